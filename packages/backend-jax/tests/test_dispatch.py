"""The compiled run's per-step host work and memory: donation of the variables' buffers,
placing an input once, the deferred divergence check. Values, never timings."""

from __future__ import annotations

import gc
import pickle
import warnings
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polydist as pd
from polydist.backend import NOT_HANDLED
from polydist.backend.tracing import storage_arrays
from polydist_jax import JaxBackend, _functional, _input, _spmd, replicate

N = 4


def make(n: int = N) -> tuple[pd.Strategy, JaxBackend]:
    backend = JaxBackend()
    return pd.MirroredStrategy(n, backend=backend), backend


def cached_input(backend: JaxBackend, v: Any) -> Any:
    """The global array the next run passes for ``v`` (the runner's input cache)."""
    return backend._compiled._variable_inputs._cache[id(v)][1]


def add_one(v: Any) -> Any:
    return lambda: v.assign(v.value() + 1, read_value=False)


@pytest.mark.parametrize("n", [1, N])
def test_written_variables_buffers_are_donated(n: int) -> None:
    strategy, backend = make(n)
    with strategy.scope():
        v = pd.Variable(np.zeros(8, np.float32))
    strategy.run(add_one(v))
    before = cached_input(backend, v)
    strategy.run(add_one(v))
    # The step wrote the new copies over the old ones: the old input is gone.
    assert before.is_deleted()
    assert [float(c.numpy()[0]) for c in v.values] == [2.0] * n


@pytest.mark.parametrize("n", [1, N])
def test_on_cpu_only_a_large_written_state_is_donated(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The default rule (conftest donates every size): an XLA:CPU step whose written
    # variables hold less than DONATE_CPU_MIN_BYTES per device keeps its inputs.
    monkeypatch.setattr(_spmd, "DONATE_CPU_MIN_BYTES", 1 << 20)
    for elements, donated in ((1 << 17, False), (1 << 18, True)):  # 0.5 and 1 MiB
        strategy, backend = make(n)
        with strategy.scope():
            v = pd.Variable(np.zeros(elements, np.float32))
        strategy.run(add_one(v))
        before = cached_input(backend, v)
        strategy.run(add_one(v))
        assert before.is_deleted() is donated, elements
        assert [float(c.numpy()[0]) for c in v.values] == [2.0] * n


@pytest.mark.parametrize("same_fn", [True, False], ids=["direct", "prepared"])
@pytest.mark.parametrize("n", [1, N])
def test_written_variables_are_updated_in_their_own_buffers(n: int, same_fn: bool) -> None:
    # Donated and reused: XLA writes each new copy into the old copy's buffer (a step
    # holds one copy of its state), from the first step on, on both paths (a new
    # function each step, as benchmarks/bench_jax.py's memory case, is prepared anew).
    strategy, _ = make(n)
    with strategy.scope():
        v = pd.Variable(np.zeros(1 << 16, np.float32))
    step = add_one(v)
    for k in range(4):
        before = [a.unsafe_buffer_pointer() for a in storage_arrays(v)]
        strategy.run(step if same_fn else add_one(v))
        assert [a.unsafe_buffer_pointer() for a in storage_arrays(v)] == before, k
    assert [float(c.numpy()[-1]) for c in v.values] == [4.0] * n


def test_an_array_a_user_holds_is_never_invalidated() -> None:
    strategy, backend = make()
    with strategy.scope():
        v = pd.Variable(np.zeros(8, np.float32))
    strategy.run(add_one(v))
    held = [c.value() for c in v.values]  # the stored copies themselves
    one = v.values[1].value()
    view = np.asarray(v.values[2].value())  # a NumPy view of a buffer on CPU
    strategy.run(add_one(v))
    strategy.run(add_one(v))
    assert not any(h.is_deleted() for h in held)
    assert [h.tolist() for h in held] == [[1.0] * 8] * N
    assert one.tolist() == [1.0] * 8
    assert view.tolist() == [1.0] * 8
    assert [c.numpy().tolist() for c in v.values] == [[3.0] * 8] * N
    # Nothing is held any more: the next steps donate again.
    del held, one, view
    strategy.run(add_one(v))
    before = cached_input(backend, v)
    strategy.run(add_one(v))
    assert before.is_deleted()


def test_a_variable_storing_another_variables_array_keeps_its_value() -> None:
    strategy, _ = make()
    with strategy.scope():
        v = pd.Variable(np.zeros(4, np.float32))
    strategy.run(add_one(v))
    # A plain variable outside the strategy holding v's copy 0 as is.
    w = pd.Variable(0.0)
    w._array = storage_arrays(v)[0]  # the same array object, as an assign may keep it
    strategy.run(add_one(v))
    assert w.numpy().tolist() == [1.0] * 4
    assert v.values[0].numpy().tolist() == [2.0] * 4


def test_variables_only_read_are_not_donated() -> None:
    strategy, backend = make()
    with strategy.scope():
        v = pd.Variable(np.ones(4, np.float32))
        w = pd.Variable(np.zeros(4, np.float32))

    def step() -> None:
        w.assign(v.value() * 2, read_value=False)

    strategy.run(step)
    read_only = cached_input(backend, v)
    strategy.run(step)
    assert not read_only.is_deleted()
    assert v.values[0].numpy().tolist() == [1.0] * 4
    assert w.values[3].numpy().tolist() == [2.0] * 4


def test_a_shared_input_is_placed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    strategy, _ = make()
    calls: list[Any] = []
    replicate = _spmd._Mesh.replicate

    def counting(self: Any, value: Any) -> Any:
        if np.shape(value) == (3,):
            calls.append(value)
        return replicate(self, value)

    monkeypatch.setattr(_spmd._Mesh, "replicate", counting)
    x = jnp.arange(3.0)
    results = [strategy.run(lambda a: a * 2, (x,)) for _ in range(3)]
    assert len(calls) == 1  # placed on the replicas' devices once, then found by identity
    for r in results:
        assert [c.tolist() for c in r.values] == [[0.0, 2.0, 4.0]] * N
    y = jnp.arange(3.0) + 1  # another array: placed
    assert strategy.run(lambda a: a * 2, (y,)).values[0].tolist() == [2.0, 4.0, 6.0]
    assert len(calls) == 2


def test_per_replica_arrays_in_place_are_joined_once() -> None:
    strategy, backend = make()
    components = [jax.device_put(jnp.full(2, float(r)), d) for r, d in enumerate(jax.devices()[:N])]
    x = pd.PerReplica(components)
    out = strategy.run(lambda a: a + 1, (x,))
    mesh = backend._compiled._mesh(tuple(strategy.extended.worker_devices))
    assert _input.joined(components, mesh.split) is not None  # found by identity next step
    again = strategy.run(lambda a: a + 1, (x,))
    for r in range(N):
        assert out.values[r].tolist() == again.values[r].tolist() == [r + 1.0] * 2


def test_divergence_in_a_later_step_still_warns() -> None:
    # A program's first calls hash the copies and read the hashes at once; later, one call
    # in CHECK_EVERY hashes them, read once that step has finished (at most `limit` steps
    # later). A divergence from then on still warns, once, naming the variable.
    strategy, backend = make()
    with strategy.scope():
        v = pd.Variable(np.zeros(2, np.float32), name="late")

    def step(x: Any) -> None:
        v.assign(x, read_value=False)

    same = pd.PerReplica([np.ones(2, np.float32)] * N)
    differ = pd.PerReplica([np.full(2, r, np.float32) for r in range(N)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(_spmd.CHECK_AT_ONCE):
            strategy.run(step, (same,))
        assert not caught
        for _ in range(_spmd.CHECK_EVERY + backend._compiled._divergence.limit + 1):
            strategy.run(step, (differ,))
    messages = [str(w.message) for w in caught if w.category is pd.ReplicaDivergenceWarning]
    assert len(messages) == 1 and "'late:0'" in messages[0]
    assert [c.numpy().tolist() for c in v.values] == [[float(r)] * 2 for r in range(N)]


def test_divergence_is_hashed_in_one_step_of_check_every(monkeypatch: pytest.MonkeyPatch) -> None:
    strategy, backend = make()
    with strategy.scope():
        v = pd.Variable(np.zeros(2, np.float32))
    flags: list[bool] = []
    checks = _spmd.CompiledRunner._checks

    def spy(self: Any, program: Any, mesh: Any) -> bool:
        flags.append(checks(self, program, mesh))
        return flags[-1]

    monkeypatch.setattr(_spmd.CompiledRunner, "_checks", spy)
    step = add_one(v)
    for _ in range(2 * _spmd.CHECK_EVERY):
        strategy.run(step)
    assert backend.compile_count == 1
    assert [c.numpy()[0] for c in v.values] == [2.0 * _spmd.CHECK_EVERY] * N
    at_once = _spmd.CHECK_AT_ONCE
    hashed = [i for i, f in enumerate(flags) if f]
    assert hashed == [*range(at_once), _spmd.CHECK_EVERY]


def test_the_step_program_holds_no_divergence_hash() -> None:
    # The divergence check hashes the copies in a program of its own, in the calls that
    # check: the step itself is the same program with or without it (no branch on a flag,
    # no extra output).
    strategy, backend = make()
    with strategy.scope():
        v = pd.Variable(np.zeros(4, np.float32))

    def step() -> Any:
        v.assign(v.value() + 1, read_value=False)
        return v.value() * 2

    text = backend.lower(strategy, step).as_text()
    assert "stablehlo.case" not in text and "stablehlo.if" not in text
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert "ui32" not in main, main  # no fingerprint among the outputs
    strategy.run(step)
    assert [c.numpy().tolist() for c in v.values] == [[1.0] * 4] * N


# --------------------------------------------------------------------------- the plan
# After its first call, a replica function's next call reuses what that call worked out
# (`_spmd._Plan`): each test below changes one thing the plan depends on and checks the
# result is the one a fresh preparation gives.


def count_classify(backend: JaxBackend, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    classify = backend._compiled._classify

    def spy(columns: Any, *args: Any) -> Any:
        calls.append(len(columns))
        return classify(columns, *args)

    monkeypatch.setattr(backend._compiled, "_classify", spy)
    return calls


def per_replica(values: list[Any]) -> Any:
    return pd.PerReplica([jax.device_put(v, d) for v, d in zip(values, jax.devices()[:N])])


def test_same_inputs_are_not_classified_or_placed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    strategy, backend = make()
    calls = count_classify(backend, monkeypatch)
    x = per_replica([jnp.full(2, float(r)) for r in range(N)])
    shared = jnp.arange(2.0)

    def add(a: Any, b: Any) -> Any:
        return a + b

    first = strategy.run(add, (x, shared))
    assert calls == [2]
    placed: list[Any] = []
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: placed.append(a))
    for _ in range(3):
        last = strategy.run(add, (x, shared))
    assert calls == [2] and placed == []
    for r in range(N):
        assert first.values[r].tolist() == last.values[r].tolist() == [r + 0.0, r + 1.0]


def test_a_new_input_object_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    strategy, backend = make()
    calls = count_classify(backend, monkeypatch)

    def add(a: Any, b: Any) -> Any:
        return a + b

    shared = jnp.arange(2.0)
    for k in range(3):  # a new batch each step: the direct path assembles it, no classifying
        x = per_replica([jnp.full(2, float(10 * k + r)) for r in range(N)])
        out = strategy.run(add, (x, shared))
        assert [v.tolist() for v in out.values] == [
            [10.0 * k + r, 10.0 * k + r + 1] for r in range(N)
        ]
    assert calls == [2] and backend.compile_count == 1
    other = jnp.arange(2.0) + 5  # a new shared array
    out = strategy.run(add, (x, other))
    assert out.values[0].tolist() == [25.0, 26.0]


@pytest.mark.parametrize(
    "second",
    [
        jnp.arange(3.0),  # another shape
        jnp.arange(2, dtype=jnp.int32),  # another dtype
        np.arange(2.0, dtype=np.float32) + 7,  # NumPy: placed anew
    ],
    ids=["shape", "dtype", "numpy"],
)
def test_another_shape_or_dtype_is_traced_anew(second: Any) -> None:
    strategy, _ = make()

    def twice(a: Any) -> Any:
        return a * 2

    strategy.run(twice, (jnp.arange(2.0),))
    out = strategy.run(twice, (second,))
    assert out.values[N - 1].tolist() == (np.asarray(second) * 2).tolist()
    assert out.values[0].dtype == (second * 2).dtype


def test_numpy_input_changed_in_place_is_read_again() -> None:
    strategy, _ = make()
    host = np.ones(2, np.float32)

    def twice(a: Any) -> Any:
        return a * 2

    assert strategy.run(twice, (host,)).values[0].tolist() == [2.0, 2.0]
    host[:] = 5
    assert strategy.run(twice, (host,)).values[0].tolist() == [10.0, 10.0]


def test_a_changed_python_scalar_is_a_new_static_value() -> None:
    strategy, backend = make()

    def scale(a: Any, k: Any) -> Any:
        return a * k

    x = jnp.ones(2)
    assert strategy.run(scale, (x, 2.0)).values[0].tolist() == [2.0, 2.0]
    assert strategy.run(scale, (x, 3.0)).values[0].tolist() == [3.0, 3.0]
    assert strategy.run(scale, (x, 3)).values[0].tolist() == [3.0, 3.0]
    assert backend.compile_count == 3  # 2.0, 3.0 and the int 3 trace differently


def test_another_nest_structure_is_traced_anew() -> None:
    strategy, _ = make()

    def total(a: Any) -> Any:
        return sum(a) if isinstance(a, tuple) else a + 0

    x = jnp.ones(2)
    assert strategy.run(total, (x,)).values[0].tolist() == [1.0, 1.0]
    assert strategy.run(total, ((x, x, x),)).values[0].tolist() == [3.0, 3.0]


def test_a_variable_created_after_the_first_step_is_an_input() -> None:
    strategy, _ = make()
    with strategy.scope():
        found = [pd.Variable(np.ones(2, np.float32))]

    def total() -> Any:
        return sum(v.value() for v in found)

    assert strategy.run(total).values[0].tolist() == [1.0, 1.0]
    with strategy.scope():
        found.append(pd.Variable(np.full(2, 10, np.float32)))
    # The same fn, the same (empty) inputs: a new variable makes the plan stale.
    assert strategy.run(total).values[0].tolist() == [11.0, 11.0]


def test_a_variable_gone_since_the_last_step_is_no_input() -> None:
    strategy, _ = make()
    with strategy.scope():
        v = pd.Variable(np.ones(2, np.float32))
        gone = pd.Variable(np.zeros(2, np.float32))
    step = add_one(v)
    strategy.run(step)
    del gone
    import gc

    gc.collect()
    strategy.run(step)
    assert [c.numpy().tolist() for c in v.values] == [[3.0, 3.0]] * N


def test_a_variable_assigned_outside_run_is_read_anew() -> None:
    strategy, _ = make()
    with strategy.scope():
        v = pd.Variable(np.ones(2, np.float32))

    def read() -> Any:
        return v.value() * 2

    strategy.run(read)
    v.assign(np.full(2, 4, np.float32))
    assert [x.tolist() for x in strategy.run(read).values] == [[8.0, 8.0]] * N


@pytest.mark.parametrize("n", [1, N])
def test_results_are_the_bits_of_a_fresh_preparation(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same training steps, with and without reusing the plan: the same bits.
    def train(reuse: bool) -> list[np.ndarray]:
        strategy, backend = make(n)
        if not reuse:
            monkeypatch.setattr(backend._compiled, "_reuse", lambda *a: None)
        rng = np.random.default_rng(0)
        with strategy.scope():
            w = pd.Variable(rng.normal(size=(3, 2)).astype(np.float32))

        def step(x: Any) -> Any:
            ctx = pd.get_replica_context()
            assert ctx is not None
            loss, grad = jax.value_and_grad(lambda w_: jnp.sum((x @ w_) ** 2))(w.value())
            w.assign_sub(0.01 * ctx.all_reduce("MEAN", grad), read_value=False)
            return loss

        batches = [rng.normal(size=(n, 4, 3)).astype(np.float32) for _ in range(3)]
        # Prebuilt inputs: each step's is new, then the same objects come again.
        xs = [
            pd.PerReplica([jnp.asarray(b) for b in batch]) if n > 1 else jnp.asarray(batch[0])
            for batch in batches
        ]
        values = []
        for k in range(6):
            out = strategy.run(step, (xs[k % 3],))
            values += [np.asarray(v) for v in strategy.experimental_local_results(out)]
        values += [c.numpy() for c in w.values] if n > 1 else [w.numpy()]
        return values

    fast, fresh = train(True), train(False)
    assert len(fast) == len(fresh)
    for a, b in zip(fast, fresh, strict=True):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


# --------------------------------------------------------------------------- the direct path
# From a function's second call on, core hands the call to `CompiledRunner.run_direct`,
# which replays the plan: each test changes one input between calls and checks the
# result is the one the prepared path gives, without a recompile.


def count_prepares(backend: JaxBackend, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    prepare = backend._compiled._prepare

    def spy(*args: Any) -> Any:
        calls.append(1)
        return prepare(*args)

    monkeypatch.setattr(backend._compiled, "_prepare", spy)
    return calls


def triple(a: Any) -> Any:
    return a * 3


def plus_one(a: Any) -> Any:
    return a + 1


def double(a: Any) -> Any:
    return a * 2


def on_devices(values: list[Any], devices: list[Any]) -> Any:
    return pd.PerReplica([jax.device_put(v, d) for v, d in zip(values, devices, strict=True)])


def replica_sum(x: Any) -> Any:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return ctx.all_reduce("SUM", x * 2)


@pytest.mark.parametrize("n", [1, N])
def test_later_calls_are_direct_and_place_nothing(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    strategy, backend = make(n)
    prepares = count_prepares(backend, monkeypatch)
    devices = jax.devices()[:n]
    x = on_devices([jnp.full(2, float(r)) for r in range(n)], devices) if n > 1 else None
    x = x if x is not None else jax.device_put(jnp.full(2, 1.0), devices[0])
    expected = [[2.0 * sum(range(n)) if n > 1 else 2.0] * 2] * n
    strategy.run(replica_sum, (x,))
    placed: list[Any] = []
    for name in ("device_put", "make_array_from_single_device_arrays"):
        original = getattr(jax, name)

        def counting(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            placed.append(args)
            return _original(*args, **kwargs)

        monkeypatch.setattr(jax, name, counting)
    original_global = _spmd._global_array

    def counting_global(*args: Any) -> Any:
        placed.append(args)
        return original_global(*args)

    monkeypatch.setattr(_spmd, "_global_array", counting_global)
    for _ in range(3):
        out = strategy.run(replica_sum, (x,))
        assert [c.tolist() for c in strategy.experimental_local_results(out)] == expected
    assert placed == []  # already in place: nothing placed or assembled again
    assert prepares == [1] and backend.compile_count == 1


@pytest.mark.parametrize("n", [1, N])
def test_parameters_passed_in_and_returned(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The getting-started idiom: each step's outputs are the next step's inputs.
    strategy, backend = make(n)
    prepares = count_prepares(backend, monkeypatch)

    def step(w: Any, x: Any) -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        grad = ctx.all_reduce("MEAN", x * w)
        return w - 0.5 * grad, jnp.sum(grad)

    w = replicate(strategy, jnp.ones(3)) if n > 1 else jnp.ones(3)
    x = jnp.arange(3.0)
    expected = np.ones(3)
    assembled: list[Any] = []
    make_array = jax.make_array_from_single_device_arrays
    global_array = _spmd._global_array

    def counting(*args: Any, **kwargs: Any) -> Any:
        assembled.append(args)
        return make_array(*args, **kwargs)

    def counting_global(*args: Any) -> Any:
        assembled.append(args)
        return global_array(*args)

    for k in range(4):
        if k == 2:  # the outputs passed back in are the program's own output arrays
            monkeypatch.setattr(jax, "make_array_from_single_device_arrays", counting)
            monkeypatch.setattr(_spmd, "_global_array", counting_global)
        w, loss = strategy.run(step, (w, x))
        grad = np.arange(3.0) * expected
        expected = expected - 0.5 * grad
        for part in strategy.experimental_local_results(w):
            np.testing.assert_allclose(np.asarray(part), expected, rtol=1e-6)
        for part in strategy.experimental_local_results(loss):
            assert not np.shape(part)  # rank 0 per replica, as returned
            np.testing.assert_allclose(float(part), grad.sum(), rtol=1e-6)
    assert prepares == [1] and backend.compile_count == 1 and assembled == []
    (plan,) = backend._compiled._plans[strategy.extended].values()
    assert plan.program.local._cache_size() == 1  # the same shardings each step


def test_a_new_array_each_step_is_used() -> None:
    for n in (1, N):
        strategy, backend = make(n)

        def add_one(a: Any) -> Any:
            return a + 1

        for k in range(4):
            x = jnp.full(2, float(k))  # uncommitted, a new array each step
            out = strategy.run(add_one, (x,))
            assert [c.tolist() for c in strategy.experimental_local_results(out)] == [
                [k + 1.0] * 2
            ] * n
        assert backend.compile_count == 1


def test_components_on_other_devices_are_placed() -> None:
    strategy, _ = make()
    devices = jax.devices()[:N]
    values = [jnp.full(2, float(r)) for r in range(N)]
    strategy.run(triple, (on_devices(values, devices),))
    strategy.run(triple, (on_devices(values, devices),))
    rotated = on_devices(values, devices[1:] + devices[:1])  # each on another replica's device
    out = strategy.run(triple, (rotated,))
    assert [c.tolist() for c in out.values] == [[3.0 * r] * 2 for r in range(N)]
    assert [str(c.device) for c in out.values] == [str(d) for d in devices]
    shared = jax.device_put(jnp.ones(2), devices[2])  # committed to one replica's device
    out = strategy.run(triple, (shared,))
    assert [c.tolist() for c in out.values] == [[3.0] * 2] * N


def test_a_per_replica_whose_components_changed_is_read_again() -> None:
    strategy, _ = make()
    devices = jax.devices()[:N]
    x = on_devices([jnp.full(2, float(r)) for r in range(N)], devices)
    for _ in range(2):
        strategy.run(plus_one, (x,))
    # The same PerReplica object holding other components (core's values are a tuple).
    x._values = on_devices([jnp.full(2, 10.0 * r) for r in range(N)], devices).values
    out = strategy.run(plus_one, (x,))
    assert [c.tolist() for c in out.values] == [[10.0 * r + 1] * 2 for r in range(N)]
    # A plain array where a PerReplica was: given to every replica.
    out = strategy.run(plus_one, (jnp.zeros(2),))
    assert [c.tolist() for c in out.values] == [[1.0] * 2] * N


def test_a_variable_assigned_between_direct_calls_is_read_anew() -> None:
    strategy, backend = make()
    with strategy.scope():
        v = pd.Variable(np.zeros(2, np.float32))
    step = add_one(v)
    for _ in range(3):
        strategy.run(step)
    v.assign(np.full(2, 10.0, np.float32))  # from outside, in cross-replica context
    strategy.run(step)
    assert [c.numpy().tolist() for c in v.values] == [[11.0] * 2] * N
    assert backend.compile_count == 1


class Pair(NamedTuple):
    split: Any
    same: Any


def test_direct_results_regroup_as_core_does() -> None:
    strategy, backend = make()
    with strategy.scope():
        v = pd.Variable(np.ones(2, np.float32))
    shared = jnp.arange(2.0)
    x = on_devices([jnp.full(2, float(r)) for r in range(N)], jax.devices()[:N])

    def step(a: Any, b: Any) -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return {
            "pair": Pair(a * 2, ctx.all_reduce("SUM", a)),
            "static": "label",
            "variable": v,
            "input": b,
            "none": None,
        }

    results = [strategy.run(step, (x, shared)) for _ in range(3)]
    for out in results:  # the prepared call, the checked direct call, a direct call
        assert list(out) == ["pair", "static", "variable", "input", "none"]
        assert isinstance(out["pair"], Pair)
        assert type(out["pair"].split) is pd.PerReplica
        assert [c.tolist() for c in out["pair"].split.values] == [[2.0 * r] * 2 for r in range(N)]
        assert type(out["pair"].same) is pd.PerReplica
        assert out["pair"].same.values[3].tolist() == [6.0, 6.0]
        assert out["static"] == "label" and out["variable"] is v and out["input"] is shared
        assert out["none"] is None
    assert backend.compile_count == 1
    plan = next(iter(backend._compiled._plans[strategy.extended].values()))
    assert plan.dispatch is not None and plan.dispatch.checked


def test_a_direct_call_inside_jax_jit_joins_its_trace() -> None:
    strategy, _ = make(1)
    x = jnp.arange(3.0)
    for _ in range(2):
        strategy.run(double, (x,))

    @jax.jit
    def outer(y: Any) -> Any:
        return strategy.run(double, (x,)) + y

    assert outer(jnp.ones(3)).tolist() == [1.0, 3.0, 5.0]


def count_calls(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> list[tuple[Any, ...]]:
    """The arguments (``self`` first) of each call of ``cls.name`` from now on."""
    calls: list[tuple[Any, ...]] = []
    original = getattr(cls, name)

    def counting(*args: Any) -> Any:
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(cls, name, counting)
    return calls


def test_results_passed_back_in_are_never_split(monkeypatch: pytest.MonkeyPatch) -> None:
    # The getting-started idiom at several devices: a direct call's results stay one
    # global array each (a deferred PerReplica); the next step takes that array whole.
    strategy, backend = make()

    def step(w: Any, x: Any) -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        grad = ctx.all_reduce("MEAN", x * w)
        return w - 0.5 * grad, jnp.sum(grad)

    w = replicate(strategy, jnp.ones(3))
    x = on_devices([jnp.arange(3.0) + r for r in range(N)], jax.devices()[:N])
    w, loss = strategy.run(step, (w, x))
    w, loss = strategy.run(step, (w, x))  # the checked first replay
    made = count_calls(monkeypatch, _spmd._Result, "components")  # results split out
    assembled: list[Any] = []
    make_array = jax.make_array_from_single_device_arrays
    monkeypatch.setattr(
        jax,
        "make_array_from_single_device_arrays",
        lambda *a, **k: assembled.append(a) or make_array(*a, **k),
    )
    for _ in range(3):
        w, loss = strategy.run(step, (w, x))
        assert type(w) is pd.PerReplica and type(loss) is pd.PerReplica
    assert made == [] and assembled == []  # nothing split, nothing joined again
    # Read, they are each replica's arrays, on its device, rank 0 where returned so.
    expected = np.ones(3)
    for _ in range(5):
        grad = np.mean([(np.arange(3.0) + r) * expected for r in range(N)], axis=0)
        expected = expected - 0.5 * grad
    parts = strategy.experimental_local_results(w)
    assert [str(p.device) for p in parts] == [str(d) for d in jax.devices()[:N]]
    for p in parts:
        np.testing.assert_allclose(np.asarray(p), expected, rtol=1e-6)
    losses = loss.values
    assert all(np.shape(p) == () for p in losses)
    assert [str(p.device) for p in losses] == [str(d) for d in jax.devices()[:N]]
    assert len(made) == 2 and backend.compile_count == 1
    # A result read per replica is still passed back whole.
    w, loss = strategy.run(step, (w, x))
    assert len(made) == 2 and assembled == []


def test_a_deferred_result_pickles_and_crosses_strategies() -> None:
    strategy, _ = make()
    x = on_devices([jnp.full(2, float(r)) for r in range(N)], jax.devices()[:N])
    for _ in range(3):
        out = strategy.run(triple, (x,))
    assert _spmd.component_source(out) is not None  # a direct call's result
    restored = pickle.loads(pickle.dumps(out))
    assert [c.tolist() for c in restored.values] == [[3.0 * r] * 2 for r in range(N)]
    # Into a strategy on other devices: read per replica and placed there.
    other = pd.MirroredStrategy([f"/cpu:{d}" for d in (4, 5, 6, 7)], backend=JaxBackend())
    moved = other.run(plus_one, (out,))
    assert [c.tolist() for c in moved.values] == [[3.0 * r + 1] * 2 for r in range(N)]
    assert [str(c.device) for c in moved.values] == [str(d) for d in jax.devices()[4:8]]


def test_shards_are_jax_own_per_device_arrays_in_replica_order() -> None:
    mesh = _spmd._Mesh.build(tuple(f"/cpu:{d}" for d in (3, 1, 2, 0)))  # not JAX's order
    rows = jnp.arange(8.0).reshape(4, 2)
    array = jax.device_put(rows, mesh.split)
    for _ in range(2):  # the order found once, then read from the cache
        parts = _spmd._shards(array, mesh)
        assert [str(p.device) for p in parts] == [str(d) for d in mesh.devices]
        assert [p.tolist() for p in parts] == rows[:, None].tolist()
        by_device = {s.device: s.data for s in array.addressable_shards}
        assert all(p is by_device[d] for p, d in zip(parts, mesh.devices, strict=True))
    replicated = jax.device_put(jnp.ones(2), mesh.replicated)
    for _ in range(2):
        copies = _spmd._shards(replicated, mesh)
        assert [str(p.device) for p in copies] == [str(d) for d in mesh.devices]
        by_device = {s.device: s.data for s in replicated.addressable_shards}
        assert all(p is by_device[d] for p, d in zip(copies, mesh.devices, strict=True))
    array.delete()
    with pytest.raises(RuntimeError, match="deleted"):
        _spmd._shards(array, mesh)


@pytest.mark.parametrize("n", [1, N])
@pytest.mark.parametrize("shape", [(3,), ()], ids=["vector", "rank0"])
def test_variable_copies_stay_whole_until_read(
    shape: tuple[int, ...], n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    strategy, backend = make(n)
    with strategy.scope():
        v = pd.Variable(np.zeros(shape, np.float32), aggregation=pd.VariableAggregation.MEAN)

    def step(x: Any) -> Any:
        v.assign_add(jnp.reshape(x, shape) if shape else jnp.sum(x))
        return jnp.sum(x)

    x = on_devices([jnp.full(3, float(r)) for r in range(n)], jax.devices()[:n])
    if n == 1:
        x = x.values[0]  # one replica: its array
    for _ in range(2):
        strategy.run(step, (x,))
    calls = count_calls(monkeypatch, _spmd._Stored, "component")  # copies split out
    before = cached_input(backend, v)
    for _ in range(3):
        strategy.run(step, (x,))
    assert calls == []  # five steps, no copy split out
    assert before.is_deleted()  # and the copies were donated each step
    mean = sum(range(n)) / n * (1 if shape else 3)
    assert v.numpy().tolist() == np.full(shape, 5 * mean).tolist()
    assert [i for _, i in calls] == [0]  # replica 0's copy only
    parts = [c.value() for c in v.values]
    assert [i for _, i in calls] == list(range(n))
    assert [p.shape for p in parts] == [shape] * n
    assert [str(p.device) for p in parts] == [str(d) for d in jax.devices()[:n]]
    # A copy a user holds is not donated (copied first); the rest still are.
    held = parts[-1]
    del parts
    strategy.run(step, (x,))
    assert not held.is_deleted() and held.tolist() == np.full(shape, 5 * mean).tolist()
    assert [c.numpy().tolist() for c in v.values] == [np.full(shape, 6 * mean).tolist()] * n
    assert backend.compile_count == 1


def test_deferred_copies_read_first_inside_a_trace_are_concrete() -> None:
    # A rank-0 copy is split out with a (jitted) reshape: read first while another
    # function is traced, it must still be a concrete array, not that trace's value.
    strategy, _ = make()
    with strategy.scope():
        v = pd.Variable(0.0, aggregation=pd.VariableAggregation.MEAN)
    for _ in range(2):
        strategy.run(lambda: v.assign_add(1.0))

    def reads() -> Any:
        assert v.shape == ()  # the copy made here, inside this function's trace
        return v.value() * 2

    out = strategy.run(reads)
    assert [float(c) for c in out.values] == [4.0] * N
    assert all(not _spmd.is_tracer(a) for a in storage_arrays(v))
    assert v.numpy() == 2.0


@pytest.mark.parametrize("reverse", [False, True], ids=["in_order", "reversed"])
def test_global_arrays_and_their_shards_are_jax_s_own(reverse: bool) -> None:
    # `_global_array` builds what jax.make_array_from_single_device_arrays builds, and
    # `_shards` hands each replica its own block, whatever the mesh's device order.
    devices = jax.devices()[:N][:: -1 if reverse else 1]
    mesh = _spmd._Mesh.of(tuple(devices))
    blocks = [jax.device_put(jnp.full((2,), float(r)), d) for r, d in enumerate(devices)]
    want = jax.make_array_from_single_device_arrays((2 * N,), mesh.split, blocks)
    for _ in range(2):  # the second time from the cached abstract value and order
        got = mesh.assemble(blocks)
        assert got.sharding == want.sharding and got.aval == want.aval
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        parts = _spmd._shards(got, mesh)
        assert [p.tolist() for p in parts] == [[float(r)] * 2 for r in range(N)]
        assert [p.devices() for p in parts] == [{d} for d in devices]
    keys = [jax.device_put(jax.random.key(r)[None], d) for r, d in enumerate(devices)]
    joined = mesh.assemble(keys)  # an extended dtype: JAX's own function builds it
    assert joined.shape == (N,) and jax.dtypes.issubdtype(joined.dtype, jax.dtypes.extended)


def test_rank0_results_come_out_per_device_with_no_reshape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A per-replica rank-0 result (a loss) is each replica's own rank-0 array as the
    # program leaves it: reading it dispatches no reshape per device after the step.
    strategy, backend = make()

    def step(w: Any, x: Any) -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return w - ctx.all_reduce("SUM", x), jnp.sum(x * w), (x * 2)[0]

    w = replicate(strategy, jnp.ones(3))
    x = on_devices([jnp.arange(3.0) + r for r in range(N)], jax.devices()[:N])
    reshapes: list[Any] = []
    original = _spmd._to_scalar

    def counting(*xs: Any) -> Any:
        reshapes.append(xs)
        return original(*xs)

    monkeypatch.setattr(_spmd, "_to_scalar", counting)
    expected_w = np.ones(3)
    for k in range(4):  # the prepared call, the checked replay, direct calls
        w, loss, first = strategy.run(step, (w, x))
        # Small integers: exact in float32 whatever the order of the sums.
        want_loss = [float(np.sum((np.arange(3.0) + r) * expected_w)) for r in range(N)]
        expected_w = expected_w - sum(np.arange(3.0) + r for r in range(N))
        for value, want in ((loss, want_loss), (first, [2.0 * r for r in range(N)])):
            parts = strategy.experimental_local_results(value)
            assert [np.shape(p) for p in parts] == [()] * N, k
            assert [str(p.device) for p in parts] == [str(d) for d in jax.devices()[:N]]
            assert [float(p) for p in parts] == want, k
            assert all(p.dtype == jnp.float32 for p in parts)
        for part in strategy.experimental_local_results(w):
            assert np.asarray(part).tolist() == expected_w.tolist()
    assert reshapes == [] and backend.compile_count == 1
    # Used as any array: summed by reduce, passed to another step per replica.
    assert float(strategy.reduce("SUM", loss, axis=None)) == sum(want_loss)
    again = strategy.run(plus_one, (loss,))
    assert [float(p) for p in again.values] == [v + 1 for v in want_loss]


def test_a_result_passed_back_in_is_not_held_after_the_call() -> None:
    # Parameters passed in and returned: once the caller drops last step's parameters
    # nothing holds them (a hand-written loop's memory, freed after the next dispatch
    # rather than by the one after it). (XLA:CPU's in-flight cap holds a step's
    # smallest output, here the loss, two steps longer.)
    strategy, _ = make()

    def step(w: Any, x: Any) -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return w - ctx.all_reduce("MEAN", x * w), jnp.sum(x)

    w = replicate(strategy, jnp.ones(3))
    x = on_devices([jnp.arange(3.0) + r for r in range(N)], jax.devices()[:N])
    for _ in range(3):  # the prepared call, the checked replay, a direct call
        w, _ = strategy.run(step, (w, x))
    expected = np.asarray(w.values[0])
    for _ in range(3):
        source = _spmd.component_source(w)
        assert isinstance(source, _spmd._Result)
        before = weakref.ref(source.array)
        del source
        w, _ = strategy.run(step, (w, x))
        assert before() is None  # the only reference was the caller's
        expected = expected - np.mean([(np.arange(3.0) + r) * expected for r in range(N)], 0)
    for part in w.values:
        np.testing.assert_allclose(np.asarray(part), expected, rtol=1e-6)


def test_lists_of_parameters_are_handed_over_without_flattening(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The getting-started idiom with a list of parameters: a later call whose arguments
    # are the same lists and tuples of leaves of the same types takes core's leaves as
    # they are; any other structure is flattened (and traced) as before.
    strategy, backend = make()

    def step(params: Any, x: Any) -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return [p - ctx.all_reduce("SUM", x) for p in params], jnp.sum(x)

    params = [replicate(strategy, jnp.ones(2)), replicate(strategy, jnp.zeros(2))]
    x = on_devices([jnp.full(2, float(r)) for r in range(N)], jax.devices()[:N])
    for _ in range(2):  # the prepared call, the checked replay
        params, _ = strategy.run(step, (params, x))
    flattened = count_calls(monkeypatch, _spmd._nest, "flatten")
    total = float(sum(range(N)))
    for k in range(3, 6):
        params, loss = strategy.run(step, (params, x))
        assert [p.values[1].tolist() for p in params] == [[1 - k * total] * 2, [-k * total] * 2]
        assert [float(v) for v in loss.values] == [2.0 * r for r in range(N)]
    assert flattened == [] and backend.compile_count == 1
    # Other structures: a longer list, a tuple, a leaf of another type.
    out, _ = strategy.run(step, ([*params, params[0]], x))
    first, second = [1 - 6 * total] * 2, [-6 * total] * 2
    assert [p.values[0].tolist() for p in out] == [first, second, first]
    out, _ = strategy.run(step, (tuple(params), x))
    assert [p.values[2].tolist() for p in out] == [first, second]
    out, _ = strategy.run(step, ([params[0], jnp.full(2, 7.0)], x))
    assert [p.values[3].tolist() for p in out] == [first, [7.0 - total] * 2]
    assert len(flattened) >= 3


def bump(w: Any) -> Any:
    return w.assign_add(np.ones(3, np.float32), read_value=False)


def test_the_input_cache_forgets_a_variable_once_it_is_gone() -> None:
    # Entries are keyed by the variable's id while it lives: a variable made later at
    # the same address never finds another's copies.
    strategy, backend = make()
    cache = backend._compiled._variable_inputs
    with strategy.scope():
        v = pd.Variable(np.zeros(3, np.float32))
    for _ in range(3):
        strategy.run(bump, (v,))
    key = id(v)
    assert key in cache._cache
    del v
    gc.collect()
    assert key not in cache._cache and key not in cache._refs
    with strategy.scope():
        w = pd.Variable(np.full(3, 5.0, np.float32))
    for _ in range(2):
        strategy.run(bump, (w,))
    assert [c.numpy().tolist() for c in w.values] == [[7.0] * 3] * N


def test_one_device_outputs_passed_back_in_are_taken_by_identity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One device: the arrays a step returned, passed back in where they were passed
    # before, are known by identity (no placement checks); another array at that place
    # (an older output, or one swapped from another place) is checked as any new one.
    # (The replay itself: without the lane, which JAX's dispatch checks.)
    monkeypatch.setattr(_spmd, "LANE_COMPILE_SECONDS", 0.0)
    strategy, backend = make(1)

    def step(w: Any, b: Any, x: Any) -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        grad = ctx.all_reduce("MEAN", x * w)
        return w - 0.5 * grad, b * 2.0, jnp.sum(grad)

    w, b, x = jnp.ones(3), jnp.ones(3), jnp.arange(3.0)
    want_w, want_b = np.ones(3), np.ones(3)

    def advance(w_in: np.ndarray, b_in: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return w_in - 0.5 * np.arange(3.0) * w_in, b_in * 2.0

    for _ in range(3):
        w, b, _ = strategy.run(step, (w, b, x))
        want_w, want_b = advance(want_w, want_b)
    placed = count_calls(monkeypatch, _spmd.CompiledRunner, "_replicated")
    for _ in range(3):
        w, b, loss = strategy.run(step, (w, b, x))
        want_loss = float(np.sum(np.arange(3.0) * want_w))
        want_w, want_b = advance(want_w, want_b)
    assert placed == []
    np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(b), want_b, rtol=1e-6)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-6)
    # Swapped: each is the other place's output of the last call, taken after checks.
    w2, b2, _ = strategy.run(step, (b, w, x))
    assert len(placed) == 2
    got_w, got_b = advance(want_b, want_w)
    np.testing.assert_allclose(np.asarray(w2), got_w, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(b2), got_b, rtol=1e-6)
    # An output of the call before last: checked again, the right values.
    w3, b3, _ = strategy.run(step, (w, b, x))
    assert len(placed) == 4
    np.testing.assert_allclose(np.asarray(w3), advance(want_w, want_b)[0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(b3), advance(want_w, want_b)[1], rtol=1e-6)
    assert backend.compile_count == 1


def test_one_device_results_are_the_programs_outputs_in_fns_structure() -> None:
    # One device: a result whose leaves are all program outputs (this replica's values
    # and all-reduced ones) is those outputs put in fn's structure as they are; one
    # with another leaf (a Python object) is regrouped leaf by leaf. Both as core's
    # regroup gives them.
    strategy, backend = make(1)

    def step(x: Any) -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return {"sum": ctx.all_reduce("SUM", x), "pair": (x * 2.0, jnp.sum(x))}

    def tagged(x: Any) -> Any:
        return step(x), "tag"

    for k in range(4):
        x = jnp.arange(3.0) + k  # a new array each call
        want = np.arange(3.0) + k
        out = strategy.run(step, (x,))
        out_tagged, tag = strategy.run(tagged, (x,))
        for got in (out, out_tagged):
            assert sorted(got) == ["pair", "sum"] and type(got["pair"]) is tuple
            np.testing.assert_array_equal(np.asarray(got["sum"]), want)
            np.testing.assert_array_equal(np.asarray(got["pair"][0]), want * 2.0)
            assert np.ndim(got["pair"][1]) == 0 and float(got["pair"][1]) == want.sum()
        assert tag == "tag"
    plans = backend._compiled._plans[strategy.extended]
    # Flat outputs: this replica's (x * 2, its sum), then the all-reduced sum; the
    # result's leaves in key order: pair[0], pair[1], sum.
    assert plans[step].dispatch.picks == [0, 1, 2]
    assert plans[tagged].dispatch.picks is None
    assert backend.compile_count == 2


@pytest.mark.parametrize("n", [1, N])
def test_variables_a_step_leaves_alone_are_no_inputs_of_it(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every variable the strategy tracks is an input of its programs; one the step
    # neither reads nor writes is dropped from the compiled call (and not looked up).
    strategy, backend = make(n)
    with strategy.scope():
        used = pd.Variable(np.ones(3, np.float32), aggregation=pd.VariableAggregation.MEAN)
        written = pd.Variable(np.zeros(3, np.float32), aggregation=pd.VariableAggregation.MEAN)
        idle = pd.Variable(np.full(3, 7.0, np.float32))

    def step(x: Any) -> Any:
        written.assign(used.value() * 2.0, read_value=False)  # written, never read
        used.assign_add(x, read_value=False)
        return jnp.sum(used.value())

    x = on_devices([jnp.ones(3)] * n, jax.devices()[:n])
    if n == 1:
        x = x.values[0]
    for _ in range(3):
        strategy.run(step, (x,))
    (plan,) = backend._compiled._plans[strategy.extended].values()
    program = plan.program
    assert program.variable_kept is not None
    kept = dict(zip([r() for r in plan.variables], program.variable_kept, strict=True))
    assert [kept[v] for v in (used, written, idle)] == [True, True, False]
    looked_up = count_calls(monkeypatch, _functional.InputCache, "lookup")
    for _ in range(2):
        loss = strategy.run(step, (x,))
    assert all(args[1] is not idle for args in looked_up) and len(looked_up) == 4
    assert used.numpy().tolist() == [6.0] * 3 and written.numpy().tolist() == [10.0] * 3
    assert [float(v) for v in strategy.experimental_local_results(loss)] == [18.0] * n
    # Assigned from outside, the variable left alone keeps the step on its direct path.
    idle.assign(np.zeros(3, np.float32))
    before = backend._compiled._plans[strategy.extended][step]
    strategy.run(step, (x,))
    assert backend._compiled._plans[strategy.extended][step] is before
    assert idle.numpy().tolist() == [0.0] * 3 and used.numpy().tolist() == [7.0] * 3
    # Another step that reads it takes it.
    assert [
        float(v)
        for v in strategy.experimental_local_results(
            strategy.run(lambda: jnp.sum(idle.value() + used.value()))
        )
    ] == [21.0] * n
    assert backend.compile_count == 2


def accumulate(w: Any, x: Any) -> Any:
    """``w`` plus the sum of every replica's ``x``, and this replica's total of ``x``."""
    ctx = pd.get_replica_context()
    assert ctx is not None
    return w + ctx.all_reduce("SUM", x), jnp.sum(x)


def test_one_replicas_per_replica_inputs_take_the_direct_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One replica: a PerReplica of one array (what a dataset of one replica gives)
    # reaches fn as that array, a shared input; later calls replay the plan.
    strategy, backend = make(1)
    prepares = count_prepares(backend, monkeypatch)
    device = jax.devices()[0]
    x = pd.PerReplica([jax.device_put(jnp.arange(3.0), device)])
    w = jnp.zeros(3)
    for k in range(4):
        w, total = strategy.run(accumulate, (w, x))
        np.testing.assert_allclose(np.asarray(w), np.arange(3.0) * (k + 1))
        assert float(total) == 3.0
    assert prepares == [1]
    # Another PerReplica, another component: used, on the same path.
    x = pd.PerReplica([jax.device_put(np.full(3, 2.0, np.float32), device)])
    w, total = strategy.run(accumulate, (w, x))
    np.testing.assert_allclose(np.asarray(w), np.arange(3.0) * 4 + 2.0)
    assert float(total) == 6.0 and prepares == [1] and backend.compile_count == 1


def test_leaves_of_another_kind_than_before_take_the_direct_path_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One replica: calls with plain arrays, then with a one-replica PerReplica of new
    # arrays each call (what a dataset of one replica gives), then plain arrays again.
    # Each change of kind runs core's path once; the calls after it are replayed
    # (before, the replay made for the first kind kept every later call off it).
    strategy, backend = make(1)
    prepares = count_prepares(backend, monkeypatch)
    device = jax.devices()[0]
    w, want = jnp.zeros(3), np.zeros(3)
    kinds = [False] * 3 + [True] * 4 + [False] * 3
    for k, wrapped in enumerate(kinds):
        x = jax.device_put(np.full(3, float(k + 1), np.float32), device)  # a new batch
        w, _ = strategy.run(accumulate, (w, pd.PerReplica([x]) if wrapped else x))
        want = want + (k + 1)
        np.testing.assert_array_equal(np.asarray(w), want)
    # Core's path: the first call, the first call of each new kind; every other one
    # was replayed.
    assert len(prepares) == 3, prepares
    assert backend.compile_count == 1


@pytest.mark.parametrize("dce", ["absent", "another signature"])
def test_without_jaxs_dead_code_elimination_every_variable_stays_an_input(
    dce: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # JAX's dce_jaxpr is private: where it is missing or takes other arguments, the
    # programs keep every variable as an input and compute the same.
    def other(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("dce_jaxpr() got an unexpected keyword argument 'instantiate'")

    monkeypatch.setattr(_spmd, "_dce_jaxpr", None if dce == "absent" else other)
    strategy, backend = make(1)
    with strategy.scope():
        used = pd.Variable(np.ones(3, np.float32))
        idle = pd.Variable(np.zeros(3, np.float32))

    def step() -> Any:
        return jnp.sum(used.value())

    for _ in range(3):
        assert float(strategy.run(step)) == 3.0
    (plan,) = backend._compiled._plans[strategy.extended].values()
    assert plan.program.kept is None and plan.program.variable_kept is None
    assert idle.numpy().tolist() == [0.0] * 3


# --------------------------------------------------------------------------- the lane
# One device: a replayed call whose arguments are all arrays (or one-replica PerReplica
# values of arrays) runs as JAX's own dispatch of fn's arguments (`_Dispatch.lane`).


def sgd_step(params: list[Any], x: Any) -> Any:
    ctx = pd.get_replica_context()
    assert ctx is not None

    def loss_of(p: list[Any]) -> Any:
        return jnp.mean((x @ p[0] + p[1]) ** 2)

    loss, grads = jax.value_and_grad(loss_of)(params)
    grads = ctx.all_reduce("MEAN", grads)
    return [p - 0.1 * g for p, g in zip(params, grads, strict=True)], loss


def count_lane_calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What each call through a lane gave (the replay's or core's prepared call's),
    `_MISSED` where it declined."""
    results: list[Any] = []
    call = _spmd._call_lane

    def spy(*args: Any) -> Any:
        results.append(out := call(*args))
        return out

    monkeypatch.setattr(_spmd, "_call_lane", spy)
    return results


def count_prepared_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """How each of core's prepared calls (``prepare_direct``) went: "answered" or
    "declined" (core then took its usual path)."""
    outcomes: list[str] = []
    prepare = _spmd.CompiledRunner.prepare_direct

    def spy(self: Any, *args: Any) -> Any:
        prepared = prepare(self, *args)
        if prepared is None:
            return None

        def counted(call_args: tuple[Any, ...]) -> Any:
            out = prepared(call_args)
            outcomes.append("declined" if out is NOT_HANDLED else "answered")
            return out

        return counted

    monkeypatch.setattr(_spmd.CompiledRunner, "prepare_direct", spy)
    return outcomes


def train_one_device(steps: int, batches: list[Any]) -> tuple[list[np.ndarray], list[float]]:
    strategy, _ = make(1)
    params = [jnp.full((3, 2), 0.5, jnp.float32), jnp.zeros(2, jnp.float32)]
    losses = []
    for k in range(steps):
        params, loss = strategy.run(sgd_step, (params, batches[k % len(batches)]))
        losses.append(float(loss))
    return [np.asarray(p) for p in params], losses


@pytest.mark.parametrize("batch_kind", ["array", "per_replica"])
def test_one_device_steps_take_jax_s_dispatch_of_fns_arguments(
    batch_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    xs = [jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3) * (k + 1) for k in range(3)]
    batches: list[Any] = xs if batch_kind == "array" else [pd.PerReplica((x,)) for x in xs]
    # The replay alone (no lane) gives the reference bits.
    monkeypatch.setattr(_spmd, "LANE_COMPILE_SECONDS", 0.0)
    want_params, want_losses = train_one_device(8, batches)
    monkeypatch.undo()
    lane_calls = count_lane_calls(monkeypatch)
    strategy, backend = make(1)
    prepares = count_prepares(backend, monkeypatch)
    params = [jnp.full((3, 2), 0.5, jnp.float32), jnp.zeros(2, jnp.float32)]
    losses = []
    for k in range(8):
        params, loss = strategy.run(sgd_step, (params, batches[k % 3]))
        losses.append(float(loss))
    # Call 1 prepares and compiles, call 2 is checked against core's regroup, call 3
    # makes the lane, which takes calls 4 to 8.
    assert prepares == [1] and backend.compile_count == 1 and backend.lane_count == 1
    assert len(lane_calls) == 5 and all(r is not _spmd._MISSED for r in lane_calls)
    for got, want in zip(params, want_params, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    assert losses == want_losses
    assert type(params) is list and params[0].devices() == {jax.devices()[0]}
    plan = backend._compiled._plans[strategy.extended][sgd_step]
    assert plan.dispatch is not None and plan.dispatch.lane is not None
    assert plan.inputs == [None] * 3  # the plan holds none of the step's arrays


def test_arguments_the_lane_does_not_take_are_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    lane_calls = count_lane_calls(monkeypatch)
    strategy, backend = make(1)
    x = jnp.ones((2, 3), jnp.float32)
    params = [jnp.full((3, 2), 0.5, jnp.float32), jnp.zeros(2, jnp.float32)]
    for _ in range(3):
        params, _ = strategy.run(sgd_step, (params, x))
    plan = backend._compiled._plans[strategy.extended][sgd_step]
    assert plan.dispatch is not None and plan.dispatch.lane is not None

    def reference(p: list[Any], batch: Any) -> list[np.ndarray]:
        fresh, _ = make(1)
        return [np.asarray(a) for a in fresh.run(sgd_step, (list(p), batch))[0]]

    # A batch committed to another device: the lane's program takes its arguments on
    # the strategy's device (``in_shardings``), so JAX copies it there, as the replay
    # places it.
    other = jax.device_put(x, jax.devices()[3])
    want = reference(params, x)
    got, _ = strategy.run(sgd_step, (params, other))
    assert lane_calls[-1] is not _spmd._MISSED
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), w)
    assert got[0].devices() == {jax.devices()[0]}
    # Parameters as a tuple (another structure): the lane declines, core's path runs it
    # (a plan of its own for that structure).
    want = reference(params, x)
    got, _ = strategy.run(sgd_step, (tuple(params), x))
    assert lane_calls[-1] is _spmd._MISSED
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), w)
    # Back to the list, then the tuple again, and so on: each structure's plan is made
    # again from its cached program, whose lane is made again once, then no more.
    for _ in range(3):
        for _ in range(4):
            params, _ = strategy.run(sgd_step, (list(params), x))
        strategy.run(sgd_step, (tuple(params), x))
    plan = backend._compiled._plans[strategy.extended][sgd_step]
    for _ in range(4):
        params, _ = strategy.run(sgd_step, (list(params), x))
    plan = backend._compiled._plans[strategy.extended][sgd_step]
    assert plan.program.lanes == 2 and plan.dispatch is not None and plan.dispatch.lane is None
    want = reference(params, x)
    got, _ = strategy.run(sgd_step, (params, x))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), w)
    assert backend.compile_count == 2  # the list's program, the tuple's
    assert backend.lane_count == 2  # the list's, made twice


def test_a_weak_typed_scalar_where_an_array_was_is_no_lane_input(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lane_calls = count_lane_calls(monkeypatch)
    strategy, backend = make(1)

    def scale(a: Any, k: Any) -> Any:
        return a * k

    a, k = jnp.ones(2, jnp.float32), jnp.float32(2.0)
    for _ in range(4):
        out = strategy.run(scale, (a, k))
    assert lane_calls and lane_calls[-1] is not _spmd._MISSED
    # A Python float is a static value of the traced program (core's rule), not an
    # input of the lane's program: the call is traced anew, as without a lane.
    out = strategy.run(scale, (a, 3.0))
    assert lane_calls[-1] is _spmd._MISSED
    assert np.asarray(out).tolist() == [3.0, 3.0] and backend.compile_count == 2


def test_a_lane_call_inside_jax_jit_joins_its_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    lane_calls = count_lane_calls(monkeypatch)
    strategy, _ = make(1)
    for k in range(4):
        assert float(strategy.run(triple, (jnp.float32(k),))) == 3.0 * k
    assert lane_calls[-1] is not _spmd._MISSED

    @jax.jit
    def outer(a: Any) -> Any:
        return strategy.run(triple, (a,)) + 1

    assert float(outer(jnp.float32(2.0))) == 7.0
    assert lane_calls[-1] is _spmd._MISSED  # a tracer came out: the replay's trace path


@pytest.mark.parametrize("why", ["slow compile", "variables", "several devices"])
def test_no_lane_where_the_plan_does_not_allow_one(
    why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if why == "slow compile":
        monkeypatch.setattr(_spmd, "LANE_COMPILE_SECONDS", 0.0)
    strategy, backend = make(N if why == "several devices" else 1)
    v: Any = None
    if why == "variables":  # (a strategy's every variable is an input of its programs)
        with strategy.scope():
            v = pd.Variable(np.ones(2, np.float32))

    def step(a: Any) -> Any:
        return a * v.value() if why == "variables" else a * 2.0

    for _ in range(5):
        out = strategy.run(step, (jnp.ones(2, jnp.float32),))
    assert [np.asarray(c).tolist() for c in strategy.experimental_local_results(out)] == [
        [1.0, 1.0] if why == "variables" else [2.0, 2.0]
    ] * (N if why == "several devices" else 1)
    plan = backend._compiled._plans[strategy.extended][step]
    assert plan.dispatch is not None and plan.dispatch.lane is None
    assert plan.dispatch.lane_off is (why != "several devices")  # (never asked for several)
    assert backend.lane_count == 0


def test_a_pytree_of_parameters_and_optimizer_state_takes_the_lane(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The functional JAX idiom: parameters as nested dicts, the optimizer's state a
    # tuple of such dicts and a step count, all passed in and returned.
    lane_calls = count_lane_calls(monkeypatch)

    def step(params: dict[str, Any], state: tuple[Any, Any], x: Any) -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean((x @ p["dense"]["w"] + p["dense"]["b"]) ** 2)
        )(params)
        grads = ctx.all_reduce("MEAN", grads)
        momentum, count = state
        momentum = jax.tree.map(lambda m, g: 0.9 * m + g, momentum, grads)
        params = jax.tree.map(lambda p, m: p - 0.1 * m, params, momentum)
        return params, (momentum, count + 1), loss

    def train(strategy: pd.Strategy, steps: int) -> tuple[Any, Any, list[float]]:
        params = {"dense": {"w": jnp.full((3, 2), 0.5, jnp.float32), "b": jnp.zeros(2)}}
        state = (jax.tree.map(jnp.zeros_like, params), jnp.int32(0))
        x = pd.PerReplica((jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3),))
        losses = []
        for _ in range(steps):
            params, state, loss = strategy.run(step, (params, state, x))
            losses.append(float(loss))
        return params, state, losses

    strategy, backend = make(1)
    params, state, losses = train(strategy, 6)
    assert len(lane_calls) == 3 and all(r is not _spmd._MISSED for r in lane_calls)
    assert backend.lane_count == 1 and backend.compile_count == 1
    monkeypatch.setattr(_spmd, "LANE_COMPILE_SECONDS", 0.0)
    want_params, want_state, want_losses = train(make(1)[0], 6)  # the replay alone
    assert losses == want_losses and int(state[1]) == int(want_state[1]) == 6
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert sorted(params) == ["dense"] and sorted(params["dense"]) == ["b", "w"]


# -- core's prepared call (`prepare_direct`) ------------------------------------------------


class StepOut(NamedTuple):
    params: list[Any]
    loss: Any


@pytest.mark.parametrize("result", ["tuple", "namedtuple", "dict in key order", "dict unsorted"])
def test_a_prepared_call_gives_what_the_replay_gives(
    result: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def step(params: list[Any], x: Any) -> Any:
        new, loss = sgd_step(params, x)
        if result == "namedtuple":
            return StepOut(new, loss)
        if result == "dict in key order":
            return {"loss": loss, "params": new}
        if result == "dict unsorted":  # JAX would sort the keys: the lane returns leaves
            return {"params": new, "loss": loss}
        return new, loss

    def train(strategy: pd.Strategy) -> list[Any]:
        params = [jnp.full((3, 2), 0.5, jnp.float32), jnp.zeros(2, jnp.float32)]
        x = pd.PerReplica((jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3),))
        outs = []
        for _ in range(7):
            out = strategy.run(step, (params, x))
            params = out["params"] if "dict" in result else out[0]
            outs.append(out)
        return outs

    monkeypatch.setattr(_spmd, "LANE_COMPILE_SECONDS", 0.0)
    want = train(make(1)[0])  # the replay alone
    monkeypatch.undo()
    lane_calls = count_lane_calls(monkeypatch)
    prepared = count_prepared_calls(monkeypatch)
    strategy, backend = make(1)
    got = train(strategy)
    # Calls 4 to 7 through the prepared call (the lane comes at call 3).
    assert prepared == ["answered"] * 4
    assert len(lane_calls) == 4 and all(r is not _spmd._MISSED for r in lane_calls)
    path = backend._compiled._plans[strategy.extended][step].dispatch.lane_path
    assert (path is None) is (result == "dict unsorted")
    for g, w in zip(got, want, strict=True):
        assert type(g) is type(w)
        if isinstance(w, dict):
            assert list(g) == list(w)
        g_leaves, w_leaves = jax.tree.leaves(g), jax.tree.leaves(w)
        assert len(g_leaves) == len(w_leaves) == 3
        for a, b in zip(g_leaves, w_leaves, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert backend.compile_count == 1 and backend.lane_count == 1


@pytest.mark.parametrize("prepared", [True, False])
def test_when_fns_closure_changes_the_call_is_the_plans(
    prepared: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The prepared call declines, and the call is what it is without one (the plan's
    # checks, then the program cache: closed-over arrays are the trace's, as in jax.jit).
    lane_calls = count_lane_calls(monkeypatch)
    outcomes = count_prepared_calls(monkeypatch)
    if not prepared:
        monkeypatch.setattr(_spmd.CompiledRunner, "prepare_direct", lambda *a: None)
    strategy, backend = make(1)
    scale = jnp.float32(2.0)

    def step(a: Any) -> Any:
        return a * scale

    a = jnp.ones(2, jnp.float32)
    for _ in range(5):
        assert np.asarray(strategy.run(step, (a,))).tolist() == [2.0, 2.0]
    assert outcomes == (["answered"] * 2 if prepared else [])
    calls = len(lane_calls)
    scale = jnp.float32(3.0)
    out = np.asarray(strategy.run(step, (a,))).tolist()
    assert out == [2.0, 2.0] and backend.compile_count == 1
    # No lane ran it (each path declined first: the plan was made again).
    assert len(lane_calls) == calls
    assert outcomes == (["answered"] * 2 + ["declined"] if prepared else [])


def test_a_prepared_call_declines_when_x64_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes = count_prepared_calls(monkeypatch)
    strategy, _ = make(1)
    for k in range(5):
        assert float(strategy.run(triple, (jnp.float32(k),))) == 3.0 * k
    assert outcomes == ["answered"] * 2
    with jax.enable_x64(True):  # type: ignore[no-untyped-call]
        out = strategy.run(triple, (np.float64(1.5),))
        assert out.dtype == jnp.float64 and float(out) == 4.5
    assert outcomes == ["answered"] * 2 + ["declined"]


def test_run_inside_a_replica_function_is_still_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes = count_prepared_calls(monkeypatch)
    strategy, _ = make(1)
    for k in range(5):
        strategy.run(triple, (jnp.float32(k),))
    assert outcomes == ["answered"] * 2

    def nested(a: Any) -> Any:
        return strategy.run(triple, (a,))

    with pytest.raises(RuntimeError, match="replica context"):
        strategy.run(nested, (jnp.float32(1.0),))
    other, _ = make(1)
    with other.scope(), pytest.raises(RuntimeError, match="Mixing different"):
        strategy.run(triple, (jnp.float32(1.0),))
    assert outcomes == ["answered"] * 2  # neither call was handed to it


def test_on_an_accelerator_a_slower_first_compile_still_gets_a_lane() -> None:
    # A GPU's or TPU's first compile autotunes, which the lane's compile finds cached.
    class Device:
        def __init__(self, platform: str) -> None:
            self.platform = platform

    class Sharding:
        def __init__(self, platform: str) -> None:
            self.device_set = {Device(platform)}

    assert _spmd.LANE_ACCELERATOR_FACTOR > 1
    for platform in ("cpu", "gpu", "tpu"):
        fake = type("P", (), {"single": Sharding(platform)})()
        want = 1.0 if platform == "cpu" else _spmd.LANE_ACCELERATOR_FACTOR
        assert _spmd._lane_factor(fake) == want
    assert _spmd._lane_factor(type("P", (), {"single": None})()) == 1.0  # several devices
