"""The federated part of a model: a frozen backbone or LoRA adapters stay local,
the rule's anchor, control variates and reply cover the part only, and what
breaks the part's contract is refused naming the fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from flwr_prox_strategies import (
    FedProx,
    FedProxRule,
    Scaffold,
    ScaffoldRule,
    federated_part,
)
from flwr_prox_strategies.core.client.message import ProtocolError
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid

from .helpers import context, train_message
from .lsq import LeastSquares, half_sse

DIM = LeastSquares().dim


def backbone_and_head(seed: int = 0) -> torch.nn.Sequential:
    """A frozen random feature map and a trainable linear head (no biases)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, 6, bias=False), torch.nn.Linear(6, 1, bias=False)
    )
    model[0].weight.requires_grad_(False)
    return model


def test_fedprox_on_the_head_only_matches_the_hand_computed_step():
    problem = LeastSquares()
    model = backbone_and_head()
    part = federated_part(model)
    assert list(part.state_dict()) == ["1.weight"]
    head_t = np.linspace(-1, 1, 6).reshape(1, 6).astype(np.float32)
    rule = FedProxRule.from_message(
        train_message([head_t], {"proximal-mu": 2.0}), context(1), part
    )
    frozen = model[0].weight.detach().clone()
    optimizer = rule.attach(torch.optim.SGD(model.parameters(), lr=0.05))
    x, y = torch.from_numpy(problem.a[1]), torch.from_numpy(problem.b[1])
    optimizer.zero_grad()
    half_sse(model(x), y).backward()
    optimizer.step()
    feats = (x @ frozen.T).double().numpy()
    w = head_t[0].astype(np.float64)
    b = problem.b[1].astype(np.float64)
    expected = w - 0.05 * (feats.T @ (feats @ w - b) + 2.0 * (w - w))
    np.testing.assert_allclose(
        model[1].weight.detach().numpy()[0], expected, rtol=1e-5, atol=1e-6
    )
    assert torch.equal(model[0].weight, frozen)
    reply = rule.reply(num_examples=20)
    sent = reply.content["arrays"].to_numpy_ndarrays()
    assert [a.shape for a in sent] == [(1, 6)]  # the head only
    assert reply.content["metrics"]["proximal-mu-applied"] == 1


def test_scaffolds_control_variates_have_the_parts_shapes():
    problem = LeastSquares()
    model = backbone_and_head()
    part = federated_part(model)
    head = np.zeros((1, 6), np.float32)
    msg = train_message(
        [head], {"server-round": 1}, {"control": [np.full((1, 6), 0.1, np.float32)]}
    )
    rule = ScaffoldRule.from_message(msg, context(1), part)
    optimizer = rule.attach(torch.optim.SGD(model.parameters(), lr=0.05))
    x, y = torch.from_numpy(problem.a[1]), torch.from_numpy(problem.b[1])
    for _ in range(3):
        optimizer.zero_grad()
        half_sse(model(x), y).backward()
        optimizer.step()
    reply = rule.reply(num_examples=20)
    deltas = reply.content["control-delta"].to_numpy_ndarrays()
    assert [d.shape for d in deltas] == [(1, 6)]
    assert reply.content["metrics"]["scaffold-applied"] == 3


def test_what_breaks_the_parts_contract_is_refused_naming_the_fix():
    model = backbone_and_head()
    model[0].weight.requires_grad_(True)  # trainable, but not federated
    part = federated_part(model, which=["1.weight"])
    msg = train_message([np.zeros((1, 6), np.float32)], {"proximal-mu": 1.0})
    rule = FedProxRule.from_message(msg, context(1), part)
    with pytest.raises(ValueError, match="outside the federated part"):
        rule.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    whole = [p.detach().numpy() for p in model.state_dict().values()]
    with pytest.raises(ProtocolError, match=r"the model has 1 tensors \(the server"):
        FedProxRule.from_message(
            train_message(whole, {"proximal-mu": 1.0}), context(1), part
        )
    with pytest.raises(ProtocolError, match=r"has shape \(1, 7\), model expects"):
        FedProxRule.from_message(
            train_message([np.zeros((1, 7), np.float32)], {"proximal-mu": 1.0}),
            context(1),
            part,
        )
    # The whole model given where the server sends the part: the fix is named.
    with pytest.raises(ProtocolError, match=r"on federated_part\(model\), whose 1"):
        FedProxRule.from_message(
            train_message([np.zeros((1, 6), np.float32)], {"proximal-mu": 1.0}),
            context(1),
            backbone_and_head(),
        )
    with pytest.raises(ValueError, match="selects no parameter"):
        federated_part(torch.nn.Linear(2, 1).requires_grad_(False))
    with pytest.raises(ValueError, match="does not have"):
        federated_part(model, which=["2.weight"])


@pytest.mark.parametrize("strategy_cls", [FedProx, Scaffold])
def test_a_federation_moves_the_part_and_never_the_backbone(strategy_cls):
    """Flower's Message API in process: the server holds the head only."""
    from flwr.clientapp import ClientApp

    problem = LeastSquares()
    rule_cls = FedProxRule if strategy_cls is FedProx else ScaffoldRule
    backbones = {}
    app = ClientApp()

    @app.train()
    def train(msg, ctx):
        k = int(ctx.node_config["partition-id"])
        model = backbone_and_head(seed=0)
        backbones[k] = model[0].weight.detach().clone()
        rule = rule_cls.from_message(msg, ctx, federated_part(model))
        optimizer = rule.attach(torch.optim.SGD(model.parameters(), lr=0.02))
        x, y = torch.from_numpy(problem.a[k]), torch.from_numpy(problem.b[k])
        for _ in range(2):
            optimizer.zero_grad()
            half_sse(model(x), y).backward()
            optimizer.step()
        assert torch.equal(model[0].weight, backbones[k])
        return rule.reply(num_examples=20)

    options = {"num_clients": 3} if strategy_cls is Scaffold else {"proximal_mu": 0.5}
    strategy = strategy_cls(
        min_train_nodes=3, min_available_nodes=3, fraction_evaluate=0.0, **options
    )
    initial = ArrayRecord(federated_part(backbone_and_head()).state_dict())
    result = strategy.start(
        grid=InProcessGrid(app, num_nodes=3),
        initial_arrays=initial,
        num_rounds=2,
        train_config=ConfigRecord(),
    )
    final = result.arrays.to_numpy_ndarrays()
    assert [a.shape for a in final] == [(1, 6)]
    assert not np.allclose(final[0], initial.to_numpy_ndarrays()[0])


def test_a_peft_models_adapters_are_the_part_and_fedprox_pulls_them():
    """LoRA on a tiny GPT-2 built from a config: the part is exactly peft's state
    dict, and FedProx with a large mu ends elsewhere than with mu = 0."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")

    def tiny_lora():
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_layer=2,
            n_head=2,
            n_embd=32,
            vocab_size=64,
            n_positions=32,
            bos_token_id=0,
            eos_token_id=0,
        )
        base = transformers.GPT2LMHeadModel(config)
        lora = peft.LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["c_attn"],
            fan_in_fan_out=True,
            init_lora_weights=False,
        )
        return peft.get_peft_model(base, lora)

    def fit(mu):
        model = tiny_lora()
        part = federated_part(model)
        adapters = peft.get_peft_model_state_dict(model)
        assert [v.shape for v in part.state_dict().values()] == [
            v.shape for v in adapters.values()
        ]
        arrays = [v.detach().numpy().copy() for v in adapters.values()]
        rule = FedProxRule.from_message(
            train_message(arrays, {"proximal-mu": mu}), context(1), part
        )
        optimizer = rule.attach(
            torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        )
        tokens = torch.randint(
            0, 64, (4, 16), generator=torch.Generator().manual_seed(1)
        )
        for _ in range(5):
            optimizer.zero_grad()
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
        reply = rule.reply(num_examples=4)
        sent = reply.content["arrays"].to_numpy_ndarrays()
        whole = sum(p.numel() for p in model.parameters())
        return sent, reply.content["metrics"], whole

    big, metrics, whole = fit(50.0)
    zero, _, _ = fit(0.0)
    assert metrics["proximal-mu-applied"] == metrics["local-steps"] == 5
    assert len(big) == 4 and sum(a.size for a in big) < whole / 20
    assert (
        max(float(np.abs(a - b).max()) for a, b in zip(big, zero, strict=True)) > 1e-3
    )


def test_the_packs_own_client_trains_the_part_it_is_given():
    """FedProxClient(federated_part(model), ...): the reply holds the head only."""
    from torch.utils.data import DataLoader, TensorDataset

    from flwr_prox_strategies import FedProxClient, to_client_app

    problem = LeastSquares()
    model = backbone_and_head()
    frozen = model[0].weight.detach().clone()
    data = TensorDataset(torch.from_numpy(problem.a[1]), torch.from_numpy(problem.b[1]))

    def client_fn(context):
        return FedProxClient(
            federated_part(model),
            DataLoader(data, batch_size=20),
            loss_fn=lambda out, y: half_sse(out, y),
            learning_rate=0.02,
            local_epochs=2,
        )

    app = to_client_app(client_fn)
    strategy = FedProx(
        min_train_nodes=1,
        min_available_nodes=1,
        fraction_evaluate=0.0,
        proximal_mu=0.5,
    )
    initial = ArrayRecord(federated_part(model).state_dict())
    result = strategy.start(
        grid=InProcessGrid(app, num_nodes=1), initial_arrays=initial, num_rounds=1
    )
    final = result.arrays.to_numpy_ndarrays()
    assert [a.shape for a in final] == [(1, 6)]
    assert torch.equal(model[0].weight, frozen)
    assert not np.allclose(final[0], initial.to_numpy_ndarrays()[0])
