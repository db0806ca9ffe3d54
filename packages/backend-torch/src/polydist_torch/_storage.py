"""Which tensors are a variable's storage: the tensors polydist writes into in place.

A torch variable's storage may be updated in place: a ``torch.nn.Parameter``
behind :func:`polydist_torch.parameters` takes every ``assign`` by ``copy_``, a
distributed module's parameters and buffers are stepped by torch optimizers and
BatchNorm, and so on. A collective may hand a tensor back without a copy only if
nothing will later write into it behind the caller's back, so it asks here: every
tensor the backend stores for a variable (``TorchBackend.store_variable``), and
every tensor the torch package makes a variable's storage (``swap_storage`` in
``distribute_module`` and ``parameters``), is marked, and so is its memory: another
tensor on that memory (``w.detach()``, ``w[0]``, ``w.view(-1)``) sees the same
writes, so it counts as storage too. Marks are weak (a tensor that dies leaves the
registry) and never removed otherwise: a tensor that was once storage only costs a
copy.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["is_variable_storage", "mark_variable_storage"]

# id of a marked tensor -> that tensor (weakly). A plain dict of weak references, not
# torch's WeakIdKeyDictionary: every collective of a lone replica asks, and a lookup
# there builds a reference object per call.
_STORAGE: dict[int, weakref.ref[torch.Tensor]] = {}
# The address of a marked tensor's memory -> that tensor (weakly), for tensors that share
# the memory without being the marked object.
_BY_MEMORY: dict[int, weakref.ref[torch.Tensor]] = {}


def _memory(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s memory (its storage's, whatever its offset); 0 when it
    has none to share (empty, or not a strided CPU/CUDA tensor)."""
    if tensor.layout is not torch.strided or tensor.device.type not in ("cpu", "cuda"):
        return 0
    return int(tensor.untyped_storage().data_ptr())


def _hold_weakly(registry: dict[int, weakref.ref[torch.Tensor]], key: int, tensor: Any) -> None:
    """``registry[key]``: ``tensor``, weakly; the entry leaves when the tensor dies (unless
    a newer tensor took the key: a reused id or address)."""
    held = registry.get(key)
    if held is not None and held() is tensor:
        return

    def forget(ref: weakref.ref[torch.Tensor]) -> None:
        if registry.get(key) is ref:
            del registry[key]

    registry[key] = weakref.ref(tensor, forget)


def mark_variable_storage(tensor: Any) -> None:
    """Records ``tensor`` as (part of) a variable's storage."""
    if not isinstance(tensor, torch.Tensor):
        return
    _hold_weakly(_STORAGE, id(tensor), tensor)
    address = _memory(tensor)
    if address:
        _hold_weakly(_BY_MEMORY, address, tensor)


def is_variable_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is, or once was, a variable's storage, or shares its memory."""
    if not _STORAGE:
        # No marked tensor lives, so no memory is marked either (a marked tensor leaves
        # both registries when it dies).
        return False
    marked = _STORAGE.get(id(tensor))
    if marked is not None and marked() is tensor:
        return True
    address = _memory(tensor)
    if not address:
        return False
    ref = _BY_MEMORY.get(address)
    owner = ref() if ref is not None else None
    # The owner still lives on that memory (not a stale address the allocator reused).
    return owner is not None and _memory(owner) == address
