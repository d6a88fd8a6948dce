"""The pack's Flower app: the ServerApp and the ClientApp that ``flwr run`` starts.

``apps/server_app.py`` and ``apps/client_app.py`` (the components named in the
repository's ``pyproject.toml``) only import these objects, so the app's code
ships in the wheel and an installed pack can run its own app
(:func:`write_app_dir`, for sweeps outside a checkout).
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from ..core.adapter import to_client_app
from ..core.central import clip_when_asked
from .config import (
    RUN_NUM_ROUNDS,
    RUN_OUTPUT_DIR,
    RUN_OUTPUT_ROOT,
    RUN_OVERRIDES,
    RUN_RESUME,
    RUN_SEED,
)
from .server import make_client, run_experiment

# clip_when_asked: clients clip their update when a central-DP run asks them to.
client_app = to_client_app(make_client, mods=[clip_when_asked])

server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the experiment described by ``context.run_config`` (see pyproject)."""
    run_experiment(grid, context.run_config)


#: The run-config keys (and defaults) the app declares, as in pyproject.toml.
APP_CONFIG: dict[str, str | int] = {
    RUN_OVERRIDES: "",
    RUN_NUM_ROUNDS: 0,
    RUN_SEED: -1,
    RUN_OUTPUT_ROOT: "",
    RUN_OUTPUT_DIR: "",
    RUN_RESUME: "",
}


def app_pyproject() -> str:
    """Return the ``pyproject.toml`` of a Flower app made of this module's apps."""
    from .. import __version__

    config = "\n".join(
        f'{key} = "{value}"' if isinstance(value, str) else f"{key} = {value}"
        for key, value in APP_CONFIG.items()
    )
    return f"""\
# Written by flwr_prox_strategies.experiment.apps: the pack's Flower app, whose
# code is the installed package.
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "flwr-prox-strategies-app"
version = "{__version__}"
description = "The Flower app of flwr-prox-strategies (installed package)"
dependencies = ["flwr-prox-strategies[all]=={__version__}"]

[tool.flwr.app]
publisher = "flwr-prox-strategies"

[tool.flwr.app.components]
serverapp = "{__name__}:server_app"
clientapp = "{__name__}:client_app"

[tool.flwr.app.config]
{config}
"""


def write_app_dir(folder: Path) -> Path:
    """Write a Flower app folder (only ``pyproject.toml``) running this module's apps.

    ``flwr run <folder>`` then starts the installed pack's ServerApp and
    ClientApp: what a sweep outside a checkout runs.
    """
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(app_pyproject())
    return folder
