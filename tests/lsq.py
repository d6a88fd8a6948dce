"""The least-squares federation of the conformance kit (tests import it from here)."""

from flwr_prox_strategies.testing import LeastSquares, half_sse

__all__ = ["LeastSquares", "half_sse"]
