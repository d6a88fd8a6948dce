"""Machinery that knows Flower: validated strategy base, adapter, training loop."""
