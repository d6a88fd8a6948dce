"""Fixtures of the slow system tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .engine import managed_engine


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """One managed local SuperLink for the simulation tests that leave it running.

    `flwr run` starts it on the first run and every later run reuses it (its
    start is a few seconds a test otherwise); each run brings its own
    federation config. Killed, with everything it started, at the end.
    """
    with managed_engine(tmp_path_factory.mktemp("flwr-home")) as env:
        yield env
