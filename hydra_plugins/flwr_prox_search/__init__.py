"""flwr-prox-strategies' Hydra sweeper: Optuna search (``hydra/sweeper=search``).

Hydra finds sweepers only under the ``hydra_plugins`` namespace, and imports
every module there whenever a Hydra app starts: this one imports Hydra alone,
and the search itself (:mod:`flwr_prox_strategies.experiment.sweeps.search`, Optuna)
only when a sweep asks for it.
"""

from __future__ import annotations

from typing import Any

from hydra.plugins.sweeper import Sweeper


class SearchSweeper(Sweeper):
    """Optuna's study over a sweep's jobs.

    See :class:`flwr_prox_strategies.experiment.sweeps.search.Search` for the options.
    """

    def __init__(self, **options: Any) -> None:
        from flwr_prox_strategies.experiment.sweeps.search import Search

        self.search = Search(**options)

    def setup(self, **context: Any) -> None:
        """Build the launcher the trials run on (Hydra's context, config, task)."""
        self.search.setup(**context)

    def sweep(self, arguments: list[str]) -> Any:
        """Run the study's trials; return the best."""
        return self.search.sweep(arguments)
