"""Cross-replica summation algorithms for the simulator's SUM reductions.

Floating-point addition is not associative, so the result of an all-reduce
depends on the order in which a real runtime adds the per-replica values.
:func:`sum_replicas` offers one reference order that has no such dependence
and several that model what real runtimes do:

``"exact"`` (the default)
    The exact mathematical sum of the N values, correctly rounded
    (round-to-nearest-even) once to the input dtype, elementwise.  The result
    is independent of the replica order *and* of the replica count (splitting a
    value ``v`` into ``v/2 + v/2`` on two replicas gives the same bits), which
    makes it the right reference for ``ReduceOp.SUM``: any real backend's
    result differs from it only by its own rounding.  Algorithm: widen to
    float64 (exact for float16/32/64) and accumulate with Knuth's TwoSum, so
    that ``s + sum(e_i)`` is the exact sum; sum the ``e_i`` with a second
    TwoSum level into ``E``.  Where that second level made no rounding error
    the exact sum is the double-double ``s + E`` and ``fl64(s + E)`` is the
    correctly rounded float64.  For float32/float16, ``t = fl64(s + E)`` is
    then cast to the target; this double rounding can only be wrong when
    ``t`` lies exactly on a midpoint between two target values, and there the
    sign of the residual ``(s + E) - t`` picks the neighbour.  Elements whose
    second level was inexact, whose float64 accumulation overflowed, or that
    hold inf/nan (all rare) go through an exact per-element path in Python
    integers (the values are dyadic rationals).  Non-finite inputs follow
    IEEE: any nan, or both +inf and -inf, gives nan; else the infinity.  An
    exact zero sum is -0.0 only if every input is -0.0 (as in IEEE addition).
    Complex dtypes reduce their real and imaginary parts separately.
    ml_dtypes' floats (bfloat16, float8_e4m3fn, float8_e5m2, ...) widen to
    float64 exactly too, but their casts from float64 round twice (through
    float32: ``np.float64(1 + 2**-8 + 2**-40).astype(bfloat16)`` is 1.0, not
    1.0078125), so the sim rounds ``s + E`` to the target's significand
    itself (ties to even, the residual deciding at a midpoint) and casts
    only the exactly representable result.  Past the largest finite value
    that cast applies the format's own overflow rule, as one ``np.add`` in
    the dtype would: inf for bfloat16 and float8_e5m2, NaN for the float8
    ``fn``/``fnuz`` formats (they have no inf), saturation for the float4
    and float6 ones.  Integer dtypes wrap around in two's complement (like
    TF's ``add_n`` on int32); modular addition is associative, so every
    order gives the same integers.

``"sequential"``
    Left to right in replica order, each partial sum rounded to the input
    dtype: ``((x0 + x1) + x2) + ...``.  This is what XLA's CPU all-reduce
    does, so it reproduces a CPU ``psum`` bit for bit, except on bfloat16 and
    the float8 dtypes, which XLA:CPU accumulates in a wider type (its psum of
    ``[1] + [2**-8] * 7`` in bfloat16 is 1.03125; this order gives 1.0).

``"reverse"``
    The same, from the last replica to the first.

``"tree"``
    Pairwise tree: at each level adjacent values ``(x[i], x[i+1])`` for even
    ``i`` are added as ``x[i] + x[i+1]``; an odd one out (the last) is carried
    unchanged to the next level.  For N=5:
    ``((x0 + x1) + (x2 + x3)) + x4``.

``"ring"``
    Our model of a chunked ring all-reduce (the reduce-scatter phase of
    gloo/NCCL ring algorithms): the flattened array is split into N
    contiguous chunks with :func:`numpy.array_split` semantics (earlier chunks
    get the extra elements) and chunk ``c`` is summed going around the ring
    starting at replica ``(c + 1) % N``:
    ``((x[c+1] + x[c+2]) + ...) + x[c]`` (indices mod N).  Real gloo/NCCL
    chunk sizes, pipelining and channel counts differ, so this reproduces
    the *kind* of order dependence a ring has, not a particular library's bits.

ml_dtypes' floats are summed in every order, the modelled orders adding in
the dtype (``np.add``, which ml_dtypes rounds correctly).  ml_dtypes is not a
dependency of the sim: it is imported only when a user-defined dtype (one
that NumPy does not define) arrives.  Non-numeric dtypes, bool included, and
ml_dtypes' other dtypes (int4, complex32, ...) are rejected with
:class:`TypeError` in every order; core refuses a SUM or MEAN of bool with
TF's reason before any backend sums (``polydist._arrays.check_summable``).
Every order returns a new array (never one of the inputs) with the inputs'
shape and dtype; floating-point warnings are suppressed since overflow to
inf is a legitimate result of a sum.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Sequence
from typing import Any, Literal, get_args

import numpy as np
import numpy.typing as npt

__all__ = ["REDUCTION_ORDERS", "ReductionOrder", "sum_replicas"]

ReductionOrder = Literal["exact", "sequential", "reverse", "tree", "ring"]
REDUCTION_ORDERS: tuple[str, ...] = get_args(ReductionOrder)

_Array = npt.NDArray[Any]
_F64 = npt.NDArray[np.float64]

_EXACT_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
_EXACT_COMPLEX = (np.dtype(np.complex64), np.dtype(np.complex128))


def sum_replicas(values: Sequence[_Array], order: ReductionOrder = "exact") -> _Array:
    """Sum per-replica arrays elementwise in the given order (see the module docs).

    ``values`` holds N >= 1 arrays of one shape and dtype.  Returns a new
    array of that shape and dtype.
    """
    if order not in REDUCTION_ORDERS:
        raise ValueError(f"unknown reduction order {order!r}; expected one of {REDUCTION_ORDERS}")
    arrays = [np.asarray(v) for v in values]
    if not arrays:
        raise ValueError("sum_replicas needs at least one replica value")
    dtype, shape = arrays[0].dtype, arrays[0].shape
    for a in arrays[1:]:
        if a.dtype != dtype or a.shape != shape:
            raise ValueError(
                f"replica values disagree: {a.dtype}{list(a.shape)} vs {dtype}{list(shape)}"
            )
    if dtype.kind not in "iufc" and _extension_finfo(dtype) is None:
        raise TypeError(
            f"cannot SUM replica values of dtype {dtype}: the sim sums NumPy's integer, float "
            "and complex dtypes and ml_dtypes' floats (bfloat16, float8_*). Cast to one of "
            "them first, e.g. x.astype(np.int8)."
        )
    if len(arrays) == 1:
        return arrays[0].copy()
    with np.errstate(all="ignore"):
        if order == "exact":
            return _sum_exact(arrays)
        if order == "sequential":
            return _sum_sequential(arrays)
        if order == "reverse":
            return _sum_sequential(arrays[::-1])
        if order == "tree":
            return _sum_tree(arrays)
        return _sum_ring(arrays)


def _sum_sequential(arrays: Sequence[_Array]) -> _Array:
    acc = arrays[0].copy()
    for a in arrays[1:]:
        # In place with out=: a 0-d ``acc + a`` would return a NumPy scalar.
        np.add(acc, a, out=acc)
    return acc


def _sum_tree(arrays: Sequence[_Array]) -> _Array:
    level = list(arrays)
    while len(level) > 1:
        nxt = [
            np.add(level[i], level[i + 1], out=np.empty_like(level[i]))
            for i in range(0, len(level) - 1, 2)
        ]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def _sum_ring(arrays: Sequence[_Array]) -> _Array:
    n = len(arrays)
    flat = np.stack([a.reshape(-1) for a in arrays])
    size = flat.shape[1]
    base, extra = divmod(size, n)
    chunk = np.repeat(np.arange(n), [base + 1] * extra + [base] * (n - extra))
    cols = np.arange(size)
    # All chunks advance around the ring in lockstep: step j adds replica
    # (c + j) % n to every element of chunk c.
    acc = flat[(chunk + 1) % n, cols]
    for step in range(2, n + 1):
        acc += flat[(chunk + step) % n, cols]
    return acc.reshape(arrays[0].shape)


def _sum_exact(arrays: Sequence[_Array]) -> _Array:
    dtype = arrays[0].dtype
    if dtype.kind in "iu":
        return _sum_sequential(arrays)
    if dtype in _EXACT_COMPLEX:
        out = np.empty(arrays[0].shape, dtype)
        out.real = _exact_float([a.real for a in arrays])
        out.imag = _exact_float([a.imag for a in arrays])
        return out
    if dtype not in _EXACT_FLOATS and _extension_finfo(dtype) is None:
        raise TypeError(
            f"order='exact' supports float16/32/64, complex64/128 and ml_dtypes' floats, "
            f"not {dtype}"
        )
    return _exact_float(arrays)


@functools.lru_cache(maxsize=64)
def _extension_finfo(dtype: np.dtype[Any]) -> Any:
    """ml_dtypes' ``finfo`` of one of its real floats (bfloat16, float8_*, ...), else None.

    Only a user-defined dtype (``isbuiltin == 2``) can be one, so NumPy's own
    dtypes never import ml_dtypes (an optional dependency).
    """
    if dtype.isbuiltin != 2:
        return None
    try:
        fi = importlib.import_module("ml_dtypes").finfo(dtype)
    except (ImportError, TypeError, ValueError):  # no ml_dtypes, or not one of its floats
        return None
    # ml_dtypes.finfo(complex32) describes its float16 parts, as np.finfo does.
    return fi if fi.dtype == dtype else None


def _finfo(dtype: np.dtype[Any]) -> Any:
    ext = _extension_finfo(dtype)
    return np.finfo(dtype) if ext is None else ext


def _two_sum(a: _F64, b: _F64) -> tuple[_F64, _F64]:
    """Knuth's TwoSum: ``s = fl(a + b)`` and ``e`` with ``s + e == a + b`` exactly."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


def _exact_float(arrays: Sequence[_Array]) -> _Array:
    dtype = arrays[0].dtype
    flat = [np.asarray(a, np.float64).reshape(-1) for a in arrays]
    s = flat[0].copy()
    big_e = np.zeros_like(s)
    # bad: the second level rounded, or s overflowed, or an input is inf/nan
    # (all of these leave a nonzero or nan error term).
    bad = np.zeros(s.shape, np.bool_)
    for x in flat[1:]:
        s, e = _two_sum(s, x)
        big_e, f = _two_sum(big_e, e)
        bad |= f != 0
    t, r = _two_sum(s, big_e)
    # An exact zero: s is -0.0 exactly when every input was -0.0.
    t = np.where(t == 0, np.where((s == 0) & np.signbit(s), -0.0, 0.0), t)
    if dtype == np.float64:
        out = t
    elif _extension_finfo(dtype) is None:
        out = _narrow(t, r, dtype)
    else:
        out = _round_to_format(t, r, dtype)
    idx = np.flatnonzero(bad)
    if idx.size:
        out[idx] = _exact_fallback(np.stack([x[idx] for x in flat]), dtype)
    return out.reshape(arrays[0].shape)


def _narrow(t: _F64, r: _F64, dtype: np.dtype[Any]) -> _Array:
    """Round the exact value ``t + r`` (``t = fl64(t + r)``) correctly to ``dtype``."""
    fi = np.finfo(dtype)
    y = t.astype(dtype)
    _, e = np.frexp(t)
    # Exponent of the target's ulp at t (subnormals share emin's ulp).
    qe = np.maximum(e - 1, fi.minexp) - fi.nmant
    # t / (ulp / 2) is an odd integer exactly when t is a target midpoint.
    k = np.ldexp(t, 1 - qe)
    fix = (np.fmod(np.abs(k), 2.0) == 1.0) & (r != 0) & np.isfinite(t)
    if fix.any():
        half = np.ldexp(1.0, qe[fix] - 1)
        # t +- ulp/2 is a target value (or 2**(emax+1), which casts to inf).
        y[fix] = (t[fix] + np.copysign(half, r[fix])).astype(dtype)
    return y


def _round_to_format(t: _F64, r: _F64, dtype: np.dtype[Any]) -> _Array:
    """``_narrow`` for ml_dtypes' floats, whose casts from float64 round twice
    (through float32): round ``t + r`` to the target's significand here, then
    cast the result, which the target holds exactly unless it is past the
    target's largest value (the cast then applies the format's overflow rule)."""
    fi = _extension_finfo(dtype)
    minexp, nmant = int(fi.minexp), int(fi.nmant)
    _, e = np.frexp(t)
    qe = np.maximum(e - 1, minexp) - nmant  # exponent of the target's ulp at t
    k = np.ldexp(t, -qe)  # t in target ulps: exact, and at most 2**(nmant + 1)
    m = np.rint(k)  # ties to even
    # On a midpoint of t the residual r says on which side the exact value lies.
    mid = (np.abs(k - np.trunc(k)) == 0.5) & (r != 0)
    m = np.where(mid, np.where(r > 0, np.ceil(k), np.floor(k)), m)
    y: _Array = np.ldexp(m, qe).astype(dtype)
    return y


def _exact_fallback(cols: _F64, dtype: np.dtype[Any]) -> _F64:
    """Exact sums of the columns of ``cols`` (N, k), rounded to ``dtype``."""
    out = np.empty(cols.shape[1])
    finite = np.isfinite(cols).all(axis=0)
    if not finite.all():
        c = cols[:, ~finite]
        pinf, ninf = (c == np.inf).any(axis=0), (c == -np.inf).any(axis=0)
        nan = np.isnan(c).any(axis=0) | (pinf & ninf)
        out[~finite] = np.where(nan, np.nan, np.where(pinf, np.inf, -np.inf))
    fi = _finfo(dtype)
    for j in np.flatnonzero(finite):
        out[j] = _exact_sum_scalar(cols[:, j].tolist(), fi.nmant + 1, fi.minexp, fi.maxexp - 1)
    return out


def _exact_sum_scalar(vals: list[float], p: int, emin: int, emax: int) -> float:
    # Floats are dyadic rationals n/d with d a power of two, so a common
    # denominator makes the sum an exact integer (like Fraction, but faster).
    ratios = [v.as_integer_ratio() for v in vals]
    den = max(d for _, d in ratios)
    num = sum(n * (den // d) for n, d in ratios)
    if num == 0:
        all_neg_zero = all(math.copysign(1.0, v) < 0 for v in vals)
        return -0.0 if all_neg_zero else 0.0
    return _round_dyadic(num, den.bit_length() - 1, p, emin, emax)


def _round_dyadic(num: int, shift: int, p: int, emin: int, emax: int) -> float:
    """Round ``num / 2**shift`` to nearest-even in a binary format with ``p``
    significand bits and exponent range ``[emin, emax]``; inf on overflow."""
    neg = num < 0
    a = -num if neg else num
    qe = max(a.bit_length() - 1 - shift, emin) - (p - 1)  # exponent of the ulp
    k = -shift - qe  # value / 2**qe == a * 2**k
    if k >= 0:
        m = a << k
    else:
        m, rem = divmod(a, 1 << -k)
        half = 1 << (-k - 1)
        if rem > half or (rem == half and m & 1):
            m += 1
    # m * 2**qe >= 2**(emax + 1) overflows.
    result = math.inf if m.bit_length() + qe > emax + 1 else math.ldexp(float(m), qe)
    return -result if neg else result
