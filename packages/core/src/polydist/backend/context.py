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
from typing import TYPE_CHECKING

from polydist._strategies.context import current_mode as current_mode
from polydist._strategies.context import current_replica_index as current_replica_index
from polydist._strategies.context import mode as _mode

if TYPE_CHECKING:
    from polydist._strategies.strategy import Strategy

__all__ = ["cross_replica_scope", "current_mode", "current_replica_index"]


@contextmanager
def cross_replica_scope(strategy: Strategy) -> Iterator[None]:
    """``strategy``'s cross-replica context for the block (where ``merge_fn`` runs)."""
    with _mode(strategy, None, strategy):
        yield
