"""pytorch-example: A Flower / PyTorch app.

Adapted from Flower's examples/advanced-pytorch (Copyright Flower Labs GmbH,
Apache License 2.0; see NOTICE at the root of this repository).
"""
