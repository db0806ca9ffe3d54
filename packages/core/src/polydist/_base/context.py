"""Per-thread context: which strategy is current, and replica vs cross-replica.

This module sits below the strategies, values and variables that all ask it where
they are, so it knows a strategy and a replica context only by the protocols below;
``polydist._strategies.context`` gives the same functions with the concrete types
(``polydist.get_strategy`` and friends), and ``polydist._strategies.mirrored``
registers how to make the default strategy (:func:`set_default_factory`).

Mirrors TF's ``distribute_lib`` modes. There are three:

* default: no strategy scope entered. ``get_strategy()`` is the default
  strategy and ``get_replica_context()`` is its default replica context.
* cross-replica: inside ``strategy.scope()`` (or a ``merge_call``'s
  ``merge_fn``). ``get_replica_context()`` is ``None``.
* replica: inside the function given to ``strategy.run``.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

__all__ = [
    "experimental_set_strategy",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]

CROSS_REPLICA_MESSAGE = (
    "Method requires being in cross-replica context, use get_replica_context().merge_call()"
)


class StrategyExtended(Protocol):
    """A ``polydist.StrategyExtended``, as the layers below the strategies see it."""

    @property
    def _backend(self) -> Any: ...

    @property
    def _devices(self) -> tuple[str, ...]: ...

    @property
    def worker_devices(self) -> tuple[str, ...]: ...

    def _container_strategy(self) -> Strategy: ...

    def _local_results(self, value: Any) -> tuple[Any, ...]: ...

    def _create_variable(self, *args: Any, **kwargs: Any) -> Any: ...

    def _reduce_to(self, *args: Any, **kwargs: Any) -> Any: ...

    def reduce_to(self, *args: Any, **kwargs: Any) -> Any: ...

    def broadcast_to(self, *args: Any, **kwargs: Any) -> Any: ...

    def update(self, *args: Any, **kwargs: Any) -> Any: ...


class Strategy(Protocol):
    """A ``polydist.Strategy``, as the layers below the strategies see it."""

    @property
    def extended(self) -> StrategyExtended: ...

    @property
    def num_replicas_in_sync(self) -> int: ...

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]: ...

    def scope(self) -> AbstractContextManager[Any]: ...


class ReplicaContext(Protocol):
    """A ``polydist.ReplicaContext``, as the layers below the strategies see it."""

    @property
    def _replica_index(self) -> int | None: ...

    @property
    def strategy(self) -> Strategy: ...

    def merge_call(
        self,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any: ...


class _Mode:
    __slots__ = ("cross_replica_context", "replica_context", "strategy")

    def __init__(
        self,
        strategy: Strategy,
        replica_context: ReplicaContext | None,
        cross_replica_context: Strategy | None,
    ) -> None:
        self.strategy = strategy
        self.replica_context = replica_context
        self.cross_replica_context = cross_replica_context


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.global_scope: Any = None


_state = _ThreadState()
# A context variable, not a thread-local: each replica (a greenlet or a thread)
# has its own stack of modes.
_stack: contextvars.ContextVar[tuple[_Mode, ...]] = contextvars.ContextVar(
    "polydist_mode_stack", default=()
)
_default_lock = threading.Lock()
_default_mode: _Mode | None = None
_default_factory: Callable[[], tuple[Strategy, ReplicaContext]] | None = None


def set_default_factory(factory: Callable[[], tuple[Strategy, ReplicaContext]]) -> None:
    """How to make the default strategy and its replica context (made on first use);
    ``polydist._strategies.mirrored`` registers it when it is imported."""
    global _default_factory
    _default_factory = factory


def _get_default_mode() -> _Mode:
    global _default_mode
    if _default_mode is None:
        with _default_lock:
            if _default_mode is None:
                if _default_factory is None:
                    raise RuntimeError(
                        "polydist's default strategy is not registered: import polydist first"
                    )
                strategy, replica_context = _default_factory()
                _default_mode = _Mode(strategy, replica_context, None)
    return _default_mode


def current_mode() -> _Mode:
    """The active mode: its ``strategy``, ``replica_context`` (``None`` in cross-replica
    context) and ``cross_replica_context`` (the strategy there, else ``None``)."""
    stack = _stack.get()
    return stack[-1] if stack else _get_default_mode()


def push_mode(mode: _Mode) -> None:
    _stack.set((*_stack.get(), mode))


def push_cross_replica_mode(strategy: Strategy) -> contextvars.Token[tuple[_Mode, ...]]:
    """Enters ``strategy``'s cross-replica context, as its ``scope()`` does (undo with
    `pop_mode`, or `leave_mode` of what it returns)."""
    return _stack.set((*_stack.get(), _Mode(strategy, None, strategy)))


def directly_in_scope_or_default(strategy: Strategy) -> bool:
    """Whether ``strategy.run`` may leave its modes alone (a prepared call): the default
    context, or ``strategy``'s own cross-replica context on top (its scope)."""
    stack = _stack.get()
    if not stack:
        return True
    top = stack[-1]
    return top.strategy is strategy and top.replica_context is None


def leave_mode(token: contextvars.Token[tuple[_Mode, ...]]) -> None:
    """Restores the modes as they were before the push that returned ``token``."""
    _stack.reset(token)


def pop_mode() -> None:
    _stack.set(_stack.get()[:-1])


@contextmanager
def mode(
    strategy: Strategy,
    replica_context: ReplicaContext | None,
    cross_replica_context: Strategy | None,
) -> Iterator[None]:
    push_mode(_Mode(strategy, replica_context, cross_replica_context))
    try:
        yield
    finally:
        pop_mode()


def is_default_mode(m: _Mode) -> bool:
    return not _stack.get() or m is _get_default_mode()


def is_default_strategy(strategy: Strategy) -> bool:
    """Whether ``strategy`` is the default strategy (or a copy of it)."""
    return isinstance(strategy.extended, type(_get_default_mode().strategy.extended))


def get_strategy() -> Strategy:
    """Returns the current strategy: the one whose scope (or ``run``) we are in,
    else the default strategy."""
    return current_mode().strategy


def has_strategy() -> bool:
    """True when inside a non-default strategy's scope or ``run``."""
    return bool(_stack.get()) and current_mode().strategy is not _get_default_mode().strategy


def get_replica_context() -> ReplicaContext | None:
    """The current ``ReplicaContext``; ``None`` in cross-replica context.

    In the default context (no scope) this is the default replica context,
    whose ``num_replicas_in_sync`` is 1.
    """
    return current_mode().replica_context


def in_cross_replica_context() -> bool:
    """True inside ``strategy.scope()`` but outside ``run``, or inside ``merge_fn``."""
    return current_mode().cross_replica_context is not None


def get_cross_replica_context() -> Strategy | None:
    """The current strategy if in cross-replica context, else ``None``.

    TF keeps this as internal API; polydist exports it because it is handy.
    """
    return current_mode().cross_replica_context


def current_replica() -> tuple[Strategy, ReplicaContext, int | None] | None:
    """Inside a replica: its strategy, its replica context and its index among this
    process's replicas (``None`` in a context traced once for every replica); ``None``
    in cross-replica context. One read of the mode stack: a backend asks it several
    times per step, where each call costs on cold caches."""
    stack = _stack.get()
    m = stack[-1] if stack else _get_default_mode()
    ctx = m.replica_context
    if ctx is None:
        return None
    return m.strategy, ctx, ctx._replica_index


def current_replica_index() -> int | None:
    """The integer id of the current replica, or ``None`` outside replica context."""
    ctx = current_mode().replica_context
    if ctx is None:
        return None
    return ctx._replica_index


def experimental_set_strategy(strategy: Strategy | None) -> None:
    """Sets (or with ``None`` clears) the current strategy without a ``with`` block.

    Like ``with strategy.scope():`` for the rest of the program on this
    thread. Raises ``RuntimeError`` if called inside a strategy's scope.
    """
    old = _state.global_scope
    if old is not None:
        old.__exit__(None, None, None)
        _state.global_scope = None
    if has_strategy():
        raise RuntimeError("Must not be called inside a `tf.distribute.Strategy` scope.")
    if strategy is not None:
        scope = strategy.scope()
        scope.__enter__()
        _state.global_scope = scope


def require_cross_replica_or_default_context(
    strategy: Strategy, message: str | None = None
) -> None:
    """Raises TF's errors unless in ``strategy``'s cross-replica context or the default context."""
    # Asked by every strategy.run and reduce: the stack read once, not through
    # current_mode and is_default_mode (calls that cost on a step's cold caches).
    stack = _stack.get()
    if not stack:
        return  # the default context
    m = stack[-1]
    if m.cross_replica_context is strategy or m is _get_default_mode():
        return
    if m.strategy is not strategy:
        wrong_strategy_scope(strategy, m)
    raise RuntimeError(message or CROSS_REPLICA_MESSAGE)


def require_replica_context(replica_ctx: ReplicaContext) -> None:
    m = current_mode()
    if m.replica_context is replica_ctx:
        return
    if m.replica_context is None:
        raise RuntimeError("Need to be inside `call_for_each_replica()`")
    if m.strategy is replica_ctx.strategy:
        raise RuntimeError("Mismatching ReplicaContext.")
    raise RuntimeError(
        f"Mismatching tf.distribute.Strategy objects: {m.strategy} is not {replica_ctx.strategy}."
    )


def wrong_strategy_scope(strategy: Strategy, m: _Mode) -> None:
    if not has_strategy():
        raise RuntimeError(f'Need to be inside "with strategy.scope()" for {strategy}')
    raise RuntimeError(
        f"Mixing different tf.distribute.Strategy objects: {m.strategy} is not {strategy}"
    )
