"""A Flower client that keeps a FedDC-sized state: two model-sized arrays.

When the server sends a ``control`` record with the model (``extra-records=1``
on the server), the reply carries a model-sized ``control`` record too: the
payload of SCAFFOLD's and FedDC's replies.

With ``train=0`` the model goes back unchanged (the engine's price alone). With
``train=1`` the client trains it as Flower's PyTorch quickstart does: the MLP
784-200-200-10 loaded from the message, one local epoch of SGD in batches of 64
on the node's iid share of Fashion-MNIST (read from ``data-dir`` once per
process), its state dict sent back: the computation every real client pays,
so that what remains between this case and the pack's is the pack's own work.
"""

from __future__ import annotations

import gzip
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()
CONTROL = "control"
BATCH_SIZE = 64
LEARNING_RATE = 0.1  # the pack's default (train.learning_rate)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Return the model, trained or not; read, update and keep two state arrays."""
    arrays = msg.content.array_records["arrays"]
    for name in ("drift", "control"):
        if name in context.state.array_records:
            state = context.state.array_records[name].to_numpy_ndarrays()
            state = [s + 1.0 for s in state]
        else:
            state = [np.zeros_like(a) for a in arrays.to_numpy_ndarrays()]
        context.state[name] = ArrayRecord(state)
    examples = 1
    if int(context.run_config.get("train", 0)):
        arrays, examples = train_mlp(
            arrays,
            str(context.run_config["data-dir"]),
            int(context.node_config["partition-id"]),
            int(context.node_config["num-partitions"]),
        )
    content = RecordDict(
        {"arrays": arrays, "metrics": MetricRecord({"num-examples": examples})}
    )
    if CONTROL in msg.content.array_records:  # a control change back, as SCAFFOLD
        content[CONTROL] = context.state.array_records["control"]
    return Message(content=content, reply_to=msg)


def train_mlp(
    arrays: ArrayRecord, data_dir: str, partition: int, partitions: int
) -> tuple[ArrayRecord, int]:
    """One epoch of SGD on this node's share: the quickstart's training loop."""
    import torch
    from torch.nn import functional
    from torch.utils.data import DataLoader, TensorDataset

    model = mlp()
    model.load_state_dict(arrays.to_torch_state_dict())
    images, labels = fashion_share(data_dir, partition, partitions)
    data = TensorDataset(
        torch.from_numpy(images).float().div_(255.0), torch.from_numpy(labels).long()
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    model.train()
    for x, y in DataLoader(data, batch_size=BATCH_SIZE, shuffle=True):
        optimizer.zero_grad()
        functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return ArrayRecord(model.state_dict()), len(data)


def mlp() -> Any:
    """784-200-200-10 with ReLUs: the pack's ``model=mlp``."""
    from torch import nn

    return nn.Sequential(
        nn.Linear(784, 200),
        nn.ReLU(),
        nn.Linear(200, 200),
        nn.ReLU(),
        nn.Linear(200, 10),
    )


def fashion_share(
    data_dir: str, partition: int, partitions: int
) -> tuple[np.ndarray, np.ndarray]:
    """This node's rows of a fixed shuffle of the training set (flattened images)."""
    images, labels = fashion_train(data_dir)
    start = partition * len(labels) // partitions
    stop = (partition + 1) * len(labels) // partitions
    return images[start:stop], labels[start:stop]


@lru_cache(maxsize=1)
def fashion_train(data_dir: str) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST's training set (uint8, n x 784), shuffled once a process."""
    folder = Path(data_dir)
    images = read_idx(folder / "train-images-idx3-ubyte.gz")
    labels = read_idx(folder / "train-labels-idx1-ubyte.gz")
    order = np.random.default_rng(0).permutation(len(labels))
    return images.reshape(len(labels), -1)[order], labels[order]


def read_idx(path: Path) -> np.ndarray:
    """An idx file (big-endian header: zero, zero, type 8 = uint8, dimensions)."""
    raw = gzip.decompress(path.read_bytes())
    if raw[:3] != b"\0\0\x08":
        raise ValueError(f"{path}: not a uint8 idx file")
    ndim = raw[3]
    shape = tuple(np.frombuffer(raw, ">i4", count=ndim, offset=4))
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(shape)
