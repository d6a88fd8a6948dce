"""The client half of each algorithm: its rule and its ``NumPyClient`` (torch).

``clients/<algorithm>.py`` beside ``<algorithm>.py``, the strategy, whose wire
keys it reads: a ServerApp imports the strategies only, never torch. The
classes load on first use from :mod:`flwr_prox_strategies` and
:mod:`flwr_prox_strategies.algorithms`.
"""
