"""The one local training loop every client of the pack uses.

Algorithms differ in the gradient they follow, not in the loop: each passes a
:class:`GradientTerm` whose ``add_`` adds its extra gradient (proximal,
dynamic-regulariser, drift correction, ...) to ``p.grad`` after the data
gradient is computed and before the optimiser step. Adding the term's gradient
directly (rather than a penalty to the loss) is exact, cheaper than autograd
through the penalty, and keeps the term outside any per-sample privatisation of
the data gradient.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate, default_convert

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BatchFn = Callable[[Any], tuple[torch.Tensor, torch.Tensor]]

# Keys a mapping batch's inputs are looked up under when none is given: the
# names flwr-datasets' image data sets (and Flower's examples) use.
DEFAULT_INPUT_KEYS = ("img", "image")


#: The functions :func:`batch_unpacker` made: each unpacks any pair of tensors.
_PAIR_UNPACKERS: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


def batch_unpacker(input_key: str | None = None, label_key: str = "label") -> BatchFn:
    """Return a function turning one batch into ``(inputs, targets)``.

    A batch may be a pair (a tuple or list of two tensors, what a
    ``TensorDataset`` yields) or a mapping (what flwr-datasets and Flower's
    examples yield), read under ``input_key`` (by default the first of
    ``"img"``, ``"image"`` present) and ``label_key``.
    """

    def unpack(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(batch, Mapping):
            keys = [input_key] if input_key is not None else DEFAULT_INPUT_KEYS
            found = next((k for k in keys if k in batch), None)
            if found is None or label_key not in batch:
                raise BatchFormatError(
                    "must yield (inputs, targets) or a mapping with keys "
                    f"{_either(keys)} and {label_key!r}; got "
                    f"{type(batch).__name__} with keys {sorted(map(str, batch))} "
                    "(set input_key= / label_key=, or batch_fn=)"
                )
            return batch[found], batch[label_key]
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return batch[0], batch[1]
        kind = (
            f"{type(batch).__name__} of length {len(batch)}"
            if isinstance(batch, (tuple, list))
            else type(batch).__name__
        )
        raise BatchFormatError(
            "must yield (inputs, targets) or a mapping with keys "
            f"{_either([input_key] if input_key else DEFAULT_INPUT_KEYS)} and "
            f"{label_key!r}; got {kind} (set batch_fn= to unpack it)"
        )

    _PAIR_UNPACKERS.add(unpack)
    return unpack


def _either(keys: Sequence[str]) -> str:
    return " or ".join(repr(k) for k in keys)


class BatchFormatError(TypeError):
    """A data loader yields batches the client cannot unpack."""


class PairLoader:
    """A loader seen through a batch function: it yields ``(inputs, targets)``.

    Everything else (``len``, ``dataset``, ``batch_size``, ...) is the wrapped
    loader's, so DP-SGD's Poisson sampling and the sample counts still see it.
    """

    def __init__(self, loader: Iterable[Any], batch_fn: BatchFn) -> None:
        self.loader = loader
        self.batch_fn = batch_fn

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in self.loader:
            yield self.batch_fn(batch)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "batch_fn"):  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.loader, name)


def _generators_of(loader: Any) -> list[torch.Generator]:
    """Return the distinct torch generators a DataLoader draws from."""
    found: dict[int, torch.Generator] = {}
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    for owner in (loader, sampler, getattr(batch_sampler, "sampler", None)):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator):
            found[id(generator)] = generator
    return list(found.values())


def _yields_tensor_pairs(loader: Iterable[Any]) -> bool:
    """Return whether every batch of ``loader`` is a pair of tensors, unread.

    True for a ``DataLoader`` over a ``TensorDataset`` of two tensors with
    torch's own collation (what the pack's :func:`~..experiment.data.to_loader`
    builds): its samples are pairs of tensors and a batch of them collates to
    a pair of tensors.
    """
    if not isinstance(loader, DataLoader):
        return False
    dataset = loader.dataset
    return (
        type(dataset) is TensorDataset
        and len(dataset.tensors) == 2
        and loader.collate_fn in (default_collate, default_convert)
    )


def check_batches(loader: Iterable[Any], batch_fn: BatchFn, name: str) -> None:
    """Unpack ``loader``'s first batch now; fail naming ``name`` and what it got.

    The peek runs with torch's random state (and the loader's own generators)
    saved and restored, so a shuffling loader draws the same batches
    afterwards as it would have without it. A loader known to yield pairs of
    tensors, read by a :func:`batch_unpacker` (which unpacks any pair), is not
    peeked: its batches cannot fail the check, and a peek costs a batch (a
    client built for every message, at thousands of nodes, paid it each time).
    """
    if batch_fn in _PAIR_UNPACKERS and _yields_tensor_pairs(loader):
        return
    generators = _generators_of(loader)
    states = [g.get_state() for g in generators]
    try:
        with torch.random.fork_rng(devices=[]):
            first = next(iter(loader), None)
    except TypeError as err:
        raise BatchFormatError(f"{name} is not iterable: {err}") from err
    finally:
        for generator, state in zip(generators, states, strict=True):
            generator.set_state(state)
    if first is None:
        return  # an empty loader is reported when it is trained on
    try:
        inputs, targets = batch_fn(first)
    except BatchFormatError as err:
        raise BatchFormatError(f"{name} {err}") from None
    for part, value in (("inputs", inputs), ("targets", targets)):
        if not isinstance(value, torch.Tensor):
            raise BatchFormatError(
                f"{name}'s batches give {part} of type {type(value).__name__}, "
                "not a torch.Tensor (add a transform that makes tensors, or "
                "set batch_fn=)"
            )


class GradientTerm(Protocol):
    r"""An extra term of the local objective, known through its gradient.

    What :meth:`ClientRule.setup <flwr_prox_strategies.extend.ClientRule.setup>`
    returns: any object with an ``add_`` method (a protocol, no base class to
    inherit). FedProx's term adds :math:`\mu(\theta - \theta_t)`, SCAFFOLD's
    the control-variate correction :math:`c - c_i`. The term reads no data, so
    under DP-SGD it is added after the per-example clipping and noise.
    """

    def add_(self, params: Sequence[torch.Tensor]) -> None:
        """Add the term's gradient at ``params`` to each ``p.grad`` in place.

        Parameters
        ----------
        params : Sequence[torch.Tensor]
            The model's trainable parameters, in ``state_dict`` order, their
            ``grad`` already holding the data gradient.
        """


@dataclass
class TrainReport:
    """What one local solve did."""

    epochs: int
    steps: int
    examples_seen: int
    mean_loss: float
    stopped_early: bool = False


def resolve_device(device: str | torch.device) -> torch.device:
    """Return ``device``; ``"auto"`` is CUDA when available, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@functools.cache
def _cpu_only() -> bool:
    """Return whether the CPU is the only device torch could seed in this process."""
    if torch.cuda.is_available() or torch.backends.mps.is_available():
        return False
    for name in ("xpu", "mtia"):
        module = getattr(torch, name, None)
        if module is not None and module.is_available():
            return False
    # A custom (privateuse1) backend's module, once registered, is seeded too.
    return not hasattr(torch, torch._C._get_privateuse1_backend_name())


def seed_torch(seed: int) -> None:
    """Seed torch's generators as ``torch.manual_seed(seed)`` does, cheaply.

    ``torch.manual_seed`` also seeds every accelerator torch was built for; for
    CUDA not yet initialised it records the caller's stack
    (``traceback.format_stack``) to replay the seed later, at every call: about
    0.5 ms in a client, a tenth of its round at thousands of nodes. With no
    accelerator available only the CPU generator ever draws, and it is seeded
    alone, to the same state; otherwise this is ``torch.manual_seed``.

    Parameters
    ----------
    seed : int
        The seed, as ``torch.manual_seed`` takes it.
    """
    if _cpu_only():
        torch.random.default_generator.manual_seed(int(seed))
    else:
        torch.manual_seed(seed)


def trainable(model: nn.Module) -> list[torch.Tensor]:
    """Return the model's trainable parameters in ``state_dict`` order."""
    return [p for p in model.parameters() if p.requires_grad]


class FederatedPart(nn.Module):
    """The part of a model that is federated: a view sharing the model's parameters.

    Build it with :func:`federated_part` and give it to a rule in place of the
    model (``XxxRule.from_message(msg, context, federated_part(model))``): the
    rule loads the received arrays into the part, builds its anchor, control
    variates and state over the part's parameters, and replies with the part's
    ``state_dict`` only; the rest of the model stays local and untouched by
    the federation. The part holds the model's own ``Parameter`` objects under
    their names in the model, so an optimiser built on ``model.parameters()``
    steps them, and calling the part runs the whole model.

    Parameters
    ----------
    model : torch.nn.Module
        The whole model.
    names : Sequence[str]
        The names (as in ``model.named_parameters()``) of the federated
        parameters, in the model's order.
    """

    source: nn.Module
    names: tuple[str, ...]

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        super().__init__()
        object.__setattr__(self, "source", model)  # not a submodule: its parts only
        found = dict(model.named_parameters())
        for name in names:
            holder: nn.Module = self
            *path, leaf = name.split(".")
            for step in path:  # mirror the dotted path: the same state_dict keys
                if step not in holder._modules:
                    holder.add_module(step, nn.Module())
                holder = holder._modules[step]  # type: ignore[assignment]
            holder.register_parameter(leaf, found[name])
        self.names = tuple(names)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the whole model."""
        return self.source(*args, **kwargs)

    def __repr__(self) -> str:
        """Name the model and how many tensors are federated."""
        return (
            f"FederatedPart({type(self.source).__name__}, {len(self.names)} of "
            f"{len(list(self.source.parameters()))} parameter tensors)"
        )


def federated_part(
    model: nn.Module,
    which: str | Sequence[str] | Callable[[str, torch.Tensor], bool] = "trainable",
) -> FederatedPart:
    """Return the part of ``model`` that is federated (see :class:`FederatedPart`).

    Parameters
    ----------
    model : torch.nn.Module
        The whole model, for example a ``peft`` model or a network whose
        backbone has ``requires_grad=False``.
    which : str | Sequence[str] | Callable (default: "trainable")
        ``"trainable"``: every parameter with ``requires_grad`` (a ``peft``
        model's adapters: the tensors ``get_peft_model_state_dict`` returns,
        in its order, under the model's own names); a list of parameter
        names; or ``which(name, parameter) -> bool``. Buffers are never
        federated.

    Returns
    -------
    FederatedPart
        The view the rule is built on; ``part.state_dict()`` gives the
        server's initial arrays (``ArrayRecord(part.state_dict())``).

    Raises
    ------
    ValueError
        ``which`` selects no parameter, or names one the model does not have.
    """
    named = dict(model.named_parameters())
    if isinstance(which, str) and which == "trainable":
        names = [n for n, p in named.items() if p.requires_grad]
    elif isinstance(which, str):
        raise ValueError(
            f"which must be 'trainable', a list of parameter names or a "
            f"callable, got {which!r}"
        )
    elif callable(which):
        names = [n for n, p in named.items() if which(n, p)]
    else:
        wanted = list(which)
        unknown = [n for n in wanted if n not in named]
        if unknown:
            raise ValueError(
                f"which names parameters the model does not have: {unknown[:5]}"
            )
        names = [n for n in named if n in set(wanted)]
    if not names:
        raise ValueError(
            "which selects no parameter of the model: nothing would be federated"
        )
    return FederatedPart(model, names)


def full_gradient(
    model: nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: LossFn,
    *,
    term: GradientTerm | None = None,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """Gradient of the mean loss over all of ``loader`` (plus ``term``).

    Batches are weighted by their size, so the result is the gradient of the
    mean over samples whatever the batch sizes. Leaves ``p.grad`` cleared.
    """
    params = trainable(model)
    total = [torch.zeros_like(p) for p in params]
    count = 0
    model.train()
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        grads = torch.autograd.grad(loss, params)
        batch = len(targets)
        for acc, g in zip(total, grads, strict=True):
            acc.add_(g, alpha=batch)
        count += batch
    if count == 0:
        raise ValueError("full_gradient: the data loader is empty")
    for acc in total:
        acc.div_(count)
    if term is not None:
        for p, acc in zip(params, total, strict=True):
            p.grad = acc
        term.add_(params)
        total = [p.grad.detach().clone() for p in params]  # type: ignore[union-attr]
        model.zero_grad(set_to_none=True)
    return total


def grad_norm(grads: Sequence[torch.Tensor]) -> float:
    """Euclidean norm of a list of tensors seen as one vector."""
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))  # type: ignore[arg-type]


def train_local(
    model: nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    epochs: int,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    term: GradientTerm | None = None,
    stop_after_epoch: Callable[[int], bool] | None = None,
    max_grad_norm: float | None = None,
    max_steps: int | None = None,
    device: torch.device | str = "cpu",
) -> TrainReport:
    """Run up to ``epochs`` epochs of mini-batch training.

    Each step: data gradient by backprop, then ``term.add_`` (if any), then
    clipping of the total gradient (if ``max_grad_norm``), then the optimiser
    step. ``stop_after_epoch(epoch)`` is asked after each epoch
    (1-based) and ends the solve early when it returns True (the FedProx
    gamma-inexact rule uses it). With ``max_steps``, exactly that many steps
    are run in one pass over :func:`cycle_batches` (the data restarts as often
    as needed; ``epochs`` and ``stop_after_epoch`` are ignored, and the report
    counts one epoch).
    """
    if epochs < 0:
        raise ValueError(f"epochs must be >= 0, got {epochs}")
    if max_steps is not None and max_steps < 0:
        raise ValueError(f"max_steps must be >= 0, got {max_steps}")
    params = trainable(model)
    model.train()
    steps = seen = 0
    loss_sum = 0.0
    epochs_run = 0
    stopped = False
    passes: Iterable[Iterable[tuple[torch.Tensor, torch.Tensor]]] = (
        [cycle_batches(loader, max_steps)]
        if max_steps is not None
        else (loader for _ in range(epochs))
    )
    for epoch, batches in enumerate(passes, start=1):
        for inputs, targets in batches:
            inputs, targets = inputs.to(device), targets.to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            if term is not None:
                term.add_(params)
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, max_norm=max_grad_norm)
            optimizer.step()
            steps += 1
            if len(targets):  # DP-SGD's Poisson sampling can draw an empty batch
                seen += len(targets)
                loss_sum += float(loss.detach()) * len(targets)
        epochs_run = epoch
        if (
            max_steps is None
            and stop_after_epoch is not None
            and epoch < epochs
            and stop_after_epoch(epoch)
        ):
            stopped = True
            break
    return TrainReport(
        epochs=epochs_run,
        steps=steps,
        examples_seen=seen,
        mean_loss=loss_sum / seen if seen else float("nan"),
        stopped_early=stopped,
    )


def cycle_batches(
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]], steps: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield exactly ``steps`` batches, restarting ``loader`` when it runs out.

    A ``DataLoader`` with ``shuffle=True`` reshuffles at every restart, as it
    would at the start of each epoch.
    """
    given = 0
    while given < steps:
        empty = True
        for batch in loader:
            empty = False
            yield batch
            given += 1
            if given == steps:
                return
        if empty:
            raise ValueError("the training loader yielded no examples")


@torch.no_grad()
def evaluate_model(
    model: nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: LossFn,
    *,
    device: torch.device | str = "cpu",
) -> tuple[float, float, int]:
    """Return (mean loss, accuracy, number of examples) over ``loader``.

    Accuracy is computed for classifiers (outputs with a class dimension) and
    reported as NaN for other models.
    """
    model.eval()
    loss_sum = 0.0
    correct = 0
    count = 0
    classifier = True
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        outputs = model(inputs)
        loss_sum += float(loss_fn(outputs, targets)) * len(targets)
        if outputs.dim() == 2 and outputs.shape[1] > 1 and targets.dim() == 1:
            correct += int((outputs.argmax(dim=1) == targets).sum())
        else:
            classifier = False
        count += len(targets)
    if count == 0:
        raise ValueError("evaluate_model: the data loader is empty")
    accuracy = correct / count if classifier else float("nan")
    return loss_sum / count, accuracy, count
