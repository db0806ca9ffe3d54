"""Traced per-replica values inside a compiled ``merge_call``, and their detection.

Inside the SPMD trace there is one traced value per argument, not one per
replica. ``merge_fn`` still expects a ``PerReplica`` for a value that differs
between replicas, so it gets a :class:`LazyPerReplica`: its components are
only materialized (one ``lax.all_gather``) when someone reads ``.values``.

Core's cross-replica reductions do read ``.values``, then hand the components
to the backend's ``reduce_to``/``all_reduce``/``all_gather``. Those look the
components up here (by identity) and emit one ``lax.psum`` (or a tiled
``lax.all_gather``) of the local value instead. The all-gather that was
materialized is then unused, and jit's lowering drops it: the compiled
program has the single collective.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import jax
from jax import lax

from polydist import PerReplica
from polydist.backend.arrays import describe

__all__ = [
    "AXIS",
    "WORKERS",
    "LazyPerReplica",
    "axes_scope",
    "find_lazy",
    "is_tracer",
    "is_varying",
    "lazy_scope",
    "replica_axes",
    "replica_axis",
    "varies_locally",
    "vary",
]

#: The mesh axis of one process's replicas (the only axis in a single process).
AXIS = "replica"
#: The mesh axis of the workers, in a compiled run across processes: the mesh is
#: ``(WORKERS, AXIS)``, worker-major, so a replica's linear index is its global id.
WORKERS = "workers"


def is_tracer(x: object) -> bool:
    return isinstance(x, jax.core.Tracer)


class _Axes(threading.local):
    def __init__(self) -> None:
        self.axes: tuple[str, ...] = (AXIS,)


_axes = _Axes()


@contextmanager
def axes_scope(axes: tuple[str, ...]) -> Iterator[None]:
    """The mesh axes that together index every replica, while a run is traced."""
    saved = _axes.axes
    _axes.axes = axes
    try:
        yield
    finally:
        _axes.axes = saved


def replica_axes() -> tuple[str, ...]:
    """The mesh axes of the run being traced on this thread: ``(AXIS,)``, or
    ``(WORKERS, AXIS)`` across processes."""
    return _axes.axes


def replica_axis() -> str | tuple[str, ...]:
    """The axis name that collectives over every replica take (``AXIS`` in one process)."""
    axes = _axes.axes
    return axes[0] if len(axes) == 1 else axes


def is_varying(x: Any) -> bool:
    """Whether a traced value may differ between replicas (JAX's "varying manual axes")."""
    return not jax.typeof(x).manual_axis_type.varying.isdisjoint(_axes.axes)


def varies_locally(x: Any) -> bool:
    """Whether a traced value may differ between this process's replicas."""
    return AXIS in jax.typeof(x).manual_axis_type.varying


def vary(x: Any) -> Any:
    """``x`` marked as possibly different on every replica (``lax.pcast`` to varying)."""
    varying = jax.typeof(x).manual_axis_type.varying
    missing = tuple(a for a in _axes.axes if a not in varying)
    return lax.pcast(x, missing, to="varying") if missing else x


class _Registry(threading.local):
    def __init__(self) -> None:
        # id(first materialized component) -> the LazyPerReplica; None outside a trace.
        self.lazy: dict[int, LazyPerReplica] | None = None


_registry = _Registry()


@contextmanager
def lazy_scope() -> Iterator[None]:
    """Where LazyPerReplica values may be created: one compiled replica function's trace."""
    saved = _registry.lazy
    _registry.lazy = {}
    try:
        yield
    finally:
        _registry.lazy = saved


class LazyPerReplica(PerReplica):
    """A ``PerReplica`` over the replicas of a compiled run, seen from inside the trace.

    ``local`` is this replica's traced value. Reading ``values`` gathers every
    replica's value (one ``lax.all_gather``), unless JAX knows the value is the
    same on every replica (not "varying"); reductions through the strategy
    never need to (they become one ``lax.psum``).
    """

    __slots__ = ("_local", "_num_replicas")

    def __init__(self, local: Any, num_replicas: int) -> None:
        # No super().__init__: that would materialize the components.
        self._local = local
        self._num_replicas = num_replicas

    @property
    def local(self) -> Any:
        """This replica's value (a tracer)."""
        return self._local

    @property
    def values(self) -> tuple[Any, ...]:
        try:
            return self._values
        except AttributeError:
            pass
        if varies_locally(self._local):
            # This process's replicas: across processes, merge_fn sees this worker's.
            gathered = lax.all_gather(self._local, AXIS, tiled=False)
            components = tuple(gathered[k] for k in range(self._num_replicas))
        else:
            # JAX knows the value is the same on every replica (e.g. an all-reduce
            # result): each component is the value itself, and no gather is needed.
            components = (self._local,) * self._num_replicas
        self._values = components
        if _registry.lazy is not None:
            _registry.lazy[id(components[0])] = self
        return components

    @property
    def _devices(self) -> tuple[str, ...]:
        return ()

    def __repr__(self) -> str:
        return (
            f"LazyPerReplica(traced {describe(self._local)} on each of "
            f"{self._num_replicas} replicas)"
        )


def find_lazy(values: Sequence[Any]) -> LazyPerReplica | None:
    """The LazyPerReplica whose materialized components are exactly ``values``, if any."""
    lazy = _registry.lazy
    if not lazy or not values:
        return None
    candidate = lazy.get(id(values[0]))
    if candidate is None:
        return None
    components = candidate._values
    if len(components) != len(values) or any(
        v is not c for v, c in zip(values, components, strict=True)
    ):
        return None
    return candidate
