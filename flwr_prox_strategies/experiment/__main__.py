"""Hydra entry point: ``python -m flwr_prox_strategies.experiment [-m] key=value ...``.

Examples
--------
One run (Flower's engine, 20 SuperNodes)::

    python -m flwr_prox_strategies.experiment strategy=fedavg num_rounds=10

A sweep, summarised in ``multirun/<date>/<time>/summary.csv`` and ``comparison.png``
(FedAvg against FedProx without and with 90% stragglers, in this process)::

    python -m flwr_prox_strategies.experiment -m engine=inprocess \
        +experiment=fedprox-stragglers partition=pathological \
        strategy=fedavg,fedprox strategy.drop_percent=0,0.9 seed=0,1
"""

import sys

import hydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig

from ..algorithms import PluginError, registered_algorithm
from .config import CONF_DIR, KebabKeyError, check_snake_key
from .sweeps.sweep import run_job


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def main(cfg: DictConfig) -> float:
    """Run one job of the (multi)run."""
    return run_job(cfg)


def _parsed(argv: list[str]) -> list[Override]:
    """Return the command line's overrides, parsed (none if Hydra cannot parse them)."""
    overrides = [arg for arg in argv if "=" in arg and not arg.startswith("-")]
    try:
        return OverridesParser.create().parse_overrides(overrides)
    except Exception:  # Hydra reports its own parse errors
        return []


def refuse_kebab_keys(argv: list[str]) -> None:
    """Exit with the snake_case spelling when an override uses a kebab-case key.

    Hydra parses the command line itself and would only say that it cannot
    override ``num-clients``.
    """
    for override in _parsed(argv):
        try:
            check_snake_key(override.key_or_group, override.input_line or "")
        except KebabKeyError as err:
            sys.exit(f"Error: {err}")


def refuse_broken_plugins(argv: list[str]) -> None:
    """Exit naming the plugin when ``strategy=`` asks for an unusable one.

    Hydra would only say that ``strategy/<name>`` is not found: the plugin's
    own error (its distribution, its entry point, what is wrong) is the fix.
    """
    for override in _parsed(argv):
        if override.key_or_group != "strategy" or override.is_delete():
            continue
        try:  # a sweep (strategy=fedavg,nova) lists its options
            options = (
                list(override.sweep_string_iterator())
                if override.is_sweep_override()
                else [override.value()]
            )
        except Exception:  # glob(...) needs Hydra's config loader: Hydra checks it
            continue
        for option in options:
            try:
                registered_algorithm(str(option))
            except PluginError as err:
                sys.exit(f"Error: {err}")
            except KeyError:
                pass  # not a plugin: Hydra lists the options


if __name__ == "__main__":
    refuse_kebab_keys(sys.argv[1:])
    refuse_broken_plugins(sys.argv[1:])
    main()
