"""The backend's cross-replica list collectives (``strategy.reduce``/``gather`` outside ``run``).

Each takes one value per replica. Three kinds of input reach them:

* concrete ``jax.Array`` components (after ``strategy.run``): moved to the
  destination device and combined by a small jitted function;
* the components of a :class:`LazyPerReplica` (core reducing inside a compiled
  ``merge_call``): one ``lax.psum``/``lax.all_gather`` of the local value;
* other tracers (inside an outer ``jax.jit``/``jax.grad``): plain ``jnp`` ops.

Sums always add in replica order, ``((x0 + x1) + x2) + ...``, rounding after
each addition: that is what XLA's CPU all-reduce does, so the results equal
the compiled ``psum`` and the sim's ``"sequential"`` order bit for bit. Not on
bfloat16 and the float8 dtypes: XLA:CPU adds those in a wider type (its
``psum`` of ``[1] + [2**-8] * 7`` in bfloat16 is 1.03125, not 1.0), so their
sums agree with the sim only within the error bound of
``polydist_conformance.tolerance``.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from polydist_jax._devices import jax_device
from polydist_jax._lazy import AXIS, find_lazy, is_tracer
from polydist_jax._typed import psum

__all__ = ["all_gather", "all_reduce", "broadcast", "on_device", "reduce_to"]


def _chain_sum(*values: Any) -> Any:
    # A left fold, so XLA keeps the sequential order (it does not reassociate float adds).
    return functools.reduce(operator.add, values)


_sequential_sum = jax.jit(_chain_sum)


@functools.partial(jax.jit, static_argnums=1)
def _concatenate(values: tuple[Any, ...], axis: int) -> Any:
    return jnp.concatenate(values, axis=axis)


def on_device(value: Any, device: jax.Device) -> Any:
    """``value`` as a jax.Array committed to ``device``; no copy if it is already there
    (an uncommitted array, e.g. made under ``jax.default_device``, would follow the
    computations that use it to other devices)."""
    if (
        isinstance(value, jax.Array)
        and not is_tracer(value)
        and value.committed
        and value.sharding.device_set == {device}
    ):
        return value
    return jax.device_put(value, device)


def on_device_all(values: Sequence[Any], device: jax.Device) -> list[Any]:
    """`on_device` of each of ``values``, those not there already moved by one
    ``jax.device_put`` (JAX batches the transfers: about a third less host work than
    one call each, which ``strategy.reduce`` of a per-replica value pays per replica)."""
    placed = list(values)
    moving = [
        i
        for i, v in enumerate(values)
        if not (
            isinstance(v, jax.Array)
            and not is_tracer(v)
            and v.committed
            and v.sharding.device_set == {device}
        )
    ]
    if moving:
        moved = jax.device_put([values[i] for i in moving], device)
        for i, m in zip(moving, moved, strict=True):
            placed[i] = m
    return placed


def host_copy(value: np.ndarray, device: jax.Device) -> Any:
    """A NumPy array as a new jax.Array on ``device`` that never shares its memory.

    XLA:CPU takes a suitably aligned host buffer as it is (zero-copy), and jax 0.10's
    ``device_put(..., may_alias=False)`` still does: the array would change when the
    caller writes into theirs. Such a buffer is copied once more, on the device. A
    device_put that copies (any other buffer, any accelerator) is the one copy.
    """
    placed = jax.device_put(value, device)
    if (
        device.platform == "cpu"
        and value.size
        and not is_tracer(placed)  # placed while a program is traced: no buffer
        and placed.unsafe_buffer_pointer() == value.__array_interface__["data"][0]
    ):
        placed = placed.copy()
    return placed


def reduce_to(values: Sequence[Any], destination: str) -> Any:
    lazy = find_lazy(values)
    if lazy is not None:
        return psum(lazy.local, AXIS)
    if any(is_tracer(v) for v in values):
        return _chain_sum(*(jnp.asarray(v) for v in values))
    device = jax_device(destination)
    return _sequential_sum(*on_device_all(values, device))


def all_reduce(values: Sequence[Any], destinations: Sequence[str]) -> list[Any]:
    total = reduce_to(values, destinations[0])
    return broadcast(total, destinations)


def all_gather(values: Sequence[Any], axis: int, destinations: Sequence[str]) -> list[Any]:
    lazy = find_lazy(values)
    if lazy is not None:
        rank = len(lazy.local.shape)
        gathered = lax.all_gather(lazy.local, AXIS, axis=axis % rank, tiled=True)
        return [gathered] * len(destinations)
    if any(is_tracer(v) for v in values):
        return [jnp.concatenate([jnp.asarray(v) for v in values], axis=axis)] * len(destinations)
    device = jax_device(destinations[0])
    gathered = _concatenate(tuple(on_device_all(values, device)), axis)
    return broadcast(gathered, destinations)


def broadcast(value: Any, destinations: Sequence[str]) -> list[Any]:
    if is_tracer(value):
        return [value] * len(destinations)
    copies: list[Any] = []
    for d in destinations:
        copy = on_device(value, jax_device(d))
        if any(copy is c for c in copies):
            # Each destination owns its result: regroup must not see one object twice.
            copy = jax.device_put(value, jax_device(d), may_alias=False)
        copies.append(copy)
    return copies
