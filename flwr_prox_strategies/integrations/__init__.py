"""Client rules inside training frameworks: Lightning and Hugging Face's Trainer.

Each module holds one framework's callback, which applies any client rule of
the pack in one line and keeps what the rule measures (how many optimiser
steps held its term) true in that framework. Each imports its framework only
when imported itself: install the pack's ``[lightning]`` or
``[transformers]`` extra.

- ``lightning``: its ``RuleCallback`` for ``Trainer.fit``
  (``lightning.pytorch`` or ``pytorch_lightning``);
- ``huggingface``: its ``RuleCallback`` for ``transformers.Trainer``.
"""

from __future__ import annotations

from typing import Any

from ..core.client.rule import ClientRule


def checked_rule(rule: Any) -> ClientRule:
    """Return ``rule`` if it is a client rule; else fail saying how to build one."""
    if not isinstance(rule, ClientRule):
        raise TypeError(
            f"RuleCallback takes a client rule (XxxRule.from_message(...)), "
            f"got {type(rule).__name__}"
        )
    return rule
