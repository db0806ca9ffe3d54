"""strategy.run on jax against the sim: replica ids, regrouping, inputs and outputs."""

from __future__ import annotations

import collections
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_testutil import assert_results_match, assert_same_bits, distribute

import polydist as pd
import polydist_jax
from polydist_jax import JaxBackend
from polydist_sim import SimBackend

N = 8


@pytest.fixture
def strategies(jax_backend: JaxBackend, sim_backend: SimBackend) -> tuple[pd.Strategy, pd.Strategy]:
    return pd.MirroredStrategy(N, backend=jax_backend), pd.MirroredStrategy(N, backend=sim_backend)


def ctx() -> pd.ReplicaContext:
    c = pd.get_replica_context()
    assert c is not None
    return c


def replica_id() -> Any:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return ctx.replica_id_in_sync_group


def test_replica_ids_are_int32_arrays_on_each_device(
    strategies: tuple[pd.Strategy, pd.Strategy],
) -> None:
    jax_strategy, sim_strategy = strategies
    got, want = jax_strategy.run(replica_id), sim_strategy.run(replica_id)
    assert isinstance(got, pd.PerReplica)
    assert_results_match(got, want)
    assert [v.devices() for v in got.values] == [{d} for d in jax.devices()]


def test_two_device_example_from_tf() -> None:
    # TF's TwoDeviceDistributionTestBase._test_run: [1, 2] then a + 2b + 2 == [6, 14].
    strategy = pd.MirroredStrategy(2, backend=JaxBackend())
    x = strategy.run(lambda: replica_id().astype(jnp.float32) + 1)
    out = strategy.run(lambda *, x: {"a": x * 2, "b": x * x}, kwargs={"x": x})
    assert isinstance(out, dict)
    final = strategy.run(lambda a, b: a + 2 * b + 2, args=(out["a"], out["b"]))
    assert [float(v) for v in final.values] == [6.0, 14.0]


def test_identical_objects_come_back_unwrapped_and_containers_kept(
    strategies: tuple[pd.Strategy, pd.Strategy],
) -> None:
    point = collections.namedtuple("point", "x y")
    constant = np.ones(3)

    def step() -> dict[str, Any]:
        return {"c": constant, "p": point(replica_id(), constant), "l": [None, "s", 3]}

    for strategy in strategies:
        out = strategy.run(step)
        assert out["c"] is constant
        assert isinstance(out["p"], point)
        assert out["p"].y is constant
        assert isinstance(out["p"].x, pd.PerReplica)
        assert [int(v) for v in out["p"].x.values] == list(range(N))
        assert out["l"] == [None, "s", 3]


def test_inputs_returned_unchanged_are_the_same_objects(
    strategies: tuple[pd.Strategy, pd.Strategy],
) -> None:
    for strategy in strategies:
        per_replica = pd.PerReplica([10 * i for i in range(N)])
        shared_array = strategy.extended.array_namespace().ones(2)
        marker = object()
        out = strategy.run(
            lambda a, b, c, m=marker: (a, b, c is m, c), args=(per_replica, shared_array, marker)
        )
        assert out[0].values == per_replica.values  # the very ints, not arrays
        assert all(v is w for v, w in zip(out[0].values, per_replica.values, strict=True))
        assert out[1] is shared_array
        assert out[2] is True
        assert out[3] is marker


def test_per_replica_inputs_are_split_and_shared_inputs_replicated(
    strategies: tuple[pd.Strategy, pd.Strategy],
) -> None:
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal((4, 3)).astype(np.float32) for _ in range(N)]
    scale = np.float32(0.5)

    def program(strategy: pd.Strategy) -> Any:
        x = distribute(strategy, rows)
        w = strategy.extended.array_namespace().asarray(np.arange(3, dtype=np.float32))
        return strategy.run(lambda x, w, s: {"y": x * w * s, "n": x.shape[0]}, args=(x, w, scale))

    got, want = program(strategies[0]), program(strategies[1])
    assert_results_match(got, want)


def test_scalar_per_replica_inputs_and_outputs(
    strategies: tuple[pd.Strategy, pd.Strategy],
) -> None:
    results = []
    for strategy in strategies:
        xs = pd.PerReplica([np.float32(i) / 3 for i in range(N)])
        first = strategy.run(lambda x: x * 2, args=(xs,))
        second = strategy.run(lambda x, r: (x + 1, r), args=(first, first))
        assert all(g is w for g, w in zip(second[1].values, first.values, strict=True))
        results.append(second[0])
    assert_results_match(*results)


def test_outputs_stay_on_their_devices(strategies: tuple[pd.Strategy, pd.Strategy]) -> None:
    jax_strategy = strategies[0]
    x = distribute(jax_strategy, [np.full((2, 2), i, np.float32) for i in range(N)])
    out = jax_strategy.run(lambda x: {"row": x[0], "sum": jnp.sum(x), "same": x * 0 + 1}, args=(x,))
    for key in ("row", "sum", "same"):
        assert [v.devices() for v in out[key].values] == [{d} for d in jax.devices()]
    assert out["sum"].values[3].shape == ()
    assert float(out["sum"].values[3]) == 12.0


def test_python_scalars_are_static_like_tf_function(jax_backend: JaxBackend) -> None:
    strategy = pd.MirroredStrategy(2, backend=jax_backend)

    def step(n: int, flag: bool) -> Any:
        assert isinstance(n, int) and isinstance(flag, bool)  # Python objects, not tracers
        return jnp.arange(n) if flag else n

    out = strategy.run(step, args=(3, True))
    np.testing.assert_array_equal(out.values[1], [0, 1, 2])
    assert strategy.run(step, args=(3, False)) == 3
    assert jax_backend.compile_count == 2


@pytest.mark.parametrize("jit", [True, False])
def test_typed_prng_keys_as_inputs_and_outputs(jit: bool) -> None:
    # jax.random.key (an extended dtype) was refused by the compiled run with "Cannot
    # interpret 'key<fry>' as a data type"; a shared key, per-replica keys, and keys
    # passed back in must all draw what plain JAX draws from them.
    backend = JaxBackend(jit=jit)
    strategy = pd.MirroredStrategy(N, backend=backend)

    def step(key: Any) -> Any:
        carry, sub = jax.random.split(key)
        return carry, jax.random.normal(sub, (3,))

    def plain(key: Any) -> tuple[Any, np.ndarray]:
        carry, sub = jax.random.split(key)
        return carry, np.asarray(jax.random.normal(sub, (3,)))

    key: Any = jax.random.key(0)
    want_key = key
    for _ in range(3):  # a shared key, then run's own per-replica keys passed back in
        key, drawn = strategy.run(step, args=(key,))
        want_key, want = plain(want_key)
        for got in strategy.experimental_local_results(drawn):
            np.testing.assert_array_equal(np.asarray(got), want)
        assert jax.dtypes.issubdtype(
            strategy.experimental_local_results(key)[0].dtype, jax.dtypes.prng_key
        )
    keys = jax.random.split(jax.random.key(7), N)
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda c: keys[c.replica_id_in_sync_group]
    )
    for _ in range(2):  # the second call replays the plan
        _, drawn = strategy.run(step, args=(per_replica,))
        for r, got in enumerate(strategy.experimental_local_results(drawn)):
            np.testing.assert_array_equal(np.asarray(got), plain(keys[r])[1])
    if jit:
        assert backend.eager_fallback_count == 0


@pytest.mark.parametrize("jit", [True, False])
def test_a_named_axis_collective_in_an_eager_run_says_why(jit: bool) -> None:
    # JAX's own error, "unbound axis name: replica ... call psum under jax.shard_map",
    # names a shard_map the user never wrote; say that the call ran eagerly and why.
    strategy = pd.MirroredStrategy(N, backend=JaxBackend(jit=jit))
    dataset = pd.data.Dataset.from_tensor_slices(np.ones((20, 3), np.float32)).batch(16)
    batches = list(strategy.experimental_distribute_dataset(dataset))

    def step(x: Any) -> Any:
        return x - jax.lax.pmean(jnp.mean(x, axis=0), "replica")

    if jit:  # the even batch compiles, and the axis is there
        out = strategy.experimental_local_results(strategy.run(step, args=(batches[0],)))
        np.testing.assert_array_equal(np.asarray(out[0]), np.zeros((2, 3), np.float32))
    why = "it could not compile: replica 0 has" if jit else r"of JaxBackend\(jit=False\)"
    with pytest.raises(
        NameError, match=f"ran the replicas eagerly, one after another, because {why}"
    ) as raised:
        strategy.run(step, args=(batches[-1],))  # 4 examples: replicas 4 to 7 get none
    assert "polydist_jax.nnx.SyncBatchNorm" in str(raised.value)  # for nnx.BatchNorm's axis


def test_a_cond_of_a_constant_and_a_per_replica_value_needs_varying(
    jax_backend: JaxBackend,
) -> None:
    # docs/backends/jax.md, Limits: shard_map's rule (optax.contrib.reduce_on_plateau
    # meets it), and the way out the docs give.
    strategy = pd.MirroredStrategy(N, backend=jax_backend)
    x = distribute(strategy, [np.array([r], np.int32) for r in range(N)])

    def step(wrap: bool, x: Any) -> Any:
        zero = polydist_jax.varying(jnp.int32(0)) if wrap else jnp.int32(0)
        return jax.lax.cond(x[0] > 3, lambda: zero, lambda: x[0] + 1)

    with pytest.raises(TypeError, match="cond branches must have equal output types"):
        strategy.run(step, args=(False, x))
    got = strategy.experimental_local_results(strategy.run(step, args=(True, x)))
    assert [int(v) for v in got] == [1, 2, 3, 4, 0, 0, 0, 0]


def test_empty_batches(strategies: tuple[pd.Strategy, pd.Strategy]) -> None:
    def program(strategy: pd.Strategy) -> Any:
        x = distribute(strategy, [np.zeros((0, 3), np.float32) for _ in range(N)])
        return strategy.run(
            lambda x: (x * 2, ctx().all_reduce("SUM", jnp.sum(x, axis=0))),
            args=(x,),
        )

    got, want = program(strategies[0]), program(strategies[1])
    assert_results_match(got, want)


def test_functions_without_inputs_or_outputs(jax_backend: JaxBackend) -> None:
    strategy = pd.MirroredStrategy(N, backend=jax_backend)
    assert strategy.run(lambda: None) is None
    assert strategy.run(lambda: ()) == ()


def test_returning_a_distributed_value_is_refused(jax_backend: JaxBackend) -> None:
    strategy = pd.MirroredStrategy(2, backend=jax_backend)
    with pytest.raises(TypeError, match="returned a PerReplica; return arrays"):
        strategy.run(lambda: pd.PerReplica([1, 2]))


def test_passing_a_whole_distributed_value_is_refused(jax_backend: JaxBackend) -> None:
    class Whole(pd.PerReplica):
        _select_whole = True  # how distributed variables reach replicas

    strategy = pd.MirroredStrategy(2, backend=jax_backend)
    with pytest.raises(NotImplementedError, match="handed to replicas whole, which is not a"):
        strategy.run(lambda v: v, args=(Whole([1, 2]),))


def test_jit_false_runs_eagerly_with_the_same_results(sim_backend: SimBackend) -> None:
    eager = pd.MirroredStrategy(N, backend=JaxBackend(jit=False))
    sim = pd.MirroredStrategy(N, backend=sim_backend)

    def step() -> Any:
        rid = int(replica_id())  # fine eagerly, impossible in a compiled run
        ctx = pd.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce("SUM", np.float32(rid) / 7)

    got = eager.run(step)
    want = sim.run(step)
    for g, w in zip(got.values, want.values, strict=True):
        assert_same_bits(g, w)
    assert eager.extended.backend.compile_count == 0  # type: ignore[attr-defined]


def test_a_loop_that_never_reads_its_results_does_not_stall_xla_cpu(
    jax_backend: JaxBackend,
) -> None:
    # Unthrottled, XLA:CPU aborts such a loop: a device thread misses the all-reduce.
    strategy = pd.MirroredStrategy(8, backend=jax_backend)

    def step() -> Any:
        return ctx().all_reduce("SUM", np.float32(1))

    before = jax_backend.compile_count
    results = [strategy.run(step) for _ in range(1500)]
    assert jax_backend.compile_count == before + 1
    assert len(jax_backend._compiled._in_flight) <= 2
    assert [float(x) for x in strategy.experimental_local_results(results[-1])] == [8.0] * 8


@pytest.mark.parametrize("outer_jit", [False, True])
def test_empty_arrays_beside_a_collective(jax_backend: JaxBackend, outer_jit: bool) -> None:
    # Zero-size inputs and results are made inside / outside the compiled program, never
    # passed in or out: beside a collective either crashed XLA:CPU's compiler (jax 0.11.2,
    # found on a GPU machine's CPU).
    strategy = pd.MirroredStrategy(4, backend=jax_backend)
    devices = jax.devices()[:4]
    shared = np.zeros((0, 2), np.float32)
    own = strategy.experimental_distribute_values_from_function(
        lambda c: jnp.zeros((0,), jnp.int32) + c.replica_id_in_sync_group
    )

    def fn(shared: Any, own: Any) -> Any:
        x = jnp.ones((3,), jnp.float32) + shared.sum() + own.sum()
        empty = jnp.zeros((2, 0), jnp.int8)
        return ctx().all_reduce("SUM", x), empty, x[:0] + replica_id(), shared, own

    def run() -> Any:
        return strategy.run(fn, (shared, own))

    if not outer_jit:  # the program's own inputs and outputs hold no zero-size array
        text = jax_backend.lower(strategy, fn, (shared, own)).as_text()
        main = next(line for line in text.splitlines() if "func.func public @main" in line)
        assert "tensor<" in main and not re.search(r"tensor<(?:\d+x)*0x", main), main
    results = jax.jit(run)() if outer_jit else run()
    total, empty, sliced, shared_back, own_back = [
        strategy.experimental_local_results(v) for v in results
    ]
    if not outer_jit:
        assert [e.devices() for e in empty] == [{d} for d in devices]
        assert shared_back == (shared,)  # a shared input handed back is that input
        assert list(own_back) == list(strategy.experimental_local_results(own))
    assert [np.asarray(t).tolist() for t in total] == [[4.0, 4.0, 4.0]] * 4
    assert [(e.shape, e.dtype) for e in empty] == [((2, 0), jnp.int8)] * 4
    assert [(s.shape, s.dtype) for s in sliced] == [((0,), jnp.float32)] * 4
    assert {(s.shape, s.dtype) for s in shared_back} == {((0, 2), np.dtype(np.float32))}
    assert [(o.shape, o.dtype) for o in own_back] == [((0,), jnp.int32)] * 4


def test_the_replica_id_stays_concrete_after_a_read_inside_a_jitted_helper() -> None:
    # Eager replicas: the id is placed before fn runs, so a first read inside a traced
    # helper cannot turn it into a tracer that later reads would leak.
    strategy = pd.MirroredStrategy(2, backend=JaxBackend(jit=False))

    def fn() -> Any:
        doubled = jax.jit(lambda: replica_id() * 2)()
        return doubled + replica_id()

    assert [int(v) for v in strategy.experimental_local_results(strategy.run(fn))] == [0, 3]
