"""MEAN equals the sim's bit for bit at any replica count (XLA turns x / n into x * (1/n))."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polydist as pd
from polydist_jax import JaxBackend

# A third of float32 values x / 3 differ from x * (1/3) in the last bit.
VALUES = np.random.default_rng(3).standard_normal((7, 64)).astype(np.float32)


def sequential_mean(rows: np.ndarray) -> np.ndarray:
    total = rows[0]
    for row in rows[1:]:
        total = total + row
    return total / np.float32(len(rows))


def ctx() -> pd.ReplicaContext:
    c = pd.get_replica_context()
    assert c is not None
    return c


@pytest.mark.parametrize("n", [3, 5, 7])
@pytest.mark.parametrize("jit", [True, False], ids=["compiled", "eager"])
def test_all_reduce_and_reduce_mean_are_the_exact_quotient(n: int, jit: bool) -> None:
    strategy = pd.MirroredStrategy(n, backend=JaxBackend(jit=jit))
    rows = VALUES[:n]
    want = sequential_mean(rows)
    assert not np.array_equal(want, sum(rows[1:], rows[0]) * np.float32(1 / n))  # can fail
    x = pd.PerReplica([jax.device_put(r, d) for r, d in zip(rows, jax.devices())])

    def step(x: Any) -> Any:
        mean = ctx().all_reduce("MEAN", x)
        merged = ctx().merge_call(lambda s, v: s.reduce("MEAN", v, axis=None), args=(x,))
        return mean, merged

    mean, merged = strategy.run(step, (x,))
    results = [*strategy.experimental_local_results(mean)]
    results += strategy.experimental_local_results(merged)
    assert len(results) >= n + 1
    for got in results:
        np.testing.assert_array_equal(np.asarray(got), want)
    outside = strategy.reduce("MEAN", x, axis=None)
    np.testing.assert_array_equal(np.asarray(outside), want)


def test_exact_divide_keeps_dtype_and_weak_type() -> None:
    xp = JaxBackend().array_namespace()
    weak = xp.exact_divide(jnp.asarray(1.0), 3)
    assert weak.dtype == jnp.float32 and weak.aval.weak_type
    assert float(weak) == np.float32(1.0) / np.float32(3)
    half = xp.exact_divide(jnp.asarray(VALUES[0], jnp.float16), 3)
    np.testing.assert_array_equal(np.asarray(half), VALUES[0].astype(np.float16) / np.float16(3))
    traced = jax.jit(lambda v: xp.exact_divide(v, 7))(VALUES[0])
    np.testing.assert_array_equal(np.asarray(traced), VALUES[0] / np.float32(7))


@pytest.mark.parametrize("jit", [True, False], ids=["compiled", "eager"])
def test_reduce_mean_with_axis_is_the_exact_quotient(jit: bool) -> None:
    """MEAN with an axis divides the sum by the number of elements summed (3 here)."""
    strategy = pd.MirroredStrategy(3, backend=JaxBackend(jit=jit))
    rows = [VALUES[r : r + 1] for r in range(3)]
    total = rows[0][0] + rows[1][0] + rows[2][0]
    want = total / np.float32(3)
    assert not np.array_equal(want, total * np.float32(1 / 3))  # the test can fail
    x = pd.PerReplica([jax.device_put(r, d) for r, d in zip(rows, jax.devices())])
    np.testing.assert_array_equal(np.asarray(strategy.reduce("MEAN", x, axis=0)), want)

    def step(x: Any) -> Any:
        return ctx().merge_call(lambda s, v: s.reduce("MEAN", v, axis=0), args=(x,))

    for got in strategy.experimental_local_results(strategy.run(step, (x,))):
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("jit", [True, False], ids=["compiled", "eager"])
def test_reduce_mean_of_ints_with_axis_is_quiet(jit: bool) -> None:
    """TF's float64 MEAN of ints is JAX's widest float without x64, as with ``axis=None``:
    no "truncated to float32" warning (pytest turns one into an error)."""
    strategy = pd.MirroredStrategy(3, backend=JaxBackend(jit=jit))
    x = strategy.run(
        lambda: jnp.arange(4, dtype=jnp.int32).reshape(2, 2) + ctx().replica_id_in_sync_group
    )
    want_dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    for axis, want in [(0, [2.0, 3.0]), (1, [1.5, 3.5]), ((0, 1), 2.5), (None, [[1, 2], [3, 4]])]:
        got = strategy.reduce("MEAN", x, axis=axis)
        assert got.dtype == want_dtype, axis
        np.testing.assert_array_equal(np.asarray(got), want)

    def step(x: Any) -> Any:
        return ctx().merge_call(lambda s, v: s.reduce("MEAN", v, axis=0), args=(x,))

    for got in strategy.experimental_local_results(strategy.run(step, (x,))):
        assert got.dtype == want_dtype
        np.testing.assert_array_equal(np.asarray(got), [2.0, 3.0])
