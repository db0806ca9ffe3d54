"""The arithmetic of the variables' ``scatter_*`` methods, on host NumPy arrays.

TF's CPU kernels apply the updates one index after the other, so a repeated
index gets every one of its updates (``scatter_add`` of ``[1, 2]`` at
``[0, 0]`` adds 3; ``scatter_update`` keeps the last). NumPy's unbuffered
``ufunc.at`` does the same, in the same order. Indices are checked the way
TF checks them: an index outside ``[0, dim)`` (negative ones included) is an
``InvalidArgumentError``. The caller (``polydist._valuetypes.variables``) has already
cast the updates to the variable's dtype.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from polydist.errors import InvalidArgumentError

__all__ = ["OPS", "batch_to_nd_indices", "scatter_nd_rows", "scatter_rows"]

_Array = npt.NDArray[Any]

#: The scatter op of each method (``scatter_nd_*`` and ``batch_scatter_update``
#: use the same ops).
OPS = {
    "scatter_add": "add",
    "scatter_sub": "sub",
    "scatter_mul": "mul",
    "scatter_div": "div",
    "scatter_min": "min",
    "scatter_max": "max",
    "scatter_update": "update",
    "batch_scatter_update": "update",
    "scatter_nd_add": "add",
    "scatter_nd_sub": "sub",
    "scatter_nd_update": "update",
}

_UFUNCS = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,
    "min": np.minimum,
    "max": np.maximum,
}


def check_dtype(op: str, method: str, dtype: np.dtype[Any], name: str) -> None:
    """TF's scatter kernels: arithmetic needs numbers, min/max real numbers."""
    if op == "update":
        return
    if dtype.kind == "b" or (op in ("min", "max") and dtype.kind == "c"):
        what = "bool" if dtype.kind == "b" else "complex"
        allowed = "real numbers" if op in ("min", "max") else "numbers"
        raise TypeError(
            f"{method} cannot update variable {name!r} of dtype {dtype}: TF's {method} takes "
            f"{allowed}, not {what}. Use scatter_update, or a variable of a numeric dtype."
        )


def scatter_rows(
    base: _Array, indices: _Array, updates: _Array, op: str, method: str, name: str
) -> _Array:
    """``base`` (a fresh array, updated in place and returned) with ``updates`` applied to
    the rows ``indices`` names along axis 0; ``updates.shape`` must be
    ``indices.shape + base.shape[1:]``, or ``()`` (one value for every named row)."""
    _check_integer(indices, method)
    if base.ndim == 0:
        raise InvalidArgumentError(
            f"{method}: variable {name!r} is a scalar, which has no rows to scatter into. "
            "Use assign (or assign_add, ...) for a scalar variable."
        )
    expected = tuple(indices.shape) + tuple(base.shape[1:])
    if updates.ndim and tuple(updates.shape) != expected:
        raise InvalidArgumentError(
            f"{method} on variable {name!r} of shape {tuple(base.shape)}: the values must have "
            f"shape indices.shape + variable.shape[1:] = {expected} (or be a scalar), got "
            f"{tuple(updates.shape)} for indices of shape {tuple(indices.shape)}."
        )
    flat = indices.reshape(-1).astype(np.int64)
    bad = np.flatnonzero((flat < 0) | (flat >= base.shape[0]))
    if bad.size:
        i = int(bad[0])
        position = np.unravel_index(i, indices.shape) if indices.ndim > 1 else (i,)
        raise InvalidArgumentError(
            f"{method} on variable {name!r}: indices[{', '.join(map(str, position))}] = "
            f"{int(flat[i])} is not in [0, {base.shape[0]}). Indices name rows of the variable "
            "and must be in range (negative indices are not allowed)."
        )
    rows = updates if not updates.ndim else updates.reshape((flat.size, *base.shape[1:]))
    _apply(base, flat, rows, op, method, name)
    return base


def scatter_nd_rows(
    base: _Array, indices: _Array, updates: _Array, op: str, method: str, name: str
) -> _Array:
    """``base`` (updated in place and returned) with ``updates`` applied at ``indices``,
    whose last dimension K indexes the first K dimensions (``tf.scatter_nd``'s layout:
    ``updates.shape == indices.shape[:-1] + base.shape[K:]``)."""
    _check_integer(indices, method)
    shape = tuple(base.shape)
    k = indices.shape[-1] if indices.ndim else 0
    if indices.ndim == 0 or not 1 <= k <= len(shape):
        raise InvalidArgumentError(
            f"{method} on variable {name!r} of shape {shape}: indices must have shape "
            f"[..., K] with 1 <= K <= {len(shape)} (K indexes the first K dimensions), got "
            f"{tuple(indices.shape)}."
        )
    expected = tuple(indices.shape[:-1]) + shape[k:]
    if tuple(updates.shape) != expected:
        raise InvalidArgumentError(
            f"{method} on variable {name!r} of shape {shape}: updates must have shape "
            f"indices.shape[:-1] + variable.shape[{k}:] = {expected}, got "
            f"{tuple(updates.shape)}."
        )
    points = indices.reshape(-1, k).astype(np.int64)
    bad = np.flatnonzero(((points < 0) | (points >= np.asarray(shape[:k]))).any(axis=1))
    if bad.size:
        i = int(bad[0])
        raise InvalidArgumentError(
            f"{method} on variable {name!r}: indices[{i}] = {points[i].tolist()} does not "
            f"index into the variable's shape {list(shape)} (negative indices are not "
            "allowed)."
        )
    flat = np.asarray(np.ravel_multi_index(tuple(points.T), shape[:k]), dtype=np.int64)
    rows = base.reshape((math.prod(shape[:k]), *shape[k:]))  # a view: updates base
    _apply(rows, flat, updates.reshape((flat.size, *shape[k:])), op, method, name)
    return base


def batch_to_nd_indices(
    indices: _Array, updates: _Array, shape: tuple[int, ...], method: str, name: str
) -> _Array:
    """TF's ``batch_scatter_update``: indices ``[b_1, ..., b_n, j]`` name row
    ``indices[b_1, ..., b_n, j]`` of ``variable[b_1, ..., b_n]``; returns those as
    ``scatter_nd`` indices (the batch position followed by the index)."""
    _check_integer(indices, method)
    expected = tuple(indices.shape) + shape[indices.ndim :]
    if not 1 <= indices.ndim <= len(shape) or tuple(updates.shape) != expected:
        raise InvalidArgumentError(
            f"{method} on variable {name!r} of shape {shape}: sparse_delta.indices must have "
            f"rank 1 to {len(shape)} and its values shape indices.shape + "
            f"variable.shape[indices.ndim:]; got indices of shape {tuple(indices.shape)} and "
            f"values of shape {tuple(updates.shape)}."
        )
    batch = np.indices(indices.shape, dtype=np.int64)[:-1]  # the b_1..b_n coordinates
    return np.stack([*batch, indices.astype(np.int64)], axis=-1)


def _check_integer(indices: _Array, method: str) -> None:
    if indices.dtype.kind not in "iu":
        raise TypeError(
            f"{method}: indices must be integers, got dtype {indices.dtype}. Pass row "
            "numbers as an int32 or int64 array."
        )


def _apply(base: _Array, flat: _Array, rows: _Array, op: str, method: str, name: str) -> None:
    if op == "update":
        base[flat] = rows  # a repeated index keeps its last update, as TF's CPU kernel
    elif op == "div" and base.dtype.kind in "iu":
        _divide_integers(base, flat, rows, method, name)
    else:
        with np.errstate(all="ignore"):  # inf/nan are results, as in TF
            _UFUNCS[op].at(base, flat, rows)


def _divide_integers(base: _Array, flat: _Array, rows: _Array, method: str, name: str) -> None:
    # C++ integer division (TF's kernel): truncates toward zero, one update at a time.
    rows = np.broadcast_to(rows, (flat.size, *base.shape[1:]))
    if np.any(rows == 0):
        raise InvalidArgumentError(
            f"{method} on variable {name!r}: integer division by zero in the updates."
        )
    for i, row in zip(flat.tolist(), rows):
        quotient = np.abs(base[i]) // np.abs(row)
        base[i] = np.where((base[i] < 0) != (row < 0), -quotient, quotient)
