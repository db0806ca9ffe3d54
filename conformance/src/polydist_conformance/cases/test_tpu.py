"""TPUStrategy: replicas, hosts and collectives of TPU slices, and TPU's static-shape rules.

Every case needs ``Capabilities.tpu``. Cases on the default slice
(``TPUStrategy()``: ``$TPU_NAME``, else the local TPU, ``$POLYDIST_LOCAL_TPU``)
hold for any TPU backend, real or simulated: counts that agree with each
other, collectives over every replica, ``gather`` needing the same shape on
every replica (reference A, "TPU specifics"). Cases that build named slices
(``TPUClusterResolver(tpu="v4-32")``) check the replica and host counts of
real Cloud TPU slices (``docs/concepts/tpu-and-multi-worker.md``) and need
``Capabilities.simulated_clusters`` too: a backend on real TPUs has the one
slice it is attached to.

A backend on real devices (``local_tpu_system()``: jax, torch_xla) runs the
default slice on its own TPU cores, or on devices standing in for them; the
oracle simulates ``$POLYDIST_LOCAL_TPU``, which must then have as many cores.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist.backend import local_tpu_system
from polydist.errors import InvalidArgumentError
from polydist.tpu import SIMULATED_SLICES
from polydist_conformance import Conformance, ConformanceSession
from polydist_conformance.cases._helpers import (
    NamedStrategy,
    components,
    distribute,
    per_replica,
    replica_context,
    replica_float,
    replica_id,
    tpu,
)

pytestmark = pytest.mark.requires("tpu")
SIMULATED = pytest.mark.requires("simulated_clusters")


@pytest.fixture(autouse=True)
def _oracle_has_the_backends_cores(
    polydist_session: ConformanceSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default slice on a backend's own TPU cores is compared with the sim's local
    slice: both must have the same number of cores. Where devices stand in for TPU cores
    and ``$POLYDIST_LOCAL_TPU`` is unset, the first single-host slice with as many cores
    is simulated (one GPU: ``v5e-1``); a slice the user named is never replaced."""
    from polydist.cluster_resolver import LOCAL_TPU_ENV, TPUClusterResolver

    system = local_tpu_system(polydist_session.backend)
    if system is None:
        return
    oracle = TPUClusterResolver("local", backend=polydist_session.oracle)
    simulated = oracle.slice_spec
    if simulated.num_cores != system.num_cores:
        fits = [
            name
            for name, spec in SIMULATED_SLICES.items()
            if spec.num_hosts == 1 and spec.num_cores == system.num_cores
        ]
        if fits and system.is_stand_in and LOCAL_TPU_ENV not in os.environ:
            monkeypatch.setenv(LOCAL_TPU_ENV, fits[0])
            return
        hint = f" such as {', '.join(fits)}" if fits else " (no simulated slice has that many)"
        what = "devices standing in for TPU cores" if system.is_stand_in else "TPU cores"
        pytest.fail(
            f"backend {polydist_session.backend.name!r} runs TPUStrategy() on "
            f"{system.num_cores} {what}, but the oracle's local TPU, {LOCAL_TPU_ENV}="
            f"{simulated.name!r}, has {simulated.num_cores}: set {LOCAL_TPU_ENV} to a "
            f"single-host slice with {system.num_cores}{hint}.",
            pytrace=False,
        )


def _tpu_extended(strategy: pd.Strategy) -> Any:
    assert isinstance(strategy, pd.TPUStrategy)
    return strategy.extended


def _default_replicas(conformance: Conformance) -> int:
    """The replicas of ``TPUStrategy()`` (the same resolver on the backend and the oracle)."""
    return tpu()(conformance.session.oracle).num_replicas_in_sync


def _skip_unless_uneven_is_possible(conformance: Conformance) -> None:
    """Uneven shapes need two replicas: a one-core slice (one GPU standing in) has one."""
    if _default_replicas(conformance) < 2:
        pytest.skip("TPUStrategy() has one replica here: no replica can differ in shape")


# -- any TPU slice ----------------------------------------------------------------------------


def test_counts_agree(conformance: Conformance) -> None:
    """One replica per TPU device; ``num_hosts * num_replicas_per_host`` of them; TPU is
    single-client, so ``experimental_local_results`` has every replica."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        ext = _tpu_extended(strategy)
        n = strategy.num_replicas_in_sync
        ones = strategy.run(lambda: xp.ones((), dtype=xp.float32))
        return {
            "replicas": n,
            "devices": len(ext.worker_devices) == n,
            "tpu_devices": all("/device:TPU:" in d for d in ext.worker_devices),
            "hosts": ext.num_hosts * ext.num_replicas_per_host == n,
            "parameter_devices": ext.parameter_devices == ext.worker_devices,
            "local_results": len(strategy.experimental_local_results(ones)) == n,
            "cluster_resolver": strategy.cluster_resolver is not None,
            "static_shapes": ext.experimental_require_static_shapes,
            "should_checkpoint": ext.should_checkpoint,
            "between_graph": ext.experimental_between_graph,
        }

    conformance.check(
        program,
        strategy=tpu(),
        expected={
            "replicas": _default_replicas(conformance),
            "devices": True,
            "tpu_devices": True,
            "hosts": True,
            "parameter_devices": True,
            "local_results": True,
            "cluster_resolver": True,
            "static_shapes": True,
            "should_checkpoint": True,
            "between_graph": False,
        },
    )


def test_collectives_span_every_replica(conformance: Conformance) -> None:
    """Inside ``run`` the context is a ``TPUReplicaContext``; ``all_reduce`` and ``reduce``
    cover all replicas of all hosts."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        def step() -> Any:
            ctx = replica_context()
            return (
                type(ctx).__name__,
                ctx.all_reduce("SUM", replica_id()),
                ctx.all_reduce("MEAN", replica_float(xp)),
            )

        kind, ids, mean = strategy.run(step)
        ones = strategy.run(lambda: xp.ones((2,), dtype=xp.float32))
        return {
            "context": kind,
            "ids": ids,
            "mean": mean,
            "reduce": strategy.reduce("SUM", ones, axis=None),
        }

    n = _default_replicas(conformance)
    conformance.check(
        program,
        strategy=tpu(),
        expected={
            "context": "TPUReplicaContext",
            "ids": per_replica([np.int32(n * (n - 1) // 2)] * n),
            "mean": per_replica([np.float32((n - 1) / 2)] * n),
            "reduce": np.full(2, n, np.float32),
        },
    )


def test_gather_needs_the_same_shape_on_every_replica(conformance: Conformance) -> None:
    """Other strategies allow uneven sizes along the gather axis; TPU does not."""

    _skip_unless_uneven_is_possible(conformance)

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        uneven = strategy.experimental_distribute_values_from_function(
            lambda ctx: xp.ones((ctx.replica_id_in_sync_group + 1,), dtype=xp.float32)
        )
        return strategy.gather(uneven, axis=0)

    conformance.check_raises(program, InvalidArgumentError, strategy=tpu())


def test_gather_of_equal_shapes(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: xp.full((2,), ctx.replica_id_in_sync_group, dtype=xp.int32)
        )
        return {
            "gather": strategy.gather(values, axis=0),
            "all_gather": strategy.run(
                lambda x: replica_context().all_gather(x, axis=0), (values,)
            ),
        }

    n = _default_replicas(conformance)
    gathered = np.repeat(np.arange(n, dtype=np.int32), 2)
    conformance.check(
        program,
        strategy=tpu(),
        expected={"gather": gathered, "all_gather": per_replica([gathered] * n)},
    )


@pytest.mark.requires("dynamic_shapes")
def test_all_gather_needs_the_same_shape_on_every_replica(conformance: Conformance) -> None:
    _skip_unless_uneven_is_possible(conformance)

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        uneven = strategy.experimental_distribute_values_from_function(
            lambda ctx: xp.ones((ctx.replica_id_in_sync_group + 1,), dtype=xp.float32)
        )
        return strategy.run(lambda x: replica_context().all_gather(x, axis=0), (uneven,))

    conformance.check_raises(
        program, InvalidArgumentError, match="same shape on every replica", strategy=tpu()
    )


def test_variables_live_on_the_tpu_devices(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(1.0, aggregation=pd.VariableAggregation.MEAN)
        return {
            "class": type(v).__name__,
            "devices": [c.device for c in components(v)] == list(strategy.extended.worker_devices),
        }

    conformance.check(
        program, strategy=tpu(), expected={"class": "MirroredVariable", "devices": True}
    )


# -- simulated slices ---------------------------------------------------------------------------

# slice -> (replicas, hosts, replicas per host): the shapes of real Cloud TPU slices
# (v2/v3 chips show 2 TensorCores as 2 devices, a v4 chip fuses them: megacore).
SLICES = {
    "v2-8": (8, 1, 8),
    "v2-32": (32, 4, 8),
    "v3-8": (8, 1, 8),
    "v3-32": (32, 4, 8),
    "v4-8": (4, 1, 4),
    "v4-16": (8, 2, 4),
    "v4-32": (16, 4, 4),
    "v5e-1": (1, 1, 1),
    "v5e-4": (4, 1, 4),
    "v5litepod-4": (4, 1, 4),
    "v5e-8": (8, 1, 8),
    "v5e-16": (16, 4, 4),
    "v5e-32": (32, 8, 4),
}


@SIMULATED
@pytest.mark.parametrize("slice_name", list(SLICES))
def test_replicas_and_hosts_of_a_slice(conformance: Conformance, slice_name: str) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        ext = _tpu_extended(strategy)
        devices = ext.worker_devices
        per_host = ext.num_replicas_per_host
        return {
            "replicas": strategy.num_replicas_in_sync,
            "hosts": ext.num_hosts,
            "per_host": per_host,
            "first": devices[0],
            "last": devices[-1],
            "host_major": all(
                f"/task:{r // per_host}/device:TPU:{r % per_host}" in d
                for r, d in enumerate(devices)
            ),
            "accelerators": strategy.cluster_resolver.num_accelerators(),
        }

    replicas, hosts, per_host = SLICES[slice_name]
    conformance.check(
        program,
        strategy=tpu(slice_name),
        expected={
            "replicas": replicas,
            "hosts": hosts,
            "per_host": per_host,
            "first": "/job:worker/replica:0/task:0/device:TPU:0",
            "last": f"/job:worker/replica:0/task:{hosts - 1}/device:TPU:{per_host - 1}",
            "host_major": True,
            "accelerators": {"TPU": per_host},
        },
    )


@SIMULATED
def test_v4_32_runs_every_host(conformance: Conformance) -> None:
    """The docs' example: 16 replicas on 4 hosts; ``all_reduce(SUM, id)`` is 120 on every
    replica, so its MEAN is 120."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        out = strategy.run(lambda: replica_context().all_reduce("SUM", replica_float(xp)))
        return {
            "worker_devices_4": strategy.extended.worker_devices[4],
            "out": out,
            "mean": strategy.reduce("MEAN", out, axis=None),
        }

    conformance.check(
        program,
        strategy=tpu("v4-32"),
        expected={
            "worker_devices_4": "/job:worker/replica:0/task:1/device:TPU:0",
            "out": per_replica([np.float32(120.0)] * 16),
            "mean": np.float32(120.0),
        },
    )


def _with_assignment(slice_name: str, **build: Any) -> NamedStrategy:
    from polydist.cluster_resolver import TPUClusterResolver
    from polydist.tpu import DeviceAssignment

    def make(backend: Any) -> pd.Strategy:
        resolver = TPUClusterResolver(tpu=slice_name)
        topology = resolver.get_tpu_system_metadata().topology
        assert topology is not None
        assignment = DeviceAssignment.build(topology, **build)
        return pd.TPUStrategy(resolver, experimental_device_assignment=assignment, backend=backend)

    args = ", ".join(f"{k}={v}" for k, v in build.items())
    return NamedStrategy(f"TPUStrategy({slice_name!r}, DeviceAssignment.build({args}))", make)


@SIMULATED
def test_device_assignment_ring_order(conformance: Conformance) -> None:
    """TF's ring order on v4-32 visits hosts 0, 1, 2, 3 and comes back through hosts 2 and
    1: replica 14 runs on host 2 and replica 15 on host 1."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        devices = strategy.extended.worker_devices
        return {"replicas": strategy.num_replicas_in_sync, "14": devices[14], "15": devices[15]}

    conformance.check(
        program,
        strategy=_with_assignment("v4-32", num_replicas=16),
        expected={
            "replicas": 16,
            "14": "/job:worker/replica:0/task:2/device:TPU:0",
            "15": "/job:worker/replica:0/task:1/device:TPU:0",
        },
    )


@SIMULATED
def test_model_parallel_annotations_are_validated(conformance: Conformance) -> None:
    """Two logical devices per replica (``computation_shape=[1, 1, 2, 1]``): TF's checks of
    ``experimental_split_to_logical_devices`` and ``experimental_assign_to_logical_device``;
    the calls return the very array they were given."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        assert isinstance(strategy, pd.TPUStrategy)
        x = xp.ones((8, 6), dtype=xp.float32)
        result: dict[str, Any] = {
            "replicas": strategy.num_replicas_in_sync,
            "split": strategy.experimental_split_to_logical_devices(x, [1, 2]) is x,
            "assign": strategy.experimental_assign_to_logical_device(x, 1) is x,
            "replicate": strategy.experimental_replicate_to_logical_devices(x) is x,
        }
        errors = []
        for bad in ([2, 2], [1, 4], [1]):
            try:
                strategy.experimental_split_to_logical_devices(x, bad)
                errors.append("")
            except ValueError as e:
                errors.append(type(e).__name__)
        try:
            strategy.experimental_assign_to_logical_device(x, 2)
            errors.append("")
        except ValueError as e:
            errors.append(type(e).__name__)
        result["errors"] = errors
        with strategy.extended.experimental_logical_device(1):
            logical_1 = strategy.extended.worker_devices
        result["logical_1_differs"] = logical_1 != strategy.extended.worker_devices
        return result

    conformance.check(
        program,
        strategy=_with_assignment("v4-32", computation_shape=[1, 1, 2, 1], num_replicas=8),
        expected={
            "replicas": 8,
            "split": True,
            "assign": True,
            "replicate": True,
            "errors": ["ValueError"] * 4,
            "logical_1_differs": True,
        },
    )


@SIMULATED
def test_run_on_a_slice_with_distributed_inputs(conformance: Conformance) -> None:
    """Per-replica inputs of a 2-host slice reach their replicas in order."""
    inputs = [np.full((3,), r, np.float32) for r in range(8)]

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        values = distribute(strategy, xp, inputs)
        return strategy.gather(strategy.run(lambda x: x * 2, (values,)), axis=0)

    conformance.check(
        program, strategy=tpu("v4-16"), expected=np.concatenate(inputs) * np.float32(2)
    )
