"""System test: SecAgg+ against a lying server's means survives a SuperNode killed
mid-protocol, on loopback.

One SuperLink and 5 SuperNodes on 127.0.0.1 run SCAFFOLD under secure
aggregation in its active-adversary setting (``secure_aggregation=secaggplus
secure_aggregation.active_adversary=true``: neighbourhoods of everyone,
threshold 3 of 5, signed keys and a signed survivor set). Every SuperNode
requires secure aggregation and holds a signing key and the key directory, all
in its node config (``secagg-required``, ``secagg-signing-key``,
``secagg-key-directory``). The run's log is streamed (``flwr log --stream``);
as soon as the server logs that round 1's nodes shared their keys, the
SuperNode with the largest partition (the slowest to train, so it is still
training) is SIGKILLed: it holds its neighbours' shares and they hold its mask
seeds, so the server must rebuild its pairwise masks from the 4 survivors'
shares to unmask round 1, after the survivors signed that they are the 4. One
round: the SuperLink takes 40 s to report the dead node.

The run must complete with every round aggregated; round 1 must count the
dead node (``secagg-dropped``) and unmask the 4 contributors' sum; the model
must learn; and the server's log must show the protocol, the consistency
check, and no plaintext array.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from flwr_prox_strategies._executables import flower_executable
from flwr_prox_strategies.experiment.config import compose_config
from flwr_prox_strategies.experiment.data import partition_sizes

from .engine import (
    REPO,
    Deployment,
    deployment,
    make_signing_keys,
    run_log,
    run_status,
)

pytestmark = pytest.mark.slow

NODES = 5
ROUNDS = 1
KILL_ROUND = 1
OVERRIDES = (
    f"strategy=scaffold secure_aggregation=secaggplus num_clients={NODES} "
    f"num_rounds={ROUNDS} model=logreg train.local_epochs=8 quorum=3 "
    "node_wait_timeout=30 secure_aggregation.active_adversary=true"
)
SHARED = re.compile(
    rf"SecAggPlus: round {KILL_ROUND}: {NODES} of {NODES} sampled nodes shared "
    "their keys"
)
# A float array printed in a log line: "array(", or a bracket opening on 4+
# floats (numpy's str, a list; "..." stands for a long array's middle).
NUMBER = r"-?\d+\.\d*(?:e[-+]?\d+)?"
PLAIN_ARRAY = re.compile(rf"array\(|\[\s*{NUMBER}(?:,?\s+(?:{NUMBER}|\.\.\.)){{3,}}")


class LogWatch:
    """``flwr log --stream`` of a run in a thread: its lines, and an event when
    a line matches ``pattern`` (or when the stream ends: the run finished)."""

    def __init__(self, run_id: str, dep: Deployment, pattern: re.Pattern[str]) -> None:
        self.lines: list[str] = []
        self.seen = threading.Event()
        self.ended = threading.Event()
        self.proc = subprocess.Popen(
            [
                flower_executable("flwr"),
                *("log", run_id, dep.connection, "--stream"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**dep.env, "PYTHONUNBUFFERED": "1"},
            cwd=REPO,
            start_new_session=True,
        )
        self.thread = threading.Thread(target=self._read, args=(pattern,), daemon=True)
        self.thread.start()

    def _read(self, pattern: re.Pattern[str]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if pattern.search(line):
                self.seen.set()
        self.ended.set()
        self.seen.set()  # wake the waiter: the line will not come

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def test_secaggplus_survives_a_node_killed_after_sharing_keys(tmp_path: Path) -> None:
    output = tmp_path / "out"
    sizes = partition_sizes(compose_config(OVERRIDES), NODES)
    victim_partition = max(range(NODES), key=lambda i: sizes[i])
    keys, trusted = make_signing_keys(tmp_path / "keys", NODES)
    start = time.monotonic()
    with deployment(
        tmp_path / "flwr",
        num_nodes=NODES,
        node_config=lambda i: (
            f'secagg-required=true secagg-signing-key="{keys[i]}" '
            f'secagg-key-directory="{trusted}"'
        ),
    ) as dep:
        started = time.monotonic() - start
        run_id = dep.submit(f"overrides='{OVERRIDES}' output-dir='{output}'")
        watch = LogWatch(run_id, dep, SHARED)
        try:
            assert watch.seen.wait(timeout=600), "round 1's key sharing not logged"
            assert not watch.ended.is_set(), (
                f"the run ended before round {KILL_ROUND}'s key sharing: "
                + "".join(watch.lines)[-3000:]
            )
            victim = dep.procs[1 + victim_partition]  # procs[0] is the SuperLink
            os.killpg(os.getpgid(victim.pid), signal.SIGKILL)
            killed_at = time.monotonic() - start
            status = dep.wait_finished(run_id, start + 900, output)
        finally:
            watch.stop()
        log = run_log(run_id, dep.env, dep.connection)
        final = run_status(run_id, dep.env, dep.connection)["status"]
    total = time.monotonic() - start
    results = json.loads((output / "results.json").read_text())
    rounds = results["rounds"]
    print(
        f"\ndeployment up in {started:.1f} s; partition {victim_partition} "
        f"({sizes[victim_partition]} examples of {sizes}) SIGKILLed at "
        f"{killed_at:.1f} s; "
        + ", ".join(
            f"r{r['round']} {r['train']['secagg-contributors']} contributors/"
            f"{r['train']['secagg-dropped']} dropped at {r['elapsed-s']:.0f} s"
            for r in rounds[1:]
        )
        + f"; accuracy {[round(r['central']['accuracy'], 3) for r in rounds]}; "
        f"all done in {total:.1f} s"
    )

    assert status == final == "finished:completed", log[-3000:]
    assert results["summary"]["complete"] is True
    assert [r["round"] for r in rounds] == list(range(ROUNDS + 1))
    # Every round aggregated: the unmasked sums reached the rule, no round kept
    # the previous model.
    assert "cannot be unmasked" not in log, log[-3000:]
    assert "keeping the previous model" not in log, log[-3000:]
    train = {r["round"]: r["train"] for r in rounds[1:]}
    # The round the node died in: it shared its keys, never sent its masked
    # vector; its masks were rebuilt from the 4 others' shares.
    assert train[KILL_ROUND]["secagg-contributors"] == NODES - 1, train[KILL_ROUND]
    assert train[KILL_ROUND]["secagg-dropped"] >= 1, train[KILL_ROUND]
    assert train[KILL_ROUND]["replies-valid"] == NODES - 1
    # Something was trained.
    accuracy = [r["central"]["accuracy"] for r in rounds]
    assert accuracy[1] > accuracy[0] + 0.5, accuracy

    # The server's log: the protocol ran, round 1 was unmasked with the
    # survivors; no line prints an array.
    for rnd, shared in ((KILL_ROUND, NODES),):
        assert (
            f"SecAggPlus: round {rnd}: {shared} of {shared} sampled nodes shared "
            "their keys" in log
        ), log[-3000:]
    assert "SecAggPlus: secure aggregation of Scaffold's sums" in log
    assert "active adversary: signed keys and survivor set" in log
    assert (
        f"round {KILL_ROUND}: consistency check: {NODES - 1} of {NODES - 1} "
        "contributors signed the survivor set" in log
    ), log[-3000:]
    plain = [line for line in log.splitlines() if PLAIN_ARRAY.search(line)]
    assert not plain, plain[:5]
