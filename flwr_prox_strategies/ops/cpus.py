"""The CPUs this process may run on: what a run's threads are sized from."""

from __future__ import annotations

import os


def available_cpus() -> int:
    """Return the CPUs this process may run on (affinity mask, else the count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity masks
        return os.cpu_count() or 1
