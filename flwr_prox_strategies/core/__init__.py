"""Internal machinery that knows Flower: the validated strategy base and its parts.

Internal: modules here may move between releases. Users import from
``flwr_prox_strategies``; contributors writing an algorithm from
``flwr_prox_strategies.extend``, which re-exports what is stable.
"""
