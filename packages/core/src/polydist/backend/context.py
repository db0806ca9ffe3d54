"""The strategy/replica context stack, as a backend that runs replicas itself sees it.

Users read it through ``polydist.get_strategy``, ``get_replica_context`` and friends.
A backend that traces the replica function once for all replicas (SPMD) installs its
own contexts: :func:`cross_replica_scope` runs a ``merge_fn`` in the strategy's
cross-replica context, and :func:`current_mode` tells which strategy, replica context
and cross-replica context are active now.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

from polydist._strategies.context import current_mode as current_mode
from polydist._strategies.context import current_replica as current_replica
from polydist._strategies.context import current_replica_index as current_replica_index
from polydist._strategies.context import mode as _mode

if TYPE_CHECKING:
    from polydist._base import context as _base_context
    from polydist._strategies.replica_context import ReplicaContext
    from polydist._strategies.strategy import Strategy, StrategyExtended
    from polydist.backend._contract import ReplicaChannel

__all__ = [
    "container_strategy",
    "cross_replica_scope",
    "current_mode",
    "current_replica",
    "current_replica_index",
    "replica_channel",
    "replica_index",
]


def replica_index(ctx: ReplicaContext | _base_context.ReplicaContext) -> int | None:
    """The index, among this process's replicas, of the replica ``ctx`` runs; ``None``
    in a context traced once for every replica (SPMD), which has no Python index."""
    # Asked several times per step: an annotation, not typing.cast (a call at run time).
    context: ReplicaContext = ctx  # type: ignore[assignment]
    return context._replica_index


def replica_channel(ctx: ReplicaContext | _base_context.ReplicaContext) -> ReplicaChannel | None:
    """The channel ``ctx``'s collectives go through; ``None`` for a strategy of one
    replica, whose collectives need no channel."""
    return cast("ReplicaContext", ctx)._channel


def container_strategy(extended: StrategyExtended | Any) -> Strategy:
    """The strategy that owns ``extended`` (a runner's view of a strategy, such as a
    simulated worker's, is another ``StrategyExtended`` with the same strategy)."""
    strategy: Strategy = extended._container_strategy()
    return strategy


@contextmanager
def cross_replica_scope(strategy: Strategy) -> Iterator[None]:
    """``strategy``'s cross-replica context for the block (where ``merge_fn`` runs)."""
    with _mode(strategy, None, strategy):
        yield
