"""Milliseconds to write and read one client's state file, the pack's way and numpy's.

With ``client_state=disk`` every client call reads its client's
``<output-dir>/client-state/<partition>.npz`` when it opens its state and
writes it back when it ends. On the MLP 784-200-200-10 a FedDC client's file
holds its committed drift and control and their pending values (four
model-sized records, 3.0 MB), SCAFFOLD's its control and the pending one
(1.5 MB).

Side by side in one run, on the same records in a fresh folder:

``numpy``
    What the pack did before: ``np.savez`` to ``<stem>.tmp.npz`` from each
    ``Array``'s ``numpy()``, then ``os.replace`` over the file; reading with
    ``np.load`` and building each ``Array`` again.
``pack``
    :func:`~flwr_prox_strategies.core.client.state.write_state_file` and
    :func:`~flwr_prox_strategies.core.client.state.read_state_file`: the
    ``Array`` s' own ``.npy`` bytes as the members, the old file moved aside
    before the new one takes its name, each member read in one ``pread``.

And the parts that separate them: the rename over an existing file against
the move aside (the same bytes written with ``write_bytes``), and zipfile's
read of every member against one ``pread`` each.

Printed: the median milliseconds of 200 repetitions of each (after 20 not
timed). Both files load with ``np.load`` to the same arrays; the script
checks that, and that each read gives the records written.

Run: ``python benchmarks/state_files.py`` (about 30 s; nothing else
running). Figures: ``benchmarks/README.md``, "Client state on disk only".
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flwr_prox_strategies.core.client.state import (
    _member,
    read_state_file,
    write_state_file,
)
from flwr_prox_strategies.core.transport.records import to_array

SHAPES = [(200, 784), (200,), (200, 200), (200,), (10, 200), (10,)]
STATES = {  # algorithm -> the records its client's file holds
    "scaffold": ("scaffold-control", "pending:scaffold-control"),
    "feddc": (
        "feddc-drift",
        "feddc-control",
        "pending:feddc-drift",
        "pending:feddc-control",
    ),
}
REPEATS, WARMUP = 200, 20


def records_of(names: tuple[str, ...]) -> RecordDict:
    """Model-sized float32 records under ``names``, with a round and a run tag."""
    rng = np.random.default_rng(0)
    records = RecordDict()
    for name in names:
        arrays = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
        records[name] = ArrayRecord({str(i): to_array(a) for i, a in enumerate(arrays)})
    records["scalar:pending-round"] = ArrayRecord({"0": to_array(np.asarray(3.0))})
    records["run-tag"] = ArrayRecord(
        {"0": to_array(np.frombuffer(b"run-0123456789", dtype=np.uint8))}
    )
    return records


def numpy_write(path: Path, records: RecordDict) -> None:
    payload = {
        f"{name}\x1f{key}": array.numpy()
        for name, record in records.array_records.items()
        for key, array in record.items()
    }
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **payload)  # type: ignore[arg-type]
    os.replace(tmp, path)


def numpy_read(path: Path) -> dict[str, ArrayRecord]:
    grouped: dict[str, dict[str, Array]] = {}
    with np.load(path, allow_pickle=False) as data:
        for compound in data.files:
            name, key = compound.split("\x1f", 1)
            grouped.setdefault(name, {})[key] = to_array(data[compound])
    return {
        name: ArrayRecord({k: arrays[k] for k in sorted(arrays, key=int)})
        for name, arrays in grouped.items()
    }


def rename_over(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp.npz")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def move_aside(path: Path, data: bytes) -> None:
    tmp, old = path.with_suffix(".tmp.npz"), path.with_suffix(".old.npz")
    tmp.write_bytes(data)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    old.unlink(missing_ok=True)


def zipfile_members(path: Path) -> list[bytes]:
    with zipfile.ZipFile(path) as archive:
        return [archive.read(info) for info in archive.infolist()]


def pread_members(path: Path) -> list[bytes]:
    with path.open("rb") as file, zipfile.ZipFile(file) as archive:
        size = os.fstat(file.fileno()).st_size
        return [_member(file.fileno(), size, archive, i) for i in archive.infolist()]


def median_ms(action: Callable[[], object]) -> float:
    for _ in range(WARMUP):
        action()
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def same(a: dict[str, ArrayRecord], b: RecordDict | dict[str, ArrayRecord]) -> bool:
    records = b.array_records if isinstance(b, RecordDict) else b
    return set(a) == set(records) and all(
        list(a[n].keys()) == list(records[n].keys())
        and all(a[n][k].data == records[n][k].data for k in a[n])
        for n in a
    )


def measure(folder: Path, algorithm: str) -> tuple[float, list[float]]:
    """MB of ``algorithm``'s file and the eight medians, after checking both ways agree."""
    records = records_of(STATES[algorithm])
    ours, theirs = folder / f"{algorithm}-pack.npz", folder / f"{algorithm}-np.npz"
    write_state_file(ours, records)
    numpy_write(theirs, records)
    assert same(read_state_file(ours), records), "the pack's read differs"
    assert same(numpy_read(theirs), records), "numpy's read differs"
    with np.load(ours) as a, np.load(theirs) as b:
        assert a.files == b.files
        assert all(np.array_equal(a[k], b[k]) for k in a.files)
    data = ours.read_bytes()
    plain = folder / f"{algorithm}-bytes.npz"
    return len(data) / 2**20, [
        median_ms(lambda: numpy_write(theirs, records)),
        median_ms(lambda: write_state_file(ours, records)),
        median_ms(lambda: numpy_read(theirs)),
        median_ms(lambda: read_state_file(ours)),
        median_ms(lambda: rename_over(plain, data)),
        median_ms(lambda: move_aside(plain, data)),
        median_ms(lambda: zipfile_members(ours)),
        median_ms(lambda: pread_members(ours)),
    ]


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="state-files-"))
    columns = ("write numpy", "write pack", "read numpy", "read pack")
    columns += ("rename over", "move aside", "zipfile read", "pread")
    print(f"{'state':10}{'MB':>6}" + "".join(f"{c:>14}" for c in columns), flush=True)
    for algorithm in STATES:
        megabytes, figures = measure(folder, algorithm)
        row = "".join(f"{f:14.2f}" for f in figures)
        print(f"{algorithm:10}{megabytes:6.1f}{row}", flush=True)
    print(f"(median ms of {REPEATS}; files in {folder}, on {filesystem(folder)})")


def filesystem(folder: Path) -> str:
    """The file system type ``folder`` is on (``/proc/mounts``), or ``unknown``."""
    best, kind = "", "unknown"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            mount = fields[1] if len(fields) > 2 else None
            if mount and str(folder).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fields[2]
    return kind


if __name__ == "__main__":
    main()
