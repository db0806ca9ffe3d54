"""polydist.nn.synchronized_moments on the sim: the moments of the global batch."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import polydist as pd


def _run_moments(parts: list[np.ndarray], **kwargs: Any) -> list[tuple[np.ndarray, ...]]:
    strategy = pd.MirroredStrategy(len(parts))
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: parts[ctx.replica_id_in_sync_group]
    )
    out = strategy.run(lambda x: pd.nn.synchronized_moments(x, **kwargs), args=(values,))
    per_field = [strategy.experimental_local_results(v) for v in out]
    return [tuple(np.asarray(f[r]) for f in per_field) for r in range(len(parts))]


@pytest.mark.parametrize("sizes", [(4, 4, 4), (3, 0, 5, 1), (0, 0, 2), (7,)])
def test_matches_one_device_moments_of_the_whole_batch(sizes: tuple[int, ...]) -> None:
    rng = np.random.default_rng(sum(sizes))
    # A large mean: E[x**2] - E[x]**2 in float32 would lose every digit of the variance.
    parts = [rng.normal(1000.0, 0.5, (n, 3, 2)).astype(np.float32) for n in sizes]
    whole = np.concatenate(parts).astype(np.float64)
    results = _run_moments(parts, axes=[0, 1], return_count=True)
    for mean, variance, count in results:  # every replica: the same global moments
        assert mean.dtype == variance.dtype == count.dtype == np.float32
        assert mean.shape == variance.shape == count.shape == (2,)
        np.testing.assert_allclose(mean, whole.mean((0, 1)), rtol=1e-6)
        np.testing.assert_allclose(variance, whole.var((0, 1)), rtol=2e-3)
        np.testing.assert_array_equal(count, [3.0 * sum(sizes)] * 2)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


def test_the_naive_formula_would_have_failed_here() -> None:
    """The check above can fail: float32 E[x**2] - E[x]**2 of the same data is far off."""
    x = np.random.default_rng(7).normal(1000.0, 0.5, (64, 2)).astype(np.float32)
    naive = (x * x).mean(0) - x.mean(0) ** 2
    assert not np.allclose(naive, x.astype(np.float64).var(0), rtol=2e-3)
    ((_, variance),) = _run_moments([x], axes=0)
    np.testing.assert_allclose(variance, x.astype(np.float64).var(0), rtol=2e-3)


def test_keepdims_negative_axes_and_mask() -> None:
    parts = [np.arange(8, dtype=np.float32).reshape(2, 4) + 10 * r for r in range(2)]
    masks = [np.asarray([True, False, True, True]), np.asarray([False, False, True, True])]
    strategy = pd.MirroredStrategy(2)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: parts[ctx.replica_id_in_sync_group]
    )
    keep = strategy.experimental_distribute_values_from_function(
        lambda ctx: masks[ctx.replica_id_in_sync_group]
    )
    mean, variance = strategy.run(
        lambda x, m: pd.nn.synchronized_moments(x, axes=(-1, 0), keepdims=True, mask=m),
        args=(values, keep),
    )
    kept = np.concatenate([p[:, m] for p, m in zip(parts, masks)], axis=1)
    for r in range(2):
        got_mean = strategy.experimental_local_results(mean)[r]
        assert got_mean.shape == (1, 1)
        np.testing.assert_allclose(got_mean, [[kept.mean()]], rtol=1e-6)
        got_var = strategy.experimental_local_results(variance)[r]
        np.testing.assert_allclose(got_var, [[kept.var()]], rtol=1e-6)


def test_outside_replica_context_the_moments_are_the_arrays_own() -> None:
    x = np.asarray([[1.0, 2.0], [3.0, 6.0]], np.float32)
    mean, variance = pd.nn.synchronized_moments(x, 0)  # the default strategy
    np.testing.assert_array_equal(mean, [2.0, 4.0])
    np.testing.assert_array_equal(variance, [1.0, 4.0])
    strategy = pd.MirroredStrategy(2)
    with strategy.scope():  # cross-replica context: Keras' layer uses the local batch
        mean, variance = pd.nn.synchronized_moments(x, 0)
    np.testing.assert_array_equal(variance, [1.0, 4.0])


def test_empty_global_batch_is_nan_and_narrow_floats_use_float32() -> None:
    ((mean, variance),) = _run_moments([np.zeros((0, 2), np.float32)], axes=0)
    assert np.isnan(mean).all() and np.isnan(variance).all()
    half = [np.asarray([[1.0], [2.0]], ml_dtypes.bfloat16), np.asarray([[4.0]], ml_dtypes.bfloat16)]
    mean, variance = _run_moments(half, axes=0)[1]
    assert mean.dtype == variance.dtype == np.float32
    np.testing.assert_allclose(mean, [7 / 3], rtol=1e-6)
    np.testing.assert_allclose(variance, [np.var([1.0, 2.0, 4.0])], rtol=1e-6)


def test_bad_input_says_what_was_expected() -> None:
    with pytest.raises(TypeError, match=r"needs a floating array, got int32\[2\]"):
        pd.nn.synchronized_moments(np.asarray([1, 2], np.int32), 0)
    with pytest.raises(ValueError, match="axis 2 is out of range for an array of rank 2"):
        pd.nn.synchronized_moments(np.zeros((2, 2), np.float32), [0, 2])
    with pytest.raises(ValueError, match="repeat an axis"):
        pd.nn.synchronized_moments(np.zeros((2, 2), np.float32), [0, -2])
    with pytest.raises(TypeError, match="axes must be integers"):
        pd.nn.synchronized_moments(np.zeros((2, 2), np.float32), [0.0])
