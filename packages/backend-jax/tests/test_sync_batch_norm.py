"""polydist_jax.nnx.SyncBatchNorm: nnx.BatchNorm with the global batch's statistics.

A Linear -> norm -> Linear model trained on N replicas (compiled and eager, even and
uneven batches, with a mask, and on 2 worker processes) gives the outputs, losses,
weights and running statistics of the same model with a plain ``nnx.BatchNorm`` on
one device over the whole batch, to float32 rounding: ``rtol=1e-5, atol=1e-6`` (the
largest difference seen is about 5e-7, a few ulps, on values of order 1 to 5). The
reference is ``nnx.BatchNorm(use_fast_variance=False)``, whose two-pass variance is
the one ``synchronized_moments`` computes; a plain ``nnx.BatchNorm`` under the
strategy normalizes each replica by its own examples and does not match.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
optax = pytest.importorskip("optax")

from flax import nnx  # noqa: E402

import polydist as pd  # noqa: E402
from polydist.debugging import check_replicas_identical  # noqa: E402
from polydist_conformance import multiprocess_tests as mpt  # noqa: E402
from polydist_conformance.multiprocess import load  # noqa: E402
from polydist_jax import JaxBackend  # noqa: E402
from polydist_jax import nnx as pdnnx  # noqa: E402

HERE = Path(__file__).resolve().parent
RTOL, ATOL = 1e-5, 1e-6
GLOBAL_BATCH = 16  # splits evenly over 2, 4 and 8 replicas
MOMENTUM = 0.8

# One device's batch norm with the variance synchronized_moments computes (two-pass).
TwoPassBatchNorm = functools.partial(nnx.BatchNorm, use_fast_variance=False)


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, norm: Any = pdnnx.SyncBatchNorm) -> None:
        # No bias before the norm: its gradient is 0 up to rounding noise.
        self.l1 = nnx.Linear(4, 6, use_bias=False, rngs=rngs)
        self.norm = norm(6, momentum=MOMENTUM, rngs=rngs)
        self.l2 = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        return self.l2(nnx.relu(self.norm(self.l1(x), mask=mask)))  # type: ignore[no-any-return]


def make_optimizer(model: Net) -> nnx.Optimizer[Net]:
    return nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)


def data(steps: int, batch: int = GLOBAL_BATCH, seed: int = 0) -> list[tuple[Any, Any]]:
    """Features of other means and scales (so the statistics matter), and targets."""
    rng = np.random.default_rng(seed)
    shift, scale = np.array([1.0, -2.0, 0.5, 3.0]), np.array([1.0, 2.0, 3.0, 0.5])
    return [
        (
            (rng.normal(size=(batch, 4)) * scale + shift).astype(np.float32),
            rng.normal(size=(batch, 3)).astype(np.float32),
        )
        for _ in range(steps)
    ]


def squared_error(out: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.sum((out - y) ** 2, axis=1)


def state_of(model: Net) -> dict[str, np.ndarray]:
    """Every parameter and running statistic, by path (read outside run)."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat)))
    return {"/".join(map(str, path)): np.asarray(var[...]) for path, var in flat}


def one_device(
    batches: list[tuple[Any, Any]], norm: Any = TwoPassBatchNorm, mask: Any = None
) -> tuple[Net, list[np.ndarray], list[float]]:
    """The model with a plain nnx batch norm, trained without a strategy on each whole
    batch (mean loss): the outputs and losses of every step."""
    model = Net(nnx.Rngs(0), norm=norm)
    optimizer = make_optimizer(model)
    outputs, losses = [], []
    for x, y in batches:

        def loss_fn(model: Net, x: Any = x, y: Any = y) -> tuple[jax.Array, jax.Array]:
            out = model(x, mask=mask)
            return jnp.mean(squared_error(out, y)), out

        (loss, out), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        outputs.append(np.asarray(out))
        losses.append(float(loss))
    return model, outputs, losses


def replica_context() -> pd.ReplicaContext:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return ctx


def distributed(strategy: pd.Strategy, norm: Any = pdnnx.SyncBatchNorm) -> tuple[Net, Any]:
    """The model under the strategy, and its train step (the docs' nnx step)."""
    with strategy.scope():
        model = pdnnx.distribute(Net(nnx.Rngs(0), norm=norm))
        optimizer = pdnnx.distribute(make_optimizer(model))

    def step(x: jax.Array, y: jax.Array, mask: jax.Array | None = None) -> Any:
        def loss_fn(model: Net) -> tuple[jax.Array, jax.Array]:
            out = model(x, mask=mask)
            # The exact global count: right for uneven batches too.
            return pd.nn.compute_average_loss_exact(squared_error(out, y)), out

        (loss, out), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, replica_context().all_reduce("SUM", grads))
        return loss, out

    return model, step


def split(strategy: pd.Strategy, batch: Any) -> Any:
    parts = np.split(batch, strategy.num_replicas_in_sync)
    return strategy.experimental_distribute_values_from_function(
        lambda c: parts[c.replica_id_in_sync_group]
    )


def run_step(strategy: pd.Strategy, step: Any, *args: Any) -> tuple[float, np.ndarray]:
    """One step; the global loss, and the replicas' outputs in batch order."""
    loss, out = strategy.run(step, args=args)
    parts = [np.asarray(o) for o in strategy.experimental_local_results(out)]
    return float(strategy.reduce("SUM", loss, axis=None)), np.concatenate(parts)


def assert_copies_identical(strategy: pd.Strategy, model: Net) -> None:
    """Mirrored weights (checked by polydist) and the sync-on-read running statistics:
    every replica's copy bitwise equal to replica 0's."""
    assert check_replicas_identical(strategy) > 0
    for name in ("norm/mean", "norm/var"):
        copies = [v.numpy() for v in pdnnx.variables(model)[name].values]
        assert all(np.array_equal(c, copies[0]) for c in copies), (name, copies)


def assert_state_close(got: Net, want: Net) -> None:
    have, expected = state_of(got), state_of(want)
    assert sorted(have) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(have[name], value, rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize(
    ("replicas", "jit", "steps"), [(2, True, 3), (8, True, 3), (2, False, 2), (4, False, 2)]
)
def test_training_matches_one_device_over_the_global_batch(
    replicas: int, jit: bool, steps: int
) -> None:
    backend = JaxBackend(jit=jit)
    strategy = pd.MirroredStrategy(replicas, backend=backend)
    model, step = distributed(strategy)
    assert isinstance(model.norm, nnx.BatchNorm)
    batches = data(steps)
    outputs, losses = [], []
    for x, y in batches:
        loss, out = run_step(strategy, step, split(strategy, x), split(strategy, y))
        outputs.append(out)
        losses.append(loss)
        assert_copies_identical(strategy, model)
    want_model, want_outputs, want_losses = one_device(batches)
    for got, want in zip(outputs, want_outputs, strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    assert_state_close(model, want_model)
    # Training moved the running statistics and the weights.
    start = state_of(Net(nnx.Rngs(0)))
    assert not np.allclose(state_of(model)["norm/mean"], start["norm/mean"])
    assert not np.allclose(state_of(model)["l1/kernel"], start["l1/kernel"])
    if jit:
        assert backend.compile_count == 1
        assert backend.eager_fallback_count == 0


def test_plain_batch_norm_under_the_strategy_does_not_match() -> None:
    # What the test above would see without synchronization: each replica normalizes by
    # its own 2 examples, and its running statistics are its own.
    strategy = pd.MirroredStrategy(8, backend="jax")
    model, step = distributed(strategy, norm=TwoPassBatchNorm)
    batches = data(1)
    (x, y) = batches[0]
    _, out = run_step(strategy, step, split(strategy, x), split(strategy, y))
    _, want_outputs, _ = one_device(batches)
    assert np.max(np.abs(out - want_outputs[0])) > 0.1
    copies = [v.numpy() for v in pdnnx.variables(model)["norm/var"].values]
    assert not np.allclose(copies[0], copies[1])


def test_uneven_last_batches_match_one_device() -> None:
    # 4 replicas: 22 examples in batches of 12 are 3+3+3+3 (compiled) and 3+3+3+1
    # (eager: uneven), then 2 examples are 1+1 and two empty replicas (eager).
    (x, y), (x2, y2) = data(1, batch=22)[0], data(1, batch=2, seed=1)[0]
    backend = JaxBackend()
    strategy = pd.MirroredStrategy(4, backend=backend)
    model, step = distributed(strategy)
    outputs, losses = [], []
    for dataset in (
        pd.data.Dataset.from_tensor_slices((x, y)).batch(12),
        pd.data.Dataset.from_tensor_slices((x2, y2)).batch(12),
    ):
        for batch in strategy.experimental_distribute_dataset(dataset):
            loss, out = run_step(strategy, step, *batch)
            outputs.append(out)
            losses.append(loss)
            assert_copies_identical(strategy, model)
    assert backend.compile_count == 1
    assert backend.eager_fallback_count == 2
    batches = [(x[:12], y[:12]), (x[12:], y[12:]), (x2, y2)]
    want_model, want_outputs, want_losses = one_device(batches)
    for got, want in zip(outputs, want_outputs, strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    assert_state_close(model, want_model)


def test_mask_counts_only_the_masked_examples() -> None:
    (x, y), *_ = data(1)
    mask = np.random.default_rng(2).random((GLOBAL_BATCH, 1)) < 0.6
    mask[:4] = False  # replica 0 of 4 has no example that counts
    strategy = pd.MirroredStrategy(4, backend="jax")
    model, step = distributed(strategy)
    _, out = run_step(strategy, step, split(strategy, x), split(strategy, y), split(strategy, mask))
    want_model, want_outputs, _ = one_device([(x, y)], mask=jnp.asarray(mask))
    np.testing.assert_allclose(out, want_outputs[0], rtol=RTOL, atol=ATOL)
    assert_state_close(model, want_model)
    # The statistics are the masked examples' (not the whole batch's).
    _, unmasked, _ = one_device([(x, y)])
    assert np.max(np.abs(unmasked[0] - want_outputs[0])) > 0.01


def test_feature_axis_of_images() -> None:
    # NCHW: the statistics reduce over the batch and both spatial axes.
    rng = np.random.default_rng(3)
    x = (rng.normal(size=(8, 3, 4, 5)) * [[[1.0]], [[2.0]], [[0.5]]] + 1).astype(np.float32)
    strategy = pd.MirroredStrategy(4, backend="jax")
    with strategy.scope():
        norm = pdnnx.distribute(pdnnx.SyncBatchNorm(3, axis=1, momentum=0.5, rngs=nnx.Rngs(0)))
    out = strategy.run(lambda x: norm(x), args=(split(strategy, x),))
    got = np.concatenate([np.asarray(o) for o in strategy.experimental_local_results(out)])
    plain = TwoPassBatchNorm(3, axis=1, momentum=0.5, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(got, plain(jnp.asarray(x)), rtol=RTOL, atol=ATOL)
    for name in ("mean", "var"):
        np.testing.assert_allclose(
            getattr(norm, name)[...], getattr(plain, name)[...], rtol=RTOL, atol=ATOL
        )


def test_eval_mode_is_nnx_batch_norm_with_the_running_statistics() -> None:
    strategy = pd.MirroredStrategy(4, backend="jax")
    model, step = distributed(strategy)
    for x, y in data(2):
        strategy.run(step, args=(split(strategy, x), split(strategy, y)))
    trained = state_of(model)
    plain = Net(nnx.Rngs(0), norm=nnx.BatchNorm)
    nnx.update(plain, nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat)))
    plain.eval()
    (x, _), *_ = data(1, seed=5)
    want = np.asarray(plain(jnp.asarray(x)))

    def infer(x: jax.Array) -> jax.Array:
        return model(x)

    model.eval()  # use_running_average=True, as nnx's
    out = strategy.run(infer, args=(split(strategy, x),))
    got = np.concatenate([np.asarray(o) for o in strategy.experimental_local_results(out)])
    # (The compiled Linear layers on 4 rows round other than on 16.)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(np.asarray(model(jnp.asarray(x))), want)  # outside run
    # In training mode, the call's flag.
    model.train()

    def infer_with_flag(x: jax.Array) -> jax.Array:
        return model.l2(nnx.relu(model.norm(model.l1(x), use_running_average=True)))  # type: ignore[no-any-return]

    out = strategy.run(infer_with_flag, args=(split(strategy, x),))
    got = np.concatenate([np.asarray(o) for o in strategy.experimental_local_results(out)])
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    assert state_of(model).keys() == trained.keys()
    for name, value in state_of(model).items():
        np.testing.assert_array_equal(value, trained[name], err_msg=name)  # nothing updated


def test_without_a_strategy_it_is_a_plain_batch_norm() -> None:
    """Nothing to synchronize (no strategy, one replica): nnx.BatchNorm's own call, bit for
    bit, its default use_fast_variance included (as torch's SyncBatchNorm falls back)."""
    x = jnp.asarray(data(1)[0][0])
    for fast in (True, False):
        sync = pdnnx.SyncBatchNorm(4, momentum=0.5, use_fast_variance=fast, rngs=nnx.Rngs(0))
        plain = nnx.BatchNorm(4, momentum=0.5, use_fast_variance=fast, rngs=nnx.Rngs(0))
        np.testing.assert_array_equal(sync(x), plain(x))
        # Twice, the second under nnx.jit.
        got = nnx.jit(lambda m, x: m(x))(sync, x)
        np.testing.assert_array_equal(got, nnx.jit(lambda m, x: m(x))(plain, x))
        for name in ("mean", "var"):
            np.testing.assert_array_equal(getattr(sync, name)[...], getattr(plain, name)[...])
    one = pd.MirroredStrategy(1, backend="jax")
    with one.scope():
        alone = pdnnx.distribute(pdnnx.SyncBatchNorm(4, momentum=0.5, rngs=nnx.Rngs(0)))
    fresh = nnx.BatchNorm(4, momentum=0.5, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(one.run(alone, args=(x,)), fresh(x), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(alone.var[...], fresh.var[...], rtol=RTOL, atol=ATOL)
    # Eval mode, and the constructor's and the call's flags, as nnx.BatchNorm's.
    sync.eval()
    plain.eval()
    np.testing.assert_array_equal(sync(x), plain(x))
    lazy = pdnnx.SyncBatchNorm(4, use_running_average=None, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="No `use_running_average` argument"):
        lazy(x)
    fresh_plain = nnx.BatchNorm(4, use_running_average=None, rngs=nnx.Rngs(0))
    for flag in (True, False):
        np.testing.assert_array_equal(
            lazy(x, use_running_average=flag), fresh_plain(x, use_running_average=flag)
        )


@pytest.mark.parametrize(
    ("dtype", "param_dtype", "x_dtype"),
    [
        (None, jnp.float32, jnp.bfloat16),
        (jnp.bfloat16, jnp.float32, jnp.float32),
        (None, jnp.bfloat16, jnp.bfloat16),
        (jnp.float16, jnp.float32, jnp.bfloat16),
    ],
)
def test_dtypes_follow_nnx_batch_norm(dtype: Any, param_dtype: Any, x_dtype: Any) -> None:
    x = jnp.asarray(data(1)[0][0], x_dtype)
    kwargs = {"dtype": dtype, "param_dtype": param_dtype, "momentum": 0.5, "rngs": nnx.Rngs(0)}
    sync = pdnnx.SyncBatchNorm(4, **kwargs)
    plain = TwoPassBatchNorm(4, **kwargs)
    got, want = sync(x), plain(x)
    assert got.dtype == want.dtype
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2
    )
    for name in ("mean", "var", "scale", "bias"):
        a, b = getattr(sync, name)[...], getattr(plain, name)[...]
        assert a.dtype == b.dtype, name
    # Under the strategy too (the statistics in float32 at least).
    strategy = pd.MirroredStrategy(2, backend="jax")
    with strategy.scope():
        sync = pdnnx.distribute(pdnnx.SyncBatchNorm(4, **{**kwargs, "rngs": nnx.Rngs(0)}))
    out = strategy.run(lambda x: sync(x), args=(split(strategy, x),))
    got = np.concatenate([np.asarray(o) for o in strategy.experimental_local_results(out)])
    assert got.dtype == want.dtype
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2
    )
    assert sync.mean[...].dtype == jnp.float32
    np.testing.assert_allclose(sync.mean[...], plain.mean[...], rtol=RTOL, atol=ATOL)


def test_weights_and_checkpoints_load_both_ways(tmp_path: Path) -> None:
    plain = Net(nnx.Rngs(1), norm=nnx.BatchNorm)
    plain(jnp.asarray(data(1)[0][0]))  # running statistics other than the initial ones
    sync = Net(nnx.Rngs(0))
    _, state_plain = nnx.split(plain)
    assert jax.tree.structure(nnx.state(sync)) == jax.tree.structure(state_plain)
    nnx.update(sync, state_plain)
    for name, value in state_of(plain).items():
        np.testing.assert_array_equal(state_of(sync)[name], value)
    # A checkpoint of the plain model restores into a distributed SyncBatchNorm one, and
    # that one's into a plain model.
    path = pd.train.Checkpoint(model=plain).save(str(tmp_path / "plain"))
    strategy = pd.MirroredStrategy(2, backend="jax")
    with strategy.scope():
        model = pdnnx.distribute(Net(nnx.Rngs(0)))
    pd.train.Checkpoint(model=model).restore(path).assert_consumed()
    for name, value in state_of(plain).items():
        np.testing.assert_array_equal(state_of(model)[name], value)
    path = pd.train.Checkpoint(model=model).save(str(tmp_path / "sync"))
    back = Net(nnx.Rngs(2), norm=nnx.BatchNorm)
    pd.train.Checkpoint(model=back).restore(path).assert_consumed()
    for name, value in state_of(plain).items():
        np.testing.assert_array_equal(state_of(back)[name], value)


def test_axis_name_is_refused() -> None:
    with pytest.raises(ValueError, match="takes no axis_name or axis_index_groups"):
        pdnnx.SyncBatchNorm(4, axis_name="replica", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="axis_index_groups"):
        pdnnx.SyncBatchNorm(4, axis_index_groups=[[0, 1]], rngs=nnx.Rngs(0))
    assert "SyncBatchNorm" in pdnnx.__all__


# --------------------------------------------------------------------------- two workers


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX process groups")
@pytest.mark.parametrize("jit", [True, False], ids=["compiled", "eager"])
def test_two_workers_match_one_device_and_draw_their_own_dropout_masks(
    tmp_path: Path, jit: bool
) -> None:
    """MultiWorkerMirroredStrategy, 2 processes x 2 CPU devices (`sync_bn_worker.py`):
    the statistics span both workers (an axis_name would span one), also on an uneven
    last step; and an nnx.RngKey reads as fold_in(key, the GLOBAL replica id)."""
    import sync_bn_worker as worker

    engine = mpt.Engine(
        HERE / "sync_bn_worker.py",
        # The workers set their own device count, not the tests' 8 (as test_multi_worker_jax).
        unset=("TF_CONFIG", "XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "POLYDIST_PROCESS_ID"),
        env={"MW_PROGRAM_JIT": "1" if jit else "0", "JAX_PLATFORMS": "cpu"},
    )
    result = engine.launch(tmp_path, timeout=300)
    assert result.exit_code == 0, result.message
    per_worker = [load(tmp_path / f"worker{w}.npz") for w in range(mpt.WORKERS)]
    assert [int(i) for i in mpt.as_global(per_worker, "replica_ids")] == [0, 1, 2, 3]

    batches = worker.batches()
    want_model, want_outputs, want_losses = one_device(batches)
    for s, want in enumerate(want_outputs):
        got = np.concatenate(mpt.as_global(per_worker, f"out_{s}"))
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"step {s}")
        loss = mpt.same_everywhere(per_worker, f"loss_{s}")
        np.testing.assert_allclose(loss, want_losses[s], rtol=RTOL, atol=ATOL)
        for name in ("norm/mean", "norm/var"):
            copies = mpt.as_global(per_worker, f"{name}_{s}")  # every replica's, bitwise
            assert all(np.array_equal(c, copies[0]) for c in copies), (s, name)
    want_state = state_of(want_model)
    for name, value in want_state.items():
        got = mpt.same_everywhere(per_worker, f"state/{name}")
        np.testing.assert_allclose(got, value, rtol=RTOL, atol=ATOL, err_msg=name)
    if jit:  # the uneven step: both workers fell back to an eager run together
        assert [int(r["eager_fallback_count"][0]) for r in per_worker] == [1, 1]

    # Dropout: replica r's mask is plain nnx's with fold_in(key, r), r the global id, so
    # the two workers' masks differ.
    masks = mpt.as_global(per_worker, "masks")
    for r, mask in enumerate(masks):
        plain = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
        stream = plain.rngs
        assert stream is not None
        stream.key[...] = jax.random.fold_in(stream.key[...], r)
        np.testing.assert_array_equal(mask, plain(jnp.ones(worker.DROPOUT_WIDTH)), f"replica {r}")
    assert len({m.tobytes() for m in masks}) == len(masks)
    worker0, worker1 = per_worker[0]["masks"], per_worker[1]["masks"]
    assert not any(np.array_equal(a, b) for a in worker0 for b in worker1)
