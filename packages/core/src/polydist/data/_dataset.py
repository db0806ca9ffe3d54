"""``Dataset``: a lazy, re-iterable ``tf.data`` pipeline over nests of NumPy arrays.

Each transformation returns a new node that keeps its input, so the pipeline
is a small graph that the distribution rules in ``_rebatch`` can walk and
rewrite the way TF's grappler passes walk a tf.data graph: find the batch op
(``compute_batch_size``), find the file source (FILE auto-sharding), insert a
shard (DATA auto-sharding). Iterating a node builds a fresh Python iterator
from the source each time, so every dataset can be iterated again.
"""

from __future__ import annotations

import abc
import builtins
import collections
import copy
import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Final

import numpy as np
from numpy.typing import DTypeLike

from polydist.data._elements import (
    FilePaths,
    _as_bool,
    _call,
    _check_batched,
    _check_signature,
    _filename_tuple,
    _frozen,
    _probe,
    _SpecInferenceError,
    _stack,
)
from polydist.data._iterator import OwnedIterator
from polydist.data._nest import Nest, flatten, map_structure, to_array, unflatten
from polydist.data._options import Options
from polydist.data._spec import TensorSpec, common_spec, spec_of, with_unknown_dims

if TYPE_CHECKING:
    from polydist.data._sources import _FileDataset

__all__ = [
    "AUTOTUNE",
    "INFINITE_CARDINALITY",
    "SHARD_HINT",
    "UNKNOWN_CARDINALITY",
    "Dataset",
]

INFINITE_CARDINALITY: Final = -1
"""``cardinality()`` of a dataset that never ends (``tf.data.INFINITE_CARDINALITY``)."""
UNKNOWN_CARDINALITY: Final = -2
"""``cardinality()`` when the length is not known statically (``tf.data.UNKNOWN_CARDINALITY``)."""
AUTOTUNE: Final = -1
"""Buffer size meaning "let the runtime choose" (``tf.data.AUTOTUNE``); prefetch uses 1."""
SHARD_HINT: Final = -1
"""``shard(SHARD_HINT, SHARD_HINT)`` is filled in by the HINT auto-shard policy."""

_UNSET: Final = object()
_END: Final = object()


def _numpy_scalars(element: Nest) -> Nest:
    return map_structure(lambda a: a[()] if a.ndim == 0 else a, element)


class Dataset(abc.ABC):
    """A lazy, re-iterable pipeline of elements, with ``tf.data.Dataset``'s API.

    An element is a nest (tuple, namedtuple, dict) of NumPy arrays; a scalar is
    a 0-d array. Build a dataset with ``from_tensor_slices``, ``from_tensors``,
    ``range``, ``from_generator`` or ``from_files`` / ``TextLineDataset``, then
    chain transformations. Iteration order and values are deterministic
    (``shuffle`` is deterministic given a seed).
    """

    # How TF's graph walks treat this op; see _rebatch.py for where they are used.
    _op_name: ClassVar[str] = "Dataset"
    _is_source: ClassVar[bool] = False
    # In kPassThroughOps of grappler/optimizers/data/auto_shard.cc (FILE sharding walk).
    _passes_file_sharding: ClassVar[bool] = False
    # In kPassThroughOps of kernels/data/experimental/compute_batch_size_op.cc.
    _passes_batch_size: ClassVar[bool] = False
    # Whether reading it again gives the same elements (False: a one-shot iterator).
    _replayable: ClassVar[bool] = True

    def __init__(self, *inputs: Dataset) -> None:
        self._inputs: tuple[Dataset, ...] = inputs
        self._spec_cache: Any = _UNSET

    # ----------------------------------------------------------- subclass hooks

    @abc.abstractmethod
    def _iterate(self) -> Iterator[Nest]:
        """A fresh iterator over the elements."""

    @abc.abstractmethod
    def _compute_cardinality(self) -> int:
        """Number of elements, INFINITE_CARDINALITY or UNKNOWN_CARDINALITY."""

    def _compute_element_spec(self) -> Nest:
        return self._inputs[0].element_spec

    def _own_options(self) -> Options | None:
        return None

    def _describe(self) -> str:
        """This op and the arguments that decide its elements, for an iterator
        checkpoint's check that it is restored into the same pipeline; "" for an op
        that does not change the elements (prefetch, options)."""
        return self._op_name

    # -------------------------------------------------------------- iteration

    def __iter__(self) -> OwnedIterator:
        """A fresh iterator over the elements; ``polydist.train.Checkpoint`` can save it."""
        return OwnedIterator(self)

    def as_numpy_iterator(self) -> OwnedIterator:
        """Iterate with 0-d arrays turned into NumPy scalars, like TF's ``tensor.numpy()``."""
        return OwnedIterator(self, _numpy_scalars)

    def __bool__(self) -> bool:
        return True  # never falls back to __len__, which may raise

    def __len__(self) -> int:
        length = self.cardinality()
        if length == INFINITE_CARDINALITY:
            raise TypeError("The dataset is infinite.")
        if length == UNKNOWN_CARDINALITY:
            raise TypeError("The dataset length is unknown.")
        return length

    def __repr__(self) -> str:
        chain: list[str] = []
        node: Dataset = self
        while True:
            chain.append(node._op_name)
            if len(node._inputs) != 1:
                break
            node = node._inputs[0]
        return f"<Dataset {' <- '.join(chain)}>"

    # ---------------------------------------------------------------- metadata

    def cardinality(self) -> int:
        """Known number of elements, or INFINITE_CARDINALITY (-1) / UNKNOWN_CARDINALITY (-2)."""
        return self._compute_cardinality()

    @property
    def element_spec(self) -> Nest:
        """Nest of ``TensorSpec`` describing one element.

        Like TF, a ``batch`` without ``drop_remainder`` has an unknown (None)
        leading dimension. ``map``'s spec is found the way TF traces the
        function once: ``fn`` is called on two synthetic elements built from the
        input spec (zeros with unknown dims of size 1, ones with size 2) and
        dims that differ become None; if ``fn`` fails on them, it is applied to
        the first real element and every dimension is reported unknown.
        ``from_generator`` / ``from_files`` without a signature report the first
        element's dtypes and ranks with unknown dimensions.
        """
        if self._spec_cache is _UNSET:
            self._spec_cache = self._compute_element_spec()
        return self._spec_cache

    def options(self) -> Options:
        """The options of this pipeline (later ``with_options`` calls win)."""
        merged = Options()
        for node in self._inputs:
            merged = merged.merge(node.options())
        own = self._own_options()
        return merged if own is None else merged.merge(own)

    def with_options(self, options: Options) -> Dataset:
        if not isinstance(options, Options):
            raise TypeError(
                f"with_options expects a polydist.data.Options, got {type(options).__name__}."
            )
        return _OptionsDataset(self, Options().merge(options))

    # ------------------------------------------------------------ graph walking

    def _with_inputs(self, inputs: tuple[Dataset, ...]) -> Dataset:
        clone = copy.copy(self)
        clone._inputs = inputs
        clone._spec_cache = _UNSET
        return clone

    def _rewrite(self, replace: Callable[[Dataset], Dataset | None]) -> Dataset:
        """Rebuild the pipeline bottom-up, replacing nodes for which ``replace`` returns one."""
        inputs = tuple(node._rewrite(replace) for node in self._inputs)
        unchanged = all(new is old for new, old in zip(inputs, self._inputs))
        node = self if unchanged else self._with_inputs(inputs)
        replacement = replace(node)
        return node if replacement is None else replacement

    def _with_own_state(self) -> Dataset:
        """This pipeline with its stateful nodes copied (a shuffle's count of passes).

        For one worker's copy of a pipeline read with other workers' copies: on
        TF each worker builds its own, so their k-th passes shuffle alike. Shared,
        reading W copies per pass would reshuffle W times, and the workers'
        shards of one pass would come from different orders.
        """
        return self._rewrite(
            lambda node: copy.copy(node) if isinstance(node, _ShuffleDataset) else None
        )

    def _shards_an_unseeded_shuffle(self) -> bool:
        """Whether a ``shard`` in the pipeline reads from a ``shuffle`` without a seed."""
        stack: list[tuple[Dataset, bool]] = [(self, False)]
        while stack:
            node, below_shard = stack.pop()
            if below_shard and isinstance(node, _ShuffleDataset) and not node._seeded:
                return True
            below = below_shard or isinstance(node, _ShardDataset)
            stack.extend((child, below) for child in node._inputs)
        return False

    def _find_file_source(self) -> _FileDataset | str:
        """The file source FILE sharding would shard, or TF's reason why there is none."""
        from polydist.data._sources import _FileDataset  # the sources subclass Dataset

        node: Dataset = self
        while not isinstance(node, _FileDataset):
            if node._passes_file_sharding:
                node = node._inputs[0]
            elif node._is_source:
                return f"Found an unshardable source dataset: {node._op_name}"
            else:
                return (
                    "Did not find a shardable source, walked to a node which is not a "
                    f"dataset: {node._op_name}"
                )
        return node

    def _file_sources(self) -> tuple[str, ...] | None:
        """Files of the pipeline's file source, or None if it is not read from files."""
        from polydist.data._sources import _FileDataset  # the sources subclass Dataset

        found = self._find_file_source()
        return found.filenames if isinstance(found, _FileDataset) else None

    # ------------------------------------------------------------------ sources

    @staticmethod
    def from_tensor_slices(tensors: Nest) -> Dataset:
        """One element per slice along the first dimension of every component.

        Python values convert as TF does: int -> int32, float -> float32,
        bool -> bool, str -> numpy str; a Python list is one array.
        """
        leaves, treespec = flatten(tensors)
        arrays = [_frozen(to_array(leaf)) for leaf in leaves]
        if not arrays:
            raise ValueError("from_tensor_slices needs at least one component, got an empty nest.")
        for i, array in enumerate(arrays):
            if array.ndim == 0:
                raise ValueError(
                    "Unbatching a tensor is only supported for rank >= 1; component "
                    f"{i} is a scalar. Use from_tensors for a single element."
                )
        sizes = sorted({array.shape[0] for array in arrays})
        if len(sizes) > 1:
            raise ValueError(
                f"Dimensions {sizes[0]} and {sizes[1]} are not compatible: every component "
                "passed to from_tensor_slices must have the same first dimension, got shapes "
                f"{[array.shape for array in arrays]}."
            )
        return _TensorSliceDataset(treespec, arrays)

    @staticmethod
    def from_tensors(tensors: Nest) -> Dataset:
        """A dataset of exactly one element, ``tensors`` (converted as in from_tensor_slices)."""
        return _TensorDataset(map_structure(lambda leaf: _frozen(to_array(leaf)), tensors))

    @staticmethod
    def range(
        start: int, stop: int | None = None, step: int = 1, *, output_type: DTypeLike = np.int64
    ) -> Dataset:
        """Like Python's ``range``; elements are 0-d int64 arrays, as ``tf.data.Dataset.range``."""
        if stop is None:
            start, stop = 0, start
        if step == 0:
            raise ValueError("Dataset.range: step must be a non-zero integer, got 0.")
        return _RangeDataset(int(start), int(stop), int(step), np.dtype(output_type))

    @staticmethod
    def from_generator(
        generator: Callable[[], Iterable[Nest]], output_signature: Nest | None = None
    ) -> Dataset:
        """Elements from ``generator()``, called anew for each iteration.

        With ``output_signature`` (a nest of ``TensorSpec``) each element is cast
        to it and checked, as TF does; without one, leaves convert like
        ``from_tensor_slices`` and ``element_spec`` is read from the first element.
        Each yielded array is copied as it is converted (TF makes a new tensor),
        so the generator may refill one buffer before every yield.
        """
        if not callable(generator):
            raise TypeError(
                f"`generator` must be a Python callable returning an iterable, got "
                f"{type(generator).__name__}; pass e.g. `lambda: my_iterable`."
            )
        from polydist.data._sources import _GeneratorDataset  # the sources subclass Dataset

        signature = None if output_signature is None else _check_signature(output_signature)
        return _GeneratorDataset(generator, signature)

    @staticmethod
    def from_files(
        filenames: FilePaths,
        reader: Callable[[str], Iterable[Nest]],
        output_signature: Nest | None = None,
    ) -> Dataset:
        """Elements read file by file: ``reader(path)`` yields the elements of one file.

        The file list stays visible to FILE auto-sharding, which gives worker
        ``w`` of ``W`` the files ``filenames[w::W]`` (like TFRecordDataset).
        As in ``from_generator``, each yielded array is copied as it is converted.
        """
        from polydist.data._sources import _FileDataset  # the sources subclass Dataset

        signature = None if output_signature is None else _check_signature(output_signature)
        return _FileDataset(_filename_tuple(filenames), reader, signature)

    # ----------------------------------------------------------- transformations

    def batch(self, batch_size: int, drop_remainder: bool = False) -> Dataset:
        """Stack ``batch_size`` consecutive elements; the last batch may be smaller."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be greater than zero, got {batch_size}.")
        return _BatchDataset(self, int(batch_size), bool(drop_remainder))

    def unbatch(self) -> Dataset:
        """Split every element along its first dimension into separate elements."""
        return _UnbatchDataset(self)

    def shard(self, num_shards: int, index: int) -> Dataset:
        """Keep elements ``index, index + num_shards, ...``."""
        if num_shards != SHARD_HINT:
            if num_shards < 1:
                raise ValueError(
                    "Number of shards must be greater than zero "
                    f"(currently num_shards = {num_shards})."
                )
            if not 0 <= index < num_shards:
                raise ValueError(
                    f"Index must be between 0 and {num_shards - 1} (currently index = {index})."
                )
        return _ShardDataset(self, int(num_shards), int(index))

    def repeat(self, count: int | None = None) -> Dataset:
        """Repeat ``count`` times; None or -1 repeats forever."""
        return _RepeatDataset(self, -1 if count is None else int(count))

    def map(self, map_func: Callable[..., Any]) -> Dataset:
        """Apply ``map_func`` to each element (a tuple element is passed as ``*args``).

        A list returned by ``map_func`` becomes a tuple, as in tf.data.
        """
        if not callable(map_func):
            raise TypeError(f"map_func must be callable, got {type(map_func).__name__}.")
        return _MapDataset(self, map_func)

    def filter(self, predicate: Callable[..., Any]) -> Dataset:
        """Keep elements for which ``predicate`` (called like map's function) is True."""
        if not callable(predicate):
            raise TypeError(f"predicate must be callable, got {type(predicate).__name__}.")
        return _FilterDataset(self, predicate)

    def take(self, count: int) -> Dataset:
        """The first ``count`` elements (all of them if ``count`` is -1)."""
        return _TakeDataset(self, int(count))

    def skip(self, count: int) -> Dataset:
        """All but the first ``count`` elements (none of them if ``count`` is -1)."""
        return _SkipDataset(self, int(count))

    def shuffle(
        self, buffer_size: int, seed: int | None = None, reshuffle_each_iteration: bool = True
    ) -> Dataset:
        """Shuffle with tf.data's buffer-sampling algorithm.

        A buffer is filled with the first ``buffer_size`` elements; each output
        is a uniformly random buffer slot, which is then refilled with the next
        input element (or, once the input is exhausted, with the buffer's last
        element, shrinking the buffer). ``buffer_size >= cardinality`` gives a
        uniform permutation. Random numbers come from
        ``numpy.random.default_rng([seed, epoch])`` where ``epoch`` counts
        iterations of this dataset when ``reshuffle_each_iteration`` is True and
        stays 0 otherwise; ``seed=None`` draws a seed once, when the dataset is
        built. The order is therefore deterministic given a seed but is not
        TF's order (TF uses Philox).
        """
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be greater than zero, got {buffer_size}.")
        return _ShuffleDataset(self, int(buffer_size), seed, bool(reshuffle_each_iteration))

    def prefetch(self, buffer_size: int) -> Dataset:
        """Read up to ``buffer_size`` elements ahead of the consumer (AUTOTUNE: 1).

        Elements and order are unchanged; only the time at which upstream
        elements are produced moves earlier, as with TF's background prefetch.
        """
        if buffer_size < 0 and buffer_size != AUTOTUNE:
            raise ValueError(f"buffer_size must be >= 0 or AUTOTUNE (-1), got {buffer_size}.")
        return _PrefetchDataset(self, int(buffer_size))


# ---------------------------------------------------------------------- sources


class _TensorSliceDataset(Dataset):
    _op_name = "TensorSliceDataset"
    _is_source = True

    def __init__(self, treespec: Any, arrays: list[np.ndarray[Any, Any]]) -> None:
        super().__init__()
        self._treespec = treespec
        self._arrays = arrays

    def _iterate(self) -> Iterator[Nest]:
        for i in builtins.range(self._arrays[0].shape[0]):
            yield unflatten(self._treespec, [array[i, ...] for array in self._arrays])

    def _compute_cardinality(self) -> int:
        return int(self._arrays[0].shape[0])

    def _compute_element_spec(self) -> Nest:
        return unflatten(self._treespec, [TensorSpec(a.shape[1:], a.dtype) for a in self._arrays])

    def _describe(self) -> str:
        return f"{self._op_name}({self._compute_cardinality()} x {self.element_spec!r})"


class _TensorDataset(Dataset):
    _op_name = "TensorDataset"
    _is_source = True

    def __init__(self, element: Nest) -> None:
        super().__init__()
        self._element = element

    def _iterate(self) -> Iterator[Nest]:
        return iter((self._element,))

    def _compute_cardinality(self) -> int:
        return 1

    def _compute_element_spec(self) -> Nest:
        return spec_of(self._element)

    def _describe(self) -> str:
        return f"{self._op_name}({self.element_spec!r})"


class _RangeDataset(Dataset):
    _op_name = "RangeDataset"
    _is_source = True

    def __init__(self, start: int, stop: int, step: int, dtype: np.dtype[Any]) -> None:
        super().__init__()
        self._range = builtins.range(start, stop, step)
        self._dtype = dtype

    def _iterate(self) -> Iterator[Nest]:
        for value in self._range:
            yield np.asarray(value, dtype=self._dtype)

    def _compute_cardinality(self) -> int:
        return len(self._range)

    def _compute_element_spec(self) -> Nest:
        return TensorSpec((), self._dtype)

    def _describe(self) -> str:
        r = self._range
        return f"{self._op_name}({r.start}, {r.stop}, {r.step}, {self._dtype})"


class _BatchDataset(Dataset):
    _op_name = "BatchDataset"
    _passes_file_sharding = True

    def __init__(self, source: Dataset, batch_size: int, drop_remainder: bool) -> None:
        super().__init__(source)
        self.batch_size = batch_size
        self.drop_remainder = drop_remainder

    def _describe(self) -> str:
        drop = self.drop_remainder
        return f"{self._op_name}(batch_size={self.batch_size}, drop_remainder={drop})"

    def _iterate(self) -> Iterator[Nest]:
        pending: list[Nest] = []
        for element in self._inputs[0]._iterate():
            pending.append(element)
            if len(pending) == self.batch_size:
                yield _stack(pending)
                pending = []
        if pending and not self.drop_remainder:
            yield _stack(pending)

    def _compute_cardinality(self) -> int:
        n = self._inputs[0].cardinality()
        if n in (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY):
            return n
        partial = 0 if n % self.batch_size == 0 or self.drop_remainder else 1
        return n // self.batch_size + partial

    def _compute_element_spec(self) -> Nest:
        leading = self.batch_size if self.drop_remainder else None
        return map_structure(
            lambda s: TensorSpec((leading, *s.shape), s.dtype), self._inputs[0].element_spec
        )


class _UnbatchDataset(Dataset):
    _op_name = "UnbatchDataset"
    _passes_file_sharding = True  # in kPassThroughOps of newer auto_shard.cc

    def _iterate(self) -> Iterator[Nest]:
        for element in self._inputs[0]._iterate():
            leaves, treespec = flatten(element)
            for i in builtins.range(_check_batched(leaves)):
                yield unflatten(treespec, [leaf[i, ...] for leaf in leaves])

    def _compute_cardinality(self) -> int:
        n = self._inputs[0].cardinality()
        if n in (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY):
            return n
        try:
            leaves, _ = flatten(self._inputs[0].element_spec)
        except _SpecInferenceError:
            return UNKNOWN_CARDINALITY
        # Like TF: the first component with a static leading size gives the ratio.
        known = [s.shape[0] for s in leaves if s.rank > 0 and s.shape[0] is not None]
        return n * known[0] if known and known[0] > 0 else UNKNOWN_CARDINALITY

    def _compute_element_spec(self) -> Nest:
        def unbatched(spec: TensorSpec) -> TensorSpec:
            if spec.rank == 0:
                raise ValueError("Cannot unbatch an input with scalar components.")
            return TensorSpec(spec.shape[1:], spec.dtype)

        return map_structure(unbatched, self._inputs[0].element_spec)


class _ShardDataset(Dataset):
    _op_name = "ShardDataset"
    _passes_file_sharding = True
    _passes_batch_size = True

    def __init__(self, source: Dataset, num_shards: int, index: int) -> None:
        super().__init__(source)
        self.num_shards = num_shards
        self.index = index

    def _describe(self) -> str:
        return f"{self._op_name}(num_shards={self.num_shards}, index={self.index})"

    def _iterate(self) -> Iterator[Nest]:
        if self.num_shards == SHARD_HINT:
            raise ValueError(
                "`Dataset.shard(SHARD_HINT, ...)` can only be used in combination with "
                "distributing the dataset under the HINT auto-shard policy, which replaces "
                "it with the worker count and index."
            )
        return itertools.islice(self._inputs[0]._iterate(), self.index, None, self.num_shards)

    def _compute_cardinality(self) -> int:
        n = self._inputs[0].cardinality()
        if n in (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY):
            return n
        if self.num_shards == SHARD_HINT:
            return UNKNOWN_CARDINALITY
        return n // self.num_shards + (1 if self.index < n % self.num_shards else 0)


class _RepeatDataset(Dataset):
    _op_name = "RepeatDataset"
    _passes_file_sharding = True
    _passes_batch_size = True

    def __init__(self, source: Dataset, count: int) -> None:
        super().__init__(source)
        self._count = count

    def _describe(self) -> str:
        return f"{self._op_name}({self._count})"

    def _iterate(self) -> Iterator[Nest]:
        if self._count >= 0:
            for _ in builtins.range(self._count):
                yield from self._inputs[0]._iterate()
            return
        while True:
            produced = False
            for element in self._inputs[0]._iterate():
                produced = True
                yield element
            if not produced:  # an empty input repeated forever is empty, as in TF
                return

    def _compute_cardinality(self) -> int:
        n = self._inputs[0].cardinality()
        if self._count < 0:
            return 0 if n == 0 else INFINITE_CARDINALITY
        if self._count == 0:
            return 0
        if n in (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY):
            return n
        return n * self._count


class _MapDataset(Dataset):
    _op_name = "MapDataset"
    _passes_file_sharding = True

    def __init__(self, source: Dataset, fn: Callable[..., Any]) -> None:
        super().__init__(source)
        self._fn = fn

    def _apply(self, element: Nest) -> Nest:
        result = _call(self._fn, element)
        if isinstance(result, list):
            result = tuple(result)  # tf.data treats a returned list as a tuple
        return map_structure(to_array, result)

    def _iterate(self) -> Iterator[Nest]:
        for element in self._inputs[0]._iterate():
            yield self._apply(element)

    def _compute_cardinality(self) -> int:
        return self._inputs[0].cardinality()

    def _compute_element_spec(self) -> Nest:
        input_spec = self._inputs[0].element_spec
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                first = spec_of(self._apply(_probe(input_spec, fill=0, unknown_size=1)))
                second = spec_of(self._apply(_probe(input_spec, fill=1, unknown_size=2)))
            merged = common_spec(first, second)
        except Exception:  # the function cannot run on synthetic data; use real data
            merged = None
        if merged is not None:
            return merged
        element = next(self._inputs[0]._iterate(), _END)
        if element is _END:
            raise _SpecInferenceError(
                "Cannot infer the element_spec of map(): the function fails on synthetic "
                "inputs and the input dataset is empty."
            )
        return with_unknown_dims(spec_of(self._apply(element)))


class _FilterDataset(Dataset):
    _op_name = "FilterDataset"
    _passes_file_sharding = True
    _passes_batch_size = True

    def __init__(self, source: Dataset, predicate: Callable[..., Any]) -> None:
        super().__init__(source)
        self._predicate = predicate

    def _iterate(self) -> Iterator[Nest]:
        for element in self._inputs[0]._iterate():
            if _as_bool(_call(self._predicate, element)):
                yield element

    def _compute_cardinality(self) -> int:
        return UNKNOWN_CARDINALITY


class _TakeDataset(Dataset):
    _op_name = "TakeDataset"
    _passes_file_sharding = True
    _passes_batch_size = True

    def __init__(self, source: Dataset, count: int) -> None:
        super().__init__(source)
        self._count = count

    def _describe(self) -> str:
        return f"{self._op_name}({self._count})"

    def _iterate(self) -> Iterator[Nest]:
        stop = None if self._count < 0 else self._count
        return itertools.islice(self._inputs[0]._iterate(), stop)

    def _compute_cardinality(self) -> int:
        n = self._inputs[0].cardinality()
        if n == UNKNOWN_CARDINALITY:
            return n
        if n == INFINITE_CARDINALITY:
            return self._count if self._count >= 0 else INFINITE_CARDINALITY
        return n if self._count < 0 else min(n, self._count)


class _SkipDataset(Dataset):
    _op_name = "SkipDataset"
    _passes_file_sharding = True
    _passes_batch_size = True

    def __init__(self, source: Dataset, count: int) -> None:
        super().__init__(source)
        self._count = count

    def _describe(self) -> str:
        return f"{self._op_name}({self._count})"

    def _iterate(self) -> Iterator[Nest]:
        if self._count < 0:
            return iter(())
        return itertools.islice(self._inputs[0]._iterate(), self._count, None)

    def _compute_cardinality(self) -> int:
        n = self._inputs[0].cardinality()
        if n in (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY):
            return n
        return 0 if self._count < 0 else max(0, n - self._count)


class _ShuffleDataset(Dataset):
    _op_name = "ShuffleDataset"
    _passes_file_sharding = True
    _passes_batch_size = True

    def __init__(
        self, source: Dataset, buffer_size: int, seed: int | None, reshuffle: bool
    ) -> None:
        super().__init__(source)
        self._buffer_size = buffer_size
        self._seeded = seed is not None
        if seed is None:  # one fresh seed per dataset, fixed across its iterations
            seed = int(np.random.default_rng().integers(2**63))
        self._seed = int(seed) % 2**64
        self._reshuffle = reshuffle
        self._epoch = 0

    def _describe(self) -> str:
        # An unseeded shuffle's drawn seed is not part of the pipeline: restore adopts
        # the saved one (see polydist.data._iterator).
        seed = self._seed if self._seeded else None
        return (
            f"{self._op_name}(buffer_size={self._buffer_size}, seed={seed}, "
            f"reshuffle_each_iteration={self._reshuffle})"
        )

    def _iterate(self) -> Iterator[Nest]:
        epoch = self._epoch
        if self._reshuffle:
            self._epoch += 1
        return self._sample(np.random.default_rng([self._seed, epoch]))

    def _sample(self, rng: np.random.Generator) -> Iterator[Nest]:
        upstream = self._inputs[0]._iterate()
        buffer = list(itertools.islice(upstream, self._buffer_size))
        while buffer:
            slot = int(rng.integers(len(buffer)))
            chosen = buffer[slot]
            refill = next(upstream, _END)
            if refill is _END:
                buffer[slot] = buffer[-1]
                buffer.pop()
            else:
                buffer[slot] = refill
            yield chosen

    def _compute_cardinality(self) -> int:
        return self._inputs[0].cardinality()


class _PrefetchDataset(Dataset):
    _op_name = "PrefetchDataset"
    _passes_file_sharding = True
    _passes_batch_size = True

    def __init__(self, source: Dataset, buffer_size: int) -> None:
        super().__init__(source)
        self._buffer_size = buffer_size

    def _describe(self) -> str:
        return ""  # reads ahead, the elements are the same

    def _iterate(self) -> Iterator[Nest]:
        ahead = 1 if self._buffer_size == AUTOTUNE else self._buffer_size
        upstream = self._inputs[0]._iterate()
        buffer = collections.deque(itertools.islice(upstream, ahead))
        if not ahead:
            yield from upstream
            return
        while buffer:
            element = buffer.popleft()
            refill = next(upstream, _END)
            if refill is not _END:
                buffer.append(refill)
            yield element

    def _compute_cardinality(self) -> int:
        return self._inputs[0].cardinality()


class _OptionsDataset(Dataset):
    _op_name = "OptionsDataset"
    _passes_file_sharding = True
    _passes_batch_size = True

    def __init__(self, source: Dataset, options: Options) -> None:
        super().__init__(source)
        self._options = options

    def _own_options(self) -> Options:
        return self._options

    def _describe(self) -> str:
        return ""

    def _iterate(self) -> Iterator[Nest]:
        return self._inputs[0]._iterate()

    def _compute_cardinality(self) -> int:
        return self._inputs[0].cardinality()
