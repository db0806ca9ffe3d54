"""jax.grad through collectives follows TF's rule: the gradient of an all-reduce is the
all-reduce of the upstream gradient (strategy_test_lib._test_collective_comms_gradients)."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax_testutil import assert_same_bits, distribute

import polydist as pd
from polydist_jax import JaxBackend, varying
from polydist_jax._typed import pspec, psum


def ctx() -> pd.ReplicaContext:
    c = pd.get_replica_context()
    assert c is not None
    return c


def grads(strategy: pd.Strategy, step: Any, *args: Any) -> list[float]:
    return [float(v) for v in strategy.run(step, args).values]


@pytest.mark.parametrize(("op", "expected"), [("SUM", [4.0, 4.0]), ("MEAN", [2.0, 2.0])])
def test_tf_case_with_x_as_an_input(op: str, expected: list[float]) -> None:
    # TF: y = all_reduce(x) * c with c = [1, 3] per replica; dy/dx = all_reduce(c).
    strategy = pd.MirroredStrategy(2, backend=JaxBackend())
    c = pd.PerReplica([jnp.float32(1.0), jnp.float32(3.0)])

    def step(x: Any, c: Any) -> Any:
        return jax.grad(lambda x: ctx().all_reduce(op, x) * c)(x)

    assert grads(strategy, step, jnp.float32(42.0), c) == expected


@pytest.mark.parametrize(("op", "expected"), [("SUM", [4.0, 4.0]), ("MEAN", [2.0, 2.0])])
def test_tf_case_with_a_constant_marked_varying(op: str, expected: list[float]) -> None:
    strategy = pd.MirroredStrategy(2, backend=JaxBackend())
    c = pd.PerReplica([jnp.float32(1.0), jnp.float32(3.0)])

    def step(c: Any) -> Any:
        x = varying(jnp.float32(42.0))  # TF's constant_op.constant(42.) is per replica
        return jax.grad(lambda x: ctx().all_reduce(op, x) * c)(x)

    assert grads(strategy, step, c) == expected


def test_unmarked_constants_get_jax_semantics() -> None:
    # Documented difference: JAX treats a constant built inside fn as one value shared
    # by all replicas, so its gradient is summed over replicas (2 x TF's here).
    strategy = pd.MirroredStrategy(2, backend=JaxBackend())
    c = pd.PerReplica([jnp.float32(1.0), jnp.float32(3.0)])

    def step(c: Any) -> Any:
        return jax.grad(lambda x: ctx().all_reduce("SUM", x) * c)(jnp.float32(42.0))

    assert grads(strategy, step, c) == [8.0, 8.0]


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize(("op", "n"), [("SUM", 2.0), ("MEAN", 1.0)])
def test_a_loss_made_from_the_all_reduce_alone(jit: bool, op: str, n: float) -> None:
    # The upstream gradient is the same on every replica (the loss is the all-reduce's
    # result itself): TF sums each replica's, so d all_reduce(x) / dx_r is N for SUM and
    # 1 for MEAN. Compiled, JAX alone took the shared result for one loss (1 and 1/N).
    strategy = pd.MirroredStrategy(2, backend=JaxBackend(jit=jit))
    x = pd.PerReplica([jnp.float32(1.0), jnp.float32(3.0)])

    def step(x: Any) -> Any:
        plain = jax.grad(lambda t: ctx().all_reduce(op, t))(x)
        squares = jax.grad(lambda t: ctx().all_reduce(op, t * t) / 2)(x)
        # A nest with an integer count beside: the count has no gradient.
        mixed = jax.grad(lambda t: ctx().all_reduce(op, (t, jnp.int32(1)))[0])(x)
        return plain, squares, mixed

    plain, squares, mixed = strategy.run(step, (x,))
    assert [float(v) for v in plain.values] == [n, n]
    assert [float(v) for v in squares.values] == [n * 1.0, n * 3.0]
    assert [float(v) for v in mixed.values] == [n, n]


def test_forward_mode_through_a_compiled_all_reduce() -> None:
    # Forward mode and second derivatives follow the same rule: d/dx_r of
    # all_reduce(SUM, x^3 / 6) is all_reduce(SUM, 1) * x_r^2 / 2 = x_r^2 on 2 replicas.
    strategy = pd.MirroredStrategy(2, backend=JaxBackend())
    x = pd.PerReplica([jnp.float32(1.0), jnp.float32(3.0)])

    def step(x: Any) -> Any:
        def cube(t: Any) -> Any:
            return ctx().all_reduce("SUM", t * t * t) / 6

        # The tangent is this replica's, as x is (varying).
        tangent = jax.jvp(lambda t: ctx().all_reduce("SUM", t * t), (x,), (jnp.ones_like(x),))[1]
        return tangent, jax.grad(cube)(x), jax.hessian(cube)(x)

    tangent, grad, hessian = strategy.run(step, (x,))
    # The tangent: the all-reduce of each replica's 2 x_r (2 + 6).
    assert [float(v) for v in tangent.values] == [8.0, 8.0]
    assert [float(v) for v in grad.values] == [1.0, 9.0]
    assert [float(v) for v in hessian.values] == [2.0, 6.0]


def test_an_all_reduce_not_differentiated_stays_shared() -> None:
    # Outside jax.grad the all-reduce's result is JAX's one shared value: returned, it
    # comes back as one replicated array (no per-replica blocks, no gather).
    from polydist_jax._lazy import is_varying

    strategy = pd.MirroredStrategy(2, backend=JaxBackend())
    seen: list[bool] = []

    def step(x: Any) -> Any:
        total = ctx().all_reduce("SUM", x)
        seen.append(is_varying(total))
        return total

    out = strategy.run(step, (pd.PerReplica([jnp.float32(1.0), jnp.float32(3.0)]),))
    assert [float(v) for v in out.values] == [4.0, 4.0]
    assert seen == [False]


def test_varying_is_a_no_op_outside_a_compiled_run() -> None:
    x = jnp.ones(2)
    assert varying(x) is x


def test_all_gather_gradient_is_all_reduced_then_sliced() -> None:
    n = 4
    strategy = pd.MirroredStrategy(n, backend=JaxBackend())
    weights = jnp.arange(2.0 * n)
    x = distribute(strategy, [np.full(2, r, np.float32) for r in range(n)])

    def step(x: Any) -> Any:
        return jax.grad(lambda x: jnp.sum(ctx().all_gather(x, 0) * weights))(x)

    out = strategy.run(step, (x,))
    for r, g in enumerate(out.values):
        np.testing.assert_array_equal(g, n * np.asarray(weights[2 * r : 2 * r + 2]))


# --------------------------------------------------------------------------- a training step

IN, HIDDEN, OUT, BATCH, N = 5, 16, 3, 8, 8
LR = 0.1


def init(seed: int) -> dict[str, Any]:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (IN, HIDDEN)) * 0.3,
        "w2": jax.random.normal(k2, (HIDDEN, OUT)) * 0.3,
    }


def loss_fn(params: dict[str, Any], x: Any, y: Any) -> Any:
    h = jnp.tanh(x @ params["w1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def sgd(params: dict[str, Any], g: dict[str, Any]) -> dict[str, Any]:
    new: dict[str, Any] = jax.tree.map(lambda p, g: p - LR * g, params, g)
    return new


@jax.jit
def full_batch_step(params: dict[str, Any], x: Any, y: Any) -> dict[str, Any]:
    return sgd(params, jax.grad(loss_fn)(params, x, y))


def replica_step(params: dict[str, Any], x: Any, y: Any) -> Any:
    loss, g = jax.value_and_grad(loss_fn)(params, x, y)
    g = ctx().all_reduce("MEAN", g)
    return sgd(params, g), loss


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((N * BATCH, IN)).astype(np.float32),
        rng.standard_normal((N * BATCH, OUT)).astype(np.float32),
    )


def test_data_parallel_step_equals_the_full_batch_step() -> None:
    strategy = pd.MirroredStrategy(N, backend=JaxBackend())
    x, y = data()
    xs = distribute(strategy, np.split(x, N))
    ys = distribute(strategy, np.split(y, N))
    params = init(0)
    new_params, _ = strategy.run(replica_step, (params, xs, ys))
    full = full_batch_step(params, x, y)
    for name in params:
        for component in new_params[name].values:
            np.testing.assert_allclose(component, full[name], rtol=1e-5, atol=1e-6)


def test_strategy_run_is_bitwise_the_hand_written_shard_map() -> None:
    backend = JaxBackend()
    strategy = pd.MirroredStrategy(N, backend=backend)
    x, y = data()
    params = init(1)
    got_params, got_loss = strategy.run(
        replica_step,
        (params, distribute(strategy, np.split(x, N)), distribute(strategy, np.split(y, N))),
    )

    mesh = Mesh(np.array(jax.devices()), ("d",))

    replicated, split = pspec(), pspec("d")

    @jax.jit
    @partial(
        jax.shard_map, mesh=mesh, in_specs=(replicated, split, split), out_specs=(replicated, split)
    )
    def hand_written(params: Any, x: Any, y: Any) -> Any:
        loss, g = jax.value_and_grad(loss_fn)(jax.lax.pcast(params, "d", to="varying"), x, y)
        g = jax.tree.map(lambda g: psum(g, "d") / N, g)
        return sgd(params, g), loss[None]

    want_params, want_loss = hand_written(params, x, y)
    for name in params:
        for component in got_params[name].values:
            assert_same_bits(component, want_params[name])
    for r, component in enumerate(got_loss.values):
        assert_same_bits(component, want_loss[r])


# --------------------------------------------------------------------------- eager runs


@pytest.mark.parametrize(("op", "expected"), [("SUM", [4.0, 4.0]), ("MEAN", [2.0, 2.0])])
def test_tf_case_eagerly(op: str, expected: list[float]) -> None:
    strategy = pd.MirroredStrategy(2, backend=JaxBackend(jit=False))
    c = pd.PerReplica([jnp.float32(1.0), jnp.float32(3.0)])

    def step(x: Any, c: Any) -> Any:
        return jax.grad(lambda x: ctx().all_reduce(op, x) * c)(x)

    assert grads(strategy, step, jnp.float32(42.0), c) == expected


def test_uneven_all_gather_gradient_eagerly() -> None:
    strategy = pd.MirroredStrategy(2, backend=JaxBackend(jit=False))
    weights = jnp.arange(5.0)

    def step(x: Any) -> Any:
        return jax.grad(lambda x: jnp.sum(ctx().all_gather(x, 0) * weights))(x)

    out = strategy.run(step, (pd.PerReplica([jnp.ones(2), jnp.ones(3)]),))
    np.testing.assert_array_equal(out.values[0], [0.0, 2.0])
    np.testing.assert_array_equal(out.values[1], [4.0, 6.0, 8.0])


def sum_loss(params: dict[str, Any], x: Any, y: Any) -> Any:
    h = jnp.tanh(x @ params["w1"])
    return jnp.sum((h @ params["w2"] - y) ** 2) / OUT


def test_partial_batch_step_falls_back_to_eager_and_trains_correctly() -> None:
    # The last batch of an epoch: 13 examples over 2 replicas (8 and 5). Each replica
    # sums its loss; the gradients are summed and divided by the global count. (Two
    # replicas: eager JAX compiles every op once per device, which is slow the first time.)
    backend = JaxBackend()
    strategy = pd.MirroredStrategy(2, backend=backend)
    x, y = data()
    x, y = x[:13], y[:13]

    def step(params: dict[str, Any], x: Any, y: Any) -> Any:
        g = jax.grad(sum_loss)(params, x, y)
        count = ctx().all_reduce("SUM", jnp.float32(x.shape[0]))
        g = jax.tree.map(lambda g: g / count, ctx().all_reduce("SUM", g))
        return sgd(params, g)

    params = init(2)
    xs = distribute(strategy, np.split(x, [8]))
    ys = distribute(strategy, np.split(y, [8]))
    new = strategy.run(step, (params, xs, ys))
    assert backend.eager_fallback_count == 1
    full = full_batch_step(params, x, y)
    for name in params:
        for component in new[name].values:
            np.testing.assert_allclose(component, full[name], rtol=1e-5, atol=1e-6)


def test_padding_and_a_mask_keep_partial_batches_compiled() -> None:
    # The fast alternative to the eager fallback (docs/backends/jax.md): pad every
    # replica to the full batch and weight the padded rows by 0.
    backend = JaxBackend()
    strategy = pd.MirroredStrategy(N, backend=backend)
    x, y = data()
    x, y = x[:61], y[:61]

    def masked_step(params: dict[str, Any], x: Any, y: Any, mask: Any) -> Any:
        def loss(params: dict[str, Any]) -> Any:
            h = jnp.tanh(x @ params["w1"])
            per_example = jnp.sum((h @ params["w2"] - y) ** 2, axis=1) / OUT
            return jnp.sum(per_example * mask)

        g = jax.grad(loss)(params)
        count = ctx().all_reduce("SUM", jnp.sum(mask))
        return sgd(params, jax.tree.map(lambda g: g / count, ctx().all_reduce("SUM", g)))

    pad = N * BATCH - 61
    xp = np.concatenate([x, np.zeros((pad, IN), np.float32)])
    yp = np.concatenate([y, np.zeros((pad, OUT), np.float32)])
    mask = np.concatenate([np.ones(61, np.float32), np.zeros(pad, np.float32)])
    params = init(2)
    args = [distribute(strategy, np.split(a, N)) for a in (xp, yp, mask)]
    new = strategy.run(masked_step, (params, *args))
    assert backend.eager_fallback_count == 0
    assert backend.compile_count == 1
    full = full_batch_step(params, x, y)
    for name in params:
        for component in new[name].values:
            np.testing.assert_allclose(component, full[name], rtol=1e-5, atol=1e-6)
