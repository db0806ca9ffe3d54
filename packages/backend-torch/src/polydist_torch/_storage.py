"""Which tensors are a variable's storage: the tensors polydist writes into in place.

A torch variable's storage may be updated in place: a ``torch.nn.Parameter``
behind :func:`polydist_torch.parameters` takes every ``assign`` by ``copy_``, a
distributed module's parameters and buffers are stepped by torch optimizers and
BatchNorm, and so on. A collective may hand a tensor back without a copy only if
nothing will later write into it behind the caller's back, so it asks here: every
tensor the backend stores for a variable (``TorchBackend.store_variable``), and
every tensor the torch package makes a variable's storage (``swap_storage`` in
``distribute_module`` and ``parameters``), is marked. Marks are weak (a tensor
that dies leaves the registry) and never removed otherwise: a tensor that was once
storage only costs a copy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["is_variable_storage", "mark_variable_storage"]

_STORAGE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def mark_variable_storage(tensor: Any) -> None:
    """Records ``tensor`` as (part of) a variable's storage."""
    if isinstance(tensor, torch.Tensor):
        _STORAGE[tensor] = True


def is_variable_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is, or once was, a variable's storage."""
    return tensor in _STORAGE
