"""pytorch-example: A Flower / PyTorch app.

Adapted from Flower's examples/advanced-pytorch (Copyright Flower Labs GmbH,
Apache License 2.0; see NOTICE at the root of this repository).
"""

import functools
import json
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: N812
from datasets import Dataset
from flwr.app import UserConfig
from torch.utils.data import DataLoader

from flwr_prox_strategies.task import load_fashion_mnist, partition_indices

FM_NORMALIZATION = ((0.1307,), (0.3081,))


# torchvision's ToTensor, Normalize, RandomCrop and RandomHorizontalFlip, in torch
def to_tensor(img):
    """Make a 28x28 uint8 image a 1x28x28 float tensor in [0, 1]."""
    return torch.as_tensor(np.asarray(img, dtype=np.uint8)).div(255.0).unsqueeze(0)


def normalize(x):
    """Normalise with Fashion-MNIST's mean and standard deviation."""
    (mean,), (std,) = FM_NORMALIZATION
    return (x - mean) / std


def random_crop(x, size=28, padding=4):
    """Pad with black, then cut a random size x size window."""
    x = F.pad(x, (padding, padding, padding, padding))
    top, left = torch.randint(0, 2 * padding + 1, (2,)).tolist()
    return x[:, top : top + size, left : left + size]


def random_horizontal_flip(x, p=0.5):
    """Mirror the image with probability p."""
    return x.flip(-1) if torch.rand(()).item() < p else x


def compose(*transforms):
    """Chain transforms, first to last."""

    def apply(img):
        for transform in transforms:
            img = transform(img)
        return img

    return apply


EVAL_TRANSFORMS = compose(to_tensor, normalize)
TRAIN_TRANSFORMS = compose(to_tensor, random_crop, random_horizontal_flip, normalize)


class Net(nn.Module):
    """Model (simple CNN adapted for Fashion-MNIST)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(16, 32, 5)
        self.fc1 = nn.Linear(32 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        """Return the class scores of a batch of 1x28x28 images."""
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 32 * 4 * 4)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def train(net, trainloader, epochs, lr, device, rule=None, momentum=0.9):
    """Train the model on the training set."""
    net.to(device)  # move model to GPU if available
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    if rule is not None:
        rule.attach(optimizer)  # adds the algorithm's term before every step
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            images = batch["image"]
            labels = batch["label"]
            optimizer.zero_grad()
            loss = criterion(net(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()

    avg_trainloss = running_loss / len(trainloader)
    return avg_trainloss


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            images = batch["image"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy


def apply_train_transforms(batch):
    """Apply transforms to the partition."""
    batch["image"] = [TRAIN_TRANSFORMS(img) for img in batch["image"]]
    return batch


def apply_eval_transforms(batch):
    """Apply transforms to the partition."""
    batch["image"] = [EVAL_TRANSFORMS(img) for img in batch["image"]]
    return batch


@functools.cache
def load_fashion_mnist_split(split: str, data_dir: str = "", num_images: int = 0):
    """Read the first `num_images` (0: all) of a Fashion-MNIST split, once.

    The original idx files: in `data_dir`, or ("") in $FLWR_PROX_DATA_DIR/
    fashion-mnist, shared/data/fashion-mnist above the working directory or
    the pack, /usr/share/datasets/fashion-mnist, else from the Hugging Face hub.
    """
    limits = {"train": None, "test": None, split: num_images or None}
    limits["test" if split == "train" else "train"] = 1  # read one row of the other
    data = load_fashion_mnist(
        data_dir=data_dir or None, max_train=limits["train"], max_test=limits["test"]
    )
    arrays = data.train if split == "train" else data.test
    images = (arrays.x.reshape(-1, 28, 28) * 255.0).round().astype(np.uint8)
    return Dataset.from_dict({"image": images, "label": arrays.y})


@functools.cache
def partition_rows(num_partitions: int, data_dir: str, num_images: int):
    """Split the training rows among the nodes, once (Dirichlet over labels)."""
    labels = load_fashion_mnist_split("train", data_dir, num_images)["label"]
    return partition_indices(
        labels, num_partitions=num_partitions, scheme="dirichlet", alpha=1.0, seed=42
    )


def load_data(
    partition_id: int, num_partitions: int, data_dir: str = "", num_images: int = 0
):
    """Load partition FashionMNIST data."""
    # Only read and partition the data set once
    rows = partition_rows(num_partitions, data_dir, num_images)[partition_id]
    partition = load_fashion_mnist_split("train", data_dir, num_images).select(rows)
    # Divide data on each node: 80% train, 20% test
    partition_train_test = partition.train_test_split(test_size=0.2, seed=42)

    train_partition = partition_train_test["train"].with_transform(
        apply_train_transforms
    )
    test_partition = partition_train_test["test"].with_transform(apply_eval_transforms)
    trainloader = DataLoader(train_partition, batch_size=32, shuffle=True)
    testloader = DataLoader(test_partition, batch_size=32)
    return trainloader, testloader


def create_run_dir(config: UserConfig) -> tuple[Path, str]:
    """Create a directory where to save results from this run."""
    # Create output directory given current timestamp
    current_time = datetime.now()
    run_dir = current_time.strftime("%Y-%m-%d/%H-%M-%S")
    # Save path is based on the current directory (or the run config's output-root)
    save_path = Path.cwd() / str(config["output-root"]) / run_dir
    save_path.mkdir(parents=True, exist_ok=False)

    # Save run config as json
    with open(f"{save_path}/run_config.json", "w", encoding="utf-8") as fp:
        json.dump(config, fp)

    return save_path, run_dir
