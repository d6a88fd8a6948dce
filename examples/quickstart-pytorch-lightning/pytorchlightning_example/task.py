"""pytorchlightning_example: A Flower / PyTorch Lightning app.

Adapted from Flower's examples/quickstart-pytorch-lightning (Copyright Flower
Labs GmbH, Apache License 2.0; see NOTICE at the root of this repository).
"""

import logging
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from datasets import Dataset
from flwr_datasets.partitioner import IidPartitioner
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils.data import DataLoader

logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)


class LitAutoEncoder(pl.LightningModule):
    """Flower's autoencoder, on 8x8 digits; the optimiser is chosen per run."""

    def __init__(self, optimizer: str = "adam", lr: float = 1e-3) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(8 * 8, 64),
            nn.ReLU(),
            nn.Linear(64, 3),
        )
        self.decoder = nn.Sequential(
            nn.Linear(3, 64),
            nn.ReLU(),
            nn.Linear(64, 8 * 8),
        )
        self.optimizer, self.lr = optimizer, lr

    def forward(self, x) -> Any:
        """Return the embedding of a batch."""
        embedding = self.encoder(x)
        return embedding

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Return Adam (Flower's), or plain SGD (what SCAFFOLD and FedDC need)."""
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        return optimizer

    def training_step(self, train_batch, batch_idx) -> torch.Tensor:
        """Return the reconstruction loss of a batch."""
        x = train_batch["image"]
        x = x.view(x.size(0), -1)
        z = self.encoder(x)
        x_hat = self.decoder(z)
        loss = F.mse_loss(x_hat, x)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx) -> None:
        """Log the validation loss."""
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx) -> None:
        """Log the test loss."""
        self._evaluate(batch, "test")

    def _evaluate(self, batch, stage=None) -> None:
        x = batch["image"]
        x = x.view(x.size(0), -1)
        z = self.encoder(x)
        x_hat = self.decoder(z)
        loss = F.mse_loss(x_hat, x)
        if stage:
            self.log(f"{stage}_loss", loss, prog_bar=True)


def apply_transforms(batch):
    """Make each 8x8 digit (values 0..16) a float tensor in [0, 1]."""
    batch["image"] = [
        torch.as_tensor(np.asarray(img), dtype=torch.float32).div(16.0)
        for img in batch["image"]
    ]
    return batch


fds = None  # Cache the partitioner

# Offline data: scikit-learn's digits (1797 8x8 images, shipped inside the
# package) instead of MNIST from the Hugging Face hub, shuffled with a fixed
# seed (IidPartitioner cuts contiguous blocks).
_digits = load_digits()
digits = Dataset.from_dict(
    {"image": _digits.images.astype(np.float32), "label": _digits.target}
).shuffle(seed=42)


def load_data(partition_id, num_partitions, seed: int = 0):
    """Return the train, validation and test loaders of one partition."""
    # Only partition the data set once
    global fds
    if fds is None:
        fds = IidPartitioner(num_partitions=num_partitions)
        fds.dataset = digits
    partition = fds.load_partition(partition_id)

    partition = partition.with_transform(apply_transforms)
    # 20 % for on federated evaluation
    partition_full = partition.train_test_split(test_size=0.2, seed=42)
    # 60 % for the federated train and 20 % for the federated validation (both in fit)
    partition_train_valid = partition_full["train"].train_test_split(
        train_size=0.75, seed=42
    )
    trainloader = DataLoader(
        partition_train_valid["train"],
        batch_size=32,
        shuffle=True,
        # The same batches in every run with this seed
        generator=torch.Generator().manual_seed(seed + partition_id),
    )
    valloader = DataLoader(
        partition_train_valid["test"],
        batch_size=32,
    )
    testloader = DataLoader(partition_full["test"], batch_size=32)
    return trainloader, valloader, testloader
