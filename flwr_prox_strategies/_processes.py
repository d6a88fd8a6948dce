"""Processes this machine's Flower engines start: free ports, process groups.

One implementation of finding and stopping what a SuperLink started (its
SuperExec, the ServerApp, Ray), for the P-FedAvg deployments and for the
experiments' own SuperLinks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path


def free_port() -> int:
    """Return a TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_cmdlines() -> dict[int, str]:
    """Return pid -> command line of every process this machine shows in /proc."""
    lines = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                raw = (entry / "cmdline").read_bytes()
                if raw:
                    lines[int(entry.name)] = raw.replace(b"\0", b" ").decode(
                        errors="replace"
                    )
    return lines


def descendants_groups(roots: set[int]) -> set[int]:
    """Return the process groups of ``roots`` and of what they started.

    Flower's SuperExecs name their parent with ``--parent-pid``; other children
    are found by their parent pid.
    """
    lines = process_cmdlines()
    pids = set(roots)
    for _ in range(3):  # SuperLink -> SuperExec -> ServerApp / ClientApp
        pids |= {
            pid
            for pid, cmd in lines.items()
            if any(f"--parent-pid {root}" in cmd for root in pids)
        }
    with contextlib.suppress(OSError):
        for line in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = line.read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) in pids:  # its parent is one of ours
                    pids.add(int(line.parent.name))
    groups = set()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(pid))
    groups.discard(os.getpgid(0))  # never our own
    return groups


def kill_groups(groups: set[int]) -> None:
    """SIGTERM, then SIGKILL, every group (Ray's and gRPC's threads ignore SIGTERM)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, sig)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(g) for g in groups):
            time.sleep(0.2)


def _alive(group: int) -> bool:
    """Return whether a process of ``group`` still runs.

    An exited one its parent has not reaped yet (a zombie, as the caller's own
    children are until it waits for them) does not count, or each stop of one's
    own children would wait out both 5 s deadlines.
    """
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    if not Path("/proc").is_dir():  # no process table to read: it may run
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # After the command's ")": state, parent pid, process group, ...
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == group and fields[0] != "Z":
                return True
    return False
