"""The backend seam: the small typed interface every backend implements.

Core owns every semantic rule (contexts, regrouping, reduce-axis rules, the
MEAN dtype rule, error messages). A backend owns devices, placement, running
the replica function, and the collectives. See ``docs/extending.md``.

Core owns the execution model (``Capabilities.execution_model``):

* **eager** (sim, torch): core runs ``fn`` once per replica itself, with
  :class:`polydist.backend.EagerReplicaRunner`, which rendezvouses the replicas
  at every collective and ``merge_call`` and calls the backend's list
  collectives (``all_reduce``, ``all_gather``, ...) with one value per replica.
  The backend supplies devices, placement and collectives; it may configure
  the runner (`SupportsReplicaRunner`).
* **spmd** (jax, torch-xla): core calls the backend's ``run_replicas(group,
  fn, per_replica_args)`` (`SupportsCompiledRun`) with the `ReplicaGroup` to
  run, a frozen description built once per strategy. It traces ``fn`` once
  for all replicas (``jax.shard_map``), installs a ``ReplicaContext`` whose
  :class:`ReplicaChannel` turns collectives into compiled ops
  (``lax.psum``), and runs ``merge_fn`` in a cross-replica context over
  per-replica values that are traced.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast, runtime_checkable

from polydist._base.packing import pack_by_dtype as pack_by_dtype
from polydist._base.packing import pack_by_size as pack_by_size
from polydist.errors import BackendNotFoundError

if TYPE_CHECKING:
    import numpy as np

    from polydist._base.communication import CommunicationOptions
    from polydist._base.reduce_op import ReduceOp
    from polydist._collectives.cross_device_ops import CrossDeviceOps
    from polydist._strategies.strategy import Strategy
    from polydist.cluster_resolver._base import ClusterResolver
    from polydist.tpu import LocalTPUSystem

__all__ = [
    "Backend",
    "Capabilities",
    "ClusterBackend",
    "ClusterToJoin",
    "Features",
    "ReplicaChannel",
    "SupportsBatchAllReduce",
    "SupportsCrossDeviceOps",
    "SupportsLocalTPUSystem",
    "SupportsPlacePerReplica",
    "SupportsReductionOrder",
    "SupportsSimulatedDevices",
    "SupportsStoreVariable",
    "SupportsSymbolicValues",
    "SupportsWorkerProcesses",
    "WorkerProcessBackend",
    "ReplicaGroup",
    "SupportsCompiledRun",
    "SupportsReplicaRunner",
    "available_backends",
    "backends_owning",
    "features",
    "get_backend",
    "get_backend_for_value",
    "is_symbolic",
    "local_tpu_system",
    "replica_group",
]

ENTRY_POINT_GROUP = "polydist.backends"
#: Entry points ``NAME = "module:Type"``: backend ``NAME`` owns the arrays of ``Type``
#: (e.g. ``torch = "torch:Tensor"``). Read without importing ``module``: see `backends_owning`.
ARRAY_TYPES_GROUP = "polydist.array_types"
#: Entry points ``NAME = "module:object"``: backend ``NAME`` runs ``MultiWorkerMirroredStrategy``
#: with one process per worker; ``object`` is its `SupportsWorkerProcesses`. Loaded without
#: creating the backend (JAX must join its cluster before its devices start).
WORKER_PROCESSES_GROUP = "polydist.worker_processes"
ENV_VAR = "POLYDIST_BACKEND"
DEFAULT_BACKEND = "sim"

# Where to get the backends we know of, for the "not installed" message. The sim is
# part of core (polydist._sim); the others are extras: polydist[jax], polydist[torch].
KNOWN_PACKAGES = {"sim": "polydist", "jax": "polydist-jax", "torch": "polydist-torch"}
# The same from a polydist checkout, where the backend packages are installed by path.
CHECKOUT_PATHS = {
    "sim": "./packages/core",
    "jax": "./packages/backend-jax",
    "torch": "./packages/backend-torch",
}


def install_hint(name: str) -> str:
    """How to install backend ``name``: ``"pip install polydist-jax (from a polydist
    checkout: pip install ./packages/backend-jax)"``."""
    package = KNOWN_PACKAGES.get(name)
    if package is None:
        return f"install the package that provides the {name!r} backend"
    return f"pip install {package} (from a polydist checkout: pip install {CHECKOUT_PATHS[name]})"


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports, declared up front (never probed with ``hasattr``).

    The conformance suite turns a missing capability into a skip whose reason
    names it.
    """

    execution_model: Literal["eager", "spmd"] = "eager"
    #: Reduction orders of the sim that this backend reproduces bit for bit
    #: (e.g. ``("sequential",)`` for XLA CPU). Empty: compare within an error bound.
    reduction_orders: tuple[str, ...] = ()
    autodiff: bool = False
    multi_worker: bool = False
    tpu: bool = False
    dynamic_shapes: bool = True
    float64: bool = True
    uneven_gather: bool = True
    #: Collective wall times are real (recorded in traces). False on a simulator.
    measured_timing: bool = True
    extra: tuple[str, ...] = field(default_factory=tuple)
    #: Variables can be read and written inside ``strategy.run`` (replica context).
    #: ``None`` (the default): ``execution_model == "eager"`` (see ``has``). An eager
    #: backend calls each replica in Python, where core handles variables; an SPMD
    #: backend must functionalize them (``polydist.backend.tracing.swap_storage``) and
    #: declare ``True``.
    variables_in_replica_context: bool | None = None
    #: ``TPUStrategy`` and ``MultiWorkerMirroredStrategy`` accept slices and clusters of
    #: any shape (``TPUClusterResolver("v4-32")``, a ``TF_CONFIG`` of several workers)
    #: and this process runs every host's and worker's replicas
    #: (``connect_cluster`` returns all workers), as the simulator does. Only
    #: meaningful with ``tpu`` or ``multi_worker``. ``None`` (the default):
    #: ``execution_model == "eager"``; a backend on real TPUs or with one process per
    #: worker declares ``False``.
    simulated_clusters: bool | None = None
    #: ``ReplicaContext.merge_call`` works inside ``strategy.run``, and so does what is
    #: built on it (aggregated variable updates in replica context, variables created
    #: inside ``run``). A backend that cannot run ``merge_fn`` there (the torch-xla SPMD
    #: trace) declares ``False``.
    merge_call: bool = True

    def has(self, name: str) -> bool:
        """Whether the backend declares capability ``name`` (a field or an ``extra`` name).

        A field left at ``None`` takes its derived default (see the field).
        """
        value = getattr(self, name, None)
        if value is None and name in _DERIVED_FROM_EXECUTION_MODEL:
            return self.execution_model == "eager"
        if isinstance(value, bool):
            return value
        return name in self.extra


#: Capabilities whose ``None`` means ``execution_model == "eager"``.
_DERIVED_FROM_EXECUTION_MODEL = ("variables_in_replica_context", "simulated_clusters")


@runtime_checkable
class ReplicaChannel(Protocol):
    """What a ``ReplicaContext`` calls to talk to the other replicas.

    ``values`` are the flattened leaves of one replica's nest, already
    converted to backend arrays. ``all_reduce`` always returns the SUM: core
    derives MEAN from it (true division by the replica count; integers become
    float64), so every backend gets that rule the same way. ``reduce_op`` is
    passed for mismatch diagnostics and tracing only.
    """

    def all_reduce(self, reduce_op: ReduceOp, values: Sequence[Any]) -> list[Any]: ...

    def all_gather(self, values: Sequence[Any], axis: int) -> list[Any]: ...

    def merge_call(
        self,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any: ...


@runtime_checkable
class Backend(Protocol):
    """The contract between polydist's core and an execution engine.

    Devices are canonical TF strings (``/job:localhost/replica:0/task:0/device:GPU:0``).
    Array arguments and results are the backend's own arrays. Cross-replica
    collectives take one value per replica (in replica order) and return the
    result placed on each destination device; ``all_reduce`` and
    ``reduce_to`` compute the SUM (core derives MEAN).

    Optional features are the small ``Supports…`` protocols below (and
    `ClusterBackend`, `WorkerProcessBackend`): a backend implements the methods of
    those it has. Core checks them once per backend (`features`), never by name.

    Running the replicas: an eager backend has nothing to implement (core runs
    them; `SupportsReplicaRunner` configures how); a backend that declares
    ``execution_model="spmd"`` implements `SupportsCompiledRun`.
    """

    name: str
    version: str
    capabilities: Capabilities

    def array_namespace(self) -> Any:
        """The Python array API namespace for this backend's arrays."""
        ...

    def list_devices(self) -> tuple[str, ...]:
        """Every device this backend can place replicas on."""
        ...

    def replica_devices(self, count: int | None) -> tuple[str, ...]:
        """Devices for ``MirroredStrategy(devices=None)`` (``count=None``) or for
        ``MirroredStrategy(count)``: the first ``count`` accelerators."""
        ...

    def validate_devices(self, devices: Sequence[str]) -> None:
        """Raises ``ValueError`` naming any device this backend cannot use."""
        ...

    def device_scope(self, device: str) -> AbstractContextManager[Any]:
        """Makes new arrays land on ``device`` (TF's ``tf.device``)."""
        ...

    def place(self, value: Any, device: str) -> Any:
        """Returns ``value`` (an array, array-like or Python scalar) on ``device``.
        Python scalars follow TF's conversion rule (core passes them already
        converted to NumPy with TF's dtypes)."""
        ...

    def to_numpy(self, value: Any) -> np.ndarray:
        """Copies a backend array to a host NumPy array."""
        ...

    def all_reduce(self, values: Sequence[Any], destinations: Sequence[str]) -> list[Any]:
        """Sums ``values`` and returns the sum on each of ``destinations``."""
        ...

    def reduce_to(self, values: Sequence[Any], destination: str) -> Any:
        """Sums ``values`` onto one ``destination`` device."""
        ...

    def all_gather(
        self, values: Sequence[Any], axis: int, destinations: Sequence[str]
    ) -> list[Any]:
        """Concatenates ``values`` along ``axis`` (sizes on ``axis`` may differ)
        and returns the result on each of ``destinations``."""
        ...

    def broadcast(self, value: Any, destinations: Sequence[str]) -> list[Any]:
        """Copies ``value`` to each of ``destinations``."""
        ...


# -- optional features ------------------------------------------------------------------


@runtime_checkable
class ClusterBackend(Protocol):
    """What a backend declaring ``Capabilities.multi_worker`` or ``.tpu`` implements too."""

    def connect_cluster(
        self, worker_devices: Sequence[Sequence[str]], worker_index: int
    ) -> tuple[int, ...]:
        """Makes the devices of every worker (or TPU host) usable.

        ``worker_devices[w]`` are worker ``w``'s devices, canonical TF strings
        such as ``/job:worker/replica:0/task:1/device:GPU:0``; this process is
        worker ``worker_index``. Returns the (sorted) indices of the workers
        whose replicas this process runs: every worker on a simulator,
        ``(worker_index,)`` on an engine with one process per worker. Raises
        ``ValueError`` naming a device the backend cannot use.
        """
        ...


@runtime_checkable
class WorkerProcessBackend(Protocol):
    """The engine half of ``MultiWorkerMirroredStrategy`` with one process per worker
    (what `SupportsWorkerProcesses.worker_process_engine` returns), besides ``Backend``
    and `ClusterBackend.connect_cluster` (which returns ``(worker_index,)``)."""

    def local_device_count(self, requested: int | None) -> tuple[str, int] | None:
        """This worker's replica device type and count for ``local_devices=requested``;
        ``None`` (only when ``requested`` is None) applies TF's rule."""
        ...

    def broadcast_from_chief(self, value: Any, device: str) -> Any:
        """Worker 0's ``value`` (an array), on ``device`` of every worker (a collective)."""
        ...


@runtime_checkable
class SupportsLocalTPUSystem(Protocol):
    """A backend on real TPUs: the cores it runs ``TPUStrategy`` on (see
    `local_tpu_system`). It must accept ``/job:localhost/replica:0/task:0/device:TPU:k``
    as core ``k``."""

    def local_tpu_system(self) -> LocalTPUSystem | None: ...


@runtime_checkable
class SupportsSymbolicValues(Protocol):
    """A compiling backend: whether ``value`` belongs to a program being compiled (a JAX
    tracer), whose concrete values do not exist yet (see `is_symbolic`)."""

    def is_symbolic(self, value: Any) -> bool: ...


@runtime_checkable
class SupportsBatchAllReduce(Protocol):
    """The ``all_reduce`` of several arrays at once (one replica-context ``all_reduce``
    of a nest), packed into fewer collectives (see `batch_all_reduce`)."""

    def batch_all_reduce(
        self, columns: Sequence[Sequence[Any]], destinations: Sequence[str], bytes_per_pack: int
    ) -> list[list[Any]]: ...


@runtime_checkable
class SupportsPlacePerReplica(Protocol):
    """Places one step's components of a leaf on the replicas' devices at once (the JAX
    backend makes one array sharded over its replica mesh); returns what ``place`` would
    give for each. Without it core calls ``place`` per replica."""

    def place_per_replica(self, values: Sequence[Any], devices: Sequence[str]) -> list[Any]: ...


@runtime_checkable
class SupportsPlacedDtype(Protocol):
    """Says the dtype ``place`` gives a NumPy array of ``dtype`` when it differs (JAX
    without x64 narrows 64-bit types to 32 bits), so a distributed dataset's
    ``element_spec`` describes the values its iterator yields. Without it core
    assumes ``place`` keeps the dtype."""

    def placed_dtype(self, dtype: np.dtype[Any]) -> np.dtype[Any]: ...


@runtime_checkable
class SupportsLibraryScope(Protocol):
    """A backend whose replica device scope makes every array operation cost more
    (torch's default-device function mode passes each torch call, attribute reads
    included, through Python): ``library_scope()`` returns a context manager that core
    enters around its own work in a replica's ``all_reduce`` and ``all_gather``, which
    names its devices itself and so needs no such scope. Without it core enters none."""

    def library_scope(self) -> AbstractContextManager[Any]: ...


@runtime_checkable
class SupportsStoreVariable(Protocol):
    """Decides what a variable component stores when its value becomes ``new`` (torch
    writes into the stored tensor, so a parameter keeps seeing the variable's storage).
    Without it the component stores ``new``."""

    def store_variable(self, stored: Any, new: Any) -> Any: ...


@runtime_checkable
class SupportsUpdateInPlace(Protocol):
    """Applies a variable's ``assign_add``/``assign_sub`` to the stored array itself.

    ``op`` is ``"add"`` or ``"subtract"``; ``delta`` has the variable's dtype, shape and
    device and is never modified; ``exclusive`` says no Python reference to ``stored``
    exists but the variable's. Returns True when ``stored`` now holds ``op(stored,
    delta)`` bit for bit, False to let core store a new array. TF's rule for a resource
    variable's buffer applies: in place only where nothing else can observe the old
    value (``exclusive``, and no view, export or autograd record the backend can see).
    """

    def update_in_place(self, stored: Any, op: str, delta: Any, *, exclusive: bool) -> bool: ...


@runtime_checkable
class SupportsHostArrayCopies(Protocol):
    """``place(value, device)`` always returns a new array for a NumPy ``value`` (never a
    view of it) when ``place_copies_host_arrays`` is True: core then places a variable's
    NumPy initial value directly, without a host copy first."""

    place_copies_host_arrays: bool


@runtime_checkable
class SupportsPlaceVariable(Protocol):
    """Places a variable's value (its initial value, a host value assigned to it) on
    ``device``: a one-off placement, where ``place`` may stage each step's inputs for an
    asynchronous copy (torch stages host arrays for a GPU in page-locked buffers that
    its allocator keeps for the next batch of their size: kept for a variable's initial
    value, such a buffer would hold host memory the size of the state for good).
    Without it core calls ``place``."""

    def place_variable(self, value: Any, device: str) -> Any: ...


@runtime_checkable
class SupportsReductionOrder(Protocol):
    """A backend that sums in a configurable order (the sim): ``MirroredStrategy``'s
    ``cross_device_ops`` picks the order (``with_reduction_order``)."""

    reduction_order: str

    def with_reduction_order(self, reduction_order: Any) -> Backend: ...


@runtime_checkable
class SupportsCrossDeviceOps(Protocol):
    """A backend that configures its collectives from a ``CrossDeviceOps`` itself."""

    def with_cross_device_ops(self, ops: CrossDeviceOps) -> Backend: ...


@runtime_checkable
class SupportsSimulatedDevices(Protocol):
    """A backend whose devices are simulated (the sim): any ``/gpu:K`` below
    ``max_simulated_devices`` exists, and its traces can be priced by a cost model."""

    max_simulated_devices: int


@dataclass(frozen=True)
class Features:
    """The optional features of one backend, checked once (`features`)."""

    cluster: bool = False
    worker_process_engine: bool = False
    local_tpu_system: bool = False
    symbolic_values: bool = False
    batch_all_reduce: bool = False
    place_per_replica: bool = False
    placed_dtype: bool = False
    library_scope: bool = False
    store_variable: bool = False
    reduction_order: bool = False
    cross_device_ops: bool = False
    simulated_devices: bool = False
    update_in_place: bool = False
    places_copies_of_host_arrays: bool = False
    place_variable: bool = False
    compiled_run: bool = False
    direct_run: bool = False
    prepared_run: bool = False
    replica_runner: bool = False

    @staticmethod
    def of(backend: object) -> Features:
        """The features ``backend`` implements, from its type (not cached: see `features`)."""
        return Features(
            cluster=isinstance(backend, ClusterBackend),
            worker_process_engine=isinstance(backend, WorkerProcessBackend),
            local_tpu_system=isinstance(backend, SupportsLocalTPUSystem),
            symbolic_values=isinstance(backend, SupportsSymbolicValues),
            batch_all_reduce=isinstance(backend, SupportsBatchAllReduce),
            place_per_replica=isinstance(backend, SupportsPlacePerReplica),
            placed_dtype=isinstance(backend, SupportsPlacedDtype),
            library_scope=isinstance(backend, SupportsLibraryScope),
            store_variable=isinstance(backend, SupportsStoreVariable),
            reduction_order=isinstance(backend, SupportsReductionOrder),
            cross_device_ops=isinstance(backend, SupportsCrossDeviceOps),
            simulated_devices=isinstance(backend, SupportsSimulatedDevices),
            update_in_place=isinstance(backend, SupportsUpdateInPlace),
            places_copies_of_host_arrays=isinstance(backend, SupportsHostArrayCopies)
            and bool(backend.place_copies_host_arrays),
            place_variable=isinstance(backend, SupportsPlaceVariable),
            compiled_run=isinstance(backend, SupportsCompiledRun),
            direct_run=isinstance(backend, SupportsDirectRun),
            prepared_run=isinstance(backend, SupportsPreparedRun),
            replica_runner=isinstance(backend, SupportsReplicaRunner),
        )


# Backends by id, with a weak reference that tells a reused id apart.
_features: dict[int, tuple[weakref.ref[Any], Features]] = {}


def features(backend: Backend) -> Features:
    """The optional features of ``backend``, checked when it is first seen (when it is
    loaded, for a backend from the registry) and frozen from then on."""
    key = id(backend)
    known = _features.get(key)
    if known is not None and known[0]() is backend:
        return known[1]
    found = Features.of(backend)

    def forget(_: weakref.ref[Any]) -> None:
        _features.pop(key, None)

    try:
        ref = weakref.ref(backend, forget)
    except TypeError:  # not weakly referenceable: checked on each call
        return found
    _features[key] = (ref, found)
    return found


@dataclass(frozen=True, eq=False)
class ReplicaGroup:
    """Who a collective or a run spans, as the strategy supplies it (its group provider).

    For a reduction: one process's replicas, a simulated cluster and one process
    per worker differ here only; the reduction itself is core's ``reduce_over_group``
    for all of them. For ``strategy.run``: what a compiled backend's
    ``run_replicas`` gets (`SupportsCompiledRun`) and what core's
    `EagerReplicaRunner` runs, built once per strategy (`replica_group`).

    Compared and hashed by identity: a backend may key what it caches per strategy by
    the run's group (weakly: it lives as long as its strategy's run state).
    """

    backend: Backend
    #: Where each of this process's values is placed before the engine's SUM; for a
    #: run, the device of each replica this process runs, in replica order.
    devices: tuple[str, ...]
    #: How many values the engine's SUM adds up (every worker's): MEAN's divisor. For a
    #: run, ``num_replicas_in_sync`` (every worker's replicas).
    size: int
    #: What the trace records as the collective's participants; ``None``: nothing.
    participants: tuple[str, ...] | None = None
    #: The SUM crosses processes: announce the reduce op to the workers' agreement
    #: check, and let a batch go to the engine together (packed).
    across_processes: bool = False
    #: For a run: the strategy whose replicas these are (the replicas' ``ReplicaContext``
    #: objects and ``merge_fn``'s cross-replica context belong to it, and its variables).
    strategy: Strategy | None = None
    #: For a run: the id (``replica_id_in_sync_group``) of this process's first replica
    #: among every worker's; 0 in one process.
    replica_offset: int = 0
    #: For a run: the strategy's ``CommunicationOptions`` (multi-worker strategies).
    communication_options: CommunicationOptions | None = None
    #: What core's replica runner keeps for runs of this group (it holds no run's
    #: state: a lone replica's collectives and channel); not part of the group.
    run_cache: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    @property
    def num_replicas_in_sync(self) -> int:
        """Every worker's replicas (``size``)."""
        return self.size


def replica_group(strategy: Strategy) -> ReplicaGroup:
    """The `ReplicaGroup` ``strategy.run`` runs: this process's replicas' devices, the
    replica count, the first replica's id, the communication options. Built once per
    strategy (and set of devices) and reused by every run."""
    return strategy.extended._run_group()


@runtime_checkable
class SupportsCompiledRun(Protocol):
    """How a backend with ``Capabilities.execution_model == "spmd"`` runs ``strategy.run``.

    Core calls ``run_replicas`` instead of its own eager runner. The backend traces
    ``fn`` once for all replicas, each call inside a ``ReplicaContext`` of
    ``group.strategy`` whose channel turns collectives into compiled ones, and returns
    each replica's result in replica order (core regroups them). ``per_replica_args[r]``
    holds the ``(args, kwargs)`` replica ``r`` receives (the same object for every
    replica when nothing is distributed). A backend that cannot compile a call may run it
    with `EagerReplicaRunner` (``runner.run(group, fn, per_replica_args)``).
    """

    def run_replicas(
        self,
        group: ReplicaGroup,
        fn: Callable[..., Any],
        per_replica_args: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
    ) -> list[Any]: ...


class _NotHandled:
    """The type of `NOT_HANDLED`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "polydist.backend.NOT_HANDLED"


#: What `SupportsDirectRun.run_direct` returns for a call it leaves to core's usual path.
NOT_HANDLED: Any = _NotHandled()


@runtime_checkable
class SupportsDirectRun(Protocol):
    """A compiled backend's fast path for a ``strategy.run`` it has run before.

    Core calls ``run_direct(group, fn, args, kwargs)`` first (outside a collective
    trace), with the call's own ``args`` and ``kwargs``; the backend returns the
    call's regrouped result, or `NOT_HANDLED`, and core then takes its usual path
    (``run_replicas``, `regroup`). A backend answers only calls whose every answer it
    learned from core on an earlier call of ``fn``: which replica gets what (core's
    selection of distributed values), and how the results regroup (core's `regroup`
    of that call's results, checked against its own once before it answers alone).
    Core still runs its after-run checks (``ReplicaDivergenceWarning``).
    """

    def run_direct(
        self,
        group: ReplicaGroup,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any: ...


@runtime_checkable
class SupportsPreparedRun(Protocol):
    """A compiled backend's prepared call of one replica function (beside
    `SupportsDirectRun`), for the steps whose host work is the step's pace.

    After ``run_direct`` answered a call ``strategy.run(fn, args)`` (positional
    arguments only), core asks ``prepare_direct(group, fn)`` (a few times at most,
    while it answers None) for a callable ``call(args)``. Core keeps it for the
    strategy's run and, at the start of later ``strategy.run(fn, args)`` calls with
    ``args`` a tuple and no ``kwargs``, in the default context or directly in the
    strategy's own scope, outside a collective trace, calls it first and nothing
    else: it enters no mode and runs no after-run check. So the call must run no
    Python code of the user's nor anything that reads the current strategy, and only
    plans without variables qualify. ``call`` returns the regrouped result, or
    `NOT_HANDLED`: core then forgets it and takes its usual path (``run_direct``
    first).
    """

    def prepare_direct(
        self, group: ReplicaGroup, fn: Callable[..., Any]
    ) -> Callable[[tuple[Any, ...]], Any] | None: ...


class ReplicaRunner(Protocol):
    """Runs an eager ``strategy.run``: ``fn`` once per replica of ``group``, replica
    ``r`` with ``per_replica_args[r]`` (``(args, kwargs)``), in a ``ReplicaContext``
    whose collectives meet the other replicas'; returns the results in replica order.
    Core's `EagerReplicaRunner` is the implementation every in-tree backend uses."""

    def run(
        self,
        group: ReplicaGroup,
        fn: Callable[..., Any],
        per_replica_args: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
    ) -> list[Any]: ...


@runtime_checkable
class SupportsReplicaRunner(Protocol):
    """An eager backend's configuration of core's runner (``execution_model == "eager"``).

    Core runs the replicas with ``replica_runner`` (read at each run); a backend without
    one gets ``EagerReplicaRunner()`` (greenlets, ``$POLYDIST_TIMEOUT_SECONDS``). A
    backend whose engine keeps state per thread asks for ``"thread"`` mode; one whose
    collectives need wrapping (autograd) passes ``wrap_channel``; one that needs work
    around a whole run (carrying the caller's thread state into the replicas) subclasses
    `EagerReplicaRunner` and extends ``run``; any object with that ``run`` method
    (`ReplicaRunner`) will do.
    """

    @property
    def replica_runner(self) -> ReplicaRunner: ...


_lock = threading.Lock()
_instances: dict[str, Backend] = {}
_entry_points: dict[str, importlib.metadata.EntryPoint] | None = None
_array_type_entry_points: tuple[importlib.metadata.EntryPoint, ...] | None = None
_array_types: dict[str, type | None] = {}


@dataclass(frozen=True)
class ClusterToJoin:
    """A worker process's cluster, as its engine joins it (see `SupportsWorkerProcesses`)."""

    resolver: ClusterResolver
    #: Each worker's address by worker index (for messages); empty without a cluster.
    addresses: list[str]
    #: Worker 0's ``host:port``, where the engines meet; ``None`` without a cluster.
    rendezvous: str | None
    #: The bound on joining and on each collective, in seconds.
    timeout: float


@runtime_checkable
class SupportsWorkerProcesses(Protocol):
    """How a backend runs ``MultiWorkerMirroredStrategy`` with one process per worker
    (``torch.distributed``, ``jax.distributed``), where the sim simulates the cluster.

    Declared under the entry-point group ``polydist.worker_processes`` with the
    backend's name, or implemented by a backend object passed as ``backend=`` (an
    engine such as ``TorchProcessGroupBackend``, or a configured provider such as
    ``polydist_jax.JaxWorkerProcesses(jit=False)``). The strategy calls
    ``worker_cluster`` first; when the cluster has several workers (or
    ``local_devices`` is given, or the backend object is an engine), it calls
    ``worker_process_engine`` and runs on the backend that returns: its list
    collectives span every worker's process, and it implements
    ``connect_cluster``, ``local_device_count`` and ``broadcast_from_chief``
    (see ``docs/extending.md``).
    """

    def worker_cluster(
        self,
        cluster_resolver: ClusterResolver | None,
        communication_options: CommunicationOptions | None,
    ) -> ClusterToJoin:
        """The cluster of this process: ``cluster_resolver``, else ``TF_CONFIG``, else the
        environment of the backend's launcher (``torchrun``, ``polydist launch``)."""
        ...

    def worker_process_engine(self, cluster: ClusterToJoin, local_devices: int | None) -> Backend:
        """The backend whose collectives span the worker processes, ready to join
        ``cluster`` (with ``local_devices`` replicas per worker; ``None``: TF's rule)."""
        ...


_worker_processes: dict[str, SupportsWorkerProcesses | None] = {}


def worker_processes(
    backend: str | Backend | SupportsWorkerProcesses | None,
) -> SupportsWorkerProcesses | None:
    """What runs ``MultiWorkerMirroredStrategy(backend=backend)`` with one process per
    worker: a backend object implementing `SupportsWorkerProcesses`, or for a name
    (``None``: ``$POLYDIST_BACKEND``, then ``sim``) its ``polydist.worker_processes``
    entry point. ``None``: the backend declares none (it simulates clusters, or has
    none). The backend itself is not created."""
    if backend is not None and not isinstance(backend, str):
        return backend if isinstance(backend, SupportsWorkerProcesses) else None
    name = backend or os.environ.get(ENV_VAR) or DEFAULT_BACKEND
    if name not in _worker_processes:  # loaded outside _lock: the import may create backends
        eps = importlib.metadata.entry_points(group=WORKER_PROCESSES_GROUP)
        ep = next((e for e in eps if e.name == name), None)
        provider = ep.load() if ep is not None else None
        if ep is not None and not isinstance(provider, SupportsWorkerProcesses):
            raise TypeError(
                f"Entry point {ep.value!r} for backend {name!r} in group "
                f"{WORKER_PROCESSES_GROUP!r} is a {type(provider).__name__}, not a "
                "polydist.backend.SupportsWorkerProcesses."
            )
        _worker_processes[name] = provider
    return _worker_processes[name]


def _discover() -> dict[str, importlib.metadata.EntryPoint]:
    global _entry_points
    if _entry_points is None:
        found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        _entry_points = {ep.name: ep for ep in found}
    return _entry_points


def _array_type_declarations() -> tuple[importlib.metadata.EntryPoint, ...]:
    global _array_type_entry_points
    if _array_type_entry_points is None:
        found = importlib.metadata.entry_points(group=ARRAY_TYPES_GROUP)
        _array_type_entry_points = tuple(sorted(found, key=lambda ep: (ep.name, ep.value)))
    return _array_type_entry_points


def backends_owning(value: Any) -> tuple[str, ...]:
    """The installed backends whose declared array type ``value`` is an instance of, sorted.

    A backend declares its array type with an entry point in the group
    ``polydist.array_types`` (``torch = "torch:Tensor"``, ``jax = "jax:Array"``).
    A type's module is never imported here: a value can only be an instance of
    a type whose module is already imported (in ``sys.modules``), so checking
    a NumPy array never imports torch or JAX. NumPy arrays and Python numbers
    belong to no backend: every backend takes them.
    """
    owners = []
    for ep in _array_type_declarations():
        module = ep.value.split(":", 1)[0].strip()
        if module.split(".", 1)[0] not in sys.modules:
            continue
        if ep.value not in _array_types:
            try:
                loaded = ep.load()
            except (ImportError, AttributeError):
                loaded = None
            _array_types[ep.value] = loaded if isinstance(loaded, type) else None
        cls = _array_types[ep.value]
        if cls is not None and isinstance(value, cls) and ep.name not in owners:
            owners.append(ep.name)
    return tuple(owners)


def get_backend_for_value(value: Any, backend: str | Backend | None = None) -> Backend:
    """The backend for a value created outside any strategy (a plain ``Variable``).

    An explicit ``backend`` wins. Otherwise the backend that `get_backend` resolves
    (``$POLYDIST_BACKEND``, then ``sim``) if ``value`` belongs to no backend or to
    that one; else the backend that owns ``value``'s type (the first by name where
    several do, e.g. ``torch`` before ``torch_xla``): a ``torch.Tensor`` makes a
    torch variable and a ``jax.Array`` a JAX one, with no ``$POLYDIST_BACKEND``.
    """
    if backend is not None:
        return get_backend(backend)
    owners = backends_owning(value)
    name = os.environ.get(ENV_VAR) or DEFAULT_BACKEND
    if not owners or name in owners:
        return get_backend(None)
    return get_backend(owners[0])


def available_backends() -> tuple[str, ...]:
    """Names of the installed backends (entry-point group ``polydist.backends``)."""
    return tuple(sorted(_discover()))


def get_backend(backend: str | Backend | None = None) -> Backend:
    """Resolves a backend: an explicit argument, then ``$POLYDIST_BACKEND``, then ``sim``.

    Backends are loaded lazily from their entry point and cached by name.
    """
    if backend is not None and not isinstance(backend, str):
        if not isinstance(backend, Backend):
            raise TypeError(
                f"backend must be a backend name or an object implementing polydist.backend."
                f"Backend, got {type(backend).__name__}."
            )
        return backend
    name = backend or os.environ.get(ENV_VAR) or DEFAULT_BACKEND
    with _lock:
        cached = _instances.get(name)
        if cached is not None:
            return cached
        entry_points = _discover()
        ep = entry_points.get(name)
        if ep is None:
            installed = ", ".join(sorted(entry_points)) or "none"
            source = (
                "argument backend="
                if backend
                else f"${ENV_VAR}"
                if os.environ.get(ENV_VAR)
                else "default"
            )
            raise BackendNotFoundError(
                f"No polydist backend named {name!r} (from {source}). Installed backends: "
                f"{installed}. To use it, {install_hint(name)}."
            )
        factory = ep.load()
        instance = factory()
        if not isinstance(instance, Backend):
            raise TypeError(
                f"Entry point {ep.value!r} for backend {name!r} did not produce a "
                "polydist.backend.Backend."
            )
        features(instance)
        _instances[name] = instance
        return instance


def local_tpu_system(backend: Backend) -> LocalTPUSystem | None:
    """The TPU cores ``backend`` runs ``TPUStrategy`` on, from `SupportsLocalTPUSystem`;
    ``None`` if it has none (the sim: its TPUs are simulated slices)."""
    from polydist.tpu import LocalTPUSystem

    if not features(backend).local_tpu_system:
        return None
    system = cast(SupportsLocalTPUSystem, backend).local_tpu_system()
    if system is not None and not isinstance(system, LocalTPUSystem):
        raise TypeError(
            f"Backend {backend.name!r}: local_tpu_system() must return a "
            f"polydist.tpu.LocalTPUSystem or None; got {type(system).__name__}."
        )
    return system


def is_symbolic(backend: Backend, value: Any) -> bool:
    """Whether ``value`` is a value of a program ``backend`` is compiling, from
    `SupportsSymbolicValues` (``False`` without it). In a compiled step that spans
    processes every worker runs the same program, so what derives from shapes (a MEAN's
    element count) is the same on every worker."""
    if not features(backend).symbolic_values:
        return False
    return bool(cast(SupportsSymbolicValues, backend).is_symbolic(value))


def batch_all_reduce(
    backend: Backend,
    columns: Sequence[Sequence[Any]],
    destinations: Sequence[str],
    bytes_per_pack: int = 0,
) -> list[list[Any]]:
    """``backend.all_reduce(column, destinations)`` of each column (one array per
    replica), through `SupportsBatchAllReduce` when the backend has it (and there are
    several columns).

    The batch method may pack the columns into fewer collectives, as TF packs a nest
    into one ``all_reduce`` per pack (`pack_by_size`): ``bytes_per_pack`` is
    ``CommunicationOptions.bytes_per_pack`` (0: one pack). Each column's results must
    equal its own ``all_reduce``'s and be arrays of their own to the caller (a result
    may be a view into a packed buffer only if no other result aliases its memory).
    """
    if not features(backend).batch_all_reduce or len(columns) < 2:
        return [backend.all_reduce(column, destinations) for column in columns]
    batched = cast(SupportsBatchAllReduce, backend)
    results = batched.batch_all_reduce(columns, destinations, bytes_per_pack)
    if len(results) != len(columns):
        raise RuntimeError(
            f"Backend {backend.name!r}: batch_all_reduce returned {len(results)} results for "
            f"{len(columns)} columns; it must return one list of per-destination results "
            "per column, in order."
        )
    return results


def _reset_registry_for_tests() -> None:
    global _entry_points, _array_type_entry_points
    with _lock:
        _instances.clear()
        _features.clear()
        _worker_processes.clear()
        _entry_points = None
        _array_type_entry_points = None
        _array_types.clear()
