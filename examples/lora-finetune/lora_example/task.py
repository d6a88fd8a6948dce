"""The model and the data: a tiny GPT-2 with LoRA adapters, text of its own.

The language model is built from a config (no download) with a fixed seed, so
every node holds the same frozen weights; only the LoRA adapters on its
attention train and travel. The text is bundled below and cut into one shard
per node, read character by character.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel

TEXT = (
    "Federated learning trains one model on data that stays where it was made. "
    "Each client improves the model on its own examples and sends back only the "
    "change; the server averages the changes and sends the new model out again. "
    "When the clients' data differ, their changes pull apart: FedProx keeps each "
    "client near the global model with a proximal term, and SCAFFOLD corrects "
    "each step with control variates that estimate the drift. Fine-tuning a large "
    "model this way moves only small adapters, low-rank updates of a few weight "
    "matrices, while the pretrained weights stay frozen on every client. "
)
VOCAB = sorted(set(TEXT))
CONTEXT = 32


def tiny_lora_model(layers: int, width: int, rank: int, seed: int) -> torch.nn.Module:
    """Return a GPT-2 of ``layers`` x ``width`` with LoRA (rank ``rank``) on c_attn."""
    torch.manual_seed(seed)  # the same frozen weights on every node
    config = GPT2Config(
        n_layer=layers,
        n_head=2,
        n_embd=width,
        vocab_size=len(VOCAB),
        n_positions=CONTEXT,
        bos_token_id=0,
        eos_token_id=0,
    )
    lora = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=["c_attn"],
        fan_in_fan_out=True,  # GPT-2's Conv1D layout
        init_lora_weights=False,  # random B too: rounds move from a non-zero start
    )
    return get_peft_model(GPT2LMHeadModel(config), lora)


def model_of(config: Mapping[str, Any]) -> torch.nn.Module:
    """Return the model the run config describes (``layers``, ``width``, ...)."""
    return tiny_lora_model(
        int(config["layers"]),
        int(config["width"]),
        int(config["lora-rank"]),
        int(config["seed"]),
    )


def shard(node: int, num_nodes: int) -> torch.Tensor:
    """Return node ``node``'s windows of the text: token ids, (n, CONTEXT)."""
    ids = torch.tensor([VOCAB.index(c) for c in TEXT])
    windows = ids.unfold(0, CONTEXT, CONTEXT // 2)
    return windows[node::num_nodes]


def loss_on(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Return the next-token loss of ``model`` on ``tokens``."""
    return model(input_ids=tokens, labels=tokens).loss
