"""The client side: the pack's ``NumPyClient``, the client rules, local training.

:mod:`.client` (the base client), :mod:`.rule` (each algorithm's client side as
pieces for any training loop), :mod:`.training` (the one local loop),
:mod:`.state` (per-client state across rounds, committed in two phases) and
:mod:`.adapter` (a ``NumPyClient`` mounted on a Message-API ``ClientApp``).
"""
