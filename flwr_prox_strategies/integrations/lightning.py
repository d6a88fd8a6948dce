"""Apply a client rule inside Lightning's ``Trainer.fit``, in one line.

Lightning's automatic optimisation runs ``backward`` inside
``optimizer.step(closure)``, wiping a term added before the step.
:class:`RuleCallback` adds it in ``on_before_optimizer_step`` (after
``backward()`` and AMP's unscaling, before Lightning's clipping) and attaches the
rule to every optimiser the trainer steps; it works with ``lightning.pytorch``
and ``pytorch_lightning``::

    rule = FedProxRule.from_message(msg, context, model)
    trainer = pl.Trainer(max_epochs=1, callbacks=[RuleCallback(rule)])
    trainer.fit(model, train_loader)
    return rule.reply(num_examples=len(train_loader.dataset))

The details (devices, ``precision``, gradient accumulation): the documentation's
guide to training frameworks.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..core.client.rule import ClientRule
from . import checked_rule


def _lightning_callback() -> type[Any]:
    """Return Lightning's ``Callback`` class, from either of its packages."""
    for module in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(module).Callback  # type: ignore[no-any-return]
        except ImportError:
            continue
    raise ImportError(
        "flwr_prox_strategies.integrations.lightning needs Lightning: "
        'pip install "flwr-prox-strategies[lightning]" (or lightning)'
    )


class RuleCallback(_lightning_callback()):  # type: ignore[misc]
    """Lightning callback that applies a client rule at every optimiser step.

    Parameters
    ----------
    rule : ~flwr_prox_strategies.ClientRule
        The round's rule, built with ``XxxRule.from_message(msg, context,
        model)`` on the LightningModule (or the network inside it) that the
        trainer fits.

    Notes
    -----
    Give the trainer a fresh callback each round, with that round's rule,
    and reply with ``rule.reply(...)``: the reply carries the model, the
    records the strategy expects and the count of steps that held the term.
    Gradient accumulation, gradient clipping and mixed precision work as
    Lightning documents them; under ``accumulate_grad_batches=k`` the term is
    added once per optimiser step, to the accumulated gradient.
    """

    def __init__(self, rule: ClientRule) -> None:
        self.rule = checked_rule(rule)

    @property
    def state_key(self) -> str:
        """Identify the callback in Lightning's checkpoints."""
        return f"RuleCallback[{type(self.rule).__name__}]"

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Attach the rule to every optimiser the trainer will step."""
        # Together: several optimisers may each step a part of the module
        # (manual optimisation of a GAN's generator and discriminator).
        if trainer.optimizers:
            self.rule.attach(*trainer.optimizers)

    def on_before_optimizer_step(
        self, trainer: Any, pl_module: Any, optimizer: Any
    ) -> None:
        """Add the term to the finished gradients, before Lightning clips them."""
        self.rule.add_gradient()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """Remove the optimiser hooks (the rule's counts stay for its reply)."""
        self.rule.detach()


__all__ = ["RuleCallback"]
