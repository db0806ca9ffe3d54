"""TF's TPU start-up calls: polydist.tpu.initialize_tpu_system / shutdown_tpu_system and
polydist.config.experimental_connect_to_cluster."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import polydist as pd
from polydist.cluster_resolver import (
    LOCAL_TPU_ENV,
    ClusterSpec,
    SimpleClusterResolver,
    TPUClusterResolver,
)
from polydist.cluster_resolver._connect import connected_cluster
from polydist.errors import FailedPreconditionError
from polydist.tpu._system import get_initialized_tpu_systems


def replica_id() -> int:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return int(ctx.replica_id_in_sync_group)


@pytest.fixture
def no_tpu_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in ("TPU_NAME", "KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS", LOCAL_TPU_ENV, "POLYDIST_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_initialize_returns_the_slice_topology_and_stores_it(no_tpu_env: object) -> None:
    resolver = TPUClusterResolver(tpu="v3-32")
    assert TPUClusterResolver(tpu="v3-32").tpu_topology is None
    topology = pd.tpu.initialize_tpu_system(resolver)
    assert isinstance(topology, pd.tpu.Topology)
    assert topology.mesh_shape.tolist() == [4, 4, 1, 2]
    assert topology.num_tasks == 4
    assert topology.num_tpus_per_task == 8
    stored = resolver.tpu_topology
    assert stored is not None
    assert np.array_equal(stored.device_coordinates, topology.device_coordinates)
    assert list(get_initialized_tpu_systems()) == ["v3-32"]


def test_initialize_without_a_resolver_uses_the_local_tpu(no_tpu_env: pytest.MonkeyPatch) -> None:
    no_tpu_env.setenv(LOCAL_TPU_ENV, "v4-8")
    topology = pd.tpu.initialize_tpu_system()
    assert topology.mesh_shape.tolist() == [2, 2, 1, 1]
    assert topology.num_tasks == 1
    assert list(get_initialized_tpu_systems()) == ["local"]
    pd.tpu.shutdown_tpu_system()
    assert get_initialized_tpu_systems() == {}


def test_initialize_without_a_resolver_reads_tpu_name(no_tpu_env: pytest.MonkeyPatch) -> None:
    no_tpu_env.setenv("TPU_NAME", "v3-32")
    assert pd.tpu.initialize_tpu_system().num_tasks == 4
    assert list(get_initialized_tpu_systems()) == ["v3-32"]


def test_reinitializing_warns_as_tf_logs(no_tpu_env: object) -> None:
    resolver = TPUClusterResolver("v3-8")
    pd.tpu.initialize_tpu_system(resolver)
    with pytest.warns(UserWarning, match="TPU system v3-8 has already been initialized"):
        again = pd.tpu.initialize_tpu_system(TPUClusterResolver("v3-8"))
    assert again.mesh_shape.tolist() == [2, 2, 1, 2]


def test_shutting_down_an_uninitialized_system_warns(no_tpu_env: object) -> None:
    with pytest.warns(UserWarning, match="shutting down a TPU system v4-8 that has not been"):
        pd.tpu.shutdown_tpu_system(TPUClusterResolver("v4-8"))


def test_run_after_shutdown_fails_until_initialized_again(no_tpu_env: object) -> None:
    resolver = TPUClusterResolver("v3-8")
    pd.tpu.initialize_tpu_system(resolver)
    strategy = pd.TPUStrategy(resolver)
    assert strategy.experimental_local_results(strategy.run(replica_id)) == tuple(range(8))
    pd.tpu.shutdown_tpu_system(resolver)
    assert get_initialized_tpu_systems() == {}
    with pytest.raises(FailedPreconditionError, match="'v3-8' was shut down"):
        strategy.run(replica_id)
    # As in TF, the strategy can still be created; running is what fails.
    later = pd.TPUStrategy(TPUClusterResolver("v3-8"))
    with pytest.raises(FailedPreconditionError, match="initialize_tpu_system"):
        later.extended.call_for_each_replica(replica_id)
    # Another slice is not affected.
    other = pd.TPUStrategy(TPUClusterResolver("v4-8"))
    assert other.experimental_local_results(other.run(replica_id)) == (0, 1, 2, 3)
    pd.tpu.initialize_tpu_system(resolver)
    assert strategy.experimental_local_results(strategy.run(replica_id)) == tuple(range(8))


def test_a_strategy_runs_without_initialization(no_tpu_env: object) -> None:
    # polydist's choice: its TPU systems need no initialization (TF's do).
    strategy = pd.TPUStrategy(TPUClusterResolver("v3-8"))
    assert strategy.num_replicas_in_sync == 8
    assert strategy.experimental_local_results(strategy.run(replica_id)) == tuple(range(8))


@pytest.mark.parametrize("call", [pd.tpu.initialize_tpu_system, pd.tpu.shutdown_tpu_system])
def test_anything_but_a_tpu_resolver_is_refused(call: object, no_tpu_env: object) -> None:
    simple = SimpleClusterResolver(ClusterSpec({"worker": ["a:1"]}))
    for bad in (simple, "v3-8"):
        with pytest.raises(TypeError, match="must be a polydist.cluster_resolver.TPUClusterRes"):
            call(bad)  # type: ignore[operator]
    assert get_initialized_tpu_systems() == {}


def test_resolver_connect_connects_and_initializes(no_tpu_env: object) -> None:
    resolver = TPUClusterResolver.connect("v4-32")
    assert list(get_initialized_tpu_systems()) == ["v4-32"]
    connection = connected_cluster()
    assert connection is not None
    assert connection.cluster_spec.as_dict() == {
        "worker": ["v4-32-w-0:8470", "v4-32-w-1:8470", "v4-32-w-2:8470", "v4-32-w-3:8470"],
        "localhost": ["localhost:0"],
    }
    assert connection.master_device == "/job:worker/replica:0/task:0/device:CPU:0"
    assert resolver.tpu_topology is not None
    assert resolver.tpu_topology.num_tasks == 4


# --------------------------------------------------------------------------- connect_to_cluster


def test_connect_to_a_cluster_spec_records_it_with_the_local_job() -> None:
    spec = ClusterSpec({"worker": ["w0:2222", "w1:2222"]})
    pd.config.experimental_connect_to_cluster(spec)
    connection = connected_cluster()
    assert connection is not None
    assert connection.cluster_spec.as_dict() == {
        "worker": ["w0:2222", "w1:2222"],
        "localhost": ["localhost:0"],
    }
    assert (connection.job_name, connection.task_index, connection.protocol) == (
        "localhost",
        0,
        "grpc",
    )
    assert connection.master_device is None  # TF: only for a resolver
    assert spec.as_dict() == {"worker": ["w0:2222", "w1:2222"]}  # the caller's is unchanged

    # Again: the new connection replaces the old one; a job of the cluster is not re-added.
    pd.config.experimental_connect_to_cluster(
        spec, job_name="worker", task_index=1, protocol="grpc+verbs"
    )
    connection = connected_cluster()
    assert connection is not None
    assert connection.cluster_spec.as_dict() == {"worker": ["w0:2222", "w1:2222"]}
    assert (connection.job_name, connection.task_index, connection.protocol) == (
        "worker",
        1,
        "grpc+verbs",
    )


def test_connect_to_a_local_resolver_does_nothing(no_tpu_env: object) -> None:
    pd.config.experimental_connect_to_cluster(TPUClusterResolver("local"))
    assert connected_cluster() is None


def test_connect_to_a_resolver_finds_its_master() -> None:
    spec = ClusterSpec({"chief": ["c:1"], "worker": ["w0:1", "w1:1"]})
    resolver = SimpleClusterResolver(spec, master="grpc://w1:1")
    pd.config.experimental_connect_to_cluster(resolver)
    connection = connected_cluster()
    assert connection is not None
    assert connection.master_device == "/job:worker/replica:0/task:1/device:CPU:0"

    pd.config.experimental_connect_to_cluster(resolver, make_master_device_default=False)
    connection = connected_cluster()
    assert connection is not None
    assert connection.master_device is None


def test_connect_refuses_bad_input() -> None:
    spec = ClusterSpec({"worker": ["w0:1"]})
    with pytest.raises(
        ValueError, match="must be a `ClusterSpec` or a `ClusterResolver`; got dict"
    ):
        pd.config.experimental_connect_to_cluster({"worker": ["w0:1"]})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot find master grpc://elsewhere:9 in the cluster"):
        pd.config.experimental_connect_to_cluster(
            SimpleClusterResolver(spec, master="grpc://elsewhere:9")
        )
    with pytest.raises(ValueError, match="ClusterDeviceFilters"):
        pd.config.experimental_connect_to_cluster(spec, cluster_device_filters=object())
    with pytest.raises(ValueError, match=r"Task 3 of job 'worker' is not in the cluster.*\[0\]"):
        pd.config.experimental_connect_to_cluster(spec, job_name="worker", task_index=3)
    with pytest.raises(ValueError, match="`task_index` must be a non-negative int; got -1"):
        pd.config.experimental_connect_to_cluster(spec, task_index=-1)
    assert connected_cluster() is None  # nothing recorded by a failed call


def test_the_resolver_reader_is_registered_whatever_module_comes_first() -> None:
    # polydist.tpu sits below cluster_resolver, which registers how to read a resolver
    # when `import polydist` (the parent of polydist.tpu) imports it.
    code = (
        "from polydist.tpu import initialize_tpu_system\n"
        "t = initialize_tpu_system()\n"
        "print(t.mesh_shape.tolist(), t.num_tasks)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TPU_NAME", "POLYDIST_BACKEND")}
    env.pop("KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS", None)
    env[LOCAL_TPU_ENV] = "v5e-8"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=env,
    ).stdout
    assert out.strip() == "[2, 4, 1, 1] 1"
