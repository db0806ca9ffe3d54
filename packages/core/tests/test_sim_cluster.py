"""The sim's cluster support: simulated tasks, connect_cluster and its device lister."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from polydist._sim import SimBackend
from polydist.cluster_resolver import (
    ClusterResolver,
    ClusterSpec,
    SimpleClusterResolver,
    get_accelerator_devices,
    set_accelerator_device_lister,
)

W1_GPU0 = "/job:worker/replica:0/task:1/device:GPU:0"


@pytest.fixture(autouse=True)
def _restore_device_lister() -> Iterator[None]:
    previous = set_accelerator_device_lister(None)
    yield
    set_accelerator_device_lister(previous)


def test_capabilities_declare_clusters() -> None:
    caps = SimBackend().capabilities
    assert caps.has("multi_worker")
    assert caps.has("tpu")


def test_validate_devices_accepts_declared_tasks_only() -> None:
    backend = SimBackend()
    with pytest.raises(ValueError, match="is on another worker"):
        backend.validate_devices([W1_GPU0])
    backend.validate_devices([W1_GPU0], simulated_tasks={("worker", 1)})
    with pytest.raises(ValueError, match="is on another worker"):
        backend.validate_devices([W1_GPU0], simulated_tasks={("worker", 0)})
    with pytest.raises(ValueError, match="out of range"):
        backend.validate_devices(
            ["/job:worker/task:1/device:GPU:1024"], simulated_tasks={("worker", 1)}
        )


def test_connect_cluster_runs_every_worker_here() -> None:
    backend = SimBackend(num_gpus=1)
    workers = [
        [f"/job:worker/replica:0/task:{t}/device:{kind}:0" for kind in ("CPU", "GPU")]
        for t in range(3)
    ]
    assert backend.connect_cluster(workers, 2) == (0, 1, 2)
    names = [d.name for d in get_accelerator_devices("")]
    assert names == [
        "/job:localhost/replica:0/task:0/device:GPU:0",
        *(f"/job:worker/replica:0/task:{t}/device:GPU:0" for t in range(3)),
    ]
    resolver = SimpleClusterResolver(ClusterSpec({"worker": ["a:1", "b:1", "c:1"]}))
    assert ClusterResolver.num_accelerators(resolver, "worker", 1) == {"GPU": 1}
    assert ClusterResolver.num_accelerators(resolver) == {"GPU": 4}


def test_connect_cluster_validates() -> None:
    backend = SimBackend()
    with pytest.raises(ValueError, match="worker_index 2 is out of range"):
        backend.connect_cluster([["/job:worker/task:0/device:CPU:0"]], 2)
    with pytest.raises(ValueError, match="simulates CPU, GPU and TPU devices"):
        backend.connect_cluster([["/job:worker/task:0/device:XLA:0"]], 0)
