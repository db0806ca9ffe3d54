"""`ClusterResolver`, `SimpleClusterResolver` and `UnionResolver`.

Behaviour follows TensorFlow's
``tensorflow/python/distribute/cluster_resolver/cluster_resolver.py``.

Counting accelerators: TensorFlow's ``ClusterResolver.num_accelerators`` asks
the runtime for the devices it can see and counts them by device type, keeping
only the devices of ``/job:<task_type>/task:<task_id>`` when both are given.
polydist has no runtime of its own, so the device list comes from a *device
lister* that a backend installs with `set_accelerator_device_lister`; with
none installed no accelerators are visible and the count is ``{}``. Job and
task are matched exactly against the parsed device name (TensorFlow matches
substrings, so ``/job:worker`` would also match ``/job:worker1``).
"""

from __future__ import annotations

import abc
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from polydist.cluster_resolver._cluster_spec import ClusterSpec

__all__ = [
    "ClusterResolver",
    "DeviceAttributes",
    "DeviceLister",
    "SimpleClusterResolver",
    "UnionClusterResolver",
    "UnionResolver",
    "format_master_url",
    "get_accelerator_devices",
    "set_accelerator_device_lister",
]


def format_master_url(master: str, rpc_layer: str | None = None) -> str:
    """Returns ``"<rpc_layer>://<master>"``, or ``master`` when ``rpc_layer`` is empty."""
    if rpc_layer:
        return f"{rpc_layer}://{master}"
    return master


def task_master(
    resolver: ClusterResolver, task_type: str | None, task_id: int | None, rpc_layer: str | None
) -> str:
    """``"<rpc_layer>://address"`` of (``task_type``, ``task_id``) in ``resolver``'s
    cluster spec, each defaulting to the resolver's own; ``""`` when no task is known."""
    task_type = resolver.task_type if task_type is None else task_type
    task_id = resolver.task_id if task_id is None else task_id
    if task_type is None or task_id is None:
        return ""
    address = resolver.cluster_spec().task_address(task_type, task_id)
    return format_master_url(address, rpc_layer or resolver.rpc_layer)


class DeviceAttributes(NamedTuple):
    """A device visible to the runtime, e.g. ``("/job:worker/task:0/device:TPU:0", "TPU")``."""

    name: str
    device_type: str


#: ``lister(master, config_proto) -> devices``: what the runtime behind ``master`` sees,
#: as `DeviceAttributes` or plain ``(name, device_type)`` pairs.
DeviceLister = Callable[[str, Any], Sequence[tuple[str, str]]]

_device_lister: DeviceLister | None = None

_CPU_TYPES = frozenset({"CPU", "XLA_CPU"})
_JOB_RE = re.compile(r"/job:([^/]+)")
_TASK_RE = re.compile(r"/task:(\d+)")


def set_accelerator_device_lister(lister: DeviceLister | None) -> DeviceLister | None:
    """Installs the function that lists visible devices; returns the previous one.

    Backends call this so that `ClusterResolver.num_accelerators` can count
    real (or simulated) devices. Pass ``None`` to uninstall.
    """
    global _device_lister
    if lister is not None and not callable(lister):
        raise TypeError(
            f"lister must be a callable (master, config_proto) -> list[DeviceAttributes] or "
            f"None; got {type(lister).__name__}."
        )
    previous = _device_lister
    _device_lister = lister
    return previous


def get_accelerator_devices(master: str, config_proto: Any = None) -> list[DeviceAttributes]:
    """Returns the non-CPU devices the installed device lister reports (``[]`` if none)."""
    if _device_lister is None:
        return []
    devices: list[DeviceAttributes] = []
    for name, device_type in _device_lister(master, config_proto):
        device = DeviceAttributes(str(name), str(device_type))
        if device.device_type in _CPU_TYPES:
            continue
        devices.append(device)
    return devices


def _on_task(device_name: str, task_type: str, task_id: int) -> bool:
    job = _JOB_RE.search(device_name)
    task = _TASK_RE.search(device_name)
    return (
        job is not None
        and task is not None
        and job.group(1) == str(task_type)
        and int(task.group(1)) == int(task_id)
    )


class ClusterResolver(abc.ABC):
    """Abstract base of all cluster resolvers (``tf.distribute.cluster_resolver``).

    A cluster resolver tells a multi-worker strategy which jobs and tasks make
    up the cluster (`cluster_spec`), where the session master is (`master`),
    which task this process is (`task_type`, `task_id`), and how many
    accelerators each worker has (`num_accelerators`).

    Subclasses that have a task type, task id or RPC layer either override the
    properties or set ``self._task_type``, ``self._task_id`` and
    ``self._rpc_layer`` so the base getters and setters apply.
    """

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """Returns the current `ClusterSpec` of the cluster."""

    @abc.abstractmethod
    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """Returns the name or URL of the session master (a TensorFlow 1.x notion)."""

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: Any = None,
    ) -> dict[str, int]:
        """Returns ``{device_type: count}`` of the accelerators per worker.

        When both ``task_type`` and ``task_id`` are given only the devices of
        that task are counted. Devices come from the lister installed with
        `set_accelerator_device_lister` (none installed: ``{}``).
        """
        master = self.master(task_type, task_id)
        mapping: dict[str, int] = {}
        for device in get_accelerator_devices(master, config_proto):
            if (
                task_type is not None
                and task_id is not None
                and not _on_task(device.name, task_type, task_id)
            ):
                continue
            mapping[device.device_type] = mapping.get(device.device_type, 0) + 1
        return mapping

    @property
    def environment(self) -> str:
        """``"google"`` inside Google's infrastructure, else ``""``."""
        return ""

    @property
    def task_type(self) -> str | None:
        """The job name of this task (``"worker"``, ``"chief"``, ``"ps"``, ...), or None."""
        value: str | None = getattr(self, "_task_type", None)
        return value

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        """The index of this task within its job, or None."""
        value: int | None = getattr(self, "_task_id", None)
        return value

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        """The RPC protocol between tasks (e.g. ``"grpc"``), or None."""
        value: str | None = getattr(self, "_rpc_layer", None)
        return value

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer


class SimpleClusterResolver(ClusterResolver):
    """A `ClusterResolver` that returns exactly what it was constructed with.

    Args:
      cluster_spec: a `ClusterSpec`.
      master: the master address (a string).
      task_type: this task's job name.
      task_id: this task's index.
      environment: ``""`` or ``"google"``.
      num_accelerators: ``{device_type: count}`` returned by `num_accelerators`.
      rpc_layer: the RPC protocol, e.g. ``"grpc"``.

    Raises:
      TypeError: if ``cluster_spec`` is not a `ClusterSpec` or ``master`` is
        not a string.
    """

    def __init__(
        self,
        cluster_spec: ClusterSpec,
        master: str = "",
        task_type: str | None = None,
        task_id: int | None = None,
        environment: str = "",
        num_accelerators: Mapping[str, int] | None = None,
        rpc_layer: str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(cluster_spec, ClusterSpec):
            raise TypeError(
                f"cluster_spec must be a ClusterSpec; got {type(cluster_spec).__name__}. Wrap "
                "a dict with polydist.cluster_resolver.ClusterSpec({...})."
            )
        if not isinstance(master, str):
            raise TypeError(f"master must be a string; got {type(master).__name__} {master!r}.")
        self._cluster_spec = cluster_spec
        self._master = master
        self._task_type = task_type
        self._task_id = task_id
        self._environment = environment
        self._num_accelerators = dict(num_accelerators) if num_accelerators is not None else None
        self._rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        """Returns the `ClusterSpec` passed to the constructor."""
        return self._cluster_spec

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """Returns the master; ``task_type`` and ``task_id`` together select a task instead."""
        if task_type is not None and task_id is not None:
            master = self.cluster_spec().task_address(task_type, task_id)
        else:
            master = self._master
        return format_master_url(master, rpc_layer=rpc_layer or self._rpc_layer)

    @property
    def environment(self) -> str:
        return self._environment

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: Any = None,
    ) -> dict[str, int]:
        """Returns the ``num_accelerators`` given to the constructor (``{}`` if None)."""
        del task_type, task_id, config_proto
        if self._num_accelerators is None:
            return {}
        return dict(self._num_accelerators)


class UnionClusterResolver(ClusterResolver):
    """Merges the cluster specs of several resolvers (TensorFlow's ``UnionResolver``).

    Task type, task id, rpc layer, environment, master and accelerator counts
    come from the first resolver unless overridden by keyword.

    Args:
      *resolvers: one or more `ClusterResolver` objects.
      rpc_layer: optional override of the RPC layer.
      task_type: optional override of the task type.
      task_id: optional override of the task id.

    Raises:
      TypeError: if a positional argument is not a `ClusterResolver`.
      ValueError: if no resolver is given or another keyword is passed.
    """

    def __init__(self, *resolvers: ClusterResolver, **kwargs: Any) -> None:
        super().__init__()
        self._rpc_layer: str | None = kwargs.pop("rpc_layer", None)
        self._task_type: str | None = kwargs.pop("task_type", None)
        self._task_id: int | None = kwargs.pop("task_id", None)
        if kwargs:
            raise ValueError(
                f"Unexpected kwargs provided {kwargs!r}; UnionResolver accepts only rpc_layer, "
                "task_type and task_id."
            )
        if not resolvers:
            raise ValueError(
                "At least one ClusterResolver is required, e.g. "
                "UnionResolver(SimpleClusterResolver(...), TFConfigClusterResolver())."
            )
        for resolver in resolvers:
            if not isinstance(resolver, ClusterResolver):
                raise TypeError(
                    "All arguments must be a sub-class of `ClusterResolver`; got "
                    f"{type(resolver).__name__}."
                )
        self._cluster_resolvers: tuple[ClusterResolver, ...] = resolvers

    def cluster_spec(self) -> ClusterSpec:
        """Returns the union of the resolvers' cluster specs.

        Jobs present in several specs are merged. If every spec lists the job's
        tasks as a list, the lists are concatenated in resolver order. If any
        spec gives the job as a dict (sparse indices), all are treated as dicts
        keyed by task index and merged; a task index present twice raises
        ``KeyError``.
        """
        dicts = [resolver.cluster_spec().as_dict() for resolver in self._cluster_resolvers]
        merged: dict[str, list[str] | dict[int, str]] = {}
        for cluster_dict in dicts:
            for job_name, tasks in cluster_dict.items():
                if job_name in merged:
                    if isinstance(tasks, dict):
                        merged[job_name] = {}
                else:
                    merged[job_name] = [] if isinstance(tasks, list) else {}

        for cluster_dict in dicts:
            for job_name, tasks in cluster_dict.items():
                target = merged[job_name]
                if isinstance(target, list):
                    assert isinstance(tasks, list)
                    target.extend(tasks)
                    continue
                task_dict = dict(enumerate(tasks)) if isinstance(tasks, list) else dict(tasks)
                duplicates = set(task_dict).intersection(target)
                if duplicates:
                    raise KeyError(
                        "Duplicate keys detected when merging two ClusterSpecs: "
                        f"{duplicates!r} (job {job_name!r}). When a job is given as a dict of "
                        "task index to address in any resolver, each task index may appear in "
                        "only one resolver; renumber the tasks or give every resolver's job "
                        "as a list to concatenate them."
                    )
                target.update(task_dict)
        return ClusterSpec(merged)

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """The first resolver's master, or the address of (``task_type``, ``task_id``)."""
        if task_type is not None and task_id is not None:
            master = self.cluster_spec().task_address(task_type, task_id)
            return format_master_url(master, rpc_layer or self._rpc_layer)
        return self._cluster_resolvers[0].master(rpc_layer=rpc_layer)

    @property
    def task_type(self) -> str | None:
        if self._task_type is not None:
            return self._task_type
        return self._cluster_resolvers[0].task_type

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        if self._task_id is not None:
            return self._task_id
        return self._cluster_resolvers[0].task_id

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def environment(self) -> str:
        return self._cluster_resolvers[0].environment

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: Any = None,
    ) -> dict[str, int]:
        """The first resolver's accelerator count."""
        return self._cluster_resolvers[0].num_accelerators(task_type, task_id, config_proto)

    @property
    def rpc_layer(self) -> str | None:
        return self._rpc_layer or self._cluster_resolvers[0].rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer


#: TensorFlow exports `UnionClusterResolver` as ``tf.distribute.cluster_resolver.UnionResolver``.
UnionResolver = UnionClusterResolver
