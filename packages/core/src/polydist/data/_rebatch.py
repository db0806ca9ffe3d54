"""TF's rules for splitting a dataset across workers and replicas, exactly.

What ``experimental_distribute_dataset`` does to a dataset, step by step
(TF 2.x ``input_lib._create_cloned_datasets_from_dataset``):

1. With R = W * R_w > 1 replicas, ``B = compute_batch_size(dataset)``. If
   B != -1 the worker's dataset gets ``RebatchDatasetV2`` with
   ``batch_sizes_for_worker(B, W, R_w, w)`` (``rebatch_v2``); else the legacy
   ``RebatchDataset(R)`` (``legacy_rebatch``). Then ``prefetch(R_w)``.
2. ``auto_shard_dataset`` runs, even for one worker. Sharding by DATA
   rewrites a trailing RebatchDatasetV2 into the legacy op (V2 "is
   incompatible with data sharding") and appends ``shard(W, w)`` before the
   trailing prefetch; FILE shards the file list of the pipeline's reader; OFF
   changes nothing. AUTO is FILE when a file source is found, else DATA.
3. The worker's replicas dequeue its elements round-robin (MultiDeviceIterator).
   A step in which some replica, on any worker, got an element gives every
   replica without one a zero-size dummy batch; when no replica got one,
   iteration stops (``get_next_as_optional`` + ``_dummy_tensor_fn``).

``rebatch_and_shard`` is steps 1-2, ``per_replica_batches`` all three.
Sources: tensorflow/python/distribute/input_lib.py, python/data/experimental/
ops/distribute.py, core/kernels/data/experimental/rebatch_dataset_op.cc,
core/kernels/data/experimental/compute_batch_size_op.cc and
core/grappler/optimizers/data/auto_shard.cc.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Final, NamedTuple

import numpy as np

from polydist.data._dataset import (
    SHARD_HINT,
    UNKNOWN_CARDINALITY,
    Dataset,
    _BatchDataset,
    _OptionsDataset,
    _PrefetchDataset,
    _ShardDataset,
)
from polydist.data._elements import _check_batched, _SpecInferenceError
from polydist.data._nest import Nest, flatten, map_structure, unflatten
from polydist.data._options import AutoShardPolicy
from polydist.data._sources import _FileDataset, _IterableDataset, as_dataset
from polydist.data._spec import TensorSpec, empty_batch, leading_dims

__all__ = [
    "AutoShardResult",
    "AutoShardWarning",
    "auto_shard_dataset",
    "batch_sizes_for_worker",
    "compute_batch_size",
    "global_per_replica_batches",
    "legacy_rebatch",
    "legacy_rebatch_slices",
    "per_replica_batches",
    "per_replica_batches_from_datasets",
    "rebatch_and_shard",
    "rebatch_v2",
]

_END: Final = object()


class AutoShardWarning(UserWarning):
    """Auto-sharding fell back from FILE to DATA sharding.

    Raised where TF logs "AUTO sharding policy will apply DATA sharding policy
    as it failed to apply FILE sharding policy": the pipeline has no file
    source. Also raised, where TF would fail at run time, when a file source
    has fewer files than workers (TF: "Could not apply FILE based sharding").
    """


# --------------------------------------------------------------- batch size


def compute_batch_size(dataset: object) -> int:
    """The batch size of ``dataset`` sans partial batches, or -1 (TF's ``compute_batch_size``).

    First the static leading dimension of every component of ``element_spec``:
    if all are known, their common value (or -1 if they differ). Otherwise
    the pipeline is walked from its end through ops that cannot change the
    leading dimension (filter, shard, repeat, shuffle, skip, take, prefetch,
    options) to a ``batch``, whose size is returned; any other op first (map,
    unbatch, a source) gives -1. Anything that is not a ``Dataset`` is -1.
    """
    if not isinstance(dataset, Dataset) or isinstance(dataset, _IterableDataset):
        return -1  # a plain iterable's spec has unknown dims: no need to read it
    try:
        dims = leading_dims(dataset.element_spec)
    except _SpecInferenceError:
        dims = []
    known = [d for d in dims if d is not None]
    if dims and len(known) == len(dims):
        return known[0] if all(d == known[0] for d in known) else -1
    node = dataset
    while not isinstance(node, _BatchDataset):
        if not node._passes_batch_size:
            return -1
        node = node._inputs[0]
    return node.batch_size


# ------------------------------------------------------------ legacy rebatch


def legacy_rebatch_slices(batch_size: int, num_replicas: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each replica's slice of a batch of ``batch_size`` (legacy rule).

    Slice r is ``[r*c, min((r+1)*c, b))`` with ``c = ceil(b/R)``; a replica
    past the end gets the empty slice ``(stop, stop)`` (rebatch_dataset_op.cc).
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be greater than zero, got {num_replicas}.")
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}.")
    interval = -(-batch_size // num_replicas)
    slices = []
    for replica in range(num_replicas):
        start = interval * replica
        stop = min(start + interval, batch_size)
        slices.append((stop, stop) if start >= stop else (start, stop))
    return slices


def legacy_rebatch(elements: Iterable[Nest], num_replicas: int) -> Iterator[Nest]:
    """Cut every element into ``num_replicas`` consecutive slices (legacy ``RebatchDataset``).

    Each component is sliced along its first dimension with
    ``legacy_rebatch_slices``, so R outputs come from every input element.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be greater than zero, got {num_replicas}.")
    for element in elements:
        leaves, treespec = flatten(element)
        for i, leaf in enumerate(leaves):
            if leaf.ndim == 0:
                raise ValueError(
                    "Cannot rebatch dataset: All components must have at least one dimension. "
                    f"Perhaps your input dataset is not batched? Component {i} is scalar."
                )
        # Components are sliced independently: they may have different batch sizes.
        per_leaf = [legacy_rebatch_slices(leaf.shape[0], num_replicas) for leaf in leaves]
        for replica in range(num_replicas):
            yield unflatten(
                treespec,
                [
                    leaf[slices[replica][0] : slices[replica][1]]
                    for leaf, slices in zip(leaves, per_leaf)
                ],
            )


# ---------------------------------------------------------------- rebatch V2


def batch_sizes_for_worker(
    global_batch_size: int, num_workers: int, num_replicas_per_worker: int, worker_index: int
) -> list[int]:
    """Sub-batch sizes for worker ``worker_index`` (TF's ``distribute.batch_sizes_for_worker``).

    With N = W * R_w sub-batches, the first ``B mod N`` have size ``ceil(B/N)``
    and the rest ``floor(B/N)``; worker w's list is rotated left by ``w * R_w``,
    so every global step consumes exactly B elements.
    """
    if num_workers < 1 or num_replicas_per_worker < 1:
        raise ValueError(
            "num_workers and num_replicas_per_worker must be >= 1, got "
            f"{num_workers} and {num_replicas_per_worker}."
        )
    if not 0 <= worker_index < num_workers:
        raise ValueError(f"worker_index must be in [0, {num_workers}), got {worker_index}.")
    if global_batch_size < 0:
        raise ValueError(f"global_batch_size must be >= 0, got {global_batch_size}.")
    num_subbatches = num_workers * num_replicas_per_worker
    offset = worker_index * num_replicas_per_worker
    floor = global_batch_size // num_subbatches
    num_ceil = global_batch_size - num_subbatches * floor
    worker_0 = [floor + 1] * num_ceil + [floor] * (num_subbatches - num_ceil)
    return worker_0[offset:] + worker_0[:offset]


def _empty_like(template: Nest | None, spec: Nest | None) -> Nest | None:
    """Zero-size batch shaped after ``spec`` (where known) and ``template``; None if neither."""
    if spec is not None:
        spec_leaves, treespec = flatten(spec)
        template_leaves: list[Any] = [None] * len(spec_leaves)
        if template is not None:
            leaves, template_tree = flatten(template)
            if template_tree == treespec:
                template_leaves = leaves
        return unflatten(
            treespec, [empty_batch(s, t) for s, t in zip(spec_leaves, template_leaves)]
        )
    if template is None:
        return None
    leaves, treespec = flatten(template)
    return unflatten(treespec, [empty_batch(None, leaf) for leaf in leaves])


def rebatch_v2(
    elements: Iterable[Nest], batch_sizes: Sequence[int], drop_remainder: bool = False
) -> Iterator[Nest]:
    """Re-batch into ``batch_sizes[0], batch_sizes[1], ...`` cycling (``RebatchDatasetV2``).

    Behaves like ``unbatch().batch(size)`` with the size cycling through
    ``batch_sizes``: a batch may take rows from several input batches, and at
    the end the short final batch goes to whichever size is next (dropped if
    ``drop_remainder``). A size of 0 yields an empty batch without reading
    input; its shape comes from ``elements.element_spec`` when ``elements`` is
    a Dataset (unknown dims from the last input element, else 0), else from
    the last input element (reading one ahead if none was read yet).
    """
    sizes = [int(size) for size in batch_sizes]
    if not sizes or any(size < 0 for size in sizes) or not any(sizes):
        raise ValueError(
            f"batch_sizes must be non-negative with at least one positive size, got {sizes}."
        )
    return _rebatch_v2(elements, sizes, drop_remainder)


def _rebatch_v2(elements: Iterable[Nest], sizes: list[int], drop_remainder: bool) -> Iterator[Nest]:
    upstream = iter(elements)
    current: list[np.ndarray[Any, Any]] | None = None  # the input batch being consumed
    treespec: Any = None
    last_input: Nest | None = None
    offset = 0
    index = 0
    exhausted = False
    while not exhausted:
        desired = sizes[index]
        index = (index + 1) % len(sizes)
        if desired == 0:
            if last_input is None:
                peeked = next(upstream, _END)
                if peeked is not _END:
                    last_input = peeked
                    upstream = itertools.chain([peeked], upstream)
            spec = _spec_or_none(elements)
            empty = _empty_like(last_input, spec)
            if empty is None:  # empty input and nothing to shape the batch after
                return
            yield empty
            continue
        pieces: list[list[np.ndarray[Any, Any]]] = []
        got = 0
        while got < desired:
            if current is None:
                element = next(upstream, _END)
                if element is _END:
                    exhausted = True
                    break
                last_input = element
                leaves, treespec = flatten(element)
                _check_batched(leaves)
                current, offset = leaves, 0
            stop = min(offset + desired - got, current[0].shape[0])
            pieces.append([leaf[offset:stop] for leaf in current])
            got += stop - offset
            offset = stop
            if offset == current[0].shape[0]:
                current = None
        if got == 0 or (drop_remainder and got < desired):
            return
        if len(pieces) == 1:
            yield unflatten(treespec, pieces[0])
        else:
            yield unflatten(
                treespec,
                [np.concatenate([piece[i] for piece in pieces]) for i in range(len(pieces[0]))],
            )


def _spec_or_none(source: object) -> Nest | None:
    if not isinstance(source, Dataset):
        return None
    try:
        return source.element_spec
    except _SpecInferenceError:
        return None


class _LegacyRebatchDataset(Dataset):
    """``RebatchDataset(num_replicas)``: TF's legacy, per-batch split."""

    _op_name = "RebatchDataset"
    _passes_file_sharding = True

    def __init__(self, source: Dataset, num_replicas: int) -> None:
        super().__init__(source)
        self.num_replicas = num_replicas

    def _describe(self) -> str:
        return f"{self._op_name}(num_replicas={self.num_replicas})"

    def _iterate(self) -> Iterator[Nest]:
        return legacy_rebatch(self._inputs[0], self.num_replicas)

    def _compute_cardinality(self) -> int:
        return UNKNOWN_CARDINALITY

    def _compute_element_spec(self) -> Nest:
        def rebatched(spec: TensorSpec) -> TensorSpec:
            if spec.rank == 0:
                raise ValueError(
                    "Invalid `input_dataset`. Expected a dataset whose elements have rank >= 1 "
                    "but found a dataset whose elements are scalars. Fix the issue by adding "
                    "the `batch` transformation to the dataset."
                )
            batch = spec.shape[0]
            per_replica = None
            if batch is not None and batch % self.num_replicas == 0:
                per_replica = batch // self.num_replicas
            return TensorSpec((per_replica, *spec.shape[1:]), spec.dtype)

        return map_structure(rebatched, self._inputs[0].element_spec)


class _RebatchV2Dataset(Dataset):
    """``RebatchDatasetV2(batch_sizes)``: unbatch-then-batch with cycling sizes."""

    _op_name = "RebatchDatasetV2"
    _passes_file_sharding = True

    def __init__(self, source: Dataset, batch_sizes: list[int]) -> None:
        super().__init__(source)
        self.batch_sizes = batch_sizes

    def _describe(self) -> str:
        return f"{self._op_name}(batch_sizes={list(self.batch_sizes)})"

    def _iterate(self) -> Iterator[Nest]:
        return rebatch_v2(self._inputs[0], self.batch_sizes)

    def _compute_cardinality(self) -> int:
        return UNKNOWN_CARDINALITY

    def _compute_element_spec(self) -> Nest:
        # TF's _RebatchDataset._compute_static_batch_dim with drop_remainder=False
        # (what distribution uses): the batch dim stays static only when every
        # size is the same and divides the input's static batch size, so that no
        # partial batch can form; e.g. batch(4, drop_remainder=True) over 2 -> 2.
        spec = self._inputs[0].element_spec
        new_dim = None
        if len(set(self.batch_sizes)) == 1:
            size = self.batch_sizes[0]
            known = [d for d in leading_dims(spec) if d is not None]
            if known and size > 0 and known[0] % size == 0:
                new_dim = size
        return map_structure(lambda s: TensorSpec((new_dim, *s.shape[1:]), s.dtype), spec)


# -------------------------------------------------------------- auto-sharding


class AutoShardResult(NamedTuple):
    """The policy auto-sharding actually applied, and the worker's dataset."""

    policy: AutoShardPolicy
    dataset: Dataset


def _shard_by_data(dataset: Dataset, num_workers: int, index: int, num_replicas: int) -> Dataset:
    # Insert the shard before any trailing prefetch/options so the right number
    # of elements is prefetched, and turn a RebatchDatasetV2 right before it
    # into the legacy op (auto_shard.cc ShardByData / RewriteRebatchV2ToV1).
    trailing: list[Dataset] = []
    node = dataset
    while isinstance(node, _PrefetchDataset | _OptionsDataset):
        trailing.append(node)
        node = node._inputs[0]
    if isinstance(node, _RebatchV2Dataset):
        if num_replicas < 1:
            raise ValueError(
                "Cannot rewrite RebatchDatasetV2 to legacy RebatchDataset with invalid "
                f"num_replicas argument. `num_replicas` is {num_replicas}, but expected to be >= 1."
            )
        node = _LegacyRebatchDataset(node._inputs[0], num_replicas)
    node = _ShardDataset(node, num_workers, index)
    for outer in reversed(trailing):
        node = outer._with_inputs((node,))
    return node


def _shard_by_hint(dataset: Dataset, num_workers: int, index: int) -> Dataset:
    def fill(node: Dataset) -> Dataset | None:
        if isinstance(node, _ShardDataset) and node.num_shards == SHARD_HINT:
            return _ShardDataset(node._inputs[0], num_workers, index)
        return None

    return dataset._rewrite(fill)


def _shard_files(dataset: Dataset, source: _FileDataset, num_workers: int, index: int) -> Dataset:
    def shard(node: Dataset) -> Dataset | None:
        if node is source:
            return source._with_files(source.filenames[index::num_workers])
        return None

    return dataset._rewrite(shard)


def auto_shard_dataset(
    dataset: object,
    num_workers: int,
    worker_index: int,
    num_replicas_in_sync: int = 1,
    policy: AutoShardPolicy | None = None,
) -> AutoShardResult:
    """Shard ``dataset`` for worker ``worker_index`` of ``num_workers`` (TF's auto-shard).

    ``policy`` defaults to ``dataset.options().experimental_distribute.auto_shard_policy``.

    - OFF: unchanged.
    - FILE: the pipeline's file source keeps files ``[w::W]``; with one worker
      TF skips the rewrite entirely. No file source with W > 1: ValueError
      (TF's NotFound). Fewer files than workers: DATA, with AutoShardWarning
      (TF fails at run time with "Could not apply FILE based sharding").
    - DATA: ``shard(W, w)`` before the trailing prefetch/options; a
      RebatchDatasetV2 there becomes ``RebatchDataset(num_replicas_in_sync)``.
    - HINT: every ``shard(SHARD_HINT, SHARD_HINT)`` becomes ``shard(W, w)``.
    - AUTO: FILE when the walk from the end through pass-through ops (batch,
      unbatch, map, filter, shard, repeat, shuffle, skip, take, prefetch,
      options, rebatch) reaches a file source with at least W files; otherwise DATA, with
      an AutoShardWarning when there are several workers. TF logs the fallback
      for one worker too, where DATA sharding keeps every element: polydist
      does not warn then, since there is nothing the user could shard.

    Returns the policy actually applied (FILE, DATA, OFF or HINT; FILE for
    FILE with one worker) and the worker's dataset.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers should be >= 1, currently {num_workers}")
    if not 0 <= worker_index < num_workers:
        raise ValueError(f"index should be >= 0 and < {num_workers}, currently {worker_index}")
    source = as_dataset(dataset)
    requested = (
        source.options().experimental_distribute.auto_shard_policy if policy is None else policy
    )
    if requested == AutoShardPolicy.OFF:
        return AutoShardResult(AutoShardPolicy.OFF, source)
    if requested == AutoShardPolicy.FILE and num_workers == 1:
        return AutoShardResult(AutoShardPolicy.FILE, source)
    if requested == AutoShardPolicy.DATA:
        return AutoShardResult(
            AutoShardPolicy.DATA,
            _shard_by_data(source, num_workers, worker_index, num_replicas_in_sync),
        )
    if requested == AutoShardPolicy.HINT:
        return AutoShardResult(
            AutoShardPolicy.HINT, _shard_by_hint(source, num_workers, worker_index)
        )

    found = source._find_file_source()
    if isinstance(found, _FileDataset):
        if len(found.filenames) >= num_workers:
            return AutoShardResult(
                AutoShardPolicy.FILE, _shard_files(source, found, num_workers, worker_index)
            )
        reason = (
            f"the dataset only has {len(found.filenames)} file(s), which is not enough for the "
            f"required {num_workers} shards/workers"
        )
    elif requested == AutoShardPolicy.FILE:
        raise ValueError(
            f"{found}. FILE auto-sharding needs a file source (Dataset.from_files, "
            "TextLineDataset). Consider either turning off auto-sharding or switching the "
            "auto_shard_policy to DATA to shard this dataset: set "
            "`options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA` and "
            "apply it with `dataset.with_options(options)`."
        )
    else:
        reason = found
    if num_workers > 1:  # one worker: DATA sharding keeps every element, nothing to warn about
        warnings.warn(
            f"{requested.name} sharding policy will apply DATA sharding policy as it failed to "
            f"apply FILE sharding policy because of the following reason: {reason}. Set "
            "options.experimental_distribute.auto_shard_policy to AutoShardPolicy.DATA (or OFF) "
            "to choose explicitly and silence this warning.",
            AutoShardWarning,
            stacklevel=2,
        )
    return AutoShardResult(
        AutoShardPolicy.DATA,
        _shard_by_data(source, num_workers, worker_index, num_replicas_in_sync),
    )


def rebatch_and_shard(
    dataset: object,
    num_workers: int = 1,
    replicas_per_worker: int = 1,
    worker_index: int = 0,
    policy: AutoShardPolicy | None = None,
) -> AutoShardResult:
    """Worker ``worker_index``'s dataset, as ``experimental_distribute_dataset`` builds it.

    Rebatches (V2 if ``compute_batch_size`` is known, else legacy) when there
    is more than one replica in all, prefetches ``replicas_per_worker``, then
    auto-shards. Each element of the result is one replica's batch; the
    worker's replicas take them in turn.
    """
    if replicas_per_worker < 1:
        raise ValueError(f"replicas_per_worker must be >= 1, got {replicas_per_worker}.")
    source = as_dataset(dataset)
    if num_workers > 1:  # each worker's copy reshuffles on its own passes only
        source = source._with_own_state()
    num_replicas = num_workers * replicas_per_worker
    if num_replicas > 1:
        batch_size = compute_batch_size(source)
        if batch_size != -1:
            sizes = batch_sizes_for_worker(
                batch_size, num_workers, replicas_per_worker, worker_index
            )
            source = _RebatchV2Dataset(source, sizes)
        else:
            legacy = _LegacyRebatchDataset(source, num_replicas)
            # TF's ValueError for unbatched (scalar) elements; a source that a peek
            # would begin a pass of (a DataLoader's shuffle) is checked as it is read.
            if not (isinstance(source, _IterableDataset) and source.peek_begins_a_pass):
                with contextlib.suppress(_SpecInferenceError):
                    _ = legacy.element_spec
            source = legacy
        source = source.prefetch(replicas_per_worker)
    return auto_shard_dataset(source, num_workers, worker_index, num_replicas, policy)


# ---------------------------------------------------------- per-replica steps


def _lockstep(streams: list[Iterator[Nest]], replicas_per_worker: int) -> Iterator[list[Nest]]:
    """Round-robin dequeue per worker; zero-size dummies; stop when no replica got data."""
    finished = [False] * len(streams)
    while True:
        step: list[Any] = []
        for worker, stream in enumerate(streams):
            for _ in range(replicas_per_worker):
                element = _END if finished[worker] else next(stream, _END)
                if element is _END:
                    finished[worker] = True
                step.append(element)
        received = [element for element in step if element is not _END]
        if not received:
            return
        template = received[-1]
        yield [_empty_like(template, None) if e is _END else e for e in step]


def _worker_streams(
    dataset: object,
    num_workers: int,
    replicas_per_worker: int,
    policy: AutoShardPolicy | None,
    warn_for: int,
) -> list[Iterator[Nest]]:
    if num_workers > 1 and isinstance(dataset, Iterator):
        raise ValueError(
            "Several simulated workers read the input, but it is a one-shot iterator; "
            "pass a re-iterable (a Dataset, a list, or an object whose __iter__ starts over)."
        )
    source = as_dataset(dataset)
    streams: list[Iterator[Nest]] = []
    for worker in range(num_workers):
        with warnings.catch_warnings():
            if worker != warn_for:  # every worker decides alike; warn once
                warnings.simplefilter("ignore", AutoShardWarning)
            result = rebatch_and_shard(source, num_workers, replicas_per_worker, worker, policy)
        streams.append(iter(result.dataset))
    return streams


def global_per_replica_batches(
    dataset: object,
    num_workers: int = 1,
    replicas_per_worker: int = 1,
    policy: AutoShardPolicy | None = None,
) -> Iterator[list[Nest]]:
    """Per step, every replica's batch: a list of W * R_w nests, worker-major.

    Replica ``w * R_w + r`` is replica r of worker w. See ``per_replica_batches``.
    """
    streams = _worker_streams(dataset, num_workers, replicas_per_worker, policy, warn_for=0)
    return _lockstep(streams, replicas_per_worker)


def per_replica_batches(
    dataset: object,
    num_workers: int = 1,
    replicas_per_worker: int = 1,
    worker_index: int = 0,
    policy: AutoShardPolicy | None = None,
) -> Iterator[list[Nest]]:
    """Per step, the batches of worker ``worker_index``'s replicas (a list of R_w nests).

    ``dataset`` is a Dataset or any re-iterable of elements (plain iterables
    are unshardable generator sources with unknown batch size). A replica that
    gets no data in a step where another replica (on any worker) does gets a
    zero-size batch: leading dim 0, other dims and dtypes of the step's last
    real batch. Iteration stops when no replica gets data. ``policy`` defaults
    to the dataset's ``auto_shard_policy`` option.

    TF gives dummies only with partial-batch handling on (finite dataset and a
    non-static element_spec, or several workers); in the remaining cases every
    replica runs out at the same step, so the steps are the same.
    """
    if not 0 <= worker_index < num_workers:
        raise ValueError(f"worker_index must be in [0, {num_workers}), got {worker_index}.")
    streams = _worker_streams(dataset, num_workers, replicas_per_worker, policy, worker_index)
    first = worker_index * replicas_per_worker
    return (
        step[first : first + replicas_per_worker]
        for step in _lockstep(streams, replicas_per_worker)
    )


def per_replica_batches_from_datasets(
    datasets: Sequence[Iterable[Nest]], replicas_per_worker: int = 1
) -> Iterator[list[Nest]]:
    """Per step, every replica's batch for ``distribute_datasets_from_function``.

    ``datasets[i]`` is input pipeline i (worker i's ``dataset_fn(InputContext)``
    result). No rebatching or sharding: worker i's replicas dequeue its
    elements round-robin. Replicas left without data while some replica has
    data get zero-size batches shaped like the step's last real batch;
    iteration stops when every pipeline is exhausted. Yields lists of
    ``len(datasets) * replicas_per_worker`` nests, worker-major.
    """
    if replicas_per_worker < 1:
        raise ValueError(f"replicas_per_worker must be >= 1, got {replicas_per_worker}.")
    if not datasets:
        raise ValueError("per_replica_batches_from_datasets needs at least one input pipeline.")
    iterators = [_converted(source) for source in datasets]
    return _lockstep(iterators, replicas_per_worker)


def _converted(source: Iterable[Nest]) -> Iterator[Nest]:
    # A plain iterable is converted as a generator source (copies included).
    return iter(as_dataset(source))
