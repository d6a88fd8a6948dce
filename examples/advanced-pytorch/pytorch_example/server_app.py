"""pytorch-example: A Flower / PyTorch app.

Adapted from Flower's examples/advanced-pytorch (Copyright Flower Labs GmbH,
Apache License 2.0; see NOTICE at the root of this repository).
"""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from torch.utils.data import DataLoader

from pytorch_example.strategy import STRATEGIES
from pytorch_example.task import (
    Net,
    apply_eval_transforms,
    create_run_dir,
    load_fashion_mnist_split,
    test,
)

# Create ServerApp
app = ServerApp()


def make_strategy(context: Context, fraction_train: float, fraction_evaluate: float):
    """Return the custom strategy on the pack's strategy `algorithm` names."""
    config = context.run_config
    algorithm = str(config["algorithm"])
    if algorithm not in STRATEGIES:
        raise ValueError(f"algorithm={algorithm!r}; choose one of {list(STRATEGIES)}")
    options = {
        "fedprox": {"proximal_mu": config["proximal-mu"]},
        "feddyn": {"alpha": config["feddyn-alpha"]},
    }.get(algorithm, {})
    return STRATEGIES[algorithm](
        fraction_train=fraction_train, fraction_evaluate=fraction_evaluate, **options
    )


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the main entry point for the ServerApp."""
    # Read run config
    num_rounds = context.run_config["num-server-rounds"]
    fraction_train = context.run_config["fraction-train"]
    fraction_eval = context.run_config["fraction-evaluate"]
    device = context.run_config["server-device"]
    lr = context.run_config["learning-rate"]

    # Load global model
    torch.manual_seed(context.run_config["seed"])
    global_model = Net()
    arrays = ArrayRecord(global_model.state_dict())

    # Initialize the strategy the run config selects
    strategy = make_strategy(context, fraction_train, fraction_eval)
    if context.run_config["use-wandb"]:
        strategy.use_wandb()

    # Define directory for results and save config
    save_path, run_dir = create_run_dir(config=context.run_config)
    strategy.set_save_path_and_run_dir(save_path, run_dir)

    # Start strategy, run it for `num_rounds`
    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": lr}),
        num_rounds=num_rounds,
        evaluate_fn=get_global_evaluate_fn(
            device=device,
            data_dir=context.run_config["data-dir"],
            num_images=context.run_config["num-test-images"],
        ),
    )

    # Save final model to disk (in the run's folder: runs side by side)
    print("\nSaving final model to disk...")
    state_dict = result.arrays.to_torch_state_dict()
    torch.save(state_dict, save_path / "final_model.pt")


def get_global_evaluate_fn(device: str, data_dir: str = "", num_images: int = 0):
    """Return an evaluation function for server-side evaluation."""

    def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Evaluate model on central data."""
        # The same Fashion-MNIST files as the clients read, not partitioned: the
        # "test" split only
        global_test_set = load_fashion_mnist_split("test", data_dir, num_images)

        testloader = DataLoader(
            global_test_set.with_transform(apply_eval_transforms),
            batch_size=32,
        )

        net = Net()
        net.load_state_dict(arrays.to_torch_state_dict())
        net.to(device)
        loss, accuracy = test(net, testloader, device=device)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    return global_evaluate
