"""The kit of a backend that runs ``MultiWorkerMirroredStrategy`` with one process per
worker (``torch.distributed``, ``jax.distributed``).

Such a backend implements `polydist.backend.SupportsWorkerProcesses` (how to join the
cluster) and returns an engine implementing `polydist.backend.WorkerProcessBackend`.
This module holds what every such engine needs besides its collectives:

* the cluster: :func:`resolve_cluster` (resolver, ``TF_CONFIG`` or the launcher's
  environment), :func:`worker_count`, :func:`id_in_cluster`,
  :func:`worker_task_names`, :func:`describe_workers`;
* membership: :class:`ClusterMembership` (joining within a timeout, heartbeats,
  agreement on each collective's signature across workers, naming the workers that
  stopped) with :class:`Heartbeat`, :func:`check_joining`, :data:`HEARTBEAT_SECONDS`,
  :data:`DEFAULT_TIMEOUT_SECONDS`, :func:`collective_timeout`;
* the cross-worker collective check: :class:`Pending` (a collective a worker is
  waiting in) and :class:`PeerMissing` (a worker that stopped answering);
* uneven gathers: :func:`shape_row`, :func:`gathered_sizes`;
* per-process state: :func:`once_per_process` and :func:`process_capabilities` (the
  capabilities of a one-process-per-worker engine). Core runs each worker's replicas
  itself (``polydist.backend.SupportsReplicaRunner`` configures how).
"""

from polydist._collectives.check import PeerMissing as PeerMissing
from polydist._collectives.check import Pending as Pending
from polydist._collectives.check import SignatureStore as SignatureStore
from polydist._collectives.check import collective_intent as collective_intent
from polydist._distributed.cluster import id_in_cluster as id_in_cluster
from polydist._distributed.cluster import worker_count as worker_count
from polydist._distributed.membership import ClusterStore as ClusterStore
from polydist._distributed.membership import HeartbeatStore as HeartbeatStore
from polydist._distributed.multi_process import DEFAULT_TIMEOUT_SECONDS as DEFAULT_TIMEOUT_SECONDS
from polydist._distributed.multi_process import HEARTBEAT_SECONDS as HEARTBEAT_SECONDS
from polydist._distributed.multi_process import ClusterMembership as ClusterMembership
from polydist._distributed.multi_process import Heartbeat as Heartbeat
from polydist._distributed.multi_process import check_joining as check_joining
from polydist._distributed.multi_process import collective_timeout as collective_timeout
from polydist._distributed.multi_process import describe_workers as describe_workers
from polydist._distributed.multi_process import gathered_sizes as gathered_sizes
from polydist._distributed.multi_process import once_per_process as once_per_process
from polydist._distributed.multi_process import process_capabilities as process_capabilities
from polydist._distributed.multi_process import resolve_cluster as resolve_cluster
from polydist._distributed.multi_process import shape_row as shape_row
from polydist._distributed.multi_process import worker_task_names as worker_task_names

__all__ = [
    "ClusterMembership",
    "ClusterStore",
    "DEFAULT_TIMEOUT_SECONDS",
    "HEARTBEAT_SECONDS",
    "Heartbeat",
    "HeartbeatStore",
    "PeerMissing",
    "Pending",
    "SignatureStore",
    "check_joining",
    "collective_intent",
    "collective_timeout",
    "describe_workers",
    "gathered_sizes",
    "id_in_cluster",
    "once_per_process",
    "process_capabilities",
    "resolve_cluster",
    "shape_row",
    "worker_count",
    "worker_task_names",
]
