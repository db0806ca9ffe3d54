"""The backend author's API: implement :class:`Backend` and register it.

Register under the entry-point group ``polydist.backends``::

    [project.entry-points."polydist.backends"]
    mybackend = "my_package:MyBackend"

and declare the array type it owns (optional) under ``polydist.array_types``, so
that a plain ``polydist.Variable`` of such an array lands on it::

    [project.entry-points."polydist.array_types"]
    mybackend = "my_array_module:ArrayType"

See ``docs/extending.md`` for the contract. This package is the whole contract: a
backend imports only ``polydist`` and ``polydist.backend.*`` (the nox ``lint``
session checks it with import-linter). Besides the protocols and the registry here,
its modules are the kits backends reuse:

* `polydist.backend.eager`: the eager per-replica runner;
* `polydist.backend.tracing`: what a tracing (SPMD) backend needs to capture
  variables and collectives;
* `polydist.backend.multiprocess`: the membership/heartbeat/agreement kit of a backend
  with one process per worker (and `polydist.backend.launch` to test it);
* `polydist.backend.devices`, `.nest`, `.arrays`, `.values`, `.context`,
  `.collectives`: device strings, nests, array rules, distributed values, the context
  stack and collective packing as core sees them;
* `polydist.backend.sim`: the reference simulator.

Optional features are the ``Supports…`` protocols (and `ClusterBackend`,
`WorkerProcessBackend`); `features` checks them once per backend, when it is loaded.
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
from polydist.backend._contract import NOT_HANDLED as NOT_HANDLED
from polydist.backend._contract import WORKER_PROCESSES_GROUP as WORKER_PROCESSES_GROUP
from polydist.backend._contract import Backend as Backend
from polydist.backend._contract import Capabilities as Capabilities
from polydist.backend._contract import ClusterBackend as ClusterBackend
from polydist.backend._contract import ClusterToJoin as ClusterToJoin
from polydist.backend._contract import Features as Features
from polydist.backend._contract import ReplicaChannel as ReplicaChannel
from polydist.backend._contract import ReplicaGroup as ReplicaGroup
from polydist.backend._contract import ReplicaRunner as ReplicaRunner
from polydist.backend._contract import SupportsBatchAllReduce as SupportsBatchAllReduce
from polydist.backend._contract import SupportsCompiledRun as SupportsCompiledRun
from polydist.backend._contract import SupportsCrossDeviceOps as SupportsCrossDeviceOps
from polydist.backend._contract import SupportsDirectRun as SupportsDirectRun
from polydist.backend._contract import SupportsHostArrayCopies as SupportsHostArrayCopies
from polydist.backend._contract import SupportsLibraryScope as SupportsLibraryScope
from polydist.backend._contract import SupportsLocalTPUSystem as SupportsLocalTPUSystem
from polydist.backend._contract import SupportsPlacedDtype as SupportsPlacedDtype
from polydist.backend._contract import SupportsPlacePerReplica as SupportsPlacePerReplica
from polydist.backend._contract import SupportsPlaceVariable as SupportsPlaceVariable
from polydist.backend._contract import SupportsPreparedRun as SupportsPreparedRun
from polydist.backend._contract import SupportsReductionOrder as SupportsReductionOrder
from polydist.backend._contract import SupportsReplicaRunner as SupportsReplicaRunner
from polydist.backend._contract import SupportsSimulatedDevices as SupportsSimulatedDevices
from polydist.backend._contract import SupportsStoreVariable as SupportsStoreVariable
from polydist.backend._contract import SupportsSymbolicValues as SupportsSymbolicValues
from polydist.backend._contract import SupportsUpdateInPlace as SupportsUpdateInPlace
from polydist.backend._contract import SupportsWorkerProcesses as SupportsWorkerProcesses
from polydist.backend._contract import WorkerProcessBackend as WorkerProcessBackend
from polydist.backend._contract import available_backends as available_backends
from polydist.backend._contract import backends_owning as backends_owning
from polydist.backend._contract import batch_all_reduce as batch_all_reduce
from polydist.backend._contract import features as features
from polydist.backend._contract import get_backend as get_backend
from polydist.backend._contract import get_backend_for_value as get_backend_for_value
from polydist.backend._contract import is_symbolic as is_symbolic
from polydist.backend._contract import local_tpu_system as local_tpu_system
from polydist.backend._contract import pack_by_dtype as pack_by_dtype
from polydist.backend._contract import pack_by_size as pack_by_size
from polydist.backend._contract import replica_group as replica_group
from polydist.backend._contract import worker_processes as worker_processes

__all__ = [
    "ARRAY_TYPES_GROUP",
    "ENTRY_POINT_GROUP",
    "WORKER_PROCESSES_GROUP",
    "Backend",
    "Capabilities",
    "ClusterBackend",
    "ClusterToJoin",
    "EagerReplicaRunner",
    "Features",
    "NOT_HANDLED",
    "ReplicaChannel",
    "SupportsBatchAllReduce",
    "SupportsCrossDeviceOps",
    "SupportsLocalTPUSystem",
    "SupportsPlacePerReplica",
    "SupportsPlacedDtype",
    "SupportsReductionOrder",
    "SupportsSimulatedDevices",
    "SupportsHostArrayCopies",
    "SupportsLibraryScope",
    "SupportsPlaceVariable",
    "SupportsStoreVariable",
    "SupportsUpdateInPlace",
    "SupportsSymbolicValues",
    "ReplicaGroup",
    "SupportsCompiledRun",
    "SupportsDirectRun",
    "SupportsPreparedRun",
    "ReplicaRunner",
    "SupportsReplicaRunner",
    "SupportsWorkerProcesses",
    "WorkerProcessBackend",
    "available_backends",
    "backends_owning",
    "batch_all_reduce",
    "busy_workers",
    "convert_to_array",
    "default_timeout",
    "features",
    "get_backend",
    "get_backend_for_value",
    "is_symbolic",
    "local_tpu_system",
    "mean_from_sum",
    "pack_by_dtype",
    "pack_by_size",
    "register_tree_system",
    "replica_group",
    "timeout_seconds_from_env",
    "worker_processes",
]
