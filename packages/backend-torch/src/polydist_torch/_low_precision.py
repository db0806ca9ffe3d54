"""torch's low-precision floats as NumPy arrays of ml_dtypes' dtypes, and back, bit for bit.

NumPy has no bfloat16 or float8 dtypes; ml_dtypes adds them, and JAX's arrays
and TF's ``.numpy()`` hand them out. torch refuses both directions
(``tensor.numpy()`` of a bfloat16 tensor, ``torch.from_numpy`` of an
ml_dtypes array), so the bits travel as a same-width integer and are viewed
as the other library's dtype.

The formats shared by name (``SHARED``) give every bit pattern the same value
in both libraries (tests/test_low_precision.py checks all of them). ml_dtypes
is optional: it is imported only when such a value arrives, and without it
``numpy_of`` widens these dtypes to float32, which holds each of their values
exactly. ml_dtypes' other dtypes (int4, float8_e4m3b11fnuz, float4_e2m1fn,
complex32, ...) have no torch counterpart here: ``unsupported_hint`` says so.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import torch

from polydist.backend import convert_to_array

__all__ = ["SHARED", "as_bits", "from_host", "numpy_of", "torch_dtype_of", "unsupported_hint"]

#: The dtypes torch and ml_dtypes both define, by their common name.
SHARED = (
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)
# float8_e8m0fnu came in torch 2.7; older versions lack some of these.
_TORCH: dict[torch.dtype, str] = {getattr(torch, n): n for n in SHARED if hasattr(torch, n)}
# Integers of each width that both torch.Tensor.view and ndarray.view accept.
_BITS: dict[int, tuple[torch.dtype, type[np.integer[Any]]]] = {
    1: (torch.uint8, np.uint8),
    2: (torch.int16, np.int16),
}


@functools.cache
def _ml_dtypes() -> ModuleType | None:
    try:
        return importlib.import_module("ml_dtypes")
    except ImportError:
        return None


def _ml_dtype(name: str) -> np.dtype[Any] | None:
    ml = _ml_dtypes()
    scalar = getattr(ml, name, None) if ml is not None else None
    return None if scalar is None else np.dtype(scalar)


def numpy_of(tensor: torch.Tensor) -> np.ndarray:
    """``tensor.numpy(force=True)`` (it may share the tensor's memory); a tensor of a
    ``SHARED`` dtype becomes an array of ml_dtypes' dtype with the same bits, or
    float32 where ml_dtypes is not installed."""
    name = _TORCH.get(tensor.dtype)
    if name is None:
        return tensor.numpy(force=True)
    dtype = _ml_dtype(name)
    if dtype is None:
        return tensor.float().numpy(force=True)  # exact: float32 holds every value
    # A negated view cannot be viewed as another dtype; resolve_neg is free otherwise.
    bits = tensor.resolve_neg().view(_BITS[dtype.itemsize][0])
    return bits.numpy(force=True).view(dtype)


def torch_dtype_of(dtype: np.dtype[Any]) -> torch.dtype | None:
    """torch's dtype for one of ml_dtypes' ``SHARED`` dtypes, else None."""
    if dtype.isbuiltin != 2:  # NumPy's own dtypes: no need to look at ml_dtypes
        return None
    name = dtype.name
    for torch_dtype, shared in _TORCH.items():
        if shared == name and _ml_dtype(name) == dtype:
            return torch_dtype
    return None


def as_bits(array: np.ndarray) -> tuple[np.ndarray, torch.dtype | None]:
    """``array`` and None; for an ml_dtypes array of a ``SHARED`` dtype, its bits as a
    same-width integer array (a view) and the torch dtype to view them as."""
    torch_dtype = torch_dtype_of(array.dtype)
    if torch_dtype is None:
        return array, None
    return array.view(_BITS[array.dtype.itemsize][1]), torch_dtype


def unsupported_hint(dtype: np.dtype[Any]) -> str:
    """What to do with an array of a NumPy extension dtype that torch cannot take."""
    if dtype.isbuiltin != 2:
        return ""
    shared = ", ".join(n for n in SHARED if n in _TORCH.values())
    return (
        f" torch takes these ml_dtypes dtypes: {shared}; cast {dtype.name} to one of them "
        "or to a NumPy dtype first (e.g. array.astype(np.float32))."
    )


def from_host(value: Any, who: str, convert: Callable[[np.ndarray], torch.Tensor]) -> torch.Tensor:
    """A host value (array-like or Python scalar, converted by TF's rules) as a tensor:
    ``convert`` makes the tensor from the array, or from an ml_dtypes array's bits,
    which are then viewed as the torch dtype. A dtype torch lacks raises a
    ``TypeError`` naming ``who`` (the backend) and what to pass instead."""
    array = np.asarray(convert_to_array(value))
    bits, low_precision = as_bits(array)
    try:
        tensor = convert(bits)
    except TypeError as e:
        raise TypeError(
            f"The {who} cannot convert {type(value).__name__} of dtype {array.dtype} to a "
            "torch tensor: expected a torch.Tensor, a NumPy array of a dtype torch supports, "
            f"or a Python number ({e})." + unsupported_hint(array.dtype)
        ) from None
    return tensor if low_precision is None else tensor.view(low_precision)
