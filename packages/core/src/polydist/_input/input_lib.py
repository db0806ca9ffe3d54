"""Distributed input: ``experimental_distribute_dataset`` and ``distribute_datasets_from_function``.

The split rules themselves (rebatching, auto-sharding, round-robin dequeue,
empty batches) live in ``polydist.data._rebatch``; this module wires them into
the strategies and turns each step's per-replica batches into values placed
on the replicas' devices (TF's ``input_lib`` / ``input_util``).

What it reads from ``strategy.extended``, with ``getattr`` and defaults, so
that any strategy class can take part (``MultiWorkerExtended`` sets them all):

* ``worker_devices``: this worker's replica devices, in replica order.
* ``_num_workers`` (default 1) and ``_worker_index`` (default 0): W, the
  workers (input pipelines), and this process's worker.
* ``_num_devices_per_worker`` (default ``len(worker_devices)``): R_w.
* ``_simulated_workers`` (default ``(_worker_index,)``): the workers whose
  replicas this process runs, in order: ``range(W)`` on the sim, which runs
  the whole cluster in one process. Each value then has one component per
  replica of these workers, worker-major, like the ``PerReplica`` that
  ``strategy.run`` takes and returns: the global view on the sim, this
  worker's replicas on an engine with one process per worker.
* ``_worker_devices_by_worker`` (needed only when several workers run here):
  every worker's devices, by worker index.

Lacking a cross-worker channel to agree on "has any worker still got data?"
(TF all-reduces that flag), every worker's pipeline is built and read here,
in lockstep, to decide when to hand out empty batches and when to stop. That
is exact when the pipelines are deterministic.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, NamedTuple, cast

import numpy as np
import optree

from polydist._base import context as _context
from polydist._base.arrays import is_floating
from polydist._base.devices import HOST_DEVICE, DeviceSpec
from polydist._valuetypes.values import DistributedValues, PerReplica
from polydist.backend._contract import SupportsPlacedDtype, SupportsPlacePerReplica, features
from polydist.data import _iterator, _sources
from polydist.data._dataset import INFINITE_CARDINALITY, Dataset
from polydist.data._elements import _SpecInferenceError
from polydist.data._input import (
    InputContext,
    InputOptions,
    InputReplicationMode,
)
from polydist.data._nest import Nest, map_structure
from polydist.data._options import AutoShardPolicy
from polydist.data._rebatch import (
    legacy_rebatch_slices,
    per_replica_batches_from_datasets,
    rebatch_and_shard,
)
from polydist.data._sources import _IterableDataset, as_dataset
from polydist.data._spec import TensorSpec
from polydist.errors import OutOfRangeError

if TYPE_CHECKING:
    from polydist._base.context import Strategy
    from polydist.backend._contract import Backend
from polydist._input.sources import (
    _Calls,
    _check_batched,
    _check_generator_function,
    _check_options,
    _Collated,
    _collated,
    _legacy_split_input,
)
from polydist._input.specs import (
    _END,
    Optional,
    PartialBatchWarning,
    PerReplicaSpec,
)

__all__ = [
    "DistributedDataset",
    "DistributedIterator",
    "Optional",
    "PartialBatchWarning",
    "PerReplicaSpec",
    "distribute_dataset",
    "distribute_datasets_from_function",
    "make_numpy_dataset",
    "warn_if_partial_batch_mean",
]


_NEXT_IN_REPLICA_MESSAGE = (
    "next(iterator) should be called from outside of replica_fn. e.g. "
    "strategy.run(replica_fn, args=(next(iterator),))"
)

# tf.data transformations, for a helpful error when one is applied to a
# distributed dataset (TF's DistributedDataset has none of them).
_TRANSFORMATIONS: Final = frozenset(
    {
        "apply",
        "as_numpy_iterator",
        "batch",
        "cache",
        "concatenate",
        "enumerate",
        "filter",
        "flat_map",
        "interleave",
        "map",
        "padded_batch",
        "prefetch",
        "rebatch",
        "repeat",
        "shard",
        "shuffle",
        "skip",
        "take",
        "unbatch",
        "with_options",
        "zip",
    }
)


# ------------------------------------------------------------------- element specs


# --------------------------------------------------------------------- Optional


# ------------------------------------------------------------ strategy layout


class _Layout(NamedTuple):
    """Who reads what: the workers, and the replicas this process yields values for."""

    num_workers: int
    worker_index: int
    replicas_per_worker: int
    workers_here: tuple[int, ...]  # workers whose replicas this process runs, in order
    devices: tuple[str, ...]  # one per replica of workers_here, worker-major
    backend: Backend
    always_wrap: bool

    @property
    def num_replicas(self) -> int:
        return self.num_workers * self.replicas_per_worker


def _is_default_strategy(strategy: Strategy) -> bool:
    return _context.is_default_strategy(strategy)


def _layout(strategy: Strategy) -> _Layout:
    extended = strategy.extended
    backend = extended._backend
    if _is_default_strategy(strategy):
        return _Layout(1, 0, 1, (0,), (HOST_DEVICE,), backend, False)
    name = type(strategy).__name__
    local = tuple(extended.worker_devices)
    num_workers = int(getattr(extended, "_num_workers", 1))
    worker_index = int(getattr(extended, "_worker_index", 0))
    per_worker = int(getattr(extended, "_num_devices_per_worker", len(local)))
    here = tuple(int(w) for w in getattr(extended, "_simulated_workers", (worker_index,)))
    if num_workers < 1 or not 0 <= worker_index < num_workers or per_worker != len(local):
        raise ValueError(
            f"{name} reports worker {worker_index} of {num_workers} with {per_worker} devices "
            f"per worker, but its worker_devices are {local}; expected 0 <= _worker_index < "
            "_num_workers and _num_devices_per_worker == len(worker_devices)."
        )
    if not here or any(not 0 <= w < num_workers for w in here):
        raise ValueError(
            f"{name}.extended._simulated_workers is {here}: expected worker indices in "
            f"[0, {num_workers})."
        )
    if here == (worker_index,):
        devices = local
    else:
        by_worker = getattr(extended, "_worker_devices_by_worker", None)
        if by_worker is None:
            raise ValueError(
                f"{name} runs workers {here} in this process but has no "
                "extended._worker_devices_by_worker to say where their replicas are."
            )
        devices = tuple(d for w in here for d in by_worker[w])
    # TF's _always_wrap: a single replica of a single worker gets plain values.
    always_wrap = num_workers > 1 or len(devices) > 1
    return _Layout(num_workers, worker_index, per_worker, here, devices, backend, always_wrap)


_Placer = Callable[[Sequence[Any], Sequence[str]], list[Any]]


def _per_replica_placer(backend: Backend) -> _Placer:
    """How a step's components of one leaf reach the replicas' devices.

    A backend with `SupportsPlacePerReplica` takes them all at once and returns what
    ``place`` would give for each (e.g. the jax backend makes one array sharded over
    its replica mesh); without it, each goes through ``place``.
    """
    if features(backend).place_per_replica:
        return cast(SupportsPlacePerReplica, backend).place_per_replica
    place = backend.place

    def place_each(values: Sequence[Any], devices: Sequence[str]) -> list[Any]:
        return [place(v, d) for v, d in zip(values, devices)]

    return place_each


def _host_of(device: str) -> str:
    """The CPU of the machine ``device`` is on (where an input pipeline runs)."""
    spec = DeviceSpec.parse(device)
    return DeviceSpec(spec.job, spec.replica, spec.task, "CPU", 0).to_string()


# -------------------------------------------------- tracking empty-batch steps

# Replicas that got an empty batch in each strategy's most recent step, for
# PartialBatchWarning. Weak keys: tracking must not keep a strategy alive.
_EMPTY_REPLICAS: weakref.WeakKeyDictionary[Strategy, tuple[int, ...]]
_EMPTY_REPLICAS = weakref.WeakKeyDictionary()


def warn_if_partial_batch_mean(strategy: Strategy, value: Any, stacklevel: int = 3) -> None:
    """Warns when ``reduce(MEAN, value, axis=None)`` averages NaNs that come from empty batches.

    The rule: ``strategy``'s most recent distributed step (the last
    ``get_next`` of any of its distributed iterators) gave some replica an
    empty batch, and ``value`` has float components that are NaN on some
    replicas and NaN-free on others. A NaN everywhere, or a value from a step
    without empty batches, does not warn. The result itself is not changed.
    """
    empty = _EMPTY_REPLICAS.get(strategy)
    if not empty or not isinstance(value, DistributedValues) or len(value.values) < 2:
        return
    backend = strategy.extended._backend
    nan_replicas = []
    for r, component in enumerate(value.values):
        array = np.asarray(backend.to_numpy(component))
        if not is_floating(np, array.dtype):  # ml_dtypes' bfloat16 and float8_* included
            return
        if np.isnan(array).any():
            nan_replicas.append(r)
    if not nan_replicas or len(nan_replicas) == len(value.values):
        return
    warnings.warn(
        f"strategy.reduce(MEAN, value, axis=None) is averaging values that are NaN on "
        f"replica(s) {nan_replicas} but not on the others, and replica(s) {list(empty)} got an "
        "empty batch in the last step (the data ran out unevenly). The mean of an empty batch "
        "is NaN, so the result is NaN. Return per-example values (or sums) from the replica "
        "function and reduce them with strategy.reduce(ReduceOp.MEAN, value, axis=0), which "
        "divides by the true number of examples; for a loss, polydist.nn."
        "compute_average_loss_exact scales by the true global batch size.",
        PartialBatchWarning,
        stacklevel=stacklevel,
    )


def _check_not_in_replica_context() -> None:
    mode = _context.current_mode()
    if mode.replica_context is not None and not _context.is_default_mode(mode):
        raise ValueError(_NEXT_IN_REPLICA_MESSAGE)


# ------------------------------------------------------------------ datasets


class DistributedDataset:
    """A dataset distributed over a strategy's replicas (``tf.distribute.DistributedDataset``).

    Made by ``strategy.experimental_distribute_dataset`` or
    ``strategy.distribute_datasets_from_function``. Iterating gives one value
    per step: a nest of ``PerReplica`` whose components are each replica's
    batch, already on that replica's device (plain arrays when the strategy has
    a single replica, as in TF). Each ``iter()`` starts over, with an iterator
    independent of the others. A distributed dataset cannot be transformed
    further: transform the dataset before distributing it.
    """

    def __init__(
        self,
        strategy: Strategy,
        layout: _Layout,
        pipelines: Sequence[Dataset],
        replicas_per_pipeline: int,
        keep: tuple[int, ...] | None,
        devices: tuple[str, ...],
        options: InputOptions | None,
        spec_source: Callable[[], Nest],
        infinite: bool,
        cardinality: int,
        passes: tuple[_IterableDataset, ...] = (),
        pads: bool = False,
        made_by: str = "experimental_distribute_dataset",
    ) -> None:
        # Built only by this module's functions; the arguments are internal.
        self._strategy = strategy
        self._layout = layout
        self._pipelines = tuple(pipelines)
        self._replicas_per_pipeline = replicas_per_pipeline
        self._keep = keep  # the replicas of each global step this process yields; None: all
        self._devices = devices
        self._options = options
        self._spec_source = spec_source
        self._infinite = infinite
        self._cardinality = cardinality
        self._spec_cache: Any = _END
        self._buffer_size = 1 if options is None else options.experimental_per_replica_buffer_size
        # The plain re-iterables (DataLoaders) whose iter() each iteration calls
        # when it is made, one entry per pass it reads, in the order of its reads.
        self._passes = passes
        # Whether a replica may get an empty batch while another gets data, whatever
        # the pipelines' specs say (distribute_datasets_from_function's round-robin).
        self._pads = pads
        self._made_by = made_by  # which strategy method, for an iterator checkpoint's check

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(self)

    @property
    def element_spec(self) -> Any:
        """The spec of one step's value: a nest of ``PerReplicaSpec`` (a nest of
        ``TensorSpec`` for a single replica).

        The batch dimension is None whenever partial batches are possible
        (rebatching, a batch without ``drop_remainder``, several workers on
        finite data); it stays static when every replica always gets the same
        batch size, e.g. ``batch(4, drop_remainder=True)`` over 2 replicas.
        """
        if self._spec_cache is _END:
            self._spec_cache = self._compute_element_spec()
        return self._spec_cache

    @property
    def cardinality(self) -> int:
        """The cardinality of the input, as TF's ``DistributedDataset.cardinality``.

        From ``experimental_distribute_dataset``: the cardinality of the dataset
        of global batches it was given. Each global batch is one step, a short
        last batch too (some replicas then get short or empty batches;
        ``batch(..., drop_remainder=True)`` drops it), so this is the number of
        steps; also with several workers sharded by DATA (what AUTO falls back
        to), where each step is every worker's slices of one global batch. With
        ``AutoShardPolicy.OFF`` each of W workers reads the whole input, in
        about W times as many steps, and this still counts the input's batches
        (TF). From ``distribute_datasets_from_function``: the cardinality of
        this worker's pipeline (replica 0's with ``PER_REPLICA``), i.e. its
        number of per-replica batches, which the worker's R_w replicas take
        round-robin in ``ceil(n / R_w)`` steps.

        ``polydist.data.INFINITE_CARDINALITY`` (-1) for an endless input,
        ``polydist.data.UNKNOWN_CARDINALITY`` (-2) when it is not known without
        reading the data (``filter``, generators, plain Python iterables, files).
        """
        return self._cardinality

    def _compute_element_spec(self) -> Any:
        spec = self._spec_source()
        backend = self._layout.backend
        if features(backend).placed_dtype:
            # The values' dtypes after place (JAX without x64: int64 -> int32).
            placed = cast(SupportsPlacedDtype, backend).placed_dtype
            spec = map_structure(lambda s: TensorSpec(s.shape, placed(s.dtype)), spec)
        if (self._layout.num_workers > 1 or self._pads) and not self._infinite:
            # TF's _rebatch_as_dynamic: any worker (or replica) may get an empty batch.
            spec = map_structure(
                lambda s: TensorSpec((None, *s.shape[1:]), s.dtype) if s.rank else s, spec
            )
        if not self._layout.always_wrap:
            return spec
        n = len(self._devices)
        return map_structure(lambda s: PerReplicaSpec(*([s] * n)), spec)

    def reduce(self, initial_state: Any, reduce_fn: Callable[[Any, Any], Any]) -> Any:
        """Folds ``reduce_fn(state, value)`` over every step, starting from ``initial_state``."""
        state = initial_state
        iterator = iter(self)
        while True:
            optional = iterator.get_next_as_optional()
            if not optional.has_value():
                return state
            state = reduce_fn(state, optional.get_value())

    def _new_values(self, skip: int = 0) -> Iterator[tuple[Any, tuple[int, ...]]]:
        """Each step's value, with the replicas that got an empty batch in it; the first
        ``skip`` steps are read now and dropped unplaced (an iterator's restore)."""
        legacy = _legacy_split_input(self._pipelines, self._keep, len(self._devices))
        if legacy is not None:
            elements = iter(legacy)
            _iterator.skip(elements, skip, "a DistributedIterator")
            return self._split_elements(elements)
        steps = per_replica_batches_from_datasets(self._pipelines, self._replicas_per_pipeline)
        _iterator.skip(steps, skip, "a DistributedIterator")
        keep = self._keep
        if keep is not None:
            steps = ([step[r] for r in keep] for step in steps)
        return map(self._to_value, steps)

    def _split_elements(self, source: Iterable[Nest]) -> Iterator[tuple[Any, tuple[int, ...]]]:
        # The fast path of one worker's legacy split: each element is one step,
        # its replica r getting legacy_rebatch_slices' slice r of every
        # component; no replica ever lacks a batch, so no dummies are needed. It
        # gives what the general path gives, without building a nest per replica.
        place_all, devices = _per_replica_placer(self._layout.backend), self._devices
        n = len(devices)
        cache: dict[int, list[tuple[int, int]]] = {}
        for element in source:
            leaves, tree = optree.tree_flatten(element, none_is_leaf=True)
            columns = []
            empty: set[int] = set()
            for i, leaf in enumerate(leaves):
                if leaf.ndim == 0:
                    raise ValueError(
                        "experimental_distribute_dataset splits every element along its first "
                        f"(batch) dimension across the {n} replicas, but the input is not "
                        f"batched: component {i} of its element is a scalar. Batch it with the "
                        "global batch size first, e.g. dataset.batch(global_batch_size) or a "
                        "DataLoader with batch_size, or give each replica its own pipeline with "
                        "strategy.distribute_datasets_from_function."
                    )
                size = leaf.shape[0]
                slices = cache.get(size)
                if slices is None:
                    if len(cache) > 64:  # batch sizes vary a lot: keep the cache small
                        cache.clear()
                    slices = cache[size] = legacy_rebatch_slices(size, n)
                columns.append(PerReplica(place_all([leaf[a:b] for a, b in slices], devices)))
                if size < n or size % n:
                    empty.update(r for r, (a, b) in enumerate(slices) if a == b)
            yield optree.tree_unflatten(tree, columns), tuple(sorted(empty))

    def _to_value(self, step: list[Nest]) -> tuple[Any, tuple[int, ...]]:
        # Pipeline elements hold arrays, never Python lists (to_array made them
        # arrays), so optree's plain flatten gives data._nest's leaves without
        # its Python is_leaf hook, which would dominate the per-step cost.
        flat = [optree.tree_flatten(nest, none_is_leaf=True) for nest in step]
        leaves0, tree0 = flat[0]
        empty: list[int] = []
        for r, (leaves, tree) in enumerate(flat):
            if tree != tree0:
                raise ValueError(
                    "The input yielded batches of different structures: replica 0 got "
                    f"{tree0} but replica {r} got {tree}. Every element of the input must have "
                    "the same nest structure (the same tuple lengths and dict keys)."
                )
            for leaf in leaves:
                if leaf.ndim and not leaf.shape[0]:
                    empty.append(r)
                    break
        backend, devices = self._layout.backend, self._devices
        if not self._layout.always_wrap:
            return optree.tree_unflatten(tree0, [backend.place(x, devices[0]) for x in leaves0]), ()
        place_all = _per_replica_placer(backend)
        columns = [
            PerReplica(place_all([leaves[i] for leaves, _ in flat], devices))
            for i in range(len(leaves0))
        ]
        return optree.tree_unflatten(tree0, columns), tuple(empty)

    def __getattr__(self, name: str) -> Any:
        if name in _TRANSFORMATIONS:
            raise AttributeError(
                f"'DistributedDataset' object has no attribute {name!r}: a distributed dataset "
                f"cannot be transformed further. Apply {name}() to the dataset before "
                f"distributing it, e.g. strategy.experimental_distribute_dataset("
                f"dataset.{name}(...)), or inside the dataset_fn given to "
                "distribute_datasets_from_function."
            )
        raise AttributeError(f"'DistributedDataset' object has no attribute {name!r}")

    def __repr__(self) -> str:
        return (
            f"<DistributedDataset over {len(self._devices)} replica(s) of "
            f"{type(self._strategy).__name__}, {len(self._pipelines)} input pipeline(s)>"
        )


class _Failure(NamedTuple):
    error: BaseException


class DistributedIterator:
    """An iterator over a ``DistributedDataset`` (``tf.distribute.DistributedIterator``).

    ``next(iterator)`` / ``get_next()`` give the next step's value; at the end
    ``next`` raises ``StopIteration`` and ``get_next`` raises
    ``OutOfRangeError``, again on every further call. ``get_next_as_optional``
    returns an empty ``Optional`` instead. Call them outside ``strategy.run``
    and pass the value in: ``strategy.run(step_fn, args=(next(iterator),))``.

    Up to ``InputOptions.experimental_per_replica_buffer_size`` steps (default
    1) are read and placed on the devices ahead of the one returned; an error
    raised while reading ahead is raised when its step is reached.

    ``polydist.train.Checkpoint(iterator=iterator)`` saves its position (the
    steps handed out, not those read ahead); restore puts a fresh iterator of
    the same distributed dataset there, by reading the input again up to it
    (see ``polydist.data._iterator``).
    """

    def __init__(self, dataset: DistributedDataset) -> None:
        self._dataset = dataset
        self._strategy = dataset._strategy
        # The shuffles' states before this iteration began a pass of them.
        self._start = _iterator.shuffle_states(dataset._pipelines)
        self._position = 0  # steps handed out
        self._begun = self._begin_passes()
        self._read_any = False  # whether a read took from the passes begun
        self._values: Iterator[tuple[Any, tuple[int, ...]]] | None = dataset._new_values()
        self._buffer: collections.deque[tuple[Any, tuple[int, ...]] | _Failure] = (
            collections.deque()
        )

    def _begin_passes(self) -> dict[int, collections.deque[Iterator[Nest]]]:
        # iter() of a plain re-iterable happens here, as iter(loader) would: a
        # DataLoader draws its seed from torch's global RNG at that point.
        begun: dict[int, collections.deque[Iterator[Nest]]] = {}
        for source in self._dataset._passes:
            begun.setdefault(id(source), collections.deque()).append(source.begin_pass())
        return begun

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        try:
            return self.get_next()
        except OutOfRangeError:
            raise StopIteration from None

    def get_next(self) -> Any:
        """The next step's value; ``OutOfRangeError`` at the end of the data."""
        _check_not_in_replica_context()
        value = self._next_value()
        if value is _END:
            raise OutOfRangeError("End of sequence")
        return value

    def get_next_as_optional(self) -> Optional:
        """The next step's value as an ``Optional``, empty at the end of the data."""
        _check_not_in_replica_context()
        return Optional(self._next_value(), lambda: self._dataset.element_spec)

    @property
    def element_spec(self) -> Any:
        """The spec of one step's value (see ``DistributedDataset.element_spec``)."""
        return self._dataset.element_spec

    def _next_value(self) -> Any:
        depth = self._dataset._buffer_size
        while self._values is not None and len(self._buffer) <= depth:
            self._read_step()
        if not self._buffer:
            return _END
        entry = self._buffer.popleft()
        if isinstance(entry, _Failure):
            raise entry.error
        value, empty = entry
        self._position += 1
        _EMPTY_REPLICAS[self._strategy] = empty
        return value

    def _read_step(self) -> None:
        assert self._values is not None
        self._read_any = True
        entry: tuple[Any, tuple[int, ...]] | _Failure | None
        try:
            with _reading_begun_passes(self._begun):
                entry = next(self._values, None)
        except Exception as error:  # surfaced when the consumer reaches this step
            entry = _Failure(error)
        if entry is None or isinstance(entry, _Failure):
            self._values = None
        if entry is not None:
            self._buffer.append(entry)

    # -- polydist.train.Checkpoint (the protocol of polydist.data._iterator) ---------------------
    def _identity(self) -> dict[str, Any]:
        dataset = self._dataset
        layout = dataset._layout
        return {
            "version": _iterator.STATE_VERSION,
            "kind": f"iter(strategy.{dataset._made_by}(...))",
            "layout": (
                f"{layout.num_workers} worker(s) x {layout.replicas_per_worker} replica(s), "
                f"{len(dataset._pipelines)} pipeline(s) of {dataset._replicas_per_pipeline} "
                "replica(s) each"
            ),
            "spec": _iterator.spec_text(dataset._pipelines[0]),
            "pipelines": [_iterator.fingerprint(p) for p in dataset._pipelines],
            "shuffles": self._start,
        }

    def _checkpoint_state(self) -> dict[str, Any]:
        bad = _iterator.unreplayable(self._dataset._pipelines)
        if bad is not None:
            raise _iterator.unreplayable_error(bad, "a DistributedIterator")
        return {**self._identity(), "position": self._position}

    def _checkpoint_problems(self, state: Mapping[str, Any]) -> list[str]:
        return _iterator.problems(state, self._identity(), "a DistributedIterator")

    def _checkpoint_restore(self, state: Mapping[str, Any]) -> Callable[[], None]:
        pipelines = self._dataset._pipelines
        now = _iterator.shuffle_states(pipelines)
        start: list[list[int]] = [list(s) for s in state["shuffles"]]
        position = int(state["position"])
        _iterator.set_shuffle_states(pipelines, start)
        # A fresh iterator's passes are the ones to replay: a DataLoader drew its
        # permutation for them (its iter()), as in the saved run's iterator.
        begun = self._begun if not self._read_any else self._begin_passes()
        self._read_any = True  # the replay reads them
        try:
            with _reading_begun_passes(begun):
                values = self._dataset._new_values(skip=position)
        except BaseException:
            _iterator.set_shuffle_states(pipelines, now)
            raise

        def commit() -> None:
            self._start, self._position, self._begun, self._values = start, position, begun, values
            self._buffer.clear()

        return commit


@contextlib.contextmanager
def _reading_begun_passes(
    begun: dict[int, collections.deque[Iterator[Nest]]],
) -> Iterator[None]:
    """While a step is read, an iteration's sources continue the passes it began."""
    if not begun:
        yield
        return
    token = _sources.BEGUN_PASSES.set({**(_sources.BEGUN_PASSES.get() or {}), **begun})
    try:
        yield
    finally:
        _sources.BEGUN_PASSES.reset(token)


# ---------------------------------------------------------------- entry points


def _as_source(dataset: object, what: str) -> tuple[Dataset, bool]:
    """``dataset`` as a Dataset, and whether it was a plain Python iterable."""
    if isinstance(dataset, Dataset):
        return dataset, False
    if isinstance(dataset, DistributedDataset):
        raise TypeError(f"{what} got a DistributedDataset; pass the dataset it was made from.")
    if isinstance(dataset, str | bytes | Mapping | np.ndarray) or (
        hasattr(dataset, "shape") and hasattr(dataset, "dtype")
    ):
        raise TypeError(
            f"{what} expects a polydist.data.Dataset or an iterable of batches (a list of "
            "dicts/tuples of arrays, a generator, a torch DataLoader), got "
            f"{type(dataset).__name__}. For arrays of examples, build the batches with "
            "polydist.data.Dataset.from_tensor_slices(arrays).batch(global_batch_size)."
        )
    if callable(dataset) and not isinstance(dataset, Iterable):
        _check_generator_function(dataset, what)
        return _IterableDataset(_Collated(_Calls(dataset))), True
    if isinstance(dataset, Iterator):  # one-shot: stays one
        return as_dataset(map(_collated, dataset)), True
    if isinstance(dataset, Iterable):
        free = isinstance(dataset, list | tuple)  # peeking at a list has no effects
        return _IterableDataset(_Collated(dataset), free_to_read=free), True
    raise TypeError(
        f"{what} expects a polydist.data.Dataset, an iterable of batches or a generator "
        f"function, got {type(dataset).__name__} {dataset!r}."
    )


def distribute_dataset(
    strategy: Strategy, dataset: object, options: InputOptions | None = None
) -> DistributedDataset:
    """``strategy.experimental_distribute_dataset(dataset, options)``.

    ``dataset`` is a ``polydist.data.Dataset`` of global batches, or any Python
    iterable of them (a list of dicts/tuples of arrays, a generator, a torch
    ``DataLoader``) or a generator function. Each global batch is split across
    the replicas by TF's rules (``polydist.data._rebatch``). A plain iterable
    has no known batch size, so the legacy ``ceil(b/R)`` split applies, and no
    file source, so it is DATA-sharded across workers (what AUTO falls back to;
    no ``AutoShardWarning``, since it has no options to set).
    """
    options = _check_options(options, from_function=False)
    if (
        options is not None
        and options.experimental_place_dataset_on_device
        and not options.experimental_fetch_to_device
    ):
        # TF accepts this and keeps the batches on the host: a silent trap.
        warnings.warn(
            "InputOptions(experimental_place_dataset_on_device=True) has no effect in "
            "experimental_distribute_dataset: it applies only to PER_REPLICA pipelines of "
            "distribute_datasets_from_function. With experimental_fetch_to_device=False the "
            "batches stay on the host CPU, as in TF; set experimental_fetch_to_device=True "
            "to place them on the replicas' devices.",
            UserWarning,
            stacklevel=3,
        )
    one_shot = isinstance(dataset, Iterator)
    source, plain = _as_source(dataset, "experimental_distribute_dataset")
    layout = _layout(strategy)
    if one_shot and layout.num_workers > 1:
        raise ValueError(
            f"{layout.num_workers} workers read the input, but it is a one-shot iterator; pass "
            "a re-iterable (a Dataset, a list, or an object whose __iter__ starts over)."
        )
    if plain and layout.num_workers > 1 and not _is_default_strategy(strategy):
        _refuse_presharded_loader(dataset, layout.num_workers)
    if layout.num_replicas > 1:
        _check_batched(source, layout.num_replicas)
    elif one_shot:
        # Infer the spec now: inferring it later, mid-iteration, would take an
        # element away from the running iteration of the one-shot iterator.
        with contextlib.suppress(_SpecInferenceError):
            _ = source.element_spec
    policy = AutoShardPolicy.DATA if plain else None
    # Every worker's pipeline is built (see the module doc); the AutoShardWarning
    # is given once, for this process's worker, at the caller's line.
    warn_for = layout.worker_index
    pipelines = []
    # The default strategy takes the dataset as it is (TF returns it unchanged).
    for worker in range(0 if _is_default_strategy(strategy) else layout.num_workers):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = rebatch_and_shard(
                source, layout.num_workers, layout.replicas_per_worker, worker, policy
            )
        if worker == warn_for:
            for w in caught:
                warnings.warn(w.message, w.category, stacklevel=3)
        pipelines.append(result.dataset)
    own = pipelines[warn_for] if pipelines else source
    if not pipelines:
        pipelines.append(source)
    _warn_if_sharding_an_unseeded_shuffle(layout, own)
    devices = _value_devices(layout, options)
    cardinality = source.cardinality()  # TF: the cardinality of the dataset given
    return DistributedDataset(
        strategy,
        layout,
        pipelines,
        layout.replicas_per_worker,
        _kept_replicas(layout),
        devices,
        options,
        lambda: own.element_spec,
        cardinality == INFINITE_CARDINALITY,
        cardinality,
        (source,) * len(pipelines) if isinstance(source, _IterableDataset) else (),
    )


def _distributed_sampler(loader: Any) -> Any:
    """The sampler of a torch ``DataLoader`` (or a look-alike) that already splits the data
    between processes, as ``DistributedSampler`` does (``num_replicas`` > 1), else None.
    Duck-typed: core does not import torch, and Lightning's and Accelerate's samplers
    keep the same two attributes."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for sampler in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        replicas = getattr(sampler, "num_replicas", None)
        if (
            isinstance(replicas, int)
            and replicas > 1
            and isinstance(getattr(sampler, "rank", None), int)
        ):
            return sampler
    return None


def _refuse_presharded_loader(dataset: Any, num_workers: int) -> None:
    """``experimental_distribute_dataset`` DATA-shards a plain iterable across workers: a
    loader whose sampler already gave this process its share would be sharded twice, each
    worker training on 1/W of its share, silently (TF does the same to a dataset sharded by
    hand under AUTO)."""
    sampler = _distributed_sampler(dataset)
    if sampler is None:
        return
    raise ValueError(
        f"experimental_distribute_dataset got a loader whose sampler, "
        f"{type(sampler).__name__}(num_replicas={sampler.num_replicas}, rank={sampler.rank}), "
        f"already splits the data between processes, and it shards the input across the "
        f"{num_workers} workers itself (DATA: each worker keeps its 1/{num_workers} slice "
        "of every batch), so each worker would train on a fraction of its share and the "
        "rest would be lost. Either give it the loader without the sampler (the same "
        "global batches on every worker; polydist splits them), or build each worker's "
        "loader in "
        "strategy.distribute_datasets_from_function(lambda ctx: DataLoader(ds, "
        "batch_size=ctx.get_per_replica_batch_size(global_batch), "
        "sampler=DistributedSampler(ds, num_replicas=ctx.num_input_pipelines, "
        "rank=ctx.input_pipeline_id))), which shards nothing."
    )


def distribute_datasets_from_function(
    strategy: Strategy,
    dataset_fn: Callable[[InputContext], Any],
    options: InputOptions | None = None,
) -> DistributedDataset:
    """``strategy.distribute_datasets_from_function(dataset_fn, options)``.

    ``dataset_fn(InputContext)`` is called once per input pipeline, right
    away: once per worker (PER_WORKER, the default) with
    ``InputContext(num_workers, worker_id, num_replicas_in_sync)``, or once per
    replica (``InputReplicationMode.PER_REPLICA``, MirroredStrategy only)
    with ``InputContext(num_replicas, replica_id, num_replicas_in_sync)``. It
    returns a ``Dataset`` (or an iterable) of *per-replica* batches: nothing is
    rebatched or sharded. A worker's replicas take its elements round-robin;
    when a pipeline runs out, its replicas get empty batches until every
    pipeline is done, so ``element_spec``'s batch dimension is ``None`` with
    more than one replica. (TF, on one worker with a fully static spec, instead
    ends at the first replica out of data and drops the others' remaining
    batches; polydist keeps them.)
    """
    if not callable(dataset_fn):
        raise TypeError(
            "dataset_fn must be a function taking an InputContext and returning a Dataset, got "
            f"{type(dataset_fn).__name__} {dataset_fn!r}."
        )
    options = _check_options(options, from_function=True)
    layout = _layout(strategy)
    num_replicas = layout.num_replicas  # over all workers, as InputContext documents
    per_replica = (
        options is not None
        and options.experimental_replication_mode == InputReplicationMode.PER_REPLICA
    )
    if per_replica:
        # TF: only MirroredStrategy takes it; the default strategy ignores options.
        mirrored = getattr(strategy.extended, "_per_replica_input", False)
        if layout.num_workers > 1 or not (mirrored or _is_default_strategy(strategy)):
            raise NotImplementedError(
                "InputReplicationMode.PER_REPLICA is only supported in "
                "`distribute_datasets_from_function` of MirroredStrategy (single-worker), not "
                f"of {type(strategy).__name__}. Use the default PER_WORKER mode."
            )
        count, per_pipeline = len(layout.devices), 1
    else:
        count, per_pipeline = layout.num_workers, layout.replicas_per_worker
    pipelines = []
    for pipeline_id in range(count):
        context = InputContext(count, pipeline_id, num_replicas)
        pipeline = _from_fn_result(dataset_fn(context), context)
        if layout.num_workers > 1:  # dataset_fn may share one shuffle between workers
            pipeline = pipeline._with_own_state()
        pipelines.append(pipeline)
    own = pipelines[0 if per_replica else layout.worker_index]
    _warn_if_sharding_an_unseeded_shuffle(layout, own)
    infinite = all(p.cardinality() == INFINITE_CARDINALITY for p in pipelines)
    return DistributedDataset(
        strategy,
        layout,
        pipelines,
        per_pipeline,
        None if per_replica else _kept_replicas(layout),
        _value_devices(layout, options),
        options,
        lambda: own.element_spec,
        infinite,
        own.cardinality(),  # TF: its first (this worker's) dataset's
        tuple(p for p in pipelines if isinstance(p, _IterableDataset)),
        pads=layout.num_replicas > 1,
        made_by="distribute_datasets_from_function",
    )


def _warn_if_sharding_an_unseeded_shuffle(layout: _Layout, pipeline: Dataset) -> None:
    # TF's trap: each worker's process draws its own seed, so the workers' shards
    # come from different orders; TF says nothing.
    if layout.num_workers > 1 and pipeline._shards_an_unseeded_shuffle():
        warnings.warn(
            f"The input of {layout.num_workers} workers is sharded after a shuffle without a "
            "seed. With one process per worker each process draws its own seed, so the "
            "workers' shards come from different orders: some examples are read twice in an "
            "epoch and others never (as in TF; the sim runs every worker in one process and "
            "hides it). Pass a seed, e.g. dataset.shuffle(buffer_size, seed=1), or shuffle "
            "after sharding.",
            UserWarning,
            stacklevel=4,
        )


def _from_fn_result(result: object, context: InputContext) -> Dataset:
    if isinstance(result, Dataset):
        return result
    try:
        return _as_source(result, "distribute_datasets_from_function")[0]
    except TypeError:
        raise TypeError(
            f"dataset_fn must return a polydist.data.Dataset (or an iterable of batches), but "
            f"for {context!r} it returned {type(result).__name__}. Return e.g. "
            "Dataset.from_tensor_slices(data).batch(context.get_per_replica_batch_size(G))."
        ) from None


def _kept_replicas(layout: _Layout) -> tuple[int, ...] | None:
    """The replicas of the workers this process runs, worker-major; None if all."""
    if layout.workers_here == tuple(range(layout.num_workers)):
        return None
    n = layout.replicas_per_worker
    return tuple(w * n + r for w in layout.workers_here for r in range(n))


def _value_devices(layout: _Layout, options: InputOptions | None) -> tuple[str, ...]:
    """Where each replica's batch is placed: its device, or its host's CPU."""
    if options is None or options.experimental_fetch_to_device:
        return layout.devices
    # TF's _input_workers_with_options: only a PER_REPLICA pipeline is placed on
    # its device; PER_WORKER without fetching stays on the host whatever
    # experimental_place_dataset_on_device says.
    if (
        options.experimental_place_dataset_on_device
        and options.experimental_replication_mode == InputReplicationMode.PER_REPLICA
    ):
        return layout.devices
    return tuple(_host_of(device) for device in layout.devices)


def make_numpy_dataset(numpy_input: Nest, session: object = None) -> Dataset:
    """``Dataset.from_tensor_slices(numpy_input)``: ``experimental_make_numpy_dataset``.

    The ``tf.compat.v1`` strategies and TF 2's ``TPUStrategy`` have this method
    (the V2 ``Strategy`` does not); ``session`` is accepted for compatibility
    and unused, since there is no graph mode. Distribute the result with
    ``experimental_distribute_dataset`` after batching it.
    """
    del session  # graph-mode only in TF
    return Dataset.from_tensor_slices(numpy_input)
