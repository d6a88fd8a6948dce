"""The rules inside real training frameworks: Lightning's Trainer, Hugging Face's Trainer.

Each framework steps the optimiser its own way (Lightning inside
``optimizer.step(closure)``, Hugging Face through accelerate's wrapper after its
own clipping). These tests run the real libraries on small problems and check
the update against hand computations, that the term is really applied (a large
mu against mu = 0, SCAFFOLD against FedAvg), that client state persists across
rounds, and that each mistake is loud with its fix.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import torch
from flwr.app import (
    Context,
    Message,
)
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader, TensorDataset

from flwr_prox_strategies import (
    FedDC,
    FedDCRule,
    FedDyn,
    FedDynRule,
    FedProx,
    FedProxRule,
    Scaffold,
    ScaffoldRule,
)
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid

from .helpers import context, logged, train_message
from .lsq import LeastSquares, half_sse

L = pytest.importorskip("lightning.pytorch")
from flwr_prox_strategies.integrations.lightning import RuleCallback  # noqa: E402

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)


@pytest.fixture(scope="module")
def problem() -> LeastSquares:
    return LeastSquares()


class LitLinear(L.LightningModule):
    """A least-squares model with Lightning's automatic optimisation."""

    def __init__(self, dim: int, optimizer: str = "sgd", lr: float = 0.02, rule=None):
        super().__init__()
        self.net = torch.nn.Linear(dim, 1, bias=False)
        self.kind, self.lr, self.rule = optimizer, lr, rule

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = half_sse(self.net(x).float(), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.kind == "adam":
            optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        # The route the pack's pages used to give: attach in configure_optimizers.
        return optimizer if self.rule is None else self.rule.attach(optimizer)


def trainer(callbacks=(), trainer_module=L, **kwargs):
    options = {
        "max_epochs": 3,
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        **kwargs,
    }
    return trainer_module.Trainer(callbacks=list(callbacks), **options)


def loader(problem, k=1, batch_size=20):
    x, y = torch.from_numpy(problem.a[k]), torch.from_numpy(problem.b[k])
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def fedprox_by_hand(problem, w_t, mu, lr, steps, k=1):
    a, b = problem.a[k].astype(np.float64), problem.b[k].astype(np.float64)
    w = w_t.astype(np.float32).astype(np.float64)
    for _ in range(steps):
        w = w - lr * (a.T @ (a @ w - b) + mu * (w - w_t))
    return w


def fit_fedprox(problem, mu, route="callback", **trainer_kwargs):
    w_t = np.linspace(-1, 1, problem.dim)
    model = LitLinear(problem.dim)
    msg = train_message([w_t.reshape(1, -1).astype(np.float32)], {"proximal-mu": mu})
    rule = FedProxRule.from_message(msg, context(1), model)
    if route == "configure_optimizers":
        model.rule = rule
        callbacks = []
    else:
        callbacks = [RuleCallback(rule)]
    trainer(callbacks, **trainer_kwargs).fit(model, loader(problem))
    reply = rule.reply(num_examples=20)
    return model.net.weight.detach().float().numpy()[0], reply, w_t


@pytest.mark.parametrize("route", ["callback", "configure_optimizers"])
def test_lightning_applies_fedprox_exactly(problem, route):
    """Both routes give the hand-computed proximal steps; mu = 1000 differs from 0."""
    w, reply, w_t = fit_fedprox(problem, 2.0, route)
    np.testing.assert_allclose(
        w, fedprox_by_hand(problem, w_t, 2.0, 0.02, 3), rtol=1e-5, atol=1e-6
    )
    metrics = reply.content["metrics"]
    assert metrics["proximal-mu-applied"] == metrics["local-steps"] == 3
    big, _, _ = fit_fedprox(problem, 1000.0 / 50, route)
    zero, _, _ = fit_fedprox(problem, 0.0, route)
    assert np.abs(big - zero).max() > 1e-2


def test_lightning_accumulation_adds_the_term_once_per_step(problem):
    """Two half-batches a step: Lightning averages their losses, the term comes once."""
    w_t = np.linspace(-1, 1, problem.dim)
    model = LitLinear(problem.dim)
    msg = train_message([w_t.reshape(1, -1).astype(np.float32)], {"proximal-mu": 2.0})
    rule = FedProxRule.from_message(msg, context(1), model)
    trainer([RuleCallback(rule)], accumulate_grad_batches=2, max_epochs=2).fit(
        model, loader(problem, batch_size=10)
    )
    a, b = problem.a[1].astype(np.float64), problem.b[1].astype(np.float64)
    w = w_t.astype(np.float32).astype(np.float64)
    for _ in range(2):  # (grad of half 1 + grad of half 2) / 2, plus mu (w - w_t)
        w = w - 0.02 * (0.5 * a.T @ (a @ w - b) + 2.0 * (w - w_t))
    np.testing.assert_allclose(
        model.net.weight.detach().numpy()[0], w, rtol=1e-5, atol=1e-6
    )
    metrics = rule.reply(num_examples=20).content["metrics"]
    assert metrics["proximal-mu-applied"] == metrics["local-steps"] == 2


def test_lightning_bf16_true_replies_in_float32(problem):
    w, reply, w_t = fit_fedprox(problem, 2.0, precision="bf16-true")
    # bfloat16 keeps 8 bits of mantissa: the hand steps to its rounding
    np.testing.assert_allclose(
        w, fedprox_by_hand(problem, w_t, 2.0, 0.02, 3), rtol=0.05, atol=0.02
    )
    [array] = reply.content["arrays"].to_numpy_ndarrays()
    assert array.dtype == np.float32 and np.isfinite(array).all()
    metrics = reply.content["metrics"]
    assert metrics["proximal-mu-applied"] == metrics["local-steps"] == 3


def test_lightning_bf16_mixed_applies_the_term(problem):
    """Autocast in bfloat16, float32 parameters: every step holds the term."""
    w, reply, w_t = fit_fedprox(problem, 2.0, precision="bf16-mixed")
    np.testing.assert_allclose(
        w, fedprox_by_hand(problem, w_t, 2.0, 0.02, 3), rtol=0.05, atol=0.02
    )
    metrics = reply.content["metrics"]
    assert metrics["proximal-mu-applied"] == metrics["local-steps"] == 3


def test_lightning_clips_the_term_with_the_data_gradient(problem):
    """gradient_clip_val: the callback adds the term before Lightning clips."""
    bound, mu, lr = 0.05, 20.0, 0.02
    w, reply, w_t = fit_fedprox(problem, mu, gradient_clip_val=bound, max_epochs=3)
    a, b = problem.a[1].astype(np.float64), problem.b[1].astype(np.float64)

    def clip(g):
        return g * min(1.0, bound / (np.linalg.norm(g) + 1e-6))

    v = u = w_t.astype(np.float32).astype(np.float64)
    for _ in range(3):  # clipped together, and (what must not happen) apart
        v = v - lr * clip(a.T @ (a @ v - b) + mu * (v - w_t))
        u = u - lr * (clip(a.T @ (a @ u - b)) + mu * (u - w_t))
    np.testing.assert_allclose(w, v, rtol=1e-5, atol=1e-6)
    assert np.abs(v - u).max() > 1e-4  # the two orders are told apart
    assert reply.content["metrics"]["proximal-mu-applied"] == 3


def test_pytorch_lightning_package_takes_the_same_callback(problem):
    pl = pytest.importorskip("pytorch_lightning")

    class PlLinear(pl.LightningModule):
        def __init__(self, dim):
            super().__init__()
            self.net = torch.nn.Linear(dim, 1, bias=False)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return half_sse(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.02)

    w_t = np.linspace(-1, 1, problem.dim)
    model = PlLinear(problem.dim)
    msg = train_message([w_t.reshape(1, -1).astype(np.float32)], {"proximal-mu": 2.0})
    rule = FedProxRule.from_message(msg, context(1), model)
    trainer([RuleCallback(rule)], trainer_module=pl).fit(model, loader(problem))
    np.testing.assert_allclose(
        model.net.weight.detach().numpy()[0],
        fedprox_by_hand(problem, w_t, 2.0, 0.02, 3),
        rtol=1e-5,
        atol=1e-6,
    )


def test_lightning_scaffold_refuses_adam_before_training(problem):
    model = LitLinear(problem.dim, optimizer="adam")
    c = np.full((1, problem.dim), 0.3, np.float32)
    msg = train_message(
        [np.zeros((1, problem.dim), np.float32)], {"server-round": 1}, {"control": [c]}
    )
    rule = ScaffoldRule.from_message(msg, context(), model)
    with pytest.raises(ValueError, match=r"needs torch\.optim\.SGD without momentum"):
        trainer([RuleCallback(rule)]).fit(model, loader(problem))
    assert rule.steps == 0  # refused before the first update


def test_a_callback_that_adds_the_term_too_early_is_measured(problem, caplog):
    """add_gradient before Lightning's closure runs: the reply says 0 of 3."""

    class TooEarly(L.Callback):
        def __init__(self, rule):
            self.rule = rule

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.rule.add_gradient()

    model = LitLinear(problem.dim)
    msg = train_message([np.zeros((1, problem.dim), np.float32)], {"proximal-mu": 5.0})
    rule = FedProxRule.from_message(msg, context(1), model)
    trainer([TooEarly(rule)]).fit(model, loader(problem))
    with caplog.at_level(logging.WARNING, logger="flwr"):
        metrics = rule.reply(num_examples=20).content["metrics"]
    assert (metrics["local-steps"], metrics["proximal-mu-applied"]) == (3, 0)
    assert metrics["term-lost-steps"] == 3
    assert "reached the update in 0 of 3" in caplog.text


def lightning_app(problem, rule_cls, committed=None) -> ClientApp:
    """A user's Message-API ClientApp training with Lightning and the callback."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        k = int(context.node_config["partition-id"])
        model = LitLinear(problem.dim, lr=0.02)
        rule = rule_cls.from_message(msg, context, model)
        if committed is not None:  # the round this client's state comes from
            committed.append((rule.server_round, rule.state.committed_round()))
        trainer([RuleCallback(rule)], max_epochs=2).fit(model, loader(problem, k, 10))
        return rule.reply(num_examples=20)

    return app


@pytest.mark.long
@pytest.mark.parametrize(
    ("make", "rule_cls"),
    [
        (lambda: FedProx(mu=1.0, fraction_evaluate=0.0), FedProxRule),
        (lambda: Scaffold(num_clients=4, fraction_evaluate=0.0), ScaffoldRule),
        (lambda: FedDyn(alpha=0.1, num_clients=4, fraction_evaluate=0.0), FedDynRule),
        (lambda: FedDC(alpha=0.1, num_clients=4, fraction_evaluate=0.0), FedDCRule),
    ],
    ids=["fedprox", "scaffold", "feddyn", "feddc"],
)
def test_lightning_clients_run_each_algorithm_with_state(problem, make, rule_cls):
    """Three rounds: every step held the term, state persists, the run differs from FedAvg."""
    committed: list[tuple[int, int]] = []
    grid = InProcessGrid(lightning_app(problem, rule_cls, committed), num_nodes=4)
    result = make().start(grid=grid, initial_arrays=problem.initial(), num_rounds=3)
    rounds = result.train_metrics_clientapp
    for metrics in rounds.values():
        assert metrics["replies-valid"] == 4
        assert metrics["replies-term-incomplete"] == 0
        assert metrics[rule_cls.applied_metric] == metrics["local-steps"] == 4
    if rule_cls.stateful:  # round 3's clients hold the state round 2 committed
        assert sorted(c for r, c in committed if r == 3) == [2, 2, 2, 2]
    from flwr_prox_strategies import ClientRule, FedAvg

    fedavg = FedAvg(fraction_evaluate=0.0).start(
        grid=InProcessGrid(lightning_app(problem, ClientRule), num_nodes=4),
        initial_arrays=problem.initial(),
        num_rounds=3,
    )
    ours = result.arrays.to_numpy_ndarrays()[0]
    plain = fedavg.arrays.to_numpy_ndarrays()[0]
    assert np.abs(ours - plain).max() > 1e-3


# ------------------------------------------------------------- Hugging Face
def tiny_bert():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=40,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
        num_labels=2,
    )
    torch.manual_seed(0)
    return transformers, transformers.BertForSequenceClassification(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=16, length=6):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, 40, (n, length), generator=g)
        self.labels = (self.ids[:, 0] > 20).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def hf_fit(rule_cls, config, extra, optimizer="sgd", tmp_path=None):
    transformers, model = tiny_bert()
    arrays = [v.detach().numpy().copy() for v in model.state_dict().values()]
    msg = train_message(arrays, config, extra(model) if extra else None)
    rule = rule_cls.from_message(msg, context(), model)
    from flwr_prox_strategies.integrations.huggingface import RuleCallback as HFRule

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=8,
        learning_rate=0.1,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    optimizers = (
        (torch.optim.SGD(model.parameters(), lr=0.1), None)
        if optimizer == "sgd"
        else (None, None)
    )
    trainer_ = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(),
        callbacks=[HFRule(rule)],
        optimizers=optimizers,
    )
    trainer_.train()
    return rule.reply(num_examples=16)


@pytest.mark.long
def test_hugging_face_trainer_applies_fedprox_and_scaffold(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="flwr")
    big = hf_fit(FedProxRule, {"proximal-mu": 100.0}, None, tmp_path=tmp_path)
    # The Trainer's own linear decay around the user's SGD is named.
    assert logged(caplog, "lr_scheduler_type=linear")
    zero = hf_fit(FedProxRule, {"proximal-mu": 0.0}, None, tmp_path=tmp_path)
    metrics = big.content["metrics"]
    assert metrics["proximal-mu-applied"] == metrics["local-steps"] == 3
    diff = [
        np.abs(p - q).max()
        for p, q in zip(
            big.content["arrays"].to_numpy_ndarrays(),
            zero.content["arrays"].to_numpy_ndarrays(),
            strict=True,
        )
    ]
    assert max(diff) > 1e-3

    def control(model):
        return {
            "control": [
                np.full(v.shape, 0.01, np.float32) for v in model.state_dict().values()
            ]
        }

    reply = hf_fit(ScaffoldRule, {"server-round": 1}, control, tmp_path=tmp_path)
    assert reply.content["metrics"]["scaffold-applied"] == 3
    deltas = reply.content["control-delta"].to_numpy_ndarrays()
    assert all(np.isfinite(d).all() for d in deltas)
    with pytest.raises(ValueError, match="got AdamW"):
        hf_fit(ScaffoldRule, {"server-round": 1}, control, "adamw", tmp_path=tmp_path)


class LitTwoParts(L.LightningModule):
    """Manual optimisation with two optimisers, one per part, stepped in turn."""

    def __init__(self, dim: int, lr: float = 0.02):
        super().__init__()
        self.split = dim // 2
        self.a = torch.nn.Linear(self.split, 1, bias=False)
        self.b = torch.nn.Linear(dim - self.split, 1, bias=False)
        self.lr = lr
        self.automatic_optimization = False

    def forward(self, x):
        return self.a(x[:, : self.split]) + self.b(x[:, self.split :])

    def training_step(self, batch, batch_idx):
        x, y = batch
        for optimizer in self.optimizers():
            optimizer.zero_grad()
            self.manual_backward(half_sse(self(x), y))
            optimizer.step()

    def configure_optimizers(self):
        return (
            torch.optim.SGD(self.a.parameters(), lr=self.lr),
            torch.optim.SGD(self.b.parameters(), lr=self.lr),
        )


def test_lightning_manual_optimisation_with_two_optimisers(problem):
    """The callback attaches both; each part's update gets the term once."""
    mu, lr = 2.0, 0.02
    w_t = np.linspace(-1, 1, problem.dim).astype(np.float32)
    model = LitTwoParts(problem.dim, lr)
    split = model.split
    msg = train_message(
        [w_t[:split].reshape(1, -1), w_t[split:].reshape(1, -1)], {"proximal-mu": mu}
    )
    rule = FedProxRule.from_message(msg, context(1), model)
    trainer([RuleCallback(rule)], max_epochs=2).fit(model, loader(problem))
    a, b = problem.a[1].astype(np.float64), problem.b[1].astype(np.float64)
    anchor = w_t.astype(np.float64)
    w = anchor.copy()
    for _ in range(2):
        for part in (slice(0, split), slice(split, None)):
            w[part] -= lr * (a.T @ (a @ w - b) + mu * (w - anchor))[part]
    got = np.concatenate(
        [model.a.weight.detach().numpy()[0], model.b.weight.detach().numpy()[0]]
    )
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
    metrics = rule.reply(num_examples=20).content["metrics"]
    assert metrics["local-steps"] == 4 and metrics["proximal-mu-applied"] == 4
