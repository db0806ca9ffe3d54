"""sum_replicas and the sim's collectives on ml_dtypes' floats (bfloat16, float8_*)."""

from __future__ import annotations

import bisect
import math
import subprocess
import sys
from fractions import Fraction
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import polydist as pd
from polydist._sim import SimBackend, _reduction
from polydist._sim._reduction import REDUCTION_ORDERS, _round_dyadic, sum_replicas

Array = npt.NDArray[Any]

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3FN = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
BF16_MAX = float(ml_dtypes.finfo(BF16).max)  # (2 - 2**-7) * 2**127; its ulp is 2**120

SETTINGS = settings(database=None, deadline=None, max_examples=300)


def reps(dtype: Any, *values: float) -> list[Array]:
    """One 0-d replica value per argument; each must be exact in ``dtype``."""
    out = [np.array(v, dtype) for v in values]
    for v, a in zip(values, out):
        assert float(a) == v or math.isnan(v), f"{v!r} is not exact in {dtype}"
    return out


def assert_same(got: Array, want: float, dtype: Any) -> None:
    """Same dtype and value, the sign of a zero included; NaN matches NaN."""
    assert got.dtype == dtype
    if math.isnan(want):
        assert np.isnan(got).all(), got
        return
    want_arr = np.full(got.shape, want, dtype)
    assert got.tobytes() == want_arr.tobytes(), f"got {got!r}, want {want_arr!r}"


# --- correct rounding, where ml_dtypes' cast would round twice ----------------


def test_ml_dtypes_cast_rounds_twice() -> None:
    # Why the sim rounds by itself: the cast goes through float32, whose
    # rounding lands on a bfloat16 midpoint that then ties to even.
    assert float(np.float64(1 + 2**-8 + 2**-40).astype(BF16)) == 1.0


def test_exact_avoids_double_rounding_up() -> None:
    # 1 + 2**-8 + 2**-40 lies above the midpoint 1 + 2**-8 between 1 and 1 + 2**-7.
    assert_same(sum_replicas(reps(BF16, 1.0, 2.0**-8, 2.0**-40)), 1 + 2**-7, BF16)
    assert_same(sum_replicas(reps(BF16, -1.0, -(2.0**-8), -(2.0**-40))), -1 - 2**-7, BF16)


def test_exact_avoids_double_rounding_down() -> None:
    # Just below the midpoint 1 + 3 * 2**-8, which would tie up to 1 + 2**-6.
    assert float(np.float64(1 + 3 * 2**-8 - 2**-40).astype(BF16)) == 1 + 2**-6
    assert_same(sum_replicas(reps(BF16, 1.0, 3 * 2.0**-8, -(2.0**-40))), 1 + 2**-7, BF16)


def test_exact_midpoint_uses_the_residual() -> None:
    # fl64(1 + 2**-8 + 2**-80) is the midpoint 1 + 2**-8 itself: only the
    # residual 2**-80 says the exact sum lies above it.
    assert_same(sum_replicas(reps(BF16, 1.0, 2.0**-8, 2.0**-80)), 1 + 2**-7, BF16)
    assert_same(sum_replicas(reps(BF16, 1.0, 2.0**-8, -(2.0**-80))), 1.0, BF16)


def test_exact_ties_to_even() -> None:
    assert_same(sum_replicas(reps(BF16, 1.0, 2.0**-8)), 1.0, BF16)
    assert_same(sum_replicas(reps(BF16, 1 + 2.0**-7, 2.0**-8)), 1 + 2**-6, BF16)
    assert_same(sum_replicas(reps(BF16, -1 - 2.0**-7, -(2.0**-8))), -1 - 2**-6, BF16)


def test_exact_subnormals() -> None:
    tiny = 2.0**-133  # bfloat16's smallest subnormal
    assert_same(sum_replicas(reps(BF16, tiny, tiny, tiny)), 3 * tiny, BF16)
    assert_same(sum_replicas(reps(BF16, 2.0**-126, -tiny)), 2.0**-126 - tiny, BF16)
    assert_same(sum_replicas(reps(BF16, 2.0**-126 + tiny, tiny)), 2.0**-126 + 2 * tiny, BF16)


@pytest.mark.parametrize("levels", [1, _reduction._DISTILL_LEVELS])
@pytest.mark.parametrize(("odd", "want"), [(False, 1.0), (True, 1 + 2**-6)])
def test_exact_integer_fallback(
    monkeypatch: pytest.MonkeyPatch, odd: bool, want: float, levels: int
) -> None:
    # 2**100 swamps the small terms, whose errors span too many bits for one
    # TwoSum level: with one level the exact per-element path must round the
    # tie; the default levels distill the errors until they vanish.
    calls: list[int] = []
    fallback = _reduction._exact_fallback

    def spy(cols: Any, dtype: Any) -> Any:
        calls.append(cols.shape[1])
        return fallback(cols, dtype)

    monkeypatch.setattr(_reduction, "_exact_fallback", spy)
    monkeypatch.setattr(_reduction, "_DISTILL_LEVELS", levels)
    big, tiny = 2.0**100, 2.0**-100
    one = 1 + 2.0**-7 if odd else 1.0
    assert_same(sum_replicas(reps(BF16, big, one, 2.0**-8, tiny, -tiny, -big)), want, BF16)
    assert calls == ([1] if levels == 1 else [])


def test_exact_overflow() -> None:
    half_ulp = 2.0**119
    assert_same(sum_replicas(reps(BF16, BF16_MAX, half_ulp)), math.inf, BF16)  # tie -> even
    # Just below the tie (fast path and integer path): max, not inf.
    assert_same(sum_replicas(reps(BF16, BF16_MAX, half_ulp, -(2.0**-133))), BF16_MAX, BF16)
    assert_same(sum_replicas(reps(BF16, BF16_MAX, half_ulp, -(2.0**100))), BF16_MAX, BF16)
    assert_same(sum_replicas(reps(BF16, -BF16_MAX, -BF16_MAX)), -math.inf, BF16)
    assert_same(sum_replicas(reps(BF16, BF16_MAX, BF16_MAX, -BF16_MAX)), BF16_MAX, BF16)
    assert_same(sum_replicas(reps(BF16, BF16_MAX, BF16_MAX), "sequential"), math.inf, BF16)


@pytest.mark.parametrize(
    ("vals", "want"),
    [
        ([math.inf, 1.0], math.inf),
        ([-math.inf, BF16_MAX, BF16_MAX], -math.inf),
        ([math.inf, -math.inf], math.nan),
        ([math.nan, 1.0], math.nan),
    ],
)
def test_exact_nonfinite(vals: list[float], want: float) -> None:
    assert_same(sum_replicas(reps(BF16, *vals)), want, BF16)


@pytest.mark.parametrize("order", REDUCTION_ORDERS)
def test_signed_zeros(order: Any) -> None:
    assert_same(sum_replicas(reps(BF16, -0.0, -0.0, -0.0), order), -0.0, BF16)
    assert_same(sum_replicas(reps(BF16, -0.0, 0.0, -0.0), order), 0.0, BF16)
    assert_same(sum_replicas(reps(BF16, 1.5, -1.5), order), 0.0, BF16)
    assert_same(sum_replicas(reps(BF16, -0.0, -(2.0**-133), 2.0**-133), order), 0.0, BF16)


def test_sequential_differs_from_exact() -> None:
    # What XLA:CPU's psum shows: a left-to-right bfloat16 sum loses every 2**-8.
    values = reps(BF16, 1.0, *[2.0**-8] * 7)
    assert_same(sum_replicas(values, "sequential"), 1.0, BF16)
    assert_same(sum_replicas(values), 1 + 7 * 2**-8, BF16)  # 1.02734375 -> 1.03125
    assert float(sum_replicas(values)) == 1.03125
    assert_same(sum_replicas(values, "reverse"), 1.03125, BF16)
    # ((1 + a) + 2a) + (2a + 2a) with a = 2**-8: 1, then 1 + 2**-7, then + 2**-6.
    assert_same(sum_replicas(values, "tree"), 1 + 3 * 2**-7, BF16)


@pytest.mark.parametrize("order", REDUCTION_ORDERS)
def test_every_order_keeps_shape_and_dtype(order: Any) -> None:
    rng = np.random.default_rng(0)
    values = [rng.standard_normal((3, 5)).astype(BF16) for _ in range(6)]
    got = sum_replicas(values, order)
    assert got.dtype == BF16 and got.shape == (3, 5)
    assert all(got is not v for v in values)
    wide = np.sum([v.astype(np.float64) for v in values], axis=0)
    # Six bfloat16 terms of size < 5: any order errs by well under 0.5.
    np.testing.assert_allclose(got.astype(np.float64), wide, atol=0.5)


# --- float8 -------------------------------------------------------------------


def test_float8_e4m3fn() -> None:
    # No infinities: past 464 (max 448 plus half its ulp) the sum is NaN.
    assert_same(sum_replicas(reps(E4M3FN, 448.0, 16.0)), 448.0, E4M3FN)  # tie -> even
    assert_same(sum_replicas(reps(E4M3FN, 448.0, 16.0, 2.0**-9)), math.nan, E4M3FN)
    assert_same(sum_replicas(reps(E4M3FN, 448.0, 32.0)), math.nan, E4M3FN)
    assert_same(sum_replicas(reps(E4M3FN, 448.0, 32.0, -32.0)), 448.0, E4M3FN)
    # Ulp 2**-3 at 1: a tie goes to even, the residual breaks it.
    assert_same(sum_replicas(reps(E4M3FN, 1.0, 2.0**-4)), 1.0, E4M3FN)
    assert_same(sum_replicas(reps(E4M3FN, 1.0, 2.0**-4, 2.0**-9)), 1.125, E4M3FN)
    assert_same(sum_replicas(reps(E4M3FN, 1.0, *[2.0**-4] * 3), "sequential"), 1.0, E4M3FN)
    assert_same(sum_replicas(reps(E4M3FN, 1.0, *[2.0**-4] * 3)), 1.25, E4M3FN)
    assert_same(sum_replicas(reps(E4M3FN, math.nan, 1.0)), math.nan, E4M3FN)


def test_float8_e5m2() -> None:
    # Recent ml_dtypes give float8_e5m2 kind "f", yet np.finfo does not know it.
    assert_same(sum_replicas(reps(E5M2, 1.0, 0.125)), 1.0, E5M2)
    assert_same(sum_replicas(reps(E5M2, 1.0, 0.125, 2.0**-16)), 1.25, E5M2)
    assert_same(sum_replicas(reps(E5M2, 57344.0, 4096.0)), math.inf, E5M2)  # tie -> even
    assert_same(sum_replicas(reps(E5M2, 57344.0, 4096.0, -(2.0**-16))), 57344.0, E5M2)


# --- refusals and the optional dependency ---------------------------------------


@pytest.mark.parametrize("order", REDUCTION_ORDERS)
@pytest.mark.parametrize(
    "dtype",
    [
        np.dtype(ml_dtypes.int4),
        np.dtype("V2"),
        # ml_dtypes.finfo(complex32) describes its float16 parts: still not a float.
        *([np.dtype(ml_dtypes.complex32)] if hasattr(ml_dtypes, "complex32") else []),
    ],
)
def test_non_float_extension_dtypes_are_refused(order: Any, dtype: Any) -> None:
    with pytest.raises(TypeError, match=f"cannot SUM replica values of dtype {dtype}"):
        sum_replicas([np.zeros(3, dtype)] * 2, order)


def test_numpy_dtypes_do_not_import_ml_dtypes() -> None:
    code = (
        "import sys, numpy as np, polydist\n"
        "from polydist._sim._reduction import sum_replicas\n"
        "for order in ('exact', 'sequential'):\n"
        "    sum_replicas([np.ones(2, np.float32)] * 3, order)\n"
        "    sum_replicas([np.ones(2, np.float16)] * 3, order)\n"
        "try:\n"
        "    sum_replicas([np.zeros(2, 'V2')] * 2)\n"
        "except TypeError:\n"
        "    pass\n"
        "assert 'ml_dtypes' not in sys.modules, 'ml_dtypes was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- a property: "exact" is the correctly rounded sum -------------------------

# Every finite bfloat16 value, ascending: an independent table to round with.
_BITS = np.arange(2**16, dtype=np.uint16)
_FINITE_BITS = _BITS[(_BITS >> 7) & 0xFF != 0xFF]  # exponent all ones: inf or nan
_TABLE = sorted({float(v) for v in _FINITE_BITS.view(BF16)})
_EVEN = {float(v): int(b) % 2 == 0 for v, b in zip(_FINITE_BITS.view(BF16), _FINITE_BITS)}


def _table_round(exact: Fraction) -> float:
    """Nearest bfloat16 to ``exact`` (ties to even), found in the table; inf past max + ulp/2."""
    if abs(exact) >= Fraction(BF16_MAX) + Fraction(2**119):
        return math.inf if exact > 0 else -math.inf
    i = bisect.bisect_left(_TABLE, float(exact))  # float() only to find the neighbours
    cands = [_TABLE[j] for j in range(max(i - 2, 0), min(i + 2, len(_TABLE)))]
    return min(cands, key=lambda c: (abs(Fraction(c) - exact), not _EVEN[c]))


def _bf16_bits() -> st.SearchStrategy[float]:
    """Any finite bfloat16, or one near 1 (there the fast path decides most sums)."""
    anywhere = st.integers(0, 2**16 - 1).filter(lambda b: (b >> 7) & 0xFF != 0xFF)
    near_one = st.builds(
        lambda sign, exp, mant: (sign << 15) | (exp << 7) | mant,
        st.integers(0, 1),
        st.integers(127 - 12, 127 + 2),
        st.integers(0, 127),
    )
    return st.one_of(anywhere, near_one).map(lambda b: float(np.array(b, np.uint16).view(BF16)))


@SETTINGS
@given(cols=st.lists(st.lists(_bf16_bits(), min_size=2, max_size=24), min_size=1, max_size=4))
def test_exact_matches_fraction_reference(cols: list[list[float]]) -> None:
    n = min(len(c) for c in cols)
    values = [np.array([c[i] for c in cols], BF16) for i in range(n)]
    got = sum_replicas(values)
    fi = ml_dtypes.finfo(BF16)
    for j, col in enumerate(cols):
        exact = sum((Fraction(x) for x in col[:n]), Fraction(0))
        if exact == 0:
            want = -0.0 if all(math.copysign(1.0, x) < 0 for x in col[:n]) else 0.0
        else:
            shift = exact.denominator.bit_length() - 1  # a power of two: dyadic inputs
            want = _round_dyadic(exact.numerator, shift, fi.nmant + 1, fi.minexp, fi.maxexp - 1)
            assert want == _table_round(exact)
        assert_same(got[j : j + 1], want, BF16)


# --- through a strategy -------------------------------------------------------


def _per_replica(n: int) -> pd.PerReplica:
    return pd.PerReplica([np.array([1.0 if i == 0 else 2.0**-8, 3.0], BF16) for i in range(n)])


@pytest.mark.parametrize("order", ["exact", "sequential"])
def test_all_reduce_in_a_strategy(order: Any) -> None:
    strategy = pd.MirroredStrategy(4, backend=SimBackend(order))
    values = _per_replica(4)

    def step(v: Array) -> tuple[Array, Array]:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce("SUM", v), ctx.all_reduce(pd.ReduceOp.MEAN, v)

    total, mean = strategy.run(step, args=(values,))
    # 1 + 3 * 2**-8 ties to even; left to right, each 2**-8 ties away to 1.
    first = 1 + 2**-6 if order == "exact" else 1.0
    for t, m in zip(total.values, mean.values):
        assert t.dtype == BF16 and m.dtype == BF16
        np.testing.assert_array_equal(t.astype(np.float64), [first, 12.0])
        # MEAN divides in bfloat16, as TF does: the quotient is exact here.
        np.testing.assert_array_equal(m.astype(np.float64), [first / 4, 3.0])


def test_mean_divides_in_bfloat16() -> None:
    strategy = pd.MirroredStrategy(3, backend=SimBackend())
    ones = pd.PerReplica([np.array(1.0 if i == 0 else 0.0, BF16) for i in range(3)])
    mean = strategy.reduce("MEAN", ones, axis=None)
    assert mean.dtype == BF16
    # 1/3 rounded to 8 significant bits is 171/512 (float32 would give 0.33333334).
    assert float(mean) == 171 / 512


def test_strategy_reduce() -> None:
    strategy = pd.MirroredStrategy(4, backend=SimBackend())
    values = _per_replica(4)
    total = strategy.reduce("SUM", values, axis=None)
    assert total.dtype == BF16
    np.testing.assert_array_equal(total.astype(np.float64), [1 + 2**-6, 12.0])
    mean = strategy.reduce("MEAN", values, axis=None)
    assert mean.dtype == BF16
    np.testing.assert_array_equal(mean.astype(np.float64), [(1 + 2**-6) / 4, 3.0])
    # axis=0: each replica sums its two elements (in bfloat16), then across replicas.
    # Replica 0 has 1 + 3 = 4; the others 2**-8 + 3, which rounds to 3 (ulp 2**-6).
    total0 = strategy.reduce("SUM", values, axis=0)
    assert total0.dtype == BF16 and total0.shape == ()
    assert float(total0) == 13.0
    mean0 = strategy.reduce("MEAN", values, axis=0)
    assert mean0.dtype == BF16 and mean0.shape == ()
    assert float(mean0) == 13.0 / 8


def test_compute_average_loss_of_bfloat16_losses() -> None:
    """TF's compute_average_loss accepts any floating loss: bfloat16 included."""
    strategy = pd.MirroredStrategy(2, backend=SimBackend())

    def step() -> Any:
        losses = np.array([1.0, 2.0, 3.5], dtype=BF16)
        return pd.nn.compute_average_loss(losses, global_batch_size=6)

    per_replica = strategy.run(step)
    # TF: the sum in bfloat16 (6.5, exact), divided by the batch size in bfloat16.
    assert float(np.array(6.5, BF16) / np.array(6, BF16)) == 1.0859375
    for value in per_replica.values:
        assert value.dtype == BF16 and float(value) == 1.0859375
    with pytest.raises(TypeError, match="floating-point"):
        strategy.run(lambda: pd.nn.compute_average_loss(np.array([1, 2], ml_dtypes.int4)))


def test_bfloat16_variables_take_ml_dtypes_values() -> None:
    """A variable holds ml_dtypes' floats (kind 'V' to NumPy) like NumPy's own floats:
    created from one, assigned its own .numpy(), MEAN-aggregated; int4 is refused."""
    strategy = pd.MirroredStrategy(2, backend=SimBackend("sequential"))
    with strategy.scope():
        v = pd.Variable(np.array([1.0078125, 3.0], BF16), aggregation=pd.VariableAggregation.MEAN)
    v.assign(v.numpy())
    strategy.run(lambda: v.assign(np.array([1.0, 2.0], BF16)))
    assert [c.numpy().dtype for c in v.values] == [BF16, BF16]
    assert v.numpy().tolist() == [1.0, 2.0]
    with pytest.raises(TypeError, match="would lose information"):
        v.assign(np.array([1, 2], ml_dtypes.int4))
    with pytest.raises(TypeError, match="which a variable cannot hold"), strategy.scope():
        pd.Variable(np.array([1, 2], ml_dtypes.int4))
