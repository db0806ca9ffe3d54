"""The list collectives: one tensor per replica in, one result per destination out.

Two algorithms:

* ``"sequential"``: add in replica order on the first destination's device,
  ``((x0 + x1) + x2) + ...``, one rounding per addition. Elementwise addition
  is correctly rounded on CPU and CUDA alike, so this is the sim's
  ``"sequential"`` order bit for bit.
* ``"nccl"``: ``torch.cuda.comm.reduce_add`` / ``gather`` / ``broadcast`` when
  every value is on its own CUDA device. Their summation order is NCCL's, so
  they are not bitwise reproducible against the sim. Anything else (CPU
  replicas, mixed devices, complex dtypes) falls back to ``"sequential"``.

With several values or destinations every result is a new tensor, a distinct one
per destination: replicas may update their copy in place, and each copy gets its
own autograd history. One value onto its own device (a one-replica ``all_reduce`` or
``all_gather``) is its own sum: it comes back as it is, as torch's ``x.to(x.device)``
returns ``x``. TF's rule is that the input is not modified, and nothing in polydist
writes into it later, with one exception that is copied: a variable's storage, or
another tensor on its memory (``_storage.py``), which assignments, optimizers and
BatchNorm update in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from polydist_torch._devices import torch_device
from polydist_torch._storage import is_variable_storage

__all__ = ["Algorithm", "all_gather", "all_reduce", "broadcast", "reduce_to"]

Algorithm = Literal["sequential", "nccl"]


def _nccl_ok(values: Sequence[torch.Tensor], devices: Sequence[torch.device]) -> bool:
    """True when torch.cuda.comm applies: one value per distinct CUDA device, not complex."""
    if len(values) < 2 or values[0].is_complex():
        return False
    if any(t.device.type != "cuda" for t in values) or any(d.type != "cuda" for d in devices):
        return False
    value_devices = {t.device.index for t in values}
    return len(value_devices) == len(values) and len({d.index for d in devices}) == len(devices)


def _alone(values: Sequence[torch.Tensor], devices: Sequence[torch.device]) -> torch.Tensor | None:
    """The one value, when it is alone and already on its one destination and is no
    variable's storage: then it is its own sum (and concatenation), handed back as it
    is. ``None`` otherwise (a copy is made)."""
    if len(values) != 1 or len(devices) != 1:
        return None
    value = values[0]
    if value.device != devices[0] or is_variable_storage(value):
        return None
    return value


def _sum_sequential(values: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = values[0].to(device, copy=True)
    for value in values[1:]:
        total.add_(value.to(device))
    return total


def _copies(value: torch.Tensor, devices: Sequence[torch.device]) -> list[torch.Tensor]:
    """``value`` itself on the first device (moved if needed), fresh copies on the others."""
    # The device test spares a .to call, which in a GPU replica passes through the
    # replica's torch function mode (a few microseconds each).
    first = value if value.device == devices[0] else value.to(devices[0])
    return [first, *(value.to(d, copy=True) for d in devices[1:])]


def _comm() -> Any:
    # torch.cuda.comm is untyped; imported when a CUDA collective runs.
    from torch.cuda import comm

    return comm


def _broadcast_cuda(value: torch.Tensor, devices: Sequence[torch.device]) -> list[torch.Tensor]:
    # comm.broadcast hands back ``value`` itself for its own device; others are copies.
    return list(_comm().broadcast(value, devices=[d.index for d in devices]))


def all_reduce(
    values: Sequence[torch.Tensor], destinations: Sequence[str], algorithm: Algorithm
) -> list[torch.Tensor]:
    devices = [torch_device(d) for d in destinations]
    alone = _alone(values, devices)
    if alone is not None:
        return [alone]
    with torch.no_grad():
        if algorithm == "nccl" and _nccl_ok(values, devices):
            root = values[0].device.index
            total = _comm().reduce_add(list(values), destination=root)
            return _broadcast_cuda(total, devices)
        return _copies(_sum_sequential(values, devices[0]), devices)


def reduce_to(
    values: Sequence[torch.Tensor], destination: str, algorithm: Algorithm
) -> torch.Tensor:
    device = torch_device(destination)
    with torch.no_grad():
        if algorithm == "nccl" and _nccl_ok(values, [v.device for v in values]):
            total: torch.Tensor = _comm().reduce_add(
                list(values), destination=values[0].device.index
            )
            return total.to(device)
        return _sum_sequential(values, device)


def all_gather(
    values: Sequence[torch.Tensor], axis: int, destinations: Sequence[str], algorithm: Algorithm
) -> list[torch.Tensor]:
    devices = [torch_device(d) for d in destinations]
    alone = _alone(values, devices)
    if alone is not None:
        return [alone]
    axis = axis % values[0].dim()
    with torch.no_grad():
        if algorithm == "nccl" and _nccl_ok(values, devices):
            gathered = _comm().gather(list(values), dim=axis, destination=devices[0])
            return _broadcast_cuda(gathered, devices)
        gathered = torch.cat([v.to(devices[0]) for v in values], dim=axis)
        return _copies(gathered, devices)


def broadcast(
    value: torch.Tensor, destinations: Sequence[str], algorithm: Algorithm
) -> list[torch.Tensor]:
    devices = [torch_device(d) for d in destinations]
    with torch.no_grad():
        distinct_cuda = all(d.type == "cuda" for d in devices) and len(
            {d.index for d in devices}
        ) == len(devices)
        if (
            algorithm == "nccl"
            and len(devices) > 1
            and distinct_cuda
            and value.device.type == "cuda"
            and not value.is_complex()
        ):
            copies = _broadcast_cuda(value, devices)
            # Never hand out the input itself: every destination gets a copy.
            return [c.clone() if c is value else c for c in copies]
        return [value.to(d, copy=True) for d in devices]
