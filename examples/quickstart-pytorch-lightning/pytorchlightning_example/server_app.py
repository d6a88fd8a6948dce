"""pytorchlightning_example: A Flower / PyTorch Lightning app.

Adapted from Flower's examples/quickstart-pytorch-lightning (Copyright Flower
Labs GmbH, Apache License 2.0; see NOTICE at the root of this repository).
"""

import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from flwr_prox_strategies import FedAvg, FedDC, FedDyn, FedProx, Scaffold
from pytorchlightning_example.task import LitAutoEncoder

# Create ServerApp
app = ServerApp()


def make_strategy(context: Context):
    """Return the pack's strategy that the run config's `algorithm` names."""
    config = context.run_config
    fractions = {"fraction_train": 0.5, "fraction_evaluate": 0.5}
    strategies = {
        "fedavg": lambda: FedAvg(**fractions),
        "fedprox": lambda: FedProx(proximal_mu=config["proximal-mu"], **fractions),
        "feddyn": lambda: FedDyn(alpha=config["feddyn-alpha"], **fractions),
        "scaffold": lambda: Scaffold(**fractions),
        "feddc": lambda: FedDC(alpha=config["feddc-alpha"], **fractions),
    }
    if config["algorithm"] not in strategies:
        raise ValueError(
            f"algorithm={config['algorithm']!r}; choose one of {list(strategies)}"
        )
    return strategies[config["algorithm"]]()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the main entry point for the ServerApp."""
    # Read run config
    num_rounds: int = context.run_config["num-server-rounds"]

    # Load global model
    torch.manual_seed(context.run_config["seed"])
    global_model = LitAutoEncoder()
    arrays = ArrayRecord(global_model.state_dict())

    # Initialize the strategy the run config selects
    strategy = make_strategy(context)

    # Start strategy, run it for `num_rounds`
    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        num_rounds=num_rounds,
    )

    # Save final model to disk
    print("\nSaving final model to disk...")
    state_dict = result.arrays.to_torch_state_dict()
    torch.save(state_dict, context.run_config["output-path"])
