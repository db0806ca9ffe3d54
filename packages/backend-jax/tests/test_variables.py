"""Variables on the jax backend: functionalized compiled runs, the sim's values bit for bit.

Each table row of docs/concepts/variables.md (and the sim's expected values in
packages/core/tests/test_variables.py) runs as one program on
``SimBackend("sequential")`` and on jax; the copies and the results must be
bitwise equal, and a step function must compile once.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_testutil import assert_results_match, assert_same_bits, distribute, mixed_floats

import polydist as pd
from polydist.debugging import check_replicas_identical
from polydist_jax import JaxBackend
from polydist_jax._functional import fingerprint
from polydist_sim import SimBackend

VA = pd.VariableAggregation
VS = pd.VariableSynchronization
N = 8

ON_WRITE_AGGREGATIONS = [VA.NONE, VA.SUM, VA.MEAN, VA.ONLY_FIRST_REPLICA]
METHODS = ["assign", "assign_add", "assign_sub"]


def ctx() -> pd.ReplicaContext:
    c = pd.get_replica_context()
    assert c is not None
    return c


def rid() -> Any:
    return ctx().replica_id_in_sync_group


def rid_plus(k: float = 1.0) -> Any:
    """``id + k`` as float32, a traced value on jax and a NumPy scalar on the sim."""
    return rid().astype(np.float32) + np.float32(k)


def copies(v: Any) -> list[Any]:
    return [c._read_storage() for c in v.values]


def diverge(v: Any, values: list[float]) -> None:
    """Gives each copy its own value (by hand, outside run)."""
    for c, x in zip(v.values, values, strict=True):
        c.assign(np.asarray(x, dtype=np.dtype(str(c.dtype))))


def make(strategy: pd.Strategy, value: Any = 0.0, **kwargs: Any) -> Any:
    with strategy.scope():
        return pd.Variable(value, **kwargs)


def outcome(program: Callable[[pd.Strategy], Any], strategy: pd.Strategy) -> Any:
    """What ``program`` returns, its exception (type and message), and its warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result: Any = program(strategy)
        except (ValueError, TypeError, RuntimeError) as e:
            result = ("raised", type(e).__name__, str(e))
    return result, [(w.category.__name__, str(w.message)) for w in caught]


def check_both(
    program: Callable[[pd.Strategy], Any], replicas: int = N, **backend_kwargs: Any
) -> JaxBackend:
    """Runs ``program`` on the sim and on jax: results, errors and warnings must match."""
    backend = JaxBackend(**backend_kwargs)
    got = outcome(program, pd.MirroredStrategy(replicas, backend=backend))
    want = outcome(program, pd.MirroredStrategy(replicas, backend=SimBackend("sequential")))
    assert_results_match(got, want)
    assert backend.eager_fallback_count == 0
    return backend


def steps(rng_seed: int, count: int = 3) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(rng_seed)
    return [[mixed_floats(rng, ()) for _ in range(N)] for _ in range(count)]


# -- creation -------------------------------------------------------------------------------


def test_variables_created_in_scope_hold_committed_arrays_on_worker_devices() -> None:
    strategy = pd.MirroredStrategy(N, backend=JaxBackend())
    with strategy.scope():
        w = pd.Variable(np.arange(3, dtype=np.float32), name="w")
        m = pd.Variable(0, synchronization=VS.ON_READ, aggregation=VA.SUM)
    assert type(w) is pd.MirroredVariable and type(m) is pd.SyncOnReadVariable
    for v in (w, m):
        arrays = copies(v)
        assert all(isinstance(a, jax.Array) and a.committed for a in arrays)
        devices = [next(iter(a.devices())) for a in arrays]
        assert devices == [
            jax.devices()[i] for i in range(N)
        ]  # worker_devices order: CPU:0 .. CPU:7
    assert w.numpy().tolist() == [0.0, 1.0, 2.0] and w.dtype == jnp.float32
    assert int(m.read_value()) == 0 and m.dtype == jnp.int32


# -- MirroredVariable and SyncOnReadVariable written in replica context --------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("aggregation", ON_WRITE_AGGREGATIONS, ids=lambda a: a.name)
@pytest.mark.parametrize("sync", [VS.ON_WRITE, VS.ON_READ], ids=lambda s: s.name)
def test_replica_context_writes_match_sim(sync: VS, aggregation: VA, method: str) -> None:
    # Every replica writes its own mixed-magnitude value, three steps in a row: SUM and
    # MEAN show the summation order in the bits, NONE and ON_READ let the copies diverge
    # (with the sim's ReplicaDivergenceWarning for NONE MirroredVariables).
    data = steps(1)

    def program(strategy: pd.Strategy) -> Any:
        v = make(strategy, np.float32(0.5), synchronization=sync, aggregation=aggregation)

        def step(x: Any) -> Any:
            return getattr(v, method)(x)

        history = []
        for rows in data:
            out = strategy.run(step, (distribute(strategy, rows),))
            history.append((copies(v), out))
        return history

    backend = check_both(program)
    assert backend.compile_count == 1  # the same step function: compiled once


def test_replica_context_table_three_replicas() -> None:
    # The table in docs/concepts/variables.md: three replicas each write id + 1.
    def program(strategy: pd.Strategy) -> Any:
        result = []
        for aggregation in ON_WRITE_AGGREGATIONS:
            v = make(strategy, 0.0, aggregation=aggregation)
            method = "assign_add" if aggregation is VA.SUM else "assign"
            strategy.run(lambda v=v, m=method: getattr(v, m)(rid_plus()))
            result.append(copies(v))
        return result

    check_both(program, replicas=3)
    strategy = pd.MirroredStrategy(3, backend=JaxBackend())
    with pytest.warns(pd.ReplicaDivergenceWarning):
        got = program(strategy)
    assert [[float(x) for x in row] for row in got] == [
        [1.0, 2.0, 3.0],
        [6.0, 6.0, 6.0],
        [2.0, 2.0, 2.0],
        [1.0, 1.0, 1.0],
    ]


def test_divergence_warning_once_per_variable_also_on_later_compiled_steps() -> None:
    # The first step writes equal values (no divergence); the second, a cached program,
    # diverges: the warning still comes, once.
    def program(strategy: pd.Strategy) -> Any:
        w = make(strategy, 0.0, name="w")
        xp = strategy.extended.array_namespace()

        def step(x: Any) -> None:
            w.assign(x * rid().astype(np.float32))

        seen = []
        for x in (0.0, 1.0, 2.0):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                strategy.run(step, (xp.asarray(x, dtype=xp.float32),))
            seen.append([str(c.message)[:40] for c in caught])
        return seen, copies(w)

    check_both(program, replicas=3)
    result, _ = outcome(program, pd.MirroredStrategy(3, backend=JaxBackend()))
    assert [len(s) for s in result[0]] == [0, 1, 0]


@pytest.mark.parametrize(
    "dtype", ["float32", "float16", "int32", "int8", "uint16", "bool", "complex64"]
)
def test_divergence_fingerprints_see_every_changed_element(dtype: str) -> None:
    # The compiled program sends core's divergence check only the variables whose
    # copies' fingerprints differ: a change of any one element must show.
    base = np.zeros(7, dtype) if dtype == "bool" else np.arange(7).astype(dtype)
    fp = fingerprint(jnp.asarray(base))
    assert fp.shape == (2,) and fp.dtype == jnp.uint32
    assert (fingerprint(jnp.asarray(base.copy())) == fp).all()
    for i in range(7):
        changed = base.copy()
        changed[i] = (not changed[i]) if dtype == "bool" else changed[i] + 1
        assert not (fingerprint(jnp.asarray(changed)) == fp).all(), i
    swapped = base[[1, 0, 2, 3, 4, 5, 6]]
    assert dtype == "bool" or not (fingerprint(jnp.asarray(swapped)) == fp).all()
    if dtype.startswith("float"):
        zeros = np.zeros(3, dtype)
        assert not (fingerprint(jnp.asarray(-zeros)) == fingerprint(jnp.asarray(zeros))).all()


def test_sum_of_a_value_that_is_the_same_object_everywhere_raises_like_the_sim() -> None:
    one = np.float32(1.0)

    def program(strategy: pd.Strategy) -> Any:
        v = make(strategy, 0.0, aggregation=VA.SUM)
        strategy.run(lambda: v.assign_add(one))
        return copies(v)

    check_both(program, replicas=2)


def test_mean_of_a_shared_literal_is_that_value() -> None:
    def program(strategy: pd.Strategy) -> Any:
        v = make(strategy, 0.0, aggregation=VA.MEAN)
        out = strategy.run(lambda: v.assign(2.0))
        return copies(v), out

    check_both(program, replicas=2)


def test_mean_update_of_int_variable_with_a_per_replica_value_raises() -> None:
    # B.26: only variables built internally can be int MEAN (creation rejects them).
    def program(strategy: pd.Strategy) -> Any:
        v = make(strategy, 1, aggregation=VA.SUM)
        v._aggregation = VA.MEAN
        error = outcome(lambda s: s.run(lambda: v.assign(rid())), strategy)[0]
        strategy.run(lambda: v.assign(2))  # the same value everywhere is allowed
        return error, copies(v)

    check_both(program, replicas=2)


def test_only_first_replica_on_write_vs_on_read() -> None:
    # B.24.
    def program(strategy: pd.Strategy) -> Any:
        on_write = make(strategy, 0.0, aggregation=VA.ONLY_FIRST_REPLICA)
        on_read = make(strategy, 0.0, synchronization=VS.ON_READ, aggregation=VA.ONLY_FIRST_REPLICA)

        def fn() -> None:
            on_write.assign(rid_plus())
            on_read.assign(rid_plus())

        strategy.run(fn)
        with strategy.scope():
            reads = (strategy.extended.read_var(on_read), strategy.extended.read_var(on_write))
        return copies(on_write), copies(on_read), reads

    check_both(program, replicas=3)


def test_all_reduce_of_an_on_read_variable() -> None:
    # B.10 (testSyncOnReadVariableInput): each replica assigns 3 * id, then all_reduce.
    def program(strategy: pd.Strategy) -> Any:
        v = make(strategy, 0.0, synchronization=VS.ON_READ, aggregation=VA.ONLY_FIRST_REPLICA)

        def fn() -> Any:
            v.assign(3 * rid().astype(np.float32))
            return ctx().all_reduce("SUM", v)

        return strategy.run(fn), copies(v)

    check_both(program, replicas=3)


# -- reads ----------------------------------------------------------------------------------

READ_CASES = [
    (VS.ON_WRITE, VA.NONE),
    (VS.ON_WRITE, VA.MEAN),
    (VS.ON_READ, VA.SUM),
    (VS.ON_READ, VA.MEAN),
    (VS.ON_READ, VA.ONLY_FIRST_REPLICA),
    (VS.ON_READ, VA.NONE),
]


@pytest.mark.parametrize(("sync", "aggregation"), READ_CASES, ids=lambda x: x.name)
def test_reads_in_replica_and_cross_replica_context(sync: VS, aggregation: VA) -> None:
    # Copies that differ (diverged by hand), read in replica context (each replica its
    # own copy), in a merge_fn (replica 0's copy, or the SUM/MEAN of the copies, or the
    # sim's ValueError for NONE), and after run.
    values = [float(x) for x in mixed_floats(np.random.default_rng(2), (N,))]

    def program(strategy: pd.Strategy) -> Any:
        v = make(strategy, 0.0, synchronization=sync, aggregation=aggregation)
        diverge(v, values)

        def replica_reads() -> Any:
            return v.read_value(), v.value(), v * 2, v + v, ctx().all_reduce("SUM", v)

        def merge_read() -> Any:
            return ctx().merge_call(lambda s: v.read_value())

        local = strategy.run(replica_reads)
        merged = outcome(lambda s: s.run(merge_read), strategy)[0]
        after = outcome(lambda s: v.read_value(), strategy)[0]
        return local, merged, after, copies(v)

    check_both(program)


@pytest.mark.parametrize("jit", [True, False], ids=["compiled", "eager"])
def test_reduce_with_axis_and_gather_of_variables(jit: bool) -> None:
    # Each replica's own copy is summed (TF's per-replica reduce_sum(v, axis)), outside
    # run and in a merge_fn of a run; a plain variable counts once on each replica.
    strategy = pd.MirroredStrategy(3, backend=JaxBackend(jit=jit))
    start = np.array([1.0, 2.0], np.float32)
    mv = make(strategy, start, aggregation=VA.MEAN)
    sv = make(strategy, start, synchronization=VS.ON_READ, aggregation=VA.SUM)
    pv = pd.Variable(start)

    def step() -> Any:
        sv.assign(sv * rid_plus())  # copies [1, 2], [2, 4], [3, 6]
        return ctx().merge_call(
            lambda s: (s.reduce("SUM", mv, axis=0), s.reduce("MEAN", sv, axis=0), s.gather(sv, 0))
        )

    merged = [strategy.experimental_local_results(t)[0] for t in strategy.run(step)]
    assert [float(merged[0]), float(merged[1])] == [9.0, 3.0]
    np.testing.assert_array_equal(np.asarray(merged[2]), [1, 2, 2, 4, 3, 6])
    for op, var, want in [
        ("SUM", mv, 9.0),
        ("MEAN", mv, 1.5),
        ("SUM", sv, 18.0),
        ("MEAN", sv, 3.0),
        ("SUM", pv, 9.0),
        ("MEAN", pv, 1.5),
    ]:
        got = strategy.reduce(op, var, axis=0)
        assert got.dtype == jnp.float32 and float(got) == want, (op, var.name)
    np.testing.assert_array_equal(np.asarray(strategy.gather(mv, axis=0)), [1, 2, 1, 2, 1, 2])
    np.testing.assert_array_equal(np.asarray(strategy.gather(sv, axis=0)), [1, 2, 2, 4, 3, 6])
    assert strategy.gather(pv, axis=0) is pv  # not distributed: returned as it is (TF)


# -- cross-replica writes ------------------------------------------------------------------

WRITE_CASES = [
    (VS.ON_WRITE, VA.NONE),
    (VS.ON_WRITE, VA.SUM),
    (VS.ON_READ, VA.SUM),
    (VS.ON_READ, VA.MEAN),
    (VS.ON_READ, VA.ONLY_FIRST_REPLICA),
]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("sync", "aggregation"), WRITE_CASES, ids=lambda x: x.name)
def test_cross_replica_writes_in_merge_fn(sync: VS, aggregation: VA, method: str) -> None:
    # merge_fn writes the variable (every copy; SyncOnRead SUM assign stores x / N, its
    # assign_add/assign_sub raise), then reads it back, starting from diverged copies.
    values = [float(x) for x in mixed_floats(np.random.default_rng(3), (N,))]

    def program(strategy: pd.Strategy) -> Any:
        v = make(strategy, 0.0, synchronization=sync, aggregation=aggregation)
        diverge(v, values)

        def merge_fn(s: pd.Strategy, x: Any) -> Any:
            written = getattr(v, method)(np.float32(6.5))
            return written, v.read_value(), s.reduce("SUM", x, axis=None)

        def fn() -> Any:
            return ctx().merge_call(merge_fn, args=(rid_plus(),))

        out = outcome(lambda s: s.run(fn), strategy)[0]
        return out, copies(v)

    check_both(program)


def test_cross_replica_writes_outside_run() -> None:
    def program(strategy: pd.Strategy) -> Any:
        m = make(strategy, 1.0)
        s = make(strategy, 0.0, synchronization=VS.ON_READ, aggregation=VA.SUM)
        i = make(strategy, 0, synchronization=VS.ON_READ, aggregation=VA.SUM)
        with strategy.scope():
            out = m.assign(3.0)
        m.assign_add(1.0)
        s.assign(10.0)  # each copy holds 10 / 3
        i.assign(10)  # split exactly: 4, 3, 3 (TF: 10 / 3 cast, reading 9)
        return out, copies(m), copies(s), s.read_value(), copies(i), i.read_value()

    check_both(program, replicas=3)


# -- StrategyExtended.update and friends -----------------------------------------------------


def test_extended_update_in_replica_context() -> None:
    # A per-replica argument updates each copy with its own replica's value (TF: the
    # copies diverge); an all-reduced one keeps them identical. Both via merge_call.
    data = steps(4, count=2)

    def program(strategy: pd.Strategy) -> Any:
        own = make(strategy, 0.0)
        shared = make(strategy, 0.0)

        def step(x: Any) -> Any:
            a = strategy.extended.update(own, lambda c, d: c.assign_add(d), args=(x,))
            total = ctx().all_reduce("SUM", x)
            b = strategy.extended.update(shared, lambda c, d: c.assign_sub(d), args=(total,))
            return a, b

        outs = [strategy.run(step, (distribute(strategy, rows),)) for rows in data]
        return outs, copies(own), copies(shared)

    assert check_both(program).compile_count == 1


def test_replica_context_private_update() -> None:
    # B.11 (ReplicaCtxUpdateTest): tensor and literal args leave identical copies.
    def program(strategy: pd.Strategy) -> Any:
        v = make(strategy, 1.0)

        def fn() -> None:
            c = ctx()
            c._update(v, lambda c, x: c.assign(x), args=(np.float32(5.0),))
            c._update(v, lambda c, x: c.assign_add(x), args=(2.0,))
            c._update(v, lambda c, x: c.assign_sub(x), kwargs={"x": np.float32(1.0)})

        strategy.run(fn)
        return copies(v)

    check_both(program, replicas=3)


def test_update_and_update_non_slot_inside_merge_fn() -> None:
    def program(strategy: pd.Strategy) -> Any:
        counter = make(strategy, 0)
        v = make(strategy, 0.0)
        diverge(v, [1.5 * k for k in range(N)])

        def merge_fn(s: pd.Strategy) -> Any:
            ext = s.extended
            ticks = ext.update_non_slot(
                ext.non_slot_devices([counter]), lambda: counter.assign_add(1)
            )
            doubled = ext.update(v, lambda c: c.assign(c * 2), group=False)
            return ticks, doubled, v.read_value()

        out = strategy.run(lambda: ctx().merge_call(merge_fn))
        return out, copies(counter), copies(v)

    check_both(program)


def test_run_returns_the_variable_for_the_variable_or_its_copy() -> None:
    strategy = pd.MirroredStrategy(N, backend=JaxBackend())
    v = make(strategy, 1.0)
    assert strategy.run(lambda: v) is v
    assert strategy.run(lambda: v._get_on_device_or_primary()) is v
    assert strategy.run(lambda v: v, args=(v,)) is v


# -- compile cache ---------------------------------------------------------------------------


def test_variables_key_the_cache_by_shape_and_dtype_not_value() -> None:
    backend = JaxBackend()
    strategy = pd.MirroredStrategy(N, backend=backend)
    v = make(strategy, np.zeros(3, np.float32), aggregation=VA.MEAN)

    def step(x: Any) -> Any:
        v.assign_add(jnp.full((3,), x))
        return v.read_value()

    for i in range(5):
        strategy.run(
            step, (distribute(strategy, [np.asarray(i + r, np.float32) for r in range(N)]),)
        )
        v.assign(np.full(3, -1.0, np.float32))  # new values between steps: no recompile
    assert backend.compile_count == 1 and backend.cache_size(strategy) == 1
    # Passing the variable as an argument works the same way.
    passed = make(strategy, np.zeros(2, np.float32))
    for _ in range(3):
        strategy.run(lambda w: w.assign_add(jnp.ones(2)), args=(passed,))
    assert copies(passed)[5].tolist() == [3.0, 3.0]  # a new lambda each time: 3 compiles
    # A new variable changes what a run functionalizes, so the step compiles again.
    before = backend.compile_count
    make(strategy, 0.0)
    strategy.run(step, (distribute(strategy, [np.asarray(r, np.float32) for r in range(N)]),))
    assert backend.compile_count == before + 1


def test_lower_traces_without_changing_the_variables() -> None:
    backend = JaxBackend()
    strategy = pd.MirroredStrategy(N, backend=backend)
    v = make(strategy, 2.0, aggregation=VA.SUM)
    lowered = backend.lower(strategy, lambda: v.assign_add(rid_plus()))
    assert "all_reduce" in lowered.as_text()
    assert [float(x) for x in copies(v)] == [2.0] * N
    assert all(isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) for a in copies(v))


# -- training ----------------------------------------------------------------------------------


def _regression_batches(strategy: pd.Strategy, count: int) -> list[tuple[Any, Any]]:
    rng = np.random.default_rng(0)
    true_w = rng.normal(size=(8, 1)).astype(np.float32)
    batches = []
    for _ in range(count):
        x = rng.normal(size=(N * 4, 8)).astype(np.float32)
        y = x @ true_w
        xs, ys = np.split(x, N), np.split(y, N)
        batches.append((distribute(strategy, xs), distribute(strategy, ys)))
    return batches


def _loss(w: Any, x: Any, y: Any) -> Any:
    return jnp.mean((x @ w - y) ** 2)


@pytest.mark.parametrize("style", ["assign_sub", "extended.update"])
def test_sgd_with_mirrored_variables_compiles_once_to_one_all_reduce(style: str) -> None:
    backend = JaxBackend()
    strategy = pd.MirroredStrategy(N, backend=backend)
    lr = np.float32(0.1)
    with strategy.scope():
        w = pd.Variable(np.zeros((8, 1), np.float32), name="w", aggregation=VA.MEAN)
        step_count = pd.Variable(0, name="step", aggregation=VA.ONLY_FIRST_REPLICA)

    def step(x: Any, y: Any) -> Any:
        loss, grad = jax.value_and_grad(_loss)(w.value(), x, y)
        if style == "assign_sub":
            w.assign_sub(lr * grad)  # MEAN aggregation: averaged over replicas
        else:
            mean = ctx().all_reduce("MEAN", lr * grad)
            strategy.extended.update(w, lambda c, d: c.assign_sub(d), args=(mean,))
        step_count.assign_add(1)
        return loss

    # The same steps with parameters passed in and out explicitly: the same numbers.
    def explicit(params: Any, x: Any, y: Any) -> Any:
        loss, grad = jax.value_and_grad(_loss)(params, x, y)
        return params - ctx().all_reduce("MEAN", lr * grad), loss

    batches = _regression_batches(strategy, 30)
    params = pd.Mirrored(copies(w))
    losses = []
    for x, y in batches:
        loss = strategy.run(step, (x, y))
        params, expected_loss = strategy.run(explicit, (params, x, y))
        for got, want in zip(copies(w), params.values, strict=True):
            assert_same_bits(got, want)
        assert_results_match(loss, expected_loss)
        losses.append(float(strategy.reduce("MEAN", loss, axis=None)))
    assert losses[-1] < losses[0] * 1e-2
    assert int(step_count.read_value()) == 30
    assert check_replicas_identical(strategy) == 2
    assert backend.cache_size(strategy) == 2  # step and explicit, each compiled once
    hlo = str(backend.lower(strategy, step, batches[0]).compile().as_text())
    assert len(re.findall(r"= \S+ all-reduce\(", hlo)) == 1
    assert "all-gather" not in hlo
    assert " select(" not in hlo  # the per-copy updates merged into one


def test_grad_with_respect_to_a_variable_value_is_per_replica() -> None:
    strategy = pd.MirroredStrategy(N, backend=JaxBackend())
    w = make(strategy, np.ones(2, np.float32))
    rows = [np.array([r, 2 * r], np.float32) for r in range(N)]

    def step(x: Any) -> Any:
        grad = jax.grad(lambda value: jnp.sum(value * x))(w.value())
        w.assign_sub(grad)  # NONE aggregation: each replica its own copy
        return grad

    with pytest.warns(pd.ReplicaDivergenceWarning):
        grads = strategy.run(step, (distribute(strategy, rows),))
    for r in range(N):
        assert grads.values[r].tolist() == rows[r].tolist()
        assert copies(w)[r].tolist() == (1 - rows[r]).tolist()


# -- checkpoints ----------------------------------------------------------------------------


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    backend = JaxBackend()
    strategy = pd.MirroredStrategy(N, backend=backend)
    with strategy.scope():
        w = pd.Variable(np.arange(4, dtype=np.float32), name="w", aggregation=VA.MEAN)
        seen = pd.Variable(0.0, name="seen", synchronization=VS.ON_READ, aggregation=VA.SUM)

    def step() -> None:
        w.assign_add(jnp.ones(4))
        seen.assign_add(rid_plus())

    strategy.run(step)
    path = pd.checkpoint.save(tmp_path, strategy, step=1)
    assert path is not None
    saved_w, saved_seen = w.numpy(), float(seen.read_value())
    assert saved_seen == sum(range(1, N + 1))

    # Into 4 jax replicas and 2 sim replicas: the value in every copy, the sum / N.
    for other in (
        pd.MirroredStrategy(4, backend=backend),
        pd.MirroredStrategy(2, backend=SimBackend("sequential")),
    ):
        with other.scope():
            w2: Any = pd.Variable(np.zeros(4, np.float32), name="w")
            s2 = pd.Variable(0.0, name="seen", synchronization=VS.ON_READ, aggregation=VA.SUM)
        pd.checkpoint.restore(tmp_path, other)
        assert [c.tolist() for c in map(np.asarray, copies(w2))] == [saved_w.tolist()] * len(
            w2.values
        )
        assert float(s2.read_value()) == saved_seen

    # Back into the training strategy: same shapes, so the step does not recompile.
    strategy.run(step)
    pd.checkpoint.restore(tmp_path, strategy)
    assert w.numpy().tolist() == saved_w.tolist() and float(seen.read_value()) == saved_seen
    assert all(isinstance(a, jax.Array) and a.committed for a in copies(w))
    compiles = backend.compile_count
    strategy.run(step)
    assert backend.compile_count == compiles
    assert w.numpy().tolist() == (saved_w + 1).tolist()


def test_checkpoint_bfloat16_bit_for_bit(tmp_path: Path) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    # NaNs (quiet, negative with a payload, signalling), +-inf, -0.0, a subnormal, 1.5.
    special = np.array([0x7FC0, 0xFFC1, 0x7F81, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x3FC0], np.uint16)
    backend = JaxBackend()
    strategy = pd.MirroredStrategy(N, backend=backend)
    with strategy.scope():
        w = pd.Variable(jnp.asarray(special.view(bf16)), name="w")
    assert w.dtype == jnp.bfloat16
    path = pd.checkpoint.save(tmp_path, {"w": w})
    assert path is not None
    saved = pd.checkpoint.read_arrays(path)["w"]
    assert saved.dtype == bf16 and saved.view(np.uint16).tolist() == special.tolist()

    for other in (
        pd.MirroredStrategy(4, backend=backend),
        pd.MirroredStrategy(2, backend=SimBackend("sequential")),
    ):
        with other.scope():
            w2: Any = pd.Variable(np.zeros(8, bf16), name="w")
        pd.checkpoint.restore(tmp_path, {"w": w2})
        got = [np.asarray(c) for c in copies(w2)]
        assert [a.dtype for a in got] == [bf16] * len(got)
        assert [a.view(np.uint16).tolist() for a in got] == [special.tolist()] * len(got)


# -- what a compiled run refuses, and what it leaves behind ----------------------------------


def test_variables_created_in_run_match_sim_and_are_created_every_call() -> None:
    # TF's shared variable creator: created once per call, from replica 0's arguments,
    # every replica gets the same MirroredVariable. A compiled run creates it while fn is
    # traced, and traces again on the next call (a new variable, as on the sim).
    calls: list[int] = []

    def initial() -> Any:
        calls.append(1)
        return np.float32(5.0)

    def fn(x: Any) -> Any:
        v = pd.Variable(initial, name="made_in_run", aggregation=VA.SUM)
        v.assign_add(x)  # written in the same call
        return v, v.read_value()

    def program(strategy: pd.Strategy) -> Any:
        calls.clear()
        made, kept = [], []
        for rows in steps(6, count=2):
            v, value = strategy.run(fn, (distribute(strategy, rows),))
            kept.append(v)
            made.append((type(v).__name__, v.name, copies(v), value))
        return len(calls), made, kept[0] is kept[1]

    backend = check_both(program)
    assert backend.compile_count == 2 and backend.cache_size() == 0


def test_variables_created_from_traced_values_are_refused() -> None:
    strategy = pd.MirroredStrategy(N, backend=JaxBackend())
    with pytest.raises(jax.errors.TracerArrayConversionError):
        strategy.run(lambda: pd.Variable(rid_plus()))
    v = make(strategy, 0.0)
    assert [float(a) for a in copies(v)] == [0.0] * N


def test_a_failing_trace_leaves_the_concrete_copies() -> None:
    strategy = pd.MirroredStrategy(N, backend=JaxBackend())
    v = make(strategy, 1.0, aggregation=VA.SUM)

    def broken() -> None:
        v.assign_add(rid_plus())
        raise KeyError("boom")

    with pytest.raises(KeyError):
        strategy.run(broken)
    assert all(not isinstance(a, jax.core.Tracer) for a in copies(v))
    assert [float(a) for a in copies(v)] == [1.0] * N
    strategy.run(lambda: v.assign_add(rid_plus()))
    assert float(v.read_value()) == 1.0 + sum(range(1, N + 1))


def test_writing_another_replicas_copy_from_replica_context_is_refused() -> None:
    strategy = pd.MirroredStrategy(N, backend=JaxBackend())
    v = make(strategy, 1.0)
    with pytest.raises(NotImplementedError, match="wrote copy 1 of 'Variable:0' directly"):
        strategy.run(lambda: v.values[1].assign(rid_plus()))
    assert [float(a) for a in copies(v)] == [1.0] * N


def test_plain_jax_variables_are_read_only_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLYDIST_BACKEND", "jax")
    backend = JaxBackend()
    strategy = pd.MirroredStrategy(N, backend=backend)
    scale = pd.Variable(2.0)  # outside any scope: one copy on the host
    assert type(scale) is pd.Variable

    def captured(x: Any) -> Any:
        return x * scale

    rows = [np.asarray(r, np.float32) for r in range(N)]
    assert [float(x) for x in strategy.run(captured, (distribute(strategy, rows),)).values] == [
        2.0 * r for r in range(N)
    ]
    scale.assign(3.0)  # seen by the next call, which does not recompile
    out = strategy.run(captured, (distribute(strategy, rows),))
    assert [float(x) for x in out.values] == [3.0 * r for r in range(N)]
    assert [float(x) for x in strategy.run(lambda s: s * 1, args=(scale,)).values] == [3.0] * N
    assert backend.compile_count == 2
    with pytest.raises(NotImplementedError, match="wrote the plain variable 'Variable:0'"):
        strategy.run(lambda s: s.assign_add(1.0), args=(scale,))
    assert float(scale) == 3.0


def test_plain_variables_of_another_backend_are_refused() -> None:
    strategy = pd.MirroredStrategy(N, backend=JaxBackend())
    plain = pd.Variable(2.0, dtype="float32")
    if plain._backend.name == "jax":
        pytest.skip("$POLYDIST_BACKEND makes plain variables jax variables")
    with pytest.raises(NotImplementedError, match="plain variable of the 'sim' backend"):
        strategy.run(lambda: plain * 2)


def test_updating_a_variable_inside_an_outer_jit_is_refused() -> None:
    strategy = pd.MirroredStrategy(N, backend=JaxBackend())
    v = make(strategy, 1.0, aggregation=VA.MEAN)

    @jax.jit
    def read(x: Any) -> Any:
        return strategy.run(lambda x: v * x, (x,))

    assert [float(a) for a in read(jnp.float32(3.0)).values] == [3.0] * N

    @jax.jit
    def write(x: Any) -> Any:
        return strategy.run(lambda x: v.assign(x), (x,))

    with pytest.raises(NotImplementedError, match="inside a JAX transformation"):
        write(jnp.float32(2.0))
    assert [float(a) for a in copies(v)] == [1.0] * N


# -- eager runs -------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", ON_WRITE_AGGREGATIONS, ids=lambda a: a.name)
def test_eager_runs_match_sim(aggregation: VA) -> None:
    data = steps(5, count=2)

    def program(strategy: pd.Strategy) -> Any:
        v = make(strategy, 0.0, aggregation=aggregation)
        m = make(strategy, 0.0, synchronization=VS.ON_READ, aggregation=VA.SUM)

        def step(x: Any) -> Any:
            m.assign_add(x)
            return v.assign_add(x)

        outs = [strategy.run(step, (distribute(strategy, rows),)) for rows in data]
        return outs, copies(v), copies(m), m.read_value()

    backend = check_both(program, jit=False)
    assert backend.compile_count == 0


def test_uneven_inputs_fall_back_to_an_eager_run_with_variables() -> None:
    backend = JaxBackend()
    strategy = pd.MirroredStrategy(3, backend=backend)
    v = make(strategy, 0.0, aggregation=VA.SUM)
    xs = strategy.experimental_distribute_values_from_function(
        lambda c: jnp.ones(c.replica_id_in_sync_group + 1)
    )
    strategy.run(lambda x: v.assign_add(jnp.sum(x)), (xs,))
    assert backend.eager_fallback_count == 1
    assert [float(a) for a in copies(v)] == [6.0] * 3
