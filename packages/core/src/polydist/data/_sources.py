"""The sources of a ``Dataset`` whose elements come from Python code: a generator
function, files read line by line (``TextLineDataset``), a one-shot iterator, and a
re-iterable such as a list or a torch ``DataLoader`` (one ``iter()`` per pass)."""

from __future__ import annotations

import abc
import collections
import contextvars
import copy
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import ClassVar

import numpy as np

from polydist.data._dataset import _END, _UNSET, UNKNOWN_CARDINALITY, Dataset
from polydist.data._elements import (
    FilePaths,
    _conform,
    _filename_tuple,
    _read_lines,
    _SpecInferenceError,
)
from polydist.data._nest import Nest, map_structure, to_array
from polydist.data._spec import TensorSpec, spec_of, with_unknown_dims

__all__ = ["TextLineDataset", "as_dataset"]


class _ProducedDataset(Dataset):
    """A source whose elements come from Python code, converted on the way out."""

    _is_source = True
    _producer: ClassVar[str]

    def __init__(self, signature: Nest | None) -> None:
        super().__init__()
        self._signature = signature

    @abc.abstractmethod
    def _produce(self) -> Iterable[Nest]: ...

    # Whether elements are copied off the producer's arrays (see _conform).
    _copies = True

    def _iterate(self) -> Iterator[Nest]:
        for value in self._produce():
            yield _conform(value, self._signature, self._producer, copy=self._copies)

    def _compute_cardinality(self) -> int:
        return UNKNOWN_CARDINALITY

    def _compute_element_spec(self) -> Nest:
        if self._signature is not None:
            return self._signature
        first = next(iter(self), _END)
        if first is _END:
            raise _SpecInferenceError(
                f"Cannot infer the element_spec of {self._op_name}: it produced no element. "
                "Pass output_signature=... (a nest of TensorSpec)."
            )
        return with_unknown_dims(spec_of(first))


class _GeneratorDataset(_ProducedDataset):
    _op_name = "GeneratorDataset"
    _producer = "`generator`"

    def __init__(self, generator: Callable[[], Iterable[Nest]], signature: Nest | None) -> None:
        super().__init__(signature)
        self._generator = generator

    def _produce(self) -> Iterable[Nest]:
        return self._generator()


class _FileDataset(_ProducedDataset):
    _op_name = "FileDataset"
    _producer = "`reader`"

    def __init__(
        self,
        filenames: tuple[str, ...],
        reader: Callable[[str], Iterable[Nest]],
        signature: Nest | None,
    ) -> None:
        super().__init__(signature)
        self._filenames = filenames
        self._reader = reader

    @property
    def filenames(self) -> tuple[str, ...]:
        return self._filenames

    def _describe(self) -> str:
        return f"{self._op_name}({list(self._filenames)})"

    def _produce(self) -> Iterable[Nest]:
        for filename in self._filenames:
            yield from self._reader(filename)

    def _with_files(self, filenames: tuple[str, ...]) -> _FileDataset:
        clone = copy.copy(self)
        clone._filenames = filenames
        clone._spec_cache = _UNSET
        return clone


class TextLineDataset(_FileDataset):
    """Lines of text files as 0-d numpy str arrays (``tf.data.TextLineDataset``).

    Files are read in order; the newline (and a ``\\r`` before it) is removed.
    TF yields bytes; this yields ``str`` decoded as UTF-8.
    """

    _op_name = "TextLineDataset"

    def __init__(self, filenames: FilePaths) -> None:
        super().__init__(_filename_tuple(filenames), _read_lines, TensorSpec((), np.str_))


# ------------------------------------------------------------- transformations


class _IteratorDataset(_ProducedDataset):
    """A one-shot iterator as a source; inferring its spec keeps the element it reads."""

    _op_name = "GeneratorDataset"
    _producer = "`iterator`"
    _replayable = False

    def __init__(self, iterator: Iterator[Nest]) -> None:
        super().__init__(None)
        self._iterator = iterator
        self._pending: collections.deque[Nest] = collections.deque()

    def _produce(self) -> Iterator[Nest]:
        while self._pending:
            yield self._pending.popleft()
        yield from self._iterator

    def _compute_element_spec(self) -> Nest:
        first = next(self._iterator, _END)
        if first is _END:
            raise _SpecInferenceError(
                "Cannot infer the element_spec of an exhausted iterator: it produced no element."
            )
        self._pending.append(first)
        return with_unknown_dims(spec_of(map_structure(to_array, first)))


# The passes over plain iterables that the reader running now began ahead, by
# id of the _IterableDataset: a DistributedIterator calls iter() on its sources
# when it is made, as iter() of the source itself would, and its reads take them.
BEGUN_PASSES: contextvars.ContextVar[Mapping[int, collections.deque[Iterator[Nest]]] | None] = (
    contextvars.ContextVar("BEGUN_PASSES", default=None)
)


class _IterableDataset(_ProducedDataset):
    """A re-iterable (a list, a torch ``DataLoader``) as a source: each pass is one ``iter()``.

    Reading it never begins a pass of its own: inferring the spec reads the
    first element of the pass that the next iteration continues, and once a
    pass has produced an element the spec comes from that element. So a
    ``DataLoader`` that shuffles draws one permutation (and moves torch's
    global RNG) per iteration the user asks for, as without polydist.
    """

    _op_name = "GeneratorDataset"
    _producer = "`iterable`"

    def __init__(self, iterable: Iterable[Nest], *, free_to_read: bool | None = None) -> None:
        super().__init__(None)
        self._iterable = iterable
        # Whether a pass has no effects (a list); by default, for a list or tuple.
        self._free_to_read = (
            isinstance(iterable, list | tuple) if free_to_read is None else free_to_read
        )
        self._peeked: tuple[Iterator[Nest], object] | None = None
        # A list's elements exist before the pass: nothing refills them, no copy.
        self._copies = not self._free_to_read

    @property
    def peek_begins_a_pass(self) -> bool:
        """Whether inferring the spec now would call ``iter()`` on the source.

        False for a list or tuple (reading one has no effects) and once the
        spec is known.
        """
        known = self._spec_cache is not _UNSET or self._peeked is not None
        return not known and not self._free_to_read

    def begin_pass(self) -> Iterator[Nest]:
        """``iter()`` of the source, now: the pass a spec peek began, else a new one."""
        if self._peeked is not None:
            iterator, first = self._peeked
            self._peeked = None
            return iterator if first is _END else itertools.chain([first], iterator)
        return iter(self._iterable)

    def _produce(self) -> Iterator[Nest]:
        passes = BEGUN_PASSES.get()
        begun = None if passes is None else passes.get(id(self))
        yield from begun.popleft() if begun else self.begin_pass()

    def _iterate(self) -> Iterator[Nest]:
        for value in super()._iterate():
            if self._spec_cache is _UNSET:  # known from the data read: no peek later
                self._spec_cache = with_unknown_dims(spec_of(value))
            yield value

    def _compute_element_spec(self) -> Nest:
        if self._peeked is None:
            iterator = self.begin_pass()
            self._peeked = (iterator, next(iterator, _END))
        first = self._peeked[1]
        if first is _END:
            raise _SpecInferenceError(
                f"Cannot infer the element_spec of {self._op_name}: the iterable produced no "
                "element."
            )
        return with_unknown_dims(spec_of(_conform(first, None, self._producer, copy=False)))


def as_dataset(source: object) -> Dataset:
    """``source`` itself if it is a Dataset, else a generator source over the iterable.

    A re-iterable (a list, a data loader) is read afresh on each iteration,
    with one ``iter()`` of it per pass (see ``_IterableDataset``); a one-shot
    iterator is read once.
    """
    if isinstance(source, Dataset):
        return source
    if isinstance(source, Iterator):
        return _IteratorDataset(source)
    if not isinstance(source, Iterable):
        raise TypeError(
            f"Expected a polydist.data.Dataset or an iterable of elements, got "
            f"{type(source).__name__}."
        )
    return _IterableDataset(source)
