"""Flower's command-line tools, found in the Python environment that runs the pack.

A virtualenv's ``python`` can run without the virtualenv being activated, so its
``bin/`` folder (where pip put ``flwr``, ``flower-superlink`` and
``flower-supernode``) need not be on ``PATH``. Flower starts its own processes
by name (``flwr run`` starts ``flower-superlink``, which starts
``flower-superexec``, ...), so the environment handed to Flower needs that folder
on ``PATH`` too: :func:`flower_env` puts it first.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

#: Where this interpreter's console scripts are installed.
SCRIPTS_DIR = Path(sys.executable).parent


def flower_executable(name: str) -> str:
    """Return the path of Flower's command ``name`` for this Python environment.

    The command beside ``sys.executable`` comes first (the environment running
    the pack), then ``PATH``.

    Parameters
    ----------
    name : str
        ``"flwr"``, ``"flower-superlink"``, ``"flower-supernode"``, ...

    Raises
    ------
    FileNotFoundError
        When neither has it, with the command that installs it.
    """
    beside = SCRIPTS_DIR / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(
            f"Flower's command {name!r} is neither beside {sys.executable} nor on "
            f"PATH. Install Flower into this Python: {sys.executable} -m pip "
            "install 'flwr-prox-strategies[experiment]' (or activate the "
            "virtualenv that has it)."
        )
    return found


def flower_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return ``base`` (default: ``os.environ``) with this Python's scripts first.

    Flower starts its own processes by name: with this folder first on ``PATH``
    they are this environment's.
    """
    env = dict(os.environ if base is None else base)
    path = env.get("PATH", "")
    if path.split(os.pathsep)[0] != str(SCRIPTS_DIR):
        env["PATH"] = os.pathsep.join(p for p in (str(SCRIPTS_DIR), path) if p)
    return env
