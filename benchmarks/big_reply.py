"""A 500 MB hostile reply on a real loopback deployment: its memory cost, its fate.

One SuperLink and 2 SuperNodes on 127.0.0.1 (tests/system/engine.py starts and
stops them by process group) run a tiny Flower app written to a temporary
folder: its ServerApp is the pack's FedAvg (one round, a 4 KB model, default
max_reply_bytes), its ClientApp answers honestly on partition 1 and, on
partition 0, sends the received keys back with the first array replaced by
--reply-mb MB (10^6 bytes) of float32. Three cases, each on a fresh deployment:
an honest reply from node 0 (baseline), a random big reply, and a big reply of
zeros (Flower sends and stores identical 5 MiB chunks once). Every 0.2 s the
script samples VmHWM/VmRSS of the SuperLink, the ServerApp (`flwr-serverapp`),
SuperNode 0 and its `flwr-clientapp`, and the size of the SuperLink's database
(state.db, -wal, -shm; deleted after each case). Prints a table (MiB); exits
non-zero if a run did not complete or a big reply was not refused (too-large).

    python benchmarks/big_reply.py [--reply-mb 500]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flwr_prox_strategies._executables import flower_executable
from flwr_prox_strategies.experiment.appdir import flower_app_pyproject
from tests.system.engine import deployment, run_log, run_status

APP = """
import json
import time
import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr_prox_strategies import FedAvg
client = ClientApp()
server = ServerApp()

@client.train()
def train(msg: Message, context: Context) -> Message:
    arrays = msg.content["arrays"]
    mb = int(context.run_config["reply-mb"])
    if context.node_config["partition-id"] == 0 and mb > 0:
        n = mb * 250_000  # float32
        big = (np.zeros(n, np.float32) if context.run_config["fill"] == "zeros"
               else np.random.default_rng(0).standard_normal(n, np.float32))
        arrays = ArrayRecord({k: Array(big) if i == 0 else arrays[k]
                              for i, k in enumerate(arrays)})
    content = RecordDict({"arrays": arrays,
                          "metrics": MetricRecord({"num-examples": 10})})
    return Message(content=content, reply_to=msg)

@server.main()
def main(grid: Grid, context: Context) -> None:
    start = time.monotonic()
    model = ArrayRecord([np.ones((100, 10), np.float32), np.zeros(10, np.float32)])
    strategy = FedAvg(min_available_nodes=2, fraction_evaluate=0.0)
    result = strategy.start(grid=grid, initial_arrays=model, num_rounds=1)
    counts = {k: float(v) for k, v in result.train_metrics_clientapp[1].items()
              if k.startswith("replies-")}
    log(20, "BIGREPLY %s", json.dumps({"round-s": time.monotonic() - start, **counts}))
"""

PYPROJECT = flower_app_pyproject(
    name="big-reply",
    version="1.0.0",
    dependencies=["flwr-prox-strategies"],
    server_app="big_reply_app:server",
    client_app="big_reply_app:client",
    config={"reply-mb": 0, "fill": "random"},
)

ROLES = ("superlink", "serverapp", "supernode 0", "clientapp 0")


def find_roles(link: int, node: int) -> dict[str, list[int]]:
    """Our processes per role. The ServerApp and the ClientApps are found by
    command line among the descendants of the SuperLink (SuperNode 0) or of the
    SuperExec it starts with --parent-pid."""
    parent, cmd = {}, {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, TypeError, ValueError):
            pid = int(entry.name)
            status = (entry / "status").read_text()
            parent[pid] = int(re.search(r"PPid:\s+(\d+)", status)[1])
            cmd[pid] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()

    def under(pid: int, root: int) -> bool:
        while pid > 1:
            if pid == root or f"--parent-pid {root} " in cmd.get(pid, "") + " ":
                return True
            pid = parent.get(pid, 0)
        return False

    found = {"superlink": [link], "supernode 0": [node]}
    for role, name, root in (
        ("serverapp", "flwr-serverapp", link),
        ("clientapp 0", "flwr-clientapp", node),
    ):
        found[role] = [p for p, line in cmd.items() if name in line and under(p, root)]
    return found


def memory_mb(pid: int) -> list[float]:
    """VmHWM (peak RSS) and VmRSS of ``pid`` in MiB (none if it is gone)."""
    with contextlib.suppress(OSError):
        text = Path(f"/proc/{pid}/status").read_text()
        return [int(kb) / 1024 for kb in re.findall(r"Vm(?:HWM|RSS):\s+(\d+)", text)]
    return []


def db_mb(home: Path) -> float:
    """Size of the SuperLink's database (state.db, -wal, -shm) in MiB."""
    size = 0
    for path in (home / "superlink").glob("state.db*"):
        with contextlib.suppress(OSError):  # removed meanwhile
            size += path.stat().st_size
    return size / 2**20


def run_case(home: Path, app: Path, mb: int, fill: str) -> dict:
    peaks = dict.fromkeys((*ROLES, "db"), 0.0)
    with deployment(home, num_nodes=2) as dep:
        link, node = dep.procs[0].pid, dep.procs[1].pid
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                for role, pids in find_roles(link, node).items():
                    for pid in pids:
                        peaks[role] = max(peaks[role], *memory_mb(pid), 0.0)
                peaks["db"] = max(peaks["db"], db_mb(home))
                time.sleep(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        start = time.monotonic()
        command = [
            flower_executable("flwr"),
            "run",
            str(app),
            dep.connection,
            "--format",
            "json",
        ]
        config = ["--run-config", f"reply-mb={mb} fill='{fill}'"]
        out = subprocess.run(
            command + config, capture_output=True, text=True, env=dep.env, check=True
        )
        run_id = str(json.loads(out.stdout)["run-id"])
        status = ""
        while time.monotonic() - start < 900:
            status = run_status(run_id, dep.env, dep.connection)["status"]
            if status.startswith("finished"):
                break
            time.sleep(1)
        wall = time.monotonic() - start
        done.set()
        sampler.join()
        log = run_log(run_id, dep.env, dep.connection)
        db = db_mb(home)
    (home / "run.log").write_text(log)
    for path in (home / "superlink").glob("state.db*"):
        path.unlink()  # up to 1 GB each: keep only the run log
    found = re.search(r"BIGREPLY (\{.*?\})", log)
    counts = json.loads(found[1]) if found else {}
    return {
        "case": "honest" if mb == 0 else f"{mb} MB {fill}",
        "status": status,
        "refused (too-large)": "not used (too-large)" in log,
        "valid": int(counts.get("replies-valid", -1)),
        "rejected": int(counts.get("replies-rejected", -1)),
        "round s": counts.get("round-s", float("nan")),
        "wall s": wall,
        **{f"{role} MB": peaks[role] for role in ROLES},
        "db MB (peak)": f"{db:.0f} ({peaks['db']:.0f})",
        "log": str(home / "run.log"),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reply-mb", type=int, default=500)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bigreply", dir="/tmp"))
    app = root / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text(PYPROJECT)
    (app / "big_reply_app.py").write_text(APP)
    cases = [(0, "random"), (args.reply_mb, "random"), (args.reply_mb, "zeros")]
    rows = [
        run_case(root / f"flwr{i}", app, mb, fill) for i, (mb, fill) in enumerate(cases)
    ]
    keys = [k for k in rows[0] if k != "log"]
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows:
        cells = [f"{row[k]:.1f}" if isinstance(row[k], float) else row[k] for k in keys]
        print("| " + " | ".join(map(str, cells)) + f" |  ({row['log']})")
    bad = [r["case"] for r in rows if r["status"] != "finished:completed"]
    bad += [r["case"] for r in rows[1:] if not r["refused (too-large)"]]
    bad += [r["case"] for r in rows[1:] if r["rejected"] < 1 or r["valid"] != 1]
    if bad:
        raise SystemExit(f"not completed, or the big reply not refused: {bad}")


if __name__ == "__main__":
    main()
