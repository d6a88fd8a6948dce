"""Per-client state across rounds: ``context.state``, optionally mirrored to disk.

Writes are two-phase: what an algorithm saves during round ``r`` is *pending*
and becomes the state the next round reads only once the server confirms that
its reply of round ``r`` was aggregated (:meth:`ClientState.resolve`), so the
server's sums over client states stay equal to the sums of what the clients
hold. With a ``state_dir`` the state is also written to
``<state_dir>/<client_key>.npz`` after each fit and read back into an empty
``context.state``, stamped with the run's tag (:meth:`ClientState.bind`: another
run's is ignored); with ``in_memory=False`` it lives in that file only, so a
simulation of thousands of nodes holds one client's state at a time, not every
node's. The protocol: the documentation's explanation of the two-phase commit.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from logging import ERROR, WARNING
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, RecordDict
from flwr.common.logger import log
from numpy.typing import NDArray

from ..transport.keys import (
    RUN_TAG_KEY,
    STATE_OUTSIDE_COMMIT_METRIC,
    STATE_ROUND_METRIC,
)
from ..transport.records import (
    NUMPY_STYPE,
    array_of_npy,
    to_array,
    to_ndarrays,
)
from .message import accepted_round, must_reset

_PENDING = "pending:"
_RUN_TAG = "run-tag"
# The zip format's local file header: its signature and fixed size (bytes).
_LOCAL_HEADER_SIGNATURE, _LOCAL_HEADER_SIZE = b"PK\x03\x04", 30


class ClientState:
    """Named lists of arrays kept for one client across rounds.

    A client rule's ``self.state``: it lives in the node's ``context.state``
    (kept by Flower for the whole run, in simulation and on a SuperNode), and
    optionally in ``<state_dir>/<client_key>.npz`` so that a later run can
    resume it, or in that file only (``in_memory=False``). Writes are
    two-phase: what a rule saves with :meth:`set_pending` during round ``r``
    becomes the state the next round reads (:meth:`get`,
    :meth:`get_tensors`) only once the server confirms that the reply of
    round ``r`` was aggregated, so a rejected reply or a round not aggregated
    leaves the client as it was. Saved state is stamped
    with the run's tag: another run's file is ignored.

    Parameters
    ----------
    context : Context | None
        The node's context; None gives a private, in-memory state (a client used
        outside Flower, e.g. in a unit test).
    state_dir : str | None (default: None)
        Folder that mirrors the state on disk (None: memory only); read when
        ``context.state`` is empty (a fresh run).
    client_key : str (default: "client")
        File name stem for this client in ``state_dir`` (its partition id).
    in_memory : bool (default: True)
        False keeps the state in ``state_dir`` only: it is read from the file
        when the call opens it and written back by :meth:`flush` (or
        :meth:`close`), and ``context.state`` holds none of it. In a
        simulation, Flower keeps every node's ``context.state`` in the
        simulation's process and sends it to the Ray actor and back at every
        call; on disk, memory stays at one client's state whatever the number
        of nodes, for a file read and write per call.

    Raises
    ------
    ValueError
        If ``in_memory`` is False without a ``state_dir``.
    """

    def __init__(
        self,
        context: Context | None,
        *,
        state_dir: str | None = None,
        client_key: str = "client",
        in_memory: bool = True,
    ) -> None:
        if not in_memory and not state_dir:
            raise ValueError(
                "in_memory=False keeps the client state in files only: it needs "
                "a state_dir"
            )
        self.in_memory = in_memory
        self.records: RecordDict = (
            context.state if context is not None and in_memory else RecordDict()
        )
        self.path = Path(state_dir) / f"{client_key}.npz" if state_dir else None
        if self.path is not None and not self.records.array_records:
            self._load_file(self.path)  # nothing when there is no file
        # Changed since read or written: what close() must still write.
        self._unwritten = False

    def get(self, name: str) -> list[NDArray] | None:
        """Return the committed arrays saved under ``name`` (copies), or None.

        Parameters
        ----------
        name : str
            The record's name (one of the rule's ``state_names``).

        Returns
        -------
        list[NDArray] | None
            The arrays, or None when nothing is committed under ``name``.
        """
        if name not in self.records.array_records:
            return None
        return to_ndarrays(self.records.array_records[name])

    def resolve(self, accepted_round: int | None) -> str:
        """Commit or drop the pending state; return what happened.

        ``accepted_round`` is the last round whose reply the server aggregated;
        None means the server sent no confirmation (a client used outside the
        pack's strategies): pending state is then committed.
        """
        pending_round = self.scalar("pending-round", -1.0)
        names = [n for n in self.records.array_records if n.startswith(_PENDING)]
        if not names:
            return "nothing pending"
        keep = accepted_round is None or int(pending_round) == accepted_round
        self._unwritten = True
        for name in names:
            record = self.records.array_records[name]
            del self.records[name]
            if keep:
                self.records[name[len(_PENDING) :]] = record
        if keep:
            self.set_scalar("committed-round", pending_round)
        return "committed" if keep else "dropped"

    def committed_round(self) -> int:
        """Return the round the committed state comes from (-1: none)."""
        return int(self.scalar("committed-round", -1.0))

    def reset(self, names: Sequence[str]) -> None:
        """Forget the state saved under ``names`` (committed and pending).

        Other records (a DP-SGD privacy ledger, say) stay: spent is spent.
        """
        doomed = {
            *names,
            *(_PENDING + n for n in names),
            "scalar:committed-round",
            "scalar:pending-round",
        }
        for name in [n for n in self.records.array_records if n in doomed]:
            del self.records[name]
            self._unwritten = True

    def bind(self, run_tag: str | None, names: Sequence[str]) -> str | None:
        """Tie the state to the run ``run_tag``; drop ``names`` if another run's.

        State stamped with another run's tag (a dead run's ``state_dir``), or
        holding ``names`` with no tag at all, is forgotten (as :meth:`reset`)
        and the state is stamped with ``run_tag``. Returns why the state was
        dropped, or None when it was kept (or ``run_tag`` is None: a server
        that names no run).
        """
        if not run_tag:
            return None
        held = self.get(_RUN_TAG)
        held_tag = bytes(held[0].astype(np.uint8)).decode() if held else None
        holds = {*names, *(_PENDING + n for n in names)} & set(
            self.records.array_records
        )
        reason = None
        if held_tag is not None and held_tag != run_tag:
            reason = f"belongs to run {held_tag}, not to this run ({run_tag})"
        elif held_tag is None and holds:
            reason = "names no run (written before runs were tagged, or by hand)"
        if reason is not None:
            self.reset(names)
        self.set(_RUN_TAG, [np.frombuffer(run_tag.encode(), dtype=np.uint8)])
        return reason

    def set_pending(
        self, name: str, arrays: Sequence[NDArray | torch.Tensor], server_round: int
    ) -> None:
        """Save ``arrays`` as the pending value of ``name`` for ``server_round``.

        It becomes the committed value once the server confirms that this
        round's reply was aggregated (the next round's rule reads it then).

        Parameters
        ----------
        name : str
            The record's name (one of the rule's ``state_names``).
        arrays : Sequence[NDArray | torch.Tensor]
            The values, one per trainable parameter.
        server_round : int
            The round whose reply carries them.
        """
        self.set(_PENDING + name, arrays)
        self.set_scalar("pending-round", float(server_round))

    def get_tensors(
        self, name: str, like: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Return ``name`` as tensors shaped like ``like``; zeros when absent.

        Parameters
        ----------
        name : str
            The record's name.
        like : Sequence[torch.Tensor]
            The tensors to match (the rule's ``self.params``): dtype, device
            and shape.

        Returns
        -------
        list[torch.Tensor]
            The committed values, or zeros like ``like``.

        Raises
        ------
        ValueError
            If the saved arrays do not match the model's shapes.
        """
        saved = self.get(name)
        if saved is None:
            return [torch.zeros_like(t) for t in like]
        if len(saved) != len(like) or any(
            tuple(s.shape) != tuple(t.shape) for s, t in zip(saved, like, strict=True)
        ):
            raise ValueError(f"client state '{name}' does not match the model's shapes")
        return [
            torch.as_tensor(s, dtype=t.dtype, device=t.device)
            for s, t in zip(saved, like, strict=True)
        ]

    def set(self, name: str, arrays: Sequence[NDArray | torch.Tensor]) -> None:
        """Save ``arrays`` under ``name`` at once (not two-phase).

        Parameters
        ----------
        name : str
            The record's name.
        arrays : Sequence[NDArray | torch.Tensor]
            The values.
        """
        record = ArrayRecord()
        for i, value in enumerate(arrays):
            if isinstance(value, torch.Tensor):
                value = value.detach().cpu().numpy()
            record[str(i)] = to_array(value)
        self.records[name] = record
        self._unwritten = True

    def scalar(self, name: str, default: float = 0.0) -> float:
        """Return a scalar saved with :meth:`set_scalar`."""
        values = self.get(f"scalar:{name}")
        return float(values[0]) if values else default

    def set_scalar(self, name: str, value: float) -> None:
        """Save one scalar (kept as a 0-d array beside the arrays)."""
        self.set(f"scalar:{name}", [np.asarray(value, dtype=np.float64)])

    def flush(self) -> None:
        """Write the state to ``state_dir`` (atomically) when one is set.

        With ``in_memory=False``, only when it changed since it was read or
        last written.
        """
        if self.path is None or (not self.in_memory and not self._unwritten):
            return
        write_state_file(self.path, self.records)
        self._unwritten = False

    def close(self) -> None:
        """End a call: with ``in_memory=False``, write what is not written yet.

        A call that fails midway keeps what it did (a commit, a privacy
        ledger's spending), as ``context.state`` would keep it in memory.
        """
        if not self.in_memory:
            self.flush()

    def _load_file(self, path: Path) -> None:
        for name, record in read_state_file(path).items():
            self.records[name] = record


def write_state_file(path: Path, records: RecordDict) -> None:
    r"""Write every ``ArrayRecord`` of ``records`` to ``path``, an ``.npz``; atomically.

    Each member is its ``Array``'s own ``.npy`` payload, written as it is (no
    conversion), named ``<record>\x1f<key>.npy``: ``np.load`` reads the file.
    The file it replaces is moved aside first rather than renamed over: on
    ext4, a rename over an existing file makes the kernel write the new
    file's blocks at once (``auto_da_alloc``), which took longer than the
    rest of the write in ``benchmarks/state_files.py``. A crash between the two
    moves leaves ``<stem>.old.npz``, the state before this call, which
    :func:`read_state_file` then reads (the call's reply was never sent).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = path.with_suffix(".tmp.npz"), path.with_suffix(".old.npz")
    tmp.unlink(missing_ok=True)  # a crash's leftover: truncating it costs as above
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as archive:
        for name, record in records.array_records.items():
            for key, array in record.items():
                if array.stype != NUMPY_STYPE:
                    array = to_array(array.numpy())
                archive.writestr(f"{name}\x1f{key}.npy", array.data)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    old.unlink(missing_ok=True)


def read_state_file(path: Path) -> dict[str, ArrayRecord]:
    """Read a file :func:`write_state_file` wrote: record name -> ``ArrayRecord``.

    The members' ``.npy`` payloads become the ``Array`` s as they are, keys in
    numeric order, each checked against its CRC. When ``path`` is missing,
    ``<stem>.old.npz`` (a write cut short between its two moves) is read if it
    exists; neither: nothing.

    Raises
    ------
    zipfile.BadZipFile
        If the file is not a zip, or a member's bytes fail their CRC.
    """
    if not path.is_file():
        path = path.with_suffix(".old.npz")
        if not path.is_file():
            return {}
    grouped: dict[str, dict[str, Array]] = {}
    with path.open("rb") as file, zipfile.ZipFile(file) as archive:
        size = os.fstat(file.fileno()).st_size
        for info in archive.infolist():
            name, key = info.filename.removesuffix(".npy").split("\x1f", 1)
            payload = _member(file.fileno(), size, archive, info)
            grouped.setdefault(name, {})[key] = array_of_npy(payload)
    return {
        name: ArrayRecord({key: arrays[key] for key in sorted(arrays, key=int)})
        for name, arrays in grouped.items()
    }


def _member(
    fd: int, size: int, archive: zipfile.ZipFile, info: zipfile.ZipInfo
) -> bytes:
    """Return a stored member's bytes, read in one ``pread`` (others: zipfile's read).

    zipfile reads a member through buffers of its own and takes about a fifth
    longer (``benchmarks/state_files.py``). A member the file's ``size``
    (bytes) cannot hold is refused before anything is allocated for it.
    """
    if info.header_offset + info.file_size > size:
        raise zipfile.BadZipFile(f"{info.filename!r} overruns {archive.filename}")
    local = os.pread(fd, _LOCAL_HEADER_SIZE, info.header_offset)
    stored = info.compress_type == zipfile.ZIP_STORED
    if not stored or local[:4] != _LOCAL_HEADER_SIGNATURE:
        return archive.read(info)
    name_size, extra_size = struct.unpack("<HH", local[26:30])
    start = info.header_offset + _LOCAL_HEADER_SIZE + name_size + extra_size
    data = os.pread(fd, info.file_size, start)
    if len(data) != info.file_size or zlib.crc32(data) != info.CRC:
        raise zipfile.BadZipFile(f"bad CRC for {info.filename!r} in {archive.filename}")
    return data


class RoundCommit:
    """One round of a stateful rule's two-phase commit, from the message to the reply.

    Opening it applies what the server said (the run the state belongs to, a
    reset, the last round of this client's it aggregated) before the rule
    reads its state; at the reply it says which state records the rule saved
    outside the commit.

    Parameters
    ----------
    state : ClientState
        The client's state.
    names : Sequence[str]
        The rule's state records (``state_names``).
    config : Mapping[str, Any]
        This round's train config.
    client_key : int
        The client's stable id.
    rule : str
        The rule's name (in logs).
    """

    def __init__(
        self,
        state: ClientState,
        names: Sequence[str],
        config: Mapping[str, Any],
        *,
        client_key: int,
        rule: str,
    ) -> None:
        self.state, self.names = state, tuple(names)
        self.client_key, self.rule = client_key, rule
        self._warned = False
        dropped = state.bind(config.get(RUN_TAG_KEY), self.names)
        if dropped is not None:
            log(
                WARNING,
                "client %d: its saved state (%s) %s; ignored, the client "
                "starts afresh and the server accounts for it",
                client_key,
                state.path or "context.state",
                dropped,
            )
        if must_reset(config, client_key):
            state.reset(self.names)
        state.resolve(accepted_round(config, client_key))
        # A record replaced before the reply was saved outside the commit.
        self.at_start = {n: state.records.array_records.get(n) for n in self.names}

    def saved_outside(self) -> list[str]:
        """Return the state records saved with ``state.set`` this round.

        A record committed now that was not when the round began (or was
        another) was written with :meth:`ClientState.set`, which commits at
        once: a reply the server then rejects would still change the client.
        """
        records = self.state.records.array_records
        return [
            name
            for name in self.names
            if records.get(name) is not None
            and records.get(name) is not self.at_start.get(name)
        ]

    def metrics(self) -> dict[str, Any]:
        """Return ``state-round`` and ``state-outside-commit`` (logged once if > 0)."""
        outside = self.saved_outside()
        if outside and not self._warned:
            self._warned = True
            log(
                ERROR,
                "client %d: %s saved its state %s with state.set, which commits "
                "at once (a reply the server rejects would still change the "
                "client): save it with self.state.set_pending(name, arrays, "
                "self.server_round) in finish()",
                self.client_key,
                self.rule,
                outside,
            )
        return {
            STATE_ROUND_METRIC: self.state.committed_round(),
            STATE_OUTSIDE_COMMIT_METRIC: len(outside),
        }
