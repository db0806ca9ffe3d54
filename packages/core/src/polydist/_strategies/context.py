"""The per-thread context (:mod:`polydist._base.context`) with the concrete types.

``polydist.get_strategy`` and friends are these functions: the stack of modes itself
lives below the strategies, which every layer asks where it is; here its answers are
typed as ``Strategy`` and ``ReplicaContext``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from polydist._base.context import CROSS_REPLICA_MESSAGE as CROSS_REPLICA_MESSAGE
from polydist._base.context import _get_default_mode as _get_default_mode
from polydist._base.context import _Mode as _Mode
from polydist._base.context import current_mode as current_mode
from polydist._base.context import current_replica as current_replica
from polydist._base.context import current_replica_index as current_replica_index
from polydist._base.context import (
    directly_in_scope_or_default as directly_in_scope_or_default,
)
from polydist._base.context import experimental_set_strategy as experimental_set_strategy
from polydist._base.context import has_strategy as has_strategy
from polydist._base.context import in_cross_replica_context as in_cross_replica_context
from polydist._base.context import is_default_mode as is_default_mode
from polydist._base.context import leave_mode as leave_mode
from polydist._base.context import mode as mode
from polydist._base.context import pop_mode as pop_mode
from polydist._base.context import push_cross_replica_mode as push_cross_replica_mode
from polydist._base.context import push_mode as push_mode
from polydist._base.context import (
    require_cross_replica_or_default_context as require_cross_replica_or_default_context,
)
from polydist._base.context import require_replica_context as require_replica_context
from polydist._base.context import wrong_strategy_scope as wrong_strategy_scope

if TYPE_CHECKING:
    from polydist._strategies.replica_context import ReplicaContext
    from polydist._strategies.strategy import Strategy

from polydist._base import context as _base

__all__ = [
    "experimental_set_strategy",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]


def get_strategy() -> Strategy:
    """Returns the current strategy: the one whose scope (or ``run``) we are in,
    else the default strategy."""
    return cast("Strategy", _base.get_strategy())


def get_replica_context() -> ReplicaContext | None:
    """The current ``ReplicaContext``; ``None`` in cross-replica context.

    In the default context (no scope) this is the default replica context,
    whose ``num_replicas_in_sync`` is 1.
    """
    return cast("ReplicaContext | None", _base.get_replica_context())


def get_cross_replica_context() -> Strategy | None:
    """The current strategy if in cross-replica context, else ``None``.

    TF keeps this as internal API; polydist exports it because it is handy.
    """
    return cast("Strategy | None", _base.get_cross_replica_context())
