"""The backend seam: the small typed interface every backend implements.

Core owns every semantic rule (contexts, regrouping, reduce-axis rules, the
MEAN dtype rule, error messages). A backend owns devices, placement, running
the replica function, and the collectives. See ``docs/extending.md``.

Two execution models fit the same contract:

* **eager** (sim, torch): ``run_replicas`` calls ``fn`` once per replica.
  Such backends delegate to :class:`polydist.backend.EagerReplicaRunner`,
  which runs the replicas, rendezvouses them at every collective and
  ``merge_call``, and calls the backend's list collectives
  (``all_reduce``, ``all_gather``, ...) with one value per replica.
* **spmd** (jax): ``run_replicas`` traces ``fn`` once for all replicas
  (``jax.shard_map``). Inside the trace it installs a
  :class:`ReplicaContext` whose :class:`ReplicaChannel` turns collectives
  into compiled ops (``lax.psum``), and runs ``merge_fn`` in a
  cross-replica context over per-replica values that are traced.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import threading
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from polydist.errors import BackendNotFoundError

if TYPE_CHECKING:
    import numpy as np

    from polydist._base.communication import CommunicationOptions
    from polydist._base.reduce_op import ReduceOp
    from polydist._strategies.strategy import StrategyExtended
    from polydist.cluster_resolver import ClusterResolver
    from polydist.tpu import LocalTPUSystem

__all__ = [
    "Backend",
    "Capabilities",
    "ClusterToJoin",
    "SupportsWorkerProcesses",
    "ReplicaChannel",
    "available_backends",
    "backends_owning",
    "get_backend",
    "get_backend_for_value",
    "is_symbolic",
    "local_tpu_system",
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
    #: backend must functionalize them (``polydist._valuetypes.variables.swap_storage``) and
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

    Optional: ``local_tpu_system() -> polydist.tpu.LocalTPUSystem`` describes the
    TPU cores this backend runs ``TPUStrategy`` on (a backend on real devices;
    see `local_tpu_system`). The backend must then accept
    ``/job:localhost/replica:0/task:0/device:TPU:k`` as core ``k``.

    Optional: ``is_symbolic(value) -> bool``: whether ``value`` belongs to a program
    being compiled (a JAX tracer), whose concrete values do not exist yet; see
    `is_symbolic`.

    Optional: ``batch_all_reduce(columns, destinations, bytes_per_pack)``: the
    ``all_reduce`` of several arrays at once (one replica-context ``all_reduce`` of a
    nest), packed into fewer collectives; see `batch_all_reduce`.
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

    def run_replicas(
        self,
        extended: StrategyExtended,
        fn: Callable[..., Any],
        per_replica_args: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
    ) -> list[Any]:
        """Calls ``fn(*args, **kwargs)`` once per replica, each inside its
        ``ReplicaContext``, and returns each replica's result in order."""
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
        _instances[name] = instance
        return instance


def local_tpu_system(backend: Backend) -> LocalTPUSystem | None:
    """The TPU cores ``backend`` runs ``TPUStrategy`` on, from its optional
    ``local_tpu_system()`` method; ``None`` if it has none (the sim: its TPUs are
    simulated slices)."""
    from polydist.tpu import LocalTPUSystem

    method = getattr(backend, "local_tpu_system", None)
    if method is None:
        return None
    system = method()
    if system is not None and not isinstance(system, LocalTPUSystem):
        raise TypeError(
            f"Backend {backend.name!r}: local_tpu_system() must return a "
            f"polydist.tpu.LocalTPUSystem or None; got {type(system).__name__}."
        )
    return system


def is_symbolic(backend: Backend, value: Any) -> bool:
    """Whether ``value`` is a value of a program ``backend`` is compiling, from its
    optional ``is_symbolic(value)`` method (``False`` without one). In a compiled step
    that spans processes every worker runs the same program, so what derives from
    shapes (a MEAN's element count) is the same on every worker."""
    method = getattr(backend, "is_symbolic", None)
    return bool(method(value)) if method is not None else False


def batch_all_reduce(
    backend: Backend,
    columns: Sequence[Sequence[Any]],
    destinations: Sequence[str],
    bytes_per_pack: int = 0,
) -> list[list[Any]]:
    """``backend.all_reduce(column, destinations)`` of each column (one array per
    replica), through the backend's optional ``batch_all_reduce(columns, destinations,
    bytes_per_pack)`` when it has one (and there are several columns).

    The batch method may pack the columns into fewer collectives, as TF packs a nest
    into one ``all_reduce`` per pack (`pack_by_size`): ``bytes_per_pack`` is
    ``CommunicationOptions.bytes_per_pack`` (0: one pack). Each column's results must
    equal its own ``all_reduce``'s and be arrays of their own to the caller (a result
    may be a view into a packed buffer only if no other result aliases its memory).
    """
    method = getattr(backend, "batch_all_reduce", None)
    if method is None or len(columns) < 2:
        return [backend.all_reduce(column, destinations) for column in columns]
    results: list[list[Any]] = method(columns, destinations, bytes_per_pack)
    if len(results) != len(columns):
        raise RuntimeError(
            f"Backend {backend.name!r}: batch_all_reduce returned {len(results)} results for "
            f"{len(columns)} columns; it must return one list of per-destination results "
            "per column, in order."
        )
    return results


def pack_by_size(nbytes: Sequence[int], bytes_per_pack: int) -> list[list[int]]:
    """The indices ``0..len(nbytes)-1`` in order, split into packs as TF's
    ``group_by_size`` does: everything in one pack when ``bytes_per_pack`` is 0, else a
    new pack starts once the last one holds more than ``bytes_per_pack`` bytes."""
    if bytes_per_pack < 0:
        raise ValueError(f"bytes_per_pack must be >= 0, got {bytes_per_pack}.")
    if bytes_per_pack == 0:
        return [list(range(len(nbytes)))] if nbytes else []
    packs: list[list[int]] = []
    last = 0
    for i, size in enumerate(nbytes):
        if not packs or last > bytes_per_pack:
            packs.append([])
            last = 0
        packs[-1].append(i)
        last += size
    return packs


def pack_by_dtype(
    dtypes: Sequence[Hashable], nbytes: Sequence[int], bytes_per_pack: int
) -> list[list[int]]:
    """The packs a nest's arrays cross the workers in, as TF packs them: the indices of
    each dtype (in order of first appearance), split by `pack_by_size`. An array whose
    dtype is given as ``None`` is never packed (a pack of its own, where it stands).
    Every worker with the same nest gets the same packs, in the same order."""
    if len(dtypes) != len(nbytes):
        raise ValueError(
            f"pack_by_dtype got {len(dtypes)} dtypes and {len(nbytes)} sizes; pass one of "
            "each per array."
        )
    groups: dict[Hashable, list[int]] = {}
    for i, dtype in enumerate(dtypes):
        groups.setdefault(("alone", i) if dtype is None else dtype, []).append(i)
    packs: list[list[int]] = []
    for indices in groups.values():
        sizes = [nbytes[i] for i in indices]
        packs += [[indices[k] for k in pack] for pack in pack_by_size(sizes, bytes_per_pack)]
    return packs


def _reset_registry_for_tests() -> None:
    global _entry_points, _array_type_entry_points
    with _lock:
        _instances.clear()
        _worker_processes.clear()
        _entry_points = None
        _array_type_entry_points = None
        _array_types.clear()
