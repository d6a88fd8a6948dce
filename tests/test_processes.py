"""The pack's process-group helpers (:mod:`flwr_prox_strategies._processes`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from flwr_prox_strategies._processes import kill_groups

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc"
)


def test_a_stopped_group_of_ones_own_unreaped_child_is_not_waited_for() -> None:
    # The child exits on SIGTERM but stays a zombie until waited for: the
    # group is dead then, not 10 s later (both deadlines).
    child = subprocess.Popen(["sleep", "100"], start_new_session=True)
    start = time.monotonic()
    kill_groups({os.getpgid(child.pid)})
    assert time.monotonic() - start < 3
    assert child.wait(timeout=5) == -15  # SIGTERM was enough


def test_a_group_that_ignores_sigterm_is_killed() -> None:
    child = subprocess.Popen(
        ["bash", "-c", 'trap "" TERM; sleep 100 & wait'], start_new_session=True
    )
    time.sleep(0.3)  # (bash set its trap)
    start = time.monotonic()
    kill_groups({os.getpgid(child.pid)})
    assert child.wait(timeout=5) == -9  # SIGTERM's 5 s, then SIGKILL
    assert 5 <= time.monotonic() - start < 8
