"""The backend author's API: implement :class:`Backend` and register it.

Register under the entry-point group ``polydist.backends``::

    [project.entry-points."polydist.backends"]
    mybackend = "my_package:MyBackend"

and declare the array type it owns (optional) under ``polydist.array_types``, so
that a plain ``polydist.Variable`` of such an array lands on it::

    [project.entry-points."polydist.array_types"]
    mybackend = "my_array_module:ArrayType"

See ``docs/extending.md`` for the contract.
"""

from polydist._base.arrays import convert_to_array as convert_to_array
from polydist._base.arrays import mean_from_sum as mean_from_sum
from polydist._strategies.eager import EagerReplicaRunner as EagerReplicaRunner
from polydist._strategies.eager import busy_workers as busy_workers
from polydist._strategies.eager import default_timeout as default_timeout
from polydist._strategies.eager import timeout_seconds_from_env as timeout_seconds_from_env
from polydist._valuetypes.nest import register_tree_system as register_tree_system
from polydist.backend._contract import ARRAY_TYPES_GROUP as ARRAY_TYPES_GROUP
from polydist.backend._contract import ENTRY_POINT_GROUP as ENTRY_POINT_GROUP
from polydist.backend._contract import WORKER_PROCESSES_GROUP as WORKER_PROCESSES_GROUP
from polydist.backend._contract import Backend as Backend
from polydist.backend._contract import Capabilities as Capabilities
from polydist.backend._contract import ClusterToJoin as ClusterToJoin
from polydist.backend._contract import ReplicaChannel as ReplicaChannel
from polydist.backend._contract import SupportsWorkerProcesses as SupportsWorkerProcesses
from polydist.backend._contract import available_backends as available_backends
from polydist.backend._contract import backends_owning as backends_owning
from polydist.backend._contract import batch_all_reduce as batch_all_reduce
from polydist.backend._contract import get_backend as get_backend
from polydist.backend._contract import get_backend_for_value as get_backend_for_value
from polydist.backend._contract import is_symbolic as is_symbolic
from polydist.backend._contract import local_tpu_system as local_tpu_system
from polydist.backend._contract import pack_by_dtype as pack_by_dtype
from polydist.backend._contract import pack_by_size as pack_by_size
from polydist.backend._contract import worker_processes as worker_processes

__all__ = [
    "ARRAY_TYPES_GROUP",
    "ENTRY_POINT_GROUP",
    "WORKER_PROCESSES_GROUP",
    "Backend",
    "Capabilities",
    "ClusterToJoin",
    "EagerReplicaRunner",
    "ReplicaChannel",
    "SupportsWorkerProcesses",
    "available_backends",
    "backends_owning",
    "batch_all_reduce",
    "busy_workers",
    "convert_to_array",
    "default_timeout",
    "get_backend",
    "get_backend_for_value",
    "is_symbolic",
    "local_tpu_system",
    "mean_from_sum",
    "pack_by_dtype",
    "pack_by_size",
    "register_tree_system",
    "timeout_seconds_from_env",
    "worker_processes",
]
