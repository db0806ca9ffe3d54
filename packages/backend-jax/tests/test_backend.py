"""The backend itself: registration, capabilities, devices, placement, the other strategies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polydist as pd
from polydist.backend import Backend, get_backend
from polydist_jax import JaxBackend

CPU = "/job:localhost/replica:0/task:0/device:CPU:{}"


def test_satisfies_the_backend_protocol() -> None:
    backend: Backend = JaxBackend()  # checked statically by mypy
    assert isinstance(backend, Backend)


def test_registered_under_jax() -> None:
    backend = get_backend("jax")
    assert isinstance(backend, JaxBackend)
    assert get_backend("jax") is backend
    assert pd.MirroredStrategy(backend="jax").extended.backend is backend


def test_env_var_selects_jax(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLYDIST_BACKEND", "jax")
    assert pd.MirroredStrategy(2).extended.backend.name == "jax"


def test_capabilities_on_cpu() -> None:
    caps = JaxBackend().capabilities
    assert caps.execution_model == "spmd"
    assert caps.reduction_orders == ("sequential",)
    assert caps.autodiff
    assert not caps.float64  # JAX's default: x64 off
    assert caps.tpu  # TPUStrategy: the CPU devices stand in for TPU cores (test_tpu.py)
    assert not caps.has("simulated_clusters")
    assert JaxBackend(jit=False).capabilities.execution_model == "eager"


def test_float64_capability_follows_x64() -> None:
    with jax.enable_x64(True):
        assert JaxBackend().capabilities.float64


class TestDevices:
    def test_default_uses_every_device_of_the_default_platform(self) -> None:
        strategy = pd.MirroredStrategy(backend=JaxBackend())
        assert strategy.num_replicas_in_sync == 8
        assert strategy.extended.worker_devices == tuple(CPU.format(i) for i in range(8))

    def test_count_takes_the_first_n(self) -> None:
        strategy = pd.MirroredStrategy(3, backend=JaxBackend())
        assert strategy.extended.worker_devices == tuple(CPU.format(i) for i in range(3))

    def test_too_many_replicas_says_how_to_get_more(self) -> None:
        with pytest.raises(ValueError, match=r"needs 9 devices .* 8 CPU .*xla_force_host"):
            pd.MirroredStrategy(9, backend=JaxBackend())

    def test_too_few_accelerators_says_both_ways_out(self) -> None:
        from polydist_jax._devices import out_of_range_message

        assert out_of_range_message(4, "GPU", 1) == (
            "MirroredStrategy(4) needs 4 devices but JAX's default platform has 1 GPU "
            "device(s). Ask for at most 1 replica(s), or run on CPU devices with "
            "JAX_PLATFORMS=cpu. On CPU, fake devices come from "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N (or "
            "jax.config.update('jax_num_cpu_devices', N)), set before JAX first runs."
        )

    def test_tf_spellings(self) -> None:
        strategy = pd.MirroredStrategy(["/cpu:5", "CPU:2"], backend=JaxBackend())
        assert strategy.extended.worker_devices == (CPU.format(5), CPU.format(2))

    @pytest.mark.parametrize(
        ("devices", "message"),
        [
            (["/gpu:0"], "JAX has no GPU devices"),
            (["/cpu:8"], "out of range: JAX has 8 CPU"),
            (["/job:worker/task:1/device:CPU:0"], "another worker"),
            (["/device:XLA:0"], "maps CPU, GPU and TPU"),
        ],
    )
    def test_bad_devices(self, devices: list[str], message: str) -> None:
        with pytest.raises(ValueError, match=message):
            pd.MirroredStrategy(devices, backend=JaxBackend())

    def test_list_devices(self) -> None:
        assert JaxBackend().list_devices() == tuple(CPU.format(i) for i in range(8))


class TestPlacement:
    def test_place_puts_on_the_device(self) -> None:
        backend = JaxBackend()
        x = backend.place(np.arange(3, dtype=np.int32), CPU.format(4))
        assert x.devices() == {jax.devices()[4]}
        assert backend.place(x, CPU.format(4)) is x  # no copy when already there

    def test_place_passes_tracers_through(self) -> None:
        backend = JaxBackend()
        seen = []

        @jax.jit
        def f(x: jax.Array) -> jax.Array:
            placed = backend.place(x, CPU.format(3))
            seen.append(placed is x)
            return x

        f(jnp.ones(2))
        assert seen == [True]

    def test_device_scope(self) -> None:
        backend = JaxBackend()
        with backend.device_scope(CPU.format(6)):
            x = jnp.ones(2)
        assert x.devices() == {jax.devices()[6]}

    def test_namespace_and_to_numpy(self) -> None:
        backend = JaxBackend()
        xp = backend.array_namespace()
        assert xp.ones is jnp.ones and xp.float32 is jnp.float32  # jax.numpy, plus:
        assert callable(xp.exact_divide)
        out = backend.to_numpy(jnp.arange(3))
        assert isinstance(out, np.ndarray)
        np.testing.assert_array_equal(out, [0, 1, 2])


class TestOneDeviceStrategy:
    def test_runs_on_its_device(self) -> None:
        strategy = pd.OneDeviceStrategy("/cpu:3", backend=JaxBackend())
        assert strategy.num_replicas_in_sync == 1

        def step(x: jax.Array) -> tuple[jax.Array, jax.Array]:
            ctx = pd.get_replica_context()
            assert ctx is not None
            return ctx.all_reduce("SUM", x * 2), ctx.replica_id_in_sync_group

        total, rid = strategy.run(step, args=(jnp.arange(4.0),))
        np.testing.assert_array_equal(total, [0.0, 2.0, 4.0, 6.0])
        assert rid.devices() == {jax.devices()[3]}
        assert int(rid) == 0
        assert float(strategy.reduce("SUM", total, axis=0)) == 12.0
        assert float(strategy.reduce("MEAN", total, axis=None)[1]) == 2.0

    def test_distribute_values_from_function_returns_the_value(self) -> None:
        # TF: value_fn(ValueContext()) itself, made under the device's scope.
        strategy = pd.OneDeviceStrategy("/cpu:3", backend=JaxBackend())
        value = strategy.experimental_distribute_values_from_function(
            lambda ctx: jnp.arange(3.0) + ctx.replica_id_in_sync_group + ctx.num_replicas_in_sync
        )
        assert isinstance(value, jax.Array) and value.devices() == {jax.devices()[3]}
        out = strategy.run(lambda x: x * 2, args=(value,))
        np.testing.assert_array_equal(out, [2.0, 4.0, 6.0])


class TestDefaultStrategy:
    def test_default_strategy_with_jax_arrays(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("POLYDIST_BACKEND", "jax")
        strategy = pd.get_strategy()
        assert strategy.num_replicas_in_sync == 1

        def step(x: jax.Array) -> jax.Array:
            ctx = pd.get_replica_context()
            assert ctx is not None
            return ctx.all_reduce("SUM", x)  # type: ignore[no-any-return]

        out = strategy.run(step, (jnp.ones(3),))
        np.testing.assert_array_equal(out, [1.0, 1.0, 1.0])
        assert float(strategy.reduce("MEAN", jnp.arange(4.0), axis=0)) == 1.5
        values = strategy.experimental_distribute_values_from_function(lambda ctx: jnp.ones(2))
        assert strategy.experimental_local_results(values)[0].shape == (2,)
