"""Image inputs are standardised by default, per data set; switchable and named."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_prox_strategies.experiment.config import compose_config
from flwr_prox_strategies.experiment.data import load_data


@pytest.mark.parametrize("dataset", ["digits", "fashion-mnist"])
def test_the_default_config_gives_standardised_inputs(dataset) -> None:
    data = load_data(compose_config(f"dataset={dataset}"))
    x = data.train.x.astype(np.float64)
    assert abs(x.mean()) < 1e-3 and abs(x.std() - 1.0) < 1e-3
    test = data.test.x.astype(np.float64)  # the same map, not its own stats
    assert abs(test.mean()) < 0.05 and abs(test.std() - 1.0) < 0.05


def test_none_keeps_the_loaders_scaling_and_official_is_mnists() -> None:
    raw = load_data(compose_config("dataset=fashion-mnist dataset.normalize=none"))
    assert raw.train.x.min() == 0.0 and raw.train.x.max() == 1.0
    official = load_data(
        compose_config("dataset=fashion-mnist dataset.normalize=official")
    )
    np.testing.assert_allclose(
        official.train.x[:50],
        (raw.train.x[:50] - 0.1307) / 0.3081,
        rtol=1e-5,
        atol=1e-5,
    )
    preset = compose_config("+experiment=non-iid-official")
    assert preset.dataset.normalize == "official"


def test_an_unknown_choice_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"dataset\.normalize='zca'"):
        load_data(compose_config("dataset=digits dataset.normalize=zca"))


def test_tabular_data_is_left_as_loaded() -> None:
    assert "normalize" not in compose_config("dataset=adult").dataset
