"""TPUStrategy on jax: compiled runs on the 8 fake CPU devices standing in for TPU cores
(a chain of one-core chips). Device coordinates -> topology -> devices is core's
``LocalTPUSystem.from_devices``: packages/core/tests/test_tpu_local_system.py."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest
from jax_testutil import assert_same_bits, distribute, mixed_floats

import polydist as pd
from polydist.cluster_resolver import TPUClusterResolver
from polydist.errors import InvalidArgumentError
from polydist.tpu import DeviceAssignment, LocalTPUSystem, assigned_devices
from polydist_jax import JaxBackend
from polydist_jax._devices import jax_device
from polydist_jax._tpu import _StandIn, local_tpu_system
from polydist_sim import SimBackend

N = 8
TPU = "/job:localhost/replica:0/task:0/device:TPU:{}"
CPU = "/job:localhost/replica:0/task:0/device:CPU:{}"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TPU_NAME", "KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS", "POLYDIST_LOCAL_TPU"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("POLYDIST_BACKEND", raising=False)


def ctx() -> pd.ReplicaContext:
    c = pd.get_replica_context()
    assert c is not None
    return c


# -- the local TPU of the jax backend: CPU devices standing in ----------------------------


def test_cpu_devices_stand_in_as_a_chain_of_one_core_chips() -> None:
    system = JaxBackend().local_tpu_system()
    assert system == LocalTPUSystem(
        mesh_shape=(N, 1, 1, 1),
        device_coordinates=tuple((i, 0, 0, 0) for i in range(N)),
        generation="",
        stand_ins=tuple(CPU.format(i) for i in range(N)),
    )
    assert system.is_stand_in and system is local_tpu_system()
    # TPU:k names the k-th stand-in; out of range says what stands in.
    assert jax_device(TPU.format(5)) == jax.devices()[5]
    with pytest.raises(ValueError, match="8 CPU device.* stand in for TPU:0..7"):
        jax_device(TPU.format(8))


def test_resolver_reports_the_backends_cores() -> None:
    resolver = TPUClusterResolver("local", backend="jax")
    metadata = resolver.get_tpu_system_metadata()
    assert (metadata.num_cores, metadata.num_hosts, metadata.num_of_cores_per_host) == (N, 1, N)
    assert metadata.topology is not None
    assert metadata.topology.mesh_shape.tolist() == [N, 1, 1, 1]
    assert metadata.devices == (
        CPU.format(0),
        *(TPU.format(i) for i in range(N)),
        "/job:localhost/replica:0/task:0/device:TPU_SYSTEM:0",
    )
    assert resolver.num_accelerators() == {"TPU": N}
    assert repr(resolver) == "TPUClusterResolver(tpu='local', backend='jax', cores=8)"
    with pytest.raises(ValueError, match="not a simulated slice"):
        _ = resolver.slice_spec


def mesh_of(resolver: TPUClusterResolver) -> list[int]:
    topology = resolver.get_tpu_system_metadata().topology
    assert topology is not None
    return [int(m) for m in topology.mesh_shape]


def test_strategy_binds_an_unbound_resolver(monkeypatch: pytest.MonkeyPatch) -> None:
    resolver = TPUClusterResolver("local")
    # Nothing chose a backend yet: the sim's local slice (v3-8) answers.
    assert mesh_of(resolver) == [2, 2, 1, 2]
    strategy = pd.TPUStrategy(resolver, backend="jax")
    assert strategy.cluster_resolver is resolver
    assert mesh_of(resolver) == [N, 1, 1, 1]
    # $POLYDIST_BACKEND decides for a resolver asked before any strategy.
    monkeypatch.setenv("POLYDIST_BACKEND", "jax")
    assert TPUClusterResolver("local").num_accelerators() == {"TPU": N}


# -- TPUStrategy runs -----------------------------------------------------------------------


@pytest.fixture
def strategies(jax_backend: JaxBackend) -> tuple[pd.TPUStrategy, pd.TPUStrategy]:
    """(jax on the 8 stand-ins, the sim's local v3-8 with XLA CPU's summation order)."""
    sim = TPUClusterResolver("local", backend=SimBackend("sequential"))
    return (
        pd.TPUStrategy(TPUClusterResolver("local"), backend=jax_backend),
        pd.TPUStrategy(sim, backend=SimBackend("sequential")),
    )


def test_default_strategy_on_jax(jax_backend: JaxBackend) -> None:
    strategy = pd.TPUStrategy(backend=jax_backend)
    extended = strategy.extended
    assert strategy.num_replicas_in_sync == N
    assert extended.worker_devices == tuple(TPU.format(i) for i in range(N))
    assert (extended.num_hosts, extended.num_replicas_per_host) == (1, N)
    assert extended.experimental_require_static_shapes
    assert extended.tpu_hardware_feature.embedding_feature.name == "UNSUPPORTED"
    assert strategy.cluster_resolver.master() == ""


def test_run_compiles_once_and_matches_the_sim_bitwise(
    strategies: tuple[pd.TPUStrategy, pd.TPUStrategy], jax_backend: JaxBackend
) -> None:
    rows = mixed_floats(np.random.default_rng(0), (N, 3, 5))

    def step(x: Any) -> Any:
        c = ctx()
        return (
            type(c).__name__,
            c.all_reduce("SUM", x),
            c.all_reduce("MEAN", x),
            c.all_gather(x, axis=0),
            c.replica_id_in_sync_group,
        )

    results = []
    for strategy in strategies:
        x = distribute(strategy, list(rows))
        for _ in range(3):
            kind, total, mean, gathered, rid = strategy.run(step, args=(x,))
        b = strategy.extended.backend
        local = strategy.experimental_local_results
        results.append(
            [
                *(b.to_numpy(v) for v in local(total)),
                *(b.to_numpy(v) for v in local(mean)),
                *(b.to_numpy(v) for v in local(gathered)),
                *(b.to_numpy(v) for v in local(rid)),
                b.to_numpy(strategy.reduce("SUM", x, axis=None)),
                b.to_numpy(strategy.reduce("MEAN", x, axis=None)),
            ]
        )
        assert kind == "TPUReplicaContext"
    for got, want in zip(*results, strict=True):
        assert_same_bits(got, want)
    # TPUStrategy's wrapper of step is equal across runs: one trace, one cached program.
    assert jax_backend.compile_count == 1
    assert jax_backend.cache_size(strategies[0]) == 1


def test_eager_runs_give_the_same_results() -> None:
    rows = mixed_floats(np.random.default_rng(2), (N, 4))
    results = []
    for backend in (JaxBackend(jit=False), JaxBackend()):
        strategy = pd.TPUStrategy(backend=backend)
        x = distribute(strategy, list(rows))
        out = strategy.run(lambda v: ctx().all_reduce("MEAN", v * 3), args=(x,))
        results.append([np.asarray(v) for v in strategy.experimental_local_results(out)])
    for got, want in zip(*results, strict=True):
        assert_same_bits(got, want)


def test_outputs_live_on_the_stand_in_devices(
    strategies: tuple[pd.TPUStrategy, pd.TPUStrategy],
) -> None:
    out = strategies[0].run(lambda: ctx().replica_id_in_sync_group)
    parts = strategies[0].experimental_local_results(out)
    assert [p.devices() for p in parts] == [{d} for d in jax.devices()]


def test_variables_in_replica_and_cross_replica_context(
    strategies: tuple[pd.TPUStrategy, pd.TPUStrategy],
) -> None:
    results = []

    def step(v: Any) -> Any:
        v.assign_add(ctx().replica_id_in_sync_group.astype(np.float32))
        return v.read_value()

    for strategy in strategies:
        with strategy.scope():
            v = pd.Variable(np.float32(1.0), aggregation=pd.VariableAggregation.MEAN)
        assert [c.device for c in v.values] == list(strategy.extended.worker_devices)
        seen = strategy.run(step, args=(v,))
        v.assign_sub(np.float32(0.5))
        b = strategy.extended.backend
        results.append(
            [b.to_numpy(c.value()) for c in v.values]
            + [b.to_numpy(s) for s in strategy.experimental_local_results(seen)]
        )
    for got, want in zip(*results, strict=True):
        assert_same_bits(got, want)
    # 1 + mean(0..7) - 0.5 on every copy.
    assert results[0][0] == np.float32(4.0)


def test_gather_needs_the_same_shape_on_every_replica(
    strategies: tuple[pd.TPUStrategy, pd.TPUStrategy],
) -> None:
    strategy = strategies[0]
    uneven = distribute(strategy, [np.ones((r + 1,), np.float32) for r in range(N)])
    with pytest.raises(InvalidArgumentError, match="same shape on every replica"):
        strategy.gather(uneven, axis=0)
    # Inside run, uneven inputs cannot compile; the eager run checks the shapes.
    with pytest.raises(InvalidArgumentError, match="same shape on every replica"):
        strategy.run(lambda x: ctx().all_gather(x, axis=0), args=(uneven,))


# -- device assignments on the mesh ---------------------------------------------------------


def chain_assignment(order: list[int]) -> DeviceAssignment:
    topology = TPUClusterResolver("local", backend="jax").get_tpu_system_metadata().topology
    assert topology is not None
    return DeviceAssignment(topology, [[[k, 0, 0, 0]] for k in order])


def test_device_assignment_orders_the_mesh(jax_backend: JaxBackend) -> None:
    order = [3, 1, 0, 2, 7, 6, 5, 4]
    da = chain_assignment(order)
    strategy = pd.TPUStrategy(
        TPUClusterResolver("local"), experimental_device_assignment=da, backend=jax_backend
    )
    assert strategy.extended.worker_devices == tuple(TPU.format(k) for k in order)
    rows = mixed_floats(np.random.default_rng(1), (N, 4))
    x = distribute(strategy, list(rows))
    ids, total = strategy.run(
        lambda v: (ctx().replica_id_in_sync_group, ctx().all_reduce("SUM", v)), args=(x,)
    )
    # Replica r's shard is on the device at core_assignment[r][0] (chip k of the chain).
    stand_ins = [_StandIn(d.id, i) for i, d in enumerate(jax.devices())]
    expected = [row[0].id for row in assigned_devices(stand_ins, da)]
    assert expected == order
    parts = strategy.experimental_local_results(ids)
    assert [next(iter(p.devices())).id for p in parts] == expected
    assert [int(p) for p in parts] == list(range(N))
    # The mesh is in replica order, so XLA CPU still sums replica 0, 1, ... left to right.
    sim = pd.TPUStrategy(
        TPUClusterResolver("local", backend=SimBackend("sequential")),
        backend=SimBackend("sequential"),
    )
    want = sim.run(lambda v: ctx().all_reduce("SUM", v), args=(distribute(sim, list(rows)),))
    for got, ref in zip(
        strategy.experimental_local_results(total),
        sim.experimental_local_results(want),
        strict=True,
    ):
        assert_same_bits(np.asarray(got), ref)


def test_several_cores_per_replica(jax_backend: JaxBackend) -> None:
    resolver = TPUClusterResolver("local", backend="jax")
    topology = resolver.get_tpu_system_metadata().topology
    assert topology is not None
    da = DeviceAssignment.build(topology, computation_shape=[2, 1, 1, 1], num_replicas=4)
    strategy = pd.TPUStrategy(resolver, experimental_device_assignment=da, backend=jax_backend)
    assert strategy.num_replicas_in_sync == 4
    assert strategy.extended.worker_devices == tuple(TPU.format(k) for k in (0, 2, 4, 6))
    with strategy.extended.experimental_logical_device(1):
        assert strategy.extended.worker_devices == tuple(TPU.format(k) for k in (1, 3, 5, 7))
    out = strategy.run(lambda: ctx().all_reduce("SUM", np.float32(1)))
    assert [float(v) for v in strategy.experimental_local_results(out)] == [4.0] * 4


def test_assignment_for_another_topology_is_refused(jax_backend: JaxBackend) -> None:
    v3_topology = TPUClusterResolver("v3-8").get_tpu_system_metadata().topology
    assert v3_topology is not None
    da = DeviceAssignment.build(v3_topology, num_replicas=8)
    with pytest.raises(ValueError, match=r"built for a TPU mesh of shape \[2, 2, 1, 2\]"):
        pd.TPUStrategy(
            TPUClusterResolver("local"), experimental_device_assignment=da, backend=jax_backend
        )


def test_simulated_slices_and_other_backends_resolvers_are_refused(
    jax_backend: JaxBackend,
) -> None:
    with pytest.raises(ValueError, match="TPU cores of this process only"):
        pd.TPUStrategy(TPUClusterResolver("v3-8"), backend=jax_backend)
    with pytest.raises(ValueError, match="already describes the local TPU of backend 'sim'"):
        pd.TPUStrategy(TPUClusterResolver("local", backend="sim"), backend=jax_backend)


def test_tpu_name_is_ignored_by_the_default_resolver(
    jax_backend: JaxBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On the sim TPU_NAME picks a simulated slice; jax has only its local TPU.
    monkeypatch.setenv("TPU_NAME", "v5e-16")
    assert pd.TPUStrategy(backend=jax_backend).num_replicas_in_sync == N
