"""Apply a client rule inside Hugging Face's ``transformers.Trainer``, in one line.

The Trainer builds (or takes) its optimiser, wraps it with accelerate and
steps it after ``backward()`` and its own gradient clipping.
:class:`RuleCallback` attaches the rule to that optimiser when training
begins: the term is added just before each update (after clipping), the rule
checks the optimiser (SCAFFOLD and FedDC refuse anything but plain SGD: pass
``optimizers=(torch.optim.SGD(model.parameters(), lr=...), None)``) and
counts the steps whose update held the term::

    rule = FedProxRule.from_message(msg, context, model)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[RuleCallback(rule)])
    trainer.train()
    return rule.reply(num_examples=len(data))
"""

from __future__ import annotations

from logging import INFO
from typing import Any

from flwr.common.logger import log

from ..core.client.rule import ClientRule
from . import checked_rule

try:
    from transformers import TrainerCallback
except ImportError as err:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "flwr_prox_strategies.integrations.huggingface needs transformers: "
        'pip install "flwr-prox-strategies[transformers]"'
    ) from err


class RuleCallback(TrainerCallback):  # type: ignore[misc]
    """Hugging Face ``TrainerCallback`` that applies a client rule at every step.

    Parameters
    ----------
    rule : ~flwr_prox_strategies.ClientRule
        The round's rule, built with ``XxxRule.from_message(msg, context,
        model)`` on the model the Trainer trains.

    Notes
    -----
    Give the Trainer a fresh callback each round, with that round's rule,
    and reply with ``rule.reply(...)``. The term is added after the
    Trainer's gradient clipping (``max_grad_norm``), once per optimiser step
    (with ``gradient_accumulation_steps=k``, to the accumulated gradient).
    """

    def __init__(self, rule: ClientRule) -> None:
        self.rule = checked_rule(rule)

    def on_train_begin(
        self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any
    ) -> None:
        """Attach the rule to the optimiser the Trainer steps."""
        if optimizer is None:
            raise RuntimeError(
                "RuleCallback: the Trainer gave its callbacks no optimizer at "
                "on_train_begin; pass optimizers=(optimizer, None) to the Trainer"
            )
        self.rule.attach(optimizer)
        schedule = getattr(args, "lr_scheduler_type", "constant")
        schedule = str(getattr(schedule, "value", schedule))  # an enum in transformers
        if schedule != "constant":
            # The Trainer wraps the user's optimiser in its own schedule: say so
            # once, and that the rule reads the rates it actually applies.
            log(
                INFO,
                "RuleCallback: the Trainer changes the learning rate every step "
                "(lr_scheduler_type=%s); %s reads each step's rate from the "
                "optimiser, so its update stays exact; pass "
                "lr_scheduler_type='constant' for the papers' constant rate",
                schedule,
                type(self.rule).__name__,
            )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Remove the optimiser hook (the rule's counts stay for its reply)."""
        self.rule.detach()


__all__ = ["RuleCallback"]
