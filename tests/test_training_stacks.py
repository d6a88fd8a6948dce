"""The rule acts in every training stack, and says so only when it did.

Closure-based steps (Lightning's automatic optimisation, LBFGS), gradient
accumulation, clipping, AMP's GradScaler, schedulers, half precision and a
model moved after the rule was built: each against a hand computation or a
closed form, and each way a term can miss the update measured in the reply.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_prox_strategies import (
    FedDyn,
    FedDynRule,
    FedProx,
    FedProxRule,
    Scaffold,
    ScaffoldRule,
)
from flwr_prox_strategies.core.client.steps import innermost_optimizer
from flwr_prox_strategies.core.server.outcome import NoRoundAggregatedError
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid

from .helpers import context, train_message
from .lsq import LeastSquares, half_sse, rule_app


@pytest.fixture(scope="module")
def problem() -> LeastSquares:
    return LeastSquares()


def fedprox_rule(problem, w_t: np.ndarray, mu: float, k: int = 1):
    model = torch.nn.Linear(problem.dim, 1, bias=False)
    msg = train_message(
        [w_t.reshape(1, -1).astype(np.float32)],
        {"proximal-mu": mu, "server-round": 1},
    )
    return model, FedProxRule.from_message(msg, context(k), model)


def scaffold_rule(problem, c: np.ndarray, model=None, **config):
    """SCAFFOLD from zero with server control ``c``, on a fresh model unless given."""
    model = torch.nn.Linear(problem.dim, 1, bias=False) if model is None else model
    msg = train_message(
        [np.zeros((1, problem.dim), np.float32)],
        {"server-round": 1, **config},
        {"control": [c]},
    )
    return model, ScaffoldRule.from_message(msg, context(), model)


def data(problem, k: int = 1):
    return torch.from_numpy(problem.a[k]), torch.from_numpy(problem.b[k])


def attached_sgd(problem, mu: float, lr: float):
    """FedProx anchored at linspace(-1, 1) on client 1, attached to SGD; its data."""
    w_t = np.linspace(-1, 1, problem.dim)
    model, rule = fedprox_rule(problem, w_t, mu)
    optimizer = rule.attach(torch.optim.SGD(model.parameters(), lr=lr))
    return w_t, model, rule, optimizer, data(problem)


def plain_steps(optimizer, model, x, y, steps: int) -> None:
    """``steps`` full-batch steps of the half squared error: zero, backward, step."""
    for _ in range(steps):
        optimizer.zero_grad()
        half_sse(model(x), y).backward()
        optimizer.step()


def fedprox_by_hand(problem, w_t, mu, lr, steps, k=1) -> np.ndarray:
    a, b = problem.a[k].astype(np.float64), problem.b[k].astype(np.float64)
    w = w_t.astype(np.float32).astype(np.float64)
    for _ in range(steps):
        w = w - lr * (a.T @ (a @ w - b) + mu * (w - w_t))
    return w


def closure_of(optimizer, model, x, y):
    """The closure Lightning's automatic optimisation passes: zero, forward, backward."""

    def closure():
        optimizer.zero_grad()  # inside step, after the pre-hooks
        loss = half_sse(model(x), y)
        loss.backward()
        return loss

    return closure


def metrics_of(rule, **kwargs) -> dict:
    return dict(rule.reply(num_examples=20, **kwargs).content["metrics"])


# ------------------------------------------------------------------ closures
def test_attach_adds_the_term_inside_a_closure_step(problem):
    """optimizer.step(closure): the term comes after the closure's backward."""
    mu, lr = 2.0, 0.02
    w_t, model, rule, optimizer, (x, y) = attached_sgd(problem, mu, lr)

    closure = closure_of(optimizer, model, x, y)

    for _ in range(4):
        optimizer.step(closure)
    np.testing.assert_allclose(
        model.weight.detach().numpy()[0],
        fedprox_by_hand(problem, w_t, mu, lr, 4),
        rtol=1e-5,
        atol=1e-6,
    )
    metrics = metrics_of(rule)
    assert metrics["proximal-mu-applied"] == metrics["local-steps"] == 4
    assert metrics["term-lost-steps"] == metrics["term-missing-steps"] == 0


def test_a_closure_step_returns_the_penalised_loss(problem):
    """What the closure returns to the optimiser includes the term's value."""
    w_t = np.linspace(-1, 1, problem.dim)
    model, rule = fedprox_rule(problem, w_t, 3.0)
    with torch.no_grad():
        model.weight.add_(0.5)  # away from the anchor: a non-zero penalty
    optimizer = rule.attach(torch.optim.SGD(model.parameters(), lr=0.0))
    x, y = data(problem)
    plain = float(half_sse(model(x), y))

    closure = closure_of(optimizer, model, x, y)

    returned = float(optimizer.step(closure))
    penalty = 0.5 * 3.0 * 0.25 * problem.dim
    assert returned == pytest.approx(plain + penalty, rel=1e-5)


def test_lbfgs_reaches_fedprox_closed_form_optimum(problem):
    """LBFGS with line search on f_k + mu/2||w - w_t||^2: the exact minimiser."""
    mu = 0.5
    k = 2
    w_t = np.linspace(-1, 1, problem.dim)
    model, rule = fedprox_rule(problem, w_t, mu, k=k)
    optimizer = rule.attach(
        torch.optim.LBFGS(
            model.parameters(), lr=1.0, max_iter=100, line_search_fn="strong_wolfe"
        )
    )
    x, y = data(problem, k)

    closure = closure_of(optimizer, model, x, y)

    optimizer.step(closure)
    a, b = problem.a[k].astype(np.float64), problem.b[k].astype(np.float64)
    w_t32 = w_t.astype(np.float32).astype(np.float64)
    optimum = np.linalg.solve(a.T @ a + mu * np.eye(problem.dim), a.T @ b + mu * w_t32)
    np.testing.assert_allclose(model.weight.detach().numpy()[0], optimum, atol=1e-4)
    metrics = metrics_of(rule)
    assert metrics["proximal-mu-applied"] == metrics["local-steps"] == 1


def test_the_old_route_in_a_closure_step_is_measured_as_lost(problem):
    """The term added before step(closure) is wiped: the reply says 0 of 3."""
    model, rule = fedprox_rule(problem, np.zeros(problem.dim), 1000.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = data(problem)

    closure = closure_of(optimizer, model, x, y)

    for _ in range(3):
        rule.add_gradient()  # where a step pre-hook used to put it
        optimizer.step(closure)
    metrics = metrics_of(rule)
    assert metrics["proximal-mu-applied"] == 0
    assert metrics["local-steps"] == 3 and metrics["term-lost-steps"] == 3


def test_accumulation_gets_the_term_once_per_step(problem):
    """Two backward passes, one step: the term is added once, after both."""
    mu, lr = 1.5, 0.01
    w_t, model, rule, optimizer, (x, y) = attached_sgd(problem, mu, lr)
    optimizer.zero_grad()
    for half in (slice(0, 10), slice(10, 20)):
        half_sse(model(x[half]), y[half]).backward()
    optimizer.step()
    a, b = problem.a[1].astype(np.float64), problem.b[1].astype(np.float64)
    w = w_t.astype(np.float32).astype(np.float64)
    expected = w - lr * (a.T @ (a @ w - b) + mu * (w - w_t))
    np.testing.assert_allclose(
        model.weight.detach().numpy()[0], expected, rtol=1e-5, atol=1e-6
    )
    assert metrics_of(rule)["proximal-mu-applied"] == 1


def test_clipping_before_or_after_the_term(problem):
    """add_gradient then clip: the term is clipped; attach: added after clipping."""
    mu, lr, bound = 5.0, 0.1, 0.01
    w_t = np.linspace(-1, 1, problem.dim)
    x, y = data(problem)
    a, b = problem.a[1].astype(np.float64), problem.b[1].astype(np.float64)
    w = w_t.astype(np.float32).astype(np.float64)
    with torch.no_grad():
        start = torch.from_numpy(w_t.astype(np.float32) + 0.1).reshape(1, -1)

    def clip(g):
        n = np.linalg.norm(g)
        return g * min(1.0, bound / (n + 1e-6))

    w0 = start.numpy()[0].astype(np.float64)
    data_grad = a.T @ (a @ w0 - b)
    term = mu * (w0 - w)
    for route in ("add_gradient", "attach"):
        model, rule = fedprox_rule(problem, w_t, mu)
        with torch.no_grad():
            model.weight.copy_(start)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        if route == "attach":
            rule.attach(optimizer)
        optimizer.zero_grad()
        half_sse(model(x), y).backward()
        if route == "add_gradient":
            rule.add_gradient()
        torch.nn.utils.clip_grad_norm_(model.parameters(), bound)
        optimizer.step()
        step = (
            clip(data_grad + term)
            if route == "add_gradient"
            else clip(data_grad) + term
        )
        np.testing.assert_allclose(
            model.weight.detach().numpy()[0], w0 - lr * step, rtol=1e-4, atol=1e-6
        )
        assert metrics_of(rule)["proximal-mu-applied"] == 1, route


def test_grad_scaler_unscales_before_the_term(problem):
    """AMP's GradScaler: the update equals the unscaled one, term included."""
    mu, lr = 2.0, 0.02
    w_t = np.linspace(-1, 1, problem.dim)
    x, y = data(problem)
    results = []
    for scaled in (False, True):
        model, rule = fedprox_rule(problem, w_t, mu)
        optimizer = rule.attach(torch.optim.SGD(model.parameters(), lr=lr))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=scaled)
        for _ in range(3):
            optimizer.zero_grad()
            scaler.scale(half_sse(model(x), y)).backward()
            scaler.step(optimizer)
            scaler.update()
        results.append(model.weight.detach().numpy()[0].copy())
        assert metrics_of(rule)["proximal-mu-applied"] == 3
    np.testing.assert_array_equal(results[0], results[1])  # powers of two: exact
    np.testing.assert_allclose(
        results[0], fedprox_by_hand(problem, w_t, mu, lr, 3), rtol=1e-5, atol=1e-6
    )


# ------------------------------------------------------------ what is missed
def test_stepping_another_optimizer_is_measured_as_missing(problem):
    model, rule = fedprox_rule(problem, np.zeros(problem.dim), 1.0)
    rule.attach(torch.optim.SGD(model.parameters(), lr=0.01))
    stepped = torch.optim.SGD(model.parameters(), lr=0.01)  # the one the loop uses
    x, y = data(problem)
    plain_steps(stepped, model, x, y, 2)
    metrics = metrics_of(rule)
    assert metrics["local-steps"] == 2
    assert metrics["proximal-mu-applied"] == 0 and metrics["term-missing-steps"] == 2


def test_no_rule_call_at_all_is_measured(problem):
    """The user forgot attach and add_gradient: the steps are still counted."""
    model, rule = fedprox_rule(problem, np.zeros(problem.dim), 1.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = data(problem)
    plain_steps(optimizer, model, x, y, 3)
    metrics = metrics_of(rule)
    assert (metrics["local-steps"], metrics["proximal-mu-applied"]) == (3, 0)


def test_add_gradient_twice_in_one_step_adds_once(problem, caplog):
    mu, lr = 2.0, 0.02
    w_t, model, rule, optimizer, (x, y) = attached_sgd(problem, mu, lr)
    optimizer.zero_grad()
    half_sse(model(x), y).backward()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        rule.add_gradient()
        rule.add_gradient()
    optimizer.step()  # the hook finds the term there: nothing more
    np.testing.assert_allclose(
        model.weight.detach().numpy()[0],
        fedprox_by_hand(problem, w_t, mu, lr, 1),
        rtol=1e-5,
        atol=1e-6,
    )
    assert "called again before the optimiser's update" in caplog.text


def test_a_loop_without_an_optimizer_counts_its_updates(problem):
    """A manual update: each add_gradient followed by a parameter change counts."""
    mu, lr = 1.0, 0.05
    w_t = np.linspace(-1, 1, problem.dim)
    model, rule = fedprox_rule(problem, w_t, mu)
    x, y = data(problem)
    for step in range(3):
        model.zero_grad()
        half_sse(model(x), y).backward()
        rule.add_gradient(lr=lr)
        if step == 0:  # an update in place
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(lr * p.grad)
        elif step == 1:  # an update through .data (the version stays)
            for p in model.parameters():
                p.data -= lr * p.grad
        # the last step forgets the update
    metrics = metrics_of(rule)
    assert (metrics["local-steps"], metrics["proximal-mu-applied"]) == (3, 2)


# ------------------------------------------------------ what a route requires
def test_scaffold_refuses_adam_whatever_the_route(problem):
    """attach, add_gradient or no call at all: the first Adam step is refused."""
    c = np.full((1, problem.dim), 0.3, np.float32)
    x, y = data(problem)
    for route in ("attach", "add_gradient", "none"):
        model, rule = scaffold_rule(problem, c)
        adam = torch.optim.Adam(model.parameters(), lr=0.01)
        if route == "attach":
            with pytest.raises(ValueError, match=r"needs torch\.optim\.SGD"):
                rule.attach(adam)
            continue
        half_sse(model(x), y).backward()
        if route == "add_gradient":
            rule.add_gradient(lr=0.01)
        with pytest.raises(ValueError, match="got Adam"):
            adam.step()
        rule.close()


def test_scaffold_option_two_divides_by_the_rates_applied(problem):
    """A scheduler halves the rate each step: K*eta is the sum of the rates."""
    lr = 0.1
    c = np.full((1, problem.dim), 0.3, np.float32)
    model = torch.nn.Linear(problem.dim, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    _, rule = scaffold_rule(problem, c, model, **{"scaffold-control-lr": "round"})
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    x, y = data(problem, 2)
    for _ in range(3):
        optimizer.zero_grad()
        half_sse(model(x), y).backward()
        rule.add_gradient()  # the callback route: no lr given, none attached
        optimizer.step()
        scheduler.step()
    a, b = problem.a[2].astype(np.float64), problem.b[2].astype(np.float64)
    w, rates = np.zeros(problem.dim), [0.1, 0.05, 0.025]
    for rate in rates:
        w = w - rate * (a.T @ (a @ w - b) + c[0])
    reply = rule.reply(num_examples=20)
    delta = reply.content["control-delta"].to_numpy_ndarrays()[0][0]
    np.testing.assert_allclose(delta, -c[0] + (0 - w) / sum(rates), rtol=1e-4)
    assert reply.content["metrics"]["scaffold-applied"] == 3


# ------------------------------------------------------- dtypes and devices
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_reply_in_the_servers_dtype(problem, dtype):
    """A model converted after from_message (Lightning's bf16-true): float32 replies."""
    c = np.full((1, problem.dim), 0.3, np.float32)
    model, rule = scaffold_rule(problem, c)
    model.to(dtype)  # same Parameter objects, new dtype, as Lightning converts
    optimizer = rule.attach(torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = data(problem, 2)
    for _ in range(2):
        optimizer.zero_grad()
        half_sse(model(x.to(dtype)).float(), y).backward()
        optimizer.step()
    reply = rule.reply(num_examples=20)
    for name in ("arrays", "control-delta"):
        [array] = reply.content[name].to_numpy_ndarrays()
        assert array.dtype == np.float32 and np.isfinite(array).all(), name
    assert reply.content["metrics"]["scaffold-applied"] == 2
    [pending] = rule.state.get("pending:scaffold-control")  # c_i+, until confirmed
    assert pending.dtype == np.float32


def test_the_rule_follows_replaced_parameters(problem):
    """A conversion that replaces the Parameter objects: the rule re-points."""
    mu, lr = 2.0, 0.02
    w_t = np.linspace(-1, 1, problem.dim)
    model, rule = fedprox_rule(problem, w_t, mu)
    old = model.weight
    model.weight = torch.nn.Parameter(old.detach().clone())  # a new object
    optimizer = rule.attach(torch.optim.SGD(model.parameters(), lr=lr))
    x, y = data(problem)
    plain_steps(optimizer, model, x, y, 2)
    np.testing.assert_allclose(
        model.weight.detach().numpy()[0],
        fedprox_by_hand(problem, w_t, mu, lr, 2),
        rtol=1e-5,
        atol=1e-6,
    )
    assert metrics_of(rule)["proximal-mu-applied"] == 2


def test_the_rule_follows_a_device_move_before_the_first_step(problem):
    """Lightning moves the model inside fit(): the anchor and the term follow."""
    model, rule = fedprox_rule(problem, np.zeros(problem.dim), 1.0)
    model.to("meta")  # the only other device on a CPU machine
    rule.wiring.follow_model()
    assert all(a.device.type == "meta" for a in rule.anchor)
    assert all(a.device.type == "meta" for a in rule.term.anchor)
    assert rule.params[0] is model.weight


def test_the_rules_term_shares_the_rules_anchor(problem):
    """One copy of the global model a client, not two (the term's is the rule's)."""
    model, rule = fedprox_rule(problem, np.linspace(-1, 1, problem.dim), 0.5)
    assert [a.data_ptr() for a in rule.term.anchor] == [
        a.data_ptr() for a in rule.anchor
    ]
    assert rule.anchor[0].data_ptr() != model.weight.data_ptr()


def test_innermost_optimizer_unwraps_wrappers():
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)

    class Wrapper:  # as accelerate's and Lightning's wrappers keep theirs
        def __init__(self, optimizer):
            self.optimizer = optimizer
            self.param_groups = optimizer.param_groups

        def step(self, closure=None):
            return self.optimizer.step(closure)

    assert innermost_optimizer(Wrapper(Wrapper(sgd))) is sgd
    assert innermost_optimizer(sgd) is sgd


# --------------------------------------------------------------- the server
def own_app(problem, rule_cls, route: str) -> ClientApp:
    """A user's closure-based loop: the rule attached, or added before the step."""

    def train(k: int, model: torch.nn.Module, rule) -> Message:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        if route == "attach":
            rule.attach(optimizer)
        x, y = torch.from_numpy(problem.a[k]), torch.from_numpy(problem.b[k])

        closure = closure_of(optimizer, model, x, y)

        for _ in range(3):
            if route == "too-early":
                rule.add_gradient()
            optimizer.step(closure)
        return rule.reply(num_examples=len(y))

    return rule_app(problem, rule_cls, train)


def run(problem, strategy, app, rounds=2):
    grid = InProcessGrid(app, num_nodes=len(problem.a))
    return strategy.start(
        grid=grid, initial_arrays=problem.initial(), num_rounds=rounds
    )


def run_refused(caplog, problem, strategy, app, rounds=2) -> None:
    """A run that aggregates no round, its warnings captured."""
    with (
        caplog.at_level(logging.WARNING, logger="flwr"),
        pytest.raises(NoRoundAggregatedError),
    ):
        run(problem, strategy, app, rounds=rounds)


@pytest.mark.parametrize(
    ("strategy", "rule_cls"),
    [
        (lambda **kw: FedProx(mu=1.0, **kw), FedProxRule),
        (lambda **kw: Scaffold(num_clients=4, **kw), ScaffoldRule),
        (lambda **kw: FedDyn(alpha=0.1, num_clients=4, **kw), FedDynRule),
    ],
    ids=["fedprox", "scaffold", "feddyn"],
)
def test_the_server_hears_when_the_term_missed_the_update(
    problem, strategy, rule_cls, caplog
):
    """Warned once with the cause and the fix; strict=True rejects; attach is clean."""
    with caplog.at_level(logging.WARNING, logger="flwr"):
        result = run(
            problem,
            strategy(fraction_evaluate=0.0),
            own_app(problem, rule_cls, "too-early"),
        )
    counts = [
        m["replies-term-incomplete"] for m in result.train_metrics_clientapp.values()
    ]
    assert counts == [4, 4]
    warnings = [
        r.getMessage() for r in caplog.records if "local steps" in r.getMessage()
    ]
    assert len(warnings) == 1, warnings
    assert "in 0 of the client's 3 local steps" in warnings[0]
    assert "rule.attach(optimizer)" in warnings[0]
    caplog.clear()
    run_refused(
        caplog,
        problem,
        strategy(fraction_evaluate=0.0, strict=True),
        own_app(problem, rule_cls, "too-early"),
    )
    assert "rule-not-applied" in caplog.text
    clean = run(
        problem, strategy(fraction_evaluate=0.0), own_app(problem, rule_cls, "attach")
    )
    for metrics in clean.train_metrics_clientapp.values():
        assert metrics["replies-term-incomplete"] == 0
        assert metrics["replies-valid"] == 4


def model_only_app() -> ClientApp:
    """A ClientApp of the user's own that replies the model and num-examples only."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        content = RecordDict(
            {
                "arrays": msg.content["arrays"],
                "metrics": MetricRecord({"num-examples": 5}),
            }
        )
        return Message(content, reply_to=msg)

    return app


def test_an_own_scaffold_reply_is_told_how_to_fix_it(problem, caplog):
    """A reply without control-delta names rule.reply, as FedDyn's does."""
    app = model_only_app()

    run_refused(
        caplog, problem, Scaffold(num_clients=4, fraction_evaluate=0.0), app, rounds=1
    )
    assert "expected ['arrays', 'control-delta']" in caplog.text
    assert "return rule.reply(...)" in caplog.text


def test_a_rule_never_replied_leaves_no_hook_behind(problem):
    """A round that raised before its reply: its rule is freed, its hooks go."""
    import gc

    from torch.optim import optimizer as torch_optimizer

    hooks = torch_optimizer._global_optimizer_pre_hooks
    w_t = np.zeros(problem.dim)
    dropped: set[int] = set()
    for _ in range(5):
        before = set(hooks)
        fedprox_rule(problem, w_t, 1.0)  # built, never replied, dropped
        dropped |= set(hooks) - before
    assert len(dropped) == 5
    gc.collect()
    model, rule = fedprox_rule(problem, w_t, 1.0)
    assert not dropped & set(hooks)  # the dropped rules' hooks were removed
    optimizer = rule.attach(torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = data(problem)
    optimizer.zero_grad()
    half_sse(model(x), y).backward()
    optimizer.step()
    assert rule.counts.steps == rule.counts.applied == 1
    mine = set(hooks)
    rule.close()
    assert len(mine - set(hooks)) == 1  # closing removes its own at once


def test_a_reply_in_another_dtype_is_told_what_the_server_accepts(problem, caplog):
    """A half-precision client replying in its own dtype: rejected, saying which."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        arrays = [
            a.astype(np.float16) for a in msg.content["arrays"].to_numpy_ndarrays()
        ]
        metrics = {"num-examples": 5, "proximal-mu-applied": 1, "local-steps": 1}
        content = RecordDict(
            {"arrays": ArrayRecord(arrays), "metrics": MetricRecord(metrics)}
        )
        return Message(content, reply_to=msg)

    run_refused(caplog, problem, FedProx(mu=0.1, fraction_evaluate=0.0), app, rounds=1)
    assert "has dtype float16, expected float32" in caplog.text
    assert "replies in the dtypes it received" in caplog.text


def test_an_own_reply_is_not_said_to_skip_the_term(problem, caplog):
    """Without rule.reply the server cannot know: it says so, not 'not applied'."""
    app = model_only_app()

    with caplog.at_level(logging.WARNING, logger="flwr"):
        run(problem, FedProx(mu=0.1, fraction_evaluate=0.0), app, rounds=1)
    assert "so nothing says their clients apply FedProx's proximal term" in caplog.text
    assert "return rule.reply(...)" in caplog.text


# ------------------------------------------------------- every order of calls
# One step of FedProx from w_t + 0.1, in each order of zero_grad (Z),
# add_gradient (A), backward (B, twice for accumulation: B1 B2) and step (S),
# with and without attach: the update against the hand computation, and the
# counters. "term" says how many times the term is in the update (0: lost or
# never added).
ORDERS = [
    # (order, attach, term in update, applied, lost, missing)
    ("Z B A S", False, 1, 1, 0, 0),
    ("Z A B S", False, 1, 1, 0, 0),  # backward accumulates onto the term
    ("A Z B S", False, 0, 0, 1, 0),  # zero_grad clears it
    ("Z A z B S", False, 0, 0, 1, 0),  # zero_grad(set_to_none=False) zeroes it
    ("Z B S", False, 0, 0, 0, 1),
    ("Z B1 A B2 S", False, 1, 1, 0, 0),  # accumulation over two passes
    ("Z B S", True, 1, 1, 0, 0),
    ("Z A B S", True, 1, 1, 0, 0),  # the hook sees the term and adds no second
    ("Z B A S", True, 1, 1, 0, 0),
    ("A Z B S", True, 1, 1, 0, 0),  # the hook adds the lost term again
    ("Z B1 A B2 S", True, 1, 1, 0, 0),
]


@pytest.mark.parametrize(
    ("order", "attach", "term", "applied", "lost", "missing"), ORDERS
)
def test_every_order_of_calls_steps_and_counts_what_the_gradient_held(
    problem, order, attach, term, applied, lost, missing
):
    mu, lr = 3.0, 0.05
    w_t = np.linspace(-1, 1, problem.dim)
    model, rule = fedprox_rule(problem, w_t, mu)
    start = w_t.astype(np.float32) + 0.1
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(start).reshape(1, -1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    if attach:
        rule.attach(optimizer)
    x, y = data(problem)
    calls = {
        "Z": lambda: optimizer.zero_grad(),
        "z": lambda: optimizer.zero_grad(set_to_none=False),
        "A": lambda: rule.add_gradient(),
        "B": lambda: half_sse(model(x), y).backward(),
        "B1": lambda: half_sse(model(x[:10]), y[:10]).backward(),
        "B2": lambda: half_sse(model(x[10:]), y[10:]).backward(),
        "S": lambda: optimizer.step(),
    }
    for call in order.split():
        calls[call]()
    a, b = problem.a[1].astype(np.float64), problem.b[1].astype(np.float64)
    w0 = start.astype(np.float64)
    w = w_t.astype(np.float32).astype(np.float64)
    expected = w0 - lr * (a.T @ (a @ w0 - b) + term * mu * (w0 - w))
    np.testing.assert_allclose(
        model.weight.detach().numpy()[0], expected, rtol=1e-5, atol=1e-6
    )
    metrics = metrics_of(rule)
    assert metrics["local-steps"] == 1
    assert metrics["proximal-mu-applied"] == applied
    assert metrics.get("term-lost-steps", 0) == lost
    assert metrics.get("term-missing-steps", 0) == missing


def test_a_closure_that_only_accumulates_keeps_the_term(problem):
    """add_gradient, then step(closure) whose closure only runs backward: kept."""
    mu, lr = 3.0, 0.05
    w_t = np.zeros(problem.dim)
    model, rule = fedprox_rule(problem, w_t, mu)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = data(problem)
    optimizer.zero_grad()
    rule.add_gradient()

    def closure():
        loss = half_sse(model(x), y)
        loss.backward()
        return loss

    optimizer.step(closure)
    metrics = metrics_of(rule)
    assert metrics["proximal-mu-applied"] == 1
    assert metrics.get("term-lost-steps", 0) == 0


def test_a_dtype_change_after_the_first_step_is_followed(problem):
    """model.to(float64) between steps: the anchor and the term follow it exactly."""
    mu, lr = 2.0, 0.05
    w_t = np.linspace(-1, 1, problem.dim)
    model, rule = fedprox_rule(problem, w_t, mu)
    optimizer = rule.attach(torch.optim.SGD(model.parameters(), lr=lr))
    x, y = data(problem)
    plain_steps(optimizer, model, x, y, 1)
    w1 = model.weight.detach().double().numpy()[0].copy()
    model.to(torch.float64)
    plain_steps(optimizer, model, x.double(), y.double(), 1)
    a, b = problem.a[1].astype(np.float64), problem.b[1].astype(np.float64)
    w = w_t.astype(np.float32).astype(np.float64)
    expected = w1 - lr * (a.T @ (a @ w1 - b) + mu * (w1 - w))
    np.testing.assert_allclose(model.weight.detach().numpy()[0], expected, atol=1e-12)
    assert metrics_of(rule)["proximal-mu-applied"] == 2


# ------------------------------------------------- several optimisers, one each part
class TwoParts(torch.nn.Module):
    """A linear model in two parts over disjoint features (the state_dict: a, b)."""

    def __init__(self, dim: int, split: int) -> None:
        super().__init__()
        self.split = split
        self.a = torch.nn.Linear(split, 1, bias=False)
        self.b = torch.nn.Linear(dim - split, 1, bias=False)

    def forward(self, x):
        return self.a(x[:, : self.split]) + self.b(x[:, self.split :])


def two_parts(problem, rule_cls=FedProxRule, config=None, extra=None):
    split = problem.dim // 2
    w_t = np.linspace(-1, 1, problem.dim).astype(np.float32)
    model = TwoParts(problem.dim, split)
    arrays = [w_t[:split].reshape(1, -1), w_t[split:].reshape(1, -1)]
    msg = train_message(
        arrays, config or {"proximal-mu": 3.0, "server-round": 1}, extra
    )
    rule = rule_cls.from_message(msg, context(1), model)
    return model, rule, w_t.astype(np.float64), split


def grad_at(problem, w, w_t, mu):
    a, b = problem.a[1].astype(np.float64), problem.b[1].astype(np.float64)
    return a.T @ (a @ w - b) + mu * (w - w_t)


@pytest.mark.parametrize("route", ["attach", "add_gradient"])
def test_two_optimisers_one_backward_each_part_gets_the_term_once(problem, route):
    """One backward, then each optimiser steps its part with its own rate."""
    mu, rates = 3.0, (0.05, 0.02)
    model, rule, w_t, split = two_parts(problem)
    opt_a = torch.optim.SGD(model.a.parameters(), lr=rates[0])
    opt_b = torch.optim.SGD(model.b.parameters(), lr=rates[1])
    if route == "attach":
        assert rule.attach(opt_a, opt_b) == (opt_a, opt_b)
    x, y = data(problem)
    for opt in (opt_a, opt_b):
        opt.zero_grad()
    half_sse(model(x), y).backward()
    for opt in (opt_a, opt_b):
        if route == "add_gradient":
            rule.add_gradient()  # before each step: each part gets it once
        opt.step()
    g = grad_at(problem, w_t, w_t, mu)
    step = np.concatenate([rates[0] * g[:split], rates[1] * g[split:]])
    got = np.concatenate(
        [model.a.weight.detach().numpy()[0], model.b.weight.detach().numpy()[0]]
    )
    np.testing.assert_allclose(got, w_t - step, rtol=1e-5, atol=1e-6)
    metrics = metrics_of(rule, lr=0.05)
    assert metrics["local-steps"] == 2 and metrics["proximal-mu-applied"] == 2


def test_two_optimisers_in_turn_as_a_gan_trains(problem):
    """zero, backward, step of one part, then of the other at the moved model."""
    mu, lr = 3.0, 0.05
    model, rule, w_t, split = two_parts(problem)
    opt_a = torch.optim.SGD(model.a.parameters(), lr=lr)
    opt_b = torch.optim.SGD(model.b.parameters(), lr=lr)
    rule.attach(opt_a, opt_b)
    x, y = data(problem)
    for opt in (opt_a, opt_b):
        opt.zero_grad()
        half_sse(model(x), y).backward()
        opt.step()
    w = w_t.copy()
    w[:split] -= lr * grad_at(problem, w, w_t, mu)[:split]
    w[split:] -= lr * grad_at(problem, w, w_t, mu)[split:]
    got = np.concatenate(
        [model.a.weight.detach().numpy()[0], model.b.weight.detach().numpy()[0]]
    )
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
    metrics = metrics_of(rule)
    assert metrics["local-steps"] == 2 and metrics["proximal-mu-applied"] == 2


def test_a_part_left_out_of_attach_is_refused_naming_the_fix(problem):
    model, rule, _, _ = two_parts(problem)
    only_a = torch.optim.SGD(model.a.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"attach\(optimizer_a, optimizer_b\)"):
        rule.attach(only_a)


def test_scaffold_checks_plain_sgd_in_every_part(problem):
    split = problem.dim // 2
    control = [
        np.zeros((1, split), np.float32),
        np.zeros((1, problem.dim - split), np.float32),
    ]
    _, rule, _, _ = two_parts(
        problem, ScaffoldRule, {"server-round": 1}, {"control": control}
    )
    model = rule.model
    sgd = torch.optim.SGD(model.a.parameters(), lr=0.1)
    adam = torch.optim.Adam(model.b.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="got Adam"):
        rule.attach(sgd, adam)
