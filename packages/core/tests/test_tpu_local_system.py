"""The seam for TPUStrategy on a backend's own TPU cores: ``local_tpu_system()``.

A sim that declares a local TPU system (as jax and torch-xla do) stands in for a
backend on real devices, so the core side runs without either.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist.backend import local_tpu_system
from polydist.cluster_resolver import TPUClusterResolver
from polydist.tpu import DeviceAssignment, LocalTPUSystem, assigned_devices
from polydist_sim import SimBackend

TPU = "/job:localhost/replica:0/task:0/device:TPU:{}"


@dataclasses.dataclass(frozen=True)
class FakeTpu:
    id: int
    coords: tuple[int, int, int]
    core_on_chip: int
    platform: str = "tpu"


# A 2x2x1 mesh of 2-core chips, listed chip by chip.
CHIPS = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
DEVICES = [FakeTpu(2 * i + c, chip, c) for i, chip in enumerate(CHIPS) for c in (0, 1)]


class LocalTpuSim(SimBackend):
    """The sim, declaring the 8 cores above as its local TPU (like a backend on TPUs)."""

    name = "local_tpu_sim"

    def __init__(self, system: LocalTPUSystem | None = None) -> None:
        super().__init__("sequential")
        self.system = system or LocalTPUSystem.from_devices(DEVICES, generation="v3")

    def local_tpu_system(self) -> LocalTPUSystem:
        return self.system


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TPU_NAME", "KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS", "POLYDIST_LOCAL_TPU"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("POLYDIST_BACKEND", raising=False)


def ctx() -> pd.ReplicaContext:
    c = pd.get_replica_context()
    assert c is not None
    return c


def ids(rows: Any) -> list[list[int]]:
    return [[d.id for d in row] for row in rows]


# -- LocalTPUSystem -------------------------------------------------------------------------


def test_from_devices_reads_coords_and_core_on_chip() -> None:
    system = LocalTPUSystem.from_devices(DEVICES, generation="v3")
    assert system.mesh_shape == (2, 2, 1, 2)
    assert system.device_coordinates[2:4] == ((1, 0, 0, 0), (1, 0, 0, 1))
    assert (system.num_cores, system.is_stand_in) == (8, False)
    topology = system.topology()
    assert topology.mesh_shape.tolist() == [2, 2, 1, 2]
    assert (topology.num_tasks, topology.num_tpus_per_task) == (1, 8)
    assert topology.device_coordinates[0].tolist() == [
        [0, 0, 0, 0], [0, 0, 0, 1], [1, 0, 0, 0], [1, 0, 0, 1],
        [0, 1, 0, 0], [0, 1, 0, 1], [1, 1, 0, 0], [1, 1, 0, 1],
    ]  # fmt: skip
    # TF's TPU device k is DEVICES[k]: the device at (1, 1, 0, core 1) is TPU:7.
    assert topology.tpu_device_ordinal_at_coordinates([0, 1, 0, 1]) == 5
    assert topology.tpu_device_ordinal_at_coordinates([1, 1, 0, 1]) == 7
    assert topology.missing_devices.size == 0


def test_assigned_devices_by_coordinates() -> None:
    topology = LocalTPUSystem.from_devices(DEVICES).topology()
    da = DeviceAssignment.build(topology, computation_shape=[1, 1, 1, 2], num_replicas=4)
    # TF's ring over the chips: (0,0) (1,0) (1,1) (0,1); a replica takes both cores of one.
    rows = assigned_devices(DEVICES, da)
    assert ids(rows) == [[0, 1], [2, 3], [6, 7], [4, 5]]
    assert assigned_devices(DEVICES) == tuple((d,) for d in DEVICES)


def test_a_hand_written_assignment_picks_devices_by_coordinates() -> None:
    da = DeviceAssignment(
        LocalTPUSystem.from_devices(DEVICES).topology(),
        [[[1, 1, 0, 1], [0, 0, 0, 0]], [[0, 1, 0, 0], [1, 0, 0, 1]]],
    )
    assert ids(assigned_devices(DEVICES, da)) == [[7, 0], [4, 3]]


def test_device_order_does_not_depend_on_the_list_order() -> None:
    shuffled = [DEVICES[i] for i in (5, 2, 7, 0, 3, 6, 1, 4)]
    da = DeviceAssignment.build(LocalTPUSystem.from_devices(shuffled).topology(), num_replicas=8)
    # The assignment names coordinates: the same physical cores, whatever the list order.
    by_coords = ids(assigned_devices(shuffled, da))
    topology = LocalTPUSystem.from_devices(DEVICES).topology()
    da_sorted = DeviceAssignment.build(topology, num_replicas=8)
    assert by_coords == ids(assigned_devices(DEVICES, da_sorted))
    # One core per replica: core axis first, then x, y (TF's grid order, no ring).
    assert [row[0] for row in by_coords] == list(range(8))


def test_bad_devices_are_refused() -> None:
    with pytest.raises(ValueError, match="both at"):
        LocalTPUSystem.from_devices([FakeTpu(0, (0, 0, 0), 0), FakeTpu(1, (0, 0, 0), 0)])
    with pytest.raises(ValueError, match="'cpu' device"):
        LocalTPUSystem.from_devices([FakeTpu(0, (0, 0, 0), 0, platform="cpu")])
    with pytest.raises(ValueError, match="at least one"):
        LocalTPUSystem.from_devices([])
    with pytest.raises(ValueError, match=r"coords \(0, 0\); a TPU chip's coordinates"):
        LocalTPUSystem.from_devices([FakeTpu(0, (0, 0), 0)])  # type: ignore[arg-type]
    bigger = DeviceAssignment.build(LocalTPUSystem.from_devices(DEVICES).topology(), num_replicas=8)
    with pytest.raises(ValueError, match="no TPU device"):
        assigned_devices(DEVICES[:6], bigger)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"device_coordinates": ()}, "at least one core"),
        ({"device_coordinates": ((0, 0, 0),)}, "must be 4 integers"),
        ({"device_coordinates": ((2, 0, 0, 0),)}, "lies outside the mesh"),
        ({"device_coordinates": ((0, 0, 0, 0),) * 2}, "each TPU device needs its own"),
        ({"stand_ins": ("/cpu:0", "/cpu:1")}, "names 2 devices for 1 cores"),
    ],
)
def test_bad_systems_are_refused(kwargs: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {"mesh_shape": (2, 1, 1, 1), "device_coordinates": ((0, 0, 0, 0),)}
    with pytest.raises(ValueError, match=message):
        LocalTPUSystem(**{**fields, **kwargs})


def test_local_tpu_system_of_a_backend() -> None:
    assert local_tpu_system(SimBackend()) is None  # the sim's TPUs are simulated slices
    backend = LocalTpuSim()
    assert local_tpu_system(backend) is backend.system

    class Broken(SimBackend):
        def local_tpu_system(self) -> Any:
            return "8 cores"

    with pytest.raises(TypeError, match="must return a polydist.tpu.LocalTPUSystem"):
        local_tpu_system(Broken())


# -- TPUClusterResolver("local") and TPUStrategy on the backend's cores ---------------------


def test_resolver_and_strategy_report_the_backends_cores() -> None:
    backend = LocalTpuSim()
    resolver = TPUClusterResolver("local", backend=backend)
    metadata = resolver.get_tpu_system_metadata()
    assert (metadata.num_cores, metadata.num_hosts, metadata.num_of_cores_per_host) == (8, 1, 8)
    assert metadata.topology is not None
    assert metadata.topology.mesh_shape.tolist() == [2, 2, 1, 2]
    assert resolver.num_accelerators() == {"TPU": 8}
    strategy = pd.TPUStrategy(resolver, backend=backend)
    assert strategy.extended.worker_devices == tuple(TPU.format(k) for k in range(8))
    feature = strategy.extended.tpu_hardware_feature  # the table's v3 entry
    assert feature.embedding_feature.name == "V1"
    out = strategy.run(lambda: ctx().all_reduce("SUM", ctx().replica_id_in_sync_group))
    assert [int(v) for v in strategy.experimental_local_results(out)] == [28] * 8


def test_device_assignment_names_physical_cores() -> None:
    backend = LocalTpuSim()
    resolver = TPUClusterResolver("local", backend=backend)
    topology = resolver.get_tpu_system_metadata().topology
    assert topology is not None
    da = DeviceAssignment.build(topology, computation_shape=[1, 1, 1, 2], num_replicas=4)
    strategy = pd.TPUStrategy(resolver, experimental_device_assignment=da, backend=backend)
    # Replica r on core_assignment[r][0]: TPU:k is DEVICES[k] (the same ring as above).
    expected = [row[0].id for row in assigned_devices(DEVICES, da)]
    assert strategy.extended.worker_devices == tuple(TPU.format(k) for k in expected)
    with strategy.extended.experimental_logical_device(1):
        second = [row[1].id for row in assigned_devices(DEVICES, da)]
        assert strategy.extended.worker_devices == tuple(TPU.format(k) for k in second)
    other = LocalTpuSim(LocalTPUSystem((8, 1, 1, 1), tuple((i, 0, 0, 0) for i in range(8))))
    with pytest.raises(ValueError, match=r"built for a TPU mesh of shape \[2, 2, 1, 2\]"):
        pd.TPUStrategy(
            TPUClusterResolver("local"), experimental_device_assignment=da, backend=other
        )


def test_named_slices_and_tpu_name_on_a_backend_with_its_own_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = LocalTpuSim()
    with pytest.raises(ValueError, match="TPU cores of this process only"):
        pd.TPUStrategy(TPUClusterResolver("v4-32"), backend=backend)
    monkeypatch.setenv("TPU_NAME", "v5e-16")  # picks a slice on the sim, not here
    assert pd.TPUStrategy(backend=backend).num_replicas_in_sync == 8
    assert pd.TPUStrategy(backend=SimBackend()).num_replicas_in_sync == 16


def test_a_resolver_answers_for_one_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = LocalTpuSim()
    unbound = TPUClusterResolver("local")
    assert unbound.num_accelerators() == {"TPU": 8}  # the sim's v3-8, provisionally
    assert unbound.slice_spec.name == "v3-8"
    pd.TPUStrategy(unbound, backend=backend)  # binds it
    assert "backend='local_tpu_sim', cores=8" in repr(unbound)
    with pytest.raises(ValueError, match="not a simulated slice"):
        _ = unbound.slice_spec
    with pytest.raises(ValueError, match="already describes the local TPU of backend 'local_"):
        pd.TPUStrategy(unbound, backend=SimBackend())
    # The same cores on another instance: fine.
    assert pd.TPUStrategy(unbound, backend=LocalTpuSim()).num_replicas_in_sync == 8
    # Bound to the sim by a strategy, it refuses another backend's cores.
    on_sim = TPUClusterResolver("local")
    pd.TPUStrategy(on_sim, backend=SimBackend())
    with pytest.raises(ValueError, match=r"backend='local_tpu_sim'\)"):
        pd.TPUStrategy(on_sim, backend=backend)
    with pytest.raises(TypeError, match="backend must be a backend name"):
        TPUClusterResolver("local", backend=3)  # type: ignore[arg-type]


def test_sim_metadata_is_unchanged() -> None:
    resolver = TPUClusterResolver("local")
    metadata = resolver.get_tpu_system_metadata()
    assert metadata.num_cores == 8 and metadata.topology is not None
    assert np.array_equal(
        metadata.topology.device_coordinates, resolver.slice_spec.topology().device_coordinates
    )
    assert repr(resolver) == "TPUClusterResolver(tpu='local', slice='v3-8')"
