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
    result differs from it only by its own rounding.  Algorithm, vectorised
    over replicas and elements (the N arrays are stacked into one (N, size)
    matrix; no Python loop runs per replica or per element on the common path):

    1. *One float64 sum, where provably exact.*  Widening to float64 is exact
       for every float we sum.  Every value of a column (one element across
       the replicas) is a multiple of the target's ulp ``2**qe`` at the
       column's smallest nonzero magnitude, and its partial sums stay below
       ``N * max|x| < 2**(e_hi + ceil(log2 N))``; when that bound is at most
       ``2**(qe + 53)``, float64 holds every partial sum exactly, in any
       order.  For float32 inputs that allows a spread of ``29 -
       ceil(log2 N)`` binades between a column's largest and smallest
       nonzero exponents (``42 - ceil(log2 N)`` for float16), which ordinary
       data (gradients, losses) meets.  The test reads the exponents from the
       bits: the maximum, and the minimum nonzero, of ``|x|`` as unsigned
       integers, over the whole matrix first and column by column only where
       that fails.  There the exact sum is ``np.add.reduce`` in float64
       (started from -0.0, IEEE's additive identity, so that an exact zero
       keeps IEEE's sign) and one correctly rounded cast.  Columns that fail
       the test, or hold inf/nan, take the next path; float64 inputs always do.
    2. *TwoSum double-double.*  Knuth's TwoSum gives ``s`` and errors with
       ``s + sum(e_i)`` exactly the sum.  The rows are added pairwise, a
       whole tree level per NumPy call; the N - 1 error rows are summed the
       same way, and so on (distillation) until every error is zero, which
       takes two or three levels (errors shrink by ~2**-53 per level and
       vanish below the inputs' smallest ulp).  Then a few values per
       element remain whose sum is exact; a TwoSum chain with a second level
       ``E`` adds them, and where that second level made no rounding error
       the exact sum is the double-double ``s + E`` and ``fl64(s + E)`` is
       the correctly rounded float64.  Wide matrices (more than 2**15
       values) are summed row by row instead (``s`` and ``E`` accumulated
       over the replicas, each call on a cache-sized row), which is faster
       there.  For float32/float16, ``t = fl64(s + E)`` is then cast to the
       target; this double rounding can only be wrong when ``t`` lies
       exactly on a midpoint between two target values, and there the sign
       of the residual ``(s + E) - t`` picks the neighbour.
    3. *Python integers.*  Elements whose errors did not vanish, whose
       float64 accumulation overflowed, or that hold inf/nan (all rare) go
       through an exact per-element path in Python integers (the values are
       dyadic rationals).

    Every path computes the correctly rounded exact sum, so which one decides
    an element never changes its bits.  Non-finite inputs follow
    IEEE: any nan, or both +inf and -inf, gives nan; else the infinity.  An
    exact zero sum is -0.0 only if every input is -0.0 (as in IEEE addition).
    Complex dtypes reduce their real and imaginary parts separately.
    ml_dtypes' floats (bfloat16, float8_e4m3fn, float8_e5m2, ...) widen to
    float64 exactly too, but their casts from float64 round twice (through
    float32: ``np.float64(1 + 2**-8 + 2**-40).astype(bfloat16)`` is 1.0, not
    1.0078125), so the sim rounds ``s + E`` (on path 1, the exact float64
    sum) to the target's significand itself (ties to even, the residual
    deciding at a midpoint) and casts
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
TF's reason before any backend sums (``polydist._base.arrays.check_summable``).
Every order returns a new array (never one of the inputs) with the inputs'
shape and dtype; floating-point warnings are suppressed since overflow to
inf is a legitimate result of a sum.
"""

from __future__ import annotations

import functools
import importlib
import math
import threading
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
    dtype, shape, n = arrays[0].dtype, arrays[0].shape, len(arrays)
    size = math.prod(shape)
    x = _scratch("stack", n * size, dtype)
    if x is None:  # np.array stacks a short list fastest
        x = np.array(arrays, dtype=dtype)
    else:
        np.stack(arrays, out=x.reshape((n, *shape)))
    x = x.reshape(n, size)
    if dtype == np.float64:
        return _sum_double_double(x, dtype).reshape(shape)
    # Widening to float64 is exact for every float we sum; the reduction
    # casts in small buffers, so no (N, size) float64 copy is made.
    s = np.add.reduce(x, axis=0, dtype=np.float64, initial=-0.0)
    out = _round_exact(s, dtype)
    slow = _inexact_in_float64(x, dtype)
    if slow is not None:
        out[slow] = _sum_double_double(x[:, slow].astype(np.float64), dtype)
    return out.reshape(shape)


# Reused buffers for the (N, size) matrices of _exact_float: fresh ones of a few
# MB cost more (page faults) than the sums.  Per thread, at most this large each.
_SCRATCH = threading.local()
_SCRATCH_MAX_BYTES = 1 << 24


def _scratch(name: str, count: int, dtype: np.dtype[Any]) -> _Array | None:
    """This thread's buffer ``name`` as an uninitialised 1-d array of ``count``
    ``dtype`` items (it must not outlive the call that asked for it), or None
    for a size better allocated afresh (small ones come from malloc's free lists)."""
    nbytes = count * dtype.itemsize
    if nbytes > _SCRATCH_MAX_BYTES or nbytes < 1 << 16:
        return None
    buf: _Array | None = getattr(_SCRATCH, name, None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(nbytes, np.uint8)
        setattr(_SCRATCH, name, buf)
    return buf[:nbytes].view(dtype)


def _inexact_in_float64(x: _Array, dtype: np.dtype[Any]) -> _Array | None:
    """Indices of the columns of ``x`` (N, k) whose sum in float64 may be
    inexact (None if there are none); every other column's is exact, in any order.

    Every value of a column is an integer multiple of ``2**qe``, the target's
    ulp at the column's smallest nonzero magnitude, and the column's partial
    sums stay below ``N * max|x| < 2**(e_hi + ceil(log2 N))`` (``2**e_hi``
    bounds ``max|x|``).  When that is at most ``2**(qe + 53)`` every partial
    sum is an integer multiple of ``2**qe`` with at most 53 bits, which
    float64 holds exactly: for float32 (24 bits) a column may span
    ``29 - ceil(log2 N)`` binades, for float16 ``42 - ceil(log2 N)``.
    Columns with an inf or nan are never fast.  The whole matrix is tested
    first (the common case), then column by column.
    """
    n = x.shape[0]
    fi = _finfo(dtype)
    slack = 52 - int(fi.nmant) - (n - 1).bit_length()
    if _extension_finfo(dtype) is None:
        # IEEE float16/float32: the exponent fields of the bits themselves.
        bits = x.view(np.uint16 if dtype.itemsize == 2 else np.uint32)
        shift, emin_field = int(fi.nmant), 1
        emax_field = (1 << (8 * dtype.itemsize - 1 - shift)) - 1
    else:
        # ml_dtypes' floats: the exact float64 values, whose exponent field is
        # frexp's exponent + 1022; the target's subnormals share the ulp of
        # its smallest normal.
        bits = x.astype(np.float64).view(np.uint64)
        shift, emax_field, emin_field = 52, 0x7FF, int(fi.minexp) + 1023
    # |x| as unsigned integers orders like |x|; (|x| - 1) wraps 0 to the
    # largest integer, so its minimum + 1 is the smallest nonzero |x| (or 0).
    top = (1 << (8 * bits.itemsize)) - 1
    buf = _scratch("bits", bits.size, bits.dtype)
    a = np.bitwise_and(bits, top >> 1, out=None if buf is None else buf.reshape(bits.shape))
    hi = int(a.max(initial=0)) >> shift
    np.subtract(a, 1, out=a)
    lo = ((int(a.min(initial=top)) + 1) & top) >> shift
    if hi < emax_field and max(hi, emin_field) - max(lo, emin_field) <= slack:
        return None
    col_hi = (np.bitwise_and(bits, top >> 1).max(axis=0) >> shift).astype(np.int64)
    col_lo = ((a.min(axis=0) + 1) >> shift).astype(np.int64)
    bad = col_hi >= emax_field
    bad |= np.maximum(col_hi, emin_field) - np.maximum(col_lo, emin_field) > slack
    idx = np.flatnonzero(bad)
    return idx if idx.size else None


def _round_exact(s: _F64, dtype: np.dtype[Any]) -> _Array:
    """Round float64 values (each an exact sum) once, correctly, to ``dtype``."""
    if _extension_finfo(dtype) is None:
        return s.astype(dtype)  # one IEEE cast: correctly rounded
    return _round_to_format(s, None, dtype)


def _sum_double_double(w: _F64, dtype: np.dtype[Any]) -> _Array:
    """The exact sums of the columns of ``w`` (N, k) rounded to ``dtype``, by TwoSum
    double-double (see the module docs), with the exact fallback where needed."""
    sums, bad = _distill(w)
    s = sums[0]
    big_e = np.zeros_like(s)
    for x in sums[1:]:
        s, e = _two_sum(s, x)
        big_e, f = _two_sum(big_e, e)
        bad |= f != 0
    t, r = _two_sum(s, big_e)
    # An exact zero: the first sum is -0.0 exactly when every input was -0.0.
    t = np.where(t == 0, np.where((sums[0] == 0) & np.signbit(sums[0]), -0.0, 0.0), t)
    if dtype == np.float64:
        out = t
    elif _extension_finfo(dtype) is None:
        out = _narrow(t, r, dtype)
    else:
        out = _round_to_format(t, r, dtype)
    idx = np.flatnonzero(bad)
    if idx.size:
        out[idx] = _exact_fallback(w[:, idx], dtype)
    return out


_DISTILL_LEVELS = 4
# Past this many values the trees' temporaries leave the cache, and summing row
# by row (a few calls per replica, each on cache-sized rows) is faster.
_TREE_MAX_SIZE = 1 << 15


def _distill(w: _F64) -> tuple[list[_F64], npt.NDArray[np.bool_]]:
    """A few rows ``sums`` whose column sums equal those of ``w`` (N, k) exactly,
    and the columns where that failed (an inf or nan, an overflow, or errors
    left after ``_DISTILL_LEVELS`` levels).

    Each level sums its rows with a TwoSum tree (:func:`_two_sum_tree`), keeps
    the sum and passes the N - 1 error rows to the next; the errors shrink by
    about 2**-53 per level and vanish once below the inputs' smallest ulp, so
    two or three levels usually leave all of them zero.
    """
    if w.size > _TREE_MAX_SIZE:
        return _distill_rows(w)
    sums = []
    rows = w
    for _ in range(_DISTILL_LEVELS):
        s, errors = _two_sum_tree(rows)
        sums.append(s)
        if not errors:
            return sums, ~np.isfinite(s)
        rows = np.concatenate(errors)
        if not rows.any():  # a nan error (inf/nan input, overflow) counts as nonzero
            return sums, np.zeros(s.shape, np.bool_)
    bad = np.asarray(rows.any(axis=0))
    return sums, bad


def _distill_rows(w: _F64) -> tuple[list[_F64], npt.NDArray[np.bool_]]:
    """:func:`_distill` row by row: ``s`` accumulates the rows with TwoSum, ``E``
    their errors with a second TwoSum; where that made no error, ``s + E`` is exact."""
    s = w[0].copy()
    big_e = np.zeros_like(s)
    bad = np.zeros(s.shape, np.bool_)
    for x in w[1:]:
        s, e = _two_sum(s, x)
        big_e, f = _two_sum(big_e, e)
        bad |= f != 0
    return [s, big_e], bad


def _two_sum_tree(w: _F64) -> tuple[_F64, list[_F64]]:
    """Sum the rows of ``w`` (N, k) pairwise with TwoSum, all pairs of a level at
    once: ``s`` (k,) and the levels' error rows, with ``s + sum(errors)`` exact."""
    errors = []
    while w.shape[0] > 1:
        half = w.shape[0] // 2
        s, e = _two_sum(w[:half], w[half : 2 * half])
        errors.append(e)
        w = np.concatenate([s, w[2 * half :]]) if w.shape[0] % 2 else s
    return w[0], errors


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


def _round_to_format(t: _F64, r: _F64 | None, dtype: np.dtype[Any]) -> _Array:
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
    if r is not None:  # None: t is exact
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
