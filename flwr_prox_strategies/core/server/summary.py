"""The run's summary of a strategy: its settings, the base's checks, Flower's lines.

Logged at the start of ``Strategy.start`` (Flower's ``summary()``), so a log
says what ran. Flower's ``FedAvg`` lines are written here, not by Flower: its
"Weighted by" line names ``weighted_by_key`` even when the pack weighs every
reply alike, and a summary must not contradict itself.
"""

from __future__ import annotations

from logging import INFO
from typing import Any

from flwr.common.logger import log

# Any strategy of the pack: the summary reads its public settings only.
Summarised = Any


def weighting_text(strategy: Summarised) -> str:
    """Return how replies are weighted, in words, and whether Flower's differs."""
    if strategy.weighting == "metric":
        return f"metric '{strategy.weighted_by_key}'"
    if strategy.weighting == "uniform":
        return "uniform (every valid reply weighs 1; Flower's FedAvg: 'num-examples')"
    return "'num-examples'"


def caps_text(strategy: Summarised) -> str:
    """Return the caps on a reply's claimed ``num-examples``, in words."""
    caps = []
    if strategy.max_weight_ratio is not None:
        caps.append(f"{strategy.max_weight_ratio:g} x the round's median")
    if strategy.max_num_examples is not None:
        caps.append(f"{strategy.max_num_examples:g}")
    return " and ".join(caps) or "none"


def log_summary(strategy: Summarised, base_settings: tuple[str, ...]) -> None:
    """Log the algorithm's settings (when it declares its own), then the base's."""
    settings = strategy.settings
    if settings != base_settings:
        log(INFO, "\t├──> %s settings:", type(strategy).__name__)
        for number, name in enumerate(settings, 1):
            branch = "└" if number == len(settings) else "├"
            log(INFO, "\t│\t%s── %s: %s", branch, name, getattr(strategy, name))
    log(INFO, "\t├──> Validation and sampling (flwr-prox-strategies):")
    if strategy.rule_metric is not None:
        log(
            INFO,
            "\t│\t├── Clients must report: '%s' (%s)",
            strategy.rule_metric,
            "replies without it rejected" if strategy.strict else "else warned",
        )
    log(INFO, "\t│\t├── Seed: %d", strategy.seed)
    log(INFO, "\t│\t├── Participation: %s", strategy.participation)
    log(
        INFO,
        "\t│\t├── num-examples cap: %s; largest reply: %s",
        caps_text(strategy),
        f"{strategy.max_reply_bytes:,} bytes"
        if strategy.max_reply_bytes is not None
        else "2 x the expected records + 1 MiB",
    )
    log(INFO, "\t│\t├── Local epochs: %s", strategy.local_epochs or "client's own")
    if strategy.local_steps is not None:
        log(INFO, "\t│\t├── Local steps: %d", strategy.local_steps)
    log(
        INFO,
        "\t│\t└── Stragglers: %.0f%% (%s)",
        100 * strategy.drop_percent,
        strategy.straggler_policy,
    )


def log_flower_summary(strategy: Summarised) -> None:
    """Log Flower's ``FedAvg.summary`` lines, with the weighting actually used."""
    log(INFO, "\t├──> Sampling:")
    log(
        INFO,
        "\t│\t├──Fraction: train (%.2f) | evaluate ( %.2f)",
        strategy.fraction_train,
        strategy.fraction_evaluate,
    )
    log(
        INFO,
        "\t│\t├──Minimum nodes: train (%d) | evaluate (%d)",
        strategy.min_train_nodes,
        strategy.min_evaluate_nodes,
    )
    log(INFO, "\t│\t└──Minimum available nodes: %d", strategy.min_available_nodes)
    log(INFO, "\t└──> Keys in records:")
    log(INFO, "\t\t├── Weighted by: %s", weighting_text(strategy))
    log(INFO, "\t\t├── ArrayRecord key: '%s'", strategy.arrayrecord_key)
    log(INFO, "\t\t└── ConfigRecord key: '%s'", strategy.configrecord_key)
