"""The strategies of one process: ``MirroredStrategy``, ``OneDeviceStrategy`` and the
default strategy (no scope entered), which this module registers with the context
stack (:mod:`polydist._base.context`).

Their base classes, ``Strategy`` and ``StrategyExtended``, are in
:mod:`polydist._strategies.strategy`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from polydist._base import context as _base_context
from polydist._base.devices import HOST_DEVICE, canonicalize
from polydist._base.reduce_op import ReduceOp
from polydist._collectives import cross_device_ops as _cross_device_ops
from polydist._strategies import context as _context
from polydist._strategies.eager import EagerReplicaRunner
from polydist._strategies.replica_context import (
    LazyReplicaId,
    ReplicaContext,
    _DefaultReplicaContext,
)
from polydist._valuetypes import variables as _variables
from polydist._valuetypes.values import (
    DistributedValues,
    ValueContext,
)
from polydist.backend._contract import Backend, get_backend

if TYPE_CHECKING:
    pass
from polydist._strategies.strategy import (
    Strategy,
    StrategyExtended,
    _resolve_devices,
)

__all__ = ["MirroredStrategy", "OneDeviceStrategy"]


class MirroredExtended(StrategyExtended):
    """``StrategyExtended`` of ``MirroredStrategy``."""

    # distribute_datasets_from_function takes InputReplicationMode.PER_REPLICA
    # (TF: only MirroredStrategy's; the others raise NotImplementedError).
    _per_replica_input: ClassVar[bool] = True


class MirroredStrategy(Strategy):
    """Synchronous training on several devices of one machine.

    One replica per device; variables are mirrored and gradients all-reduced.

    Args:
        devices: device strings (``["/gpu:0", "/gpu:1"]``). ``None`` uses all
            the backend's accelerators, or the CPU if it has none. An ``int``
            N (a polydist extension) takes the backend's first N accelerators:
            on the simulator ``MirroredStrategy(8)`` gives 8 virtual GPUs.
        cross_device_ops: a ``CrossDeviceOps`` choosing the all-reduce algorithm
            (on the simulator, the summation order: see ``polydist._collectives.cross_device_ops``;
            a backend object passed explicitly keeps its own order).
        backend: a backend name or object; else ``$POLYDIST_BACKEND``, else ``sim``.
    """

    # The compat.v1 strategy subclasses build their StrategyExtended subclass here.
    _extended_class: ClassVar[type[MirroredExtended]] = MirroredExtended

    def __init__(
        self,
        devices: Sequence[str] | int | None = None,
        cross_device_ops: Any = None,
        *,
        backend: str | Backend | None = None,
    ) -> None:
        ops = _cross_device_ops.check_cross_device_ops(cross_device_ops)
        resolved = _cross_device_ops.backend_for(get_backend(backend), ops)
        canonical = _resolve_devices(resolved, devices)
        super().__init__(self._extended_class(self, resolved, canonical, cross_device_ops=ops))


class OneDeviceExtended(StrategyExtended):
    """``StrategyExtended`` of ``OneDeviceStrategy``: one replica, no communication."""

    _distributed_variables = False  # TF: plain variables on the device

    def _call_for_each_replica(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        strategy = self._container_strategy()
        device = self._devices[0]
        runner = getattr(self._backend, "replica_runner", None)
        replica_id: Any
        if isinstance(runner, EagerReplicaRunner) and runner.lazy_replica_id:
            replica_id = LazyReplicaId(self._backend, 0, device)  # placed if asked for
        else:
            replica_id = self._backend.place(np.asarray(0, dtype=np.int32), device)
        with (
            ReplicaContext(strategy, replica_id, replica_index=0),
            self._backend.device_scope(device),
        ):
            return fn(*args, **kwargs)

    def _distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        # TF returns the value itself (no PerReplica): `run` hands its args on as they are.
        with self._backend.device_scope(self._devices[0]):
            return value_fn(ValueContext())


class OneDeviceStrategy(Strategy):
    """Runs everything on one device: a single replica, placed on ``device``."""

    _extended_class: ClassVar[type[OneDeviceExtended]] = OneDeviceExtended  # see MirroredStrategy

    def __init__(self, device: str, *, backend: str | Backend | None = None) -> None:
        resolved = get_backend(backend)
        canonical = canonicalize(device)
        resolved.validate_devices((canonical,))
        super().__init__(self._extended_class(self, resolved, (canonical,)))


class _DefaultExtended(StrategyExtended):
    """The default strategy: no distribution, everything happens in place."""

    def _call_for_each_replica(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        strategy = self._container_strategy()
        with ReplicaContext(strategy, np.asarray(0, dtype=np.int32), replica_index=0):
            return fn(*args, **kwargs)

    def _reduce_to(self, reduce_op: ReduceOp, value: Any, destinations: Any) -> Any:
        value = _variables.read_for_reduce(value)
        if isinstance(value, DistributedValues):
            return value.values[0]
        return value

    def _gather_to(self, value: Any, destination: str, axis: int) -> Any:
        return value

    def _distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        with self._backend.device_scope(self._devices[0]):  # TF: as OneDeviceStrategy
            return value_fn(ValueContext())

    @property
    def worker_devices(self) -> tuple[str, ...]:
        raise RuntimeError("worker_devices() method unsupported by default tf.distribute.Strategy.")

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        raise RuntimeError(
            "parameter_devices() method unsupported by default tf.distribute.Strategy."
        )


class _DefaultDistributionStrategy(Strategy):
    @contextmanager
    def _scope_impl(self) -> Iterator[Strategy]:
        if _context.has_strategy():
            raise RuntimeError("Must not nest tf.distribute.Strategy scopes.")
        yield self

    def __repr__(self) -> str:
        return "<default polydist strategy>"


def _make_default_strategy() -> Strategy:
    strategy = _DefaultDistributionStrategy.__new__(_DefaultDistributionStrategy)
    Strategy.__init__(strategy, _DefaultExtended(strategy, None, (HOST_DEVICE,)))
    return strategy


def _make_default_mode() -> tuple[Strategy, ReplicaContext]:
    strategy = _make_default_strategy()
    return strategy, _DefaultReplicaContext(strategy)


# The context stack sits below the strategies: it asks here for the default strategy.
_base_context.set_default_factory(_make_default_mode)
