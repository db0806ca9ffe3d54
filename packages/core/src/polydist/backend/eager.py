"""The eager per-replica runner: how core runs an eager backend's replicas.

Core runs ``strategy.run`` with it for a backend whose ``Capabilities.execution_model``
is ``"eager"`` (configured by the backend's ``replica_runner``,
`polydist.backend.SupportsReplicaRunner`); a compiled backend may call it for a call it
cannot compile (``runner.run(group, fn, per_replica_args)``).

:class:`EagerReplicaRunner` calls the replica function once per replica (on threads
or greenlets), installs each replica's ``ReplicaContext``, rendezvouses the replicas
at every collective and ``merge_call`` (with a timeout and a diagnostic naming each
replica's state) and calls the backend's list collectives with one value per replica.
"""

from polydist._strategies.eager import EagerReplicaRunner as EagerReplicaRunner
from polydist._strategies.eager import busy_workers as busy_workers
from polydist._strategies.eager import default_timeout as default_timeout
from polydist._strategies.eager import timeout_seconds_from_env as timeout_seconds_from_env

__all__ = ["EagerReplicaRunner", "busy_workers", "default_timeout", "timeout_seconds_from_env"]
