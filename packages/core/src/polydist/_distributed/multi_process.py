"""``MultiWorkerMirroredStrategy`` with one process per worker (torch.distributed, jax.distributed).

The simulator runs every worker of a cluster in one process
(`polydist._distributed.multi_worker`). A real engine runs one process per worker: this
process runs only its own worker's D replicas, and every cross-replica
collective is a local step (over this worker's replicas, in replica order)
followed by a cross-process step through the engine's collectives
(``torch.distributed.all_reduce``, a ``psum`` over every process's devices).

This module holds what such engines share; each backend package provides the
engine half, a backend that implements `WorkerProcessBackend`:

* its list collectives (``all_reduce``, ``reduce_to``, ``all_gather``) span
  every worker's process once ``connect_cluster`` has connected them, so a
  list of this worker's D values yields the sum (or concatenation) over all
  ``W x D`` replicas, in worker order;
* ``broadcast_from_chief`` copies worker 0's value to every worker;
* ``local_device_count`` says how many replicas this worker runs.

`MultiProcessExtended` (which ``MultiWorkerMirroredStrategy`` builds when its
backend declares `polydist.backend.SupportsWorkerProcesses`) then fixes what the
single-process strategy cannot know: the global replica ids
(``worker_index * D + local index``), MEAN's divisor (``W x D``, not this
worker's D: its ``ReplicaGroup``), reductions of host values and of counts
across workers, gathers of one local component, and variables whose initial
values come from worker 0 (as TF's ``CollectiveAllReduceExtended`` broadcasts
them).

What stays per worker, as in TF: ``experimental_local_results``,
``worker_devices``, ``should_checkpoint`` (the chief only) and the input
pipeline (auto-sharded: ``InputContext.num_input_pipelines == W``).

Timeouts: ``CommunicationOptions.timeout_seconds`` bounds joining the
cluster and every cross-process collective; ``None`` means
`DEFAULT_TIMEOUT_SECONDS` (60 s), 0 disables the bound (`NO_TIMEOUT_SECONDS`).
A backend turns its engine's failures into ``DeadlineExceededError`` (a peer
did not arrive in time) or ``UnavailableError`` (a peer's process is gone),
naming the worker. Before each cross-process collective it also checks that
every worker is about to run the same one (`polydist._collectives.check`), or
raises ``CollectiveMismatchError`` on all of them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from polydist import errors
from polydist._base.arrays import (
    convert_to_array,
)
from polydist._base.communication import (
    CommunicationOptions,
)
from polydist._base.devices import DeviceSpec
from polydist._base.reduce_op import ReduceOp
from polydist._collectives import cross_device_ops as _cross_device_ops
from polydist._collectives import trace as _trace
from polydist._distributed.cluster import InReplicaContext
from polydist._distributed.membership import _SILENCE_SECONDS as _SILENCE_SECONDS
from polydist._distributed.membership import HEARTBEAT_SECONDS as HEARTBEAT_SECONDS
from polydist._distributed.membership import ClusterMembership as ClusterMembership
from polydist._distributed.membership import ClusterStore as ClusterStore
from polydist._distributed.membership import Heartbeat as Heartbeat
from polydist._distributed.membership import HeartbeatStore as HeartbeatStore
from polydist._distributed.membership import describe_workers as describe_workers
from polydist._distributed.membership import once_per_process as once_per_process
from polydist._distributed.membership import process_capabilities as process_capabilities
from polydist._distributed.multi_worker import MultiWorkerExtended
from polydist._strategies.replica_context import ReplicaContext
from polydist._strategies.strategy import (
    Strategy,
)
from polydist._valuetypes import variables as _variables
from polydist._valuetypes.values import (
    DistributedValues,
    Mirrored,
)
from polydist.backend._contract import (
    Backend,
    ClusterToJoin,
    WorkerProcessBackend,
    is_symbolic,
)
from polydist.cluster_resolver import (
    ClusterResolver,
    ClusterSpec,
    SimpleClusterResolver,
    TFConfigClusterResolver,
)

__all__ = [
    "DEFAULT_TIMEOUT_SECONDS",
    "HEARTBEAT_SECONDS",
    "ClusterMembership",
    "ClusterStore",
    "ClusterToJoin",
    "Heartbeat",
    "HeartbeatStore",
    "NO_TIMEOUT_SECONDS",
    "MultiProcessExtended",
    "WorkerProcessBackend",
    "check_joining",
    "collective_timeout",
    "describe_workers",
    "environment_cluster_resolver",
    "once_per_process",
    "process_capabilities",
    "rendezvous_address",
    "resolve_cluster",
    "task_addresses",
    "task_names",
    "worker_task_names",
]

#: The bound on joining the cluster and on each cross-process collective when
#: ``CommunicationOptions.timeout_seconds`` is None.
DEFAULT_TIMEOUT_SECONDS = 60.0
#: What ``timeout_seconds=0`` (no bound) becomes: engines need a finite number.
NO_TIMEOUT_SECONDS = 365 * 24 * 3600.0


def collective_timeout(options: CommunicationOptions | None) -> float:
    """Seconds that joining the cluster and each collective may take (see the module doc)."""
    seconds = None if options is None else options.timeout_seconds
    if seconds is None:
        return DEFAULT_TIMEOUT_SECONDS
    return NO_TIMEOUT_SECONDS if seconds == 0 else float(seconds)


def task_names(spec: ClusterSpec, task_type: str | None, task_id: int | None) -> list[str]:
    """``/job:J/replica:0/task:T`` of each worker of the collective, by worker index."""
    from polydist._distributed.multi_worker import _collective_tasks

    return [f"/job:{j}/replica:0/task:{t}" for j, t in _collective_tasks(spec, task_type, task_id)]


def task_addresses(spec: ClusterSpec, task_type: str | None, task_id: int | None) -> list[str]:
    """The address of each worker of the collective, by worker index."""
    from polydist._distributed.multi_worker import _collective_tasks

    if not spec:
        return []
    return [spec.task_address(j, t) for j, t in _collective_tasks(spec, task_type, task_id)]


def rendezvous_address(resolver: ClusterResolver) -> str | None:
    """``host:port`` of worker 0 (the chief, else ``worker`` task 0), where the engines meet;
    ``None`` without a cluster."""
    spec = resolver.cluster_spec()
    if not spec:
        return None
    for job in ("chief", "worker"):
        if job in spec.jobs:
            return spec.task_address(job, min(spec.task_indices(job)))
    return None


def environment_cluster_resolver(
    rank_var: str, size_var: str, address: str | None, *, what: str
) -> SimpleClusterResolver | None:
    """A cluster of ``$size_var`` workers where this process is worker ``$rank_var``.

    The variables are a launcher's (``torchrun``'s ``RANK``/``WORLD_SIZE``); only
    worker 0's address (``address``, the rendezvous) is known, so the others read
    ``"unknown (<what> rank r)"``. ``None`` when the variables are not set.
    """
    rank, size = os.environ.get(rank_var), os.environ.get(size_var)
    if rank is None or size is None:
        return None
    try:
        r, n = int(rank), int(size)
    except ValueError:
        raise ValueError(
            f"${rank_var}={rank!r} and ${size_var}={size!r} must be integers (set by {what})."
        ) from None
    if not 0 <= r < n:
        raise ValueError(
            f"${rank_var}={r} is out of range for ${size_var}={n}: expected 0 <= rank < size."
        )
    if not address:
        raise ValueError(
            f"${rank_var} and ${size_var} are set (by {what}) but the rendezvous address is "
            "not: set MASTER_ADDR and MASTER_PORT, or TF_CONFIG, or pass a cluster_resolver."
        )
    workers = [address, *(f"unknown ({what} rank {i})" for i in range(1, n))]
    return SimpleClusterResolver(ClusterSpec({"worker": workers}), task_type="worker", task_id=r)


def default_cluster_resolver(*fallbacks: ClusterResolver | None) -> ClusterResolver:
    """``TFConfigClusterResolver()`` when ``TF_CONFIG`` names a cluster, else the first
    fallback given (a launcher's environment), else ``TFConfigClusterResolver()``."""
    tf_config = TFConfigClusterResolver()
    if tf_config.cluster_spec():
        return tf_config
    for resolver in fallbacks:
        if resolver is not None:
            return resolver
    return tf_config


def resolve_cluster(
    cluster_resolver: ClusterResolver | None,
    communication_options: CommunicationOptions | None,
    rank_var: str,
    size_var: str,
    address: str | None,
    *,
    what: str,
) -> ClusterToJoin:
    """The cluster of a strategy created with ``cluster_resolver``: when it is None,
    `default_cluster_resolver` with a launcher's variables (`environment_cluster_resolver`
    of ``rank_var``, ``size_var``, ``address`` and ``what``)."""
    if cluster_resolver is not None and not isinstance(cluster_resolver, ClusterResolver):
        raise TypeError(
            f"cluster_resolver must be a polydist ClusterResolver (e.g. "
            f"TFConfigClusterResolver()) or None, got {type(cluster_resolver).__name__}: "
            f"{cluster_resolver!r}. Pass CommunicationOptions by keyword: "
            "MultiWorkerMirroredStrategy(communication_options=...)."
        )
    if communication_options is not None and not isinstance(
        communication_options, CommunicationOptions
    ):
        raise TypeError(
            "communication_options must be a polydist CommunicationOptions or None, got "
            f"{type(communication_options).__name__}: {communication_options!r}."
        )
    if cluster_resolver is None:
        cluster_resolver = default_cluster_resolver(
            environment_cluster_resolver(rank_var, size_var, address, what=what)
        )
    spec = cluster_resolver.cluster_spec()
    task_type, task_id = cluster_resolver.task_type, cluster_resolver.task_id
    addresses: list[str] = []
    if spec and task_type is not None and task_id is not None:
        # Without a task the strategy explains what is missing.
        addresses = task_addresses(spec, task_type, task_id)
    return ClusterToJoin(
        cluster_resolver,
        addresses,
        rendezvous_address(cluster_resolver),
        collective_timeout(communication_options),
    )


def shape_row(shape: Sequence[int]) -> np.ndarray:
    """``[rank, *shape]`` as int64: what each worker sends before an all_gather across
    workers, whose sizes along the axis may differ (`gathered_sizes`)."""
    return np.asarray([len(shape), *shape], dtype=np.int64)


def gathered_sizes(
    rows: Sequence[Sequence[int]], shape: Sequence[int], axis: int, rank: int
) -> list[int]:
    """Every worker's size along ``axis`` from their `shape_row`s (``rows``, in worker
    order); raises ``InvalidArgumentError`` unless the other dimensions match
    ``shape``, this worker's (``rank``)."""
    mine = [int(x) for i, x in enumerate(shape) if i != axis]
    for w, row in enumerate(rows):
        dims = [int(x) for x in row[1:]]
        if int(row[0]) != len(shape) or [x for i, x in enumerate(dims) if i != axis] != mine:
            raise errors.InvalidArgumentError(
                f"all_gather along axis {axis}: worker {rank} has shape {list(shape)} but "
                f"worker {w} has {dims}; all dimensions except axis {axis} must match on every "
                "worker's replicas."
            )
    return [int(row[1 + axis]) for row in rows]


def check_joining(worker_index: int, world: int, joined: tuple[int, int] | None) -> bool:
    """For ``connect_cluster(worker_devices, worker_index)`` of ``world`` workers: whether
    this process already joined that cluster (``joined``: its (worker index, cluster size),
    ``None`` before). Raises ``ValueError`` for an index out of range, or when it joined
    as another worker (a process joins one cluster)."""
    if not 0 <= worker_index < world:
        raise ValueError(
            f"worker_index {worker_index} is out of range for a cluster of {world} workers: "
            f"expected 0 <= index < {world}. Give each worker its own task index "
            "(TF_CONFIG's task.index, or RANK) below the number of workers in the cluster."
        )
    if joined is None:
        return False
    if joined != (worker_index, world):
        raise ValueError(
            f"This process already is worker {joined[0]} of a cluster of {joined[1]}; it "
            f"cannot also be worker {worker_index} of {world}. A process joins one cluster: "
            "create every MultiWorkerMirroredStrategy of the program with the same cluster."
        )
    return True


def worker_task_names(worker_devices: Sequence[Sequence[str]]) -> list[str]:
    """``/job:J/replica:R/task:T`` of each worker of ``connect_cluster``'s devices."""
    specs = (DeviceSpec.parse(devices[0]) for devices in worker_devices)
    return [f"/job:{s.job}/replica:{s.replica}/task:{s.task}" for s in specs]


class _WorkerReplicaContext(ReplicaContext):
    """A replica of this worker, with its id among all workers' replicas."""

    def __init__(
        self,
        strategy: Strategy,
        replica_id_in_sync_group: Any,
        *,
        channel: Any = None,
        replica_index: int | None = None,
    ) -> None:
        if replica_index is None:
            # A compiled run's replica (one program for all): its id is already the global one.
            super().__init__(strategy, replica_id_in_sync_group, channel=channel)
            return
        extended = cast("MultiProcessExtended", strategy.extended)
        global_id = extended._replica_offset + replica_index
        device = extended.worker_devices[replica_index]
        replica_id = extended._backend.place(np.asarray(global_id, dtype=np.int32), device)
        super().__init__(strategy, replica_id, channel=channel, replica_index=replica_index)


class MultiProcessExtended(MultiWorkerExtended):
    """``StrategyExtended`` of ``MultiWorkerMirroredStrategy`` on an engine with one process
    per worker: this worker's replicas, collectives across every worker's process."""

    def __init__(
        self,
        container_strategy: Strategy,
        cluster_resolver: ClusterResolver | None,
        communication_options: CommunicationOptions | None,
        backend: str | Backend | None,
    ) -> None:
        self._requested_local_devices: int | None = getattr(
            container_strategy, "_requested_local_devices", None
        )
        super().__init__(container_strategy, cluster_resolver, communication_options, backend)
        if self._simulated_workers != (self._id_in_cluster,):
            raise RuntimeError(
                f"Backend {self._backend.name!r} runs workers {self._simulated_workers} in this "
                "process, but it was given as an engine with one process per worker, whose "
                f"connect_cluster returns only this worker ({self._id_in_cluster},). For a "
                "simulated cluster use MultiWorkerMirroredStrategy(backend='sim')."
            )

    # -- layout --------------------------------------------------------------------------------
    def _local_device_count(self, resolver: ClusterResolver, backend: Backend) -> tuple[str, int]:
        engine = _engine(backend)
        answer = engine.local_device_count(self._requested_local_devices)
        if answer is None:
            return super()._local_device_count(resolver, backend)
        return answer

    @property
    def _replica_offset(self) -> int:
        """Global replica id of this worker's first replica."""
        return self._id_in_cluster * self._num_devices_per_worker

    def _engine(self) -> WorkerProcessBackend:
        return _engine(self._backend)

    # -- running --------------------------------------------------------------------------------
    def _call_for_each_replica(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        try:  # free on the success path
            if self._replica_offset == 0:
                return super()._call_for_each_replica(fn, args, kwargs)
            wrapped = InReplicaContext(fn, _WorkerReplicaContext)
            return super()._call_for_each_replica(wrapped, args, kwargs)
        except BaseException as e:
            self._abandon(e, "strategy.run")
            raise

    def _abandon(self, err: BaseException, where: str) -> None:
        """``err`` escaped ``where``, which may have left this worker's collectives out of
        step with the other workers': the cluster fails, and says so to the peers
        (`ClusterMembership.abandon`), instead of pairing one step's collectives with
        another's."""
        if self._num_workers == 1:
            return
        membership = getattr(self._backend, "cluster_membership", None)
        member = membership() if membership is not None else None
        if isinstance(member, ClusterMembership):
            member.abandon(err, where)

    def _run_across_processes(self) -> bool:
        return self._num_workers > 1

    # -- reductions: the group spans every worker's process ------------------------------------
    def _replica_group(self, count: int) -> _cross_device_ops.ReplicaGroup:
        group = super()._replica_group(count)
        if self._num_workers == 1:
            return group
        # The engine's SUM adds every worker's replicas: MEAN divides by W x D.
        return dataclasses.replace(group, size=count * self._num_workers, across_processes=True)

    def _check_reduce_components(self, value: DistributedValues) -> None:
        d = self._num_devices_per_worker
        if self._num_workers > 1 and not isinstance(value, Mirrored) and len(value.values) != d:
            raise ValueError(
                f"Cannot reduce a {type(value).__name__} with {len(value.values)} components on "
                f"worker {self._id_in_cluster} of {self._num_workers}: each worker holds one "
                f"component per local replica ({d}), as strategy.run returns them; the "
                "reduction then spans every worker's replicas. Pass the value strategy.run "
                "returned (or experimental_distribute_values_from_function's)."
            )
        super()._check_reduce_components(value)

    def _host_group(self) -> _cross_device_ops.ReplicaGroup | None:
        # As TF (and the sim): every worker contributes its copy once: SUM is W * value.
        if self._num_workers == 1:
            return None
        return _cross_device_ops.ReplicaGroup(
            self._backend,
            (self._worker_device,),
            self._num_workers,
            self._devices,
            across_processes=True,
        )

    @property
    def _local_replica_count(self) -> int:
        return self._num_devices_per_worker

    def _count_over_group(self, local: int, numer: Any) -> int:
        if self._num_workers == 1:
            return local
        if is_symbolic(self._backend, numer):
            # A compiled step: every worker runs this program, with these very shapes.
            return local * self._num_workers
        # Eager: the workers' batches may differ (a partial last batch).
        counted = self._sum_over_workers(np.asarray(local, dtype=np.int64))
        return int(self._backend.to_numpy(counted))

    def _sum_over_workers(self, array: Any) -> Any:
        """The sum of one host array per worker (a collective), on this worker's host."""
        backend = self._backend
        placed = backend.place(array, self._worker_device)
        if _trace.is_tracing():
            self._record("reduce_to", ReduceOp.SUM, placed)
        if self._num_workers == 1:
            return placed
        return backend.reduce_to([placed], self._worker_device)

    # -- variables ------------------------------------------------------------------------------
    def _create_variable(self, **kwargs: Any) -> Any:
        if self._num_workers > 1 and kwargs.get("initial_value") is not None:
            # TF's CollectiveAllReduceExtended: every worker starts from worker 0's value.
            initial = kwargs["initial_value"]
            if callable(initial) and not isinstance(
                initial, _variables.Variable | DistributedValues
            ):
                initial = initial()
            array = convert_to_array(_variables._read_operand(initial))
            kwargs["initial_value"] = self._engine().broadcast_from_chief(
                array, self.worker_devices[0]
            )
        return super()._create_variable(**kwargs)


def _engine(backend: Backend) -> WorkerProcessBackend:
    if not isinstance(backend, WorkerProcessBackend):
        raise TypeError(
            f"Backend {backend.name!r} ({type(backend).__name__}) does not run one process per "
            "worker: a MultiWorkerMirroredStrategy on it needs a backend implementing "
            "polydist.backend.WorkerProcessBackend (local_device_count, "
            "broadcast_from_chief), such as polydist_torch's or polydist_jax's."
        )
    return backend
