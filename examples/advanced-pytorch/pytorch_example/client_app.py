"""pytorch-example: A Flower / PyTorch app.

Adapted from Flower's examples/advanced-pytorch (Copyright Flower Labs GmbH,
Apache License 2.0; see NOTICE at the root of this repository).
"""

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_prox_strategies import ClientRule, FedDynRule, FedProxRule, ScaffoldRule
from pytorch_example.task import Net, load_data
from pytorch_example.task import test as test_fn
from pytorch_example.task import train as train_fn

# The client side of each algorithm the run config can select
RULES = {
    "fedavg": ClientRule,
    "fedprox": FedProxRule,
    "scaffold": ScaffoldRule,
    "feddyn": FedDynRule,
}

# Flower ClientApp
app = ClientApp()
classification_head_name = "classification-head"


def save_layer_weights_to_state(state: RecordDict, net: Net):
    """Save last layer weights to state."""
    state[classification_head_name] = ArrayRecord(net.fc2.state_dict())


def load_layer_weights_from_state(state: RecordDict, net: Net):
    """Load last layer weights from state and applies them to the model."""
    if classification_head_name not in state:
        return

    # Restore this client's saved classification head
    state_dict = state[classification_head_name].to_torch_state_dict()
    net.fc2.load_state_dict(state_dict, strict=True)


@app.train()
def train(msg: Message, context: Context):
    """Train the model on local data."""
    # Load model and apply received weights (the rule loads them: move the
    # model to its device first, the rule anchors its parameters)
    model = Net()
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model.to(device)
    # The algorithm's rule; `client-rule` names another one (a deliberate mistake)
    rule_name = context.run_config["client-rule"] or context.run_config["algorithm"]
    rule = RULES[str(rule_name)].from_message(msg, context, model)
    # Restore this client's previously saved classification layer weights
    # (no action if this is the first round it participates in)
    load_layer_weights_from_state(context.state, model)

    # Load the data
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    # The same batches and augmentations in every run with this seed
    server_round = msg.content["config"]["server-round"]
    seed = [context.run_config["seed"], partition_id, server_round]
    torch.manual_seed(int(np.random.SeedSequence(seed).generate_state(1)[0]))
    trainloader, _ = load_data(
        partition_id,
        num_partitions,
        context.run_config["data-dir"],
        context.run_config["num-train-images"],
    )

    # SCAFFOLD's control variates assume plain SGD steps (its rule refuses momentum)
    momentum = 0.0 if rule.plain_sgd else 0.9
    if context.run_config["keep-momentum"]:  # a deliberate mistake: 0.9 kept
        momentum = 0.9

    # Call the training function
    train_loss = train_fn(
        model,
        trainloader,
        context.run_config["local-epochs"],
        msg.content["config"]["lr"],
        device,
        rule,
        momentum,
    )

    # Save classification head in `context.state` to use in future rounds
    save_layer_weights_to_state(context.state, model)

    if context.run_config["own-reply"]:  # a deliberate mistake: Flower's own reply
        model_record = ArrayRecord(model.state_dict())
        metrics = {
            "train_loss": train_loss,
            "num-examples": len(trainloader.dataset),
        }
        metric_record = MetricRecord(metrics)
        content = RecordDict({"arrays": model_record, "metrics": metric_record})
        return Message(content=content, reply_to=msg)

    # Construct and return reply Message (with the records the strategy expects)
    return rule.reply(
        num_examples=len(trainloader.dataset), metrics={"train_loss": train_loss}
    )


@app.evaluate()
def evaluate(msg: Message, context: Context):
    """Evaluate the model on local data."""
    # Load model and apply received weights
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    # Restore this client's previously saved classification layer weights
    # (no action if this is the first round it participates in)
    load_layer_weights_from_state(context.state, model)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model.to(device)

    # Load the data
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    _, valloader = load_data(
        partition_id,
        num_partitions,
        context.run_config["data-dir"],
        context.run_config["num-train-images"],
    )

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
