"""Replica ids are off by one: replica r is told it is r + 1."""

from __future__ import annotations

from typing import Any

from polydist.backend import EagerReplicaRunner

from ._support import MutantSim, wrap_replica_fn


class _Runner(EagerReplicaRunner):
    def run(self, group: Any, fn: Any, per_replica_args: Any) -> list[Any]:
        def shift(ctx: Any) -> None:
            ctx._replica_id_in_sync_group = ctx._replica_id_in_sync_group + 1

        return wrap_replica_fn(super().run, group, fn, per_replica_args, shift)


class MutantBackend(MutantSim):
    runner_class = _Runner
