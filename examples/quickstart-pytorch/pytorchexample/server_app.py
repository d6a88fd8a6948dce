"""pytorchexample: A Flower / PyTorch app.

Adapted from Flower's examples/quickstart-pytorch (Copyright Flower Labs GmbH,
Apache License 2.0; see NOTICE at the root of this repository).
"""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from flwr_prox_strategies import FedAvg, FedDC, FedDyn, FedProx, Scaffold, SecAggPlus
from pytorchexample.task import Net, load_centralized_dataset, test

# Create ServerApp
app = ServerApp()


def make_strategy(context: Context, fraction_evaluate: float):
    """Return the pack's strategy that the run config's `algorithm` names."""
    config = context.run_config
    strategies = {
        "fedavg": lambda: FedAvg(fraction_evaluate=fraction_evaluate),
        "fedprox": lambda: FedProx(
            proximal_mu=config["proximal-mu"], fraction_evaluate=fraction_evaluate
        ),
        "feddyn": lambda: FedDyn(
            alpha=config["feddyn-alpha"], fraction_evaluate=fraction_evaluate
        ),
        "scaffold": lambda: Scaffold(fraction_evaluate=fraction_evaluate),
        "feddc": lambda: FedDC(
            alpha=config["feddc-alpha"], fraction_evaluate=fraction_evaluate
        ),
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
    fraction_evaluate: float = context.run_config["fraction-evaluate"]
    num_rounds: int = context.run_config["num-server-rounds"]
    lr: float = context.run_config["learning-rate"]

    # Load global model
    torch.manual_seed(context.run_config["seed"])
    global_model = Net()
    arrays = ArrayRecord(global_model.state_dict())

    # Initialize the strategy the run config selects
    strategy = make_strategy(context, fraction_evaluate)
    if context.run_config["secure-aggregation"]:
        strategy = SecAggPlus(strategy)

    # Start strategy, run it for `num_rounds`
    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": lr}),
        num_rounds=num_rounds,
        evaluate_fn=global_evaluate,
    )

    # Save final model to disk
    print("\nSaving final model to disk...")
    state_dict = result.arrays.to_torch_state_dict()
    torch.save(state_dict, context.run_config["output-path"])


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Evaluate model on central data."""
    # Load the model and initialize it with the received weights
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model.to(device)

    # Load entire test set
    test_dataloader = load_centralized_dataset()

    # Evaluate the global model on the test set
    test_loss, test_acc = test(model, test_dataloader, device)

    # Return the evaluation metrics
    return MetricRecord({"accuracy": test_acc, "loss": test_loss})
