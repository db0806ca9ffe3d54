"""``Strategy``, ``StrategyExtended`` and the single-machine strategies."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from contextlib import ContextDecorator
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from polydist._base.arrays import (
    check_same_shape,
    check_summable,
    convert_to_array,
    describe,
    divide_exactly,
    is_array,
    is_integral,
    mean_from_sum,
)
from polydist._base.communication import CommunicationOptions, call_options
from polydist._base.devices import HOST_DEVICE, canonicalize
from polydist._base.reduce_op import ReduceOp, as_reduce_op
from polydist._collectives import cross_device_ops as _cross_device_ops
from polydist._collectives import trace as _trace
from polydist._strategies import context as _context
from polydist._strategies import eager as _eager
from polydist._strategies.extended_mixin import ExtendedVariablesMixin
from polydist._strategies.replica_context import (
    _check_gather_axis,
)
from polydist._valuetypes import indexed_slices as _indexed_slices
from polydist._valuetypes import nest as _nest
from polydist._valuetypes import variables as _variables
from polydist._valuetypes.indexed_slices import IndexedSlices
from polydist._valuetypes.values import (
    DistributedValues,
    Mirrored,
    PerReplica,
    ValueContext,
    check_num_components,
    per_replica_nests,
    picked_leaves,
    regroup,
    select_replicas,
)
from polydist.backend._contract import NOT_HANDLED, Backend, ReplicaGroup, get_backend
from polydist.errors import InvalidArgumentError

if TYPE_CHECKING:
    from polydist._input.input_lib import DistributedDataset
    from polydist.data import InputContext, InputOptions

__all__ = ["RunOptions", "Strategy", "StrategyExtended"]

_GATHER_MESSAGE = (
    "tf.distribute.Strategy.gather method requires cross-replica context, use "
    "get_replica_context().all_gather() instead"
)


class StrategyExtended(ExtendedVariablesMixin):
    """Additional APIs for algorithms that need to be distribution-aware.

    Holds the strategy's backend and devices and implements the reductions
    every strategy shares.
    """

    #: The strategy's ``CommunicationOptions`` (multi-worker strategies set them).
    _communication_options: CommunicationOptions | None = None

    def __init__(
        self,
        container_strategy: Strategy,
        backend: Backend | None,
        devices: Sequence[str],
        *,
        cross_device_ops: Any = None,
    ) -> None:
        self._container_strategy_ref = container_strategy
        self._backend_ref = backend
        self._devices: tuple[str, ...] = tuple(devices)
        self._cross_device_ops = cross_device_ops
        self._run_execution_cache: _eager.ReplicaExecution | None = None

    # -- plumbing -------------------------------------------------------------
    def _container_strategy(self) -> Strategy:
        return self._container_strategy_ref

    @property
    def _backend(self) -> Backend:
        if self._backend_ref is None:
            self._backend_ref = get_backend()
        return self._backend_ref

    @property
    def backend(self) -> Backend:
        """The polydist backend this strategy runs on (a polydist extension)."""
        return self._backend

    def array_namespace(self) -> Any:
        """The array API namespace of this strategy's arrays (a polydist extension)."""
        return self._backend.array_namespace()

    @property
    def _num_replicas_in_sync(self) -> int:
        return len(self._devices)

    def _backend_name(self) -> str:
        return self._backend_ref.name if self._backend_ref is not None else "default backend"

    def __deepcopy__(self, memo: dict[int, Any]) -> StrategyExtended:
        # The backend is a process-wide engine handle: share it, copy the rest.
        result = self.__class__.__new__(self.__class__)
        memo[id(self)] = result
        for k, v in self.__dict__.items():
            if k == "_run_execution_cache":
                v = None  # it refers to the backend and the strategy: the copy builds its own
            setattr(result, k, v if k == "_backend_ref" else copy.deepcopy(v, memo))
        return result

    # -- properties -------------------------------------------------------------
    @property
    def worker_devices(self) -> tuple[str, ...]:
        """The devices this worker's replicas run on, in replica order."""
        return self._devices

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The devices variables are placed on (a copy on each replica's device)."""
        return self._devices

    @property
    def experimental_require_static_shapes(self) -> bool:
        """True when the strategy needs static shapes (TPU)."""
        return False

    # -- running ------------------------------------------------------------------
    def call_for_each_replica(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Runs ``fn`` once per replica (TF v1 API; ``Strategy.run`` calls this)."""
        _check_callable(fn, "fn", "strategy.run(fn, args=(...))")
        _context.require_cross_replica_or_default_context(self._container_strategy())
        return self._call_for_each_replica(fn, tuple(args), dict(kwargs or {}))

    def _call_for_each_replica(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        execution = self._run_execution_cache
        if (
            execution is None
            or execution.group.devices is not self._devices
            or not _plain_run_devices(type(self))
        ):
            execution = self._run_execution()
        tracing = _trace.is_tracing()
        if execution.direct is not None and not tracing:
            # A compiled backend's answer for a call it has run before (it replays what
            # core decided then: each replica's arguments, the regrouping).
            result = execution.direct(execution.group, fn, args, kwargs)
            if result is not NOT_HANDLED:
                _variables.after_run(self)
                if execution.prepare is not None and not kwargs and fn not in execution.prepared:
                    _prepare(self, execution, fn)
                return result
        per_replica = _per_replica_args(args, kwargs, len(self._devices))
        if tracing:
            _trace.begin_step()
        results = execution.run(fn, per_replica)
        _variables.after_run(self)  # ReplicaDivergenceWarning for NONE-aggregated copies
        return regroup(results)

    def _run_devices(self) -> tuple[str, ...]:
        """The devices of the replicas ``strategy.run`` runs in this process, in replica
        order: ``worker_devices``, except that a simulated cluster runs every worker's."""
        return self.worker_devices

    def _run_group(self) -> ReplicaGroup:
        """The `ReplicaGroup` of ``strategy.run`` (``polydist.backend.replica_group``)."""
        return self._run_execution().group

    def _run_execution(self) -> _eager.ReplicaExecution:
        """How ``strategy.run`` runs: built once, and again only when the run's devices
        change (a TPU logical device), so that a step pays no more than a lookup."""
        devices = self._run_devices()
        execution = self._run_execution_cache
        if execution is not None:
            cached = execution.group.devices
            if cached is devices or cached == devices:
                return execution
        group = ReplicaGroup(
            self._backend,
            tuple(devices),
            self._num_replicas_in_sync,
            tuple(devices),
            across_processes=self._run_across_processes(),
            strategy=self._container_strategy(),
            replica_offset=self._replica_offset,
            communication_options=self._communication_options,
        )
        execution = self._run_execution_cache = _eager.ReplicaExecution(group)
        return execution

    def _run_across_processes(self) -> bool:
        """Whether a run's collectives span several processes (one per worker)."""
        return False

    # -- reductions --------------------------------------------------------------
    def reduce_to(
        self, reduce_op: ReduceOp | str, value: Any, destinations: Any, options: Any = None
    ) -> Any:
        """Combines ``value`` across replicas onto ``destinations``.

        ``destinations`` is a device string (the result is one array there) or
        a distributed value or variable (the result is a ``Mirrored`` on its
        devices); a list or tuple of devices raises ``ValueError`` (TF asserts).
        ``value`` may be a ``PerReplica``, a ``Mirrored`` or a plain array that
        is taken to be the same on every replica.
        """
        reduce_op = _check_reduce_op(reduce_op)
        _context.require_cross_replica_or_default_context(self._container_strategy())
        _check_not_a_list(destinations, "reduce_to")
        with call_options(options):
            return self._reduce_to(reduce_op, value, destinations)

    def batch_reduce_to(
        self,
        reduce_op: ReduceOp | str,
        value_destination_pairs: Sequence[tuple[Any, Any]],
        options: Any = None,
    ) -> list[Any]:
        """``reduce_to`` over a list of ``(value, destinations)`` pairs."""
        reduce_op = _check_reduce_op(reduce_op)
        _context.require_cross_replica_or_default_context(self._container_strategy())
        for pair in value_destination_pairs:
            if isinstance(pair, tuple) and len(pair) == 2:
                _check_not_a_list(pair[1], "batch_reduce_to")
        with call_options(options):  # its bytes_per_pack packs the batch across workers
            if self._cross_device_ops is not None:  # TF: cross_device_ops.batch_reduce
                batched = _cross_device_ops.strategy_batch_reduce(
                    self, reduce_op, list(value_destination_pairs)
                )
                if batched is not None:
                    return batched
            return self._batch_reduce_to(reduce_op, list(value_destination_pairs))

    def _batch_reduce_to(self, reduce_op: ReduceOp, pairs: list[tuple[Any, Any]]) -> list[Any]:
        """`batch_reduce_to` without cross-device ops: the group's batch (packed across
        processes), else one `_reduce_to` per pair."""
        packed = _cross_device_ops.COLLECTIVE_ALL_REDUCE.batch_reduce_dense(self, reduce_op, pairs)
        if packed is not None:
            return packed
        return [self._reduce_to(reduce_op, v, d) for v, d in pairs]

    def _reduce_to(self, reduce_op: ReduceOp, value: Any, destinations: Any) -> Any:
        # Every reduce (Strategy.reduce with or without axis, reduce_to, batch_reduce_to)
        # comes through here on every backend and strategy; the strategy's CrossDeviceOps
        # reduces over the group this strategy supplies (`_replica_group`).
        value = _variables.read_for_reduce(value)  # a variable reduces as its copies' values
        if not isinstance(value, DistributedValues) and self._host_group() is not None:
            return self._reduce_host_value(reduce_op, value, destinations)
        if isinstance(value, DistributedValues):
            self._check_reduce_components(value)
        if isinstance(value, Mirrored):
            if reduce_op is ReduceOp.MEAN:
                return self._to_destinations(value._primary, destinations)
            raise ValueError(
                "Cannot SUM a Mirrored value across replicas: it is the same on every replica, "
                "so the sum is ill-defined. Use ReduceOp.MEAN, or pass a PerReplica value."
            )
        if not isinstance(value, DistributedValues):
            return self._reduce_non_distributed(reduce_op, value, destinations)
        if any(isinstance(v, IndexedSlices) for v in value.values):
            return self._reduce_indexed_slices(reduce_op, value.values, destinations)
        components = [convert_to_array(v) for v in value.values]
        check_same_shape(components, "reduce")
        if len(components) == 1 and not self._replica_group(1).across_processes:
            return self._to_destinations(components[0], destinations)
        if self._cross_device_ops is not None:  # TF: the strategy's CrossDeviceOps reduces
            op = "all_reduce" if isinstance(destinations, DistributedValues) else "reduce_to"
            self._record(op, reduce_op, components[0])
        return _cross_device_ops.strategy_reduce(
            self, reduce_op, PerReplica(components), destinations
        )

    @property
    def _collective_ops(self) -> _cross_device_ops.CrossDeviceOps:
        """The strategy's ``CrossDeviceOps``: ``cross_device_ops``, else the backend's own
        collectives over `_replica_group` (TF: every strategy holds one)."""
        if self._cross_device_ops is not None:
            return self._cross_device_ops  # type: ignore[no-any-return]
        return _cross_device_ops.COLLECTIVE_ALL_REDUCE

    # -- the group (what differs between one process, a simulated cluster and workers) --
    def _replica_group(self, count: int) -> _cross_device_ops.ReplicaGroup:
        """Who a reduction of ``count`` components of this process spans (the strategy's
        group provider): here this process's replicas, MEAN dividing by ``count``."""
        devices = self._devices if count == len(self._devices) else (HOST_DEVICE,) * count
        return _cross_device_ops.ReplicaGroup(self._backend, devices, count, self._devices)

    def _check_reduce_components(self, value: DistributedValues) -> None:
        """Raises unless ``value`` has one component per replica of this process."""
        check_num_components(value, len(self._devices), "strategy.reduce (or reduce_to)")

    def _host_group(self) -> _cross_device_ops.ReplicaGroup | None:
        """The group that reduces a host value (not distributed) once per worker;
        ``None``: one worker, where TF's non-distributed rule applies."""
        return None

    def _reduce_host_value(self, reduce_op: ReduceOp, value: Any, destinations: Any) -> Any:
        raise NotImplementedError  # only strategies with a `_host_group` reduce host values

    @property
    def _local_replica_count(self) -> int:
        """How many of the replicas a non-distributed value stands for run here."""
        return self._num_replicas_in_sync

    @property
    def _replica_offset(self) -> int:
        """Global replica id of this process's first replica."""
        return 0

    def _count_over_group(self, local: int, numer: Any) -> int:
        """The number of elements every replica of the group summed (MEAN with an axis):
        ``local``, this process's, when the group is this process."""
        return local

    def _place_components(self, components: Sequence[Any]) -> list[Any]:
        return [self._backend.place(c, d) for c, d in zip(components, self._devices_of(components))]

    def _devices_of(self, components: Sequence[Any]) -> tuple[str, ...]:
        """Where each component of a distributed value lives: its replica's device."""
        if len(self._devices) != len(components):
            return tuple(HOST_DEVICE for _ in components)
        return self._devices

    def _reduce_indexed_slices(
        self, reduce_op: ReduceOp, components: Sequence[Any], destinations: Any
    ) -> Any:
        # TF concatenates the replicas' rows (and divides them for MEAN): a gather, so
        # no cross-device algorithm and no bool rule apply.
        if not all(isinstance(c, IndexedSlices) for c in components):
            kinds = ", ".join(type(c).__name__ for c in components)
            raise TypeError(
                f"Cannot reduce a mix of IndexedSlices and other values across replicas (the "
                f"replicas gave {kinds}). Every replica must pass an IndexedSlices."
            )
        group = self._replica_group(len(components))
        if len(components) == 1 and not group.across_processes:
            return self._to_destinations(components[0], destinations)
        dests = (
            _cross_device_ops.destination_devices(destinations)
            if isinstance(destinations, DistributedValues)
            else (_destination(destinations),)
        )
        reduced = _indexed_slices.reduce(
            self._backend, reduce_op, components, group.devices, dests, group.size
        )
        self._record("all_gather", None, components[0].values)
        self._record("all_gather", None, components[0].indices)
        return Mirrored(reduced) if isinstance(destinations, DistributedValues) else reduced[0]

    def _reduce_non_distributed(self, reduce_op: ReduceOp, value: Any, destinations: Any) -> Any:
        # TF's cross_device_ops.reduce_non_distributed_value.
        if not _is_arraylike(value) and _equals_zero(value):
            return 0
        if reduce_op is ReduceOp.MEAN or self._num_replicas_in_sync == 1:
            if not isinstance(value, IndexedSlices):
                value = convert_to_array(value)
            return self._to_destinations(value, destinations)
        raise ValueError(
            f"A non-DistributedValues value {value!r} cannot be reduced with the given reduce op "
            f"{reduce_op}: with {self._num_replicas_in_sync} replicas, summing one value that is "
            "the same on every replica is ill-defined. Pass a PerReplica value (e.g. the output "
            "of strategy.run) or use ReduceOp.MEAN. In replica context (v.assign_add(n) on a "
            "SUM variable inside strategy.run), a Python number such as x.shape[0] is this one "
            "value; pass an array (np.int32(n), jnp.asarray(n), torch.tensor(n)) to sum each "
            "replica's own."
        )

    def _to_destinations(self, value: Any, destinations: Any) -> Any:
        if isinstance(destinations, DistributedValues):
            dests = _cross_device_ops.destination_devices(destinations)
            if isinstance(value, IndexedSlices):
                self._record("broadcast", None, value.values)
                return Mirrored(_indexed_slices.broadcast(self._backend, value, dests))
            array = convert_to_array(value)
            copies = self._backend.broadcast(array, dests)
            self._record("broadcast", None, array)  # a collective too: the trace must show it
            return Mirrored(copies)
        return value

    def _record(self, op: str, reduce_op: ReduceOp | None, example: Any) -> None:
        _cross_device_ops.record(op, reduce_op, example, self._devices, self._backend)

    def _local_results(self, value: Any) -> tuple[Any, ...]:
        if isinstance(value, DistributedValues):
            return value.values
        selected = select_replicas(range(len(self._devices)), value)
        return (value,) if selected is None else selected

    def _distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        n = self._num_replicas_in_sync
        offset = self._replica_offset  # ids among every worker's replicas
        values = []
        for r, device in enumerate(self._devices):
            with self._backend.device_scope(device):
                values.append(value_fn(ValueContext(offset + r, n)))
        return regroup(values, always_wrap=True)

    def _gather_to(self, value: Any, destination: str, axis: int) -> Any:
        if not isinstance(value, DistributedValues):
            group = self._host_group()
            if group is None:
                return value  # one worker: TF gives a non-distributed value back as it is
            return self._gather_host_value(group, value, destination, axis)
        check_num_components(value, len(self._devices), "strategy.gather")
        components = _replica_arrays(value)
        for c in components:
            _check_gather_axis(c, axis)
        _check_gather_shapes(components, axis, same_shape=self._gather_needs_same_shape)
        if len(components) == 1 and not self._replica_group(1).across_processes:
            first = value.values[0]
            # A variable's copy is read now: its storage may be updated in place later.
            return first.read_value() if isinstance(first, _variables.Variable) else components[0]
        result = self._backend.all_gather(self._place_components(components), axis, [destination])[
            0
        ]
        self._record("gather", None, components[0])
        return result

    def _gather_host_value(
        self, group: _cross_device_ops.ReplicaGroup, value: Any, destination: str, axis: int
    ) -> Any:
        """A non-distributed value gathered across several workers: TF's
        ``CrossDeviceOps._gather`` makes it one component per worker (as `_reduce_to`
        reduces it over `_host_group`), so the result is every worker's copy
        concatenated along ``axis`` in worker order, the same on every worker."""
        array = convert_to_array(_variables.read_for_reduce(value))
        _check_gather_axis(array, axis)
        backend = group.backend
        copies = [backend.place(array, d) for d in group.devices]  # this process's workers'
        result = backend.all_gather(copies, axis, [destination])[0]
        if group.participants is not None:
            _cross_device_ops.record("gather", None, array, group.participants, backend)
        return result

    _gather_needs_same_shape = False


def _check_not_a_list(destinations: Any, method: str) -> None:
    """TF's ``reduce_to`` asserts that ``destinations`` is not a list or tuple."""
    if isinstance(destinations, list | tuple):
        raise ValueError(
            f"{method} takes one destination, not a {type(destinations).__name__}: got "
            f"{destinations!r}. Pass a device string (the result is one array there), or a "
            "variable or distributed value such as a Mirrored (the result is a Mirrored on "
            "its devices): to reach several devices, pass a variable or distributed value "
            "that lives on them."
        )


def _replica_arrays(value: DistributedValues) -> list[Any]:
    """Each replica's array of ``value``; a distributed variable gives each replica's own
    copy, as TF's per-replica ``reduce_sum(v, axis)`` reads it (backends take arrays only)."""
    value = _variables.read_for_reduce(value)
    return [convert_to_array(_variables.read_for_reduce(v)) for v in value.values]


class RunOptions(NamedTuple):
    """Options of ``Strategy.run`` (``tf.distribute.RunOptions``), as TF's namedtuple.

    TF's ``TPUStrategy`` reads them when it compiles the step; the other strategies
    ignore them. polydist accepts them on every strategy (``run(fn, options=...)``)
    and they change nothing: no backend needs them to run a step whose batch size
    varies.

    Attributes:
        experimental_enable_dynamic_batch_size: TPU: compile for a batch size
            that may vary between steps (default True).
        experimental_bucketizing_dynamic_shape: TPU: pad dynamic shapes to a
            power of two (default False).
        experimental_xla_options: TPU: XLA compiler options (default None).
    """

    experimental_enable_dynamic_batch_size: bool = True
    experimental_bucketizing_dynamic_shape: bool = False
    experimental_xla_options: Any = None


class Strategy:
    """A state and compute distribution policy on a list of devices.

    Use ``scope()`` to create variables under the strategy, ``run`` to call a
    function once per replica, and ``reduce``/``gather`` to combine the
    per-replica results.
    """

    def __init__(self, extended: StrategyExtended) -> None:
        self._extended = extended
        self._scope_depth = 0

    # -- properties -------------------------------------------------------------
    @property
    def extended(self) -> StrategyExtended:
        """A ``StrategyExtended`` with additional methods."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas over which gradients are aggregated."""
        return self._extended._num_replicas_in_sync

    @property
    def cluster_resolver(self) -> Any:
        """The cluster resolver of a multi-worker or TPU strategy; ``None`` otherwise."""
        return getattr(self._extended, "_cluster_resolver", None)

    # -- scope --------------------------------------------------------------------
    def _scope_impl(self) -> Any:
        return _StrategyScope(self)

    def scope(self) -> Any:
        """A context manager that makes this strategy current, in cross-replica context.

        Entering the scope of a different strategy inside it raises
        ``RuntimeError`` ("Mixing different tf.distribute.Strategy objects").
        """
        return self._scope_impl()

    # -- running ------------------------------------------------------------------
    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        options: Any = None,
    ) -> Any:
        """Calls ``fn(*args, **kwargs)`` once on each replica.

        Distributed values in ``args``/``kwargs`` are replaced by each
        replica's component; other values go to every replica as they are.
        The results are regrouped: a leaf that is the very same object on
        every replica comes back as it is, others come back as ``PerReplica``;
        lists, tuples, namedtuples and dicts keep their types.
        """
        if type(args) is not tuple and not isinstance(args, (list, tuple)):
            raise ValueError(
                "Positional args to Strategy.run must be a list or tuple, got "
                f"{type(args).__name__}: {args!r}. Wrap a single argument as args=(x,)."
            )
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"kwargs to Strategy.run must be a dict, got {type(kwargs).__name__}.")
        execution = self._extended._run_execution_cache
        if execution is not None and execution.prepared and kwargs is None and type(args) is tuple:
            # The backend's prepared call of fn (`SupportsPreparedRun`, asked for by
            # `_prepare`): a step whose host work sets its pace pays only for that call.
            try:
                call = execution.prepared.get(fn)
            except TypeError:  # (an unhashable callable: the usual path says what is wrong)
                call = None
            if (
                call is not None
                and execution.group.devices is self._extended._devices
                and _context.directly_in_scope_or_default(self)
                and not _trace.is_tracing()
            ):
                result = call(args)
                if result is not NOT_HANDLED:
                    return result
                execution.prepared.pop(fn, None)  # (another thread may have dropped it)
        cls = type(self)
        plain = _PLAIN_SCOPE.get(cls)
        if plain is None:
            plain = _PLAIN_SCOPE[cls] = (
                cls.scope is Strategy.scope and cls._scope_impl is Strategy._scope_impl
            )
        if not plain:
            with self.scope():
                return self._extended.call_for_each_replica(fn, args, kwargs)
        # `_scope_impl` inlined (run is the per-step path: two generator context managers
        # cost a few microseconds): the same checks, the same mode.
        if _context.has_strategy():
            _context.require_cross_replica_or_default_context(self)
            return self._run_replicas(fn, args, kwargs)
        token = _context.push_cross_replica_mode(self)
        try:
            return self._run_replicas(fn, args, kwargs)
        finally:
            _context.leave_mode(token)

    def _run_replicas(
        self, fn: Callable[..., Any], args: tuple[Any, ...] | list[Any], kwargs: Any
    ) -> Any:
        """``extended.call_for_each_replica`` in the context ``run`` entered (whose check
        that call repeats unless a subclass overrides it)."""
        extended = self._extended
        if type(extended).call_for_each_replica is not StrategyExtended.call_for_each_replica:
            return extended.call_for_each_replica(fn, args, kwargs)
        _check_callable(fn, "fn", "strategy.run(fn, args=(...))")
        args = args if type(args) is tuple else tuple(args)
        return extended._call_for_each_replica(fn, args, {} if kwargs is None else dict(kwargs))

    def experimental_run_v2(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        options: Any = None,
    ) -> Any:
        """Deprecated alias of ``run``."""
        return self.run(fn, args, kwargs, options)

    # -- combining results ----------------------------------------------------------
    def reduce(
        self, reduce_op: ReduceOp | str, value: Any, axis: int | Sequence[int] | None
    ) -> Any:
        """Reduces ``value`` across replicas and returns the result on the host.

        ``axis=None`` reduces across replicas only (all components must have
        the same shape). With an ``axis``, each replica first sums over that
        axis; MEAN then divides by the true number of elements summed, so it
        is exact for partial and empty batches. MEAN of integers is float64.
        Requires cross-replica (or default) context.
        """
        _context.require_cross_replica_or_default_context(self)
        reduce_op = as_reduce_op(reduce_op)
        if _nest.is_plain_leaf(value):
            # A step's loss, reduced every step: what `_reduce_to` gives a plain array
            # (TF's reduce_non_distributed_value: itself, for MEAN, and for SUM with one
            # replica in sync), without its calls, each of which costs on a step's cold
            # caches. (MEAN's partial-batch warning looks at distributed values only.)
            if (
                axis is None
                and _plain_array(value)
                and _plain_reduce(type(self._extended))
                and (reduce_op is ReduceOp.MEAN or len(self._extended._devices) == 1)
            ):
                return value
        elif _nest.is_nested(value):
            return _nest.map_structure(lambda v: self.reduce(reduce_op, v, axis), value)
        if axis is None:
            if reduce_op is ReduceOp.MEAN:  # NaN means of empty batches: PartialBatchWarning
                from polydist._input.input_lib import warn_if_partial_batch_mean

                warn_if_partial_batch_mean(self, value)
            return self._extended._reduce_to(reduce_op, value, _current_device())
        return self._reduce_with_axis(reduce_op, value, axis)

    def _reduce_with_axis(self, reduce_op: ReduceOp, value: Any, axis: int | Sequence[int]) -> Any:
        extended = self._extended
        if isinstance(value, DistributedValues):
            components = _replica_arrays(value)
        else:
            # TF runs the local reduction on every replica: a plain value counts once each.
            value = _variables.read_for_reduce(value)
            components = [convert_to_array(value)] * extended._local_replica_count
        check_summable(reduce_op, components)  # the local reduce_sum is a SUM too
        group = extended._replica_group(len(components))
        # TF sums each component on its replica's device: place host values (NumPy, or
        # run results of a function that returned NumPy) there first, so that the
        # backend's xp.sum gets its own arrays.
        components = extended._place_components(components)
        xp = extended._backend.array_namespace()
        axes = _normalize_axis(axis, components[0])
        # dtype=: NumPy and torch widen int32 sums to int64; TF's reduce_sum keeps int32.
        sums = PerReplica([xp.sum(c, axis=axes, dtype=c.dtype) for c in components])
        with _cross_device_ops.intent(group, reduce_op):  # a MEAN stays MEAN to the workers
            numer = extended._reduce_to(ReduceOp.SUM, sums, _current_device())
            if reduce_op is ReduceOp.SUM:
                return numer
            local = sum(
                int(np.prod([c.shape[a] for a in axes], dtype=np.int64)) for c in components
            )
            denom = extended._count_over_group(local, numer)
        numer = xp.asarray(numer)
        with np.errstate(invalid="ignore", divide="ignore"):  # all empty: NaN, as in TF
            if is_integral(xp, numer.dtype):  # float64, or JAX's widest float without x64
                return xp.asarray(mean_from_sum(xp, numer, denom))
            return xp.asarray(divide_exactly(xp, numer, xp.asarray(denom, dtype=numer.dtype)))

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates the per-replica components of ``value`` along ``axis`` on the host.

        Sizes along ``axis`` may differ (not on TPU). A non-distributed value
        (a host array, or what ``run`` returns with one replica per worker) is
        returned as it is with one worker; with several workers
        (``MultiWorkerMirroredStrategy``) it counts as one component per worker,
        as in TF: the result is every worker's copy, concatenated in worker order
        on every worker (``reduce`` counts it once per worker too). Requires
        cross-replica (or default) context; in replica context use
        ``get_replica_context().all_gather()``. ``IndexedSlices`` (alone or per
        replica) raise ``NotImplementedError``, as in TF.
        """
        _context.require_cross_replica_or_default_context(self, _GATHER_MESSAGE)
        for leaf in _nest.flatten(value)[0]:
            components = leaf.values if isinstance(leaf, DistributedValues) else (leaf,)
            if any(isinstance(c, IndexedSlices) for c in components):
                got = (
                    "an IndexedSlices"
                    if leaf is components[0]
                    else f"a {type(leaf).__name__} of them"
                )
                raise NotImplementedError(
                    f"gather does not support IndexedSlices (TF), got {got}. Combine every "
                    'replica\'s rows with strategy.reduce("SUM", value, axis=None) (it '
                    "concatenates them), or gather dense arrays, such as the values and the "
                    "indices gathered separately."
                )
        return _nest.map_structure(
            lambda v: self._extended._gather_to(v, _current_device(), axis), value
        )

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The components of ``value`` on this worker, one per local replica, as a tuple.

        A nest of distributed values gives one nest per replica; a single
        non-distributed value gives ``(value,)``.
        """
        return self._extended._local_results(value)

    def experimental_distribute_values_from_function(
        self, value_fn: Callable[[ValueContext], Any]
    ) -> Any:
        """Builds a ``PerReplica`` by calling ``value_fn(ValueContext)`` for each replica.

        ``OneDeviceStrategy`` and the default strategy return ``value_fn``'s value
        itself, called once with ``ValueContext()`` (as TF does).
        """
        return self._extended._distribute_values_from_function(value_fn)

    # -- input (implemented in polydist._input.input_lib) ---------------------------------
    def experimental_distribute_dataset(
        self, dataset: Any, options: InputOptions | None = None
    ) -> DistributedDataset:
        """Splits each global batch of ``dataset`` across the replicas (TF's rules).

        ``dataset`` is a ``polydist.data.Dataset`` or any iterable of global
        batches. Iterating the result gives ``PerReplica`` values already on
        the replicas' devices. See ``docs/concepts/input.md``.
        """
        from polydist._input.input_lib import distribute_dataset

        return distribute_dataset(self, dataset, options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Any], options: InputOptions | None = None
    ) -> DistributedDataset:
        """Calls ``dataset_fn(InputContext)`` once per input pipeline; replicas take
        its per-replica batches round-robin, without rebatching."""
        from polydist._input.input_lib import distribute_datasets_from_function

        return distribute_datasets_from_function(self, dataset_fn, options)

    def experimental_distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Any], options: InputOptions | None = None
    ) -> DistributedDataset:
        """Deprecated alias of ``distribute_datasets_from_function``."""
        return self.distribute_datasets_from_function(dataset_fn, options)

    # -- misc -------------------------------------------------------------------------
    def __copy__(self) -> Strategy:
        raise RuntimeError("Must only deepcopy DistributionStrategy.")

    def __deepcopy__(self, memo: dict[int, Any]) -> Strategy:
        result = self.__class__.__new__(self.__class__)
        memo[id(self)] = result
        for k, v in self.__dict__.items():
            setattr(result, k, copy.deepcopy(v, memo))
        return result

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} with {self.num_replicas_in_sync} replica(s) on "
            f"{self._extended._backend_name()}>"
        )


class _StrategyScope(ContextDecorator):
    """``strategy.scope()``: this strategy current, in cross-replica context (inside a
    scope of the same strategy, nothing more). A plain class, not a generator: every
    ``strategy.run`` enters one."""

    __slots__ = ("_pushed", "_strategy")

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy
        self._pushed: list[bool] = []  # per entry (the object may be entered again inside)

    def __enter__(self) -> Strategy:
        strategy = self._strategy
        if _context.has_strategy():
            _context.require_cross_replica_or_default_context(strategy)
            self._pushed.append(False)
        else:
            _context.push_mode(_context._Mode(strategy, None, strategy))
            self._pushed.append(True)
        return strategy

    def __exit__(self, *exc: object) -> None:
        if self._pushed.pop():
            _context.pop_mode()


def _per_replica_args(
    args: tuple[Any, ...], kwargs: dict[str, Any], n: int
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Each replica's ``(args, kwargs)``: `select_replica` of both, with one flatten for
    all replicas; the very same pair for all when nothing in them is distributed."""
    if not kwargs:  # the common step: a few arrays, each already known to be a plain leaf
        for arg in args:
            if not _nest.is_plain_leaf(arg):
                break
        else:
            return [(args, kwargs)] * n
    flat, spec = _nest.flatten((args, kwargs))
    if not any(isinstance(leaf, DistributedValues) for leaf in flat):
        return [(args, kwargs)] * n
    picked = picked_leaves(flat)
    for i in picked:
        check_num_components(flat[i], n, "strategy.run")
    return per_replica_nests(flat, spec, picked, range(n))


#: Per Strategy class: whether it keeps Strategy's scope (`Strategy.run` inlines it).
_PLAIN_SCOPE: dict[type, bool] = {}
#: Per StrategyExtended class: whether its run's devices are ``_devices`` itself.
_PLAIN_RUN_DEVICES: dict[type, bool] = {}


#: Per StrategyExtended class: whether it reduces a value that is not distributed as
#: `StrategyExtended` does (`_plain_reduce`).
_PLAIN_REDUCE: dict[type, bool] = {}
#: Per type: whether its values are arrays that reduce as themselves (`_plain_array`).
_PLAIN_ARRAY: dict[type, bool] = {}


def _plain_reduce(cls: type[StrategyExtended]) -> bool:
    """Whether ``cls`` reduces a non-distributed array as `StrategyExtended` does (none
    of the steps overridden): MEAN, and SUM with one replica in sync, give the array
    itself (TF's ``reduce_non_distributed_value``)."""
    plain = _PLAIN_REDUCE.get(cls)
    if plain is None:
        plain = _inherits(
            cls,
            _PLAIN_REDUCE,
            (
                "_reduce_to",
                "_host_group",
                "_reduce_non_distributed",
                "_to_destinations",
                "_num_replicas_in_sync",
            ),
        )
    return plain


def _inherits(cls: type[StrategyExtended], cache: dict[type, bool], names: tuple[str, ...]) -> bool:
    """Whether ``cls`` overrides none of `StrategyExtended`'s ``names``, recorded in
    ``cache`` (its callers read it there first: they are asked at every run or reduce)."""
    plain = cache[cls] = all(getattr(cls, n) is getattr(StrategyExtended, n) for n in names)
    return plain


def _plain_array(value: Any) -> bool:
    """Whether ``value``'s type is an array type (no variable, no ``IndexedSlices``),
    which `convert_to_array` returns as it is."""
    cls = type(value)
    plain = _PLAIN_ARRAY.get(cls)
    if plain is None:
        plain = _PLAIN_ARRAY[cls] = (
            is_array(value)
            and not isinstance(value, (_variables.Variable, IndexedSlices, DistributedValues))
            and convert_to_array(value) is value
        )
    return plain


#: How often core asks a backend for a replica function's prepared call while it has
#: none (the JAX backend's comes with a plan's lane, at its third call), and how many
#: functions a strategy keeps one for.
_PREPARE_ASKS = 4
_PREPARED_MAX = 64


def _prepare(
    extended: StrategyExtended, execution: _eager.ReplicaExecution, fn: Callable[..., Any]
) -> None:
    """Asks the backend for ``fn``'s prepared call (`SupportsPreparedRun`), for
    strategies whose ``run`` and its parts are the base classes' (their checks are the
    ones a prepared call stands in for)."""
    asked = execution.asked.get(fn, 0)
    if asked >= _PREPARE_ASKS or execution.prepare is None:
        return
    cls, strategy_cls = type(extended), type(extended._container_strategy())
    if not (
        _plain_run_devices(cls)
        and all(
            getattr(cls, n) is getattr(StrategyExtended, n)
            for n in ("call_for_each_replica", "_call_for_each_replica")
        )
        and all(
            getattr(strategy_cls, n) is getattr(Strategy, n)
            for n in ("run", "_run_replicas", "scope", "_scope_impl")
        )
    ):
        execution.asked[fn] = _PREPARE_ASKS
        return
    call = execution.prepare(execution.group, fn)
    if call is None:
        if len(execution.asked) >= _PREPARED_MAX:
            execution.asked.clear()
        execution.asked[fn] = asked + 1
        return
    if len(execution.prepared) >= _PREPARED_MAX:
        execution.prepared.clear()
    execution.prepared[fn] = call


def _plain_run_devices(cls: type[StrategyExtended]) -> bool:
    """Whether ``cls`` runs on ``_devices`` as `StrategyExtended` does (neither
    ``_run_devices`` nor ``worker_devices`` overridden): a cached run execution whose
    group is on those very devices is then current (`StrategyExtended._run_execution`)."""
    plain = _PLAIN_RUN_DEVICES.get(cls)
    if plain is None:
        plain = _inherits(cls, _PLAIN_RUN_DEVICES, ("_run_devices", "worker_devices"))
    return plain


def _check_callable(fn: Any, name: str, usage: str) -> None:
    if not callable(fn):
        raise TypeError(
            f"{name} must be a callable (a function to run on each replica), got "
            f"{type(fn).__name__} {fn!r}. Pass the function itself, as in {usage}."
        )


def _check_reduce_op(reduce_op: Any) -> ReduceOp:
    if type(reduce_op).__name__ == "VariableAggregation":
        raise ValueError(
            f"reduce_op must be a ReduceOp (SUM or MEAN), got VariableAggregation {reduce_op}. "
            "Convert it with ReduceOp.from_variable_aggregation()."
        )
    return as_reduce_op(reduce_op)


def _current_device() -> str:
    return HOST_DEVICE


_destination = _cross_device_ops.destination


def _is_arraylike(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _equals_zero(x: Any) -> bool:
    try:
        return bool(x == 0)
    except (TypeError, ValueError):
        return False


def _check_gather_shapes(components: Sequence[Any], axis: int, *, same_shape: bool) -> None:
    first = components[0]
    rank = len(first.shape)
    axis = axis % rank
    for r, c in enumerate(components[1:], start=1):
        ok = len(c.shape) == rank and str(c.dtype) == str(first.dtype)
        if ok:
            dims = range(rank) if same_shape else (d for d in range(rank) if d != axis)
            ok = all(c.shape[d] == first.shape[d] for d in dims)
        if not ok:
            rule = "all dimensions" if same_shape else f"all dimensions except axis {axis}"
            raise InvalidArgumentError(
                f"Cannot gather: replica 0 has {describe(first)} but replica {r} has "
                f"{describe(c)}; {rule} and the dtype must match."
            )


def _normalize_axis(axis: Any, example: Any) -> tuple[int, ...]:
    rank = len(example.shape)
    if isinstance(axis, bool) or not isinstance(axis, int | tuple | list):
        raise TypeError(f"Expected `axis` to be an integer, tuple or list not: {axis!r}")
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    result = []
    for a in axes:
        if not -rank <= a < rank:
            raise ValueError(f"`axis` = {a!r} out of range for `value` with rank {rank}")
        result.append(a % rank)
    return tuple(result)


def _resolve_devices(backend: Backend, devices: Any) -> tuple[str, ...]:
    if devices is None:
        return tuple(backend.replica_devices(None))
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices < 1:
            raise ValueError(f"MirroredStrategy needs at least one replica, got {devices}.")
        return tuple(backend.replica_devices(devices))
    if isinstance(devices, str):
        raise ValueError(
            f"devices must be a list of device strings, got the string {devices!r}. "
            f"Write devices=[{devices!r}]."
        )
    if isinstance(devices, bool) or not isinstance(devices, Iterable):
        raise TypeError(
            "devices must be a list of device strings (e.g. ['/gpu:0', '/gpu:1']), an int "
            f"number of replicas (e.g. MirroredStrategy(2)) or None, got "
            f"{type(devices).__name__} {devices!r}."
        )
    devices = list(devices)
    if not devices:
        raise ValueError("Must specify at least one device.")
    canonical = tuple(canonicalize(d) for d in devices)
    if len(set(canonical)) != len(canonical):
        raise ValueError(f"No duplicates allowed in `devices` argument: {devices}")
    backend.validate_devices(canonical)
    return canonical
