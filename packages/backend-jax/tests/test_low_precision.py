"""SUM/MEAN of bfloat16 and float8 across replicas, compiled and eager, against the sim.

XLA:CPU adds these dtypes in a wider type, so its sums are not the sim's
"sequential" bits: they are compared with the sim's correctly rounded
("exact") sums within the conformance suite's error bound.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax_testutil import distribute

import polydist as pd
from polydist_conformance.tolerance import Reduction, within_bound
from polydist_jax import JaxBackend
from polydist_sim import SimBackend

N = 8
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3FN = np.dtype(ml_dtypes.float8_e4m3fn)
# [1] + [2**-8] * 7: exactly 1.02734375, 1.03125 rounded once to bfloat16, but
# 1.0 if each addition rounds to bfloat16 (every 2**-8 is a tie that goes to even).
ONE_AND_TIES = [np.array([1.0 if r == 0 else 2.0**-8, 3.0], BF16) for r in range(N)]


def ctx() -> pd.ReplicaContext:
    c = pd.get_replica_context()
    assert c is not None
    return c


def random_rows(dtype: np.dtype[Any], shape: tuple[int, int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # Magnitudes 2**-6 .. 2**6, so the order of the additions shows in the bits.
    return [
        (rng.standard_normal(shape) * 2.0 ** rng.integers(-6, 6, shape)).astype(dtype)
        for _ in range(N)
    ]


def host(x: Any) -> np.ndarray:
    return np.asarray(x)


def assert_within(got: Any, want: Any, reduction: Reduction, *, oracle_exact: bool) -> None:
    g, w = host(got), host(want)
    assert g.dtype == w.dtype, f"dtype {g.dtype} != {w.dtype}"
    ok = within_bound(g, w, reduction, oracle_exact=oracle_exact)
    assert ok.all(), f"outside the error bound:\n{g!r}\n{w!r}"


def program(strategy: pd.Strategy, rows: list[np.ndarray]) -> dict[str, Any]:
    x = distribute(strategy, rows)
    total, mean = strategy.run(
        lambda v: (ctx().all_reduce("SUM", v), ctx().all_reduce(pd.ReduceOp.MEAN, v)), (x,)
    )
    return {
        "all_reduce_sum": total.values,
        "all_reduce_mean": mean.values,
        "reduce_sum": strategy.reduce("SUM", x, axis=None),
        "reduce_mean": strategy.reduce("MEAN", x, axis=None),
        "reduce_sum_axis0": strategy.reduce("SUM", x, axis=0),
        "reduce_mean_axis0": strategy.reduce("MEAN", x, axis=0),
    }


@pytest.mark.parametrize("jit", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize(
    "rows",
    # float8_e4m3fn: one row each, as the bound needs (terms - 1) * 2**-4 < 1.
    [ONE_AND_TIES, random_rows(BF16, (3, 5), 0), random_rows(E4M3FN, (1, 5), 1)],
    ids=["ties", "random-bf16", "random-e4m3fn"],
)
def test_sums_agree_with_the_sim_within_the_bound(jit: bool, rows: list[np.ndarray]) -> None:
    got = program(pd.MirroredStrategy(N, backend=JaxBackend(jit=jit)), rows)
    want = program(pd.MirroredStrategy(N, backend=SimBackend("exact")), rows)
    dtype = rows[0].dtype
    across = Reduction.across_replicas(rows)
    across_mean = Reduction.across_replicas(rows, mean=True)
    along = Reduction.along_axis(rows, 0)
    along_mean = Reduction.along_axis(rows, 0, mean=True)
    for key, reduction in [("all_reduce_sum", across), ("all_reduce_mean", across_mean)]:
        assert len(got[key]) == N
        for g in got[key]:
            assert g.dtype == dtype
            # The sim's cross-replica sums are correctly rounded.
            assert_within(g, want[key][0], reduction, oracle_exact=True)
    assert_within(got["reduce_sum"], want["reduce_sum"], across, oracle_exact=True)
    assert_within(got["reduce_mean"], want["reduce_mean"], across_mean, oracle_exact=True)
    # With an axis each replica first sums its batch with its own xp.sum.
    assert_within(got["reduce_sum_axis0"], want["reduce_sum_axis0"], along, oracle_exact=False)
    assert_within(
        got["reduce_mean_axis0"], want["reduce_mean_axis0"], along_mean, oracle_exact=False
    )
    for key in got:
        for value in got[key] if key.startswith("all_reduce") else [got[key]]:
            assert value.dtype == dtype, key


def test_compiled_psum_adds_bfloat16_in_a_wider_type() -> None:
    # Pinned: XLA:CPU's all-reduce rounds once, so it gives the correctly rounded
    # 1.03125 here, where adding in bfloat16 (the sim's "sequential") gives 1.0.
    strategy = pd.MirroredStrategy(N, backend=JaxBackend())
    x = distribute(strategy, ONE_AND_TIES)
    out = strategy.run(lambda v: ctx().all_reduce("SUM", v), (x,))
    for v in out.values:
        assert v.dtype == jnp.bfloat16
        np.testing.assert_array_equal(host(v).astype(np.float64), [1.03125, 24.0])
    sim = pd.MirroredStrategy(N, backend=SimBackend("sequential"))
    seq = sim.reduce("SUM", pd.PerReplica(ONE_AND_TIES), axis=None)
    np.testing.assert_array_equal(seq.astype(np.float64), [1.0, 24.0])


def test_int4_is_refused_by_core_as_on_the_sim() -> None:
    strategy = pd.MirroredStrategy(N, backend=JaxBackend())
    with pytest.raises(TypeError, match=r"cannot SUM replica values of dtype int4: got int4\[3\]"):
        strategy.run(lambda: ctx().all_reduce("SUM", jnp.ones(3, jnp.int4)))
    sim = pd.MirroredStrategy(N, backend=SimBackend())
    with pytest.raises(TypeError, match="cannot SUM replica values of dtype int4"):
        sim.run(lambda: ctx().all_reduce("SUM", np.ones(3, ml_dtypes.int4)))
