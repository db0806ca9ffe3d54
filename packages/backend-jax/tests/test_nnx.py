"""Flax nnx models and optax states as distributed variables (polydist_jax.nnx).

Training inside ``strategy.run`` (compiled and eager, 1, 3 and 8 replicas),
with the stateful ``nnx.Optimizer`` step and with the functional
``jax.value_and_grad`` + ``optax.update`` + ``optax.apply_updates`` step: after
every step the copies are bitwise identical, and the weights equal those of
single-device training on the whole batch within the tolerance the docs state
(docs/frameworks/flax.md: ``rtol=1e-5, atol=1e-6``).
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

flax = pytest.importorskip("flax")
optax = pytest.importorskip("optax")

from flax import nnx  # noqa: E402

import polydist as pd  # noqa: E402
from polydist.debugging import check_replicas_identical  # noqa: E402
from polydist_jax import JaxBackend  # noqa: E402
from polydist_jax import nnx as pdnnx  # noqa: E402

GLOBAL_BATCH = 24  # splits evenly over 1, 3 and 8 replicas
LEARNING_RATE = 1e-2
RTOL, ATOL = 1e-5, 1e-6  # the tolerance docs/frameworks/flax.md states


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(jax.nn.relu(self.l1(x)))  # type: ignore[no-any-return]


def batches(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (
            rng.normal(size=(GLOBAL_BATCH, 8)).astype(np.float32),
            rng.integers(0, 3, size=GLOBAL_BATCH).astype(np.int32),
        )
        for _ in range(steps)
    ]


def per_example_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # type: ignore[no-any-return]


def single_device(steps: int) -> tuple[list[np.ndarray], list[float]]:
    """The same model trained without a strategy, on each whole batch (mean loss)."""
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)

    @nnx.jit
    def step(model: MLP, optimizer: nnx.Optimizer[MLP], x: jax.Array, y: jax.Array) -> jax.Array:
        def loss_fn(model: MLP) -> jax.Array:
            return per_example_loss(model(x), y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss  # type: ignore[no-any-return]

    losses = [float(step(model, optimizer, x, y)) for x, y in batches(steps)]
    return params_of(model), losses


def params_of(model: MLP) -> list[np.ndarray]:
    return [np.asarray(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param))]


def split(strategy: pd.Strategy, batch: np.ndarray) -> Any:
    parts = np.split(batch, strategy.num_replicas_in_sync)
    return strategy.experimental_distribute_values_from_function(
        lambda c: parts[c.replica_id_in_sync_group]
    )


def replica_context() -> pd.ReplicaContext:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return ctx


def nnx_optimizer_step(strategy: pd.Strategy) -> tuple[MLP, Any]:
    """The stateful nnx step: an nnx.Optimizer updates the model the step captures."""
    with strategy.scope():
        model = pdnnx.distribute(MLP(nnx.Rngs(0)))
        optimizer = pdnnx.distribute(nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param))

    def step(x: jax.Array, y: jax.Array) -> jax.Array:
        def loss_fn(model: MLP) -> jax.Array:
            return pd.nn.compute_average_loss(per_example_loss(model(x), y))  # type: ignore[no-any-return]

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        grads = replica_context().all_reduce(pd.ReduceOp.SUM, grads)
        optimizer.update(model, grads)
        return loss  # type: ignore[no-any-return]

    return model, step


def functional_optax_step(strategy: pd.Strategy) -> tuple[MLP, Any]:
    """The functional step: jax.value_and_grad, optax.update, optax.apply_updates."""
    tx = optax.adam(LEARNING_RATE)
    with strategy.scope():
        model = pdnnx.distribute(MLP(nnx.Rngs(0)))
        opt_state = pdnnx.distribute(tx.init(nnx.state(model, nnx.Param)), name="opt_state")

    def step(x: jax.Array, y: jax.Array) -> jax.Array:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_fn(params: Any) -> jax.Array:
            logits = nnx.merge(graphdef, params, rest)(x)
            return pd.nn.compute_average_loss(per_example_loss(logits, y))  # type: ignore[no-any-return]

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = replica_context().all_reduce(pd.ReduceOp.SUM, grads)
        updates, new_state = tx.update(grads, opt_state.get_value(), params)
        nnx.update(model, optax.apply_updates(params, updates))
        opt_state.set_value(new_state)
        return loss

    return model, step


@pytest.mark.parametrize("style", [nnx_optimizer_step, functional_optax_step])
@pytest.mark.parametrize(
    ("replicas", "jit", "steps"),
    [(1, True, 4), (3, True, 4), (8, True, 4), (1, False, 1), (3, False, 2), (8, False, 1)],
)
def test_training_matches_single_device(style: Any, replicas: int, jit: bool, steps: int) -> None:
    backend = JaxBackend(jit=jit)
    strategy = pd.MirroredStrategy(replicas, backend=backend)
    model, step = style(strategy)
    losses = []
    for x, y in batches(steps):
        per_replica = strategy.run(step, args=(split(strategy, x), split(strategy, y)))
        losses.append(float(strategy.reduce(pd.ReduceOp.SUM, per_replica, axis=None)))
        # Raises (naming the variable) if any copy differs from replica 0's by one bit.
        assert check_replicas_identical(strategy) > 0
    expected_params, expected_losses = single_device(steps)
    np.testing.assert_allclose(losses, expected_losses, rtol=RTOL, atol=ATOL)
    for got, want in zip(params_of(model), expected_params, strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    # Training moved the weights (so the comparison is not of two initial models).
    assert not np.allclose(expected_params[0], params_of(MLP(nnx.Rngs(0)))[0])
    if jit:
        assert backend.compile_count == 1
        assert backend.eager_fallback_count == 0


def test_optax_clipping_accumulation_and_schedules_see_one_global_step() -> None:
    # The step all-reduces before nnx.Optimizer.update, so the chain's clip sees the
    # global gradients' norm, MultiSteps accumulates summed gradients, and the schedule
    # and MultiSteps' counters advance once per step (not once per replica).
    def tx() -> Any:
        inner = optax.chain(
            optax.clip_by_global_norm(0.05), optax.adam(optax.linear_schedule(0.05, 0.001, 3))
        )
        return optax.MultiSteps(inner, every_k_schedule=2)

    steps = 6
    backend = JaxBackend()
    strategy = pd.MirroredStrategy(8, backend=backend)
    with strategy.scope():
        model = pdnnx.distribute(MLP(nnx.Rngs(0)))
        optimizer = pdnnx.distribute(nnx.Optimizer(model, tx(), wrt=nnx.Param))

    def step(x: jax.Array, y: jax.Array) -> None:
        def loss_fn(model: MLP) -> jax.Array:
            return pd.nn.compute_average_loss(per_example_loss(model(x), y))  # type: ignore[no-any-return]

        grads = nnx.grad(loss_fn)(model)
        optimizer.update(model, replica_context().all_reduce("SUM", grads))

    for x, y in batches(steps):
        strategy.run(step, args=(split(strategy, x), split(strategy, y)))
        check_replicas_identical(strategy)
    assert backend.compile_count == 1

    plain = MLP(nnx.Rngs(0))
    plain_optimizer = nnx.Optimizer(plain, tx(), wrt=nnx.Param)
    norms = []
    for x, y in batches(steps):
        grads = nnx.grad(lambda m, x=x, y=y: per_example_loss(m(x), y).mean())(plain)
        norms.append(float(optax.tree.norm(grads)))
        plain_optimizer.update(plain, grads)
    assert min(norms) > 0.1  # so the clip clipped every step
    for got, want in zip(params_of(model), params_of(plain), strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    got_state = jax.tree.leaves(nnx.state(optimizer))
    want_state = jax.tree.leaves(nnx.state(plain_optimizer))
    for got, want in zip(got_state, want_state, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=ATOL)
    assert int(optimizer.opt_state.mini_step[...]) == 0  # 6 steps: 3 updates of 2
    assert int(optimizer.opt_state.gradient_step[...]) == 3


class DocsMLP(nnx.Module):
    """docs/frameworks/flax.md's model."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(4, 16, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.hidden(x)))  # type: ignore[no-any-return]


def test_uneven_batches_alternate_compiled_and_eager_steps() -> None:
    """The docs' nnx step over 2 epochs of 38 examples in global batches of 32 on 8
    replicas: a full batch (compiled), then 6 examples (eager: uneven), twice, so
    compiled and eager steps alternate. The weights equal a plain nnx loop's."""
    global_batch, examples, epochs = 32, 38, 2
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(examples, 4)).astype(np.float32)
    ys = rng.integers(0, 3, size=examples).astype(np.int32)

    backend = JaxBackend()
    strategy = pd.MirroredStrategy(8, backend=backend)
    with strategy.scope():
        model = pdnnx.distribute(DocsMLP(nnx.Rngs(0)))
        optimizer = pdnnx.distribute(nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param))

    def train_step(x: jax.Array, y: jax.Array) -> jax.Array:
        def loss_fn(model: DocsMLP) -> jax.Array:
            per_example = per_example_loss(model(x), y)
            return pd.nn.compute_average_loss(per_example, global_batch_size=global_batch)  # type: ignore[no-any-return]

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        grads = replica_context().all_reduce("SUM", grads)
        optimizer.update(model, grads)
        return loss  # type: ignore[no-any-return]

    dataset = pd.data.Dataset.from_tensor_slices((xs, ys)).batch(global_batch)
    losses = []
    for _ in range(epochs):
        for x, y in strategy.experimental_distribute_dataset(dataset):
            per_replica = strategy.run(train_step, args=(x, y))
            losses.append(float(strategy.reduce("SUM", per_replica, axis=None)))
            assert check_replicas_identical(strategy) > 0
    assert int(optimizer.step[...]) == 4
    assert backend.compile_count == 1
    assert backend.eager_fallback_count == 2  # the two uneven batches

    # The same steps without a strategy: each whole batch's summed loss / global_batch.
    plain = DocsMLP(nnx.Rngs(0))
    plain_optimizer = nnx.Optimizer(plain, optax.adam(LEARNING_RATE), wrt=nnx.Param)
    expected_losses = []
    for _ in range(epochs):
        for start in range(0, examples, global_batch):
            x, y = xs[start : start + global_batch], ys[start : start + global_batch]

            def plain_loss(model: DocsMLP, x: Any = x, y: Any = y) -> jax.Array:
                return per_example_loss(model(x), y).sum() / global_batch  # type: ignore[no-any-return]

            loss, grads = nnx.value_and_grad(plain_loss)(plain)
            plain_optimizer.update(plain, grads)
            expected_losses.append(float(loss))
    np.testing.assert_allclose(losses, expected_losses, rtol=RTOL, atol=ATOL)
    want = [np.asarray(p) for p in jax.tree.leaves(nnx.state(plain, nnx.Param))]
    got = [np.asarray(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param))]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)
    assert not np.allclose(want[0], np.asarray(DocsMLP(nnx.Rngs(0)).hidden.kernel[...]))


def test_distribute_names_and_kinds() -> None:
    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.dense = nnx.Linear(4, 2, rngs=rngs)
            self.norm = nnx.BatchNorm(2, rngs=rngs)

    strategy = pd.MirroredStrategy(3, backend="jax")
    with strategy.scope():
        model = pdnnx.distribute(Net(nnx.Rngs(0)))
        optimizer = pdnnx.distribute(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    found = pdnnx.variables(model)
    assert sorted(found) == [
        "dense/bias",
        "dense/kernel",
        "norm/bias",
        "norm/mean",
        "norm/scale",
        "norm/var",
    ]
    assert isinstance(found["dense/kernel"], pd.MirroredVariable)
    assert found["dense/kernel"].name == "dense/kernel:0"
    assert found["dense/kernel"].trainable
    assert found["dense/kernel"].aggregation is pd.VariableAggregation.NONE
    assert [c.device for c in found["dense/kernel"].values] == list(
        strategy.extended.worker_devices
    )
    # Batch statistics: each replica keeps its own, read as their mean (Keras under TF).
    assert isinstance(found["norm/mean"], pd.SyncOnReadVariable)
    assert found["norm/mean"].aggregation is pd.VariableAggregation.MEAN
    assert not found["norm/mean"].trainable
    assert sorted(pdnnx.variables(optimizer)) == ["step"]  # SGD without momentum: no state
    # The model is the same object, with the same values and types.
    kernel = model.dense.kernel
    assert type(kernel).__name__ == "Param" and isinstance(kernel, nnx.Param)
    assert pdnnx.is_distributed(kernel)
    np.testing.assert_array_equal(np.asarray(kernel[...]), found["dense/kernel"].numpy())


def test_reads_and_writes_outside_run() -> None:
    strategy = pd.MirroredStrategy(3, backend="jax")
    with strategy.scope():
        model = pdnnx.distribute(MLP(nnx.Rngs(0)))
    bias = pdnnx.variables(model)["l1/bias"]
    # Outside run a write updates every copy; a read gives replica 0's copy.
    model.l1.bias[...] = jnp.arange(16, dtype=jnp.float32)
    for copy in bias.values:
        np.testing.assert_array_equal(copy.numpy(), np.arange(16, dtype=np.float32))
    bias.values[0].assign(jnp.full(16, 5.0))
    np.testing.assert_array_equal(np.asarray(model.l1.bias[...]), np.full(16, 5.0))
    # nnx.state shares the model's variables (nnx's rule): writing one writes the model.
    nnx.state(model, nnx.Param)["l1"]["bias"][...] = jnp.full(16, 7.0)
    # Copies (nnx.clone, jax.tree.map, pickle) hold their own values.
    clone = nnx.clone(model)
    pickled = pickle.loads(pickle.dumps(model.l1.bias))
    assert type(pickled) is nnx.Param
    for copied in (clone.l1.bias, jax.tree.map(lambda x: x, model).l1.bias, pickled):
        assert isinstance(copied, nnx.Param) and not pdnnx.is_distributed(copied)
        np.testing.assert_array_equal(np.asarray(copied[...]), np.full(16, 7.0))
    clone.l1.bias[...] = jnp.zeros(16)
    np.testing.assert_array_equal(bias.numpy(), np.full(16, 7.0))
    # The model still runs as a plain nnx model outside run, on replica 0's weights.
    out = model(jnp.ones((2, 8)))
    assert out.shape == (2, 3)


def test_forgotten_all_reduce_warns_of_divergence() -> None:
    strategy = pd.MirroredStrategy(3, backend="jax")
    with strategy.scope():
        model = pdnnx.distribute(MLP(nnx.Rngs(0)))
        optimizer = pdnnx.distribute(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))

    def step(x: jax.Array, y: jax.Array) -> jax.Array:
        def loss_fn(model: MLP) -> jax.Array:
            return per_example_loss(model(x), y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)  # each replica's own gradients: the copies diverge
        return loss

    x, y = batches(1)[0]
    with pytest.warns(pd.ReplicaDivergenceWarning, match=r"'l[12]/(kernel|bias):0'"):
        strategy.run(step, args=(split(strategy, x), split(strategy, y)))
    with pytest.raises(pd.debugging.ReplicaDivergenceError):
        check_replicas_identical(strategy)


class DropoutNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.dense = nnx.Linear(8, 8, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        return self.dropout(x, rngs=rngs)  # type: ignore[no-any-return]


def test_dropout_rng_state_is_distributed() -> None:
    strategy = pd.MirroredStrategy(3, backend="jax")
    with strategy.scope():
        model = pdnnx.distribute(DropoutNet(nnx.Rngs(0)))
    found = pdnnx.variables(model)
    assert found["dropout/rngs/key"].dtype == jnp.uint32  # the key's data
    assert found["dropout/rngs/count"].numpy() == 0

    def step(x: jax.Array) -> jax.Array:
        return model(x)

    x = np.ones((6, 8), np.float32)
    first = strategy.run(step, args=(split(strategy, x),))
    second = strategy.run(step, args=(split(strategy, x),))
    # Each call drew new random numbers (the counter advanced alike in every copy) ...
    assert [c.numpy() for c in found["dropout/rngs/count"].values] == [2, 2, 2]
    check_replicas_identical(strategy)
    a, b = strategy.experimental_local_results(first), strategy.experimental_local_results(second)
    assert not np.array_equal(np.asarray(a[0]), np.asarray(b[0]))
    # ... and the key reads back as a key, outside run the stored (unfolded) one.
    key = model.dropout.rngs.key[...]
    assert jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    plain_key = DropoutNet(nnx.Rngs(0)).dropout.rngs.key[...]
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(plain_key))


def hand_masks(replicas: int, steps: int, width: int) -> list[list[np.ndarray]]:
    """Each replica's dropout outputs from plain nnx: its key is fold_in(key, replica id)
    (the key itself with one replica)."""
    masks: list[list[np.ndarray]] = [[] for _ in range(steps)]
    for r in range(replicas):
        plain = DropoutNet(nnx.Rngs(0))
        if replicas > 1:
            stream = plain.dropout.rngs
            assert stream is not None
            stream.key[...] = jax.random.fold_in(stream.key[...], r)
        for s in range(steps):
            masks[s].append(np.asarray(plain(jnp.ones((1, width)))))
    return masks


@pytest.mark.parametrize("replicas", [1, 2, 8])
@pytest.mark.parametrize("jit", [True, False])
def test_each_replica_draws_its_own_dropout_mask(replicas: int, jit: bool) -> None:
    steps, width = 2, 64
    strategy = pd.MirroredStrategy(replicas, backend=JaxBackend(jit=jit))
    with strategy.scope():
        model = pdnnx.distribute(DropoutNet(nnx.Rngs(0)))

    def step(x: jax.Array) -> jax.Array:
        return model(x)

    x = np.ones((replicas, width), np.float32)
    got = []
    for _ in range(steps):
        out = strategy.run(step, args=(split(strategy, x),))
        got.append([np.asarray(o) for o in strategy.experimental_local_results(out)])
        check_replicas_identical(strategy)  # the key and the count stay mirrored
    want = hand_masks(replicas, steps, width)
    for s in range(steps):
        for r in range(replicas):
            np.testing.assert_array_equal(got[s][r], want[s][r])
        assert len({m.tobytes() for m in got[s]}) == replicas  # no two replicas alike
        assert 0 < np.count_nonzero(got[s][0]) < width
    count = pdnnx.variables(model)["dropout/rngs/count"]
    assert [c.numpy() for c in count.values] == [steps] * replicas


@pytest.mark.parametrize("jit", [True, False])
def test_rng_streams_in_transforms_forks_and_reseeds(jit: bool) -> None:
    replicas, width = 4, 32
    strategy = pd.MirroredStrategy(replicas, backend=JaxBackend(jit=jit))
    with strategy.scope():
        model = pdnnx.distribute(DropoutNet(nnx.Rngs(0, dropout=1)))
    x = split(strategy, np.ones((replicas, width), np.float32))

    def differs(fn: Any) -> list[np.ndarray]:
        out = strategy.run(fn, args=(x,))
        check_replicas_identical(strategy)  # nnx wrote back no replica's folded key
        masks = [np.asarray(o) for o in strategy.experimental_local_results(out)]
        assert len({m.tobytes() for m in masks}) == replicas
        return masks

    def through_transforms(x: jax.Array) -> jax.Array:
        loss, _ = nnx.value_and_grad(lambda m: (m(x) ** 2).sum())(model)
        return nnx.jit(lambda m, x: m(x))(model, x) + 0 * loss

    differs(through_transforms)
    assert pdnnx.variables(model)["dropout/rngs/count"].numpy() == 2

    # A fork holds this replica's own keys: split_rngs and vmap work on it.
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0, None))
    def per_member(rngs: nnx.Rngs, x: jax.Array) -> jax.Array:
        return rngs.dropout.uniform(x.shape)

    forked = differs(lambda x: per_member(model.rngs.fork(), x))
    assert forked[0].shape == (3, 1, width)
    # An nnx.Rngs made in the step is the step's own: every replica draws the same.
    out = strategy.run(lambda x: model(x, rngs=nnx.Rngs(dropout=5)), args=(x,))
    same = [np.asarray(o) for o in strategy.experimental_local_results(out)]
    assert all(np.array_equal(m, same[0]) for m in same)
    # nnx.reseed in run stores the same new key in every copy; each replica folds it.
    reseeded = differs(lambda x: (nnx.reseed(model, dropout=7), model(x))[1])
    assert pdnnx.variables(model)["dropout/rngs/count"].numpy() == 1
    plain = DropoutNet(nnx.Rngs(0, dropout=1))
    nnx.reseed(plain, dropout=7)
    stream = plain.dropout.rngs
    assert stream is not None
    stream.key[...] = jax.random.fold_in(stream.key[...], 2)  # replica 2's
    np.testing.assert_array_equal(reseeded[2], np.asarray(plain(jnp.ones((1, width)))))

    # split_rngs would change a distributed key's shape: a clear error.
    def split_model(x: jax.Array) -> jax.Array:
        with nnx.split_rngs(model, splits=2):
            return x

    with pytest.raises(NotImplementedError, match=r"split_rngs\(rngs.fork\(\)"):
        strategy.run(split_model, args=(x,))


def test_checkpoint_round_trip_into_another_replica_count(tmp_path: Path) -> None:
    eight = pd.MirroredStrategy(8, backend="jax")
    model, step = nnx_optimizer_step(eight)
    x, y = batches(1)[0]
    eight.run(step, args=(split(eight, x), split(eight, y)))
    pd.checkpoint.save(str(tmp_path), pdnnx.variables(model), step=1)
    trained = params_of(model)

    three = pd.MirroredStrategy(3, backend="jax")
    with three.scope():
        fresh = pdnnx.distribute(MLP(nnx.Rngs(1)))
    assert not np.array_equal(params_of(fresh)[0], trained[0])
    pd.checkpoint.restore(str(tmp_path), pdnnx.variables(fresh))
    for got, want in zip(params_of(fresh), trained, strict=True):
        np.testing.assert_array_equal(got, want)
    check_replicas_identical(three)


def test_bad_uses_say_what_to_do() -> None:
    with pytest.raises(ValueError, match=r"needs a strategy: call it under"):
        pdnnx.distribute(MLP(nnx.Rngs(0)))
    sim = pd.MirroredStrategy(2, backend="sim")
    with pytest.raises(ValueError, match="jax backend"):
        pdnnx.distribute(MLP(nnx.Rngs(0)), strategy=sim)
    strategy = pd.MirroredStrategy(2, backend="jax")
    box = pdnnx.distribute({"w": jnp.zeros(3)}, strategy=strategy, name="box")
    assert sorted(pdnnx.variables(box)) == ["box/w"]
    with pytest.raises(ValueError, match="keeps its structure"):
        box.set_value({"w": jnp.zeros(3), "extra": jnp.zeros(1)})
    # An optax state made before distribute (of the model's plain nnx.Params) takes the
    # states made after it (of its bound Params): the same arrays in the same places.
    plain = MLP(nnx.Rngs(0))
    tx = optax.adam(0.1)
    opt_state = pdnnx.distribute(tx.init(nnx.state(plain, nnx.Param)), strategy=strategy)
    bound = pdnnx.distribute(plain, strategy=strategy)
    new_state = jax.tree.map(lambda a: a + 1, tx.init(nnx.state(bound, nnx.Param)))
    opt_state.set_value(new_state)
    assert pdnnx.variables(opt_state)["0/mu/l1/bias"].numpy().tolist() == [1.0] * 16
    with pytest.raises(ValueError, match="no distributed variables"):
        pdnnx.variables(MLP(nnx.Rngs(0)))

    model = pdnnx.distribute(MLP(nnx.Rngs(0)), strategy=strategy)
    with pytest.raises(ValueError, match="already distributed by another strategy"):
        pdnnx.distribute(model, strategy=pd.MirroredStrategy(3, backend="jax"))
    clone = pdnnx.distribute(nnx.clone(model), strategy=pd.MirroredStrategy(3, backend="jax"))
    assert len(pdnnx.variables(clone)["l1/bias"].values) == 3

    @jax.jit
    def outside_run(x: jax.Array) -> jax.Array:
        model.l1.bias[...] = x  # nnx's own rule outside a run: not at another trace level
        return x

    with pytest.raises(Exception, match="different trace level"):
        outside_run(jnp.ones(16))
    np.testing.assert_array_equal(pdnnx.variables(model)["l1/bias"].numpy(), np.zeros(16))


class NormNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.dense = nnx.Linear(4, 2, rngs=rngs)
        self.norm = nnx.BatchNorm(2, momentum=0.5, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.norm(self.dense(x))  # type: ignore[no-any-return]


def norm_net_step(model: NormNet, optimizer: Any) -> Any:
    def step(x: jax.Array) -> jax.Array:
        def loss_fn(model: NormNet) -> jax.Array:
            return pd.nn.compute_average_loss(jnp.sum(model(x) ** 2, axis=1))  # type: ignore[no-any-return]

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, replica_context().all_reduce(pd.ReduceOp.SUM, grads))
        return loss  # type: ignore[no-any-return]

    return step


@pytest.mark.parametrize("jit", [True, False])
def test_batch_statistics_are_each_replicas_own(jit: bool) -> None:
    strategy = pd.MirroredStrategy(4, backend=JaxBackend(jit=jit))
    with strategy.scope():
        model = pdnnx.distribute(NormNet(nnx.Rngs(0)))
        optimizer = pdnnx.distribute(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    kernel = np.asarray(model.dense.kernel[...])
    strategy.run(norm_net_step(model, optimizer), args=(split(strategy, x),))
    # Each replica's running mean moved halfway to its own batch's mean (momentum 0.5),
    # as a Keras BatchNormalization under a TF strategy; the weights stayed mirrored.
    mean = pdnnx.variables(model)["norm/mean"]
    for r, part in enumerate(np.split(x, 4)):
        own = (part @ kernel).mean(axis=0) * 0.5
        np.testing.assert_allclose(mean.values[r].numpy(), own, rtol=1e-5, atol=1e-6)
    # Read outside run: their mean.
    np.testing.assert_allclose(
        np.asarray(model.norm.mean[...]), (x @ kernel).mean(axis=0) * 0.5, rtol=1e-5, atol=1e-6
    )
    assert check_replicas_identical(strategy) == 5  # 4 nnx.Params and the step count


@pytest.mark.parametrize("jit", [True, False])
def test_nnx_metrics_updated_in_run_count_every_replica(jit: bool) -> None:
    # An nnx.metrics.Average's total and count were mirrored: each replica added its
    # own examples to its own copy, and compute() outside run gave replica 0's share
    # (with a divergence warning). They are sums now, as a Keras metric's under TF.
    def metrics() -> nnx.MultiMetric:
        return nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(16, 3)).astype(np.float32)
    labels = rng.integers(0, 3, 16).astype(np.int32)
    loss = rng.normal(size=16).astype(np.float32)
    plain = metrics()
    plain.update(logits=logits, labels=labels, loss=loss)
    plain.update(logits=logits[:5], labels=labels[:5], loss=loss[:5])

    strategy = pd.MirroredStrategy(8, backend=JaxBackend(jit=jit))
    with strategy.scope():
        distributed = pdnnx.distribute(metrics())
    found = pdnnx.variables(distributed)
    assert found["loss/total"].aggregation == pd.VariableAggregation.SUM
    assert found["accuracy/count"].synchronization == pd.VariableSynchronization.ON_READ

    def step(logits: jax.Array, labels: jax.Array, loss: jax.Array) -> None:
        distributed.update(logits=logits, labels=labels, loss=loss)

    batch = (split(strategy, logits), split(strategy, labels), split(strategy, loss))
    strategy.run(step, args=batch)
    distributed.reset()  # outside run: every copy, so the sums start again from 0
    strategy.run(step, args=batch)
    last = pd.data.Dataset.from_tensor_slices((logits[:5], labels[:5], loss[:5])).batch(5)
    for uneven in strategy.experimental_distribute_dataset(last):  # 3 replicas get none
        strategy.run(step, args=uneven)
    assert int(found["loss/count"].numpy()) == 21
    for name, want in plain.compute().items():
        np.testing.assert_allclose(distributed.compute()[name], want, rtol=RTOL, atol=ATOL)


def test_one_device_strategy() -> None:
    strategy = pd.OneDeviceStrategy("/cpu:1", backend="jax")
    with strategy.scope():
        model = pdnnx.distribute(NormNet(nnx.Rngs(0)))
        optimizer = pdnnx.distribute(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    kernel = pdnnx.variables(model)["dense/kernel"]
    assert type(kernel) is pd.Variable and kernel.device.endswith("CPU:1")
    before = kernel.numpy()
    x = np.arange(16, dtype=np.float32).reshape(4, 4) % 5
    strategy.run(norm_net_step(model, optimizer), args=(x,))
    assert not np.array_equal(kernel.numpy(), before)
    assert int(optimizer.step[...]) == 1


def test_train_checkpoint_saves_and_restores_nnx_objects(tmp_path: Path) -> None:
    eight = pd.MirroredStrategy(8, backend="jax")
    with eight.scope():
        model = pdnnx.distribute(MLP(nnx.Rngs(0)))
        optimizer = pdnnx.distribute(nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param))

    def step(x: jax.Array, y: jax.Array) -> None:
        def loss_fn(model: MLP) -> jax.Array:
            return pd.nn.compute_average_loss(per_example_loss(model(x), y))  # type: ignore[no-any-return]

        grads = nnx.grad(loss_fn)(model)
        optimizer.update(model, replica_context().all_reduce(pd.ReduceOp.SUM, grads))

    x, y = batches(1)[0]
    eight.run(step, args=(split(eight, x), split(eight, y)))
    checkpoint = pd.train.Checkpoint(model=model, optimizer=optimizer)
    manager = pd.train.CheckpointManager(checkpoint, str(tmp_path), max_to_keep=2)
    path = manager.save()
    trained = [np.asarray(a) for a in jax.tree.leaves(nnx.state(optimizer))]
    # Saved under their paths, readable without polydist.
    (tensors,) = Path(path).glob("*.safetensors")
    names = set(safetensors.numpy.load_file(str(tensors)))
    assert {"model/l1/kernel", "optimizer/opt_state/0/mu/l1/kernel", "optimizer/step"} <= names
    assert int(optimizer.step[...]) == 1

    # Into fresh distributed objects on another replica count ...
    three = pd.MirroredStrategy(3, backend="jax")
    with three.scope():
        fresh = pdnnx.distribute(MLP(nnx.Rngs(1)))
        fresh_optimizer = pdnnx.distribute(
            nnx.Optimizer(fresh, optax.adam(LEARNING_RATE), wrt=nnx.Param)
        )
    assert not np.array_equal(params_of(fresh)[0], params_of(model)[0])
    status = pd.train.Checkpoint(model=fresh, optimizer=fresh_optimizer).restore(
        manager.latest_checkpoint
    )
    status.assert_consumed()
    for got, want in zip(params_of(fresh), params_of(model), strict=True):
        np.testing.assert_array_equal(got, want)
    restored = [np.asarray(a) for a in jax.tree.leaves(nnx.state(fresh_optimizer))]
    for got, want in zip(restored, trained, strict=True):
        np.testing.assert_array_equal(got, want)
    assert check_replicas_identical(three) == 14  # 4 params, 2 x 4 Adam moments, count, step

    # ... and into a plain nnx model and optimizer, without a strategy.
    plain = MLP(nnx.Rngs(2))
    plain_optimizer = nnx.Optimizer(plain, optax.adam(LEARNING_RATE), wrt=nnx.Param)
    pd.train.Checkpoint(model=plain, optimizer=plain_optimizer).restore(path).assert_consumed()
    for got, want in zip(params_of(plain), params_of(model), strict=True):
        np.testing.assert_array_equal(got, want)
    assert int(plain_optimizer.step[...]) == 1

    # A plain model's checkpoint restores into a distributed one.
    plain.l1.bias[...] = jnp.full(16, 3.0)
    plain_path = pd.train.Checkpoint(model=plain).write(str(tmp_path / "plain"))
    pd.train.Checkpoint(model=fresh).read(plain_path).assert_consumed()
    for copy in pdnnx.variables(fresh)["l1/bias"].values:
        np.testing.assert_array_equal(copy.numpy(), np.full(16, 3.0))


class WithHead(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 3, rngs=rngs)
        self.head = nnx.Linear(3, 2, rngs=rngs)  # not in an MLP's checkpoint


def test_checkpoint_restores_the_layers_a_grown_model_shares(tmp_path: Path) -> None:
    """A model with a layer the checkpoint lacks gets the layers it holds (TF's partial
    restore); before, expect_partial() hid that nothing of it was restored."""
    source = MLP(nnx.Rngs(0))
    source.l1.bias[...] = jnp.full(16, 3.0)
    path = pd.train.Checkpoint(model=source).write(str(tmp_path / "mlp"))

    plain = WithHead(nnx.Rngs(1))
    head = np.asarray(plain.head.kernel[...])
    status = pd.train.Checkpoint(model=plain).read(path)
    with pytest.raises(AssertionError, match="not assigned a value.*model/head/bias"):
        status.assert_existing_objects_matched()
    status.expect_partial()
    np.testing.assert_array_equal(plain.l1.bias[...], np.full(16, 3.0))
    np.testing.assert_array_equal(plain.l2.kernel[...], source.l2.kernel[...])
    np.testing.assert_array_equal(plain.head.kernel[...], head)

    strategy = pd.MirroredStrategy(2, backend="jax")
    with strategy.scope():
        grown = pdnnx.distribute(WithHead(nnx.Rngs(2)))
    head = np.asarray(grown.head.kernel[...])
    pd.train.Checkpoint(model=grown).read(path).expect_partial()
    for copy in pdnnx.variables(grown)["l1/bias"].values:
        np.testing.assert_array_equal(copy.numpy(), np.full(16, 3.0))
    np.testing.assert_array_equal(grown.l2.kernel[...], source.l2.kernel[...])
    np.testing.assert_array_equal(grown.head.kernel[...], head)


class Counted(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l = nnx.Linear(2, 2, rngs=rngs)
        self.seen = nnx.Variable(0)  # Python numbers: JAX's dtypes (int32, float32 unless x64)
        self.scale = nnx.Param(1.0)


def test_checkpoint_of_python_number_variables_restores_both_ways(tmp_path: Path) -> None:
    """A distributed and a plain model store ``nnx.Variable(0)`` and ``nnx.Param(1.0)``
    with the dtypes jnp.asarray gives them, so each restores the other's checkpoint."""
    int_dtype, float_dtype = jnp.asarray(0).dtype, jnp.asarray(1.0).dtype
    strategy = pd.MirroredStrategy(2, backend="jax")
    with strategy.scope():
        distributed = pdnnx.distribute(Counted(nnx.Rngs(0)))
    distributed.seen.set_value(7)
    distributed.scale.set_value(2.5)
    assert pdnnx.variables(distributed)["seen"].dtype == int_dtype
    assert pdnnx.variables(distributed)["scale"].dtype == float_dtype

    path = pd.train.Checkpoint(model=distributed).write(str(tmp_path / "distributed"))
    dtypes = {k: v.dtype for k, v in pd.checkpoint.read_manifest(path).arrays.items()}
    assert (dtypes["model/seen"], dtypes["model/scale"]) == (int_dtype, float_dtype)
    plain = Counted(nnx.Rngs(1))
    pd.train.Checkpoint(model=plain).read(path).assert_consumed()
    assert (int(plain.seen[...]), float(plain.scale[...])) == (7, 2.5)
    np.testing.assert_array_equal(plain.l.kernel[...], distributed.l.kernel[...])

    other = Counted(nnx.Rngs(2))
    other.seen.set_value(3)
    other.scale.set_value(0.5)
    plain_path = pd.train.Checkpoint(model=other).write(str(tmp_path / "plain"))
    dtypes = {k: v.dtype for k, v in pd.checkpoint.read_manifest(plain_path).arrays.items()}
    assert (dtypes["model/seen"], dtypes["model/scale"]) == (int_dtype, float_dtype)
    pd.train.Checkpoint(model=distributed).read(plain_path).assert_consumed()
    assert (int(distributed.seen[...]), float(distributed.scale[...])) == (3, 0.5)
    for copy in pdnnx.variables(distributed)["scale"].values:
        np.testing.assert_array_equal(copy.numpy(), np.asarray(0.5, float_dtype))
    np.testing.assert_array_equal(distributed.l.kernel[...], other.l.kernel[...])


def test_nnx_step_compiles_to_one_all_reduce() -> None:
    """The bound model adds no collective: the step's only one is the gradients' all-reduce."""
    strategy = pd.MirroredStrategy(4, backend="jax")
    _, step = nnx_optimizer_step(strategy)
    x, y = batches(1)[0]
    lowered = strategy.extended.backend.lower(
        strategy, step, args=(split(strategy, x), split(strategy, y))
    )
    text = lowered.compile().as_text()
    assert len(re.findall(r"\ball-reduce(-start)?\(", text)) == 1, text
    assert "all-gather" not in text
