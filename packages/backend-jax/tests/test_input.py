"""Distributed input on jax: one sharded global array per step, fed to the compiled run as is."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from jax_testutil import assert_results_match

import polydist as pd
from polydist.data import (
    AutoShardPolicy,
    Dataset,
    InputContext,
    InputOptions,
    Options,
    TensorSpec,
)
from polydist_jax import AXIS, JaxBackend, _input, _spmd
from polydist_sim import SimBackend

N = 8
FEATURES = 3


def rows(start: int, count: int) -> np.ndarray:
    """``count`` examples of FEATURES integer-valued float32s (sums are exact in any order)."""
    base = np.arange(start, start + count, dtype=np.float32)
    return np.stack([base, -base, base % 5], axis=1)


def global_batches(sizes: list[int]) -> list[dict[str, np.ndarray]]:
    out, start = [], 0
    for size in sizes:
        out.append({"x": rows(start, size), "y": np.arange(start, start + size, dtype=np.int32)})
        start += size
    return out


class Counting:
    """A re-iterable plain source that counts the batches its latest iteration gave."""

    def __init__(self, batches: list[dict[str, np.ndarray]]) -> None:
        self.batches = batches
        self.pulled = 0

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        # Each iter() is a new pass (distributing itself reads none).
        self.pulled = 0
        for batch in self.batches:
            self.pulled += 1
            yield batch


def off_dataset(sizes: list[int]) -> Dataset:
    """The batches as a Dataset without auto-sharding (split by RebatchDatasetV2)."""
    x = np.concatenate([b["x"] for b in global_batches(sizes)])
    dataset = Dataset.from_tensor_slices(x).batch(sizes[0])
    options = Options()
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.OFF
    return dataset.with_options(options)


def from_function(strategy: pd.Strategy, per_replica_batch: int, steps: int) -> Any:
    def dataset_fn(ctx: InputContext) -> Dataset:
        examples = N * per_replica_batch * steps
        return (
            Dataset.from_tensor_slices(rows(0, examples))
            .shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
            .batch(per_replica_batch)
        )

    return strategy.distribute_datasets_from_function(dataset_fn)


def step(batch: dict[str, Any]) -> Any:
    ctx = pd.get_replica_context()
    assert ctx is not None
    x = batch["x"]
    return x * 2.0, ctx.all_reduce("SUM", x.sum()), batch["y"]


def all_reduce_sum(x: Any) -> Any:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return ctx.all_reduce("SUM", x)


def record_run_inputs(backend: JaxBackend, monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """Every compiled call's input arrays, as the program receives them."""
    calls: list[list[Any]] = []
    ordered = _spmd._ordered  # how both the prepared and the direct path list them

    def spy(*args: Any) -> Any:
        inputs = ordered(*args)
        calls.append(list(inputs))
        return inputs

    monkeypatch.setattr(_spmd, "_ordered", spy)
    return calls


def assert_on_replica_mesh(array: Any, strategy: pd.Strategy) -> None:
    sharding = array.sharding
    assert isinstance(sharding, NamedSharding)
    assert sharding.spec == PartitionSpec(AXIS)
    assert sharding.mesh.axis_names == (AXIS,)
    want = [d.id for d in jax.devices()[:N]]  # worker_devices order: CPU:0..7
    assert [d.id for d in sharding.mesh.devices.flat] == want
    assert strategy.extended.worker_devices == tuple(
        f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(N)
    )


# --------------------------------------------------------------------------- one global array


@pytest.mark.parametrize("source", ["plain", "dataset", "from_function"])
def test_each_step_is_one_array_sharded_over_the_replica_mesh(
    source: str, jax_backend: JaxBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    strategy = pd.MirroredStrategy(N, backend=jax_backend)
    if source == "plain":  # legacy split of each global batch: one whole-batch transfer
        dist = strategy.experimental_distribute_dataset(global_batches([16, 16]))
    elif source == "dataset":  # RebatchDatasetV2: per-replica batches, one batched transfer
        dist = strategy.experimental_distribute_dataset(off_dataset([16, 16]))
    else:
        dist = from_function(strategy, 2, 2)
    calls = record_run_inputs(jax_backend, monkeypatch)
    for k, value in enumerate(dist):
        x = value["x"] if isinstance(value, dict) else value
        # What users see is unchanged: each replica's own 2 rows, committed to its device.
        assert len(x.values) == N
        for r, component in enumerate(x.values):
            assert isinstance(component, jax.Array) and component.committed
            assert component.devices() == {jax.devices()[r]}
            np.testing.assert_array_equal(np.asarray(component), rows(16 * k + 2 * r, 2))
        array = _input.global_array(x)
        assert array is not None and array.shape == (16, FEATURES)
        assert_on_replica_mesh(array, strategy)
        # The global array's blocks are the components' own buffers (no copy).
        for r, shard in enumerate(sorted(array.addressable_shards, key=lambda s: s.device.id)):
            assert shard.data.unsafe_buffer_pointer() == x.values[r].unsafe_buffer_pointer()
        strategy.run(all_reduce_sum, args=(x,))
        # The compiled program received that very array: no reassembly, no resharding.
        assert any(inp is array for inp in calls[-1])
    assert len(calls) == 2
    assert jax_backend.compile_count == 1


def test_equal_steps_compile_once_and_match_the_sim(
    jax_backend: JaxBackend, sim_backend: SimBackend
) -> None:
    sizes = [16] * 5
    jax_strategy = pd.MirroredStrategy(N, backend=jax_backend)
    sim_strategy = pd.MirroredStrategy(N, backend=sim_backend)
    got = [
        jax_strategy.run(step, args=(v,))
        for v in jax_strategy.experimental_distribute_dataset(global_batches(sizes))
    ]
    want = [
        sim_strategy.run(step, args=(v,))
        for v in sim_strategy.experimental_distribute_dataset(global_batches(sizes))
    ]
    assert len(got) == len(want) == 5
    assert_results_match(got, want)
    assert jax_backend.compile_count == 1
    assert jax_backend.cache_size(jax_strategy) == 1
    assert jax_backend.eager_fallback_count == 0


def test_partial_final_batch_keeps_per_replica_arrays_and_matches_the_sim(
    jax_backend: JaxBackend, sim_backend: SimBackend
) -> None:
    sizes = [16, 16, 13]  # the last batch splits 2,2,2,2,2,2,1,0 (legacy ceil(13/8))
    jax_strategy = pd.MirroredStrategy(N, backend=jax_backend)
    sim_strategy = pd.MirroredStrategy(N, backend=sim_backend)
    values = list(jax_strategy.experimental_distribute_dataset(global_batches(sizes)))
    last = values[-1]["x"]
    assert [c.shape[0] for c in last.values] == [2, 2, 2, 2, 2, 2, 1, 0]
    assert _input.global_array(last) is None  # no single array has these blocks
    assert all(_input.global_array(v["x"]) is not None for v in values[:-1])
    for r, component in enumerate(last.values):
        assert component.devices() == {jax.devices()[r]}
    got = [jax_strategy.run(step, args=(v,)) for v in values]
    want = [
        sim_strategy.run(step, args=(v,))
        for v in sim_strategy.experimental_distribute_dataset(global_batches(sizes))
    ]
    assert_results_match(got, want)
    assert jax_backend.compile_count == 1  # the uneven step ran eagerly
    assert jax_backend.eager_fallback_count == 1


def test_numpy_values_from_function_share_the_dataset_program(
    jax_backend: JaxBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    strategy = pd.MirroredStrategy(N, backend=jax_backend)
    calls = record_run_inputs(jax_backend, monkeypatch)
    (from_dataset,) = strategy.experimental_distribute_dataset([rows(0, 16)])
    from_values = strategy.experimental_distribute_values_from_function(
        lambda ctx: rows(2 * ctx.replica_id_in_sync_group, 2)
    )
    # As in TF, value_fn's NumPy values stay NumPy in the PerReplica.
    assert all(isinstance(c, np.ndarray) for c in from_values.values)
    assert _input.global_array(from_values) is None
    a = strategy.run(all_reduce_sum, args=(from_dataset,))
    b = strategy.run(all_reduce_sum, args=(from_values,))
    # At run, the NumPy components go over as one global array on the replica mesh.
    (joined,) = [i for i in calls[-1] if isinstance(i, jax.Array)]
    assert joined.shape == (16, FEATURES)
    assert_on_replica_mesh(joined, strategy)
    for r in range(N):
        np.testing.assert_array_equal(np.asarray(a.values[r]), np.asarray(b.values[r]))
    assert jax_backend.compile_count == 1


def test_a_steps_global_array_is_released_with_its_values(jax_backend: JaxBackend) -> None:
    strategy = pd.MirroredStrategy(N, backend=jax_backend)
    (value,) = strategy.experimental_distribute_dataset(global_batches([16]))
    array = _input.global_array(value["x"])
    assert array is not None
    # The registry holds the global array strongly, so it dies only with the entry.
    dead = weakref.ref(array)
    del array
    gc.collect()
    assert dead() is not None  # the step's values are alive: so is its entry
    del value
    gc.collect()
    assert dead() is None


def test_host_placement_and_eager_backends_place_per_replica(sim_backend: SimBackend) -> None:
    del sim_backend
    batches = global_batches([16, 16])
    off = InputOptions(experimental_fetch_to_device=False)
    eager = pd.MirroredStrategy(N, backend=JaxBackend(jit=False))
    compiled = pd.MirroredStrategy(N, backend=JaxBackend())
    for strategy, options in ((compiled, off), (eager, None)):
        for k, value in enumerate(strategy.experimental_distribute_dataset(batches, options)):
            x = value["x"]
            assert _input.global_array(x) is None
            for r, component in enumerate(x.values):
                want = 0 if options is off else r  # on the host: this machine's CPU:0
                assert component.devices() == {jax.devices()[want]}
                np.testing.assert_array_equal(np.asarray(component), rows(16 * k + 2 * r, 2))


# --------------------------------------------------------------------------- prefetch


@pytest.mark.parametrize("buffer_size", [0, 1, 3])
def test_next_steps_are_transferred_before_they_are_asked_for(
    buffer_size: int, jax_backend: JaxBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    strategy = pd.MirroredStrategy(N, backend=jax_backend)
    source = Counting(global_batches([16] * 6))
    transferred: list[Any] = []  # the global array of each step's "x", in order
    place = _input.place_per_replica

    def spy(*args: Any) -> list[Any]:
        components = place(*args)
        array = _input.joined(components, None)
        if array is not None and array[0].shape[1:] == (FEATURES,):
            transferred.append(array[0])
        return components

    monkeypatch.setattr(_input, "place_per_replica", spy)
    options = InputOptions(
        experimental_fetch_to_device=True, experimental_per_replica_buffer_size=buffer_size
    )
    dist = strategy.experimental_distribute_dataset(source, options)
    transferred.clear()
    iterator = iter(dist)
    for k in range(6):
        value = next(iterator)
        ahead = min(k + 1 + buffer_size, 6)
        # Steps k+1 .. k+buffer_size were read and their transfers issued already.
        assert source.pulled == ahead
        assert len(transferred) == ahead
        assert transferred[k] is _input.global_array(value["x"])
        for later in transferred[k + 1 :]:
            assert_on_replica_mesh(later, strategy)
    with pytest.raises(StopIteration):
        next(iterator)


def test_results_are_the_same_with_and_without_prefetch(jax_backend: JaxBackend) -> None:
    strategy = pd.MirroredStrategy(N, backend=jax_backend)
    sizes = [16, 16, 16, 13]
    results: dict[int, list[Any]] = {}
    for buffer_size in (0, 1, 4):
        options = InputOptions(experimental_per_replica_buffer_size=buffer_size)
        dist = strategy.experimental_distribute_dataset(global_batches(sizes), options)
        results[buffer_size] = [strategy.run(step, args=(v,)) for v in dist]
    assert len(results[0]) == len(sizes)
    for buffer_size in (1, 4):
        assert_results_match(results[buffer_size], results[0])
    assert jax_backend.compile_count == 1


def test_jnp_values_are_transferred_to_their_replicas(jax_backend: JaxBackend) -> None:
    # A source of jax arrays (e.g. made on device 0) is moved like place() moves it.
    strategy = pd.MirroredStrategy(N, backend=jax_backend)
    batch = {"x": jnp.asarray(rows(0, 16))}
    (value,) = strategy.experimental_distribute_dataset([batch])
    array = _input.global_array(value["x"])
    assert array is not None
    assert_on_replica_mesh(array, strategy)
    for r, component in enumerate(value["x"].values):
        assert component.devices() == {jax.devices()[r]} and component.committed
        np.testing.assert_array_equal(np.asarray(component), rows(2 * r, 2))


# ------------------------------------------------------------------------- element_spec


def test_element_spec_has_the_dtypes_of_the_values_without_x64(jax_backend: JaxBackend) -> None:
    # JAX's default (x64 off): device_put makes int64 int32 and float64 float32,
    # and the spec says so, as a spec from tf.data describes its tensors.
    strategy = pd.MirroredStrategy(2, backend=jax_backend)
    data = {
        "i": np.arange(8),
        "f": np.arange(8, dtype=np.float64),
        "h": np.arange(8, dtype=np.float16),
        "b": np.arange(8) % 2 == 0,
    }
    dist = strategy.experimental_distribute_dataset(Dataset.from_tensor_slices(data).batch(4))
    value = next(iter(dist))
    assert [value[k].values[0].dtype for k in "ifhb"] == [
        np.int32,
        np.float32,
        np.float16,
        np.bool_,
    ]
    expected = {
        "i": np.int32,
        "f": np.float32,
        "h": np.float16,
        "b": np.bool_,
    }
    assert {k: spec.value_specs for k, spec in dist.element_spec.items()} == {
        k: (TensorSpec((None,), dtype),) * 2 for k, dtype in expected.items()
    }
    assert dist.element_spec["i"].is_compatible_with(value["i"])
    assert dist.element_spec["f"].is_compatible_with(value["f"])
    from_fn = strategy.distribute_datasets_from_function(
        lambda _: Dataset.range(4).batch(2, drop_remainder=True)
    )
    # Round-robin over 2 replicas may pad: the batch dimension is None (input.md).
    assert from_fn.element_spec.value_specs == (TensorSpec((None,), np.int32),) * 2
    assert [c.tolist() for c in next(iter(from_fn)).values] == [[0, 1], [2, 3]]
    single = pd.MirroredStrategy(1, backend=jax_backend).experimental_distribute_dataset(
        Dataset.range(4).batch(2)
    )
    assert single.element_spec == TensorSpec((None,), np.int32)


def test_element_spec_keeps_64_bit_dtypes_with_x64() -> None:
    with jax.enable_x64(True):
        strategy = pd.MirroredStrategy(2, backend=JaxBackend())
        dist = strategy.experimental_distribute_dataset(Dataset.range(8).batch(4))
        assert dist.element_spec.value_specs[0].dtype == np.int64
        assert next(iter(dist)).values[0].dtype == np.int64
