"""pytorchexample: A Flower / PyTorch app.

Adapted from Flower's examples/quickstart-pytorch (Copyright Flower Labs GmbH,
Apache License 2.0; see NOTICE at the root of this repository).
"""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: N812
from datasets import Dataset
from flwr_datasets.partitioner import IidPartitioner
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader


class Net(nn.Module):
    """Model (simple CNN adapted from 'PyTorch: A 60 Minute Blitz')."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        """Return the class scores of a batch of 3x32x32 images."""
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


fds = None  # Cache the partitioned data set

# Offline data: scikit-learn's digits (1797 8x8 images, shipped inside the
# package), split like CIFAR-10 into "train" (partitioned) and "test" (central).
# train_test_split shuffles with a fixed seed: IidPartitioner cuts contiguous
# blocks, so the partitions must not inherit the file's order.
_digits = load_digits()
digits = Dataset.from_dict(
    {"img": _digits.images.astype(np.float32), "label": _digits.target}
).train_test_split(test_size=0.2, seed=42)


def pytorch_transforms(img):
    """Make an 8x8 digit (values 0..16) a 3x32x32 tensor in [-1, 1] for Net."""
    x = torch.as_tensor(img, dtype=torch.float32).div(16.0).view(1, 1, 8, 8)
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    return x.view(1, 32, 32).expand(3, 32, 32).sub(0.5).div(0.5)


def apply_transforms(batch):
    """Apply transforms to the partition."""
    batch["img"] = [pytorch_transforms(img) for img in batch["img"]]
    return batch


def load_data(partition_id: int, num_partitions: int, batch_size: int, seed: int = 0):
    """Load partition of the digits data."""
    # Only partition the data set once
    global fds
    if fds is None:
        fds = IidPartitioner(num_partitions=num_partitions)
        fds.dataset = digits["train"]
    partition = fds.load_partition(partition_id)
    # Divide data on each node: 80% train, 20% test
    partition_train_test = partition.train_test_split(test_size=0.2, seed=42)
    # Construct dataloaders
    partition_train_test = partition_train_test.with_transform(apply_transforms)
    trainloader = DataLoader(
        partition_train_test["train"],
        batch_size=batch_size,
        shuffle=True,
        # The same batches in every run with this seed
        generator=torch.Generator().manual_seed(seed + partition_id),
    )
    testloader = DataLoader(partition_train_test["test"], batch_size=batch_size)
    return trainloader, testloader


def load_centralized_dataset():
    """Load test set and return dataloader."""
    # Load entire test set
    dataset = digits["test"].with_transform(apply_transforms)
    return DataLoader(dataset, batch_size=128)


def train(net, trainloader, epochs, lr, device, rule=None):
    """Train the model on the training set."""
    net.to(device)  # move model to GPU if available
    criterion = torch.nn.CrossEntropyLoss().to(device)
    # SCAFFOLD's and FedDC's control variates assume plain SGD steps
    # (rule.attach refuses momentum for them); the others keep momentum.
    momentum = 0.0 if rule is not None and rule.plain_sgd else 0.9
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    if rule is not None:
        rule.attach(optimizer)  # adds the algorithm's term before every step
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    avg_trainloss = running_loss / (epochs * len(trainloader))
    return avg_trainloss


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy
