"""pytorchexample: A Flower / PyTorch app.

Adapted from Flower's examples/quickstart-pytorch (Copyright Flower Labs GmbH,
Apache License 2.0; see NOTICE at the root of this repository).
"""

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_prox_strategies import (
    ClientRule,
    FedDCRule,
    FedDynRule,
    FedProxRule,
    ScaffoldRule,
    SecAggPlusMod,
)
from pytorchexample.task import Net, load_data
from pytorchexample.task import test as test_fn
from pytorchexample.task import train as train_fn

# The client side of each algorithm the run config can select
RULES = {
    "fedavg": ClientRule,
    "fedprox": FedProxRule,
    "feddyn": FedDynRule,
    "scaffold": ScaffoldRule,
    "feddc": FedDCRule,
}

# Flower ClientApp
# (the mod answers a server running SecAggPlus, and passes everything else on)
app = ClientApp(mods=[SecAggPlusMod()])


@app.train()
def train(msg: Message, context: Context):
    """Train the model on local data."""
    # Load the model and initialize it with the received weights
    model = Net()
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model.to(device)
    rule = RULES[context.run_config["algorithm"]].from_message(msg, context, model)

    # Load the data
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    batch_size = context.run_config["batch-size"]
    seed = context.run_config["seed"]
    trainloader, _ = load_data(partition_id, num_partitions, batch_size, seed)

    # Call the training function
    train_loss = train_fn(
        model,
        trainloader,
        context.run_config["local-epochs"],
        msg.content["config"]["lr"],
        device,
        rule,
    )

    # Construct and return reply Message (with the records the strategy expects)
    return rule.reply(
        num_examples=len(trainloader.dataset), metrics={"train_loss": train_loss}
    )


@app.evaluate()
def evaluate(msg: Message, context: Context):
    """Evaluate the model on local data."""
    # Load the model and initialize it with the received weights
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model.to(device)

    # Load the data
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    batch_size = context.run_config["batch-size"]
    _, valloader = load_data(partition_id, num_partitions, batch_size)

    # Call the evaluation function
    eval_loss, eval_acc = test_fn(
        model,
        valloader,
        device,
    )

    # Construct and return reply Message
    metrics = {
        "eval_loss": eval_loss,
        "eval_acc": eval_acc,
        "num-examples": len(valloader.dataset),
    }
    metric_record = MetricRecord(metrics)
    content = RecordDict({"metrics": metric_record})
    return Message(content=content, reply_to=msg)
