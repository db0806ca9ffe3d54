"""``IndexedSlices``: a sparse set of rows (TF's ``tf.IndexedSlices``), and how they move.

A variable's ``scatter_*`` methods take one as ``sparse_delta``. Across
replicas they combine the way TF combines them: a SUM concatenates every
replica's values and indices in replica order (their dense sums then add up:
TF's ``AggregateIndexedSlicesGradients``), a MEAN also divides the values by
the number of replicas. Both are ``all_gather``s of the values and the
indices, never a sum, so no backend needs a sparse collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from polydist._base.arrays import convert_to_array, describe, dtype_name, mean_from_sum
from polydist._base.reduce_op import ReduceOp
from polydist.errors import InvalidArgumentError

if TYPE_CHECKING:
    from polydist.backend._contract import Backend

__all__ = ["IndexedSlices"]


class IndexedSlices:
    """A sparse representation of some rows of a dense array (TF's ``tf.IndexedSlices``).

    ``IndexedSlices(values, indices, dense_shape=None)``: row ``indices[i]``
    of the dense array gets ``values[i]``, so ``values.shape`` is
    ``indices.shape + dense_shape[1:]``. ``values`` and ``indices`` are arrays
    of any backend (Python lists are converted with TF's dtypes: ``[1.0]`` is
    float32, ``[1]`` int32); ``indices`` must be integers. ``dense_shape``,
    optional, is the dense array's shape as a tuple of ints.

    Pass one as ``sparse_delta`` to ``Variable.scatter_add`` and the other
    ``scatter_*`` methods. Only what those need is here (TF's class also has
    ``device``, ``op``, ``graph``, ...).
    """

    __slots__ = ("_dense_shape", "_indices", "_values")

    def __init__(self, values: Any, indices: Any, dense_shape: Any = None) -> None:
        self._values = convert_to_array(values)
        self._indices = convert_to_array(indices)
        if not dtype_name(self._indices.dtype).startswith(("int", "uint")):
            raise TypeError(
                f"IndexedSlices indices must be integers, got {describe(self._indices)}. "
                "Pass the row numbers as an int32 or int64 array."
            )
        self._dense_shape = None if dense_shape is None else _as_shape(dense_shape)

    @property
    def values(self) -> Any:
        """The rows: ``values[i]`` is row ``indices[i]`` of the dense array."""
        return self._values

    @property
    def indices(self) -> Any:
        """The row numbers of ``values`` (integers)."""
        return self._indices

    @property
    def dense_shape(self) -> tuple[int, ...] | None:
        """The shape of the dense array, or ``None`` if it was not given."""
        return self._dense_shape

    @property
    def dtype(self) -> Any:
        """The dtype of ``values``."""
        return self._values.dtype

    def __repr__(self) -> str:
        return (
            f"IndexedSlices(indices={self._indices!r}, values={self._values!r}, "
            f"dense_shape={self._dense_shape!r})"
        )


def _as_shape(dense_shape: Any) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in dense_shape)
    except TypeError:
        raise TypeError(
            f"IndexedSlices dense_shape must be a sequence of ints (the dense array's shape), "
            f"got {type(dense_shape).__name__} {dense_shape!r}."
        ) from None
    if any(d < 0 for d in shape):
        raise ValueError(f"IndexedSlices dense_shape must not be negative, got {shape}.")
    return shape


def broadcast(backend: Backend, value: IndexedSlices, devices: Sequence[str]) -> list[Any]:
    """``value`` copied to each of ``devices``: one ``IndexedSlices`` per device."""
    values = backend.broadcast(value.values, devices)
    indices = backend.broadcast(value.indices, devices)
    return [IndexedSlices(v, i, value.dense_shape) for v, i in zip(values, indices)]


def reduce(
    backend: Backend,
    reduce_op: ReduceOp,
    components: Sequence[IndexedSlices],
    placed_on: Sequence[str],
    devices: Sequence[str],
    count: int | None = None,
) -> list[IndexedSlices]:
    """The SUM or MEAN of one ``IndexedSlices`` per replica (``placed_on[r]`` holds
    replica ``r``'s), on each of ``devices``: every replica's rows, concatenated in
    replica order; MEAN divides the values by the number of replicas (TF): ``count``,
    default ``len(components)`` (a gather across processes: every worker's replicas)."""
    _check_mergeable(components)
    values = [backend.place(c.values, d) for c, d in zip(components, placed_on)]
    indices = [backend.place(c.indices, d) for c, d in zip(components, placed_on)]
    all_values = backend.all_gather(values, 0, devices)
    all_indices = backend.all_gather(indices, 0, devices)
    if reduce_op is ReduceOp.MEAN:
        xp = backend.array_namespace()
        n = len(components) if count is None else count
        all_values = [mean_from_sum(xp, v, n) for v in all_values]
    shape = components[0].dense_shape
    return [IndexedSlices(v, i, shape) for v, i in zip(all_values, all_indices)]


def _check_mergeable(components: Sequence[IndexedSlices]) -> None:
    first = components[0]
    for r, c in enumerate(components):
        rows = c.values.shape[0] if len(c.values.shape) else None
        if len(c.indices.shape) != 1 or rows != c.indices.shape[0]:
            raise InvalidArgumentError(
                f"Cannot reduce IndexedSlices across replicas: replica {r} has indices "
                f"{describe(c.indices)} and values {describe(c.values)}; combining them "
                "needs 1-D indices and values with one row per index."
            )
        same = (
            tuple(c.values.shape[1:]) == tuple(first.values.shape[1:])
            and dtype_name(c.values.dtype) == dtype_name(first.values.dtype)
            and dtype_name(c.indices.dtype) == dtype_name(first.indices.dtype)
        )
        if not same:
            raise InvalidArgumentError(
                f"Cannot reduce IndexedSlices across replicas: replica 0 has values "
                f"{describe(first.values)} and indices {describe(first.indices)}, replica {r} "
                f"has {describe(c.values)} and {describe(c.indices)}. The rows must have the "
                "same shape and dtype on every replica (only their number may differ)."
            )
