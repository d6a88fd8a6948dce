"""What a reply's step counts say when steps lacked the rule's term, in words.

A client rule counts the steps whose update held its term (``*-applied``,
``term-lost-steps``, ``term-missing-steps``); the client's log and the server's
warning explain a shortfall in the same words (:func:`shortfall_text`).
"""

from __future__ import annotations


def shortfall_text(lost: int, missing: int, rule: str, *, counted: bool = True) -> str:
    """Say why steps lacked the term, and what to change (client and server logs).

    ``counted=False`` names the causes without their numbers.
    """
    causes = []
    if lost:
        causes.append(
            f"{f'{lost} ' if counted else 'steps '}lost (the term was added, "
            "then the gradients were cleared, zeroed or replaced before the "
            "update: the step runs zero_grad() and backward() inside "
            "optimizer.step(closure), as Lightning's automatic optimisation and "
            "LBFGS do, or zero_grad() comes after the term; attach the rule "
            "to the optimiser, rule.attach(optimizer), which adds it inside the "
            "closure, or use the pack's RuleCallback for Lightning or Hugging "
            "Face)"
        )
    if missing:
        causes.append(
            f"{f'{missing} ' if counted else 'steps '}without it (no term was "
            "added before these updates: the optimiser that steps the model is "
            "not the one attached, or "
            f"{rule}.add_gradient() was not called at every step; attach the "
            "optimiser your training stack steps, or, under Lightning or Hugging "
            "Face, add the pack's RuleCallback)"
        )
    return "; ".join(causes) or "no step lacked the term"


__all__ = ["shortfall_text"]
