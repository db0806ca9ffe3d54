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
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol, TypeVar, cast

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
from polydist._collectives.check import (
    CollectiveChecker,
    Pending,
    SignatureStore,
    checks_enabled,
)
from polydist._distributed.cluster import InReplicaContext
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
    Capabilities,
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
        if self._replica_offset == 0:
            return super()._call_for_each_replica(fn, args, kwargs)
        wrapped = InReplicaContext(fn, _WorkerReplicaContext)
        return super()._call_for_each_replica(wrapped, args, kwargs)

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


# -- liveness: heartbeats through the engine's key-value store --------------------------------

#: How often each worker writes its heartbeat.
HEARTBEAT_SECONDS = 0.5
# How long the survivors watch the heartbeats after a failure before naming the dead.
_SILENCE_SECONDS = 4 * HEARTBEAT_SECONDS


class HeartbeatStore(Protocol):
    """The cluster's key-value store (torch's ``TCPStore``, JAX's coordination service)."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> str | None:
        """The value, or ``None`` if the key is not set."""
        ...

    def delete(self, key: str) -> None: ...


class Heartbeat:
    """A daemon thread that writes ``"<beat> <collectives>"`` under ``hb/<worker>`` every
    `HEARTBEAT_SECONDS` and watches the other workers' entries.

    When a collective fails, `diagnose` tells the workers whose heartbeat stopped
    (dead, hung or cut off) from those alive but behind (they have not entered
    this worker's current collective). The store lives in worker 0's process:
    when it is unreachable, worker 0 is the one gone.
    """

    def __init__(
        self,
        make_store: Callable[[], HeartbeatStore],
        rank: int,
        world_size: int,
        collectives: Callable[[], int | None],
    ) -> None:
        self._make_store = make_store
        self._rank = rank
        self._others = [r for r in range(world_size) if r != rank]
        self._collectives = collectives
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._store_error: BaseException | None = None
        # worker -> (its last entry (beat, collectives), when it last changed)
        self._seen: dict[int, tuple[tuple[int, int], float]] = {}
        self._started = self._watched = time.monotonic()  # _watched: the last look
        self._chores: list[Callable[[HeartbeatStore], None]] = []
        self._thread = threading.Thread(
            target=self._loop, name=f"polydist-heartbeat-{rank}", daemon=True
        )
        self._thread.start()

    def _loop(self) -> None:
        try:
            store = self._make_store()
            beat = 0
            while not self._stop.is_set():
                count = self._collectives()
                if count is None:  # the group is gone
                    return
                beat += 1
                store.set(f"hb/{self._rank}", f"{beat} {count}")
                self._watch(store)
                for chore in list(self._chores):
                    chore(store)
                self._stop.wait(HEARTBEAT_SECONDS)
        except Exception as e:  # the store (worker 0) is gone, or the process is exiting
            with self._lock:
                self._store_error = e

    def _watch(self, store: HeartbeatStore) -> None:
        now = time.monotonic()
        for r in self._others:
            value = store.get(f"hb/{r}")
            if value is None:
                continue
            beat, count = (int(x) for x in value.split())
            with self._lock:
                previous = self._seen.get(r)
                if previous is None or previous[0] != (beat, count):
                    self._seen[r] = ((beat, count), now)
        with self._lock:
            self._watched = now

    def add_chore(self, chore: Callable[[HeartbeatStore], None]) -> None:
        """Runs ``chore(store)`` after each beat, on the heartbeat's thread and store
        connection (it must be quick: a late beat looks like a dead worker)."""
        self._chores.append(chore)

    def silent(self, seconds: float = 2 * _SILENCE_SECONDS) -> list[int]:
        """The workers whose heartbeat this thread has seen unchanged for ``seconds`` (dead,
        hung or cut off); ``[0]`` when the store (worker 0's) is unreachable. Does not wait.
        Measured against this thread's own last look, so a starved thread names nobody."""
        with self._lock:
            if self._store_error is not None:
                return [0] if self._rank != 0 else []
            now = self._watched
            if now - self._started < seconds:
                return []
            return [
                r
                for r in self._others
                if (seen := self._seen.get(r)) is None or now - seen[1] > seconds
            ]

    def diagnose(self, collectives: int) -> tuple[list[int], list[int]]:
        """(dead, behind) after a failed collective, this worker's number ``collectives``.

        Sleeps ~2 s so that every live worker writes fresh heartbeats first.
        """
        if not self._others:
            return [], []
        failed_at = time.monotonic()
        time.sleep(_SILENCE_SECONDS)
        # A beat written just before a worker died may be read up to one interval later.
        since = failed_at + 1.2 * HEARTBEAT_SECONDS
        with self._lock:
            if self._store_error is not None:
                return ([0] if self._rank != 0 else []), []
            latest = {
                r: seen[0] if (seen := self._seen.get(r)) is not None and seen[1] > since else None
                for r in self._others
            }
        dead = [r for r in self._others if latest[r] is None]
        behind = [r for r in self._others if (v := latest[r]) is not None and v[1] < collectives]
        return dead, behind

    def stop(self, wait: float = 0.0) -> None:
        """Stops the thread; waits up to ``wait`` s for it to end (call it at exit: a
        daemon thread killed inside an engine's C++ call can abort the process)."""
        self._stop.set()
        if wait > 0 and self._thread is not threading.current_thread():
            self._thread.join(wait)


def describe_workers(
    ranks: Sequence[int], names: Sequence[str], addresses: Sequence[str] = ()
) -> str:
    """``"1 (/job:worker/replica:0/task:1 at host:port)"`` for each worker, comma-separated."""
    parts = []
    for r in ranks:
        where = f" at {addresses[r]}" if r < len(addresses) and addresses[r] else ""
        parts.append(f"{r} ({names[r]}{where})" if r < len(names) else str(r))
    return ", ".join(parts)


# -- the engines' halves ---------------------------------------------------------------------


class ClusterStore(HeartbeatStore, SignatureStore, Protocol):
    """The cluster's key-value store, as the heartbeat and the collective check use it."""


class ClusterMembership:
    """This process's membership in a cluster of worker processes, which an engine
    subclasses: the workers (``names`` and ``addresses`` by worker index), how many
    collectives this process has entered, its heartbeat and collective check (`watch`),
    the failure that ended the cluster, and how messages name the workers.

    A collective runs through `call`; the engine's errors in it (``engine_errors``)
    become polydist's through the engine's `translate`.
    """

    #: What the engine raises when a collective, or the store, fails.
    engine_errors: ClassVar[tuple[type[Exception], ...]] = (Exception,)

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        timeout: float,
        names: Sequence[str],
        addresses: Sequence[str],
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.names = list(names)
        self.addresses = list(addresses)
        self.collectives = 0  # how many collectives this process has entered
        # At the collective check of the next one: its heartbeat counts it as reached,
        # or a peer waiting there for a stuck third would look behind too.
        self.entering = False
        self.failure: errors.OpError | None = None
        self.heartbeat: Heartbeat | None = None
        self.checker: CollectiveChecker | None = None

    def watch(
        self,
        make_store: Callable[[], ClusterStore],
        *,
        check_timeout: float | None = None,
        overlap_writes: bool = False,
    ) -> None:
        """Starts the heartbeat (whose thread makes its own store) and the collective
        check (on another ``make_store()``), which waits ``check_timeout`` (default
        ``timeout``) for the others' signatures."""
        me = weakref.ref(self)

        def collectives() -> int | None:
            member = me()
            return None if member is None else member.collectives + member.entering

        self.heartbeat = Heartbeat(make_store, self.rank, self.world_size, collectives)
        self.checker = CollectiveChecker(
            make_store(),
            self.rank,
            self.world_size,
            timeout=self.timeout if check_timeout is None else check_timeout,
            heartbeat=self.heartbeat,
            names=self.names,
            addresses=self.addresses,
            enabled=checks_enabled(),
            overlap_writes=overlap_writes,
        )

    # -- collectives ---------------------------------------------------------------------------
    def check_signature(
        self,
        op: str,
        dtype: Any = None,
        shape: Sequence[int] = (),
        axis: int | None = None,
        payload: str = "",
    ) -> list[str] | None:
        """Before collective ``op`` of an array of ``dtype`` and ``shape`` (``dtype=None``:
        ``op`` alone): raises ``CollectiveMismatchError`` unless every worker is about to run
        the same one (see ``polydist._collectives.check``); a missing peer or store fails
        the cluster (`failed`). Returns every worker's ``payload`` (rank order), or
        ``None`` when nothing was compared."""
        return self.checked(op, dtype, shape, axis, lambda: None, payload)[1]

    def checked(
        self,
        op: str,
        dtype: Any,
        shape: Sequence[int],
        axis: int | None,
        prepare: Callable[[], _T],
        payload: str = "",
        parts: Sequence[Sequence[int]] | None = None,
    ) -> tuple[_T, list[str] | None]:
        """`check_signature`, running ``prepare()`` (the caller's work before the
        collective) while this worker's signature travels: (its result, the payloads).
        ``parts``: the shapes of the arrays packed into the collective, if several."""
        if self.checker is None or self.failure is not None:
            # no store to compare through (or `call` raises the failure)
            return prepare(), None
        self.entering = True
        try:
            pending = self.checker.publish(op, dtype, shape, axis, payload, parts)
            prepared = prepare()
            return prepared, self.checker.confirm(pending)
        except errors.CollectiveMismatchError:
            raise  # no worker issued it: the cluster is still usable
        except self.engine_errors as e:
            self.collectives += 1  # the collective it was entering, for the diagnosis
            raise self.failed(op, e) from e
        finally:
            self.entering = False

    def announce(self, op: str) -> Pending | None:
        """For an engine that compares the workers' digests of collective ``op`` in a
        collective of its own (cheaper than the store's round trip): numbers ``op`` as the
        check does, without a store round trip (`CollectiveChecker.announce`). `settle`
        follows once that exchange completed; `publish_late` meanwhile, if it is slow.
        ``None``: no check."""
        if self.checker is None or self.failure is not None:
            return None
        try:
            return self.checker.announce(op)
        except self.engine_errors as e:
            self.collectives += 1
            raise self.failed(op, e) from e

    def publish_late(self, pending: Pending | None) -> None:
        """`announce`'s signature, written after all, so that a peer at another collective
        raises ``CollectiveMismatchError`` (safe from another thread; errors are dropped:
        the engine's own wait reports a gone store)."""
        if self.checker is not None:
            try:
                self.checker.publish_late(pending)
            except Exception:
                pass

    def settle(self, pending: Pending | None) -> None:
        """`announce`'s collective completed on every worker (`CollectiveChecker.settled`)."""
        if self.checker is not None:
            self.checker.settled(pending)

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, collective ``what``; an engine error in it fails the cluster (`failed`),
        and once failed, no collective runs."""
        if self.failure is not None:
            raise type(self.failure)(
                f"{what} cannot run: the cluster failed earlier and cannot be used any more "
                f"({self.failure}). Stop every worker and restart them."
            )
        self.collectives += 1
        try:
            return fn()
        except self.engine_errors as e:
            raise self.failed(what, e) from e

    def failed(self, what: str, err: BaseException) -> errors.OpError:
        """Records and returns `translate`'s error for ``err``, which ended ``what``: the
        cluster's failure."""
        self.failure = self.translate(what, err)
        return self.failure

    def translate(self, what: str, err: BaseException) -> errors.OpError:
        """The ``UnavailableError`` or ``DeadlineExceededError`` for the engine's ``err``,
        which ended collective ``what``, naming the workers at fault (`diagnose`)."""
        raise NotImplementedError(f"{type(self).__name__} must implement translate")

    # -- naming the workers ----------------------------------------------------------------
    def diagnose(self, collectives: int | None = None) -> tuple[list[int], list[int]]:
        """(dead, behind) after collective number ``collectives`` (default: the latest) failed:
        see `Heartbeat.diagnose`; nobody without a heartbeat."""
        if self.heartbeat is None:
            return [], []
        return self.heartbeat.diagnose(self.collectives if collectives is None else collectives)

    def describe(self, ranks: Sequence[int]) -> str:
        """`describe_workers` of this cluster's workers ``ranks``."""
        return describe_workers(ranks, self.names, self.addresses)

    def collective(self, what: str, n: int | None = None) -> str:
        """How messages name collective number ``n`` (default: the latest), ``what``."""
        n = self.collectives if n is None else n
        return f"{what} (collective #{n} of worker {self.rank}) across {self.world_size} workers"

    def unavailable(self, dead: Sequence[int]) -> str:
        """Why messages name the ``dead`` workers of `diagnose`."""
        return (
            f"worker(s) {self.describe(dead)} unavailable: its process stopped sending "
            "heartbeats (it exited, crashed, hung or lost its network)"
        )

    def behind(self, late: Sequence[int]) -> str:
        """Why messages name the ``late`` workers (``behind``) of `diagnose`."""
        return (
            f"worker(s) {self.describe(late)} are alive but did not reach it (they are stuck, "
            "slower than the timeout, or running different collectives)"
        )

    def close(self, wait: float = 0.0) -> None:
        """Leaves the collective check (unless the cluster failed) and stops the heartbeat,
        waiting up to ``wait`` s for its thread (see `Heartbeat.stop`)."""
        if self.checker is not None and self.failure is None:
            self.checker.leave()  # a peer still at a collective raises CollectiveMismatchError
        if self.heartbeat is not None:
            self.heartbeat.stop(wait)


_T = TypeVar("_T")


def once_per_process(make: Callable[[], _T]) -> Callable[[], _T]:
    """A function that returns the one ``make()`` of this process, made on its first call
    (thread-safe): an engine's shared backend, its watchdog."""
    made: list[_T] = []
    lock = threading.Lock()

    def get() -> _T:
        with lock:
            if not made:
                made.append(make())
            return made[0]

    return get


def process_capabilities(capabilities: Capabilities) -> Capabilities:
    """An engine backend's ``capabilities`` with one process per worker: ``multi_worker``;
    no simulated clusters; no exact reduction order (the engine's sum across workers)."""
    return dataclasses.replace(
        capabilities, multi_worker=True, reduction_orders=(), simulated_clusters=False
    )
