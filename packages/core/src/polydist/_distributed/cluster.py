"""Cluster rules shared by the multi-worker and TPU strategies, and their backend seam.

The first half re-implements TensorFlow's ``distribute/multi_worker_util.py``:
which jobs a cluster may have, how many workers take part in collectives
(``worker_count``), a worker's position among them (``id_in_cluster``) and
who is the chief (``is_chief``).

The second half is the seam between those strategies and a backend. A
backend that declares ``Capabilities.multi_worker`` or ``Capabilities.tpu``
also implements `ClusterBackend.connect_cluster`: the strategy hands it every
worker's (or TPU host's) devices and the backend answers which of those
workers' replicas THIS process runs. The simulator runs all of them in one
process; a multi-process engine would answer with its own worker only and
do the cross-process collectives itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from polydist._base.devices import DeviceSpec
from polydist._strategies import context as _context
from polydist._strategies.replica_context import ReplicaContext
from polydist.backend._contract import ClusterBackend
from polydist.cluster_resolver import ClusterSpec

if TYPE_CHECKING:
    from polydist.backend._contract import Backend, ReplicaChannel

__all__ = [
    "ClusterBackend",
    "InReplicaContext",
    "connect_cluster",
    "id_in_cluster",
    "is_chief",
    "normalize_cluster_spec",
    "worker_count",
]

_ALLOWED_TASK_TYPES = ("chief", "worker", "evaluator", "ps", None)


def normalize_cluster_spec(cluster_spec: Any) -> ClusterSpec:
    """Returns ``cluster_spec`` (a dict or `ClusterSpec`) as a `ClusterSpec`."""
    if isinstance(cluster_spec, ClusterSpec):
        return cluster_spec
    if isinstance(cluster_spec, Mapping):
        return ClusterSpec(cluster_spec)
    raise ValueError(
        "`cluster_spec` should be a dict or a polydist.cluster_resolver.ClusterSpec; got "
        f"{type(cluster_spec).__name__} {cluster_spec!r}."
    )


def _validate_cluster_spec(cluster_spec: Any, task_type: str | None, task_id: int | None) -> None:
    """TF's checks: known job names, the task exists, at most one chief and one evaluator."""
    spec = normalize_cluster_spec(cluster_spec)
    if any(job not in _ALLOWED_TASK_TYPES for job in spec.jobs):
        raise ValueError(
            "Disallowed task type found in cluster spec. Allowed types are "
            f"{_ALLOWED_TASK_TYPES} and the cluster spec is {spec}. Rename the jobs to "
            "'chief', 'worker', 'evaluator' or 'ps'."
        )
    if task_type not in _ALLOWED_TASK_TYPES:
        raise ValueError(
            f"Unrecognized task_type: {task_type!r}, valid task types are: {_ALLOWED_TASK_TYPES}."
        )
    if task_type and task_type not in spec.jobs and task_type != "evaluator":
        raise ValueError(
            f"`task_type` {task_type!r} not found in cluster_spec {spec}; the task must be one "
            "of the cluster's jobs."
        )
    as_dict = spec.as_dict()
    if len(as_dict.get("chief", [])) > 1:
        raise ValueError(f"There must be at most one 'chief' job; got {as_dict['chief']}.")
    if len(as_dict.get("evaluator", [])) > 1:
        raise ValueError(f"There must be at most one 'evaluator' job; got {as_dict['evaluator']}.")
    if task_type in spec.jobs and task_id is not None and task_id >= len(spec.job_tasks(task_type)):
        raise ValueError(
            f"The `task_id` {task_id} exceeds the maximum id of {task_type} "
            f"({len(spec.job_tasks(task_type)) - 1})."
        )


def is_chief(cluster_spec: Any, task_type: str | None, task_id: int | None) -> bool:
    """True for the chief, the evaluator, and worker 0 of a cluster without a chief."""
    _validate_cluster_spec(cluster_spec, task_type, task_id)
    as_dict = normalize_cluster_spec(cluster_spec).as_dict()
    if task_type in ("chief", "evaluator"):
        return True
    # Without a chief, worker 0 acts as the chief (as in MultiWorkerMirroredStrategy).
    return "chief" not in as_dict and task_type == "worker" and task_id == 0


def worker_count(cluster_spec: Any, task_type: str | None) -> int:
    """How many workers take part in collectives: chief + workers (an evaluator: its own)."""
    _validate_cluster_spec(cluster_spec, task_type, task_id=0)
    as_dict = normalize_cluster_spec(cluster_spec).as_dict()
    if task_type not in ("chief", "worker", "evaluator"):
        raise ValueError(
            f"Unexpected `task_type` {task_type!r}: only 'chief', 'worker' and 'evaluator' "
            "tasks run a multi-worker strategy."
        )
    if task_type == "evaluator":
        # The evaluator is a cluster of its own; TF would fail on a missing job, we count it.
        return max(len(as_dict.get("evaluator", [])), 1)
    return len(as_dict.get("chief", [])) + len(as_dict.get("worker", []))


def id_in_cluster(cluster_spec: Any, task_type: str | None, task_id: int) -> int:
    """A worker's position among the collective's workers: the chief is 0, then the workers."""
    _validate_cluster_spec(cluster_spec, task_type, task_id)
    as_dict = normalize_cluster_spec(cluster_spec).as_dict()
    if task_type == "chief":
        return 0
    if task_type == "worker":
        return task_id + len(as_dict.get("chief", []))
    if task_type == "evaluator":
        return task_id
    raise ValueError(f"There is no id for task_type {task_type!r}.")


# -- the backend seam ---------------------------------------------------------------------


def connect_cluster(
    backend: Backend, worker_devices: Sequence[Sequence[str]], worker_index: int, *, what: str
) -> tuple[int, ...]:
    """Connects ``backend`` to a cluster; ``what`` names the strategy for error messages."""
    caps = backend.capabilities
    if not (caps.has("multi_worker") or caps.has("tpu")):
        devices = [d for ws in worker_devices for d in ws]
        remote = sorted({_task_of(d) for d in devices} - {("localhost", 0)})
        raise ValueError(
            f"{what} needs devices of {len(worker_devices)} workers/hosts (tasks {remote}), but "
            f"backend {backend.name!r} declares neither Capabilities.multi_worker nor "
            "Capabilities.tpu, so it can only use this machine's devices. Simulate the cluster "
            "on the simulator instead (backend='sim')."
        )
    local = cast(ClusterBackend, backend).connect_cluster(worker_devices, worker_index)
    if worker_index not in local:
        raise RuntimeError(
            f"Backend {backend.name!r} runs workers {local} in this process, which does not "
            f"include this worker ({worker_index}); its connect_cluster() must return the "
            "workers whose replicas this process runs, this one included."
        )
    return tuple(sorted(local))


def _task_of(device: str) -> tuple[str, int]:
    spec = DeviceSpec.parse(device)
    return spec.job, spec.task


# -- replica contexts of cluster strategies --------------------------------------------


class InReplicaContext:
    """Runs a replica function inside a strategy's own `ReplicaContext` subclass.

    The backend's runner enters a plain ``ReplicaContext``; this wrapper,
    passed to it as the replica function, enters ``context_class`` on top,
    with the same replica id and channel (wrapped by ``wrap_channel`` if given).
    """

    __slots__ = ("_context_class", "_fn", "_wrap_channel")

    def __init__(
        self,
        fn: Callable[..., Any],
        context_class: type[ReplicaContext],
        wrap_channel: Callable[[ReplicaChannel, ReplicaContext], ReplicaChannel] | None = None,
    ) -> None:
        self._fn = fn
        self._context_class = context_class
        self._wrap_channel = wrap_channel

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        """The replica function (``inspect.unwrap`` finds it, e.g. to read its closure)."""
        return self._fn

    # Equal wrappers of the same function: a backend that caches compiled programs by
    # replica function (jax) reuses them across runs of the strategy.
    def __eq__(self, other: object) -> bool:
        return isinstance(other, InReplicaContext) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple[Any, ...]:
        return (self._fn, self._context_class, self._wrap_channel)

    def __repr__(self) -> str:
        return f"{self._context_class.__name__}({self._fn!r})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outer = _context.get_replica_context()
        assert outer is not None, "InReplicaContext must run as a replica function"
        channel = outer._channel
        if channel is not None and self._wrap_channel is not None:
            channel = self._wrap_channel(channel, outer)
        ctx = self._context_class(
            outer.strategy,
            outer.replica_id_in_sync_group,
            channel=channel,
            replica_index=outer._replica_index,
        )
        with ctx:
            return self._fn(*args, **kwargs)
