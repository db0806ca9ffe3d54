"""The simulator backend: virtual devices, eager replicas, exact reductions.

Its execution model is eager: core runs the replicas (``replica_runner``
configures how), and the sim supplies devices, placement and collectives."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Sequence
from typing import Any, Literal

import numpy as np

from polydist._sim._reduction import REDUCTION_ORDERS, ReductionOrder, sum_replicas
from polydist._strategies.eager import EagerReplicaRunner
from polydist.backend._contract import Capabilities
from polydist.cluster_resolver import set_accelerator_device_lister

__all__ = ["MAX_DEVICES", "SimBackend"]

#: The sim has as many virtual devices of each type as a program names, up to this.
MAX_DEVICES = 1024
GPUS_ENV = "POLYDIST_SIM_GPUS"
_VERSION = "0.1.0"


def _device(kind: str, index: int) -> str:
    return f"/job:localhost/replica:0/task:0/device:{kind}:{index}"


class _ConnectedCluster:
    """The devices the sim's accelerator device lister reports (see ``connect_cluster``)."""

    devices: tuple[tuple[str, str], ...] = ()


def _list_simulated_devices(master: str, config_proto: Any) -> list[tuple[str, str]]:
    # Like TF's eager context after connecting to a cluster: every task's devices,
    # whatever the master; ClusterResolver.num_accelerators filters them by task.
    del master, config_proto
    return list(_ConnectedCluster.devices)


class SimBackend:
    """A machine of virtual devices, simulated with NumPy.

    Args:
        reduction_order: how cross-replica sums are computed. ``"exact"`` (the
            default) gives the correctly rounded exact sum, independent of the
            replica count and order. ``"sequential"`` adds left to right in
            replica order with rounding after each addition, which is what
            XLA's CPU all-reduce does, bit for bit. ``"reverse"``, ``"tree"``
            and ``"ring"`` model other algorithms.
        replica_mode: ``"greenlet"`` (default: replicas take turns as greenlets on
            the calling thread, no threads at all) or ``"thread"`` (pooled
            threads, as TF's MirroredStrategy runs them).
        timeout_seconds: thread mode: how long one replica may run between two
            collectives before the sim reports it as stuck (default
            ``$POLYDIST_TIMEOUT_SECONDS`` or 300).
        num_gpus: GPUs of the simulated machine used by ``MirroredStrategy()``
            with no devices (default ``$POLYDIST_SIM_GPUS`` or 0, so like TF on a
            laptop it uses the CPU). Any ``/gpu:K`` with ``K < 1024`` may be named.
            Each worker of a simulated ``TF_CONFIG`` cluster has this many GPUs.

    Clusters: the sim declares ``Capabilities.multi_worker`` and ``.tpu``. A
    ``MultiWorkerMirroredStrategy`` or a multi-host ``TPUStrategy`` declares its
    workers' devices with ``connect_cluster``, and the sim then runs the
    replicas of every worker in this one process.
    """

    name = "sim"
    version = _VERSION
    #: `polydist.backend.SupportsSimulatedDevices`: any ``/gpu:K`` below this exists.
    max_simulated_devices = MAX_DEVICES

    def __init__(
        self,
        reduction_order: ReductionOrder = "exact",
        *,
        replica_mode: Literal["greenlet", "thread"] = "greenlet",
        timeout_seconds: float | None = None,
        num_gpus: int | None = None,
    ) -> None:
        if reduction_order not in REDUCTION_ORDERS:
            raise ValueError(
                f"Unknown reduction_order {reduction_order!r}: expected one of "
                f"{', '.join(map(repr, REDUCTION_ORDERS))}."
            )
        self.reduction_order: ReductionOrder = reduction_order
        self.capabilities = Capabilities(
            execution_model="eager",
            reduction_orders=(reduction_order,),
            autodiff=False,
            multi_worker=True,
            tpu=True,
            dynamic_shapes=True,
            float64=True,
            uneven_gather=True,
            measured_timing=False,  # traces carry the cost model's predictions instead
        )
        #: How core runs the replicas (``polydist.backend.SupportsReplicaRunner``); replica
        #: ids are NumPy values, safe to place inside a replica when it asks for its id.
        self.replica_runner = EagerReplicaRunner(
            replica_mode, timeout_seconds, lazy_replica_id=True
        )
        if num_gpus is None:
            num_gpus = int(os.environ.get(GPUS_ENV, "0"))
        if not 0 <= num_gpus <= MAX_DEVICES:
            raise ValueError(f"num_gpus must be in 0..{MAX_DEVICES}, got {num_gpus}.")
        self._num_gpus = num_gpus

    def with_reduction_order(self, reduction_order: ReductionOrder) -> SimBackend:
        """A sim backend like this one with another reduction order."""
        other = SimBackend(reduction_order, num_gpus=self._num_gpus)
        other.replica_runner = self.replica_runner
        return other

    def __repr__(self) -> str:
        return f"SimBackend(reduction_order={self.reduction_order!r})"

    # -- devices -------------------------------------------------------------------
    def array_namespace(self) -> Any:
        return np

    def list_devices(self) -> tuple[str, ...]:
        return (_device("CPU", 0), *(_device("GPU", i) for i in range(self._num_gpus)))

    def replica_devices(self, count: int | None) -> tuple[str, ...]:
        if count is None:
            if self._num_gpus:
                return tuple(_device("GPU", i) for i in range(self._num_gpus))
            return (_device("CPU", 0),)
        if count > MAX_DEVICES:
            raise ValueError(f"The sim simulates at most {MAX_DEVICES} replicas, got {count}.")
        return tuple(_device("GPU", i) for i in range(count))

    def validate_devices(
        self, devices: Sequence[str], *, simulated_tasks: Collection[tuple[str, int]] = ()
    ) -> None:
        """Raises ``ValueError`` naming a device the sim cannot place replicas on.

        Devices of this machine (``/job:localhost/task:0``) are accepted, and
        those of the ``(job, task)`` pairs in ``simulated_tasks``: the workers
        or TPU hosts that a strategy simulates in this process.
        """
        from polydist._base.devices import DeviceSpec

        for d in devices:
            spec = DeviceSpec.parse(d)
            if spec.device_type not in ("CPU", "GPU", "TPU"):
                raise ValueError(
                    f"The sim cannot place replicas on {d!r}: it simulates CPU, GPU and TPU "
                    "devices."
                )
            if spec.device_index >= MAX_DEVICES:
                raise ValueError(
                    f"Device {d!r} is out of range: the sim simulates device indices "
                    f"0..{MAX_DEVICES - 1}."
                )
            local = spec.job == "localhost" and spec.task == 0
            if not local and (spec.job, spec.task) not in simulated_tasks:
                raise ValueError(
                    f"Device {d!r} is on another worker; single-machine strategies take "
                    "devices of this machine (/job:localhost/task:0). Use "
                    "MultiWorkerMirroredStrategy for several workers."
                )

    def connect_cluster(
        self, worker_devices: Sequence[Sequence[str]], worker_index: int
    ) -> tuple[int, ...]:
        """Simulates a cluster in this process; ``worker_devices[w]`` are worker ``w``'s devices.

        Every worker's replicas run here, so this returns all worker indices.
        Like TF connecting to a cluster, it makes the devices visible: it
        installs a device lister (``polydist.cluster_resolver.
        set_accelerator_device_lister``) through which ``ClusterResolver.
        num_accelerators()`` counts them, replacing any lister installed before.
        """
        from polydist._base.devices import DeviceSpec

        if not 0 <= worker_index < len(worker_devices):
            raise ValueError(
                f"worker_index {worker_index} is out of range for a cluster of "
                f"{len(worker_devices)} workers (valid: 0..{len(worker_devices) - 1})."
            )
        specs = [DeviceSpec.parse(d) for ws in worker_devices for d in ws]
        flat = [s.to_string() for s in specs]
        self.validate_devices(flat, simulated_tasks={(s.job, s.task) for s in specs})
        local = [
            (_device("CPU", 0), "CPU"),
            *((_device("GPU", i), "GPU") for i in range(self._num_gpus)),
        ]
        remote = [(s.to_string(), s.device_type) for s in specs if s.to_string() not in dict(local)]
        _ConnectedCluster.devices = (*local, *remote)
        set_accelerator_device_lister(_list_simulated_devices)
        return tuple(range(len(worker_devices)))

    def device_scope(self, device: str) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def place(self, value: Any, device: str) -> Any:
        return np.asarray(value)

    def to_numpy(self, value: Any) -> np.ndarray:
        return np.asarray(value)

    # -- collectives -----------------------------------------------------------------
    def all_reduce(self, values: Sequence[Any], destinations: Sequence[str]) -> list[Any]:
        total = sum_replicas([np.asarray(v) for v in values], self.reduction_order)
        return [total, *(total.copy() for _ in destinations[1:])]

    def reduce_to(self, values: Sequence[Any], destination: str) -> Any:
        return sum_replicas([np.asarray(v) for v in values], self.reduction_order)

    def all_gather(
        self, values: Sequence[Any], axis: int, destinations: Sequence[str]
    ) -> list[Any]:
        gathered = np.concatenate([np.asarray(v) for v in values], axis=axis)
        return [gathered, *(gathered.copy() for _ in destinations[1:])]

    def broadcast(self, value: Any, destinations: Sequence[str]) -> list[Any]:
        array = np.asarray(value)
        return [array.copy() for _ in destinations]
