"""The array namespace of the torch backends: ``array_api_compat.torch``, with an
``asarray`` that says what it does with autograd.

``torch.asarray(t)`` of a tensor that tracks gradients changed meaning in torch
2.13: the result used to be detached and now keeps ``t.requires_grad`` (a copy
is a differentiable clone), and until callers say which they want torch warns
("unspecified requires_grad now defaults to obj.requires_grad"). Core calls
``xp.asarray(value, copy=True)`` to copy arrays (``Variable.read_value()``,
assignments), and a variable backed by a ``torch.nn.Parameter``
(``polydist_torch.parameters``) always tracks gradients. This ``asarray``
passes ``requires_grad=obj.requires_grad`` for a tensor when the caller did
not: torch 2.13's new default, on every torch version and without the warning.
So ``v.read_value()`` is differentiable, as TF's is. It also takes NumPy arrays
of ml_dtypes' bfloat16 and float8_* (``v.numpy()`` of such a variable), which
``torch.asarray`` refuses. Everything else is ``array_api_compat.torch`` itself.
"""

from __future__ import annotations

from typing import Any

import array_api_compat.torch as _compat
import numpy as np
import torch

from polydist_torch import _low_precision

__all__ = ["asarray", "exact_divide"]


def exact_divide(total: Any, count: Any) -> Any:
    """``total / count``, correctly rounded (core's ``divide_exactly``): torch divides a
    complex number by multiplying with the divisor's reciprocal (1 ulp off for
    ``(10+0j) / 3``), so each part of a complex ``total`` is divided on its own."""
    if isinstance(total, torch.Tensor) and total.dtype in (torch.complex64, torch.complex128):
        return torch.complex(total.real / count, total.imag / count)
    return total / count


def asarray(
    obj: Any,
    /,
    *,
    dtype: Any = None,
    device: Any = None,
    copy: bool | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``array_api_compat.torch.asarray``; a tensor keeps its ``requires_grad`` unless told,
    and ml_dtypes' bfloat16 and float8_* arrays become torch's dtypes, bit for bit."""
    if isinstance(obj, np.ndarray | np.generic):
        bits, low_precision = _low_precision.as_bits(np.asarray(obj))
        if low_precision is not None:  # torch.asarray refuses ml_dtypes' dtypes
            if copy is not False:  # a private copy (also for read-only arrays)
                bits, copy = np.array(bits, order="C", copy=True), None
            obj = torch.from_numpy(bits).view(low_precision)
    if isinstance(obj, torch.Tensor) and "requires_grad" not in kwargs:
        kwargs["requires_grad"] = obj.requires_grad
    result: torch.Tensor = _compat.asarray(obj, dtype=dtype, device=device, copy=copy, **kwargs)
    return result


def __getattr__(name: str) -> Any:
    return getattr(_compat, name)


def __dir__() -> list[str]:
    return sorted(set(dir(_compat)) | {"asarray"})
