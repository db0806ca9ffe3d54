"""The compiled run's per-step host work and memory: donation of the variables' buffers,
placing an input once, the deferred divergence check. Values, never timings."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polydist as pd
from polydist.backend.tracing import storage_arrays
from polydist_jax import JaxBackend, _input, _spmd

N = 4


def make(n: int = N) -> tuple[pd.Strategy, JaxBackend]:
    backend = JaxBackend()
    return pd.MirroredStrategy(n, backend=backend), backend


def cached_input(backend: JaxBackend, v: Any) -> Any:
    """The global array the next run passes for ``v`` (the runner's input cache)."""
    return backend._compiled._variable_inputs._cache[v][1]


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
        if np.shape(value) == (3,):  # not the runner's own flag (a scalar)
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
