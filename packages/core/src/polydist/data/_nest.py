"""Nests of NumPy arrays with tf.data's conventions, on top of optree.

tf.data's nest (``tf.data.util.nest``) treats tuples, namedtuples and dicts as
structure and a Python list as one value (it becomes a tensor); None is a leaf.
``polydist._valuetypes.nest`` follows ``tf.nest`` instead, where lists are structure, which
is why the input pipeline has its own helpers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import optree

__all__ = ["Nest", "flatten", "map_structure", "to_array", "unflatten"]

# A dataset element: a tuple / namedtuple / dict nest whose leaves are numpy arrays.
Nest = Any

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _is_list(value: object) -> bool:
    return isinstance(value, list)


def flatten(nest: Nest) -> tuple[list[Any], optree.PyTreeSpec]:
    """Leaves and structure of ``nest`` (lists are leaves, None is a leaf)."""
    return optree.tree_flatten(nest, is_leaf=_is_list, none_is_leaf=True)


def unflatten(treespec: optree.PyTreeSpec, leaves: list[Any]) -> Nest:
    return optree.tree_unflatten(treespec, leaves)


def map_structure(fn: Callable[..., Any], nest: Nest, *rest: Nest) -> Nest:
    return optree.tree_map(fn, nest, *rest, is_leaf=_is_list, none_is_leaf=True)


def _python_leaves(value: object, out: list[object]) -> bool:
    """Collect the scalars of a (nested) Python list; False if any is not plain Python."""
    if isinstance(value, list):
        return all(_python_leaves(v, out) for v in value)
    if isinstance(value, bool | int | float | complex | str | bytes):
        out.append(value)
        return True
    return False


def _python_dtype(scalars: list[object]) -> np.dtype[Any] | None:
    """The dtype TF's tensor conversion gives plain Python values (None: let numpy decide)."""
    if not scalars:
        return np.dtype(np.float32)  # tf.constant([]) is float32
    if all(isinstance(s, bool) for s in scalars):
        return np.dtype(np.bool_)
    ints = [s for s in scalars if isinstance(s, int) and not isinstance(s, bool)]
    if len(ints) == len(scalars):
        fits = all(_INT32_MIN <= s <= _INT32_MAX for s in ints)
        return np.dtype(np.int32 if fits else np.int64)
    if all(isinstance(s, int | float) and not isinstance(s, bool) for s in scalars):
        return np.dtype(np.float32)
    if all(isinstance(s, complex | int | float) for s in scalars):
        return np.dtype(np.complex128)
    return None


def to_array(value: object) -> np.ndarray[Any, Any]:
    """Convert one leaf the way ``tf.convert_to_tensor`` would, but to numpy.

    NumPy arrays and scalars keep their dtype; Python ``int`` becomes int32
    (int64 when it does not fit), ``float`` float32, ``bool`` bool, ``str`` a
    numpy str array. Anything else array-like (a jax or torch CPU array) goes
    through ``np.asarray``.
    """
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, np.generic):
        return np.asarray(value)
    if value is None:
        raise TypeError(
            "A dataset element component is None, which has no array value; "
            "return or pass an array, a Python number or a string instead."
        )
    scalars: list[object] = []
    if _python_leaves(value, scalars):
        dtype = _python_dtype(scalars)
        return np.asarray(value, dtype=dtype) if dtype is not None else np.asarray(value)
    array = np.asarray(value)
    if array.dtype == np.dtype(object):
        raise TypeError(
            f"Cannot convert a value of type {type(value).__name__} to an array for a "
            "dataset element; expected a numpy array, an array-like, a Python number or str."
        )
    return array
