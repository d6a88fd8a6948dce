"""The least-squares federation of the conformance kit (tests import it from here)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from flwr_prox_strategies import ClientRule
from flwr_prox_strategies.testing import LeastSquares, half_sse

__all__ = ["LeastSquares", "half_sse", "rule_app"]


def rule_app(
    problem: LeastSquares,
    rule_cls: type[ClientRule],
    train_node: Callable[[int, torch.nn.Module, ClientRule], Message],
) -> ClientApp:
    """A user's Message-API client: node k's linear model and the message's rule.

    ``train_node(k, model, rule)`` runs the user's own loop and returns the reply.
    """
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        k = int(context.node_config["partition-id"])
        model = torch.nn.Linear(problem.dim, 1, bias=False)
        return train_node(k, model, rule_cls.from_message(msg, context, model))

    return app
