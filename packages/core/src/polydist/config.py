"""``polydist.config``: the ``tf.config`` calls that TF code ported to polydist makes.

``experimental_connect_to_cluster`` checks its arguments as TensorFlow does and
records the cluster; polydist has no remote eager context to connect (strategies
reach their workers through their backends).
"""

from __future__ import annotations

from typing import Any

from polydist.cluster_resolver import ClusterResolver, ClusterSpec
from polydist.cluster_resolver._connect import connect_to_cluster

__all__ = ["experimental_connect_to_cluster"]


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
    connect_to_cluster(
        cluster_spec_or_resolver,
        job_name=job_name,
        task_index=task_index,
        protocol=protocol,
        make_master_device_default=make_master_device_default,
        cluster_device_filters=cluster_device_filters,
    )
