"""Pure math on numpy/torch (no flwr import): aggregation, proximal terms, metrics."""
