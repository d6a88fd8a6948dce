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
