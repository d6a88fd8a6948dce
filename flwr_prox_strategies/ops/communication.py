r"""Per-round traffic and wall-clock time of FedAvg against P-FedAvg.

A model of size :math:`s`, :math:`\lvert S\rvert` clients a round,
:math:`\lvert S_i\rvert` of them on server :math:`i` of degree :math:`d_i` and
bandwidth :math:`b_i`: the volumes per round, each server's round time
:math:`T_i` (transfers, compute :math:`\beta`, the slowest client's delay, mixing)
and the expected speed-up :math:`\mathbb E[T^{\mathrm{FedAvg}}] /
\mathbb E[T^{\mathrm{P}}]`, by Monte Carlo over the delays (``DELAYS``). The model,
its delay law and its limits: the P-FedAvg page of the documentation. Example:
:math:`\lvert S\rvert = 100`, :math:`s = 50` Mb, :math:`b = 10` Mb/s, five servers
on a ring: FedAvg takes 1000 s a round, P-FedAvg 210 s, a speed-up of 4.76.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

DELAYS = ("none", "exponential")

# A total |S| (split evenly over the servers) or one count |S_i| per server.
ClientCounts = int | Sequence[int] | NDArray[np.integer]


def _positive(value: float, name: str) -> float:
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def _nonnegative(value: float, name: str) -> float:
    if not (np.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a non-negative finite number, got {value!r}")
    return float(value)


def _degrees(degrees: ArrayLike) -> NDArray[np.int_]:
    values = np.asarray(degrees)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(
            f"degrees must be a non-empty 1-D sequence (one per server), got "
            f"shape {values.shape}"
        )
    if not (np.issubdtype(values.dtype, np.integer) and (values >= 0).all()):
        raise ValueError("degrees must be non-negative integers")
    return values.astype(int)


def split_clients(clients: int, servers: int) -> NDArray[np.int_]:
    r"""Spread ``clients`` over ``servers`` as evenly as possible.

    Parameters
    ----------
    clients : int
        Total :math:`\lvert S\rvert \ge` ``servers`` (every server needs a client).
    servers : int
        Number of servers :math:`M \ge 1`.

    Returns
    -------
    ndarray of int, shape (servers,)
        :math:`\lvert S_i\rvert`, the first ``clients mod M`` servers taking one
        extra client.
    """
    if not (isinstance(servers, int | np.integer) and servers >= 1):
        raise ValueError(f"servers must be an integer >= 1, got {servers!r}")
    if not (isinstance(clients, int | np.integer) and clients >= servers):
        raise ValueError(
            f"clients must be an integer >= servers = {servers} (every server "
            f"needs a client), got {clients!r}"
        )
    base, extra = divmod(int(clients), int(servers))
    return base + (np.arange(servers) < extra).astype(int)


def _clients_per_server(clients: ClientCounts, servers: int) -> NDArray:
    """``K_i`` from a total (split evenly) or from explicit per-server counts."""
    if isinstance(clients, int | np.integer):
        return split_clients(int(clients), servers)
    counts = np.asarray(clients)
    if counts.shape != (servers,):
        raise ValueError(
            f"clients must be an int or one count per server ({servers}), got "
            f"shape {counts.shape}"
        )
    if not (np.issubdtype(counts.dtype, np.integer) and (counts >= 1).all()):
        raise ValueError("clients per server must be integers >= 1")
    return counts.astype(int)


def _bandwidths(bandwidth: float | ArrayLike, servers: int) -> NDArray[np.float64]:
    values = np.asarray(bandwidth, dtype=float)
    if values.shape not in ((), (servers,)):
        raise ValueError(
            f"bandwidth must be one number or one per server ({servers}), got "
            f"shape {values.shape}"
        )
    values = np.broadcast_to(values, (servers,))
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise ValueError("bandwidth must be positive and finite")
    return values


def volumes(
    model_size: float, clients: ClientCounts, degrees: ArrayLike
) -> dict[str, float]:
    r"""Total and peak (busiest server) traffic per round, in units of the model.

    Parameters
    ----------
    model_size : float
        Model size :math:`s > 0`.
    clients : int or sequence of int
        Total :math:`\lvert S\rvert` (split evenly by :func:`split_clients`) or the
        per-server counts :math:`\lvert S_i\rvert`.
    degrees : array_like of int, shape (M,)
        Degrees :math:`d_i` of the servers in the overlay graph.

    Returns
    -------
    dict
        ``"fedavg-total"``, ``"fedavg-peak"`` (both :math:`2\lvert S\rvert s`),
        ``"pfedavg-total"`` (:math:`2\lvert S\rvert s + \sum_i d_i s`) and
        ``"pfedavg-peak"``
        (:math:`\max_i (2\lvert S_i\rvert + d_i) s`).
    """
    size = _positive(model_size, "model_size")
    degree = _degrees(degrees)
    counts = _clients_per_server(clients, len(degree))
    client_traffic = 2.0 * float(counts.sum()) * size
    return {
        "fedavg-total": client_traffic,
        "fedavg-peak": client_traffic,
        "pfedavg-total": client_traffic + float(degree.sum()) * size,
        "pfedavg-peak": float((2 * counts + degree).max()) * size,
    }


def server_times(
    model_size: float,
    clients: ClientCounts,
    degrees: ArrayLike,
    bandwidth: float | ArrayLike,
    beta: float = 0.0,
) -> NDArray[np.float64]:
    r"""Each server's round time without delays, :math:`(2|S_i| + d_i)s/b_i + \beta`.

    Parameters
    ----------
    model_size : float
        Model size :math:`s > 0`.
    clients : int or sequence of int
        Total :math:`\lvert S\rvert` or per-server counts :math:`\lvert S_i\rvert`.
    degrees : array_like of int, shape (M,)
        Server degrees :math:`d_i`.
    bandwidth : float or array_like, shape (M,)
        Link bandwidth :math:`b_i > 0` of every server (or one for all).
    beta : float
        Client compute time per round, :math:`\beta \ge 0` seconds.

    Returns
    -------
    ndarray of float64, shape (M,)
    """
    size = _positive(model_size, "model_size")
    degree = _degrees(degrees)
    counts = _clients_per_server(clients, len(degree))
    links = _bandwidths(bandwidth, len(degree))
    compute = _nonnegative(beta, "beta")
    return (2 * counts + degree) * size / links + compute


def round_time(
    model_size: float,
    clients: ClientCounts,
    degrees: ArrayLike,
    bandwidth: float | ArrayLike,
    beta: float = 0.0,
    delays: ArrayLike | None = None,
) -> float:
    r"""P-FedAvg's synchronous round time :math:`\max_i T_i`.

    Parameters
    ----------
    model_size, clients, degrees, bandwidth, beta
        As in :func:`server_times`.
    delays : array_like, shape (M,), optional
        Delay of each server's slowest client this round (default none).

    Returns
    -------
    float
        Seconds. ``degrees=[0]`` gives FedAvg (see :func:`fedavg_round_time`).
    """
    times = server_times(model_size, clients, degrees, bandwidth, beta)
    if delays is not None:
        extra = np.asarray(delays, dtype=float)
        if extra.shape != times.shape or not (extra >= 0).all():
            raise ValueError(
                f"delays must be {times.shape[0]} non-negative numbers (one per "
                f"server), got shape {extra.shape}"
            )
        times = times + extra
    return float(times.max())


def fedavg_round_time(
    model_size: float,
    clients: int,
    bandwidth: float,
    beta: float = 0.0,
    delay: float = 0.0,
) -> float:
    r"""FedAvg's round time :math:`2\lvert S\rvert s/B + \beta + \delta` (one server).

    Parameters
    ----------
    model_size : float
        Model size :math:`s > 0`.
    clients : int
        Number of clients :math:`\lvert S\rvert \ge 1`.
    bandwidth : float
        The server's bandwidth :math:`b > 0`.
    beta : float
        Client compute time :math:`\beta \ge 0`.
    delay : float
        Delay :math:`\delta \ge 0` of the slowest client.

    Returns
    -------
    float
        Seconds.
    """
    return round_time(model_size, clients, [0], bandwidth, beta, [delay])


def slowest_client_delays(
    clients_per_server: ArrayLike,
    mean: float,
    rounds: int,
    rng: np.random.Generator,
) -> NDArray[np.float64]:
    r"""Per round and server, the largest of its clients' exponential delays.

    The maximum of :math:`n` i.i.d. exponentials of mean :math:`\mu` is
    :math:`-\mu\log(1 - U^{1/n})` for :math:`U` uniform on [0, 1).

    Parameters
    ----------
    clients_per_server : array_like of int, shape (M,)
        :math:`\lvert S_i\rvert \ge 1`.
    mean : float
        Mean delay :math:`\mu > 0` of one client.
    rounds : int
        Number of rounds to draw.
    rng : numpy.random.Generator
        Source of randomness.

    Returns
    -------
    ndarray of float64, shape (rounds, M)
    """
    counts = np.asarray(clients_per_server, dtype=float)
    scale = _positive(mean, "mean")
    if not (isinstance(rounds, int | np.integer) and rounds >= 1):
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
    uniform = rng.random((int(rounds), counts.size))
    # 1 - U^(1/n) = -expm1(log(U)/n) keeps its digits when n is large; U = 0
    # gives log 0 = -inf and a delay of exactly 0, a legitimate draw.
    with np.errstate(divide="ignore"):
        return -scale * np.log(-np.expm1(np.log(uniform) / counts))


def expected_round_times(
    model_size: float,
    clients: ClientCounts,
    degrees: ArrayLike,
    bandwidth: float | ArrayLike,
    beta: float = 0.0,
    delay: str | None = None,
    delay_mean: float = 1.0,
    samples: int = 10_000,
    seed: int = 0,
    fedavg_bandwidth: float | None = None,
) -> tuple[float, float]:
    r"""Return the expected round times of FedAvg and P-FedAvg, same clients.

    Parameters
    ----------
    model_size, clients, degrees, bandwidth, beta
        As in :func:`server_times`; FedAvg serves all
        :math:`\lvert S\rvert = \sum_i \lvert S_i\rvert` clients.
    delay : {None, "none", "exponential"}
        Law of the client delays (the P-FedAvg page of the documentation).
    delay_mean : float
        Mean delay :math:`\mu > 0` of one client (exponential only).
    samples : int
        Monte Carlo rounds (exponential only).
    seed : int
        Seed of the Monte Carlo draws.
    fedavg_bandwidth : float, optional
        FedAvg's server bandwidth; defaults to ``bandwidth``, which must then be
        a single number.

    Returns
    -------
    tuple of float
        :math:`(\mathbb E[T^{\mathrm{FedAvg}}], \mathbb E[T^{\mathrm{P}}])`
        in seconds.
    """
    law = "none" if delay is None else delay
    if law not in DELAYS:
        raise ValueError(f"delay must be None or one of {DELAYS}, got {delay!r}")
    if fedavg_bandwidth is None:
        if np.ndim(bandwidth) != 0:
            raise ValueError(
                "fedavg_bandwidth is needed when bandwidth is given per server"
            )
        fedavg_bandwidth = float(np.asarray(bandwidth))
    degree = _degrees(degrees)
    counts = _clients_per_server(clients, len(degree))
    pfedavg = server_times(model_size, counts, degree, bandwidth, beta)
    fedavg = fedavg_round_time(model_size, int(counts.sum()), fedavg_bandwidth, beta)
    if law == "none":
        return fedavg, float(pfedavg.max())
    rng = np.random.default_rng(seed)
    slowest = slowest_client_delays(counts, delay_mean, samples, rng)
    fedavg_times = fedavg + slowest.max(axis=1)
    pfedavg_times = (pfedavg + slowest).max(axis=1)
    return float(fedavg_times.mean()), float(pfedavg_times.mean())


def expected_speedup(*args: Any, **kwargs: Any) -> float:
    r"""Return the expected speed-up of P-FedAvg over FedAvg.

    .. math::
        S = \mathbb E[T^{\mathrm{FedAvg}}] / \mathbb E[T^{\mathrm{P}}].

    Parameters are those of :func:`expected_round_times`.

    Returns
    -------
    float
        Above 1 when P-FedAvg's rounds are shorter; tends to :math:`M` as the
        number of clients grows (equal bandwidths).
    """
    fedavg, pfedavg = expected_round_times(*args, **kwargs)
    return fedavg / pfedavg


# help() and the API reference show the parameters it passes on.
expected_speedup.__signature__ = inspect.signature(  # type: ignore[attr-defined]
    expected_round_times
).replace(return_annotation="float")
