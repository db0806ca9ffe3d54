"""TPUStrategy on simulated slices (reference "TPU specifics")."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist._distributed.tpu_strategy import (
    LogicalDeviceAnnotation,
    TPUHardwareFeature,
    TPUReplicaContext,
)
from polydist.cluster_resolver import TPUClusterResolver, set_accelerator_device_lister
from polydist.errors import InvalidArgumentError
from polydist.tpu import DeviceAssignment
from polydist_sim import SimBackend


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("TPU_NAME", "KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS", "POLYDIST_LOCAL_TPU"):
        monkeypatch.delenv(name, raising=False)
    # A multi-host slice installs the sim's device lister: put the old one back.
    previous = set_accelerator_device_lister(None)
    set_accelerator_device_lister(previous)
    yield
    set_accelerator_device_lister(previous)


def tpu(name: str, **kwargs: Any) -> pd.TPUStrategy:
    return pd.TPUStrategy(TPUClusterResolver(tpu=name), **kwargs)


def assignment(name: str, num_replicas: int, shape: list[int] | None = None) -> DeviceAssignment:
    topology = TPUClusterResolver(tpu=name).get_tpu_system_metadata().topology
    assert topology is not None
    return DeviceAssignment.build(topology, computation_shape=shape, num_replicas=num_replicas)


def ctx() -> pd.ReplicaContext:
    context = pd.get_replica_context()
    assert context is not None
    return context


def replica_id() -> int:
    return int(ctx().replica_id_in_sync_group)


# -- slices ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "replicas", "hosts", "per_host"),
    [
        ("v2-8", 8, 1, 8),
        ("v3-8", 8, 1, 8),
        ("v3-32", 32, 4, 8),
        ("v4-8", 4, 1, 4),
        ("v4-32", 16, 4, 4),
        ("v5e-8", 8, 1, 8),
        ("v5e-16", 16, 4, 4),
        ("v5litepod-16", 16, 4, 4),
    ],
)
def test_simulated_slices(name: str, replicas: int, hosts: int, per_host: int) -> None:
    strategy = tpu(name)
    extended = strategy.extended
    assert strategy.num_replicas_in_sync == replicas
    assert (extended.num_hosts, extended.num_replicas_per_host) == (hosts, per_host)
    # Host by host, device by device; every host's replicas run in this process.
    assert extended.worker_devices == tuple(
        f"/job:worker/replica:0/task:{h}/device:TPU:{d}"
        for h in range(hosts)
        for d in range(per_host)
    )
    out = strategy.run(lambda: ctx().all_reduce("SUM", np.float32(1)))
    assert [float(v) for v in strategy.experimental_local_results(out)] == [replicas] * replicas
    assert float(strategy.reduce("SUM", strategy.run(replica_id), axis=None)) == sum(
        range(replicas)
    )


def test_default_resolver_is_the_local_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    strategy = pd.TPUStrategy()
    assert strategy.num_replicas_in_sync == 8
    assert strategy.extended.worker_devices[0] == "/job:localhost/replica:0/task:0/device:TPU:0"
    assert strategy.cluster_resolver.master() == ""
    assert strategy.extended.get_host_cpu_device(0) == "/replica:0/task:0/device:CPU:0"
    monkeypatch.setenv("POLYDIST_LOCAL_TPU", "v4-8")
    assert pd.TPUStrategy().num_replicas_in_sync == 4
    monkeypatch.setenv("TPU_NAME", "v5e-16")
    named = pd.TPUStrategy()
    assert named.num_replicas_in_sync == 16
    assert named.extended.get_host_cpu_device(2) == "/job:worker/task:2/device:CPU:0"


def test_cluster_resolver_and_properties() -> None:
    resolver = TPUClusterResolver(tpu="v4-32")
    strategy = pd.TPUStrategy(resolver)
    assert strategy.cluster_resolver is resolver
    assert resolver.num_accelerators() == {"TPU": 4}
    extended = strategy.extended
    assert extended.experimental_require_static_shapes
    assert extended.should_checkpoint and extended.should_save_summary
    assert not extended.experimental_between_graph
    assert extended.parameter_devices == extended.worker_devices
    feature = extended.tpu_hardware_feature
    assert isinstance(feature, TPUHardwareFeature)
    assert feature.embedding_feature is TPUHardwareFeature.EmbeddingFeature.V1
    assert feature.num_embedding_devices_per_chip == 4
    assert tpu("v5e-8").extended.tpu_hardware_feature.embedding_feature is (
        TPUHardwareFeature.EmbeddingFeature.UNSUPPORTED
    )
    assert "TPUStrategy with 16 replica(s)" in repr(strategy)


def test_run_is_eager_in_a_tpu_replica_context() -> None:
    strategy = tpu("v3-8")
    seen = strategy.run(lambda: type(pd.get_replica_context()))
    assert seen is TPUReplicaContext
    out = strategy.run(lambda x: x * 2, args=(strategy.run(replica_id),))
    assert strategy.experimental_local_results(out) == tuple(2 * r for r in range(8))


# -- device assignment ---------------------------------------------------------------------------


def test_device_assignment_order_maps_to_replicas() -> None:
    da = assignment("v4-32", 16)
    strategy = tpu("v4-32", experimental_device_assignment=da)
    expected = tuple(
        f"/job:worker/replica:0{da.tpu_device(replica=r, job='worker')[len('/job:worker') :]}"
        for r in range(16)
    )
    assert strategy.extended.worker_devices == expected
    # The ring order interleaves hosts, so this is not the default host-by-host order.
    assert expected != tpu("v4-32").extended.worker_devices
    devices = strategy.run(lambda: ctx().devices[0])
    assert strategy.experimental_local_results(devices) == expected
    # TF 2.0's keyword gives the same strategy.
    same = pd.TPUStrategy(TPUClusterResolver(tpu="v4-32"), device_assignment=da)
    assert same.extended.worker_devices == expected


def test_device_assignment_with_logical_devices() -> None:
    da = assignment("v3-8", 4, [1, 1, 1, 2])
    strategy = tpu("v3-8", experimental_device_assignment=da)
    extended = strategy.extended
    assert strategy.num_replicas_in_sync == 4
    assert (extended.num_hosts, extended.num_replicas_per_host) == (1, 4)
    assert extended._num_logical_devices_per_replica == 2
    first = extended.worker_devices
    assert first == tuple(
        f"/job:worker/replica:0/task:0/device:TPU:{da.tpu_ordinal(r, 0)}" for r in range(4)
    )
    with extended.experimental_logical_device(1):
        assert extended.worker_devices == tuple(
            f"/job:worker/replica:0/task:0/device:TPU:{da.tpu_ordinal(r, 1)}" for r in range(4)
        )
    assert extended.worker_devices == first
    with (
        pytest.raises(ValueError, match=r"`logical_device_id` not in range \(was 2"),
        extended.experimental_logical_device(2),
    ):
        pass

    def in_replica() -> str:
        ctx = pd.get_replica_context()
        assert isinstance(ctx, TPUReplicaContext)
        with ctx.experimental_logical_device(1):
            return strategy.extended.worker_devices[0]

    assert strategy.run(in_replica) == "/job:worker/replica:0/task:0/device:TPU:1"
    multi_host = tpu("v3-32", experimental_device_assignment=assignment("v3-32", 4, [2, 2, 1, 2]))
    assert (multi_host.extended.num_hosts, multi_host.extended.num_replicas_per_host) == (4, 1)


def test_device_assignment_errors() -> None:
    da = assignment("v3-8", 8)
    with pytest.raises(ValueError, match="Pass the device assignment once"):
        pd.TPUStrategy(TPUClusterResolver(tpu="v3-8"), da, device_assignment=da)
    with pytest.raises(ValueError, match="which slice 'v3-8' does not have"):
        tpu("v3-8", experimental_device_assignment=assignment("v3-32", 32))
    with pytest.raises(TypeError, match="device_assignment must be a polydist.tpu"):
        tpu("v3-8", experimental_device_assignment=[[0, 0, 0, 0]])
    with pytest.raises(TypeError, match="tpu_cluster_resolver must be a"):
        pd.TPUStrategy("v3-8")  # type: ignore[arg-type]


def test_backend_without_tpu_support() -> None:
    backend = SimBackend()
    backend.capabilities = dataclasses.replace(backend.capabilities, tpu=False)
    with pytest.raises(ValueError, match="declares Capabilities.tpu"):
        pd.TPUStrategy(TPUClusterResolver(tpu="v3-8"), backend=backend)


# -- model-parallel annotations ----------------------------------------------------------------


def test_assign_to_logical_device() -> None:
    strategy = tpu("v3-8", experimental_device_assignment=assignment("v3-8", 4, [1, 1, 1, 2]))
    x = np.ones((4, 6), np.float32)
    assert strategy.experimental_assign_to_logical_device(x, 1) is x
    assert strategy.extended.logical_device_annotation(x) == LogicalDeviceAnnotation(
        "maximal", logical_device_id=1
    )
    for bad in (2, -1):
        with pytest.raises(ValueError, match="must be lower then total number of logical devices"):
            strategy.experimental_assign_to_logical_device(x, bad)
    spmd = tpu(
        "v3-8",
        experimental_device_assignment=assignment("v3-8", 4, [1, 1, 1, 2]),
        experimental_spmd_xla_partitioning=True,
    )
    with pytest.raises(ValueError, match="Cannot assign a tensor to a logical device in SPMD"):
        spmd.experimental_assign_to_logical_device(x, 0)
    # Without model parallelism there is one logical device, 0.
    with pytest.raises(ValueError, match="only total of 1 logical devices"):
        tpu("v3-8").experimental_assign_to_logical_device(x, 1)


def test_split_to_logical_devices() -> None:
    strategy = tpu("v3-32", experimental_device_assignment=assignment("v3-32", 4, [2, 2, 1, 2]))
    x = np.ones((4, 6, 8), np.float32)
    assert strategy.experimental_split_to_logical_devices(x, [2, 2, 2]) is x
    annotation = strategy.extended.logical_device_annotation(x)
    assert annotation is not None
    assert (annotation.kind, annotation.partition_dimensions) == ("tiled", (2, 2, 2))
    assert annotation.tile_assignment is not None
    np.testing.assert_array_equal(annotation.tile_assignment, np.arange(8).reshape(2, 2, 2))
    with pytest.raises(ValueError, match=r"Length of `partition_dimensions` must equal .* \(3\)"):
        strategy.experimental_split_to_logical_devices(x, [2, 4])
    with pytest.raises(ValueError, match=r"`partition_dimensions\[1\]` must be divisible .* \(4\)"):
        strategy.experimental_split_to_logical_devices(x, [1, 4, 2])
    with pytest.raises(ValueError, match=r"number of logical devices \(=8\).*product is 4"):
        strategy.experimental_split_to_logical_devices(x, [1, 2, 2])
    # SPMD mode allows splitting.
    spmd = tpu(
        "v3-32",
        experimental_device_assignment=assignment("v3-32", 4, [2, 2, 1, 2]),
        experimental_spmd_xla_partitioning=True,
    )
    assert spmd.experimental_split_to_logical_devices(x, [1, 1, 8]) is x


def test_replicate_to_logical_devices_and_side_table() -> None:
    strategy = tpu("v3-8")
    x = np.arange(3.0)
    assert strategy.experimental_replicate_to_logical_devices(x) is x
    assert strategy.extended.logical_device_annotation(x) == LogicalDeviceAnnotation("replicated")
    assert strategy.extended.logical_device_annotation(np.arange(3.0)) is None
    # Scalars cannot be tracked, but the call still returns them.
    assert strategy.experimental_replicate_to_logical_devices(1.5) == 1.5
    assert strategy.extended.logical_device_annotation(1.5) is None
    # Annotating inside a replica works too.
    out = strategy.run(lambda: strategy.experimental_replicate_to_logical_devices(np.ones(2)))
    assert strategy.extended.logical_device_annotation(out.values[3]) is not None
    assert copy.deepcopy(strategy).extended.logical_device_annotation(x) is None


# -- TPU shape rules -------------------------------------------------------------------------------


def test_gather_needs_the_same_shape() -> None:
    strategy = tpu("v3-8")
    uneven = strategy.run(lambda: np.ones(replica_id() % 2 + 1, np.float32))
    with pytest.raises(InvalidArgumentError, match="TPUStrategy.gather needs the same shape"):
        strategy.gather(uneven, axis=0)
    even = strategy.run(lambda: np.full((2, 3), replica_id(), np.float32))
    assert strategy.gather(even, axis=1).shape == (2, 24)
    # Other strategies allow uneven sizes along the axis.
    mirrored = pd.MirroredStrategy(2)
    assert mirrored.gather(mirrored.run(lambda: np.ones(replica_id() + 1)), axis=0).shape == (3,)


def test_all_gather_needs_the_same_shape() -> None:
    strategy = tpu("v4-32")

    def uneven() -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return ctx.all_gather(np.ones(1 + (replica_id() == 5), np.float32), axis=0)

    with pytest.raises(InvalidArgumentError, match="TPU all_gather needs the same shape"):
        strategy.run(uneven)

    def even() -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return ctx.all_gather({"a": np.full((1, 2), replica_id())}, axis=0)

    out = strategy.run(even)
    np.testing.assert_array_equal(out["a"].values[7][:, 0], np.arange(16))


def test_experimental_make_numpy_dataset_is_a_tf2_tpu_strategy_member() -> None:
    # TF 2's TPUStrategy documents it (seed 000_37401e2c067d27de), with the signature
    # experimental_make_numpy_dataset(numpy_input): TF's own example, distributed.
    strategy = tpu("v3-8")
    dataset = strategy.experimental_make_numpy_dataset(np.arange(16, dtype=np.float32))
    assert [float(x) for x in dataset][:3] == [0.0, 1.0, 2.0]
    dist = strategy.experimental_distribute_dataset(dataset.batch(16))
    batch = next(iter(dist))
    parts = strategy.experimental_local_results(batch)
    assert len(parts) == 8
    assert [p.tolist() for p in map(np.asarray, parts)] == [
        [2.0 * r, 2.0 * r + 1] for r in range(8)
    ]
    # A nest of arrays; a list of arrays is stacked (tf.data's rule).
    pairs = strategy.experimental_make_numpy_dataset({"x": [np.arange(3), np.arange(3) * 10]})
    assert [e["x"].tolist() for e in pairs] == [[0, 1, 2], [0, 10, 20]]
    with pytest.raises(RuntimeError, match="cross-replica context"):
        strategy.run(lambda: strategy.experimental_make_numpy_dataset(np.arange(2)))


# -- non-slot variables (TF V1's TPUExtended) -------------------------------------------------


HOST = "/job:worker/replica:0/task:0/device:CPU:0"


@pytest.mark.parametrize(
    "make", [tpu, lambda name: pd.compat.v1.TPUStrategy(TPUClusterResolver(name))]
)
def test_non_slot_devices_are_the_host_and_update_non_slot_runs_once(make: Any) -> None:
    # TF's TPUExtended: non_slot_devices is the host device, and update_non_slot runs
    # fn(*args, **kwargs) once there, returning fn's result (not one per TPU core).
    strategy = make("v3-8")
    ext = strategy.extended
    with strategy.scope():
        w = pd.Variable(np.float32(1.0), name="w")
        beta = pd.Variable(np.float32(2.0), name="beta_power")
    devices = ext.non_slot_devices([w])
    assert devices == HOST
    step = pd.Variable(np.int64(0))  # a plain host counter, like a global step
    calls: list[int] = []

    def finish(n: int, scale: float = 1.0) -> Any:
        calls.append(n)
        step.assign_add(n)
        return beta.assign(beta * np.float32(scale))

    out = ext.update_non_slot(devices, finish, args=(2,), kwargs={"scale": 0.5})
    assert calls == [2] and int(step.numpy()) == 2
    assert isinstance(out, pd.Mirrored) and [float(x) for x in out.values] == [1.0] * 8
    assert [float(c.numpy()) for c in beta.values] == [1.0] * 8  # every copy, once
    assert ext.update_non_slot(devices, lambda: np.float32(3.0)) == 3.0
    ungrouped = ext.update_non_slot(devices, lambda: np.float32(3.0), group=False)
    assert isinstance(ungrouped, tuple) and [float(x) for x in ungrouped] == [3.0]
    with pytest.raises(RuntimeError, match="cross-replica context"):
        strategy.run(lambda: ext.update_non_slot(devices, lambda: 1))
    # A multi-host slice: the first host's CPU.
    assert make("v3-32").extended.non_slot_devices([]) == HOST


def test_run_options() -> None:
    # tf.distribute.RunOptions: TF's namedtuple and defaults; run accepts it everywhere.
    options = pd.RunOptions()
    assert options == (True, False, None)
    assert options.experimental_enable_dynamic_batch_size is True
    assert options.experimental_bucketizing_dynamic_shape is False
    assert options.experimental_xla_options is None
    assert pd.RunOptions(experimental_bucketizing_dynamic_shape=True)[1] is True
    import polydist.compat.v1 as v1

    assert v1.distribute.RunOptions is pd.RunOptions
    s = tpu("v2-8")
    ids = s.run(
        lambda: pd.get_replica_context().replica_id_in_sync_group,
        options=pd.RunOptions(experimental_enable_dynamic_batch_size=False),
    )
    assert [int(i) for i in s.experimental_local_results(ids)] == list(range(8))
    total = s.experimental_run_v2(lambda: np.float32(1), options=options)
    assert float(s.reduce("SUM", s.run(lambda x: x + 0, args=(total,)), axis=None)) == 8.0
