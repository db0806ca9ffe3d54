"""The array namespace of the jax backend: ``jax.numpy``, with an exact ``exact_divide``.

XLA rewrites a division by a scalar (a constant, or any broadcast scalar) into a
multiplication by its reciprocal: ``x / 3`` becomes ``x * (1/3)``, 1 ulp off for
about a third of float32 values, in a compiled program and in eager ``jnp`` alike.
TF's MEAN (and the sim's) is the sum divided by the count, so core's
``mean_from_sum`` divides with ``exact_divide`` where the namespace has one. Here
the divisor is a full array of the count behind an ``optimization_barrier``: XLA's
simplifier cannot see that it is a broadcast scalar, so the divide stays a divide.
Everything else is ``jax.numpy`` itself.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as _jnp
from jax import lax

__all__ = ["exact_divide"]


@jax.jit
def _divide(total: Any, count: Any) -> Any:
    # full_like gives count total's dtype (as NumPy rounds a Python int to it) and weak
    # type, so the result's are total / count's.
    divisor = lax.full_like(total, count)
    return lax.div(total, lax.optimization_barrier(divisor))  # type: ignore[no-untyped-call]


def exact_divide(total: Any, count: Any) -> Any:
    """``total / count``, correctly rounded (``total``: a float or complex array;
    ``count``: a number or a 0-d array)."""
    total = _jnp.asarray(total)
    if not _jnp.issubdtype(total.dtype, _jnp.inexact):
        return total / count
    if _jnp.issubdtype(total.dtype, _jnp.complexfloating):
        # Each part on its own, as the sim and torch divide: XLA's complex division
        # gives NaN in the imaginary part of (inf+1j)/3.
        return lax.complex(_divide(_jnp.real(total), count), _divide(_jnp.imag(total), count))
    return _divide(total, count)


def __getattr__(name: str) -> Any:
    return getattr(_jnp, name)


def __dir__() -> list[str]:
    return sorted(set(dir(_jnp)) | {"exact_divide"})
