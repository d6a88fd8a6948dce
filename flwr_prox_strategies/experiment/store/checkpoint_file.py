"""The checkpoint file: one per output folder, written atomically, read safely.

A checkpoint is ``<output folder>/checkpoint.npz``: numpy's zip of every array
plus, under ``__meta__``, a JSON document of everything else in which each array is
a reference (``{"$array": "a3"}``); how it is written and read safely:
``docs/howto/resume.md``.

What the encoding keeps exactly: ``None``, ``bool``, ``int``, ``float``
(NaN and infinities included), ``str``, lists, tuples, sets, dicts with any
of these as keys (a dict with non-string keys keeps them, ``{3: 7}`` comes back
as ``{3: 7}``), numpy arrays and scalars (dtype and bits), torch tensors (as
CPU tensors). Anything else is refused when the checkpoint is written, naming
where it was found.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

CHECKPOINT_FILE = "checkpoint.npz"
FORMAT = "flwr-prox-strategies checkpoint"
VERSION = 1
_META = "__meta__"
_DIGEST = "__sha256__"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, or cannot resume this run."""


def _encode(value: Any, arrays: dict[str, np.ndarray], where: str) -> Any:
    if isinstance(value, np.generic):  # before float: np.float64 is a float
        ref = f"a{len(arrays)}"
        arrays[ref] = _plain(np.asarray(value), where)
        return {"$scalar": ref}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    torch = sys.modules.get("torch")  # a tensor exists only where torch is loaded
    if torch is not None and isinstance(value, torch.Tensor):
        ref = f"a{len(arrays)}"
        arrays[ref] = _plain(value.detach().cpu().numpy(), where)
        return {"$tensor": ref}
    if isinstance(value, np.ndarray):
        ref = f"a{len(arrays)}"
        arrays[ref] = _plain(value, where)
        return {"$array": ref}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: _encode(v, arrays, f"{where}.{k}") for k, v in value.items()}
        return {
            "$dict": [
                [
                    _encode(k, arrays, f"{where}[key]"),
                    _encode(v, arrays, f"{where}.{k}"),
                ]
                for k, v in value.items()
            ]
        }
    if isinstance(value, list):
        return [_encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {
            "$tuple": [_encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]
        }
    if isinstance(value, (set, frozenset)):
        return {"$set": [_encode(v, arrays, f"{where}[item]") for v in value]}
    raise TypeError(
        f"cannot checkpoint {where}: a {type(value).__name__} (checkpoints hold "
        "numbers, strings, containers, numpy arrays and torch tensors)"
    )


def _plain(array: np.ndarray, where: str) -> np.ndarray:
    if array.dtype.hasobject:
        raise TypeError(f"cannot checkpoint {where}: an array of Python objects")
    return np.asarray(array, order="C")  # (ascontiguousarray makes 0-d arrays 1-d)


def _decode(value: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    if isinstance(value, list):
        return [_decode(v, arrays) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, body),) = value.items()
        if tag == "$array":
            return np.array(arrays[body])
        if tag == "$scalar":
            return np.array(arrays[body])[()]
        if tag == "$tensor":
            import torch  # only a checkpoint that holds a tensor needs it

            return torch.from_numpy(np.array(arrays[body]))
        if tag == "$float":
            return float(body)
        if tag == "$tuple":
            return tuple(_decode(v, arrays) for v in body)
        if tag == "$set":
            return {_decode(v, arrays) for v in body}
        if tag == "$dict":
            return {_decode(k, arrays): _decode(v, arrays) for k, v in body}
    return {k: _decode(v, arrays) for k, v in value.items()}


def _digest(meta: bytes, arrays: Mapping[str, np.ndarray]) -> bytes:
    hasher = hashlib.sha256(meta)
    for name in sorted(arrays):
        array = arrays[name]
        hasher.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
        hasher.update(array.tobytes())
    return hasher.digest()


def write_checkpoint(folder: Path, document: Mapping[str, Any]) -> Path:
    """Write ``document`` to ``<folder>/checkpoint.npz`` atomically; return the path.

    Raises
    ------
    TypeError
        When ``document`` holds a value the format cannot keep exactly.
    """
    arrays: dict[str, np.ndarray] = {}
    body = _encode(dict(document), arrays, "checkpoint")
    meta = json.dumps({"format": FORMAT, "version": VERSION, "document": body})
    meta_bytes = meta.encode()
    payload = dict(arrays)
    payload[_META] = np.frombuffer(meta_bytes, dtype=np.uint8)
    payload[_DIGEST] = np.frombuffer(_digest(meta_bytes, arrays), dtype=np.uint8)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / CHECKPOINT_FILE
    tmp = folder / (CHECKPOINT_FILE + ".tmp")
    with open(tmp, "wb") as handle:
        np.savez(handle, **payload)  # type: ignore[arg-type]
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path


def read_checkpoint(folder: Path) -> dict[str, Any]:
    """Read ``<folder>/checkpoint.npz``.

    Raises
    ------
    CheckpointError
        When the folder or the file is missing, or the file is damaged (not a
        zip, a failed CRC or SHA-256, not this format, a newer version).
    """
    if not folder.is_dir():
        raise CheckpointError(f"{folder} does not exist (or is not a folder)")
    path = folder / CHECKPOINT_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{folder} holds no {CHECKPOINT_FILE}: the run wrote none (it ended "
            "before its first checkpoint, or had checkpoint_every=0)"
        )
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
        meta_bytes = arrays.pop(_META).tobytes()
        digest = arrays.pop(_DIGEST).tobytes()
        if _digest(meta_bytes, arrays) != digest:
            raise ValueError("SHA-256 mismatch")
        meta = json.loads(meta_bytes.decode())
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as err:
        raise CheckpointError(
            f"{path} is damaged ({type(err).__name__}: {err}); it cannot be resumed"
        ) from err
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT}")
    if int(meta.get("version", 0)) > VERSION:
        raise CheckpointError(
            f"{path} has format version {meta['version']}; this pack reads up to "
            f"{VERSION}: resume it with the version of the pack that wrote it"
        )
    result = _decode(meta["document"], arrays)
    assert isinstance(result, dict)
    return result
