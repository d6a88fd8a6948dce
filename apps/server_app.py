"""The ServerApp `flwr run .` starts: compose conf/, run, write results."""

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from flwr_prox_strategies.experiment.server import run_experiment

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the experiment described by ``context.run_config`` (see pyproject)."""
    run_experiment(grid, context.run_config)
