"""Secure aggregation (SecAgg+) over the Message API: the wrapper and the client mod."""

from .client import SecAggPlusMod, SecureAggregationRefused
from .server import SecAggPlus

__all__ = ["SecAggPlus", "SecAggPlusMod", "SecureAggregationRefused"]
