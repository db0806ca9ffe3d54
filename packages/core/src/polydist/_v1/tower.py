"""The tower-era ``DistributionStrategy`` API (TF 1.11's ``tf.contrib.distribute``).

A *tower* is TF 1.11's name for a replica. The tower-era classes are thin
adapters: ``DistributionStrategy`` is a `polydist.compat.v1` strategy
(`StrategyV1`) with the old method names and signatures, each delegating to
the shared ``Strategy`` / ``StrategyExtended`` code, and ``TowerContext``
wraps the current `polydist.ReplicaContext`.

Differences from TF 1.11, all deliberate:

* Eager only: ``initialize()`` / ``finalize()`` return ``None`` (TF eager),
  also on ``TPUStrategy`` (TF 1.11 raised in eager mode); the simulated TPU
  system needs no initialization.
* The context checks are TF 1.13's: methods that need cross-tower context
  also work in the default context (outside any ``scope()``), and
  ``call_for_each_tower`` enters the strategy's scope itself.
* ``TPUStrategy`` runs one replica per TPU core, with the TPU cores as
  ``worker_devices`` (TF 1.12's ``TPUExtended``); TF 1.11's first version
  inherited ``OneDeviceStrategy('/device:CPU:0')``'s properties.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from polydist._base.arrays import convert_to_array, mean_from_sum
from polydist._base.devices import HOST_DEVICE, canonicalize
from polydist._base.reduce_op import ReduceOp, as_reduce_op
from polydist._input.input_lib import DistributedDataset
from polydist._strategies import context as _context
from polydist._strategies.replica_context import ReplicaContext
from polydist._strategies.strategy import Strategy
from polydist._v1.compat_v1 import (
    InputIterator,
    MirroredExtendedV1,
    MirroredStrategyV1,
    MultiStepContext,
    OneDeviceExtendedV1,
    OneDeviceStrategyV1,
    StrategyV1,
    TPUExtendedV1,
    TPUStrategyV1,
    run_steps,
)
from polydist._valuetypes.values import DistributedValues, Mirrored, PerReplica, select_replica
from polydist._valuetypes.variables import VariableAggregation
from polydist.backend._contract import Backend

if TYPE_CHECKING:
    from polydist.cluster_resolver import TPUClusterResolver

__all__ = [
    "DistributionStrategy",
    "MapOutput",
    "MirroredStrategy",
    "OneDeviceStrategy",
    "PerDeviceDataset",
    "TPUStrategy",
    "TowerContext",
    "TowerMultiStepContext",
    "get_cross_tower_context",
    "get_distribution_strategy",
    "get_tower_context",
    "has_distribution_strategy",
    "require_tower_context",
]


# --------------------------------------------------------------------------- contexts


class TowerContext:
    """What code running on one tower sees (TF 1.11's ``TowerContext``).

    Get it with ``get_tower_context()`` inside ``call_for_each_tower``. It
    wraps the replica's `polydist.ReplicaContext`, so TF 2 code and tower-era
    code can be mixed. ``TowerContext(distribution_strategy, tower_id)``
    makes a single-tower context, as in TF.
    """

    def __init__(self, distribution_strategy: Strategy, tower_id: int) -> None:
        if isinstance(tower_id, bool) or not isinstance(tower_id, int) or tower_id < 0:
            raise ValueError(f"tower_id must be an int >= 0, got {tower_id!r}.")
        self._replica_context = ReplicaContext(
            distribution_strategy, np.asarray(tower_id, dtype=np.int32), replica_index=tower_id
        )

    @classmethod
    def _wrap(cls, replica_context: ReplicaContext) -> TowerContext:
        ctx = cls.__new__(cls)
        ctx._replica_context = replica_context
        return ctx

    def __enter__(self) -> TowerContext:
        self._replica_context.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._replica_context.__exit__(*exc)

    def merge_call(self, merge_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``merge_fn(distribution, *args, **kwargs)`` once, in cross-tower context.

        Every tower must call it. The towers' arguments are merged first (a
        value that differs between towers arrives as a ``PerReplica``: read
        its components with ``distribution.unwrap``); ``merge_fn``'s result is
        handed back to every tower, each ``PerReplica`` in it replaced by that
        tower's component.
        """
        require_tower_context(self)
        return self._replica_context.merge_call(merge_fn, args=args, kwargs=kwargs)

    @property
    def is_single_tower(self) -> bool:
        """Whether there is only one tower."""
        require_tower_context(self)
        return self.num_towers == 1

    @property
    def num_towers(self) -> int:
        """The number of towers, for averaging across towers."""
        return self._replica_context.num_replicas_in_sync

    @property
    def tower_id(self) -> int:
        """Which tower this is: an int in ``0..num_towers - 1``."""
        require_tower_context(self)
        index = self._replica_context._replica_index
        if index is None:  # a compiled (SPMD) replica: only the traced id exists
            return self._replica_context.replica_id_in_sync_group  # type: ignore[no-any-return]
        return index

    @property
    def distribution_strategy(self) -> Strategy:
        """The strategy the towers belong to."""
        return self._replica_context.strategy

    @property
    def device(self) -> str:
        """The device this tower runs on (the host's CPU for the default tower).

        Raises ``RuntimeError`` in a compiled (SPMD) run, where no Python tower
        index exists, as ``ReplicaContext.devices`` does.
        """
        require_tower_context(self)
        return self._replica_context.devices[0]

    def __repr__(self) -> str:
        index = self._replica_context._replica_index
        return f"TowerContext(tower_id={index}, num_towers={self.num_towers})"


def get_tower_context() -> TowerContext | None:
    """The current `TowerContext`; ``None`` in cross-tower context.

    Outside any strategy this is the default (single) tower's context, as in TF.
    """
    replica_context = _context.get_replica_context()
    if replica_context is None:
        return None
    return TowerContext._wrap(replica_context)


def get_cross_tower_context() -> Strategy | None:
    """The current strategy in cross-tower context (inside ``scope()`` or a
    ``merge_fn``), else ``None``."""
    return _context.get_cross_replica_context()


def get_distribution_strategy() -> Strategy:
    """The current strategy (the default one outside any ``scope()``)."""
    return _context.get_strategy()


def has_distribution_strategy() -> bool:
    """Whether a non-default strategy is current (inside its ``scope()``)."""
    return _context.has_strategy()


def require_tower_context(tower_ctx: TowerContext) -> None:
    """Raises ``RuntimeError`` unless ``tower_ctx`` is the current tower context."""
    _context.require_replica_context(tower_ctx._replica_context)


# --------------------------------------------------------------------------- values


class MapOutput:
    """One tower's results of ``DistributionStrategy.map``: ``get()`` gives the list.

    ``reduce`` combines a ``PerReplica`` of them: SUM adds every element,
    MEAN divides that by the number of elements (a tower that got none adds
    nothing, as in TF).
    """

    __slots__ = ("_l",)

    def __init__(self, outputs: Sequence[Any]) -> None:
        self._l = list(outputs)

    def get(self) -> list[Any]:
        """The results, in the order of the mapped elements."""
        return self._l

    def __repr__(self) -> str:
        return f"MapOutput({self._l!r})"


class PerDeviceDataset:
    """What ``distribute_dataset`` returns: each tower reads its own elements.

    The dataset's elements are per-tower batches; at each step tower ``i``
    gets the next element in turn (TF's ``PerDeviceDataset``). Make an
    iterator with ``make_one_shot_iterator()`` or
    ``make_initializable_iterator()`` (its ``initializer`` restarts it and is
    ``[]``), or iterate it directly.
    """

    def __init__(self, dataset: DistributedDataset) -> None:
        self._dataset = dataset

    def make_one_shot_iterator(self) -> InputIterator:
        """An iterator over the steps; ``get_next()`` gives a ``PerReplica`` per component."""
        return InputIterator(self._dataset)

    def make_initializable_iterator(self) -> InputIterator:
        """Same as ``make_one_shot_iterator``; ``iterator.initializer`` restarts it."""
        return InputIterator(self._dataset)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._dataset)

    def __repr__(self) -> str:
        return f"<PerDeviceDataset over {self._dataset!r}>"


class TowerMultiStepContext(MultiStepContext):
    """The `MultiStepContext` of ``run_steps_on_dataset``: outputs are reduced with a
    ``VariableAggregation`` (SUM, MEAN or ONLY_FIRST_TOWER) onto the host, and
    non-tensor outputs of the towers are kept as a list."""

    def set_last_step_output(self, name: str, output: Any, aggregation: Any = None) -> None:
        """Records ``output`` under ``name``; with ``aggregation`` the towers' values are
        reduced onto the host (``distribution.reduce(aggregation, output, "/device:CPU:0")``).
        In tower context ``aggregation`` is required and every tower must call this."""
        super().set_last_step_output(name, output, aggregation)

    def _reduce(self, strategy: Strategy, reduce_op: Any, value: Any) -> Any:
        if isinstance(strategy, DistributionStrategy):
            return strategy.reduce(reduce_op, value, destinations=HOST_DEVICE)
        op = _tower_reduce_op(reduce_op)  # a v1/v2 strategy: no tower-era reduce to call
        if op is None:
            return strategy.experimental_local_results(value)[0]
        return super()._reduce(strategy, op, value)

    def _local_results(self, strategy: Strategy, value: Any) -> Any:
        return list(strategy.experimental_local_results(value))


# --------------------------------------------------------------------------- the strategy


def _tower_reduce_op(aggregation: Any) -> ReduceOp | None:
    """A tower-era aggregation as a ``ReduceOp``; ``None`` for ONLY_FIRST_TOWER."""
    if isinstance(aggregation, VariableAggregation):
        if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:  # alias ONLY_FIRST_TOWER
            return None
        if aggregation in (VariableAggregation.SUM, VariableAggregation.MEAN):
            return ReduceOp(aggregation.name)
        raise ValueError(
            f"Cannot reduce with aggregation {aggregation}: use VariableAggregation.SUM, MEAN "
            "or ONLY_FIRST_TOWER (or ReduceOp.SUM / MEAN)."
        )
    if isinstance(aggregation, str) and aggregation.upper() in (
        "ONLY_FIRST_TOWER",
        "ONLY_FIRST_REPLICA",
    ):
        return None
    return as_reduce_op(aggregation)


class DistributionStrategy(StrategyV1):
    """TF 1.11's ``tf.contrib.distribute.DistributionStrategy``, the tower-era API.

    The base of the tower-era strategies here; combine it with any
    `polydist.compat.v1` strategy class to give that strategy the tower API
    (``class S(DistributionStrategy, MirroredStrategyV1)``). Towers are
    replicas: ``num_towers == num_replicas_in_sync``, ``call_for_each_tower``
    is ``extended.call_for_each_replica``, ``get_tower_context()`` wraps
    ``get_replica_context()``.
    """

    # -- properties ---------------------------------------------------------------------------
    @property
    def between_graph(self) -> bool:
        """Whether each worker runs its own copy of the program (multi-worker strategies)."""
        return self.extended.experimental_between_graph

    @property
    def is_single_tower(self) -> bool:
        """True when ``call_for_each_tower(fn)`` calls ``fn`` once."""
        return self.num_towers == 1

    @property
    def num_towers(self) -> int:
        """The number of towers (replicas), for averaging across towers."""
        return self.num_replicas_in_sync

    @property
    def parameter_devices(self) -> list[str]:
        """The devices variables and ``update`` are placed on."""
        return list(self.extended.parameter_devices)

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker should save checkpoints."""
        return self.extended.should_checkpoint

    @property
    def should_init(self) -> bool:
        """Whether this worker should run initializers."""
        return self.extended.experimental_should_init

    @property
    def should_save_summary(self) -> bool:
        """Whether this worker should write summaries."""
        return self.extended.should_save_summary

    @property
    def worker_device_index(self) -> Any:
        """A value whose component on tower ``i`` is ``i`` (the integer 0 for one tower).

        Pass it to ``call_for_each_tower(fn, distribution.worker_device_index)``
        to give ``fn`` its tower's index into ``worker_devices``.
        """
        _context.require_cross_replica_or_default_context(self)
        if self.is_single_tower:
            return 0
        return PerReplica(tuple(range(self.num_towers)))

    @property
    def worker_devices(self) -> list[str]:
        """The devices ``call_for_each_tower`` runs on, in tower order."""
        return list(self.extended.worker_devices)

    # -- running -------------------------------------------------------------------------------
    def call_for_each_tower(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``fn(*args, **kwargs)`` once per tower; returns the merged results.

        Distributed values among the arguments give each tower its component.
        ``fn`` may call ``get_tower_context()`` for ``tower_id`` and
        ``merge_call``. TF 1.11's ``run_concurrently`` keyword is accepted and
        ignored (the backend decides how replicas run).
        """
        kwargs.pop("run_concurrently", None)
        with self.scope():
            return self.extended.call_for_each_replica(fn, args, kwargs)

    def run_steps_on_dataset(
        self,
        fn: Callable[..., Any],
        iterator: Any,
        iterations: int = 1,
        initial_loop_values: Any = None,
    ) -> TowerMultiStepContext:
        """Calls ``fn(context, *inputs)`` ``iterations`` times, ``inputs = iterator.get_next()``.

        A tuple of inputs is passed as separate arguments, anything else as
        one. ``context`` is a `TowerMultiStepContext`: record outputs with
        ``set_last_step_output(name, value, aggregation=None)`` and
        ``set_non_tensor_output(name, value)``; it is returned, with
        ``last_step_outputs`` / ``non_tensor_outputs`` of the last step. The
        steps have run when this returns (``run_op`` is ``None``).
        """
        ctx = run_steps(
            self,
            fn,
            iterator,
            iterations,
            initial_loop_values,
            TowerMultiStepContext(),
            unpack_inputs=True,
        )
        return cast(TowerMultiStepContext, ctx)

    def map(
        self, map_over: Sequence[Any], fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """Calls ``fn(element, *args, **kwargs)`` for each element of ``map_over``,
        spreading the elements over the towers' devices round-robin.

        Returns a ``PerReplica`` of `MapOutput` (one per tower; a single
        ``MapOutput`` with one tower) for ``reduce``.
        """
        devices = self.extended.worker_devices
        backend = self.extended._backend
        if len(devices) == 1:
            with backend.device_scope(devices[0]):
                return MapOutput([fn(m, *args, **kwargs) for m in map_over])
        results: list[list[Any]] = [[] for _ in devices]
        for i, m in enumerate(map_over):
            r = i % len(devices)
            with backend.device_scope(devices[r]):
                results[r].append(fn(m, *select_replica(r, args), **select_replica(r, kwargs)))
        return PerReplica([MapOutput(r) for r in results])

    # -- reductions -----------------------------------------------------------------------------
    # The tower-era signature: destinations, not axis. The v1/v2 one stays StrategyV1.reduce.
    def reduce(self, aggregation: Any, value: Any, destinations: Any = None) -> Any:
        """Combines the towers' values of ``value`` and puts the result on ``destinations``.

        Args:
            aggregation: ``VariableAggregation.SUM``, ``MEAN`` or
                ``ONLY_FIRST_TOWER`` (the first tower's value), or a ``ReduceOp``.
            value: a per-tower value (e.g. ``call_for_each_tower``'s result).
            destinations: a device string (one array there), a list of device
                strings or a mirrored value / variable (a ``Mirrored`` on their
                devices). ``None``: the devices of ``value``, i.e. an all-reduce.
        """
        _context.require_cross_replica_or_default_context(self)
        op = _tower_reduce_op(aggregation)
        if _holds_map_output(value):
            return self._reduce_map_output(op, value, destinations)
        if op is None:  # ONLY_FIRST_TOWER
            if not isinstance(value, DistributedValues):
                return value
            first = self.unwrap(value)[0]
            if isinstance(first, int | float):
                return first
            return self.broadcast(first, destinations)
        if destinations is None:
            destinations = value if isinstance(value, DistributedValues) else HOST_DEVICE
        if _is_device_list(destinations):
            devices = _device_list(destinations)
            if len(devices) > 1:
                total = self.extended.reduce_to(op, value, HOST_DEVICE)
                return self._to_devices(total, devices)
            destinations = devices[0]
        return self.extended.reduce_to(op, value, destinations)

    def batch_reduce(
        self, aggregation: Any, value_destination_pairs: Sequence[tuple[Any, Any]]
    ) -> list[Any]:
        """``reduce`` over a list of ``(value, destinations)`` pairs, in one batch when it can."""
        _context.require_cross_replica_or_default_context(self)
        pairs = list(value_destination_pairs)
        op = _tower_reduce_op(aggregation)
        simple = all(
            d is not None and not _is_device_list(d) and not _holds_map_output(v) for v, d in pairs
        )
        if op is not None and simple:
            return self.extended.batch_reduce_to(op, pairs)
        return [self.reduce(aggregation, v, d) for v, d in pairs]

    def broadcast(self, tensor: Any, destinations: Any = None) -> Any:
        """Copies ``tensor`` to ``destinations`` (default: every worker device) as a
        ``Mirrored``; with one tower and no destinations, ``tensor`` itself."""
        _context.require_cross_replica_or_default_context(self)
        if destinations is None:
            if self.is_single_tower:
                return tensor
            destinations = self.worker_devices
        if _is_device_list(destinations):
            devices = _device_list(destinations)
            if len(devices) > 1:
                return self._to_devices(tensor, devices)
            destinations = devices[0]
        return self.extended.broadcast_to(convert_to_array(tensor), destinations)

    def _to_devices(self, value: Any, devices: tuple[str, ...]) -> Mirrored:
        array = convert_to_array(value)
        return Mirrored(self.extended._backend.broadcast(array, devices))

    def _reduce_map_output(self, op: ReduceOp | None, value: Any, destinations: Any) -> Any:
        if op is None:
            raise ValueError(
                "ONLY_FIRST_TOWER cannot reduce the MapOutput values of map(): use "
                "VariableAggregation.SUM or MEAN."
            )
        outputs = value.values if isinstance(value, DistributedValues) else (value,)
        partials: list[Any] = []
        count = 0
        for output in outputs:
            items = [convert_to_array(x) for x in output.get()]
            count += len(items)
            total = items[0] if items else None
            for x in items[1:]:  # sum within the device first, as TF
                total = total + x
            partials.append(total)
        present = [p for p in partials if p is not None]
        if not present:
            raise ValueError("Cannot reduce the result of map() over no elements.")
        # Towers that got no element (fewer elements than towers) add nothing: TF
        # skips them; the reduction still needs one value per tower.
        xp = self.extended.array_namespace()
        partials = [xp.zeros_like(present[0]) if p is None else p for p in partials]
        total = self.extended._reduce_to(ReduceOp.SUM, PerReplica(partials), HOST_DEVICE)
        if op is ReduceOp.MEAN:  # the mean over elements, not over towers
            total = mean_from_sum(xp, total, count)
        if destinations is None:
            return (
                total
                if self.is_single_tower
                else self._to_devices(total, tuple(self.worker_devices))
            )
        return self.broadcast(total, destinations)

    # -- variables ------------------------------------------------------------------------------
    def update(self, var: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``fn(component, *args, **kwargs)`` on each copy of ``var``; mirrored
        arguments give each copy theirs. Returns the merged results."""
        return self.extended.update(var, fn, args, kwargs)

    def update_non_slot(
        self, colocate_with: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """Runs ``fn(*args, **kwargs)`` on each device of ``colocate_with`` (from
        ``non_slot_devices``); returns the merged results."""
        return self.extended.update_non_slot(colocate_with, fn, args, kwargs)

    def non_slot_devices(self, var_list: Sequence[Any]) -> Any:
        """Where non-slot variables go: a list of devices (a variable of ``var_list`` for
        the default strategy). Pass it to ``colocate_vars_with`` and ``update_non_slot``."""
        devices = self.extended.non_slot_devices(var_list)
        if isinstance(devices, tuple):
            return list(devices)
        if isinstance(devices, str):
            return [devices]
        return devices

    def read_var(self, tower_local_var: Any) -> Any:
        """The value of a variable; the aggregate over towers for a tower-local one."""
        return self.extended.read_var(tower_local_var)

    def value_container(self, value: Any) -> Any:
        """The distributed variable a per-tower component belongs to (else ``value``)."""
        return self.extended.value_container(value)

    def unwrap(self, value: Any) -> list[Any]:  # type: ignore[override]  # TF 1.11: a list
        """The per-tower components of ``value`` as a list (``[value]`` for a single value)."""
        return list(self.experimental_local_results(value))

    # -- input and lifecycle ----------------------------------------------------------------------
    def distribute_dataset(self, dataset_fn: Callable[[], Any]) -> PerDeviceDataset:
        """A `PerDeviceDataset` over ``dataset_fn()``, whose elements are per-tower batches.

        At each step every tower takes the next element in turn, as TF's
        ``PerDeviceDataset``. ``dataset_fn`` takes no arguments and returns a
        ``polydist.data.Dataset`` (or an iterable of batches).
        """
        if not callable(dataset_fn):
            raise TypeError(
                "dataset_fn must be a function returning a polydist.data.Dataset, got "
                f"{type(dataset_fn).__name__} {dataset_fn!r}."
            )
        return PerDeviceDataset(self.distribute_datasets_from_function(lambda _: dataset_fn()))

    def initialize(self) -> None:
        """Initialization before any computation: nothing to do, returns ``None`` (TF eager)."""
        return None

    def finalize(self) -> None:
        """Final actions after all computations: nothing to do, returns ``None`` (TF eager)."""
        return None


def _holds_map_output(value: Any) -> bool:
    if isinstance(value, MapOutput):
        return True
    return isinstance(value, PerReplica) and isinstance(value.values[0], MapOutput)


def _is_device_list(destinations: Any) -> bool:
    return isinstance(destinations, list | tuple)


def _device_list(destinations: Sequence[Any]) -> tuple[str, ...]:
    if not destinations or not all(isinstance(d, str) for d in destinations):
        raise ValueError(
            "destinations must be a device string, a non-empty list of device strings, or a "
            f"mirrored value or variable; got {destinations!r}."
        )
    return tuple(canonicalize(d) for d in destinations)


# --------------------------------------------------------------------------- the strategies


class MirroredStrategy(DistributionStrategy, MirroredStrategyV1):
    """TF 1.11's ``tf.contrib.distribute.MirroredStrategy``: one tower per device.

    Args:
        devices: device strings; ``None`` uses ``num_gpus`` GPUs.
        num_gpus: the number of GPUs (0: the CPU); give ``devices`` or this.
        num_gpus_per_worker: TF's multi-worker setting; without a cluster it is
            ``num_gpus``.
        cross_tower_ops: TF 1.11's name for ``cross_device_ops``.
        prefetch_on_device: accepted and unused (each tower's batch is already
            placed on its device).
        auto_shard_dataset: accepted and unused (it only applies across workers).
        cross_device_ops: a `polydist.CrossDeviceOps`.
        backend: a backend name or object; else ``$POLYDIST_BACKEND``, else ``sim``.
    """

    def __init__(
        self,
        devices: Sequence[str] | None = None,
        num_gpus: int | None = None,
        num_gpus_per_worker: int | None = None,
        cross_tower_ops: Any = None,
        prefetch_on_device: bool | None = None,
        auto_shard_dataset: bool = False,
        *,
        cross_device_ops: Any = None,
        backend: str | Backend | None = None,
    ) -> None:
        del prefetch_on_device, auto_shard_dataset  # nothing to prefetch; one worker
        if cross_tower_ops is not None and cross_device_ops is not None:
            raise ValueError("Pass cross_tower_ops or cross_device_ops (its later name), not both.")
        if num_gpus_per_worker is not None:
            if num_gpus is not None and num_gpus != num_gpus_per_worker:
                raise ValueError(
                    f"num_gpus={num_gpus} and num_gpus_per_worker={num_gpus_per_worker} "
                    "disagree; without a cluster they are the same thing: pass one."
                )
            num_gpus = num_gpus_per_worker
        resolved: Sequence[str] | int | None = devices
        if devices is not None and num_gpus is not None:
            raise ValueError(
                f"Must only specify one of `devices` and `num_gpus`; got devices={devices!r} "
                f"and num_gpus={num_gpus!r}."
            )
        if devices is None and num_gpus is not None:
            if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 0:
                raise ValueError(f"num_gpus must be an int >= 0, got {num_gpus!r}.")
            resolved = ["/device:CPU:0"] if num_gpus == 0 else num_gpus
        super().__init__(resolved, cross_tower_ops or cross_device_ops, backend=backend)

    @property
    def extended(self) -> MirroredExtendedV1:
        """A `polydist.compat.v1` ``MirroredExtendedV1``."""
        return cast(MirroredExtendedV1, self._extended)


class OneDeviceStrategy(DistributionStrategy, OneDeviceStrategyV1):
    """TF 1.11's ``tf.contrib.distribute.OneDeviceStrategy(device)``: one tower."""

    @property
    def extended(self) -> OneDeviceExtendedV1:
        """A `polydist.compat.v1` ``OneDeviceExtendedV1``."""
        return cast(OneDeviceExtendedV1, self._extended)


class TPUStrategy(DistributionStrategy, TPUStrategyV1):
    """TF 1.11's ``tf.contrib.distribute.TPUStrategy`` on a simulated TPU slice.

    One tower per TPU core (see `polydist.TPUStrategy` for the slices).

    Args:
        tpu_cluster_resolver: a `polydist.cluster_resolver.TPUClusterResolver`
            (default as `polydist.TPUStrategy`).
        steps_per_run: steps run on the TPU per call (Keras/Estimator loops);
            default 1.
        num_cores: use only the first ``num_cores`` cores; ``None``: all.
        backend: a backend that declares ``Capabilities.tpu`` (default ``sim``).
    """

    def __init__(
        self,
        tpu_cluster_resolver: TPUClusterResolver | None = None,
        steps_per_run: int | None = None,
        num_cores: int | None = None,
        *,
        backend: str | Backend | None = None,
    ) -> None:
        Strategy.__init__(  # see TPUStrategyV1
            self,
            TPUExtendedV1(
                self, tpu_cluster_resolver, steps_per_run, num_cores=num_cores, backend=backend
            ),
        )

    @property
    def extended(self) -> TPUExtendedV1:
        """A `polydist.compat.v1` ``TPUExtendedV1``."""
        return cast(TPUExtendedV1, self._extended)

    @property
    def num_hosts(self) -> int:
        """The number of TPU hosts."""
        return self.extended.num_hosts

    @property
    def num_towers_per_host(self) -> int:
        """TPU cores (towers) per host."""
        return self.extended.num_replicas_per_host

    def get_host_cpu_device(self, host_id: int) -> str:
        """The CPU device of TPU host ``host_id`` (``/replica:0/task:0/device:CPU:0`` if local)."""
        return self.extended.get_host_cpu_device(host_id)
