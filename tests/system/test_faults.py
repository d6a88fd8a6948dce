"""System test: nodes die, restart without their state, and join, on loopback.

One SuperLink and 3 SuperNodes on 127.0.0.1 run three runs of the pack's app at
once, SCAFFOLD, FedDyn and FedDC (the strategies that keep sums over client
states), each with its clients' state mirrored to ``<output>/client-state``, on
4 data partitions. Once every run has finished round 1, the SuperNode of
partition 1 is SIGKILLed (mid-round for runs already in round 2), its state
files are taken away (moved out of the runs' folders), and a new SuperNode for
partition 1 starts: new node id, empty ``context.state``, no file. In the
SCAFFOLD run it finds instead the file of another run (a dead run's
``state_dir``), which it must ignore with a warning. A fourth SuperNode (a new
client, partition 3) joins at the same time. (Three clients, not more: the sums
do not depend on the count, and every client is a ClientApp process a round a
run, which is where this test's time goes on 2 cores.)

Each run must complete, and at its end the server's sums must equal the sums of
what the clients hold, read from their state files and resolved with the
server's last confirmations, plus the retired state of the lost client
(SCAFFOLD's and FedDC's ``K c = sum c_i``, FedDyn's and FedDC's drift sums);
the restarted client must be detected once (no state where the server had
some: retired, not rejected as stale), and K must be 3 + 1 (the retired state)
+ 1 (the joined client).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from flwr_prox_strategies.algorithms import feddc, feddyn, scaffold
from flwr_prox_strategies.core.client.state import ClientState
from flwr_prox_strategies.experiment.build import build_model
from flwr_prox_strategies.experiment.checkpoint import CLIENT_STATE_DIR, read_checkpoint
from flwr_prox_strategies.experiment.config import compose_config
from flwr_prox_strategies.experiment.data import partition_sizes

from .engine import deployment, results_ended, rounds_done, run_log, run_status

pytestmark = pytest.mark.slow

ROUNDS = 3
NODES = 3  # SuperNodes at the start: partitions 0..NODES-1
PARTITIONS = NODES + 1  # one more for the client that joins
KILL_AFTER = 1  # round 2 loses the node, round 3 has it back and the joiner
VICTIM = 1  # partition id of the SuperNode that dies
JOINER = 3  # partition id of the client that joins
DEAD_RUN = "deadbeefdeadbeef"

# Per strategy: (client state name, what the server's sum over it is called in
# its checkpoint, whether that entry holds the mean over K (c) or the sum, and
# whether client k's term counts rho_k = n_k / mean n times: FedDC's official
# control variates upload rho_k * delta c_k, as the official code does).
SUMS = {
    "scaffold": [(scaffold.CONTROL_STATE, "control", "mean", False)],
    "feddyn": [(feddyn.DRIFT_STATE, "drift-sum", "sum", False)],
    "feddc": [
        (feddc.CONTROL_STATE, "control", "mean", True),
        (feddc.DRIFT_STATE, "drift-sum", "sum", False),
    ],
}


def overrides(name: str) -> str:
    return (
        f"strategy={name} num_clients={NODES} num_partitions={PARTITIONS} "
        f"num_rounds={ROUNDS} "
        "model=logreg train.local_epochs=1 quorum=2"
    )


def flat(arrays) -> np.ndarray:
    values = arrays.values() if isinstance(arrays, dict) else arrays
    return np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in values])


def committed(path: Path, accepted: int, name: str) -> np.ndarray | None:
    """What the client whose state file is ``path`` holds for ``name``, once the
    server's confirmation of round ``accepted`` reaches it (the two-phase commit)."""
    state = ClientState(None, state_dir=str(path.parent), client_key=path.stem)
    state.resolve(accepted)
    saved = state.get(name)
    return None if saved is None else flat(saved)


def plant_other_runs_state(folder: Path) -> None:
    """A SCAFFOLD state file of another run for client VICTIM, shaped like the model."""
    params = [
        p.detach().numpy()
        for p in build_model(compose_config(overrides("scaffold"))).parameters()
    ]
    state = ClientState(None, state_dir=str(folder), client_key=str(VICTIM))
    state.bind(DEAD_RUN, [])
    state.set(scaffold.CONTROL_STATE, [np.full_like(p, 7.0) for p in params])
    state.set_scalar("committed-round", 4.0)
    state.flush()


def test_lost_restarted_and_joining_nodes_keep_the_sums_right(tmp_path: Path) -> None:
    outputs = {name: tmp_path / name for name in SUMS}
    taken = tmp_path / "taken"  # the lost node's files, out of the runs' reach
    with deployment(
        tmp_path / "flwr", num_nodes=NODES, num_partitions=PARTITIONS
    ) as dep:
        runs = {
            name: dep.submit(f"overrides='{overrides(name)}' output-dir='{out}'")
            for name, out in outputs.items()
        }
        start = time.monotonic()
        deadline = start + 600
        asked = start
        while min(rounds_done(out) for out in outputs.values()) < KILL_AFTER:
            assert time.monotonic() < deadline, f"round {KILL_AFTER} not reached"
            # The results files say how far the runs are, and that a run ended
            # (completed or failed: it writes that last); `flwr ls` (about 2 s of
            # CPU, taken from the runs) only now and then, for a run that died
            # without writing.
            for name, out in outputs.items():
                assert not results_ended(out), (
                    f"{name} ended before round {KILL_AFTER}: "
                    + run_log(runs[name], dep.env, dep.connection)[-3000:]
                )
            if time.monotonic() - asked > 60:
                asked = time.monotonic()
                for name, run_id in runs.items():
                    status = run_status(run_id, dep.env, dep.connection)["status"]
                    assert not status.startswith("finished"), (
                        f"{name}: {status} before round {KILL_AFTER}: "
                        + run_log(run_id, dep.env, dep.connection)[-3000:]
                    )
            time.sleep(0.2)
        victim = dep.procs[1 + VICTIM]  # procs[0] is the SuperLink
        os.killpg(os.getpgid(victim.pid), signal.SIGKILL)
        killed_at = time.monotonic() - start
        rounds_at_kill = {name: rounds_done(out) for name, out in outputs.items()}
        for name, out in outputs.items():
            lost = out / CLIENT_STATE_DIR / f"{VICTIM}.npz"
            (taken / name).mkdir(parents=True)
            shutil.move(lost, taken / name / lost.name)
        plant_other_runs_state(outputs["scaffold"] / CLIENT_STATE_DIR)
        dep.start_supernode(VICTIM, PARTITIONS, folder="restarted")
        dep.start_supernode(JOINER, PARTITIONS)  # a new client joins
        status, logs = {}, {}
        for name, run_id in runs.items():
            status[name] = dep.wait_finished(run_id, deadline, outputs[name])
            logs[name] = run_log(run_id, dep.env, dep.connection)
        total = time.monotonic() - start
        restarted_log = (dep.flwr_home / "restarted" / "supernode.out").read_text()
    print(f"partition {VICTIM} SIGKILLed at {killed_at:.1f} s, rounds {rounds_at_kill}")
    for name in SUMS:
        assert status[name] == "finished:completed", logs[name][-3000:]
        rounds = json.loads((outputs[name] / "results.json").read_text())["rounds"]
        print(
            f"{name}: "
            + ", ".join(
                f"r{r['round']} {r['train']['replies-valid']}/"
                f"{r['train']['replies-failed']} at {r['elapsed-s']:.0f} s"
                for r in rounds[1:]
            )
        )
    print(f"all runs done in {total:.1f} s")

    # The other run's file was ignored by the restarted client, with a warning.
    assert f"belongs to run {DEAD_RUN}, not to this run" in restarted_log
    for name, out in outputs.items():
        checkpoint = read_checkpoint(out)
        assert checkpoint["round"] == ROUNDS
        server = checkpoint["strategy"]
        # The restarted node was detected: no state where the server had some.
        found = [
            line
            for line in logs[name].splitlines()
            if f"client {VICTIM} (node" in line and "holds no state" in line
        ]
        assert len(found) == 1, logs[name][-3000:]
        retired_round = int(
            found[0].split("last committed its round ")[1].split(":")[0]
        )
        assert server["retired-states"] == 1, name
        assert server["num-clients"] == NODES + 1 + 1, name
        assert sorted(server["client-keys-seen"]) == list(range(PARTITIONS))
        accepted = {int(k): int(v) for k, v in server["accepted"].items()}
        files = sorted((out / CLIENT_STATE_DIR).glob("*.npz"))
        assert [f.stem for f in files] == [str(k) for k in range(PARTITIONS)]
        sizes = partition_sizes(compose_config(overrides(name)), PARTITIONS)
        for state_name, entry, kind, by_size in SUMS[name]:
            rho = [n / np.mean(sizes) if by_size else 1.0 for n in sizes]
            retired = committed(
                taken / name / f"{VICTIM}.npz", retired_round, state_name
            )
            assert retired is not None
            clients = rho[VICTIM] * retired
            for f in files:
                held = committed(f, accepted.get(int(f.stem), -1), state_name)
                if held is not None:
                    clients = clients + rho[int(f.stem)] * held
            on_server = flat(server[entry])
            if kind == "mean":
                on_server = on_server * server["num-clients"]
            gap = float(np.max(np.abs(on_server - clients)))
            print(f"{name} {entry}: max |server - clients| = {gap:.2e}")
            np.testing.assert_allclose(on_server, clients, rtol=1e-5, atol=1e-6)
