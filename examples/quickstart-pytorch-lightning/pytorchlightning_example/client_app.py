"""pytorchlightning_example: A Flower / PyTorch Lightning app.

Adapted from Flower's examples/quickstart-pytorch-lightning (Copyright Flower
Labs GmbH, Apache License 2.0; see NOTICE at the root of this repository).
"""

import pytorch_lightning as pl
from datasets.utils.logging import disable_progress_bar
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_prox_strategies import (
    ClientRule,
    FedDCRule,
    FedDynRule,
    FedProxRule,
    ScaffoldRule,
)
from flwr_prox_strategies.integrations.lightning import RuleCallback

disable_progress_bar()

from pytorchlightning_example.task import LitAutoEncoder, load_data  # noqa: E402

# The client side of each algorithm the run config can select
RULES = {
    "fedavg": ClientRule,
    "fedprox": FedProxRule,
    "feddyn": FedDynRule,
    "scaffold": ScaffoldRule,
    "feddc": FedDCRule,
}

# Flower ClientApp
app = ClientApp()


def make_model(context: Context, rule_class: type[ClientRule]) -> LitAutoEncoder:
    """Flower's Adam, or plain SGD where the rule needs it (optimizer="auto")."""
    config = context.run_config
    optimizer = str(config["optimizer"])
    if optimizer == "auto":
        optimizer = "sgd" if rule_class.plain_sgd else "adam"
    lr = config["sgd-learning-rate"] if optimizer == "sgd" else config["learning-rate"]
    return LitAutoEncoder(optimizer=optimizer, lr=float(lr))


@app.train()
def train(msg: Message, context: Context):
    """Train the model on local data."""
    # Load the model and initialize it with the received weights
    rule_class = RULES[context.run_config["algorithm"]]
    model = make_model(context, rule_class)
    rule = rule_class.from_message(msg, context, model)

    # Load the data
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    seed = context.run_config["seed"]
    train_loader, val_loader, _ = load_data(partition_id, num_partitions, seed)

    # Train the model on local data, the algorithm's rule at every step
    max_epochs = context.run_config["max-epochs"]
    trainer = pl.Trainer(
        max_epochs=max_epochs,
        enable_progress_bar=False,
        callbacks=[RuleCallback(rule)],
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, train_loader, val_loader)

    # FIT does not return values, but you can read final epoch metrics here:
    fit_metrics = trainer.callback_metrics  # Dict[str, Tensor]
    loss = float(fit_metrics["train_loss"])

    # Construct and return reply Message (with the records the strategy expects)
    return rule.reply(
        num_examples=len(train_loader.dataset), metrics={"train_loss": loss}
    )


@app.evaluate()
def evaluate(msg: Message, context: Context):
    """Evaluate the model on local data."""
    # Load the model and initialize it with the received weights
    model = LitAutoEncoder()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())

    # Load the data
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    _, _, test_loader = load_data(partition_id, num_partitions)

    # Call the evaluation function
    trainer = pl.Trainer(enable_progress_bar=False, logger=False)
    results = trainer.test(model, test_loader, verbose=False)
    # Test returns a list[dict] with your logged test_* metrics:
    loss = results[0]["test_loss"]

    # Construct and return reply Message
    metrics = {
        "eval_loss": loss,
        "num-examples": len(test_loader.dataset),
    }
    metric_record = MetricRecord(metrics)
    content = RecordDict({"metrics": metric_record})
    return Message(content=content, reply_to=msg)
