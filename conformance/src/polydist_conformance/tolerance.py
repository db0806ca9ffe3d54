"""The tolerance model: when a backend's floating-point result counts as equal to the oracle's.

Every conformance case runs one program on the backend under test and on the
simulator (the oracle) and compares the results leaf by leaf:

* **Integers, booleans, shapes, dtypes and structure are always exact.**
* **A float result that no cross-replica sum produced** (an identity, a
  gather, a replica id, a sum of small integers that every order computes
  exactly) must match **bit for bit**.
* **A float result of a sum** is marked by the case with
  :func:`polydist_conformance.reduced` and a :class:`Reduction` that says how
  many terms were summed and their magnitudes. Then:

  - If the backend declares, in ``Capabilities.reduction_orders``, an order
    that the sim reproduces (``"sequential"`` for XLA on CPU, say), the oracle
    runs with that order and the cross-replica sum must match **bit for bit**.
    Not for extension floats (ml_dtypes' bfloat16, float8_*): the sim adds
    them in the dtype, while runtimes add them in a wider type (XLA:CPU's
    psum of ``[1] + [2**-8] * 7`` in bfloat16 is 1.03125, the sequential
    bfloat16 sum 1.0), so they are compared with the bound below, the
    oracle counted as inexact.
  - Otherwise the oracle runs with ``"exact"`` (correctly rounded) sums and
    the backend's result must lie within a **rigorous error bound** of it.
  - A sum that is partly computed by the backend's own array library
    (``Strategy.reduce`` with an ``axis``: each replica first runs
    ``xp.sum`` over its batch, in an order the sim does not model) is always
    compared with the bound (``Reduction(local_sum=True)``).

The bound
---------
Let ``s = x_1 + ... + x_n`` be the exact sum, ``A = |x_1| + ... + |x_n|``, and
``u = eps / 2`` the unit roundoff of the result's dtype (2**-24 for float32).
Whatever order and tree a backend adds the terms in, with each addition
rounded in precision ``u`` or finer, its result ``s^`` satisfies (Higham,
*Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. (4.4); no
underflow or overflow)::

    |s^ - s| <= gamma(n-1) * A,      gamma(k) = k*u / (1 - k*u)

The oracle's own error is ``E_o = u*A`` when its sum is correctly rounded
(``|fl(s) - s| <= u*|s| <= u*A``; 0 for a single term), else the same
``gamma(n-1)*A``. The comparison allows the sum of both errors::

    SUM:   |s_b - s_o| <= E_b + E_o

``MEAN`` divides the sum by ``d`` (the replica count, or the number of
elements summed), adding the division's rounding ``|fl(s^/d) - s^/d| <= u*|s^/d|``
with ``|s^| <= A + E``::

    MEAN:  |m_backend - m_oracle| <= ((E_b + u*(A + E_b)) + (E_o + u*(A + E_o))) / d

``d`` must be exactly representable in the dtype (at most 2**p). ``A`` is
computed from the inputs with :func:`math.fsum` (correctly rounded) and then
scaled by ``1 + 2**-52`` so that it is an upper bound, and the comparison is
evaluated in exact rational arithmetic (:class:`fractions.Fraction`), so the
check adds no rounding of its own. Non-finite values must match exactly (NaN
against NaN, an infinity against the same infinity). Complex results are
compared bit for bit.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "Reduction",
    "allowed_difference",
    "gamma",
    "mean_error_bound",
    "sum_error_bound",
    "unit_roundoff",
    "within_bound",
]

# math.fsum is correctly rounded: the true A is at most A_fsum * (1 + 2**-52).
_ABS_SUM_SLACK = 1 + Fraction(1, 2**52)


@dataclass(frozen=True, eq=False)
class Reduction:
    """How a floating-point result was computed: a sum of ``terms`` values per element.

    Build it from the case's host inputs with :meth:`across_replicas` (what
    ``all_reduce`` and ``reduce(axis=None)`` do) or :meth:`along_axis` (what
    ``reduce(op, value, axis)`` does), then mark the program's result with
    ``polydist_conformance.reduced(result, reduction)``.

    Attributes:
        terms: how many values were summed into each output element (``n``).
        abs_sum: ``sum|x_i|`` per output element (broadcastable to the result),
            correctly rounded in float64.
        divisor: for ``MEAN``, the count the sum was divided by; ``None`` for ``SUM``.
        local_sum: part of the sum was done by the backend's array library
            (``xp.sum`` inside ``reduce`` with an ``axis``), so it is compared
            with the bound even where the cross-replica order is bitwise.
    """

    terms: int
    abs_sum: npt.NDArray[np.float64]
    divisor: int | None = None
    local_sum: bool = False

    def __post_init__(self) -> None:
        if self.terms < 0:
            raise ValueError(f"Reduction.terms must be >= 0, got {self.terms}.")
        if self.divisor is not None and self.divisor < 1:
            raise ValueError(f"Reduction.divisor must be >= 1 or None, got {self.divisor}.")

    @classmethod
    def across_replicas(cls, per_replica: Sequence[Any], *, mean: bool = False) -> Reduction:
        """The elementwise sum (or mean) of one same-shaped value per replica."""
        arrays = [np.asarray(v, dtype=np.float64) for v in per_replica]  # exact widening
        if not arrays:
            raise ValueError("Reduction.across_replicas needs at least one replica value.")
        stacked = np.abs(np.stack(arrays))
        n = len(arrays)
        return cls(terms=n, abs_sum=_fsum_leading(stacked), divisor=n if mean else None)

    @classmethod
    def along_axis(
        cls, per_replica: Sequence[Any], axis: int | Sequence[int], *, mean: bool = False
    ) -> Reduction:
        """``Strategy.reduce(op, value, axis)``: every element on ``axis`` of every replica.

        The per-replica values may differ in size along ``axis`` (partial or
        empty batches); MEAN divides by the total element count.
        """
        arrays = [np.asarray(v, dtype=np.float64) for v in per_replica]
        if not arrays:
            raise ValueError("Reduction.along_axis needs at least one replica value.")
        rank = arrays[0].ndim
        axes = tuple(a % rank for a in ((axis,) if isinstance(axis, int) else tuple(axis)))
        rest = [d for d in range(rank) if d not in axes]
        columns = [
            np.transpose(a, (*axes, *rest)).reshape((-1, *(a.shape[d] for d in rest)))
            for a in arrays
        ]
        terms = np.abs(np.concatenate(columns, axis=0))
        n = int(terms.shape[0])
        return cls(
            terms=n,
            abs_sum=_fsum_leading(terms),
            divisor=n if mean and n else None,
            local_sum=True,
        )


def _fsum_leading(values: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Correctly rounded sums over axis 0."""
    if values.shape[0] == 0:
        return np.zeros(values.shape[1:], dtype=np.float64)
    flat = values.reshape(values.shape[0], -1)
    sums = [math.fsum(flat[:, j].tolist()) for j in range(flat.shape[1])]
    return np.asarray(sums, dtype=np.float64).reshape(values.shape[1:])


def _finfo(dtype: Any) -> Any:
    try:
        return np.finfo(dtype)
    except (TypeError, ValueError):
        # bfloat16 and friends (installed with jax); imported by name, as it may be absent.
        return importlib.import_module("ml_dtypes").finfo(dtype)


def unit_roundoff(dtype: Any) -> Fraction:
    """``u = eps / 2`` of a floating-point dtype, exactly (2**-24 for float32)."""
    return Fraction(float(_finfo(dtype).eps)) / 2


def gamma(k: int, u: Fraction) -> Fraction:
    """Higham's ``gamma(k) = k*u / (1 - k*u)``; requires ``k*u < 1``."""
    ku = k * u
    if ku >= 1:
        raise ValueError(f"gamma({k}) is undefined for u = {float(u):g}: k*u must be < 1.")
    return ku / (1 - ku)


def sum_error_bound(terms: int, abs_sum: Fraction, u: Fraction) -> Fraction:
    """Higham (4.4): any evaluation of a sum of ``terms`` values errs by ``gamma(n-1)*A``."""
    return gamma(max(terms - 1, 0), u) * abs_sum


def mean_error_bound(
    terms: int, abs_sum: Fraction, divisor: int, u: Fraction, *, sum_error: Fraction | None = None
) -> Fraction:
    """Error of ``fl(s^ / d)`` against ``s / d``: ``(E + u*(A + E)) / d``.

    ``E`` is the sum's error bound (``sum_error``; by default
    :func:`sum_error_bound`), ``A = sum|x_i|``.
    """
    e = sum_error_bound(terms, abs_sum, u) if sum_error is None else sum_error
    return (e + u * (abs_sum + e)) / divisor


def _allowed(
    reduction: Reduction, u: Fraction, abs_sum: Fraction, *, oracle_exact: bool
) -> Fraction:
    n = reduction.terms
    e_backend = sum_error_bound(n, abs_sum, u)
    if n <= 1:
        e_oracle = Fraction(0)
    elif oracle_exact:
        e_oracle = u * abs_sum
    else:
        e_oracle = e_backend
    if reduction.divisor is None:
        return e_backend + e_oracle
    d = reduction.divisor
    return mean_error_bound(n, abs_sum, d, u, sum_error=e_backend) + mean_error_bound(
        n, abs_sum, d, u, sum_error=e_oracle
    )


def allowed_difference(
    reduction: Reduction, dtype: Any, shape: tuple[int, ...], *, oracle_exact: bool
) -> npt.NDArray[np.object_]:
    """The largest allowed ``|backend - oracle|`` per element, as exact fractions
    (``math.inf`` where an input is not finite).

    ``oracle_exact``: the oracle's sum is correctly rounded (order ``"exact"``
    and no local ``xp.sum``); else it carries the same ``gamma(n-1)*A`` error as
    the backend.
    """
    u = unit_roundoff(dtype)
    if reduction.divisor is not None and reduction.divisor > 2 ** (_finfo(dtype).nmant + 1):
        raise ValueError(
            f"MEAN divisor {reduction.divisor} is not exactly representable in {dtype}; the "
            "bound assumes it is."
        )
    abs_sums = np.broadcast_to(reduction.abs_sum, shape)
    out = np.empty(shape, dtype=object)
    for index in np.ndindex(*shape):
        abs_sum = float(abs_sums[index])
        if not math.isfinite(abs_sum):  # an infinite input: the results are not finite either
            out[index] = math.inf
            continue
        a = Fraction(abs_sum) * _ABS_SUM_SLACK
        out[index] = _allowed(reduction, u, a, oracle_exact=oracle_exact)
    return out


def within_bound(
    actual: Any, reference: Any, reduction: Reduction, *, oracle_exact: bool
) -> npt.NDArray[np.bool_]:
    """Elementwise: does ``actual`` lie within the error bound of ``reference``?

    Both are float arrays of one shape and dtype. Evaluated exactly, in
    rational arithmetic. Non-finite elements must match exactly.
    """
    a = np.asarray(actual)
    r = np.asarray(reference)
    if a.shape != r.shape or a.dtype != r.dtype:
        raise ValueError(
            f"within_bound compares arrays of one shape and dtype, got {a.dtype}{list(a.shape)} "
            f"and {r.dtype}{list(r.shape)}."
        )
    allowed = allowed_difference(reduction, a.dtype, a.shape, oracle_exact=oracle_exact)
    ok = np.empty(a.shape, dtype=np.bool_)
    for index in np.ndindex(*a.shape):
        x, y = float(a[index]), float(r[index])
        if not (math.isfinite(x) and math.isfinite(y)):
            ok[index] = (math.isnan(x) and math.isnan(y)) or x == y
        else:
            ok[index] = abs(Fraction(x) - Fraction(y)) <= allowed[index]
    return ok
