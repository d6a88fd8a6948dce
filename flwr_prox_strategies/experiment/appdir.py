"""The pack's Flower app described, not started: its parts, its run config, its folder.

:mod:`.apps` is a Flower entry point (``flwr run`` imports it to get the
ServerApp and the ClientApp) and nothing in the pack imports it
(``[tool.importlinter]`` in ``pyproject.toml``). What the rest of the pack needs
of the app lives here instead:

* :func:`make_client_app`, the ClientApp, which :mod:`.apps` exposes and the
  in-process engine of a sweep (``engine=inprocess``) runs;
* :data:`APP_CONFIG`, the run-config keys the app declares;
* :func:`write_app_dir`, a Flower app folder whose ``pyproject.toml`` names the
  installed package's apps by their dotted names (:data:`SERVER_APP`,
  :data:`CLIENT_APP`), for sweeps outside a checkout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from flwr.clientapp import ClientApp

from . import (
    RUN_NUM_ROUNDS,
    RUN_OUTPUT_DIR,
    RUN_OUTPUT_ROOT,
    RUN_OVERRIDES,
    RUN_RESUME,
    RUN_SEED,
)

if TYPE_CHECKING:
    from flwr.app import Context
    from flwr.client import NumPyClient

#: The module ``flwr run`` imports for the pack's apps, and the components in it.
APP_MODULE = "flwr_prox_strategies.experiment.apps"
SERVER_APP = f"{APP_MODULE}:server_app"
CLIENT_APP = f"{APP_MODULE}:client_app"

#: The run-config keys (and defaults) the app declares, as in pyproject.toml.
APP_CONFIG: dict[str, str | int] = {
    RUN_OVERRIDES: "",
    RUN_NUM_ROUNDS: 0,
    RUN_SEED: -1,
    RUN_OUTPUT_ROOT: "",
    RUN_OUTPUT_DIR: "",
    RUN_RESUME: "",
}


def make_client_app() -> ClientApp:
    """Return the pack's ClientApp: the configured client on this node's partition.

    Returns
    -------
    ClientApp
        :func:`~.server.make_client` mounted by
        :func:`~flwr_prox_strategies.to_client_app`, with the mod that clips a
        client's update when a central-DP run asks for it. Its
        :class:`~flwr_prox_strategies.SecAggPlusMod` is required when the
        run's configuration sets ``secure_aggregation`` (or the SuperNode's
        ``secagg-required``): a server that then sends a plain train message
        gets no update. The client's code (torch, the model, the data) is
        imported at the first message that needs the client, not when the app
        is loaded.
    """
    # Imported here: writing an app folder needs no client machinery.
    from ..core.client.adapter import to_client_app
    from ..core.client.secagg import SecAggPlusMod
    from ..core.privacy.uploads import clip_when_asked

    return to_client_app(
        _make_client,
        mods=[SecAggPlusMod(required=_secure_aggregation_configured), clip_when_asked],
        secure_aggregation=False,  # the mod above, outermost
    )


def _secure_aggregation_configured(context: Context) -> bool:
    # Asked at a plain train message, which builds the client next: the
    # composed configuration is the one the client is built from (cached).
    from .build import client_recipe

    return client_recipe(context.run_config).cfg.get("secure_aggregation") is not None


def _make_client(context: Context) -> NumPyClient:
    # Imported at the first message that needs the client: the key-exchange
    # stages of secure aggregation are answered by a mod, without torch, Hydra,
    # the model or the data code (a SuperNode starts a process per message).
    from .server import make_client

    return make_client(context)


def flower_app_pyproject(
    *,
    name: str,
    version: str,
    dependencies: Sequence[str],
    server_app: str,
    client_app: str,
    config: Mapping[str, str | int],
    description: str | None = None,
) -> str:
    """Return the ``[project]`` and ``[tool.flwr.app]`` tables of a Flower app.

    Parameters
    ----------
    name, version, dependencies : str, str, Sequence[str]
        The ``[project]``'s.
    server_app, client_app : str
        The components, ``"module:attribute"``.
    config : Mapping[str, str | int]
        The run config's keys and defaults (a string is quoted).
    description : str | None (default: None)
        The project's description, if any.

    Returns
    -------
    str
        The ``pyproject.toml`` text (publisher ``flwr-prox-strategies``).
    """
    about = "" if description is None else f'description = "{description}"\n'
    needs = ", ".join(f'"{dependency}"' for dependency in dependencies)
    values = "\n".join(
        f'{key} = "{value}"' if isinstance(value, str) else f"{key} = {value}"
        for key, value in config.items()
    )
    return f"""\
[project]
name = "{name}"
version = "{version}"
{about}dependencies = [{needs}]

[tool.flwr.app]
publisher = "flwr-prox-strategies"

[tool.flwr.app.components]
serverapp = "{server_app}"
clientapp = "{client_app}"

[tool.flwr.app.config]
{values}
"""


def app_pyproject() -> str:
    """Return the ``pyproject.toml`` of a Flower app made of the installed apps.

    Returns
    -------
    str
        A pyproject whose components are :data:`SERVER_APP` and
        :data:`CLIENT_APP` and whose run config is :data:`APP_CONFIG`.
    """
    from .. import __version__

    header = f"""\
# Written by {__name__}: the pack's Flower app, whose code is the installed package.
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

"""
    return header + flower_app_pyproject(
        name="flwr-prox-strategies-app",
        version=__version__,
        description="The Flower app of flwr-prox-strategies (installed package)",
        dependencies=[f"flwr-prox-strategies[all]=={__version__}"],
        server_app=SERVER_APP,
        client_app=CLIENT_APP,
        config=APP_CONFIG,
    )


def write_app_dir(folder: Path) -> Path:
    """Write a Flower app folder (only ``pyproject.toml``) running the installed apps.

    ``flwr run <folder>`` then starts the installed pack's ServerApp and
    ClientApp: what a sweep outside a checkout runs.

    Parameters
    ----------
    folder : Path
        Created if missing; its ``pyproject.toml`` is overwritten.

    Returns
    -------
    Path
        ``folder``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(app_pyproject())
    return folder
