"""lora_example: the ClientApp. Each round: the rule on the adapters, a plain loop.

The rule is built on ``federated_part(model)``: FedProx's anchor and SCAFFOLD's
control variates cover the adapters only, and the reply carries them alone.
"""

from __future__ import annotations

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from flwr_prox_strategies import FedProxRule, ScaffoldRule, federated_part
from lora_example.task import loss_on, model_of, shard

app = ClientApp()
RULES = {"fedprox": FedProxRule, "scaffold": ScaffoldRule}


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Fine-tune this node's adapters for ``local-steps`` SGD steps."""
    config = context.run_config
    model = model_of(config)
    rule = RULES[str(config["algorithm"])].from_message(
        msg, context, federated_part(model)
    )
    adapters = [p for p in model.parameters() if p.requires_grad]
    optimizer = rule.attach(
        torch.optim.SGD(adapters, lr=float(config["learning-rate"]))
    )
    node = int(context.node_config["partition-id"])
    tokens = shard(node, int(context.node_config["num-partitions"]))
    model.train()
    for step in range(int(config["local-steps"])):
        batch = tokens[step % len(tokens) :][:4]
        optimizer.zero_grad()
        loss_on(model, batch).backward()
        optimizer.step()
    return rule.reply(num_examples=len(tokens))
