"""The pack's Flower app: the ServerApp and the ClientApp that ``flwr run`` starts.

A Flower entry point, imported by ``flwr run`` only: ``apps/server_app.py`` and
``apps/client_app.py`` (the components named in the repository's
``pyproject.toml``) re-export these objects, and the app folder a sweep writes
outside a checkout names them directly (:mod:`.appdir`). Nothing in the pack
imports this module (``[tool.importlinter]``); what others need of the app
(the ClientApp's factory, the run-config keys, the app folder) is in
:mod:`.appdir`.
"""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from .appdir import make_client_app

client_app = make_client_app()

server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the experiment described by ``context.run_config`` (see pyproject)."""
    # Imported here: a SuperNode imports this module for the ClientApp, and the
    # server's pipeline (Hydra, torch, every algorithm) is not for it to load.
    from .server import run_experiment

    run_experiment(grid, context.run_config)
