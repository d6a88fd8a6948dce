"""Layouts: a rule's tensor per trainable parameter, a message's array per entry.

A rule computes on the model's trainable parameters (``model.parameters()``
order, float32 at least); a message carries one array per ``state_dict``
entry, buffers included, in the dtypes the server sent. Every conversion
between the two lives here, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord
from numpy.typing import NDArray
from torch import nn

from ..transport.records import to_ndarrays, to_record
from .message import ProtocolError
from .training import FederatedPart, trainable


def params_from_arrays(
    model: nn.Module,
    arrays: Sequence[NDArray],
    like: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Pick the trainable parameters' entries out of ``state_dict``-ordered arrays.

    The tensors take the dtype and device of ``like`` (one per trainable
    parameter; a rule passes its :attr:`ClientRule.anchor`), else the
    parameters' own.
    """
    keys = list(model.state_dict(keep_vars=True))
    if len(arrays) != len(keys):
        raise ProtocolError(f"received {len(arrays)} arrays, expected {len(keys)}")
    by_key = dict(zip(keys, arrays, strict=True))
    names = {id(p): name for name, p in model.named_parameters()}
    params = trainable(model)
    templates = params if like is None else list(like)
    return [
        torch.as_tensor(
            np.asarray(by_key[names[id(p)]]), dtype=t.dtype, device=t.device
        )
        for p, t in zip(params, templates, strict=True)
    ]


def numpy_dtype(tensor: torch.Tensor) -> np.dtype[Any]:
    """Return the numpy dtype a tensor travels as (bfloat16 as float32)."""
    if tensor.dtype == torch.bfloat16:
        return np.dtype(np.float32)
    return np.dtype(str(tensor.dtype).removeprefix("torch."))


def to_numpy(tensor: torch.Tensor, dtype: np.dtype[Any] | None = None) -> NDArray:
    """Return a tensor as a numpy array on the CPU, in ``dtype`` (default: its own)."""
    value = tensor.detach()
    if value.dtype == torch.bfloat16:
        value = value.float()
    array = value.cpu().numpy()
    return array if dtype is None or array.dtype == dtype else array.astype(dtype)


def arrays_from_params(
    model: nn.Module,
    tensors: Sequence[torch.Tensor],
    dtypes: Sequence[np.dtype[Any]] | None = None,
) -> list[NDArray]:
    """Lay out per-parameter tensors like ``state_dict`` (zeros for buffers).

    Each array takes the dtype of ``dtypes`` (one per ``state_dict`` entry:
    what the server sent), else its entry's own (bfloat16 as float32).
    """
    by_id = {id(p): t for p, t in zip(trainable(model), tensors, strict=True)}
    named = dict(model.named_parameters())
    entries = model.state_dict(keep_vars=True).items()
    wanted = list(dtypes) if dtypes is not None else [None] * len(entries)
    out = []
    for (key, value), given in zip(entries, wanted, strict=True):
        dtype = numpy_dtype(value) if given is None else np.dtype(given)
        param = named.get(key)
        tensor = by_id.get(id(param)) if param is not None else None
        out.append(
            to_numpy(tensor, dtype)
            if tensor is not None
            else np.zeros(tuple(value.shape), dtype=dtype)
        )
    return out


def rule_precision(param: torch.Tensor) -> torch.Tensor:
    """Return a copy of ``param`` in the precision a rule computes in.

    Half-precision parameters (bfloat16, float16) are copied as float32: the
    anchor, the state and the received records keep the server's precision
    while the model trains in the lower one.
    """
    value = param.detach().clone()
    if value.is_floating_point() and value.element_size() < 4:
        return value.float()
    return value


def load_arrays(model: nn.Module, arrays: ArrayRecord | Sequence[NDArray]) -> None:
    """Load arrays into ``model`` (``state_dict`` order, every shape checked)."""
    values = to_ndarrays(arrays) if isinstance(arrays, ArrayRecord) else arrays
    state = model.state_dict()
    if len(values) != len(state):
        trainable_count = sum(1 for p in model.parameters() if p.requires_grad)
        hint = ""
        if len(values) < len(state) and not isinstance(model, FederatedPart):
            hint = (
                " (fewer than the model's: if the server federates a part of it, "
                "build the rule or client on federated_part(model)"
                + (
                    f", whose {trainable_count} trainable tensors would match)"
                    if trainable_count == len(values)
                    else ")"
                )
            )
        elif isinstance(model, FederatedPart):
            hint = (
                " (the server sends another layout than this federated part: "
                "give the server ArrayRecord(federated_part(model).state_dict()) "
                "as its initial arrays)"
            )
        raise ProtocolError(
            f"received {len(values)} arrays, the model has {len(state)} tensors{hint}"
        )
    new_state = {}
    for (key, current), value in zip(state.items(), values, strict=True):
        if tuple(current.shape) != tuple(np.shape(value)):
            raise ProtocolError(
                f"array for '{key}' has shape {np.shape(value)}, "
                f"model expects {tuple(current.shape)}"
            )
        new_state[key] = torch.as_tensor(
            np.asarray(value), dtype=current.dtype, device=current.device
        )
    model.load_state_dict(new_state, strict=True)


class ReplyLayout:
    """How one model's reply records are laid out: its entries, the server's dtypes.

    Parameters
    ----------
    model : torch.nn.Module
        The model the rule trains.
    keys : Sequence[str] (default: ())
        The received model record's keys (a reply record reuses them).
    dtypes : Sequence[numpy.dtype] | None (default: None)
        The dtypes the server sent, one per ``state_dict`` entry (None: the
        model's own).
    """

    def __init__(
        self,
        model: nn.Module,
        keys: Sequence[str] = (),
        dtypes: Sequence[np.dtype[Any]] | None = None,
    ) -> None:
        self.model = model
        self.keys = list(keys)
        self.dtypes = None if dtypes is None else list(dtypes)

    def server_dtypes(self) -> list[np.dtype[Any]] | None:
        """Return the dtypes the server sent, one per ``state_dict`` entry, or None."""
        if not self.dtypes or len(self.dtypes) != len(self.model.state_dict()):
            return None
        return self.dtypes

    def to_reply(
        self,
        tensors: Sequence[torch.Tensor],
        params: Sequence[torch.Tensor],
        *,
        buffers: str,
        rule: str,
    ) -> list[NDArray]:
        """Lay out one tensor per parameter of ``params`` as a reply record.

        See :meth:`ClientRule.to_reply_layout
        <flwr_prox_strategies.extend.ClientRule.to_reply_layout>`; ``rule``
        names the caller in errors.
        """
        if buffers not in ("zeros", "model"):
            raise ValueError(f"buffers must be 'zeros' or 'model', got {buffers!r}")
        tensors = list(tensors)
        if len(tensors) != len(params) or any(
            tuple(t.shape) != tuple(p.shape)
            for t, p in zip(tensors, params, strict=True)
        ):
            raise ValueError(
                f"{rule}.to_reply_layout takes one tensor per trainable parameter "
                f"({len(params)}, shaped as rule.params), got {len(tensors)}"
            )
        arrays = arrays_from_params(self.model, tensors, self.server_dtypes())
        if buffers == "model":
            ours = {id(p) for p in params}
            trained = {n for n, p in self.model.named_parameters() if id(p) in ours}
            for i, (name, value) in enumerate(self.model.state_dict().items()):
                if name not in trained:
                    arrays[i] = to_numpy(value, arrays[i].dtype)
        return arrays

    def record(self, arrays: Sequence[NDArray]) -> ArrayRecord:
        """Return a reply record: in the server's dtypes when it has one per entry."""
        dtypes = self.server_dtypes()
        if dtypes is not None and len(arrays) == len(dtypes):
            arrays = [
                np.asarray(a).astype(dt, copy=False)
                for a, dt in zip(arrays, dtypes, strict=True)
            ]
        return to_record(list(arrays), self.keys or None)

    def model_record(self) -> ArrayRecord:
        """Return the model's ``state_dict`` as a reply record (the server's dtypes)."""
        dtypes = self.server_dtypes()
        return to_record(
            [
                to_numpy(v, None if dtypes is None else dtypes[i])
                for i, v in enumerate(self.model.state_dict().values())
            ],
            self.keys or None,
        )


__all__ = [
    "ReplyLayout",
    "arrays_from_params",
    "load_arrays",
    "numpy_dtype",
    "params_from_arrays",
    "rule_precision",
    "to_numpy",
]
