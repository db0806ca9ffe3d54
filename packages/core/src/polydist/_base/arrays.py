"""Array rules shared by every backend: TF's conversions and the MEAN rule."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from polydist.errors import InvalidArgumentError

__all__ = [
    "check_summable",
    "convert_to_array",
    "describe",
    "dtype_name",
    "is_array",
    "is_integral",
    "mean_from_sum",
]

_INT32 = np.iinfo(np.int32)


def is_array(x: object) -> bool:
    """Whether ``x`` is an array of some library (it has a shape and a dtype; NumPy
    scalars are not)."""
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, np.generic)


def convert_to_array(value: Any) -> Any:
    """TF's ``convert_to_tensor`` dtype policy for Python values.

    Python ``int`` becomes int32 (int64 if it does not fit), ``float`` float32,
    ``bool`` bool, ``complex`` complex128; lists and tuples of them likewise.
    Arrays (anything with ``shape`` and ``dtype``) are returned unchanged.
    """
    if is_array(value):
        return value
    if isinstance(value, np.generic):
        return np.asarray(value)
    if isinstance(value, bool):
        return np.asarray(value, dtype=np.bool_)
    if isinstance(value, int):
        return np.asarray(value, dtype=np.int32 if _INT32.min <= value <= _INT32.max else np.int64)
    if isinstance(value, float):
        return np.asarray(value, dtype=np.float32)
    if isinstance(value, complex):
        return np.asarray(value, dtype=np.complex128)
    if isinstance(value, list | tuple):
        arr = np.asarray(value)
        if arr.dtype == np.float64 and not _contains_numpy(value):
            return arr.astype(np.float32)
        fits_int32 = arr.size == 0 or (_INT32.min <= arr.min() and arr.max() <= _INT32.max)
        if arr.dtype == np.int64 and fits_int32 and not _contains_numpy(value):
            return arr.astype(np.int32)
        return arr
    raise TypeError(
        f"Cannot convert {type(value).__name__} {value!r} to an array: expected an array, a "
        "Python number, or a list of numbers."
    )


def _contains_numpy(value: Any) -> bool:
    if isinstance(value, list | tuple):
        return any(_contains_numpy(v) for v in value)
    return isinstance(value, np.generic | np.ndarray)


def is_integral(xp: Any, dtype: Any) -> bool:
    """Integer or bool, for any backend's dtype (ml_dtypes' bfloat16 included)."""
    try:
        return bool(xp.isdtype(dtype, ("integral", "bool")))
    except TypeError:
        # NumPy's isdtype refuses dtypes it does not define (ml_dtypes' bfloat16,
        # float8_*, int4): only its own kinds can be integral here.
        return getattr(dtype, "kind", None) in ("b", "i", "u")


def is_floating(xp: Any, dtype: Any) -> bool:
    """Real or complex floating point, for any backend's dtype (ml_dtypes' bfloat16 and
    float8_* included)."""
    try:
        return bool(xp.isdtype(dtype, ("real floating", "complex floating")))
    except TypeError:  # a dtype NumPy does not define: ml_dtypes' floats are named so
        return dtype_name(dtype).startswith(("bfloat", "float"))


def divide_exactly(xp: Any, total: Any, count: Any) -> Any:
    """``total / count`` (a float or complex array by an int or a 0-d array), correctly
    rounded; a complex ``total`` has each part divided on its own.

    XLA turns ``x / n`` into ``x * (1/n)``, 1 ulp off for a third of values, and
    complex divisions in NumPy, torch and XLA multiply by a reciprocal too: a
    namespace that does so gives its own ``exact_divide`` (polydist_jax's,
    polydist_torch's); NumPy's complex arrays are divided here.
    """
    divide = getattr(xp, "exact_divide", None)
    if divide is not None:
        return divide(total, count)
    if isinstance(total, np.ndarray | np.generic) and np.iscomplexobj(total):
        # NumPy divides a complex number by multiplying with 1/count (1 ulp off for
        # (10+0j)/3): each part divided on its own is the correctly rounded quotient.
        parts = np.empty(np.shape(total), dtype=total.dtype)
        parts.real = np.real(total) / count
        parts.imag = np.imag(total) / count
        return parts if isinstance(total, np.ndarray) else parts[()]
    return total / count


def mean_from_sum(xp: Any, total: Any, count: int) -> Any:
    """TF's MEAN: the SUM divided by ``count`` with true division.

    As in TF's ``truediv``, integer (and bool) sums become float64 first; a
    float sum keeps its dtype. The quotient is correctly rounded on every
    backend (the namespace's ``exact_divide``, if it has one).
    """
    if is_integral(xp, total.dtype):
        with warnings.catch_warnings():
            # A namespace without float64 (JAX with x64 off, which declares
            # Capabilities.float64=False) gives its widest float instead.
            warnings.simplefilter("ignore", UserWarning)
            total = xp.astype(total, xp.float64)
    mean = divide_exactly(xp, total, count)
    # asarray only to turn NumPy's 0-d result (a scalar) back into an array: on
    # a torch tensor that tracks gradients it would warn (torch >= 2.13).
    return mean if is_array(mean) else xp.asarray(mean)


def check_summable(reduce_op: Any, values: Sequence[Any]) -> None:
    """Refuses to SUM or MEAN bool arrays across replicas, as TF's ``add_n`` does.

    MEAN is a SUM divided by the count, so it is refused too. Core calls this
    before it hands values to a backend's collectives, so every backend refuses
    alike (torch would OR the flags, JAX's ``psum`` would count them). So are
    dtypes that are not numbers to ``add_n``: NumPy's non-numeric kinds and
    ml_dtypes' sub-byte integers and complex32 (its floats, bfloat16 and
    float8_*, are summed).
    """
    for value in values:
        dtype = getattr(value, "dtype", None)
        if dtype is None:
            continue
        name = dtype_name(dtype)
        op = getattr(reduce_op, "value", reduce_op)
        if name == "bool":
            raise TypeError(
                f"cannot SUM bool replica values: got {describe(value)} for ReduceOp.{op} "
                "(TF's add_n does not support bool, and MEAN sums first). Cast to an integer "
                "dtype first (x.astype('int32'), or x.to(torch.int32) on torch): its SUM "
                "counts the True values and its MEAN is float64."
            )
        kind = getattr(dtype, "kind", None)  # NumPy's and JAX's dtypes (torch's have none)
        if (
            isinstance(kind, str)
            and kind not in "iufc"
            and not name.startswith(("bfloat", "float"))
        ):
            raise TypeError(
                f"cannot SUM replica values of dtype {name}: got {describe(value)} for "
                f"ReduceOp.{op}; SUM and MEAN take integer, floating (bfloat16 and float8_* "
                "included) and complex arrays. Cast first, e.g. x.astype('int8')."
            )


def dtype_name(dtype: Any) -> str:
    """``"float32"`` for NumPy, JAX and torch dtypes alike."""
    try:
        return _dtype_names(dtype)
    except TypeError:  # an unhashable dtype-like
        return _dtype_name(dtype)


def _dtype_name(dtype: Any) -> str:
    text = str(dtype)
    return text.removeprefix("torch.").removeprefix("dtype(").strip("')\"")


# str() of a NumPy dtype is slow, and every collective names its dtype at least once.
_dtype_names = functools.lru_cache(maxsize=512)(_dtype_name)


def describe(x: Any) -> str:
    """``float32[2,3]`` style description for messages."""
    if is_array(x):
        shape = ",".join(str(int(d)) if d is not None else "?" for d in x.shape)
        return f"{dtype_name(x.dtype)}[{shape}]"
    return type(x).__name__


def check_same_shape(components: Sequence[Any], what: str) -> None:
    """Raises unless every replica's component has the first one's shape and dtype."""
    first = components[0]
    for r, c in enumerate(components[1:], start=1):
        if tuple(c.shape) != tuple(first.shape) or c.dtype != first.dtype:
            raise InvalidArgumentError(
                f"Cannot {what} across replicas: replica 0 has {describe(first)} but replica {r} "
                f"has {describe(c)}. With axis=None every replica's value must have the same "
                "shape and dtype; to reduce values of different lengths pass an axis, e.g. "
                "strategy.reduce(op, value, axis=0)."
            )
