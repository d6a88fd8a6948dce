"""Flower's FedAvg with trivial stateful clients (benchmarks/scale.py's baseline)."""
