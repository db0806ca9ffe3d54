"""``tf.config.experimental_connect_to_cluster`` (public as ``polydist.config``).

TensorFlow's (``tensorflow/python/eager/remote.py``) builds a ``ServerDef`` from
the cluster and makes the remote tasks' devices available to eager code. polydist
has no remote eager context: strategies reach their workers through their
backends. It checks the arguments as TF does and records the cluster it would
connect to, with TF's additions (the local job, the master's device), as a
`ClusterConnection`; ``TPUClusterResolver.connect`` calls it, as TF's does.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from polydist.cluster_resolver._base import ClusterResolver
from polydist.cluster_resolver._cluster_spec import ClusterSpec

__all__ = ["ClusterConnection", "connected_cluster", "experimental_connect_to_cluster"]

_LOCAL_MASTERS = ("", "local")
_DEFAULT_PROTOCOL = "grpc"  # TF's remote_utils default outside Google
# TF picks an unused port for the local job it adds; nothing listens here, so port 0.
_LOCAL_JOB_ADDRESS = "localhost:0"


@dataclasses.dataclass(frozen=True)
class ClusterConnection:
    """The cluster the last ``experimental_connect_to_cluster`` call recorded.

    Attributes:
      cluster_spec: the cluster, with the local job added if it was missing.
      job_name, task_index, protocol: this process's task and the protocol.
      master_device: with ``make_master_device_default`` and a resolver whose
        master is remote, the master task's device (``/job:worker/replica:0/
        task:0/device:CPU:0``), which TF makes the default device; else None.
    """

    cluster_spec: ClusterSpec
    job_name: str
    task_index: int
    protocol: str
    master_device: str | None


_lock = threading.Lock()
_connection: ClusterConnection | None = None


def connected_cluster() -> ClusterConnection | None:
    """The recorded connection; None before the first (non-local) connect."""
    return _connection


def experimental_connect_to_cluster(
    cluster_spec_or_resolver: ClusterSpec | ClusterResolver,
    job_name: str = "localhost",
    task_index: int = 0,
    protocol: str | None = None,
    make_master_device_default: bool = True,
    cluster_device_filters: Any = None,
) -> None:
    """Connects to the given cluster (``tf.config.experimental_connect_to_cluster``).

    As in TensorFlow: a resolver whose ``master()`` is local (``""`` or
    ``"local"``, e.g. ``TPUClusterResolver("local")``) changes nothing; the local
    job ``job_name`` is added to the cluster if it lacks it; calling again replaces
    the previous connection; with ``make_master_device_default`` and a resolver,
    its master must be one of the cluster's tasks.

    polydist has no remote eager context, so nothing is reached over the network:
    the cluster is recorded, and no device scope is entered (polydist has none).

    Args:
      cluster_spec_or_resolver: a `polydist.cluster_resolver.ClusterSpec` or
        `polydist.cluster_resolver.ClusterResolver` describing the cluster.
      job_name: the name of the local job.
      task_index: the local task index; where ``job_name`` is in the cluster, one
        of its tasks.
      protocol: the communication protocol; default ``"grpc"``.
      make_master_device_default: with a resolver whose master is remote, record
        the master task's device (TF makes it the default device).
      cluster_device_filters: must be None: polydist has no
        ``tf.train.experimental.ClusterDeviceFilters`` (no remote devices to filter).

    Raises:
      ValueError: ``cluster_spec_or_resolver`` is neither a ``ClusterSpec`` nor a
        ``ClusterResolver``; ``cluster_device_filters`` is given; the master is not
        in the cluster; ``job_name``, ``task_index`` or ``protocol`` is malformed.
    """
    global _connection
    if isinstance(cluster_spec_or_resolver, ClusterSpec):
        cluster_spec = ClusterSpec(cluster_spec_or_resolver)
    elif isinstance(cluster_spec_or_resolver, ClusterResolver):
        if cluster_spec_or_resolver.master() in _LOCAL_MASTERS:
            return  # TF does nothing for a local master
        cluster_spec = ClusterSpec(cluster_spec_or_resolver.cluster_spec())
    else:
        raise ValueError(
            "`cluster_spec_or_resolver` must be a `ClusterSpec` or a `ClusterResolver`; got "
            f"{type(cluster_spec_or_resolver).__name__} {cluster_spec_or_resolver!r:.80}. Pass "
            "polydist.cluster_resolver.ClusterSpec({...}) or a resolver such as "
            "TPUClusterResolver(tpu='v4-32')."
        )
    if cluster_device_filters:
        raise ValueError(
            "`cluster_device_filters` must be an instance of "
            "`tf.train.experimental.ClusterDeviceFilters`, which polydist does not have (it "
            f"has no remote devices to filter); got {cluster_device_filters!r:.80}. Pass None."
        )
    if not isinstance(job_name, str) or not job_name:
        raise ValueError(f"`job_name` must be a non-empty string; got {job_name!r}.")
    if isinstance(task_index, bool) or not isinstance(task_index, int) or task_index < 0:
        raise ValueError(f"`task_index` must be a non-negative int; got {task_index!r}.")
    if protocol is not None and not isinstance(protocol, str):
        raise ValueError(f"`protocol` must be a string such as 'grpc' or None; got {protocol!r}.")
    if job_name in cluster_spec.jobs:
        if task_index not in cluster_spec.task_indices(job_name):
            raise ValueError(
                f"Task {task_index} of job {job_name!r} is not in the cluster: that job has "
                f"tasks {cluster_spec.task_indices(job_name)}. Pass this process's job_name "
                "and task_index."
            )
    else:
        # TF adds the local job when the cluster lacks it.
        jobs = cluster_spec.as_dict()
        jobs[job_name] = [_LOCAL_JOB_ADDRESS]
        cluster_spec = ClusterSpec(jobs)

    master_device = None
    if make_master_device_default and isinstance(cluster_spec_or_resolver, ClusterResolver):
        master = cluster_spec_or_resolver.master()
        master_device = _master_device(cluster_spec, master)
    with _lock:
        _connection = ClusterConnection(
            cluster_spec=cluster_spec,
            job_name=job_name,
            task_index=task_index,
            protocol=protocol or _DEFAULT_PROTOCOL,
            master_device=master_device,
        )


def _master_device(cluster_spec: ClusterSpec, master: str) -> str:
    # TF's match: either address contains the other ("grpc://h:8470" and "h:8470").
    for job in cluster_spec.jobs:
        for task in cluster_spec.task_indices(job):
            address = cluster_spec.task_address(job, task)
            if master in address or address in master:
                return f"/job:{job}/replica:0/task:{task}/device:CPU:0"
    raise ValueError(
        f"`make_master_device_default` is set to True but cannot find master {master} in the "
        f"cluster {cluster_spec.as_dict()}. Pass make_master_device_default=False, or a "
        "resolver whose master() is one of its cluster's tasks."
    )
