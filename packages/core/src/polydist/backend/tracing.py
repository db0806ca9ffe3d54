"""What a tracing (SPMD) backend needs to capture variables and collectives.

A backend that traces the replica function once for all replicas (``jax.jit`` with
``shard_map``, torch-xla) cannot let core run Python per replica. It

* functionalizes variables: reads each variable's stored arrays with
  :func:`storage_arrays`, swaps traced values in with :func:`swap_storage` while it
  traces (and back after), inside :func:`traced_replica_scope`, so a distributed
  variable in replica context acts as the traced replica's copy; after a run it may
  :func:`defer_storage` the new copies to the one output that holds them all, so a
  copy is split out per replica only when read (:func:`deferred_storage` tells it
  whether the copies are still that output's);
* records the collectives of the traced program once with
  :func:`capture_collectives` and replays them into the user's traces on every call
  with :func:`record_collective` (when :func:`is_tracing`);
* runs variable creation inside ``merge_call`` eagerly (:func:`is_variable_creation`)
  and reports replica-context writes of NONE-aggregated mirrored variables
  (:func:`note_replica_write`, :func:`replica_writes`), which core checks for
  divergence after the run.

:func:`tracked_variables` lists the variables a strategy created; the ``version`` of
its :func:`tracking_state` changes whenever one is created (a backend caching that
list per step checks it).

:func:`declare_internal_modules` names a backend's own packages, whose frames a
trace's call site (:func:`user_source_line`) looks past.
"""

from polydist._collectives.trace import CollectiveEvent as CollectiveEvent
from polydist._collectives.trace import Trace as Trace
from polydist._collectives.trace import capture_collectives as capture_collectives
from polydist._collectives.trace import declare_internal_modules as declare_internal_modules
from polydist._collectives.trace import is_tracing as is_tracing
from polydist._collectives.trace import record_collective as record_collective
from polydist._collectives.trace import user_source_line as user_source_line
from polydist._valuetypes.variables import StorageSource as StorageSource
from polydist._valuetypes.variables import components as components
from polydist._valuetypes.variables import current_update_replica as current_update_replica
from polydist._valuetypes.variables import defer_storage as defer_storage
from polydist._valuetypes.variables import deferred_storage as deferred_storage
from polydist._valuetypes.variables import is_variable_creation as is_variable_creation
from polydist._valuetypes.variables import note_replica_write as note_replica_write
from polydist._valuetypes.variables import replica_writes as replica_writes
from polydist._valuetypes.variables import storage_arrays as storage_arrays
from polydist._valuetypes.variables import swap_storage as swap_storage
from polydist._valuetypes.variables import traced_replica_scope as traced_replica_scope
from polydist._valuetypes.variables import tracked_variables as tracked_variables
from polydist._valuetypes.variables import tracking_state as tracking_state

__all__ = [
    "CollectiveEvent",
    "StorageSource",
    "Trace",
    "capture_collectives",
    "components",
    "current_update_replica",
    "defer_storage",
    "deferred_storage",
    "declare_internal_modules",
    "is_tracing",
    "is_variable_creation",
    "note_replica_write",
    "record_collective",
    "replica_writes",
    "storage_arrays",
    "swap_storage",
    "traced_replica_scope",
    "tracked_variables",
    "tracking_state",
    "user_source_line",
]
