"""Tests for polydist._sim._reduction.sum_replicas (the sim backend's sums)."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from polydist._sim._reduction import REDUCTION_ORDERS, sum_replicas

Array = npt.NDArray[Any]

FLOATS = [np.float16, np.float32, np.float64]
WIDTH: dict[Any, Literal[16, 32, 64]] = {np.float16: 16, np.float32: 32, np.float64: 64}
UINT = {np.float16: np.uint16, np.float32: np.uint32, np.float64: np.uint64}

# The database would write .hypothesis/ into the repository.
SETTINGS = settings(database=None, deadline=None, max_examples=200)


def f32(x: float) -> Array:
    return np.array(x, np.float32)


def reps(dtype: Any, *values: complex) -> list[Array]:
    """One 0-d replica value per argument."""
    return [np.array(v, dtype) for v in values]


def bits(a: Array) -> Array:
    return a.view(UINT[a.dtype.type])


def assert_same_bits(got: Array, want: Array) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    np.testing.assert_array_equal(bits(got), bits(want))


# --- an independent Fraction-based reference for "exact" ---------------------


def ref_round(exact: Fraction, dtype: Any) -> Any:
    """Round a rational to nearest-even in dtype by comparing candidates exactly."""
    t = np.dtype(dtype).type
    with np.errstate(all="ignore"):
        return _ref_round(exact, t)


def _ref_round(exact: Fraction, t: Any) -> Any:
    fi = np.finfo(t)
    big = Fraction(float(fi.max))
    ulp = big - Fraction(float(np.nextafter(fi.max, t(0))))  # ulp at max
    overflow = big + ulp / 2
    if abs(exact) >= overflow:
        return t(math.inf if exact > 0 else -math.inf)
    if abs(exact) > big:
        return t(fi.max if exact > 0 else -fi.max)
    approx = t(float(exact))  # may be off by one ulp through double rounding
    cands = [approx, np.nextafter(approx, t(np.inf)), np.nextafter(approx, t(-np.inf))]
    cands = [c for c in cands if np.isfinite(c)]
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - exact), int(bits(np.array(c))) & 1))


def ref_exact(values: list[Array]) -> Array:
    dtype = values[0].dtype
    stacked = np.stack(values).reshape(len(values), -1)
    out = np.empty(stacked.shape[1], dtype)
    for j in range(stacked.shape[1]):
        col = [float(x) for x in stacked[:, j]]
        if any(math.isnan(x) for x in col) or (math.inf in col and -math.inf in col):
            out[j] = np.nan
        elif math.inf in col or -math.inf in col:
            out[j] = math.inf if math.inf in col else -math.inf
        else:
            exact = sum((Fraction(x) for x in col), Fraction(0))
            if exact == 0:
                neg = all(math.copysign(1.0, x) < 0 for x in col)
                out[j] = -0.0 if neg else 0.0
            else:
                out[j] = ref_round(exact, dtype)
    return out.reshape(values[0].shape)


def python_loop(values: list[Array]) -> Array:
    acc = values[0].copy()
    with np.errstate(all="ignore"):
        for v in values[1:]:
            acc = acc + v
    return np.asarray(acc)


def ref_tree(values: list[Array]) -> Array:
    level = list(values)
    with np.errstate(all="ignore"):
        while len(level) > 1:
            pairs = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]
            level = pairs + ([level[-1]] if len(level) % 2 else [])
    return np.asarray(level[0])


def ref_ring(values: list[Array]) -> Array:
    n = len(values)
    flat = [v.reshape(-1) for v in values]
    out = np.empty_like(flat[0])
    chunks = np.array_split(np.arange(flat[0].size), n)
    for c, idx in enumerate(chunks):
        acc = flat[(c + 1) % n][idx]
        for j in range(2, n + 1):
            with np.errstate(all="ignore"):
                acc = acc + flat[(c + j) % n][idx]
        out[idx] = acc
    return out.reshape(values[0].shape)


# --- strategies ---------------------------------------------------------------


@st.composite
def replica_matrix(draw: st.DrawFn, dtype: Any) -> list[Array]:
    n = draw(st.integers(1, 40))
    m = draw(st.integers(1, 4))
    elems = st.floats(width=WIDTH[dtype], allow_nan=False, allow_infinity=False)
    mat = draw(hnp.arrays(dtype, (n, m), elements=elems))
    return list(mat)


@st.composite
def cancelling(draw: st.DrawFn, dtype: Any) -> list[Array]:
    """Large values with their exact negatives plus small survivors, shuffled."""
    w = WIDTH[dtype]
    big = draw(st.lists(st.floats(width=w, allow_nan=False, allow_infinity=False), max_size=12))
    small = draw(
        st.lists(
            st.floats(width=w, min_value=-1.0, max_value=1.0, allow_subnormal=True),
            min_size=1,
            max_size=12,
        )
    )
    vals = draw(st.permutations(big + [-x for x in big] + small))
    return reps(dtype, *vals)


@st.composite
def near_f32_midpoint(draw: st.DrawFn) -> list[Array]:
    """a + ulp(a)/2 lands on a float32 midpoint; a tiny extra term decides the rounding."""
    mant = draw(st.integers(2**23, 2**24 - 1))
    exp = draw(st.integers(-100, 80))
    a = math.ldexp(mant, exp)
    half = math.ldexp(1.0, exp - 1)
    tiny = math.ldexp(
        draw(st.sampled_from([1.0, -1.0, 0.0, 3.0, -5.0])), exp - draw(st.integers(25, 40))
    )
    sign = draw(st.sampled_from([1.0, -1.0]))
    # Split the half ulp in two so no single input carries it.
    vals = [sign * a, sign * half / 2, sign * half / 2, tiny]
    return reps(np.float32, *draw(st.permutations(vals)))


# --- "exact" ------------------------------------------------------------------


def test_orders_tuple() -> None:
    assert REDUCTION_ORDERS == ("exact", "sequential", "reverse", "tree", "ring")


@pytest.mark.parametrize("dtype", FLOATS)
@SETTINGS
@given(data=st.data())
def test_exact_matches_fraction_reference(dtype: Any, data: st.DataObject) -> None:
    values = data.draw(replica_matrix(dtype))
    assert_same_bits(sum_replicas(values), ref_exact(values))


@pytest.mark.parametrize("dtype", FLOATS)
@SETTINGS
@given(data=st.data())
def test_exact_cancellation_matches_reference(dtype: Any, data: st.DataObject) -> None:
    values = data.draw(cancelling(dtype))
    assert_same_bits(sum_replicas(values, "exact"), ref_exact(values))


@SETTINGS
@given(values=near_f32_midpoint())
def test_exact_float32_midpoints_match_reference(values: list[Array]) -> None:
    assert_same_bits(sum_replicas(values), ref_exact(values))


@pytest.mark.parametrize("dtype", FLOATS)
@SETTINGS
@given(data=st.data())
def test_exact_is_permutation_invariant(dtype: Any, data: st.DataObject) -> None:
    values = data.draw(replica_matrix(dtype))
    shuffled = data.draw(st.permutations(values))
    assert_same_bits(sum_replicas(shuffled), sum_replicas(values))


def test_exact_cancellation_differs_from_sequential() -> None:
    values = reps(np.float32, 1e8, 1.0, -1e8)
    assert sum_replicas(values) == np.float32(1.0)
    assert sum_replicas(values, "sequential") == np.float32(0.0)  # 1e8 + 1 rounds to 1e8


def test_exact_avoids_double_rounding_up() -> None:
    # Exact sum 1 + 2**-24 + 2**-80 is just above the float32 midpoint 1 + 2**-24.
    values = reps(np.float32, 1.0, 2.0**-24, 2.0**-80)
    naive = np.float32(sum(float(v) for v in values))  # float64 lands on the midpoint
    assert naive == np.float32(1.0)  # ... and ties to even: wrong
    assert sum_replicas(values) == np.float32(1.0 + 2.0**-23)


def test_exact_avoids_double_rounding_down() -> None:
    # 1 + 2**-23 + 2**-24 is a midpoint whose even neighbour is 1 + 2**-22; the exact
    # sum is just below it.
    values = reps(np.float32, 1.0 + 2.0**-23, 2.0**-24, -(2.0**-80))
    assert np.float32(sum(float(v) for v in values)) == np.float32(1.0 + 2.0**-22)
    assert sum_replicas(values) == np.float32(1.0 + 2.0**-23)


def test_exact_midpoint_tie_rounds_to_even() -> None:
    assert sum_replicas(reps(np.float32, 1.0, 2.0**-24)) == np.float32(1.0)
    assert sum_replicas(reps(np.float32, 1.0 + 2.0**-23, 2.0**-24)) == np.float32(1.0 + 2.0**-22)


@pytest.mark.parametrize(("dtype", "k", "p"), [(np.float32, 80, 24), (np.float64, 200, 53)])
def test_exact_fallback_ties_to_even(dtype: Any, k: int, p: int) -> None:
    # 2**k swamps the small terms, whose errors span too many bits for the
    # second TwoSum level, so the exact per-element path rounds the tie.
    big, tiny, half = 2.0**k, 2.0**-k, 2.0**-p
    values = reps(dtype, big, 1.0, half, tiny, -tiny, -big)
    assert sum_replicas(values) == 1.0  # 1 + half ulp ties down to even
    odd = 1.0 + 2 * half
    values = reps(dtype, big, odd, half, tiny, -tiny, -big)
    assert sum_replicas(values) == 1.0 + 4 * half  # ties up to even


def test_exact_is_replica_count_independent() -> None:
    x = np.float32(0.1)
    for n in (1, 2, 4, 64, 1024):
        assert sum_replicas([np.array(x / np.float32(n))] * n) == x  # x / 2**k is exact
    # The same total split unevenly over 3 and 5 replicas.
    y = float(x)
    assert sum_replicas(reps(np.float32, y, 1e30, -1e30)) == x
    assert sum_replicas(reps(np.float32, 3.0, y, -1.0, 1e-30, -2.0)) == x


def test_exact_float32_overflow_threshold() -> None:
    big = float(np.finfo(np.float32).max)
    assert sum_replicas(reps(np.float32, big, 2.0**103)) == np.float32(np.inf)  # tie -> even
    # Just below the tie: the midpoint fix must pick max, not inf.
    assert sum_replicas(reps(np.float32, big, 2.0**103, -(2.0**-149))) == np.float32(big)
    assert sum_replicas(reps(np.float32, big, big, -big)) == np.float32(big)


def test_exact_float64_intermediate_overflow() -> None:
    big = float(np.finfo(np.float64).max)
    # The float64 accumulation overflows; the exact fallback does not.
    assert sum_replicas(reps(np.float64, big, big, -big)) == big
    assert sum_replicas(reps(np.float64, big, 2.0**970)) == np.inf  # tie -> even
    assert sum_replicas(reps(np.float64, big, 2.0**970, -5e-324)) == big
    assert sum_replicas(reps(np.float64, -big, -big)) == -np.inf


def test_exact_float16() -> None:
    assert sum_replicas(reps(np.float16, 65504.0, 16.0)) == np.float16(np.inf)
    assert sum_replicas(reps(np.float16, 65504.0, 16.0, -(2.0**-24))) == np.float16(65504.0)
    assert sum_replicas(reps(np.float16, 2048.0, 1.0, 1.0)) == np.float16(2050.0)
    assert sum_replicas(reps(np.float16, 2048.0, 1.0, 1.0), "sequential") == np.float16(2048.0)


@pytest.mark.parametrize(
    ("vals", "want"),
    [
        ([np.inf, 1.0], np.inf),
        ([-np.inf, 6e4, 6e4], -np.inf),
        ([np.inf, np.inf], np.inf),
        ([np.inf, -np.inf], np.nan),
        ([np.nan, 1.0], np.nan),
        ([1.0, np.nan, np.inf], np.nan),
    ],
)
@pytest.mark.parametrize("dtype", FLOATS)
def test_exact_nonfinite(vals: list[float], want: float, dtype: Any) -> None:
    got = sum_replicas(reps(dtype, *vals))
    assert got.dtype == dtype
    if math.isnan(want):
        assert np.isnan(got)
    else:
        assert got == want


def test_exact_mixes_fast_path_and_fallback() -> None:
    # Columns: plain, nonfinite, overflow fallback, inexact second level, cancellation.
    big = float(np.finfo(np.float64).max)
    rows = [
        [1.0, np.inf, big, 1.0, 1e300],
        [2.0, 1.0, big, 2.0**-60, 1.0],
        [3.0, -np.inf, -big, 2.0**-200, -1e300],
    ]
    values = [np.array(r) for r in rows]
    want = np.array([6.0, np.nan, big, 1.0 + 2.0**-60, 1.0])
    got = sum_replicas(values)
    np.testing.assert_array_equal(got, want)
    assert_same_bits(got, ref_exact(values))


@pytest.mark.parametrize("dtype", FLOATS)
def test_exact_signed_zeros(dtype: Any) -> None:
    assert np.signbit(sum_replicas(reps(dtype, -0.0, -0.0, -0.0)))
    for vals in (
        [-0.0, 0.0],
        [1.0, -1.0],
        [-1.0, 1.0],
        [-1.0, -0.0, 1.0],
        [2.0**-14, 1, -1, -(2.0**-14)],
    ):
        got = sum_replicas(reps(dtype, *vals))
        assert got == 0
        assert not np.signbit(got), vals


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_exact_complex(dtype: Any) -> None:
    values = reps(dtype, complex(1e8, 1.0), complex(1.0, 1e8), complex(-1e8, -1e8))
    got = sum_replicas(values)
    assert got.dtype == dtype
    assert got.shape == ()
    assert got == complex(1.0, 1.0)
    if dtype == np.complex64:  # float32 parts lose the 1s sequentially
        assert sum_replicas(values, "sequential") == complex(0.0, 0.0)


def test_exact_complex_array() -> None:
    values = [np.array([1 + 2j, complex(-0.0, -0.0)], np.complex64)] * 3
    got = sum_replicas(values)
    np.testing.assert_array_equal(got, np.array([3 + 6j, 0j], np.complex64))
    assert np.signbit(got.real[1])
    assert np.signbit(got.imag[1])


def test_exact_large_float32_array() -> None:
    rng = np.random.default_rng(0)
    values = list(rng.standard_normal((8, 100_000)).astype(np.float32) * 1000)
    got = sum_replicas(values)
    assert got.shape == (100_000,)
    assert got.dtype == np.float32
    sample = rng.choice(100_000, 300, replace=False)
    assert_same_bits(got[sample], ref_exact([v[sample] for v in values]))


def test_exact_float64_wide_magnitudes_use_fallback() -> None:
    rng = np.random.default_rng(1)
    mags = 10.0 ** rng.integers(-150, 150, size=(6, 200))
    values = list(rng.standard_normal((6, 200)) * mags)
    assert_same_bits(sum_replicas(values), ref_exact(values))


# --- integer and bool ---------------------------------------------------------


@pytest.mark.parametrize("order", REDUCTION_ORDERS)
def test_int32_wraparound(order: Any) -> None:
    imax = np.iinfo(np.int32).max
    got = sum_replicas(reps(np.int32, imax, 1), order)
    assert got.dtype == np.int32
    assert got == np.iinfo(np.int32).min
    assert sum_replicas(reps(np.int32, imax, 1, -1), order) == imax


@pytest.mark.parametrize("order", REDUCTION_ORDERS)
def test_unsigned_and_int64_wraparound(order: Any) -> None:
    assert sum_replicas(reps(np.uint8, 250, 10, 1), order) == np.uint8(5)
    i64 = np.iinfo(np.int64)
    values = [np.array([i64.max, 5], np.int64), np.array([i64.max, -7], np.int64)]
    np.testing.assert_array_equal(sum_replicas(values, order), np.array([-2, -2], np.int64))


@pytest.mark.parametrize("order", REDUCTION_ORDERS)
@pytest.mark.parametrize("n", [1, 3])
def test_bool_raises(order: Any, n: int) -> None:
    with pytest.raises(TypeError, match="bool"):
        sum_replicas([np.array([True, False])] * n, order)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least one"):
        sum_replicas([])
    with pytest.raises(ValueError, match="unknown reduction order"):
        sum_replicas([f32(1.0)], "pairwise")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="disagree"):
        sum_replicas([f32(1.0), np.array(1.0)])
    with pytest.raises(ValueError, match="disagree"):
        sum_replicas([np.zeros(2, np.float32), np.zeros(3, np.float32)])
    with pytest.raises(TypeError, match="dtype"):
        sum_replicas([np.array(["a"]), np.array(["b"])])
    with pytest.raises(TypeError, match="exact"):
        sum_replicas([np.array(1.0, np.longdouble)] * 2)


# --- shapes, copies, sizes ----------------------------------------------------


@pytest.mark.parametrize("order", REDUCTION_ORDERS)
@pytest.mark.parametrize("dtype", [*FLOATS, np.complex64, np.int32])
def test_single_replica_returns_copy(order: Any, dtype: Any) -> None:
    x = np.array([1, 2, 3], dtype)
    got = sum_replicas([x], order)
    assert got is not x
    assert not np.shares_memory(got, x)
    np.testing.assert_array_equal(got, x)
    assert got.dtype == dtype


@pytest.mark.parametrize("order", REDUCTION_ORDERS)
@pytest.mark.parametrize("dtype", [*FLOATS, np.complex128, np.int16])
def test_result_is_new_array_of_same_shape_and_dtype(order: Any, dtype: Any) -> None:
    values = [np.full((2, 3), i + 1, dtype) for i in range(4)]
    snapshot = [v.copy() for v in values]
    got = sum_replicas(values, order)
    assert isinstance(got, np.ndarray)
    assert got.shape == (2, 3)
    assert got.dtype == dtype
    assert not any(np.shares_memory(got, v) for v in values)
    np.testing.assert_array_equal(got, np.full((2, 3), 10, dtype))
    for v, s in zip(values, snapshot):
        np.testing.assert_array_equal(v, s)


@pytest.mark.parametrize("order", REDUCTION_ORDERS)
@pytest.mark.parametrize("n", [1, 2, 5])
def test_zero_d(order: Any, n: int) -> None:
    values = reps(np.float32, *[0.5 * (i + 1) for i in range(n)])
    got = sum_replicas(values, order)
    assert isinstance(got, np.ndarray)
    assert got.shape == ()
    assert got.dtype == np.float32
    assert got == np.float32(0.25 * n * (n + 1))


@pytest.mark.parametrize("order", REDUCTION_ORDERS)
def test_empty_arrays(order: Any) -> None:
    got = sum_replicas([np.zeros((0, 3), np.float32)] * 3, order)
    assert got.shape == (0, 3)
    assert got.dtype == np.float32


def test_1024_replicas() -> None:
    x = np.float32(0.1)
    values = [np.full(3, x)] * 1024
    assert_same_bits(sum_replicas(values), np.full(3, x * np.float32(1024)))  # exact: 2**10 x
    seq = sum_replicas(values, "sequential")
    assert_same_bits(seq, python_loop(values))
    assert seq[0] != x * np.float32(1024)
    rng = np.random.default_rng(2)
    values = list(rng.standard_normal((1024, 5)).astype(np.float32))
    assert_same_bits(sum_replicas(values, "reverse"), python_loop(values[::-1]))
    assert_same_bits(sum_replicas(values, "tree"), ref_tree(values))
    assert_same_bits(sum_replicas(values, "ring"), ref_ring(values))
    assert_same_bits(sum_replicas(values), ref_exact(values))


# --- the modelled orders ------------------------------------------------------

TINY = 2.0**-24  # half an ulp of 1.0 in float32


def test_modelled_orders_differ_on_crafted_case() -> None:
    values = reps(np.float32, 1.0, TINY, TINY, TINY)
    # sequential: each 2**-24 ties back down to 1.
    assert sum_replicas(values, "sequential") == f32(1.0)
    # reverse: 3 * 2**-24 + 1 = 1 + 1.5 ulp, a tie rounding to the even 1 + 2**-22.
    assert sum_replicas(values, "reverse") == f32(1.0 + 2.0**-22)
    # tree: (1 + 2**-24) + (2**-24 + 2**-24) = 1 + 2**-23.
    assert sum_replicas(values, "tree") == f32(1.0 + 2.0**-23)
    # exact: 1 + 3 * 2**-24 ties to even like reverse.
    assert sum_replicas(values, "exact") == f32(1.0 + 2.0**-22)


def test_tree_carries_odd_one_out() -> None:
    values = reps(np.float32, 1.0, TINY, TINY, TINY, TINY)
    # ((1 + t) + (t + t)) + t = (1 + 2**-23) + 2**-24, a tie to even 1 + 2**-22.
    assert sum_replicas(values, "tree") == f32(1.0 + 2.0**-22)
    assert sum_replicas(values, "sequential") == f32(1.0)
    # Carrying at the front instead, (t + t) + ..., would differ:
    values = reps(np.float32, TINY, TINY, TINY, TINY, 1.0)
    # ((t + t) + (t + t)) + 1 = 2**-22 + 1 exactly.
    assert sum_replicas(values, "tree") == f32(1.0 + 2.0**-22)
    values = reps(np.float32, TINY, TINY, 1.0)
    assert sum_replicas(values, "tree") == f32(1.0 + 2.0**-23)
    assert sum_replicas(values, "reverse") == f32(1.0)


def test_reverse_crafted() -> None:
    values = reps(np.float32, 1.0, TINY, TINY)
    assert sum_replicas(values, "sequential") == f32(1.0)
    assert sum_replicas(values, "reverse") == f32(1.0 + 2.0**-23)


def test_ring_crafted() -> None:
    # N=3, 5 elements -> chunks [0, 1], [2, 3], [4] (array_split semantics).
    # Chunk 0 starts at replica 1: (t + t) + 1 = 1 + 2**-23.
    # Chunk 1 starts at replica 2: (t + 1) + t = 1.  Chunk 2 is in order: 1.
    values = [
        np.full(5, 1.0, np.float32),
        np.full(5, TINY, np.float32),
        np.full(5, TINY, np.float32),
    ]
    want = np.array([1.0 + 2.0**-23, 1.0 + 2.0**-23, 1.0, 1.0, 1.0], np.float32)
    assert_same_bits(sum_replicas(values, "ring"), want)
    assert_same_bits(sum_replicas(values, "sequential"), np.ones(5, np.float32))
    # Chunking is over the flattened array.
    shaped = [v[:4].reshape(2, 2) for v in values]
    want4 = np.array([[1.0 + 2.0**-23, 1.0 + 2.0**-23], [1.0, 1.0]], np.float32)
    assert_same_bits(sum_replicas(shaped, "ring"), want4)


def test_ring_fewer_elements_than_replicas() -> None:
    # One element, N=3: only chunk 0 is non-empty and it starts at replica 1.
    values = reps(np.float32, 1.0, TINY, TINY)
    assert sum_replicas(values, "ring") == f32(1.0 + 2.0**-23)


@SETTINGS
@given(
    mat=hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 40), st.integers(0, 50)),
        elements=st.floats(width=32, allow_nan=False, allow_infinity=False),
    )
)
def test_modelled_orders_match_references(mat: Array) -> None:
    values = list(mat)
    assert_same_bits(sum_replicas(values, "sequential"), python_loop(values))
    assert_same_bits(sum_replicas(values, "reverse"), python_loop(values[::-1]))
    assert_same_bits(sum_replicas(values, "tree"), ref_tree(values))
    assert_same_bits(sum_replicas(values, "ring"), ref_ring(values))


def test_sequential_matches_explicit_loop_float16() -> None:
    rng = np.random.default_rng(3)
    values = list(rng.standard_normal((33, 7)).astype(np.float16))
    assert_same_bits(sum_replicas(values, "sequential"), python_loop(values))
