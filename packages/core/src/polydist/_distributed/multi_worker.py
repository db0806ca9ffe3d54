"""``MultiWorkerMirroredStrategy``: synchronous training across the workers of a cluster.

The cluster comes from a cluster resolver (``TF_CONFIG`` by default, read as
TF reads it). The strategy object stands for ONE worker, the current task,
as in TF: ``worker_devices`` and ``experimental_local_results`` are that
worker's, ``should_checkpoint`` is True on the chief only.

Where the workers run is the backend's choice (`polydist._distributed.cluster`). The
simulator runs W workers x D devices in this one process: one ``run`` calls
all W*D replicas, so every collective spans all workers, with replica ids
``0..W*D-1`` ordered by worker (the chief first, then ``worker`` tasks by
index) and by device within a worker.

How many devices D each worker has follows TF: with a
``TFConfigClusterResolver`` the GPUs of this machine (on the sim:
``SimBackend(num_gpus=...)`` / ``$POLYDIST_SIM_GPUS``; every simulated worker
is a copy of this machine), otherwise ``cluster_resolver.num_accelerators()``
(GPUs, else TPUs); with neither, one CPU per worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, cast

from polydist._base.arrays import convert_to_array
from polydist._base.communication import (
    CommunicationImplementation,
    CommunicationOptions,
)
from polydist._base.devices import DeviceSpec, canonicalize
from polydist._base.reduce_op import ReduceOp
from polydist._collectives import cross_device_ops as _cross_device_ops
from polydist._distributed.cluster import (
    InReplicaContext,
    connect_cluster,
    id_in_cluster,
    is_chief,
    normalize_cluster_spec,
    worker_count,
)
from polydist._strategies.mirrored import MirroredExtended
from polydist._strategies.replica_context import ReplicaContext
from polydist._strategies.strategy import Strategy
from polydist._valuetypes.values import DistributedValues, Mirrored, select_replicas
from polydist.backend._contract import (
    Backend,
    SupportsWorkerProcesses,
    get_backend,
    worker_processes,
)
from polydist.cluster_resolver import (
    ClusterResolver,
    ClusterSpec,
    TFConfigClusterResolver,
)

__all__ = [
    "ExperimentalMultiWorkerMirroredStrategy",
    "MultiWorkerExtended",
    "MultiWorkerMirroredStrategy",
]


class MultiWorkerExtended(MirroredExtended):
    """``StrategyExtended`` of `MultiWorkerMirroredStrategy` (TF's ``CollectiveAllReduceExtended``).

    Attributes read by other parts of polydist (e.g. input auto-sharding):

    * ``_num_workers``: W, the workers in the collective (chief + workers).
    * ``_worker_index`` (TF: ``_id_in_cluster``): this worker's index in ``0..W-1``.
    * ``_num_devices_per_worker``: D.
    * ``_simulated_workers``: the worker indices whose replicas this process
      runs, in order: ``range(W)`` on the sim, ``(worker_index,)`` on an engine
      with one process per worker. A ``PerReplica`` fed to ``run`` holds one
      component per replica of these workers, worker-major.
    * ``_worker_devices_by_worker``: every worker's D devices, by worker index.
    """

    _per_replica_input: ClassVar[bool] = False  # TF's CollectiveAllReduceExtended raises

    def __init__(
        self,
        container_strategy: Strategy,
        cluster_resolver: ClusterResolver | None,
        communication_options: CommunicationOptions | None,
        backend: str | Backend | None,
    ) -> None:
        if cluster_resolver is None:
            cluster_resolver = TFConfigClusterResolver()
        if not isinstance(cluster_resolver, ClusterResolver):
            raise TypeError(
                "cluster_resolver must be a polydist.cluster_resolver.ClusterResolver (e.g. "
                f"TFConfigClusterResolver()), got {type(cluster_resolver).__name__}."
            )
        if communication_options is None:
            communication_options = CommunicationOptions()
        if not isinstance(communication_options, CommunicationOptions):
            raise TypeError(
                "communication_options must be a polydist.experimental.CommunicationOptions, "
                f"got {type(communication_options).__name__} {communication_options!r}."
            )
        resolved = get_backend(backend)
        self._cluster_resolver = cluster_resolver
        self._communication_options: CommunicationOptions = communication_options
        self._rpc_layer = cluster_resolver.rpc_layer

        spec = normalize_cluster_spec(cluster_resolver.cluster_spec())
        device_type, count = self._local_device_count(cluster_resolver, resolved)
        self._local_device_type = device_type
        self._num_devices_per_worker = count
        if spec:
            self._init_multi_worker(cluster_resolver, spec, resolved)
        else:
            self._init_local()
        run_devices = [
            d for w in self._simulated_workers for d in self._worker_devices_by_worker[w]
        ]
        super().__init__(container_strategy, resolved, run_devices)

    def _init_local(self) -> None:
        # TF's _initialize_local: one worker, this machine's devices, no task.
        self._cluster_spec: ClusterSpec | None = None
        self._task_type: str | None = None
        self._task_id: int | None = None
        self._num_workers = 1
        self._id_in_cluster = 0
        self._is_chief = True
        self._worker_device = canonicalize("/device:CPU:0")
        devices = tuple(
            canonicalize(f"/device:{self._local_device_type}:{i}")
            for i in range(self._num_devices_per_worker)
        )
        self._worker_devices_by_worker: tuple[tuple[str, ...], ...] = (devices,)
        self._simulated_workers: tuple[int, ...] = (0,)

    def _init_multi_worker(
        self, resolver: ClusterResolver, spec: ClusterSpec, backend: Backend
    ) -> None:
        task_type, task_id = resolver.task_type, resolver.task_id
        if task_type is None or task_id is None:
            raise ValueError(
                "When `cluster_spec` is given, you must also specify `task_type` and `task_id`: "
                f"the cluster is {spec} but task_type={task_type!r}, task_id={task_id!r}. Set "
                '"task": {"type": "worker", "index": i} in TF_CONFIG or pass them to the resolver.'
            )
        self._cluster_spec = spec
        self._task_type = task_type
        self._task_id = int(task_id)
        self._num_workers = worker_count(spec, task_type)
        if not self._num_workers:
            raise ValueError(
                f"No `worker`, `chief` or `evaluator` tasks can be found in `cluster_spec` {spec}."
            )
        self._id_in_cluster = id_in_cluster(spec, task_type, self._task_id)
        self._is_chief = is_chief(spec, task_type, self._task_id)
        self._worker_device = f"/job:{task_type}/replica:0/task:{self._task_id}/device:CPU:0"

        tasks = _collective_tasks(spec, task_type, self._task_id)
        kind, count = self._local_device_type, self._num_devices_per_worker
        by_worker = tuple(
            tuple(f"/job:{job}/replica:0/task:{t}/device:{kind}:{i}" for i in range(count))
            for job, t in tasks
        )
        if len(tasks) == 1 and not backend.capabilities.has("multi_worker"):
            # One worker needs no cluster: use this machine's names on any backend.
            by_worker = (tuple(canonicalize(f"/device:{kind}:{i}") for i in range(count)),)
            self._worker_device = canonicalize("/device:CPU:0")
            self._simulated_workers = (0,)
        else:
            # Each worker's host CPU is declared too: host tensors live there.
            with_hosts = [
                list(dict.fromkeys((f"/job:{job}/replica:0/task:{t}/device:CPU:0", *devices)))
                for (job, t), devices in zip(tasks, by_worker)
            ]
            self._simulated_workers = connect_cluster(
                backend, with_hosts, self._id_in_cluster, what="MultiWorkerMirroredStrategy"
            )
        self._worker_devices_by_worker = by_worker

    def _local_device_count(self, resolver: ClusterResolver, backend: Backend) -> tuple[str, int]:
        """The device type and count D of each worker (TF's rule; a subclass may override)."""
        return _local_device_count(resolver, backend)

    # -- the worker's view ------------------------------------------------------------
    @property
    def _num_replicas_in_sync(self) -> int:
        return self._num_workers * self._num_devices_per_worker

    @property
    def _worker_index(self) -> int:
        return self._id_in_cluster

    @property
    def _local_replica_range(self) -> range:
        """This worker's replicas among the replicas this process runs."""
        start = self._simulated_workers.index(self._id_in_cluster) * self._num_devices_per_worker
        return range(start, start + self._num_devices_per_worker)

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """This worker's devices (``/job:worker/replica:0/task:i/device:GPU:d``)."""
        return self._worker_devices_by_worker[self._id_in_cluster]

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The devices this worker keeps variables on (its ``worker_devices``)."""
        return self.worker_devices

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker should save checkpoints: the chief only."""
        return self._is_chief

    @property
    def should_save_summary(self) -> bool:
        """Whether this worker should write summaries: the chief only."""
        return self._is_chief

    @property
    def experimental_should_init(self) -> bool:
        """Whether this worker initializes variables (every worker does)."""
        return True

    @property
    def experimental_between_graph(self) -> bool:
        """True: each worker runs its own copy of the program."""
        return True

    def _in_multi_worker_mode(self) -> bool:
        """Whether more than one worker takes part."""
        return self._num_workers > 1

    def _runs_other_workers(self) -> bool:
        return len(self._simulated_workers) > 1

    # -- running ----------------------------------------------------------------------
    def _call_for_each_replica(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if not self._runs_other_workers():
            return super()._call_for_each_replica(fn, args, kwargs)
        wrapped = InReplicaContext(fn, _SimulatedWorkerReplicaContext)
        return super()._call_for_each_replica(wrapped, args, kwargs)

    def _run_devices(self) -> tuple[str, ...]:
        # A simulated cluster runs every worker's replicas here, replica r on the r-th.
        return self._devices if self._runs_other_workers() else self.worker_devices

    def _local_results(self, value: Any) -> tuple[Any, ...]:
        if not self._runs_other_workers():
            return super()._local_results(value)
        local = self._local_replica_range
        if isinstance(value, DistributedValues):
            if len(value.values) == len(self._devices):
                return value.values[local.start : local.stop]
            return value.values
        selected = select_replicas(local, value)
        return (value,) if selected is None else selected

    # -- reductions: the group this worker reduces over -------------------------------------
    def _check_reduce_components(self, value: DistributedValues) -> None:
        if (
            self._runs_other_workers()
            and not isinstance(value, Mirrored)
            and len(value.values) != len(self._devices)
        ):
            raise ValueError(
                f"Cannot reduce a {type(value).__name__} with {len(value.values)} components "
                f"across this simulated cluster of {self._num_workers} workers x "
                f"{self._num_devices_per_worker} devices: the sim runs every worker in this "
                f"process, so it needs one component per replica of every worker "
                f"({len(self._devices)}), as strategy.run returns. experimental_local_results "
                "gives only this worker's components; reduce the value strategy.run returned."
            )
        super()._check_reduce_components(value)

    def _host_group(self) -> _cross_device_ops.ReplicaGroup | None:
        # TF reduces a host tensor with a collective among the workers' host CPUs: each
        # worker contributes its copy once, so SUM is W * value and MEAN is value.
        if self._num_workers == 1:
            return None
        if not self._runs_other_workers():
            raise NotImplementedError(
                f"Reducing a host value across {self._num_workers} workers needs the backend "
                f"{self._backend_name()!r} to run a cross-process collective, which it does "
                "not provide yet. Reduce a distributed value (the output of strategy.run)."
            )
        hosts = tuple(
            f"/job:{job}/replica:0/task:{t}/device:CPU:0"
            for job, t in _collective_tasks(self._cluster_spec, self._task_type, self._task_id)
        )
        return _cross_device_ops.ReplicaGroup(
            self._backend,
            tuple(hosts[w] for w in self._simulated_workers),
            self._num_workers,
            hosts,  # the workers' host CPUs, not every replica
        )

    def _reduce_host_value(self, reduce_op: ReduceOp, value: Any, destinations: Any) -> Any:
        group = self._host_group()
        assert group is not None
        array = convert_to_array(value)
        copies = [array] * len(group.devices)  # this process's workers' copies
        total = _cross_device_ops.reduce_over_group(group, reduce_op, copies, self._worker_device)
        return self._to_destinations(total, destinations)


class _SimulatedWorkerReplicaContext(ReplicaContext):
    """A replica of a simulated worker: its id counts the replicas of all workers."""

    @property
    def devices(self) -> tuple[str, ...]:
        """Deprecated in TF: the device this replica runs on (on whichever worker)."""
        assert self._replica_index is not None
        return (self._strategy.extended._devices[self._replica_index],)


def _collective_tasks(
    spec: ClusterSpec | None, task_type: str | None, task_id: int | None
) -> list[tuple[str, int]]:
    """The (job, task) of each worker in the collective, by worker index."""
    if spec is None or task_type is None:
        return [("localhost", 0)]
    if task_type == "evaluator":
        return [("evaluator", int(task_id or 0))]
    tasks: list[tuple[str, int]] = []
    for job in ("chief", "worker"):
        if job not in spec.jobs:
            continue
        indices = spec.task_indices(job)
        if indices != list(range(len(indices))):
            raise ValueError(
                f"Job {job!r} has task indices {indices}; a multi-worker cluster needs them "
                f"numbered 0..{len(indices) - 1} (worker ids are derived from them)."
            )
        tasks.extend((job, i) for i in indices)
    return tasks


def _local_device_count(resolver: ClusterResolver, backend: Backend) -> tuple[str, int]:
    """TF's ``_initialize_local_devices``: the device type and count of each worker."""
    if isinstance(resolver, TFConfigClusterResolver):
        # TF counts this machine's GPUs here (TFConfigClusterResolver cannot count them).
        gpus = 0
        for d in backend.list_devices():
            spec = DeviceSpec.parse(d)
            if spec.device_type == "GPU" and spec.job == "localhost" and spec.task == 0:
                gpus += 1
        return ("GPU", gpus) if gpus else ("CPU", 1)
    accelerators = resolver.num_accelerators()
    if accelerators.get("GPU", 0):
        return "GPU", int(accelerators["GPU"])
    if accelerators.get("TPU", 0):
        return "TPU", int(accelerators["TPU"])
    return "CPU", 1


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous training across workers, each with one or more devices.

    Like ``MirroredStrategy``, but the replicas span every worker of a cluster:
    variables are mirrored on all of them and gradients are all-reduced across
    all ``num_replicas_in_sync = workers x devices per worker`` replicas.

    This object represents the current task (``cluster_resolver.task_type`` /
    ``task_id``): ``extended.worker_devices`` and ``experimental_local_results``
    are this worker's. On the simulator all workers run in this process: one
    ``run`` runs every worker's replicas, so you can see the whole cluster's
    collectives on a laptop. Disagreeing collectives raise
    ``CollectiveMismatchError`` at once (``timeout_seconds`` never fires).

    Args:
        cluster_resolver: a `polydist.cluster_resolver.ClusterResolver`;
            default ``TFConfigClusterResolver()``, which reads ``TF_CONFIG``.
            With no cluster (no ``TF_CONFIG``) there is one worker.
        communication_options: a `polydist.experimental.CommunicationOptions`.
        backend: a backend name or object (or a backend's
            `polydist.backend.SupportsWorkerProcesses`, such as
            ``polydist_jax.JaxWorkerProcesses(jit=False)``); else
            ``$POLYDIST_BACKEND``, else ``sim``. It picks the engine:
            ``"sim"`` simulates every worker of the cluster in this process;
            ``"torch"`` (``torch.distributed``) and ``"jax"``
            (``jax.distributed``) run one process per worker when the cluster
            has several workers or ``local_devices`` is given (see
            ``docs/multi-host.md``). Without ``cluster_resolver`` the cluster
            comes from ``TF_CONFIG``, else from the launcher of such an engine
            (``polydist launch``, ``torchrun``).
        local_devices: replicas per worker on an engine with one process per
            worker (a polydist extension): the first N accelerators, or N
            virtual CPU replicas. Default (TF's rule): every GPU, else one CPU.
    """

    # The compat.v1 strategy subclass builds its StrategyExtended subclass here.
    _extended_class: ClassVar[type[MultiWorkerExtended]] = MultiWorkerExtended

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        *,
        backend: str | Backend | SupportsWorkerProcesses | None = None,
        local_devices: int | None = None,
    ) -> None:
        _check_local_devices(local_devices)
        self._requested_local_devices = local_devices
        processes = worker_processes(backend)
        if processes is not None:
            cluster = processes.worker_cluster(cluster_resolver, communication_options)
            cluster_resolver = cluster.resolver
            an_engine = backend is not None and not isinstance(backend, str)
            if an_engine or local_devices is not None or _several_workers(cluster_resolver):
                from polydist._distributed.multi_process import MultiProcessExtended

                engine = processes.worker_process_engine(cluster, local_devices)
                super().__init__(
                    MultiProcessExtended(self, cluster_resolver, communication_options, engine)
                )
                return
        if local_devices is not None:
            raise ValueError(
                f"local_devices={local_devices} needs a backend with one process per worker "
                f"(torch, jax), but backend {backend or 'from $POLYDIST_BACKEND or default'!r} "
                "declares none. On the sim, each worker has this machine's GPUs "
                "(SimBackend(num_gpus=...)) or cluster_resolver.num_accelerators()."
            )
        # No SupportsWorkerProcesses here: a backend name or object.
        plain = cast("str | Backend | None", backend)
        super().__init__(self._extended_class(self, cluster_resolver, communication_options, plain))

    @property
    def extended(self) -> MultiWorkerExtended:
        """A `MultiWorkerExtended` with additional methods."""
        extended = self._extended
        assert isinstance(extended, MultiWorkerExtended)
        return extended

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The cluster resolver: ``cluster_spec()``, ``task_type``, ``task_id``, ...."""
        return self.extended._cluster_resolver


def _check_local_devices(local_devices: Any) -> None:
    if local_devices is not None and (
        isinstance(local_devices, bool) or not isinstance(local_devices, int)
    ):
        raise TypeError(
            f"local_devices must be a positive int or None, got "
            f"{type(local_devices).__name__} {local_devices!r}."
        )
    if local_devices is not None and local_devices < 1:
        raise ValueError(f"local_devices must be >= 1, got {local_devices}.")


def _several_workers(resolver: ClusterResolver) -> bool:
    """Whether ``resolver`` names a cluster of several workers with this task in it
    (a task left out is the strategy's error to report)."""
    spec = normalize_cluster_spec(resolver.cluster_spec())
    task_type = resolver.task_type
    if not spec or task_type is None or resolver.task_id is None:
        return False
    return worker_count(spec, task_type) > 1


class _ExperimentalMeta(type):
    # TF: any MultiWorkerMirroredStrategy is an instance of the experimental name too.
    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, MultiWorkerMirroredStrategy)


class ExperimentalMultiWorkerMirroredStrategy(
    MultiWorkerMirroredStrategy, metaclass=_ExperimentalMeta
):
    """Deprecated ``tf.distribute.experimental.MultiWorkerMirroredStrategy``.

    Use ``polydist.MultiWorkerMirroredStrategy``. As in TF, this takes the
    communication implementation first and the cluster resolver second, and
    every ``MultiWorkerMirroredStrategy`` is an instance of it.
    """

    def __init__(
        self,
        communication: CommunicationImplementation | str = CommunicationImplementation.AUTO,
        cluster_resolver: ClusterResolver | None = None,
        *,
        backend: str | Backend | None = None,
    ) -> None:
        options = CommunicationOptions(implementation=communication)
        super().__init__(cluster_resolver, options, backend=backend)
