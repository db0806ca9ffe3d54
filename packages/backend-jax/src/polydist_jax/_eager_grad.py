"""Collectives that ``jax.grad`` can differentiate when replicas run eagerly.

An eager run (``JaxBackend(jit=False)``, or the fallback for uneven inputs)
calls the replica function once per replica, each on its own thread, so each
``jax.grad`` is its own trace and a collective cannot mix their tracers. Here
the collective becomes a ``jax.custom_vjp`` whose forward and backward each
rendezvous with the other replicas on concrete values, with TF's rules:

* the gradient of ``all_reduce`` is the all-reduce (SUM) of the upstream gradients;
* the gradient of ``all_gather`` is the all-reduce of the upstream gradients,
  sliced to this replica's own segment.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from polydist import ReduceOp, get_replica_context
from polydist.backend import ReplicaChannel
from polydist.backend import nest as _nest
from polydist_jax._lazy import is_tracer

__all__ = ["DifferentiableChannel", "MovedArrays"]


def _zero_cotangent(x: Any) -> Any:
    # Integer and bool inputs have no gradient: JAX wants float0 zeros for them.
    return np.zeros(np.shape(x), dtype=jax.dtypes.float0)


def _differentiable(x: Any) -> bool:
    return bool(jnp.issubdtype(jnp.result_type(x), jnp.inexact))


class MovedArrays:
    """The copies `DifferentiableChannel.merge_call` made of merge_fn's arrays for the
    replicas of one backend's eager runs, so that a run whose replicas all return
    copies of one array returns that array, as the sim does (`restore`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._originals: dict[int, tuple[Any, Any]] = {}  # id(copy) -> (copy, original)

    def note(self, copy: Any, original: Any) -> None:
        with self._lock:
            self._originals[id(copy)] = (copy, original)

    def forget(self) -> None:
        with self._lock:
            self._originals = {}

    def restore(self, results: list[Any]) -> list[Any]:
        """``results`` (one per replica) where each replica returned a copy of the same
        array at the same place: that array itself (core's regroup then unwraps it).
        Forgets every copy noted so far."""
        with self._lock:
            originals, self._originals = self._originals, {}
        if not originals or len(results) < 2:
            return results

        def original(x: Any) -> Any:
            entry = originals.get(id(x))
            return entry[1] if entry is not None and entry[0] is x else x

        flats = [_nest.flatten(r) for r in results]
        spec = flats[0][1]
        if any(f[1] != spec for f in flats[1:]):  # each replica's own structure
            return results
        rows = [list(f[0]) for f in flats]
        for i in range(len(rows[0])):
            first = original(rows[0][i])
            if all(original(row[i]) is first for row in rows[1:]):
                for row in rows:
                    row[i] = first
        return [_nest.unflatten(spec, row) for row in rows]


class DifferentiableChannel:
    """Wraps one eager replica's channel (``EagerReplicaRunner(wrap_channel=...)``)."""

    def __init__(
        self, inner: ReplicaChannel, replica_index: int, moved: MovedArrays | None = None
    ) -> None:
        self._inner = inner
        self._index = replica_index
        self._moved = moved

    def all_reduce(self, reduce_op: ReduceOp, values: Sequence[Any]) -> list[Any]:
        if not any(is_tracer(v) for v in values):
            return self._inner.all_reduce(reduce_op, values)
        inner = self._inner

        def forward(*xs: Any) -> tuple[Any, ...]:
            return tuple(inner.all_reduce(reduce_op, list(xs)))

        def backward(primals: tuple[Any, ...], cts: tuple[Any, ...]) -> tuple[Any, ...]:
            summed = iter(inner.all_reduce(ReduceOp.SUM, _float_cotangents(primals, cts)))
            return tuple(
                next(summed) if _differentiable(x) else _zero_cotangent(x) for x in primals
            )

        return list(_call_with_vjp(forward, backward, values))

    def all_gather(self, values: Sequence[Any], axis: int) -> list[Any]:
        if not any(is_tracer(v) for v in values):
            return self._inner.all_gather(values, axis)
        inner, index = self._inner, self._index

        def forward(*xs: Any) -> tuple[Any, ...]:
            return tuple(inner.all_gather(list(xs), axis))

        def backward(primals: tuple[Any, ...], cts: tuple[Any, ...]) -> tuple[Any, ...]:
            # Sizes may differ between replicas: gather them to find this replica's segment.
            sizes = [np.asarray([np.shape(x)[axis]], dtype=np.int32) for x in primals]
            all_sizes = inner.all_gather(sizes, 0)
            summed = iter(inner.all_reduce(ReduceOp.SUM, _float_cotangents(primals, cts)))
            out = []
            for x, counts in zip(primals, all_sizes, strict=True):
                if not _differentiable(x):
                    out.append(_zero_cotangent(x))
                    continue
                start = int(np.sum(np.asarray(counts)[:index]))
                total = next(summed)
                out.append(jax.lax.slice_in_dim(total, start, start + np.shape(x)[axis], axis=axis))
            return tuple(out)

        return list(_call_with_vjp(forward, backward, values))

    def merge_call(
        self, merge_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        result = self._inner.merge_call(merge_fn, args, kwargs)
        ctx = get_replica_context()
        if ctx is None or ctx._replica_index is None:
            return result
        # merge_fn's arrays may live on another device (strategy.reduce's result is on
        # the host): as TF copies across devices, this replica gets them on its own.
        extended = ctx._strategy.extended
        device = extended.worker_devices[ctx._replica_index]
        backend = extended._backend
        moved = self._moved

        def place(x: Any) -> Any:
            if not isinstance(x, jax.Array) or is_tracer(x) or not x.committed:
                return x
            copy = backend.place(x, device)
            if copy is not x and moved is not None:
                moved.note(copy, x)
            return copy

        return _nest.map_structure(place, result)


def _float_cotangents(primals: tuple[Any, ...], cts: tuple[Any, ...]) -> list[Any]:
    return [jnp.asarray(ct) for x, ct in zip(primals, cts, strict=True) if _differentiable(x)]


def _call_with_vjp(
    forward: Callable[..., tuple[Any, ...]],
    backward: Callable[[tuple[Any, ...], tuple[Any, ...]], tuple[Any, ...]],
    values: Sequence[Any],
) -> tuple[Any, ...]:
    fn = jax.custom_vjp(forward)
    fn.defvjp(lambda *xs: (forward(*xs), xs), backward)
    result: tuple[Any, ...] = fn(*(jnp.asarray(v) for v in values))
    return result
