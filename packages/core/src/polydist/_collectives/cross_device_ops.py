"""``CrossDeviceOps``: the algorithms that combine values across devices (TF's classes).

``MirroredStrategy(cross_device_ops=...)`` takes one of them. polydist maps
the choice onto the backend's collectives:

* On the simulator each algorithm is a summation order (see
  ``polydist._sim._reduction``), so the bits of a float sum show which one ran:

  =============================  ====================  ===========================
  class                          all-reduce (result    reduce to one device
                                 on every replica)     (e.g. ``strategy.reduce``)
  =============================  ====================  ===========================
  ``NcclAllReduce``              ``"ring"``            ``"sequential"`` (TF falls
                                                       back to ReductionToOneDevice)
  ``HierarchicalCopyAllReduce``  ``"tree"``            ``"sequential"`` (same)
  ``ReductionToOneDevice``       ``"sequential"``      ``"sequential"`` (add_n)
  no ``cross_device_ops``        the backend's order   the backend's order
                                 (``"exact"``)         (``"exact"``)
  =============================  ====================  ===========================

  Replica-context ``all_reduce`` uses the all-reduce column. A backend object
  the user configured explicitly (``backend=SimBackend("tree")``) wins: its
  order is used everywhere and ``cross_device_ops`` does not change it. Only
  backends from the registry (``backend=None`` or a name) are reconfigured.
* Any other backend that defines ``with_cross_device_ops(ops)`` gets that
  call (it returns the backend to use); else the backend's own collectives run.

Every cross-replica reduction of a strategy goes through the strategy's
``CrossDeviceOps`` (TF's model): the one passed as ``cross_device_ops`` (through
its ``reduce``/``batch_reduce``/``broadcast``, and so through the
``*_implementation`` hooks of a user subclass), else `CollectiveAllReduce`, the
backend's own collectives. What differs between one process, a simulated
cluster and one process per worker is the `ReplicaGroup` the strategy supplies
(``StrategyExtended._replica_group``): its devices, MEAN's divisor, and whether
the sum crosses processes. The reduce tail (place, the engine's SUM, MEAN,
``Mirrored``, the trace) is `reduce_over_group`, and MEAN's rule is applied in
`apply_mean` only.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, cast

import numpy as np

from polydist._base import context as _context
from polydist._base.arrays import (
    check_same_shape,
    check_summable,
    convert_to_array,
    describe,
    is_array,
    mean_from_sum,
)
from polydist._base.communication import bytes_per_pack, current_call_options
from polydist._base.devices import HOST_DEVICE, canonicalize
from polydist._base.reduce_op import ReduceOp, as_reduce_op
from polydist._collectives import trace as _trace
from polydist._collectives.check import collective_intent
from polydist._valuetypes import indexed_slices as _indexed_slices
from polydist._valuetypes.values import DistributedValues, Mirrored, PerReplica, regroup
from polydist._valuetypes.variables import Variable, _read_operand, read_for_reduce
from polydist.backend._contract import (
    Backend,
    ReplicaGroup,
    SupportsCrossDeviceOps,
    SupportsReductionOrder,
    batch_all_reduce,
    features,
)
from polydist.errors import InvalidArgumentError

__all__ = [
    "AllReduceCrossDeviceOps",
    "CollectiveAllReduce",
    "CrossDeviceOps",
    "HierarchicalCopyAllReduce",
    "NcclAllReduce",
    "ReductionToOneDevice",
    "ReplicaGroup",
]


class StrategyExtended(_context.StrategyExtended, Protocol):
    """What the reduce path needs of a ``polydist.StrategyExtended`` (which sits above)."""

    _cross_device_ops: Any

    @property
    def _collective_ops(self) -> CrossDeviceOps: ...

    def _replica_group(self, count: int) -> ReplicaGroup: ...


# -- which backend computes ---------------------------------------------------------------

# The StrategyExtended whose reduction is running (set by the strategy glue below);
# without one, the current strategy's backend is used.
_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "polydist_cross_device_ops_extended", default=None
)

# Backends derived here (derived -> the registry backend they came from), and a
# cache so that every strategy with the same algorithm shares one derived backend.
_BASE_OF: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_DERIVED: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


@contextmanager
def active(extended: StrategyExtended) -> Iterator[None]:
    token = _ACTIVE.set(extended)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _current_backend() -> Backend:
    extended = _ACTIVE.get()
    if extended is None:
        extended = _context.get_strategy().extended
    return extended._backend  # type: ignore[no-any-return]


def _configurable_base(backend: Any) -> Any:
    """The registry backend ``backend`` is (or was derived from); ``None`` if the user
    built and passed it explicitly (then it is used as it is)."""
    base = _BASE_OF.get(backend)
    if base is not None:
        return base
    from polydist.backend import _contract as registry

    if any(b is backend for b in registry._instances.values()):
        return backend
    return None


def _derive(backend: Any, key: str, make: Callable[[Any], Any]) -> Any:
    base = _configurable_base(backend)
    if base is None:
        return backend
    cache = _DERIVED.setdefault(base, {})
    derived = cache.get(key)
    if derived is None:
        derived = make(base)
        if derived is not base:
            _BASE_OF[derived] = base
        cache[key] = derived
    return derived


def backend_with_order(backend: Backend, order: str | None) -> Backend:
    """``backend`` reconfigured to sum in ``order`` (sim), unless the user configured it."""
    if order is None or not features(backend).reduction_order:
        return backend
    return _derive(  # type: ignore[no-any-return]
        backend,
        f"order:{order}",
        lambda b: cast(SupportsReductionOrder, b).with_reduction_order(order),
    )


def backend_for(backend: Backend, ops: CrossDeviceOps | None) -> Backend:
    """The backend a ``MirroredStrategy`` with ``cross_device_ops=ops`` runs on."""
    if ops is None:
        return backend
    if features(backend).cross_device_ops:
        base = _configurable_base(backend)
        if base is None:
            return backend
        derived = cast(SupportsCrossDeviceOps, base).with_cross_device_ops(ops)
        if derived is not base:
            _BASE_OF[derived] = base
        return derived
    return backend_with_order(backend, ops._all_reduce_order)


def check_cross_device_ops(ops: Any) -> CrossDeviceOps | None:
    if ops is None or isinstance(ops, CrossDeviceOps):
        return ops
    raise TypeError(
        f"cross_device_ops must be a polydist.CrossDeviceOps such as NcclAllReduce(), "
        f"HierarchicalCopyAllReduce() or ReductionToOneDevice(), got {type(ops).__name__} "
        f"{ops!r}."
    )


# -- the group and the reduce tail ------------------------------------------------------------


def apply_mean(xp: Any, reduce_op: ReduceOp, values: list[Any], size: int) -> list[Any]:
    """MEAN's rule, applied to the SUMs of a group of ``size`` values (the one place)."""
    if reduce_op is not ReduceOp.MEAN:
        return values
    return [mean_from_sum(xp, v, size) for v in values]


def record(
    op: str,
    reduce_op: ReduceOp | None,
    example: Any,
    participants: Sequence[str],
    backend: Backend,
) -> None:
    """Records a cross-replica collective in the active trace (if any)."""
    if _trace.is_tracing():
        dtype = describe(example).split("[")[0]
        shape = tuple(int(d) for d in example.shape)
        _trace.record_collective(
            op,
            reduce_op=reduce_op.value if reduce_op else None,
            dtype=dtype,
            nbytes=int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize,
            shape=shape,
            participants=tuple(participants),
            backend=backend.name,
        )


def intent(group: ReplicaGroup, reduce_op: ReduceOp) -> contextlib.AbstractContextManager[Any]:
    return (
        collective_intent(reduce_op.value) if group.across_processes else contextlib.nullcontext()
    )


def reduce_over_group(
    group: ReplicaGroup,
    reduce_op: ReduceOp,
    arrays: Sequence[Any],
    destinations: tuple[str, ...] | str,
    *,
    op: str | None = None,
) -> Any:
    """The reduce tail: places this process's ``arrays`` on the group's devices, SUMs them
    with the engine (``all_reduce`` onto a tuple of devices: a ``Mirrored``;
    ``reduce_to`` onto one device: an array), applies MEAN and records the collective
    (as ``op``, default ``"all_reduce"``/``"reduce_to"``)."""
    check_summable(reduce_op, arrays)
    backend = group.backend
    placed = [backend.place(a, d) for a, d in zip(arrays, group.devices)]
    with intent(group, reduce_op):
        if isinstance(destinations, tuple):
            sums = backend.all_reduce(placed, destinations)
        else:
            sums = [backend.reduce_to(placed, destinations)]
    if group.participants is not None:
        kind = op or ("all_reduce" if isinstance(destinations, tuple) else "reduce_to")
        record(kind, reduce_op, arrays[0], group.participants, backend)
    sums = apply_mean(backend.array_namespace(), reduce_op, sums, group.size)
    return Mirrored(sums) if isinstance(destinations, tuple) else sums[0]


def batch_reduce_over_group(
    group: ReplicaGroup,
    reduce_op: ReduceOp,
    columns: Sequence[Sequence[Any]],
    destinations: tuple[str, ...],
    bytes_per_pack: int,
) -> list[Any]:
    """`reduce_over_group` of several columns onto the same devices, given to the engine
    together (`polydist.backend.batch_all_reduce`: one collective per pack)."""
    for column in columns:
        check_summable(reduce_op, column)
    backend = group.backend
    placed = [[backend.place(a, d) for a, d in zip(c, group.devices)] for c in columns]
    with intent(group, reduce_op):
        sums = batch_all_reduce(backend, placed, destinations, bytes_per_pack)
    xp = backend.array_namespace()
    results: list[Any] = []
    for column, reduced in zip(placed, sums, strict=True):
        if group.participants is not None:
            record("all_reduce", reduce_op, column[0], group.participants, backend)
        results.append(Mirrored(apply_mean(xp, reduce_op, reduced, group.size)))
    return results


# -- the strategy's glue ---------------------------------------------------------------------


def strategy_reduce(
    extended: StrategyExtended, reduce_op: ReduceOp, value: Any, destinations: Any
) -> Any:
    """``StrategyExtended._reduce_to`` of a per-replica value, via the strategy's
    ``CrossDeviceOps`` (its ``cross_device_ops``, else `CollectiveAllReduce`)."""
    ops = extended._collective_ops
    with active(extended):
        return ops.reduce(reduce_op, value, destinations)


def strategy_batch_reduce(
    extended: StrategyExtended, reduce_op: ReduceOp, pairs: Sequence[tuple[Any, Any]]
) -> list[Any] | None:
    """``batch_reduce_to`` via ``cross_device_ops.batch_reduce`` when every value is
    per-replica (TF's batch path); ``None`` tells the caller to reduce pair by pair."""
    if not pairs:
        return []
    values = [read_for_reduce(v) for v, _ in pairs]
    n = len(extended._devices)
    if n < 2 or not all(isinstance(v, PerReplica) and len(v.values) == n for v in values):
        return None
    ops = extended._cross_device_ops
    with active(extended):
        return ops.batch_reduce(reduce_op, [(v, d) for v, (_, d) in zip(values, pairs)])  # type: ignore[no-any-return]


# -- destinations ------------------------------------------------------------------------------


def _device_of(x: Any) -> str:
    device = getattr(x, "device", None)
    if device is None:
        return HOST_DEVICE
    try:
        return canonicalize(str(device))
    except ValueError:
        return HOST_DEVICE


def _devices_of(destinations: Any) -> tuple[str, ...]:
    if isinstance(destinations, DistributedValues):
        return tuple(_device_of(c) for c in destinations.values)
    if isinstance(destinations, str):
        return (canonicalize(destinations),)
    return (_device_of(destinations),)


def destination(destinations: Any) -> str:
    """The one device a reduction onto ``destinations`` (not a distributed value) lands on."""
    if isinstance(destinations, str):
        return canonicalize(destinations)
    device = getattr(destinations, "device", None)
    if isinstance(device, str):
        return canonicalize(device)
    raise ValueError(
        f"destinations must be a device string, a distributed value or a variable, got "
        f"{type(destinations).__name__} {destinations!r}."
    )


def destination_devices(destinations: Any) -> tuple[str, ...]:
    """Where a strategy's reduction onto a distributed value (or variable) puts its
    result: the device of each of its components."""
    return tuple(str(getattr(c, "device", HOST_DEVICE)) for c in destinations.values)


def _devices_match(left: Any, right: Any) -> bool:
    return left is right or set(_devices_of(left)) == set(_devices_of(right))


def _check_destinations(destinations: Any) -> bool:
    if isinstance(destinations, str):
        return bool(destinations)
    return destinations is not None


def validate_destinations(destinations: Any) -> None:
    """TF's ``validate_destinations``."""
    if not (isinstance(destinations, DistributedValues | Variable | str) or is_array(destinations)):
        raise ValueError(
            "destinations must be one of a `DistributedValues` object, a tf.Variable object, "
            f"or a device string; got {type(destinations).__name__} {destinations!r}."
        )
    if not _check_destinations(destinations):
        raise ValueError("destinations can not be empty")


def _as_distributed(value: Any) -> DistributedValues:
    """TF's ``_make_tensor_into_per_replica`` (variables read as their copies)."""
    value = read_for_reduce(value)
    if isinstance(value, DistributedValues):
        return value
    if isinstance(value, list | tuple):
        raise ValueError(
            "Cannot convert `input_tensor` to a `PerReplica` object, got "
            f"{value!r} but expected a object that is not a tuple or list."
        )
    if is_array(value) or isinstance(value, _indexed_slices.IndexedSlices):
        return PerReplica((value,))
    raise ValueError(
        "Cannot convert `input_tensor` to a `PerReplica` object because it doesn't have "
        f"device set (got {type(value).__name__} {value!r}); pass an array or a PerReplica."
    )


def _sparse_components(value: DistributedValues) -> list[Any] | None:
    """The components of ``value`` when they are ``IndexedSlices`` (TF splits a batch by
    sparsity and gathers the sparse ones); ``None`` when they are dense."""
    components = [_read_operand(v) for v in value.values]
    sparse = [isinstance(c, _indexed_slices.IndexedSlices) for c in components]
    if not any(sparse):
        return None
    if not all(sparse):
        kinds = ", ".join(type(c).__name__ for c in components)
        raise TypeError(
            f"Cannot reduce a mix of IndexedSlices and other values across replicas (the "
            f"replicas gave {kinds}). Every replica must pass an IndexedSlices."
        )
    return components


def _reduce_sparse(
    backend: Backend, reduce_op: ReduceOp, components: Sequence[Any], device: str
) -> Any:
    """TF's ``aggregate_tensors_or_indexed_slices`` of one ``IndexedSlices`` per replica,
    onto ``device``: every replica's rows, concatenated (MEAN divides the values)."""
    placed_on = tuple(_device_of(c.values) for c in components)
    return _indexed_slices.reduce(backend, reduce_op, components, placed_on, (device,))[0]


def _arrays(value: DistributedValues) -> list[Any]:
    arrays = [convert_to_array(_read_operand(v)) for v in value.values]
    first = arrays[0]
    for r, a in enumerate(arrays[1:], start=1):
        if tuple(a.shape) != tuple(first.shape) or str(a.dtype) != str(first.dtype):
            raise InvalidArgumentError(
                f"Cannot reduce across replicas: replica 0 has {describe(first)} but replica "
                f"{r} has {describe(a)}; every replica's value must have the same shape and "
                "dtype (AddN: inputs must have the same size)."
            )
    return arrays


def simple_broadcast(backend: Backend, value: Any, destinations: Any) -> Any:
    """Copies ``value`` to the devices of ``destinations``: one array for one device,
    else a ``Mirrored`` (TF's ``simple_broadcast``)."""
    devices = _devices_of(destinations)
    if isinstance(value, _indexed_slices.IndexedSlices):
        return regroup(_indexed_slices.broadcast(backend, value, devices), Mirrored)
    array = convert_to_array(_read_operand(value))
    copies = backend.broadcast(array, devices)
    return regroup(copies, Mirrored)


# -- the classes -------------------------------------------------------------------------------


class CrossDeviceOps:
    """Base class for cross-device reduction and broadcasting algorithms.

    Pass one to ``MirroredStrategy(cross_device_ops=...)``. Subclasses
    implement ``reduce_implementation``, ``batch_reduce_implementation`` and
    optionally ``broadcast_implementation``; ``reduce``, ``batch_reduce``
    and ``broadcast`` validate their arguments and call them.
    """

    #: The simulator's summation order that models this algorithm's all-reduce
    #: (``None``: the backend's own order).
    _all_reduce_order: str | None = None

    def __init__(self) -> None:
        self._canonicalize_devices = True

    def reduce(
        self,
        reduce_op: ReduceOp | str,
        per_replica_value: Any,
        destinations: Any,
        options: Any = None,
    ) -> Any:
        """Reduces ``per_replica_value`` onto ``destinations`` (a device string: one array;
        a distributed value or variable: a ``Mirrored`` on its devices)."""
        reduce_op = as_reduce_op(reduce_op)
        value = _as_distributed(per_replica_value)
        validate_destinations(destinations)
        if len(value.values) == 1 and _devices_match(value, destinations):
            only = _read_operand(value.values[0])
            if not isinstance(only, _indexed_slices.IndexedSlices):
                only = convert_to_array(only)
            return regroup((only,), Mirrored)
        return self.reduce_implementation(reduce_op, value, destinations, options)

    def batch_reduce(
        self,
        reduce_op: ReduceOp | str,
        value_destination_pairs: Sequence[tuple[Any, Any]],
        options: Any = None,
    ) -> list[Any]:
        """``reduce`` for a list of ``(value, destinations)`` pairs."""
        reduce_op = as_reduce_op(reduce_op)
        pairs = list(value_destination_pairs)
        normalized = []
        for pair in pairs:
            if not isinstance(pair, tuple):
                raise ValueError(
                    "Each element of `value_destination_pairs` should be a tuple, got "
                    f"{type(pair).__name__}."
                )
            if len(pair) != 2:
                raise ValueError(
                    "Each element of `value_destination_pairs` should be a tuple of size 2, "
                    f"got one of size {len(pair)}."
                )
            normalized.append((_as_distributed(pair[0]), pair[1]))
        for _, d in normalized:
            validate_destinations(d)
        if (
            normalized
            and len(normalized[0][0].values) == 1
            and all(_devices_match(v, d) for v, d in normalized)
        ):
            return [regroup(v.values, Mirrored) for v, _ in normalized]
        return self.batch_reduce_implementation(reduce_op, normalized, options)  # type: ignore[no-any-return]

    def broadcast(self, tensor: Any, destinations: Any) -> Any:
        """Copies ``tensor`` to the devices of ``destinations``."""
        validate_destinations(destinations)
        return self.broadcast_implementation(tensor, destinations)

    def reduce_implementation(
        self, reduce_op: ReduceOp, per_replica_value: Any, destinations: Any, options: Any
    ) -> Any:
        """The reduction itself (for subclass implementers)."""
        raise NotImplementedError("_reduce method must be implemented in descendants.")

    def batch_reduce_implementation(
        self, reduce_op: ReduceOp, value_destination_pairs: Sequence[tuple[Any, Any]], options: Any
    ) -> Any:
        """The batched reduction itself (for subclass implementers)."""
        raise NotImplementedError(
            "batch_reduce_implementation method must be implemented in descendants."
        )

    def broadcast_implementation(self, tensor: Any, destinations: Any) -> Any:
        """The broadcast itself (for subclass implementers): plain copies by default."""
        return simple_broadcast(_current_backend(), tensor, destinations)


class ReductionToOneDevice(CrossDeviceOps):
    """Copies the values to one device, adds them there, and broadcasts the result.

    Args:
        reduce_to_device: the device to reduce on; default the first destination.
        accumulation_fn: called with the list of per-replica arrays, returns their
            sum. Default: TF's ``add_n``, which the simulator models as
            ``"sequential"`` (left to right in replica order).
    """

    _all_reduce_order = "sequential"

    def __init__(
        self,
        reduce_to_device: str | None = None,
        accumulation_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        self.reduce_to_device = reduce_to_device
        self.accumulation_fn = accumulation_fn
        super().__init__()

    def reduce_implementation(
        self, reduce_op: ReduceOp, per_replica_value: Any, destinations: Any, options: Any
    ) -> Any:
        if _check_destinations(destinations):
            devices = _devices_of(destinations)
        else:
            devices = _devices_of(per_replica_value)
        reduce_to_device = self.reduce_to_device or devices[0]
        reduced = self._simple_reduce(per_replica_value, reduce_to_device, reduce_op)
        return self.broadcast(reduced, destinations)

    def batch_reduce_implementation(
        self, reduce_op: ReduceOp, value_destination_pairs: Sequence[tuple[Any, Any]], options: Any
    ) -> list[Any]:
        return [
            self.reduce_implementation(reduce_op, v, d, options) for v, d in value_destination_pairs
        ]

    def _simple_reduce(self, value: DistributedValues, device: str, reduce_op: ReduceOp) -> Any:
        sparse = _sparse_components(value)
        if sparse is not None:  # TF: concatenated, whatever the accumulation_fn
            return _reduce_sparse(_current_backend(), reduce_op, sparse, canonicalize(device))
        arrays = _arrays(value)
        backend = backend_with_order(_current_backend(), "sequential")
        if self.accumulation_fn is not None:  # it decides for itself what it accepts
            total = self.accumulation_fn(arrays)
            return apply_mean(backend.array_namespace(), reduce_op, [total], len(arrays))[0]
        group = ReplicaGroup(backend, tuple(_device_of(v) for v in value.values), len(arrays))
        return reduce_over_group(group, reduce_op, arrays, canonicalize(device))  # add_n

    def __repr__(self) -> str:
        return (
            f"ReductionToOneDevice(reduce_to_device={self.reduce_to_device!r}, "
            f"accumulation_fn={self.accumulation_fn!r})"
        )


class AllReduceCrossDeviceOps(CrossDeviceOps):
    """All-reduce algorithms; reductions whose result goes to one device fall back to
    ``ReductionToOneDevice`` (TF)."""

    def __init__(self, all_reduce_alg: str = "nccl", num_packs: int = 1) -> None:
        self._all_reduce_alg = all_reduce_alg
        self._num_packs = num_packs
        self._simple_cross_replica_ops = ReductionToOneDevice()
        super().__init__()

    def reduce_implementation(
        self, reduce_op: ReduceOp, per_replica_value: Any, destinations: Any, options: Any
    ) -> Any:
        # The sim's model of TF's "devices match" test: the result lands on as many
        # devices as there are replicas (the values of the sim carry no device).
        # IndexedSlices have no efficient all-reduce: TF splits a batch by sparsity and
        # reduces the sparse values with ReductionToOneDevice (a gather).
        if (
            isinstance(destinations, DistributedValues)
            and len(destinations.values) == len(per_replica_value.values) > 1
            and _sparse_components(per_replica_value) is None
        ):
            return self._all_reduce(reduce_op, per_replica_value, destinations)
        return self._simple_cross_replica_ops.reduce(
            reduce_op, per_replica_value, destinations, options
        )

    def batch_reduce_implementation(
        self, reduce_op: ReduceOp, value_destination_pairs: Sequence[tuple[Any, Any]], options: Any
    ) -> list[Any]:
        # TF packs the values into num_packs buffers first; packing does not change
        # the per-element summation order, so each value is all-reduced on its own.
        return [
            self.reduce_implementation(reduce_op, v, d, options) for v, d in value_destination_pairs
        ]

    def _all_reduce(self, reduce_op: ReduceOp, value: DistributedValues, destinations: Any) -> Any:
        arrays = _arrays(value)
        backend = backend_with_order(_current_backend(), self._all_reduce_order)
        group = ReplicaGroup(backend, tuple(_device_of(v) for v in value.values), len(arrays))
        return reduce_over_group(group, reduce_op, arrays, _devices_of(destinations))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_packs={self._num_packs})"


class NcclAllReduce(AllReduceCrossDeviceOps):
    """NVIDIA NCCL all-reduce. The simulator models it as a chunked ring (``"ring"``).

    Args:
        num_packs: how many packs the values are split into before the
            all-reduce (0: no packing). Must be >= 0.
    """

    _all_reduce_order = "ring"

    def __init__(self, num_packs: int = 1) -> None:
        if num_packs < 0:
            raise ValueError(
                f"NCCL all-reduce requires num_packs >= 0, but {num_packs} is specified"
            )
        super().__init__(all_reduce_alg="nccl", num_packs=num_packs)


class HierarchicalCopyAllReduce(AllReduceCrossDeviceOps):
    """Hierarchical copy all-reduce (reduce along a tree of GPUs, broadcast back).

    The simulator models it as a pairwise tree (``"tree"``).

    Args:
        num_packs: how many packs the values are split into (0: no packing). Must be >= 0.
    """

    _all_reduce_order = "tree"

    def __init__(self, num_packs: int = 1) -> None:
        if num_packs < 0:
            raise ValueError(
                f"HierarchicalCopy requires num_packs >= 0, but {num_packs} is specified"
            )
        super().__init__(all_reduce_alg="hierarchical_copy", num_packs=num_packs)


class CollectiveAllReduce(CrossDeviceOps):
    """The backend's own collectives over the strategy's `ReplicaGroup`: the
    ``CrossDeviceOps`` of every strategy created without ``cross_device_ops`` (TF's
    ``CollectiveAllReduce``, the one of ``MultiWorkerMirroredStrategy``).

    The strategy has validated the value (``StrategyExtended._reduce_to``), so
    ``reduce`` goes straight to the group.
    """

    def reduce(
        self,
        reduce_op: ReduceOp | str,
        per_replica_value: Any,
        destinations: Any,
        options: Any = None,
    ) -> Any:
        return self.reduce_implementation(
            as_reduce_op(reduce_op), per_replica_value, destinations, options
        )

    def reduce_implementation(
        self, reduce_op: ReduceOp, per_replica_value: Any, destinations: Any, options: Any
    ) -> Any:
        arrays = [convert_to_array(v) for v in per_replica_value.values]
        group = _active_extended()._replica_group(len(arrays))
        dests: tuple[str, ...] | str = (
            destination_devices(destinations)
            if isinstance(destinations, DistributedValues)
            else destination(destinations)
        )
        return reduce_over_group(group, reduce_op, arrays, dests)

    def batch_reduce_implementation(
        self, reduce_op: ReduceOp, value_destination_pairs: Sequence[tuple[Any, Any]], options: Any
    ) -> list[Any]:
        return [
            self.reduce_implementation(reduce_op, v, d, options) for v, d in value_destination_pairs
        ]

    def batch_reduce_dense(
        self, extended: StrategyExtended, reduce_op: ReduceOp, pairs: Sequence[tuple[Any, Any]]
    ) -> list[Any] | None:
        """As TF's collective all-reduce across workers: when every pair is a dense
        per-replica value and a distributed destination on the same devices (a model's
        (gradient, variable) pairs), the values go to the engine together
        (`batch_reduce_over_group`: one collective per pack on torch and JAX). ``None``:
        the caller reduces them one by one (one process: always, as TF does)."""
        n = len(extended._devices)
        group = extended._replica_group(n)
        if not group.across_processes or len(pairs) < 2:
            return None
        columns: list[list[Any]] = []
        devices: tuple[str, ...] | None = None
        for value, destinations in pairs:
            value = read_for_reduce(value)
            if (
                not isinstance(value, DistributedValues)
                or isinstance(value, Mirrored)
                or not isinstance(destinations, DistributedValues)
                or len(value.values) != n
                or any(isinstance(v, _indexed_slices.IndexedSlices) for v in value.values)
            ):
                return None
            here = destination_devices(value)
            if destination_devices(destinations) != here or devices not in (None, here):
                return None  # TF: "not efficient"
            devices = here
            components = [convert_to_array(v) for v in value.values]
            check_same_shape(components, "reduce")
            columns.append(components)
        assert devices is not None
        packing = bytes_per_pack(
            getattr(extended, "_communication_options", None), current_call_options()
        )
        return batch_reduce_over_group(group, reduce_op, columns, devices, packing)


#: The `CollectiveAllReduce` of every strategy without ``cross_device_ops`` (it is stateless).
COLLECTIVE_ALL_REDUCE = CollectiveAllReduce()


def _active_extended() -> StrategyExtended:
    extended = _ACTIVE.get()
    if extended is None:
        extended = _context.get_strategy().extended
    return extended  # type: ignore[no-any-return]
