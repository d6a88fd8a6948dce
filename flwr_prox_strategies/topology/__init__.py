"""Command line tool for the P-FedAvg server overlay (``python -m`` this package).

Builds the servers' graph and mixing matrix, prints its consensus rate and the
per-round traffic, and plots the expected speed-up of P-FedAvg over FedAvg
against the number of clients. The maths lives in
:mod:`flwr_prox_strategies.ops.graphs`, :mod:`flwr_prox_strategies.ops.mixing`
and :mod:`flwr_prox_strategies.ops.communication`.
"""
