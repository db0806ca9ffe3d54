"""Shared pieces of the mutants."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import polydist as pd
from polydist._strategies import context as _context
from polydist.backend import EagerReplicaRunner, ReplicaGroup
from polydist_sim import SimBackend


class MutantSim(SimBackend):
    """The sim, under the name ``mutant:<module>``; core runs its replicas with a
    ``runner_class()`` (a mutant's runner has the bug a backend's runner could have)."""

    runner_class: type[EagerReplicaRunner] = EagerReplicaRunner

    def __init__(self, reduction_order: Any = "exact") -> None:
        super().__init__(reduction_order)
        self.name = "mutant:" + type(self).__module__.rsplit(".", 1)[-1]
        self.replica_runner = self.runner_class()


def is_mutant(backend: object) -> bool:
    return isinstance(backend, MutantSim)


def wrap_replica_fn(
    run: Callable[..., list[Any]],
    group: ReplicaGroup,
    fn: Callable[..., Any],
    per_replica_args: Sequence[Any],
    before: Callable[[pd.ReplicaContext], None],
) -> list[Any]:
    """Runs the replicas with ``before(ctx)`` called at the start of each replica's fn."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        before(ctx)
        return fn(*args, **kwargs)

    return run(group, wrapped, per_replica_args)


class ChannelWrapper:
    """A ReplicaChannel that forwards to the real one; mutants override a method."""

    def __init__(self, inner: Any, ctx: pd.ReplicaContext) -> None:
        self.inner = inner
        self.ctx = ctx

    def all_reduce(self, reduce_op: Any, values: Sequence[Any]) -> list[Any]:
        return list(self.inner.all_reduce(reduce_op, values))

    def all_gather(self, values: Sequence[Any], axis: int) -> list[Any]:
        return list(self.inner.all_gather(values, axis))

    def merge_call(self, merge_fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.inner.merge_call(merge_fn, args, kwargs)


class _ChannelRunner(EagerReplicaRunner):
    def __init__(self, channel_class: type[ChannelWrapper]) -> None:
        super().__init__()
        self.channel_class = channel_class

    def run(
        self, group: ReplicaGroup, fn: Callable[..., Any], per_replica_args: Sequence[Any]
    ) -> list[Any]:
        def install(ctx: pd.ReplicaContext) -> None:
            ctx._channel = self.channel_class(ctx._channel, ctx)

        return wrap_replica_fn(super().run, group, fn, per_replica_args, install)


class ChannelMutant(MutantSim):
    """Runs the replicas with their channel wrapped in ``channel_class``."""

    channel_class: type[ChannelWrapper] = ChannelWrapper

    def __init__(self, reduction_order: Any = "exact") -> None:
        super().__init__(reduction_order)
        self.replica_runner = _ChannelRunner(self.channel_class)


@contextlib.contextmanager
def cross_replica(strategy: pd.Strategy) -> Iterator[None]:
    with _context.mode(strategy, None, strategy):
        yield


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)
