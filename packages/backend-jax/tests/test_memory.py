"""Memory and aliasing: a variable holds its state once (no host copy of its initial
value, its buffers donated to the compiled step), and nothing a user holds is ever
invalidated or changed by a later step. Values, never memory figures."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polydist as pd
from polydist_jax import JaxBackend

N = 4


def add_one(v: Any) -> Any:
    return lambda: v.assign(v.value() + 1, read_value=False)


@pytest.mark.parametrize("n", [1, N])
def test_a_variable_is_placed_from_the_callers_numpy_array_without_a_host_copy(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = JaxBackend()
    received: list[Any] = []
    place = JaxBackend.place

    def recording(self: JaxBackend, value: Any, device: str) -> Any:
        received.append(value)
        return place(self, value, device)

    monkeypatch.setattr(JaxBackend, "place", recording)
    strategy = pd.MirroredStrategy(n, backend=backend)
    init = np.arange(6, dtype=np.float32)
    with strategy.scope():
        v = pd.Variable(init)
    # Every copy is placed from the caller's array itself (place copies it), not from a
    # host copy made first: making the variable holds its value once, not twice.
    assert len(received) == n
    assert all(r is init for r in received)
    # The variable still never shares memory with its initial value.
    init[:] = -1.0
    assert [c.numpy().tolist() for c in v.values] == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]] * n
    strategy.run(add_one(v))
    assert init.tolist() == [-1.0] * 6
    assert v.values[n - 1].numpy().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_place_copies_a_numpy_array_on_cpu() -> None:
    # XLA:CPU takes an aligned host buffer as it is (zero-copy), even with
    # device_put(may_alias=False); arrays of many sizes meet every alignment.
    backend = JaxBackend()
    hosts = [np.ones(1024 + i, np.float32) for i in range(64)]
    placed = [backend.place(h, "/cpu:0") for h in hosts]
    for h in hosts:
        h[0] = 7.0
    assert [float(p[0]) for p in placed] == [1.0] * 64
    assert all(p.committed and p.sharding.device_set == {jax.devices()[0]} for p in placed)


def test_a_one_device_variable_does_not_alias_its_initial_value() -> None:
    init = np.zeros(3, np.float32)
    with pd.OneDeviceStrategy("/cpu:0", backend=JaxBackend()).scope():
        v = pd.Variable(init)
    init[0] = 5.0
    assert v.numpy().tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("n", [1, N])
def test_a_value_read_before_the_first_step_stays_valid(n: int) -> None:
    strategy = pd.MirroredStrategy(n, backend=JaxBackend())
    with strategy.scope():
        v = pd.Variable(np.zeros(4, np.float32))
    early = v.value()  # the stored copy itself, read before any step
    each = [c.value() for c in v.values]
    for _ in range(3):
        strategy.run(add_one(v))
    assert not early.is_deleted()
    assert early.tolist() == [0.0] * 4
    assert [e.tolist() for e in each] == [[0.0] * 4] * n
    assert [c.numpy().tolist() for c in v.values] == [[3.0] * 4] * n


@pytest.mark.parametrize("n", [1, N])
def test_a_jax_initial_value_stays_valid_after_donated_steps(n: int) -> None:
    strategy = pd.MirroredStrategy(n, backend=JaxBackend())
    init = jax.device_put(jnp.arange(4.0), jax.devices()[0])
    with strategy.scope():
        v = pd.Variable(init)
    for _ in range(2):
        strategy.run(add_one(v))
    assert not init.is_deleted()
    assert init.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert v.values[0].numpy().tolist() == [2.0, 3.0, 4.0, 5.0]


def test_a_value_read_between_steps_in_cross_replica_context_stays_valid() -> None:
    strategy = pd.MirroredStrategy(N, backend=JaxBackend())
    with strategy.scope():
        v = pd.Variable(np.zeros(2, np.float32))
    strategy.run(add_one(v))
    reads = [v.value(), v.read_value(), jnp.asarray(v), v + 0]
    local = strategy.experimental_local_results(v)
    for _ in range(2):
        strategy.run(add_one(v))
    assert [np.asarray(r).tolist() for r in reads] == [[1.0, 1.0]] * 4
    assert [c.value().tolist() for c in local] == [[3.0, 3.0]] * N
    assert v.numpy().tolist() == [3.0, 3.0]


def test_placing_a_numpy_array_while_a_program_is_traced() -> None:
    # Inside a trace (a compiled step across processes places host constants) the
    # placed value is a tracer with no buffer to compare with the host array's.
    from polydist_jax._collectives import host_copy

    device = jax.devices()[0]
    out = jax.jit(lambda: host_copy(np.full(3, 1.5, np.float32), device) * 2)()
    assert out.tolist() == [3.0, 3.0, 3.0]


@pytest.mark.parametrize("devices", [["/cpu:0"], ["/cpu:0", "/cpu:1"]])
def test_a_variable_written_every_step_keeps_its_deferred_source_until_a_read(
    devices: list[str],
) -> None:
    """Each step's new copies replace those of last step's source in place while none was
    read (`InputCache.renew_deferred`); once a copy is read, the next step defers a new
    source, so the array the caller read keeps its value."""
    strategy = pd.MirroredStrategy(devices, backend=JaxBackend())
    with strategy.scope():
        v = pd.Variable(jnp.zeros(3, jnp.float32))

    def step() -> None:
        v.assign_add(jnp.ones(3, jnp.float32))

    def source() -> Any:
        sources = {id(c.__dict__.get("_pending")) for c in v.values}
        assert len(sources) == 1
        return v.values[0].__dict__.get("_pending")

    for _ in range(4):  # the first calls trace and record the plan
        strategy.run(step)
    first = source()
    assert first is not None
    strategy.run(step)
    strategy.run(step)
    assert source() is first  # renewed in place: no copy was read
    held = v.values[-1].read_value()
    np.testing.assert_array_equal(np.asarray(held), np.full(3, 6.0, np.float32))
    strategy.run(step)
    assert source() is not first  # a copy was read: a new source
    np.testing.assert_array_equal(np.asarray(held), np.full(3, 6.0, np.float32))
    for c in v.values:
        np.testing.assert_array_equal(np.asarray(c.read_value()), np.full(3, 7.0, np.float32))
