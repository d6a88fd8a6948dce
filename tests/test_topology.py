"""Server overlays, mixing matrices (incl. the SDP optima), the communication model
and the ``python -m flwr_prox_strategies.topology`` tool."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

from flwr_prox_strategies.ops.communication import (
    expected_round_times,
    expected_speedup,
    fedavg_round_time,
    round_time,
    server_times,
    slowest_client_delays,
    split_clients,
    volumes,
)
from flwr_prox_strategies.ops.graphs import (
    TOPOLOGIES,
    adjacency,
    from_adjacency,
    grid_shape,
    is_connected,
)
from flwr_prox_strategies.ops.mixing import (
    MIXINGS,
    check_mixing,
    consensus_rate,
    mixing_matrix,
    optimal_mixing,
)
from flwr_prox_strategies.topology.__main__ import main

SDP_TOL = 2e-3  # the optima below are quoted to 4 digits


def degrees(adj):
    return adj.sum(axis=1)


def assert_graph(adj, servers):
    assert adj.shape == (servers, servers)
    assert np.issubdtype(adj.dtype, np.integer)
    assert set(np.unique(adj)) <= {0, 1}
    assert np.array_equal(adj, adj.T)
    assert not np.diagonal(adj).any()
    assert is_connected(adj)


# ------------------------------------------------------------------- graphs


PARAMS: dict[str, dict[str, Any]] = {"erdos-renyi": {"probability": 0.5}}


@pytest.mark.parametrize("kind", TOPOLOGIES)
@pytest.mark.parametrize("servers", [2, 4, 9, 12])
def test_every_topology_is_a_connected_simple_graph(kind, servers):
    params: dict[str, Any] = dict(PARAMS.get(kind, {}))
    if kind == "random-regular":
        params["degree"] = {2: 1, 9: 4}.get(servers, 3)  # servers * degree even
    adj = adjacency(kind, servers, **params)
    assert_graph(adj, servers)


def test_ring_star_complete_structure():
    ring = adjacency("ring", 6)
    assert (degrees(ring) == 2).all()
    assert ring[0, 1] == ring[0, 5] == 1
    assert adjacency("ring", 2).tolist() == [[0, 1], [1, 0]]
    star = adjacency("star", 7)
    assert degrees(star)[0] == 6 and (degrees(star)[1:] == 1).all()
    complete = adjacency("complete", 5)
    assert (degrees(complete) == 4).all()


def test_grid_and_torus():
    assert grid_shape(16) == (4, 4)
    assert grid_shape(12) == (3, 4)
    assert grid_shape(7) == (1, 7)  # a prime gives a path
    assert grid_shape(12, rows=2) == (2, 6)
    grid = adjacency("grid", 16)
    assert grid.sum() // 2 == 24  # 2 * 4 * 3
    assert sorted(np.unique(degrees(grid))) == [2, 3, 4]
    # Row-major numbering: (r, c) -> 4r + c.
    assert grid[5, 6] == grid[5, 1] == grid[5, 9] == grid[5, 4] == 1
    assert grid[3, 4] == 0  # end of a row is not joined to the next row
    torus = adjacency("torus", 16)
    assert (degrees(torus) == 4).all()
    assert torus[0, 3] == torus[0, 12] == 1
    assert (degrees(adjacency("torus", 12, rows=2)) == 3).all()  # a 2-cycle is one edge
    path = adjacency("grid", 5)
    assert sorted(degrees(path)) == [1, 1, 2, 2, 2]


@pytest.mark.parametrize(
    "servers,degree", [(10, 3), (50, 4), (12, 10), (30, 2), (9, 8)]
)
def test_random_regular(servers, degree):
    adj = adjacency("random-regular", servers, degree=degree, seed=3)
    assert_graph(adj, servers)
    assert (degrees(adj) == degree).all()
    assert np.array_equal(
        adj, adjacency("random-regular", servers, degree=degree, seed=3)
    )


def test_random_graphs_depend_on_seed():
    draws = {
        adjacency("random-regular", 20, degree=3, seed=s).tobytes() for s in range(5)
    }
    assert len(draws) == 5
    draws = {
        adjacency("erdos-renyi", 20, probability=0.3, seed=s).tobytes()
        for s in range(5)
    }
    assert len(draws) == 5


def test_erdos_renyi_density_and_reproducibility():
    adj = adjacency("erdos-renyi", 60, probability=0.2, seed=1)
    assert_graph(adj, 60)
    assert abs(adj.sum() / (60 * 59) - 0.2) < 0.03
    assert np.array_equal(adj, adjacency("erdos-renyi", 60, probability=0.2, seed=1))
    assert (
        adjacency("erdos-renyi", 6, probability=1.0) == adjacency("complete", 6)
    ).all()


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        (("hypercube", 4), {}, "kind"),
        (("ring", 1), {}, "servers"),
        (("ring", 4.0), {}, "servers"),
        (("ring", 5), {"degree": 2}, "does not take degree"),
        (("star", 5), {"probability": 0.5}, "does not take probability"),
        (("grid", 12), {"rows": 5}, "rows"),
        (("torus", 12), {"rows": 0}, "rows"),
        (("random-regular", 10), {}, "degree"),
        (("random-regular", 7), {"degree": 3}, "even"),
        (("random-regular", 6), {"degree": 6}, "degree"),
        (("random-regular", 6), {"degree": 1}, "disconnected"),
        (("erdos-renyi", 10), {}, "probability"),
        (("erdos-renyi", 10), {"probability": 0.0}, "probability"),
        (("erdos-renyi", 10), {"probability": 1.5}, "probability"),
        (("erdos-renyi", 40), {"probability": 0.01}, "connected"),
    ],
)
def test_adjacency_rejects_bad_parameters(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        adjacency(*args, **kwargs)


def test_is_connected():
    assert is_connected([[0]])
    assert is_connected(adjacency("ring", 7))
    two_triangles = np.kron(np.eye(2, dtype=int), adjacency("complete", 3))
    assert not is_connected(two_triangles)
    with pytest.raises(ValueError, match="square"):
        is_connected(np.zeros((2, 3)))


@pytest.mark.parametrize(
    "matrix,match",
    [
        (np.zeros((2, 3)), "square"),
        (np.zeros(4), "square"),
        ([[0, 2], [2, 0]], "0 or 1"),
        ([[0, 0.5], [0.5, 0]], "0 or 1"),
        ([[1, 1], [1, 0]], "diagonal"),
        ([[0, 1, 0], [0, 0, 1], [0, 1, 0]], "symmetric"),
        (np.kron(np.eye(2, dtype=int), [[0, 1], [1, 0]]), "connected"),
    ],
)
def test_from_adjacency_rejects(matrix, match):
    with pytest.raises(ValueError, match=match):
        from_adjacency(matrix)


def test_from_adjacency_accepts_bool_and_float():
    ring = adjacency("ring", 5)
    assert np.array_equal(from_adjacency(ring.astype(bool)), ring)
    assert from_adjacency(ring.astype(float)).dtype.kind == "i"


# ------------------------------------------------------------------- mixing


GRAPHS = [
    ("ring", 8, {}),
    ("star", 8, {}),
    ("grid", 12, {}),
    ("torus", 16, {}),
    ("random-regular", 14, {"degree": 3}),
    ("erdos-renyi", 15, {"probability": 0.3}),
]


@pytest.mark.parametrize("kind,servers,params", GRAPHS)
@pytest.mark.parametrize("method", ["metropolis", "max-degree"])
def test_local_weights_are_nonnegative_doubly_stochastic(kind, servers, params, method):
    adj = adjacency(kind, servers, **params, seed=2)
    w = mixing_matrix(adj, method)
    check_mixing(w, adj)
    assert (w >= 0).all()
    assert np.allclose(w.sum(axis=0), 1.0)
    assert consensus_rate(w) < 1.0  # connected graph: it does reach consensus


def test_metropolis_and_max_degree_by_hand():
    star = adjacency("star", 4)  # hub degree 3, leaves 1
    w = mixing_matrix(star, "metropolis")
    assert np.allclose(w[0, 1:], 0.25) and np.isclose(w[0, 0], 0.25)
    assert np.allclose(np.diagonal(w)[1:], 0.75)
    w = mixing_matrix(star, "max-degree")
    assert np.allclose(w, mixing_matrix(star, "metropolis"))
    ring = adjacency("ring", 5)
    assert np.allclose(
        mixing_matrix(ring, "metropolis")[0], [1 / 3, 1 / 3, 0, 0, 1 / 3]
    )


def test_uniform_only_on_the_complete_graph():
    w = mixing_matrix(adjacency("complete", 4), "uniform")
    assert np.allclose(w, 0.25) and consensus_rate(w) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="complete"):
        mixing_matrix(adjacency("ring", 4), "uniform")
    with pytest.raises(ValueError, match="method"):
        mixing_matrix(adjacency("ring", 4), "laplacian")


def test_consensus_rate_extremes():
    assert consensus_rate(np.eye(5)) == pytest.approx(1.0)
    assert consensus_rate(np.full((5, 5), 0.2)) == pytest.approx(0.0, abs=1e-12)
    # Symmetric W: the rate is the second-largest eigenvalue modulus.
    w = mixing_matrix(adjacency("ring", 9))
    eigenvalues = np.sort(np.abs(np.linalg.eigvalsh(w)))
    assert consensus_rate(w) == pytest.approx(eigenvalues[-2])


def test_check_mixing_rejects():
    adj = adjacency("ring", 4)
    good = mixing_matrix(adj)
    check_mixing(good, adj)
    with pytest.raises(ValueError, match="square"):
        check_mixing(np.ones((2, 3)) / 3)
    asymmetric = good.copy()
    asymmetric[0, 1] += 0.1
    asymmetric[0, 0] -= 0.1
    with pytest.raises(ValueError, match="symmetric"):
        check_mixing(asymmetric)
    with pytest.raises(ValueError, match="sum to 1"):
        check_mixing(good * 1.01)
    leaky = np.full((4, 4), 0.25)  # stochastic, but uses the missing diagonals
    check_mixing(leaky)
    with pytest.raises(ValueError, match="off the graph"):
        check_mixing(leaky, adj)
    with pytest.raises(ValueError, match="shape"):
        check_mixing(good, adjacency("ring", 5))


@pytest.mark.parametrize(
    "kind,servers,nonnegative,rho",
    [
        ("ring", 8, True, 0.7445),
        ("ring", 8, False, 0.7445),
        ("ring", 16, True, 0.9267),
        ("grid", 16, True, 0.8244),
        ("star", 8, True, 0.8571),
        ("star", 8, False, 0.7778),
        ("complete", 7, True, 0.0),
        ("complete", 7, False, 0.0),
    ],
)
def test_sdp_reaches_the_known_optima(kind, servers, nonnegative, rho):
    adj = adjacency(kind, servers)
    w, rate = optimal_mixing(adj, nonnegative=nonnegative)
    assert rate == pytest.approx(rho, abs=SDP_TOL)
    assert rate == pytest.approx(consensus_rate(w))
    check_mixing(w, adj)
    if nonnegative:
        assert (w >= 0).all()


def test_sdp_closed_forms():
    # Ring: uniform edge weight w, eigenvalues 1 - 2w(1 - cos(2 pi k / M)).
    servers = 8
    gaps = 1 - np.cos(2 * np.pi * np.arange(1, servers) / servers)
    weight = 2 / (gaps.max() + gaps.min())
    ring_rate = 1 - weight * gaps.min()
    assert optimal_mixing(adjacency("ring", servers))[1] == pytest.approx(
        ring_rate, abs=1e-6
    )
    # Star: nonneg edge weight <= 1/(M-1) gives 1 - 1/(M-1); signed 2/(M+1) gives (M-1)/(M+1).
    star = adjacency("star", servers)
    w, rate = optimal_mixing(star)
    assert rate == pytest.approx(1 - 1 / (servers - 1), abs=1e-6)
    assert w[0, 0] == pytest.approx(0.0, abs=1e-6)  # the hub keeps nothing of itself
    w, rate = optimal_mixing(star, nonnegative=False)
    assert rate == pytest.approx((servers - 1) / (servers + 1), abs=1e-6)
    assert w[0, 0] < 0  # the faster signed optimum needs a negative diagonal


def test_sdp_on_a_long_ring_is_within_one_percent_of_the_gap():
    """The ill-conditioned case: 1 - rho ~ 2e-3 for a ring of 100."""
    servers = 100
    gaps = 1 - np.cos(2 * np.pi * np.arange(1, servers) / servers)
    optimum = 1 - 2 * gaps.min() / (gaps.max() + gaps.min())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _, rate = optimal_mixing(adjacency("ring", servers))
    assert optimum - 1e-9 <= rate <= optimum + 0.01 * (1 - optimum)


@pytest.mark.parametrize(
    "kind,servers,params", [*GRAPHS, ("random-regular", 50, {"degree": 4})]
)
def test_sdp_never_loses_to_local_weights(kind, servers, params):
    adj = adjacency(kind, servers, **params, seed=4)
    nonneg, nonneg_rate = optimal_mixing(adj)
    signed, signed_rate = optimal_mixing(adj, nonnegative=False)
    check_mixing(nonneg, adj)
    check_mixing(signed, adj)
    assert (nonneg >= 0).all()
    # The signed problem relaxes the nonneg one, which relaxes the local rules.
    assert signed_rate <= nonneg_rate + 1e-6
    for method in ("metropolis", "max-degree"):
        assert nonneg_rate <= consensus_rate(mixing_matrix(adj, method)) + 1e-6
    assert np.allclose(mixing_matrix(adj, "sdp"), nonneg, atol=1e-9)


def test_sdp_rejects_disconnected_graphs():
    with pytest.raises(ValueError, match="connected"):
        optimal_mixing(np.kron(np.eye(2, dtype=int), adjacency("complete", 3)))


def test_mixing_names():
    assert MIXINGS == ("metropolis", "max-degree", "uniform", "sdp", "sdp-signed")


# ------------------------------------------------------------ communication


def test_worked_example():
    """100 clients, 10 Mb/s, 50 Mb model, 5 servers on a ring with 20 clients each."""
    ring = degrees(adjacency("ring", 5))
    assert fedavg_round_time(50, 100, 10) == pytest.approx(1000.0)
    assert server_times(50, 100, ring, 10) == pytest.approx([210.0] * 5)
    assert round_time(50, 100, ring, 10) == pytest.approx(200.0 + 10.0)
    assert expected_speedup(50, 100, ring, 10) == pytest.approx(1000 / 210)
    assert expected_speedup(50, 100, ring, 10) == pytest.approx(4.76, abs=0.01)
    assert volumes(50, 100, ring) == {
        "fedavg-total": 10_000.0,
        "fedavg-peak": 10_000.0,
        "pfedavg-total": 10_000.0 + 10 * 50.0,
        "pfedavg-peak": 2 * 20 * 50.0 + 2 * 50.0,
    }


def test_volumes_with_uneven_clients_and_degrees():
    star = degrees(adjacency("star", 4))  # [3, 1, 1, 1]
    v = volumes(2.0, [1, 5, 2, 2], star)
    assert v["fedavg-total"] == v["fedavg-peak"] == 2 * 10 * 2.0
    assert v["pfedavg-total"] == 2 * 10 * 2.0 + 6 * 2.0
    assert v["pfedavg-peak"] == (2 * 5 + 1) * 2.0  # the busiest server, not the hub
    # Even split: 2 (K/M) s + max_i d_i s.
    v = volumes(1.0, 40, star)
    assert v["pfedavg-peak"] == 2 * 10 + 3


def test_split_clients():
    assert split_clients(10, 5).tolist() == [2] * 5
    assert split_clients(11, 4).tolist() == [3, 3, 3, 2]
    with pytest.raises(ValueError, match="clients"):
        split_clients(3, 4)


def test_per_server_bandwidth_and_delays():
    times = server_times(10.0, [1, 2], [1, 1], [10.0, 5.0], beta=1.0)
    assert times.tolist() == pytest.approx([3 * 10 / 10 + 1, 5 * 10 / 5 + 1])
    assert round_time(10.0, [1, 2], [1, 1], [10.0, 5.0], 1.0, delays=[9.0, 0.0]) == 13.0
    assert fedavg_round_time(10.0, 3, 10.0, beta=1.0, delay=2.0) == 6 + 1 + 2
    with pytest.raises(ValueError, match="fedavg_bandwidth"):
        expected_speedup(10.0, [1, 2], [1, 1], [10.0, 5.0])
    assert expected_speedup(
        10.0, [1, 2], [1, 1], [10.0, 5.0], fedavg_bandwidth=10.0
    ) == pytest.approx(6.0 / 10.0)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: volumes(0.0, 10, [1, 1]), "model_size"),
        (lambda: volumes(1.0, 10, []), "degrees"),
        (lambda: volumes(1.0, 10, [1.5, 1]), "degrees"),
        (lambda: volumes(1.0, [5, 5, 5], [1, 1]), "clients"),
        (lambda: volumes(1.0, [5, 0], [1, 1]), "clients"),
        (lambda: volumes(1.0, 1, [1, 1]), "clients"),
        (lambda: server_times(1.0, 10, [1, 1], 0.0), "bandwidth"),
        (lambda: server_times(1.0, 10, [1, 1], [1.0, 1.0, 1.0]), "bandwidth"),
        (lambda: server_times(1.0, 10, [1, 1], 1.0, beta=-1.0), "beta"),
        (lambda: round_time(1.0, 10, [1, 1], 1.0, delays=[1.0]), "delays"),
        (lambda: expected_speedup(1.0, 10, [1, 1], 1.0, delay="gamma"), "delay"),
        (
            lambda: expected_speedup(
                1.0, 10, [1, 1], 1.0, delay="exponential", delay_mean=0.0
            ),
            "mean",
        ),
        (
            lambda: expected_speedup(
                1.0, 10, [1, 1], 1.0, delay="exponential", samples=0
            ),
            "rounds",
        ),
    ],
)
def test_communication_rejects_bad_parameters(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_slowest_delay_sampler_matches_the_maximum_of_exponentials():
    rng = np.random.default_rng(0)
    counts = np.array([1, 4, 30])
    draws = slowest_client_delays(counts, 2.0, 200_000, rng)
    harmonic = np.array([np.sum(1.0 / np.arange(1, n + 1)) for n in counts])
    assert draws.min() >= 0
    assert draws.mean(axis=0) == pytest.approx(2.0 * harmonic, rel=0.01)
    # Same law as drawing every client and taking the max.
    direct = rng.exponential(2.0, size=(200_000, 4)).max(axis=1)
    assert np.quantile(draws[:, 1], [0.1, 0.5, 0.9]) == pytest.approx(
        np.quantile(direct, [0.1, 0.5, 0.9]), rel=0.02
    )


def test_expected_times_with_equal_servers_are_exact():
    """Equal servers: both rounds wait for the slowest of all K clients, E = mu H_K."""
    ring = degrees(adjacency("ring", 5))
    mean_delay = 3.0
    fedavg, pfedavg = expected_round_times(
        50, 100, ring, 10, delay="exponential", delay_mean=mean_delay, samples=100_000
    )
    slowest = mean_delay * np.sum(1.0 / np.arange(1, 101))
    assert fedavg == pytest.approx(1000 + slowest, rel=1e-3)
    assert pfedavg == pytest.approx(210 + slowest, rel=5e-3)


def test_speedup_rises_toward_m_with_clients():
    """Figure 2 of the P-FedAvg paper: M = 5, exponential delays."""
    ring = degrees(adjacency("ring", 5))
    clients = [5, 10, 20, 50, 100, 200, 500, 2000]
    speedups = [
        expected_speedup(
            50, k, ring, 10, delay="exponential", delay_mean=5.0, samples=20_000
        )
        for k in clients
    ]
    assert np.all(np.diff(speedups) > 0)
    assert speedups[0] < 2.5
    assert 4.9 < speedups[-1] < 5.0


def test_speedup_falls_with_client_compute_time():
    ring = degrees(adjacency("ring", 5))
    betas = [0.0, 10.0, 100.0, 1000.0, 10_000.0]
    speedups = [
        expected_speedup(
            50,
            100,
            ring,
            10,
            beta=b,
            delay="exponential",
            delay_mean=5.0,
            samples=20_000,
        )
        for b in betas
    ]
    assert np.all(np.diff(speedups) < 0)
    assert speedups[0] > 4.0
    assert 1.0 < speedups[-1] < 1.2


def test_speedup_is_reproducible_with_a_seed():
    ring = degrees(adjacency("ring", 5))

    def speedup(seed):
        return expected_speedup(
            50,
            50,
            ring,
            10,
            delay="exponential",
            delay_mean=5.0,
            samples=1000,
            seed=seed,
        )

    assert speedup(1) == speedup(1)
    assert speedup(1) != speedup(2)


# --------------------------------------------------------------------- CLI


def test_cli_worked_example(tmp_path, capsys):
    plot = tmp_path / "speedup.png"
    assert (
        main(
            [
                "--servers",
                "5",
                "--clients",
                "100",
                "--max-clients",
                "200",
                "--plot",
                str(plot),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "rho(W)" in out and "W =" in out
    assert "pfedavg-peak   2100" in out
    assert "FedAvg 1000 s, P-FedAvg 210 s" in out
    assert "expected speed-up: 4.762" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_sdp_with_delays(tmp_path, capsys):
    plot = tmp_path / "curve.png"
    argv = [
        "--topology", "star", "--servers", "8", "--mixing", "sdp-signed",
        "--delay", "exponential", "--delay-mean", "2", "--samples", "500",
        "--beta", "5", "--max-clients", "80", "--plot", str(plot),
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "rho(W) = ||W - 11^T/M||_2 = 0.7778" in out
    assert plot.stat().st_size > 0


def test_cli_reports_bad_parameters(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "--topology",
                "random-regular",
                "--servers",
                "7",
                "--degree",
                "3",
                "--plot",
                str(tmp_path / "x.png"),
            ]
        )
    assert exit_info.value.code == 2
    assert "even" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(
            ["--servers", "10", "--max-clients", "5", "--plot", str(tmp_path / "x.png")]
        )
