"""What ``experimental_distribute_dataset`` and ``distribute_datasets_from_function``
are given: the checks of their options, dataset functions and batching, TF1's legacy
split of an input, and the collation of plain Python elements into arrays.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from polydist.data._dataset import (
    Dataset,
    _OptionsDataset,
    _PrefetchDataset,
    _ShardDataset,
)
from polydist.data._elements import _SpecInferenceError
from polydist.data._input import (
    InputOptions,
    validate_input_options,
)
from polydist.data._nest import flatten
from polydist.data._rebatch import (
    _LegacyRebatchDataset,
)
from polydist.data._sources import _IterableDataset

if TYPE_CHECKING:
    pass


def _legacy_split_input(
    pipelines: Sequence[Dataset], keep: tuple[int, ...] | None, num_replicas: int
) -> Dataset | None:
    """The input of a one-worker pipeline that is only a legacy split, else None.

    rebatch_and_shard gives one worker prefetch / options / shard(1, 0) over a
    RebatchDataset: all no-ops but the split (prefetch only reads ahead).
    """
    if len(pipelines) != 1 or keep is not None or num_replicas < 2:
        return None
    node = pipelines[0]
    while True:
        no_op_shard = isinstance(node, _ShardDataset) and (node.num_shards, node.index) == (1, 0)
        if no_op_shard or isinstance(node, _PrefetchDataset | _OptionsDataset):
            node = node._inputs[0]
        elif isinstance(node, _LegacyRebatchDataset) and node.num_replicas == num_replicas:
            return node._inputs[0]
        else:
            return None


def _check_options(options: object, *, from_function: bool) -> InputOptions | None:
    if options is not None and not isinstance(options, InputOptions):
        raise TypeError(
            f"options must be a polydist.data.InputOptions or None, got "
            f"{type(options).__name__} {options!r}."
        )
    validate_input_options(options, from_function=from_function)
    if options is not None:
        buffer = options.experimental_per_replica_buffer_size
        if isinstance(buffer, bool) or not isinstance(buffer, int | np.integer) or buffer < 0:
            raise ValueError(
                "InputOptions.experimental_per_replica_buffer_size must be an int >= 0 (the "
                f"number of steps read ahead), got {buffer!r}."
            )
        options = options._replace(experimental_per_replica_buffer_size=int(buffer))
    return options


def _plain_scalars(value: object) -> bool:
    """A Python (or NumPy) scalar, or a (nested) list of them: one array in tf.data."""
    if isinstance(value, list):
        return all(_plain_scalars(v) for v in value)
    return isinstance(value, bool | int | float | complex | str | bytes | np.generic)


def _collated(element: Any) -> Any:
    """A plain iterable's batch, reading a list that holds arrays as a structure.

    torch's ``default_collate`` makes the batches of a dataset of tuples (a
    ``TensorDataset``) *lists* of tensors, ``[x, y]``, where tf.data's nest
    would read a list as one array (stacking ``x`` and ``y``, or failing when
    their shapes differ). So in the batches of a plain iterable (a torch
    ``DataLoader``, a list, a generator) a list whose items are arrays or nests
    is a tuple; a list of Python numbers (or of such lists) stays one array, as
    in tf.data. Returns ``element`` itself when it holds no such list.
    """
    if isinstance(element, list):
        if _plain_scalars(element):
            return element
        return tuple(_collated(v) for v in element)
    if isinstance(element, tuple):
        items = [_collated(v) for v in element]
        if all(a is b for a, b in zip(items, element)):
            return element
        return type(element)(*items) if hasattr(element, "_fields") else tuple(items)
    if isinstance(element, dict):
        changed = {k: _collated(v) for k, v in element.items()}
        if all(changed[k] is v for k, v in element.items()):
            return element
        try:
            return type(element)(changed)
        except TypeError:  # e.g. a defaultdict
            return changed
    return element


class _Collated:
    """A re-iterable plain source whose batches go through :func:`_collated`."""

    __slots__ = ("_source",)

    def __init__(self, source: Iterable[Any]) -> None:
        self._source = source

    def __iter__(self) -> Iterator[Any]:
        return map(_collated, self._source)


class _Calls:
    """A generator function as a re-iterable: each ``iter()`` calls it (one pass)."""

    __slots__ = ("_function",)

    def __init__(self, function: Callable[[], Iterable[Any]]) -> None:
        self._function = function

    def __iter__(self) -> Iterator[Any]:
        return iter(self._function())


def _check_generator_function(fn: Callable[..., Any], what: str) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: just call it
        return
    required = [
        p
        for p in signature.parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if required:
        raise TypeError(
            f"{what} got a function that takes arguments ({', '.join(p.name for p in required)}). "
            "A generator function given here is called with no arguments; a function of an "
            "InputContext belongs in strategy.distribute_datasets_from_function(dataset_fn)."
        )


def _check_batched(source: Dataset, num_replicas: int) -> None:
    if isinstance(source, _IterableDataset) and source.peek_begins_a_pass:
        # Reading a DataLoader now would draw a shuffle the user did not ask
        # for: its batches are checked as they are split (_split_elements).
        return
    try:
        spec = source.element_spec
    except _SpecInferenceError:  # an empty source: there is nothing to split
        return
    leaves, _ = flatten(spec)
    scalars = [i for i, leaf in enumerate(leaves) if leaf.rank == 0]
    if scalars:
        raise ValueError(
            "experimental_distribute_dataset splits every element along its first (batch) "
            f"dimension across the {num_replicas} replicas, but the dataset is not batched: its "
            f"element_spec is {spec!r}, with scalar component(s) {scalars}. Batch it with the "
            "global batch size first, e.g. dataset.batch(global_batch_size), or give each "
            "replica its own pipeline with strategy.distribute_datasets_from_function."
        )
