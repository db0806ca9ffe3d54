"""TF 1's strategy API (``tf.compat.v1.distribute``): ``StrategyV1`` and ``StrategyExtendedV1``.

The v1 classes are the v2 classes plus the members TF 2 removed, so both
share one implementation: ``MirroredStrategyV1`` *is* a
`polydist.MirroredStrategy` whose ``extended`` is a ``MirroredExtendedV1``
(a ``MirroredExtended`` with the v1-only members). ``polydist.compat.v1``
exports them under TF's names; the tower-era ``polydist.contrib.distribute``
builds on them too.

What differs from TF, all because polydist has no graphs and no sessions:

* Everything runs when it is called, as in TF's eager mode.
  ``InputIterator.initialize()`` restarts the iterator and returns ``[]``
  (TF eager: it re-creates the iterator and returns no ops), and
  ``MultiStepContext.run_op`` is ``None`` (TF eager: ``tf.group`` gives
  ``None``): ``experimental_run_steps_on_iterator`` has already run the steps.
* A ``ConfigProto`` is a dict: ``update_config_proto`` takes a mapping of
  ``ConfigProto`` fields (nested messages as nested dicts, enums by name) and
  returns an updated deep copy, setting what TF's strategy sets.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from polydist._base.communication import (
    CommunicationImplementation,
    CommunicationOptions,
)
from polydist._base.reduce_op import ReduceOp
from polydist._distributed.cluster import normalize_cluster_spec
from polydist._distributed.multi_worker import MultiWorkerExtended, MultiWorkerMirroredStrategy
from polydist._distributed.tpu_strategy import TPUExtended, TPUStrategy
from polydist._input.input_lib import DistributedDataset, DistributedIterator, make_numpy_dataset
from polydist._strategies import context as _context
from polydist._strategies.mirrored import (
    MirroredExtended,
    MirroredStrategy,
    OneDeviceExtended,
    OneDeviceStrategy,
)
from polydist._strategies.strategy import Strategy, StrategyExtended, _check_reduce_op
from polydist._valuetypes import nest as _nest
from polydist.backend._contract import Backend, is_symbolic
from polydist.cluster_resolver import ClusterResolver, ClusterSpec, TPUClusterResolver
from polydist.data import Dataset, InputContext, InputReplicationMode

if TYPE_CHECKING:
    from polydist.tpu import DeviceAssignment

__all__ = [
    "CollectiveAllReduceStrategyV1",
    "InputIterator",
    "MirroredExtendedV1",
    "MirroredStrategyV1",
    "MultiStepContext",
    "MultiWorkerExtendedV1",
    "OneDeviceExtendedV1",
    "OneDeviceStrategyV1",
    "StrategyExtendedV1",
    "StrategyV1",
    "TPUExtendedV1",
    "TPUStrategyV1",
]


# --------------------------------------------------------------------------- input iterators


class InputIterator:
    """The iterator of ``make_dataset_iterator`` / ``make_input_fn_iterator`` (TF's
    ``DistributedIteratorV1``).

    ``get_next()`` gives the next step's value (a ``PerReplica`` per
    component, like iterating a distributed dataset); at the end of the data
    it raises ``OutOfRangeError``. ``initialize()`` starts it over from the
    first step and returns ``[]``: there are no initializer ops to run.
    """

    def __init__(self, dataset: DistributedDataset) -> None:
        self._dataset = dataset
        self._iterator: DistributedIterator = iter(dataset)

    def initialize(self) -> list[Any]:
        """Restarts the iterator at the first step; returns ``[]`` (no ops to run).

        TF graph mode returns the iterator's initializer ops; TF eager
        re-creates the iterator and returns ``[]``, as here.
        """
        self._iterator = iter(self._dataset)
        return []

    @property
    def initializer(self) -> list[Any]:
        """``initialize()`` (as in TF, reading it restarts the iterator)."""
        return self.initialize()

    def get_next(self) -> Any:
        """The next step's value; ``polydist.errors.OutOfRangeError`` at the end."""
        return self._iterator.get_next()

    def get_next_as_optional(self) -> Any:
        """The next step's value as an ``Optional``, empty at the end of the data."""
        return self._iterator.get_next_as_optional()

    @property
    def element_spec(self) -> Any:
        """The spec of one step's value (see ``DistributedDataset.element_spec``)."""
        return self._iterator.element_spec

    def __iter__(self) -> Iterator[Any]:
        return self._iterator

    def __next__(self) -> Any:
        return next(self._iterator)

    def __repr__(self) -> str:
        return f"<InputIterator over {self._dataset!r}>"


# --------------------------------------------------------------------------- multi-step loops


class MultiStepContext:
    """What ``extended.experimental_run_steps_on_iterator`` passes to ``fn`` and returns.

    ``fn(context, inputs)`` records outputs with ``set_last_step_output`` and
    ``set_non_tensor_output``; after the loop, ``last_step_outputs`` and
    ``non_tensor_outputs`` hold those of the last step. ``run_op`` is
    ``None``: the steps have already run (TF eager gives ``None`` too).
    """

    def __init__(self) -> None:
        self._last_step_outputs: dict[str, Any] = {}
        self._last_step_outputs_reduce_ops: dict[str, Any] = {}
        self._non_tensor_outputs: dict[str, Any] = {}
        #: TF graph mode: the op running the loop. Here the loop has run: ``None``.
        self.run_op: Any = None
        #: The ``initial_loop_values`` the loop was given (unused: there is no
        #: graph loop to thread them through).
        self.initial_loop_values: Any = None

    @property
    def last_step_outputs(self) -> dict[str, Any]:
        """The outputs set with ``set_last_step_output``, by name (the last step's)."""
        return self._last_step_outputs

    def _set_last_step_outputs(self, outputs: dict[str, Any]) -> None:
        if not isinstance(outputs, dict):
            raise ValueError(
                f"Need a dictionary to set last_step_outputs, got {type(outputs).__name__}."
            )
        self._last_step_outputs = outputs

    def set_last_step_output(self, name: str, output: Any, reduce_op: Any = None) -> None:
        """Records ``output`` under ``name`` as an output of the last step.

        With ``reduce_op`` (``ReduceOp.SUM``/``MEAN``), the replicas' values
        are reduced across replicas with the current strategy (TF:
        ``strategy.reduce(reduce_op, output, axis=None)``). In replica context
        (inside ``call_for_each_replica``) ``reduce_op`` is required, and every
        replica must call this (it is a ``merge_call``); where the backend
        compiles the replica function (JAX), ``ValueError``: record the result
        of ``call_for_each_replica`` in cross-replica context instead.
        """
        if _context.in_cross_replica_context():
            self._last_step_outputs_reduce_ops[name] = reduce_op
            if reduce_op is None:
                self._last_step_outputs[name] = output
            else:
                strategy = _context.get_strategy()
                self._last_step_outputs[name] = self._reduce(strategy, reduce_op, output)
            return
        replica_ctx = _context.get_replica_context()
        assert replica_ctx is not None
        if reduce_op is None:
            raise ValueError(
                f"set_last_step_output({name!r}, ...) was called in replica context without a "
                "reduction: pass reduce_op (ReduceOp.SUM or ReduceOp.MEAN) to combine the "
                "replicas' values, or call it in cross-replica context with the PerReplica "
                "result of call_for_each_replica."
            )

        def merge_fn(strategy: Strategy, value: Any) -> None:
            # Set once in merge_fn: every replica shares this context object.
            reduced = self._reduce(strategy, reduce_op, value)
            _check_concrete(strategy, reduced, f"set_last_step_output({name!r}, ...)")
            self._last_step_outputs[name] = reduced
            self._last_step_outputs_reduce_ops[name] = reduce_op

        replica_ctx.merge_call(merge_fn, args=(output,))

    @property
    def non_tensor_outputs(self) -> dict[str, Any]:
        """The values set with ``set_non_tensor_output``, by name."""
        return self._non_tensor_outputs

    def set_non_tensor_output(self, name: str, output: Any) -> None:
        """Records any Python value under ``name``; in replica context, the replicas'
        values are kept as a sequence, one per replica (they are not reduced)."""
        if _context.in_cross_replica_context():
            self._non_tensor_outputs[name] = output
            return
        replica_ctx = _context.get_replica_context()
        assert replica_ctx is not None  # not cross-replica: a replica (or the default) context

        def merge_fn(strategy: Strategy, value: Any) -> None:
            results = self._local_results(strategy, value)
            _check_concrete(strategy, results, f"set_non_tensor_output({name!r}, ...)")
            self._non_tensor_outputs[name] = results

        replica_ctx.merge_call(merge_fn, args=(output,))

    # Overridden by the tower-era context (aggregations, lists).
    def _reduce(self, strategy: Strategy, reduce_op: Any, value: Any) -> Any:
        op = _check_reduce_op(reduce_op)
        # Leaf by leaf through the v2 reduce: a subclass's reduce may take other arguments.
        return _nest.map_structure(lambda v: Strategy.reduce(strategy, op, v, None), value)

    def _local_results(self, strategy: Strategy, value: Any) -> Any:
        return strategy.experimental_local_results(value)

    def __repr__(self) -> str:
        return (
            f"MultiStepContext(last_step_outputs={sorted(self._last_step_outputs)}, "
            f"non_tensor_outputs={sorted(self._non_tensor_outputs)})"
        )


def _check_concrete(strategy: Strategy, value: Any, call: str) -> None:
    """Raises if ``value`` belongs to a program being compiled (a JAX tracer).

    ``merge_fn`` of a compiled replica function runs once, at trace time: what it
    stores in the context would be a tracer, unusable after ``run``, and a cached
    program would not call it again on later steps.
    """
    backend = strategy.extended._backend
    if not any(is_symbolic(backend, leaf) for leaf in _nest.flatten(value)[0]):
        return
    raise ValueError(
        f"MultiStepContext.{call} was called inside a replica function that backend "
        f"{backend.name!r} compiles: the value would be a traced placeholder, not the "
        "step's result. Return the value from the replica function and record it in "
        "cross-replica context instead (out = strategy.extended.call_for_each_replica(...); "
        "context.set_last_step_output(name, out, reduce_op)), or run the backend eagerly "
        "(e.g. JaxBackend(jit=False))."
    )


def run_steps(
    strategy: Strategy,
    fn: Callable[..., Any],
    iterator: Any,
    iterations: int,
    initial_loop_values: Any,
    ctx: MultiStepContext,
    *,
    unpack_inputs: bool,
) -> MultiStepContext:
    """Calls ``fn(ctx, inputs)`` ``iterations`` times with ``inputs = iterator.get_next()``.

    ``fn`` runs in cross-replica context (inside the strategy's scope) and
    typically calls ``call_for_each_replica`` with the inputs. With
    ``unpack_inputs`` (the tower-era API) a tuple of inputs is passed as
    separate arguments: ``fn(ctx, *inputs)``.
    """
    _context.require_cross_replica_or_default_context(strategy)
    if not callable(fn):
        raise TypeError(
            f"fn must be a function fn(context, inputs), got {type(fn).__name__} {fn!r}."
        )
    get_next = getattr(iterator, "get_next", None)
    if not callable(get_next):
        raise TypeError(
            "iterator must have a get_next() method (make one with "
            "strategy.make_dataset_iterator(dataset)), got "
            f"{type(iterator).__name__} {iterator!r}."
        )
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
        raise ValueError(
            f"iterations must be an int >= 0 (the number of steps to run), got {iterations!r}."
        )
    ctx.initial_loop_values = initial_loop_values
    with strategy.scope():
        for _ in range(iterations):
            inputs = get_next()
            if unpack_inputs and isinstance(inputs, tuple):
                fn(ctx, *inputs)
            else:
                fn(ctx, inputs)
    return ctx


# --------------------------------------------------------------------------- session configs


def copy_config(config_proto: Any) -> MutableMapping[str, Any]:
    """A deep copy of a dict-like ``ConfigProto``; ``TypeError`` for anything else."""
    if isinstance(config_proto, MutableMapping):
        return copy.deepcopy(config_proto)
    if isinstance(config_proto, Mapping):
        return copy.deepcopy(dict(config_proto))
    raise TypeError(
        "polydist has no TF sessions, so a session config is a dict of ConfigProto fields "
        "(nested messages as dicts, e.g. {'allow_soft_placement': True, 'graph_options': "
        f"{{...}}}}); got {type(config_proto).__name__} {config_proto!r}. Convert a ConfigProto "
        "with google.protobuf.json_format.MessageToDict(config, "
        "preserving_proto_field_name=True)."
    )


def _section(config: MutableMapping[str, Any], *path: str) -> MutableMapping[str, Any]:
    """The nested message at ``path``, created empty where missing."""
    node = config
    for i, key in enumerate(path):
        child = node.setdefault(key, {})
        if not isinstance(child, MutableMapping):
            raise TypeError(
                f"config[{']['.join(repr(k) for k in path[: i + 1])}] must be a dict (a "
                f"ConfigProto message), got {type(child).__name__} {child!r}."
            )
        node = child
    return node


def _update_in_place(session_config: Any, updated: Mapping[str, Any]) -> None:
    # TF's session_config.CopyFrom(updated): the caller's object changes.
    if not isinstance(session_config, MutableMapping):
        raise TypeError(
            "configure(session_config=...) updates the config in place, so it must be a "
            f"mutable dict of ConfigProto fields; got {type(session_config).__name__}."
        )
    session_config.clear()
    session_config.update(updated)


def cluster_def(spec: ClusterSpec) -> dict[str, Any]:
    """``ClusterSpec.as_cluster_def()`` as a dict: ``{"job": [{"name", "tasks"}]}``."""
    return {
        "job": [
            {"name": job, "tasks": {i: spec.task_address(job, i) for i in spec.task_indices(job)}}
            for job in spec.jobs
        ]
    }


def _collective_leader(spec: ClusterSpec, task_type: str | None) -> str:
    """TF's ``multi_worker_util.collective_leader``."""
    if task_type == "evaluator":
        return ""  # the only evaluator needs no leader
    if "chief" in spec.jobs:
        return "/job:chief/replica:0/task:0"
    return "/job:worker/replica:0/task:0"


# --------------------------------------------------------------------------- StrategyExtendedV1


class StrategyExtendedV1(StrategyExtended):
    """``tf.compat.v1.distribute.StrategyExtended``: `polydist.StrategyExtended` plus the
    members TF 2 removed (``experimental_make_numpy_dataset``,
    ``experimental_run_steps_on_iterator``, ``steps_per_run``)."""

    steps_per_run: int | None = 1
    """Steps run on the device per call (a ``TPUStrategy`` v1 argument in TF, where only
    TPU has it); the other v1 strategies run one step per call: 1."""

    def experimental_make_numpy_dataset(self, numpy_input: Any, session: Any = None) -> Dataset:
        """A ``polydist.data.Dataset`` of the slices of ``numpy_input`` (a nest of arrays).

        ``session`` (TF graph mode) is accepted and unused. Batch the result
        and distribute it with ``experimental_distribute_dataset``.
        """
        _context.require_cross_replica_or_default_context(self._container_strategy())
        return make_numpy_dataset(numpy_input, session)

    def experimental_run_steps_on_iterator(
        self,
        fn: Callable[..., Any],
        iterator: Any,
        iterations: int = 1,
        initial_loop_values: Any = None,
    ) -> MultiStepContext:
        """Calls ``fn(context, iterator.get_next())`` ``iterations`` times; returns ``context``.

        ``context`` is a `MultiStepContext`: ``fn`` records outputs with
        ``context.set_last_step_output(name, value, reduce_op=None)`` and
        ``context.set_non_tensor_output(name, value)``, read afterwards from
        ``context.last_step_outputs`` / ``non_tensor_outputs``. ``fn`` runs in
        cross-replica context and typically calls ``call_for_each_replica``.
        The steps run before this returns; ``context.run_op`` is ``None``.
        """
        return run_steps(
            self._container_strategy(),
            fn,
            iterator,
            iterations,
            initial_loop_values,
            MultiStepContext(),
            unpack_inputs=False,
        )

    def _update_config_proto(self, config_proto: Any) -> MutableMapping[str, Any]:
        return copy_config(config_proto)  # TF's default: an unchanged copy

    def _configure(
        self,
        session_config: Any = None,
        cluster_spec: Any = None,
        task_type: str | None = None,
        task_id: int | None = None,
    ) -> None:
        del cluster_spec, task_type, task_id  # TF's default ignores them all
        if session_config is not None:
            _update_in_place(session_config, self._update_config_proto(session_config))


class MirroredExtendedV1(StrategyExtendedV1, MirroredExtended):
    """``StrategyExtended`` of the v1 ``MirroredStrategy``."""

    def _update_config_proto(self, config_proto: Any) -> MutableMapping[str, Any]:
        updated = copy_config(config_proto)
        updated["isolate_session_state"] = True  # as TF's MirroredExtended
        return updated

    def _configure(
        self,
        session_config: Any = None,
        cluster_spec: Any = None,
        task_type: str | None = None,
        task_id: int | None = None,
    ) -> None:
        if cluster_spec:
            raise NotImplementedError(
                "configure(cluster_spec=...) turns TF 1's MirroredStrategy into in-graph "
                f"multi-worker replication over {cluster_spec!r}, which polydist does not "
                "implement. Use polydist.compat.v1.distribute.experimental."
                "MultiWorkerMirroredStrategy (or polydist.MultiWorkerMirroredStrategy) with a "
                "cluster resolver instead."
            )
        super()._configure(session_config, None, task_type, task_id)


class OneDeviceExtendedV1(StrategyExtendedV1, OneDeviceExtended):
    """``StrategyExtended`` of the v1 ``OneDeviceStrategy``."""


class TPUExtendedV1(StrategyExtendedV1, TPUExtended):
    """``StrategyExtended`` of the v1 ``TPUStrategy`` (``steps_per_run`` is set).

    ``num_cores`` (the tower-era ``TPUStrategy`` argument) runs replicas on the
    first ``num_cores`` TPU cores only.
    """

    def __init__(
        self,
        container_strategy: Strategy,
        tpu_cluster_resolver: TPUClusterResolver | None = None,
        steps_per_run: int | None = None,
        device_assignment: DeviceAssignment | None = None,
        *,
        num_cores: int | None = None,
        backend: str | Backend | None = None,
    ) -> None:
        steps = 1 if steps_per_run is None else steps_per_run  # TF's default
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(
                f"steps_per_run must be an int >= 1 (steps run on the TPU per call), got "
                f"{steps_per_run!r}."
            )
        super().__init__(
            container_strategy, tpu_cluster_resolver, steps, device_assignment, backend=backend
        )
        if num_cores is not None:
            self._use_first_cores(num_cores)

    def _use_first_cores(self, num_cores: int) -> None:
        available = len(self._tpu_devices)
        if isinstance(num_cores, bool) or not isinstance(num_cores, int):
            raise TypeError(f"num_cores must be an int or None, got {num_cores!r}.")
        if not 1 <= num_cores <= available:
            raise ValueError(
                f"num_cores={num_cores} but the slice has {available} TPU cores: pass 1.."
                f"{available}, or None to use them all."
            )
        # TF: "Only create variables for the number of replicas we're running."
        self._tpu_devices = self._tpu_devices[:num_cores]
        self._devices = self._devices[:num_cores]

    def _update_config_proto(self, config_proto: Any) -> MutableMapping[str, Any]:
        updated = copy_config(config_proto)
        updated["isolate_session_state"] = True
        spec = self._tpu_cluster_resolver.cluster_spec()
        if spec:
            updated["cluster_def"] = cluster_def(spec)
        return updated


class MultiWorkerExtendedV1(StrategyExtendedV1, MultiWorkerExtended):
    """``StrategyExtended`` of the v1 ``MultiWorkerMirroredStrategy`` (TF's
    ``CollectiveAllReduceExtended``)."""

    def _update_config_proto(self, config_proto: Any) -> MutableMapping[str, Any]:
        updated = copy_config(config_proto)
        # TF turns on the scoped allocator for CollectiveReduce (fewer, larger all-reduces).
        rewrite = _section(updated, "graph_options", "rewrite_options")
        rewrite["scoped_allocator_optimization"] = "ON"
        _section(rewrite, "scoped_allocator_opts")["enable_op"] = ["CollectiveReduce"]
        if self._communication_options.implementation is CommunicationImplementation.NCCL:
            _section(updated, "experimental")["collective_nccl"] = True  # graph mode, as v1
        spec = self._cluster_spec
        if not spec:
            return updated
        _section(updated, "experimental")["collective_group_leader"] = _collective_leader(
            spec, self._task_type
        )
        # The device filters keep this worker from talking to the others' devices.
        updated["device_filters"] = [f"/job:{self._task_type}/task:{self._task_id}"]
        return updated

    def _configure(
        self,
        session_config: Any = None,
        cluster_spec: Any = None,
        task_type: str | None = None,
        task_id: int | None = None,
    ) -> None:
        if cluster_spec:
            same = (
                self._cluster_spec is not None
                and normalize_cluster_spec(cluster_spec) == self._cluster_spec
                and (task_type, task_id) == (self._task_type, self._task_id)
            )
            if not same:
                raise NotImplementedError(
                    f"configure(cluster_spec={cluster_spec!r}, task_type={task_type!r}, "
                    f"task_id={task_id!r}) would move this strategy to another cluster or "
                    "task, which polydist does not do after construction. Pass the cluster "
                    "when creating the strategy: cluster_resolver=TFConfigClusterResolver() "
                    "(TF_CONFIG) or another polydist.cluster_resolver.ClusterResolver."
                )
        super()._configure(session_config, None, task_type, task_id)


# --------------------------------------------------------------------------- StrategyV1


def group(strategy: Strategy, value: Any, name: str | None = None) -> Any:
    """TF's ``_group``: with one local value and no name, that value; else ``tf.group``
    of them, which in eager mode (and here: there are no ops) is ``None``."""
    flat, _ = _nest.flatten(list(strategy.experimental_local_results(value)))
    if len(flat) != 1 or name is not None:
        return None
    return flat[0]


class StrategyV1(Strategy):
    """``tf.compat.v1.distribute.Strategy``: `polydist.Strategy` plus TF 1's members.

    ``reduce``'s ``axis`` defaults to ``None``; ``make_dataset_iterator`` /
    ``make_input_fn_iterator`` return an `InputIterator`; ``experimental_run``
    feeds one ``get_next()`` of it to ``run``; ``update_config_proto`` updates
    a dict-like session config.
    """

    @property
    def extended(self) -> StrategyExtendedV1:
        """A `StrategyExtendedV1` with additional methods."""
        return cast(StrategyExtendedV1, self._extended)

    @property
    def steps_per_run(self) -> int | None:
        """DEPRECATED: use ``.extended.steps_per_run`` instead."""
        return self.extended.steps_per_run

    def make_dataset_iterator(self, dataset: Any) -> InputIterator:
        """An `InputIterator` splitting each global batch of ``dataset`` across the replicas.

        The split follows ``experimental_distribute_dataset``. Pass the
        iterator to ``experimental_run``, or call ``get_next()`` and pass the
        value to ``extended.call_for_each_replica``.
        """
        with self.scope():
            return InputIterator(self.experimental_distribute_dataset(dataset))

    def make_input_fn_iterator(
        self,
        input_fn: Callable[[InputContext], Any],
        replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER,
    ) -> InputIterator:
        """An `InputIterator` over ``input_fn(InputContext)``, called once per worker.

        ``input_fn`` returns a dataset of *per-replica* batches (size them with
        ``input_context.get_per_replica_batch_size(global_batch_size)``); each
        replica of the worker takes the next batch in turn. Only
        ``InputReplicationMode.PER_WORKER`` is supported, as in TF.
        """
        if replication_mode != InputReplicationMode.PER_WORKER:
            raise ValueError(
                f"Input replication mode not supported: {replication_mode!r}. "
                "make_input_fn_iterator supports InputReplicationMode.PER_WORKER only."
            )
        with self.scope():
            return InputIterator(self.distribute_datasets_from_function(input_fn))

    def experimental_make_numpy_dataset(self, numpy_input: Any, session: Any = None) -> Dataset:
        """A ``polydist.data.Dataset`` of the slices of ``numpy_input``; ``session`` is unused.

        Example (TF's)::

            numpy_input = np.ones([10], dtype=np.float32)
            dataset = strategy.experimental_make_numpy_dataset(numpy_input)
            dist_dataset = strategy.experimental_distribute_dataset(dataset.batch(2))
        """
        return self.extended.experimental_make_numpy_dataset(numpy_input, session=session)

    def experimental_run(self, fn: Callable[..., Any], input_iterator: Any = None) -> Any:
        """Runs ``fn`` on each replica with the next step's inputs from ``input_iterator``.

        ``fn(inputs)`` gets its replica's component of
        ``input_iterator.get_next()``; without an iterator, ``fn()``. Returns
        the regrouped results, as ``run``.
        """
        with self.scope():
            args = (input_iterator.get_next(),) if input_iterator is not None else ()
        return self.run(fn, args=args)

    def reduce(
        self, reduce_op: ReduceOp | str, value: Any, axis: int | Sequence[int] | None = None
    ) -> Any:
        """``polydist.Strategy.reduce`` with ``axis=None`` by default (TF 1)."""
        return super().reduce(reduce_op, value, axis)

    def update_config_proto(self, config_proto: Any) -> MutableMapping[str, Any]:
        """A copy of the dict-like session config ``config_proto``, updated for this strategy.

        What is set follows TF: ``MirroredStrategy`` and ``TPUStrategy`` set
        ``isolate_session_state``; ``TPUStrategy`` also sets ``cluster_def``
        for a remote slice; ``MultiWorkerMirroredStrategy`` turns on the scoped
        allocator for ``CollectiveReduce`` and, in a cluster, sets the
        collective group leader and ``device_filters``. ``OneDeviceStrategy``
        returns an unchanged copy.
        """
        return self.extended._update_config_proto(config_proto)

    def configure(
        self,
        session_config: Any = None,
        cluster_spec: Any = None,
        task_type: str | None = None,
        task_id: int | None = None,
    ) -> None:
        """Updates the dict-like ``session_config`` in place, as ``update_config_proto``.

        A ``cluster_spec`` other than the strategy's own raises
        ``NotImplementedError`` (TPUStrategy ignores it, as TF does).
        """
        self.extended._configure(session_config, cluster_spec, task_type, task_id)

    def unwrap(self, value: Any) -> tuple[Any, ...]:
        """DEPRECATED: ``experimental_local_results``."""
        return self.experimental_local_results(value)

    def colocate_vars_with(self, colocate_with_variable: Any) -> Any:
        """DEPRECATED: ``extended.colocate_vars_with``."""
        return self.extended.colocate_vars_with(colocate_with_variable)

    def group(self, value: Any, name: str | None = None) -> Any:
        """DEPRECATED: ``tf.group(experimental_local_results(value))``.

        There are no ops to group: this returns the only local value when
        there is exactly one (and no ``name``), else ``None`` (TF eager).
        """
        return group(self, value, name)


class MirroredStrategyV1(StrategyV1, MirroredStrategy):
    """``tf.compat.v1.distribute.MirroredStrategy(devices=None, cross_device_ops=None)``.

    A `polydist.MirroredStrategy` with the v1 API (see `StrategyV1`).
    """

    _extended_class = MirroredExtendedV1

    @property
    def extended(self) -> MirroredExtendedV1:
        """A `MirroredExtendedV1`."""
        return cast(MirroredExtendedV1, self._extended)


class OneDeviceStrategyV1(StrategyV1, OneDeviceStrategy):
    """``tf.compat.v1.distribute.OneDeviceStrategy(device)``: a `polydist.OneDeviceStrategy`
    with the v1 API (see `StrategyV1`)."""

    _extended_class = OneDeviceExtendedV1

    @property
    def extended(self) -> OneDeviceExtendedV1:
        """A `OneDeviceExtendedV1`."""
        return cast(OneDeviceExtendedV1, self._extended)


class TPUStrategyV1(StrategyV1, TPUStrategy):
    """``tf.compat.v1.distribute.experimental.TPUStrategy`` on a simulated TPU slice.

    A `polydist.TPUStrategy` with the v1 API (see `StrategyV1`).

    Args:
        tpu_cluster_resolver: a `polydist.cluster_resolver.TPUClusterResolver`
            (default as `polydist.TPUStrategy`).
        steps_per_run: steps run on the TPU per call (used by Keras/Estimator
            loops; default 1, as TF). Read it as ``extended.steps_per_run``.
        device_assignment: a `polydist.tpu.DeviceAssignment` placing the replicas.
        backend: a backend that declares ``Capabilities.tpu`` (default ``sim``).
    """

    def __init__(
        self,
        tpu_cluster_resolver: TPUClusterResolver | None = None,
        steps_per_run: int | None = None,
        device_assignment: DeviceAssignment | None = None,
        *,
        backend: str | Backend | None = None,
    ) -> None:
        # Strategy.__init__, not TPUStrategy's: that one builds the v2 TPUExtended.
        Strategy.__init__(
            self,
            TPUExtendedV1(
                self, tpu_cluster_resolver, steps_per_run, device_assignment, backend=backend
            ),
        )

    @property
    def extended(self) -> TPUExtendedV1:
        """A `TPUExtendedV1`."""
        return cast(TPUExtendedV1, self._extended)


class CollectiveAllReduceStrategyV1(StrategyV1, MultiWorkerMirroredStrategy):
    """``tf.compat.v1.distribute.experimental.MultiWorkerMirroredStrategy``.

    A `polydist.MultiWorkerMirroredStrategy` with the v1 API (see `StrategyV1`)
    and TF 1's arguments: the collective implementation first, then the
    cluster resolver (default: ``TF_CONFIG``).
    """

    _extended_class = MultiWorkerExtendedV1

    def __init__(
        self,
        communication: CommunicationImplementation | str = CommunicationImplementation.AUTO,
        cluster_resolver: ClusterResolver | None = None,
        *,
        backend: str | Backend | None = None,
    ) -> None:
        options = CommunicationOptions(implementation=communication)
        super().__init__(cluster_resolver, options, backend=backend)

    @property
    def extended(self) -> MultiWorkerExtendedV1:
        """A `MultiWorkerExtendedV1`."""
        return cast(MultiWorkerExtendedV1, self._extended)
