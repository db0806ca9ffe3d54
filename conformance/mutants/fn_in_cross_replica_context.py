"""The replica function runs in cross-replica context instead of replica context."""

from __future__ import annotations

from typing import Any

from polydist.backend import EagerReplicaRunner

from ._support import MutantSim, cross_replica


class _Runner(EagerReplicaRunner):
    def run(self, group: Any, fn: Any, per_replica_args: Any) -> list[Any]:
        strategy = group.strategy

        def in_cross_replica(*args: Any, **kwargs: Any) -> Any:
            with cross_replica(strategy):
                return fn(*args, **kwargs)

        return super().run(group, in_cross_replica, per_replica_args)


class MutantBackend(MutantSim):
    runner_class = _Runner
