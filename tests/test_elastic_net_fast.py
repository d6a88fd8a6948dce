"""The elastic-net centre from a guess (``hint=``) against the sorted one.

The guess only decides which coordinates are sorted: the weighted centre must
be the same bits with any guess, the unweighted one the same up to the order of
one float sum, and both the brute-force minimiser's.
"""

from __future__ import annotations

import numpy as np
import pytest

from flwr_prox_strategies.algorithms import fedepm as fedepm_module
from flwr_prox_strategies.ops import elastic_net
from flwr_prox_strategies.ops.elastic_net import (
    elastic_net_center,
    table_center,
    weighted_elastic_net_center,
    with_rows,
)
from tests.test_elastic_net import brute_force
from tests.test_fedepm import Federation

LAMS = (0.0, 1e-3, 0.5, 3.0)
ETAS = (0.0, 1e-5, 0.1, 2.0)


def random_table(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Float32 uploads with ties: repeated rows, rounded values, a shared start."""
    z = rng.normal(size=(rows, cols)) * rng.choice([0.01, 1.0, 100.0])
    kind = int(rng.integers(4))
    if kind == 1:
        z = np.round(z, 0)  # few distinct values: ties everywhere
    elif kind == 2:  # stale rows: copies of row 0, as unsampled clients hold
        z[rng.random(rows) < 0.5] = z[0]
    elif kind == 3:  # uploads equal to the start in some coordinates only
        z = np.where(rng.random(z.shape) < 0.6, z[:1], z)
    return z.astype(np.float32)


def penalties(rng: np.random.Generator) -> tuple[float, float]:
    lam = float(rng.choice(LAMS))
    eta = float(rng.choice(ETAS)) if lam > 0 else float(rng.choice(ETAS[1:]))
    return lam, eta


def hints(rng: np.random.Generator, z: np.ndarray, exact: np.ndarray) -> list:
    """Guesses good and bad: the answer, row 0, a moved answer, noise, NaN."""
    noisy = exact + rng.normal(size=exact.shape) * np.abs(exact).mean()
    nan = exact.copy()
    nan[:: max(1, len(nan) // 3)] = np.nan
    return [exact, exact.astype(np.float32), z[0], noisy, nan, z[-1] + 1e3]


@pytest.mark.parametrize("seed", range(60))
def test_weighted_centre_is_the_same_bits_with_any_hint(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = int(rng.choice([1, 2, 3, 5, 12, 40]))
    z = random_table(rng, rows, 37)
    weights = np.ones(rows, dtype=np.int64)
    if seed % 2:  # FedEPM's "seen" table: row 0 stands for the unseen clients
        weights[0] = int(rng.integers(1, 500))
    if seed % 5 == 4:  # any weights (ties then sorted)
        weights = rng.integers(1, 6, size=rows)
    lam, eta = penalties(rng)
    want = weighted_elastic_net_center(z, weights, lam, eta, block=16)
    for hint in hints(rng, z, want):
        got = weighted_elastic_net_center(z, weights, lam, eta, block=16, hint=hint)
        np.testing.assert_array_equal(got, want)
    repeated = np.repeat(z.astype(np.float64), weights, axis=0)
    if len(repeated) <= 200:
        for s in range(0, z.shape[1], 5):
            assert (
                want[s]
                == pytest.approx(
                    brute_force(repeated[:, s], lam, eta), rel=1e-9, abs=1e-9
                )
                or eta == 0
            )  # eta 0: any median minimises; the lower one is kept


@pytest.mark.parametrize("seed", range(60))
def test_unweighted_centre_with_a_hint_is_the_sorted_one(seed: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    rows = int(rng.choice([1, 2, 3, 4, 9, 30]))
    z = random_table(rng, rows, 29)
    if seed % 3 == 0:
        z = z.astype(np.float64)
    lam, eta = penalties(rng)
    want = elastic_net_center(z, lam, eta)
    first = None
    for hint in hints(rng, z, want):
        got = elastic_net_center(z, lam, eta, hint=hint, block=8)
        # the uploads' total is summed in row order, not sorted order
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(z).max())
        if first is None:
            first = got
        np.testing.assert_array_equal(got, first)  # whatever the guess
    if eta > 0:
        for s in range(z.shape[1]):
            assert got[s] == pytest.approx(
                brute_force(z[:, s].astype(np.float64), lam, eta), rel=1e-9, abs=1e-9
            )


def test_one_row_and_all_rows_equal() -> None:
    z = np.array([[1.5, -2.0, 0.0]], dtype=np.float32)
    for lam, eta in ((0.5, 1.0), (0.0, 1.0), (1.0, 0.0)):
        np.testing.assert_array_equal(
            elastic_net_center(z, lam, eta, hint=np.zeros(3)), z[0]
        )
        np.testing.assert_array_equal(
            weighted_elastic_net_center(z, [7], lam, eta, hint=z[0]), z[0]
        )
    same = np.repeat(z, 50, axis=0)
    np.testing.assert_array_equal(elastic_net_center(same, 0.3, 2.0, hint=z[0]), z[0])


@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_non_finite_uploads_give_the_sorted_answer(eta: float) -> None:
    """NaN and inf are sorted as before: the centre is as (non-)finite as it was."""
    rng = np.random.default_rng(3)
    z = rng.normal(size=(9, 6)).astype(np.float32)
    z[2, 0], z[4, 1], z[5, 2], z[:, 3] = np.nan, np.inf, -np.inf, np.inf
    weights = np.arange(1, 10)
    weights[1:] = 1
    for hint in (np.zeros(6), z[0], np.full(6, np.nan), np.full(6, np.inf)):
        np.testing.assert_array_equal(
            weighted_elastic_net_center(z, weights, 1.0, eta, hint=hint),
            weighted_elastic_net_center(z, weights, 1.0, eta),
        )
        np.testing.assert_array_equal(
            elastic_net_center(z, 1.0, eta, hint=hint),
            elastic_net_center(z, 1.0, eta),
        )
    if eta > 0:  # (an upload's +inf can leave a finite centre: the others' minimum)
        assert np.isnan(elastic_net_center(z, 1.0, eta, hint=z[0])[0])


def simulate(
    rng: np.random.Generator,
    *,
    clients: int,
    per_round: int,
    rounds: int,
    dense: bool,
    lam: float,
    eta: float,
    spread: float,
):
    """FedEPM's server loop: replace the repliers' rows, centre with and without hint.

    Uploads are the current model plus a change in some coordinates (a client's
    prox step leaves the others as they were: the l1 threshold). Yields each
    round's (hinted centre, sorted centre).
    """
    start = rng.normal(size=40).astype(np.float32) * 0.05
    table = np.repeat(start[None], clients if dense else 1, axis=0)
    slots: dict[int, int] = {}
    model = start.copy()
    for _ in range(rounds):
        chosen = rng.choice(clients, per_round, replace=False)
        rows = [
            slots.setdefault(int(c), (0 if dense else 1) + len(slots)) for c in chosen
        ]
        change = rng.normal(size=(per_round, 40)) * spread
        change[rng.random(change.shape) < 0.5] = 0.0
        values = [(model + c).astype(np.float32) for c in change]
        table = with_rows(table, len(slots) + (0 if dense else 1), rows, values)
        unseen = None if dense else clients - len(slots)
        hinted = table_center(table, lam, eta, unseen, model)
        plain = table_center(table, lam, eta, unseen)
        yield hinted, plain
        model = hinted.astype(np.float32)


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize(
    "lam, eta, spread",
    [(5.0, 10.0, 0.05), (0.05, 10.0, 0.5), (0.0, 1.0, 0.1), (1.0, 0.0, 0.1)],
)
def test_rounds_of_fedepm_give_the_sorted_centres(dense, lam, eta, spread) -> None:
    """Rows replaced round after round, the model as the hint: the same centres."""
    rng = np.random.default_rng(int(lam * 100 + eta + dense))
    for hinted, plain in simulate(
        rng,
        clients=60,
        per_round=5,
        rounds=15,
        dense=dense,
        lam=lam,
        eta=eta,
        spread=spread,
    ):
        if dense:  # the total's summation order only
            np.testing.assert_allclose(hinted, plain, rtol=1e-12, atol=1e-15)
        else:
            np.testing.assert_array_equal(hinted, plain)


def test_the_hint_spares_the_sort(monkeypatch) -> None:
    """The model as the hint certifies most coordinates: few are sorted."""
    sorted_columns = []

    def counting(cols, *args):
        sorted_columns.append(cols.shape[1])
        return reference(cols, *args)

    reference = elastic_net._sorted_weighted_center
    monkeypatch.setattr(elastic_net, "_sorted_weighted_center", counting)
    rng = np.random.default_rng(0)
    rounds = list(
        simulate(
            rng,
            clients=1000,
            per_round=10,
            rounds=10,
            dense=False,
            lam=5.0,
            eta=10.0,
            spread=0.05,
        )
    )
    plain = 40 * len(rounds)  # every column of every round, without the hint
    assert plain <= sum(sorted_columns) <= plain + 0.05 * 40 * len(rounds)


def test_fedepm_models_are_the_same_with_and_without_the_hint(monkeypatch) -> None:
    """The strategy passes its model as the hint; without it, the same models."""
    fed = Federation(m=8)
    models = {}
    for hinted in (True, False):
        if not hinted:
            monkeypatch.setattr(
                fedepm_module,
                "table_center",
                lambda table, lam, eta, unseen, hint=None: table_center(
                    table, lam, eta, unseen
                ),
            )
        for table in ("seen", "dense"):
            strategy = fedepm_module.FedEPM(
                num_clients=fed.m,
                rho=0.25,
                k0=3,
                eta=2.0,
                lam=0.3,
                noise=0.0,
                table=table,
                min_available_nodes=fed.m,
                fraction_evaluate=0.0,
            )
            result = strategy.start(
                grid=fed.grid(), initial_arrays=fed.initial(), num_rounds=5
            )
            models[table, hinted] = result.arrays.to_numpy_ndarrays()[0]
    np.testing.assert_array_equal(models["seen", True], models["seen", False])
    np.testing.assert_allclose(
        models["dense", True], models["dense", False], rtol=1e-6, atol=1e-7
    )
