"""Runs replicas eagerly, one at a time, with a rendezvous at every collective.

This is how TF's MirroredStrategy runs eagerly, and how core runs
``strategy.run`` on backends whose execution model is eager (the sim, torch),
configured by the backend (``polydist.backend.SupportsReplicaRunner``).
Replicas take turns in replica order: each runs until it reaches a
collective or ``merge_call`` (a *sync point*) or returns. When all have
paused, the runner checks that they agree and performs the collective
through the backend's list collectives.

Because replicas never run at the same time, execution is deterministic, and
a disagreement is seen exactly: it raises ``CollectiveMismatchError`` at
once, where real hardware would hang.

Each replica runs on its own stack, in one of two ways:

* ``"greenlet"`` (the default): greenlets on the calling thread. A switch
  costs about a microsecond and no replica thread is created (one watchdog
  thread reports a replica stuck in a wait outside polydist: see `_Watchdog`).
* ``"thread"``: pooled daemon threads, for engines whose per-thread state
  must not be switched in the middle of a call (for example an autograd
  engine that runs a replica's backward pass). Each wait has a timeout;
  idle threads exit after ``$POLYDIST_IDLE_THREAD_SECONDS`` (2 s). A lone
  replica runs on the calling thread instead, each of its collectives
  performed as it reaches it: with nobody to wait for, there is nothing to
  switch between.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

import numpy as np

from polydist._base.arrays import dtype_name
from polydist._base.communication import CommunicationOptions, bytes_per_pack, current_call_options
from polydist._base.reduce_op import ReduceOp
from polydist._collectives import trace as _trace
from polydist._collectives.check import collective_intent
from polydist._strategies import context as _context
from polydist._strategies.replica_slots import (
    _FAILED,
    _PAUSED,
    _WATCHDOG,
    TIMEOUT_ENV,
    _GreenletSlot,
    _Slot,
    _ThreadSlot,
    busy_workers,
)
from polydist._valuetypes.values import regroup, select_replica
from polydist.backend._contract import batch_all_reduce, features
from polydist.errors import CollectiveMismatchError

if TYPE_CHECKING:
    from polydist.backend._contract import (
        Backend,
        ReplicaChannel,
        ReplicaGroup,
        SupportsCompiledRun,
        SupportsDirectRun,
        SupportsPreparedRun,
        SupportsReplicaRunner,
    )

__all__ = [
    "EagerReplicaRunner",
    "ReplicaExecution",
    "busy_workers",
    "default_timeout",
    "timeout_seconds_from_env",
]


Mode = Literal["greenlet", "thread"]


DEFAULT_TIMEOUT_SECONDS = 300.0


def timeout_seconds_from_env(default: float = DEFAULT_TIMEOUT_SECONDS) -> float:
    """``$POLYDIST_TIMEOUT_SECONDS`` as seconds (``default`` when unset or empty).

    The one parser of the variable, for every backend. Raises ``ValueError``
    naming the variable unless it is a finite number of seconds above 0.
    """
    environ = os.environ
    data = environ.__dict__.get("_data") if type(environ) is os._Environ else None
    if type(data) is dict:
        # Read at every run, so one lookup in os.environ's own dict: its Mapping.get
        # encodes the key and raises and catches a KeyError when unset (~1 µs).
        raw = data.get(_TIMEOUT_KEY)
        if raw is None:
            return default
        cached = _PARSED.get(raw)
        if cached is not None:
            return cached
        text = environ.decodevalue(raw).strip()
    else:  # os.environ replaced by another mapping (as some test helpers do)
        raw = None
        text = environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return default
    cached = _PARSED.get(text)  # parse each text once
    if cached is not None:
        return cached
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= threading.TIMEOUT_MAX:  # NaN fails too
        raise ValueError(
            f"${TIMEOUT_ENV} must be a positive number of seconds (e.g. 300 or 2.5), got "
            f"{text!r}. It bounds how long a replica may run between two collectives "
            f"before it is reported as stuck; set it to a number above 0, or unset it for "
            f"the default ({default:g} s)."
        )
    if len(_PARSED) < 64:
        _PARSED[text] = seconds
        if raw is not None:
            _PARSED[raw] = seconds
    return seconds


#: Texts of the variable already parsed, and os.environ's raw values of them.
_PARSED: dict[Any, float] = {}
_TIMEOUT_KEY: Any = os.environ.encodekey(TIMEOUT_ENV)


def default_timeout() -> float:
    """Seconds a threaded replica may run between two sync points
    (``$POLYDIST_TIMEOUT_SECONDS``, default 300); see `timeout_seconds_from_env`."""
    return timeout_seconds_from_env()


# -- sync points --------------------------------------------------------------------


class _SyncRequest:
    __slots__ = ("_frame", "kind", "options", "payload", "signature")

    def __init__(self, kind: str, signature: tuple[Any, ...], payload: Any, frame: FrameType):
        self.kind = kind  # "all_reduce" | "all_gather" | "merge_call"
        self.signature = signature
        self.payload = payload
        self._frame = frame
        # The call's own CommunicationOptions, read on the replica's thread or greenlet.
        self.options = current_call_options()

    @property
    def source(self) -> str:
        # Computed lazily: the replica is paused at the call, so its frames are intact.
        return _trace.user_source_line(frame=self._frame)

    def describe(self) -> str:
        if self.kind == "all_reduce":
            op, leaves = self.signature
            return f"all_reduce({op}) of {_leaves_text(leaves)} at {self.source}"
        if self.kind == "all_gather":
            axis, leaves = self.signature
            return f"all_gather(axis={axis}) of {_leaves_text(leaves)} at {self.source}"
        return f"merge_call at {self.source}"


def _leaves_text(leaves: tuple[tuple[Any, tuple[Any, ...]], ...]) -> str:
    if not leaves:
        return "an empty nest"
    texts = [_leaf_text(leaf) for leaf in leaves[:5]]
    if len(leaves) <= 4:
        return ", ".join(texts)
    return f"{', '.join(texts[:4])}, ... ({len(leaves)} arrays)"


class _EagerChannel:
    __slots__ = ("_slot",)

    def __init__(self, slot: _Syncs) -> None:
        self._slot = slot

    def all_reduce(self, reduce_op: ReduceOp, values: Sequence[Any]) -> list[Any]:
        signature = (reduce_op.value, tuple((v.dtype, tuple(v.shape)) for v in values))
        reply: list[Any] = self._slot.sync(
            _SyncRequest("all_reduce", signature, list(values), sys._getframe(1))
        )
        return reply

    def all_gather(self, values: Sequence[Any], axis: int) -> list[Any]:
        leaves = tuple(_gather_signature(v, axis) for v in values)
        reply: list[Any] = self._slot.sync(
            _SyncRequest("all_gather", (axis, leaves), list(values), sys._getframe(1))
        )
        return reply

    def merge_call(
        self, merge_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        return self._slot.sync(
            _SyncRequest("merge_call", (), (merge_fn, args, kwargs), sys._getframe(1))
        )


class _LoneChannel(_EagerChannel):
    """A lone replica's channel: an all_reduce has nobody to wait for or agree with, so it
    is performed at once, without the sync request and signature a group needs."""

    __slots__ = ()

    def all_reduce(self, reduce_op: ReduceOp, values: Sequence[Any]) -> list[Any]:
        collectives = self._slot
        assert isinstance(collectives, _Collectives)
        if _trace.is_tracing() or (collectives.packs_nests and len(values) > 1):
            # Recorded in the trace, or packed: the general path.
            signature = (reduce_op.value, tuple((v.dtype, tuple(v.shape)) for v in values))
            reply: list[Any] = collectives.sync(
                _SyncRequest("all_reduce", signature, list(values), sys._getframe(1))
            )
            return reply
        return collectives.lone_all_reduce(reduce_op.value, values, sys._getframe(1))


def _gather_signature(v: Any, axis: int) -> tuple[Any, tuple[Any, ...]]:
    shape: list[Any] = list(v.shape)
    if shape:
        shape[axis] = "*"
    return v.dtype, tuple(shape)


def _leaf_text(leaf: tuple[Any, tuple[Any, ...]]) -> str:
    dtype, shape = leaf
    return f"{dtype_name(dtype)}[{','.join(map(str, shape))}]"


# -- one run ------------------------------------------------------------------------------


_REPLICA_CONTEXT: list[Any] = []


def _replica_context_module() -> Any:
    # Imported once, lazily (replica_context's users import this module).
    if not _REPLICA_CONTEXT:
        from polydist._strategies import replica_context

        _REPLICA_CONTEXT.append(replica_context)
    return _REPLICA_CONTEXT[0]


class _Syncs(Protocol):
    """Where a replica's channel sends its sync points: its slot, or, for a lone
    replica, the run's `_Collectives` (performed at once)."""

    def sync(self, request: _SyncRequest) -> Any: ...


class _Collectives:
    """The replicas of one run as the collectives see them: where they run, and how a set
    of sync requests (one per replica) is checked and performed. `_Run` schedules
    several replicas; a lone thread-mode replica needs only this (`EagerReplicaRunner.run`)."""

    def __init__(
        self,
        group: ReplicaGroup,
        wrap_channel: Callable[[ReplicaChannel, int], ReplicaChannel] | None = None,
        lazy_replica_id: bool = False,
    ) -> None:
        if group.strategy is None:
            raise ValueError(
                "EagerReplicaRunner.run needs the ReplicaGroup of a run (with its strategy): "
                "polydist.backend.replica_group(strategy), or the group run_replicas got."
            )
        self.strategy = group.strategy
        self.wrap_channel = wrap_channel
        self.offset = group.replica_offset
        self.backend: Backend = group.backend
        self.devices: tuple[str, ...] = group.devices
        # The strategy's CommunicationOptions (multi-worker strategies only).
        self.options: CommunicationOptions | None = group.communication_options
        self.lazy_replica_id = lazy_replica_id
        # Whether the backend packs a nest's arrays into fewer collectives (fixed per backend).
        self.packs_nests = features(self.backend).batch_all_reduce

    def sync(self, request: _SyncRequest) -> Any:
        """A lone replica's sync point, performed at once: nobody else to wait for."""
        return self._resolve([request])[0]

    def lone_all_reduce(self, reduce_op: str, values: Sequence[Any], frame: FrameType) -> list[Any]:
        """A lone replica's all_reduce of ``values``, not traced and not packed: what
        `_resolve` does for one request, one array at a time under one intent."""
        backend, devices = self.backend, self.devices
        device = devices[0]
        with collective_intent(reduce_op, lambda: _trace.user_source_line(frame=frame)):
            return [backend.all_reduce([backend.place(v, device)], devices)[0] for v in values]

    def channel(self, index: int, syncs: _Syncs) -> ReplicaChannel:
        """Replica ``index``'s channel, its sync points going to ``syncs``."""
        channel: ReplicaChannel = _LoneChannel(syncs) if syncs is self else _EagerChannel(syncs)
        if self.wrap_channel is not None:
            channel = self.wrap_channel(channel, self.offset + index)
        return channel

    def run_replica(
        self,
        index: int,
        syncs: _Syncs,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        channel: ReplicaChannel | None = None,
    ) -> Any:
        """``fn(*args, **kwargs)`` as replica ``index``: in its replica context (its sync
        points go to ``syncs``, through ``channel``, else `channel`'s) and device scope."""
        device = self.devices[index]
        if channel is None:
            channel = self.channel(index, syncs)
        module = _REPLICA_CONTEXT[0] if _REPLICA_CONTEXT else _replica_context_module()
        replica_id: Any
        if self.lazy_replica_id:
            # Placed when the replica first asks for it: most steps never do, and a
            # placement is a host-to-device copy.
            replica_id = module.LazyReplicaId(self.backend, index, device)
        else:
            replica_id = self.backend.place(np.asarray(index, dtype=np.int32), device)
        ctx = module.ReplicaContext(self.strategy, replica_id, channel=channel, replica_index=index)
        with ctx, self.backend.device_scope(device):
            return fn(*args, **kwargs)

    def _mismatch(self, states: dict[int, str]) -> CollectiveMismatchError:
        lines = [
            "Replicas disagree on the next collective; on real hardware this program would hang.",
        ]
        lines += [f"  replica {r} ({self.devices[r]}): {states[r]}" for r in sorted(states)]
        lines.append(
            "Every replica must call the same collectives (all_reduce, all_gather, merge_call) "
            "in the same order, with the same shapes and dtypes. Make the control flow around "
            "collectives identical on all replicas (e.g. do not branch on "
            "replica_id_in_sync_group or on data-dependent values around a collective)."
        )
        return CollectiveMismatchError("\n".join(lines))

    def _resolve(self, requests: list[_SyncRequest]) -> list[Any]:
        first = requests[0]
        if any(r.kind != first.kind or r.signature != first.signature for r in requests[1:]):
            raise self._mismatch({i: r.describe() for i, r in enumerate(requests)})
        if first.kind == "merge_call":
            return self._merge_call(requests)
        backend, devices = self.backend, self.devices
        placed = [
            [backend.place(v, devices[r]) for v in req.payload] for r, req in enumerate(requests)
        ]
        outputs: list[list[Any]] = [[] for _ in requests]
        tracing = _trace.is_tracing()
        # Wall time only where it means something (not on the simulator).
        timed = tracing and backend.capabilities.measured_timing
        # Engines that check collectives across processes publish the op and call site.
        reduce_op = first.signature[0] if first.kind == "all_reduce" else None
        intent = collective_intent(reduce_op, lambda: first.source)
        batches = features(backend).batch_all_reduce
        if first.kind == "all_reduce" and len(first.payload) > 1 and batches:
            # A nest, on a backend that packs its arrays into fewer collectives (as TF
            # does): the trace still lists each array, with its share of the time.
            columns = [[leaves[i] for leaves in placed] for i in range(len(first.payload))]
            start = time.perf_counter() if timed else 0.0
            with intent:
                packing = bytes_per_pack(self.options, first.options)
                sums = batch_all_reduce(backend, columns, devices, packing)
            duration = time.perf_counter() - start if timed else None
            for reduced in sums:
                for r, out in enumerate(outputs):
                    out.append(reduced[r])
            if tracing:
                sizes = [_nbytes(column[0]) for column in columns]
                total = sum(sizes) or 1
                for column, size in zip(columns, sizes, strict=True):
                    share = None if duration is None else duration * size / total
                    _record(first, column[0], devices, backend.name, share)
            return outputs
        for i in range(len(first.payload)):
            values = [leaves[i] for leaves in placed]
            start = time.perf_counter() if timed else 0.0
            with intent:
                if first.kind == "all_reduce":
                    reduced = backend.all_reduce(values, devices)
                else:
                    reduced = backend.all_gather(values, first.signature[0], devices)
            duration = time.perf_counter() - start if timed else None
            for r, out in enumerate(outputs):
                out.append(reduced[r])
            if tracing:
                _record(first, values[0], devices, backend.name, duration)
        return outputs

    def _merge_call(self, requests: list[_SyncRequest]) -> list[Any]:
        merge_fn = requests[0].payload[0]
        args = regroup(tuple(r.payload[1] for r in requests))
        kwargs = regroup(tuple(r.payload[2] for r in requests))
        strategy = self.strategy
        if _trace.is_tracing():
            _trace.record_collective(
                "merge_call",
                reduce_op=None,
                dtype="",
                nbytes=0,
                shape=(),
                participants=self.devices,
                backend=self.backend.name,
                source=requests[0].source,
            )
        with _context.mode(strategy, None, strategy):
            result = merge_fn(strategy, *args, **kwargs)
        return [select_replica(r, result) for r in range(len(requests))]


class _Run(_Collectives):
    """One run of several replicas: the scheduler."""

    def __init__(
        self,
        group: ReplicaGroup,
        fn: Callable[..., Any],
        per_replica_args: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
        mode: Mode,
        timeout: float,
        wrap_channel: Callable[[ReplicaChannel, int], ReplicaChannel] | None = None,
        lazy_replica_id: bool = False,
    ) -> None:
        super().__init__(group, wrap_channel, lazy_replica_id)
        self.fn = fn
        self.args = per_replica_args
        self.timeout = timeout
        self.running: _Slot | None = None  # greenlet mode: the replica running now
        self.switches = 0  # greenlet mode: replica resumptions so far
        self.thread_id = threading.get_ident()
        slot_class: type[_Slot] = _GreenletSlot if mode == "greenlet" else _ThreadSlot
        self.slots: list[_Slot] = [slot_class(self, r) for r in range(len(per_replica_args))]
        self.watched = mode == "greenlet"

    def call_replica(self, slot: _Slot) -> Any:
        args, kwargs = self.args[slot.index]
        return self.run_replica(slot.index, slot, self.fn, args, kwargs)

    def run(self) -> list[Any]:
        replies: list[Any] = [None] * len(self.slots)
        if self.watched:
            _WATCHDOG.watch(self)
        try:
            while True:
                for slot in self.slots:
                    slot.advance(replies[slot.index])
                    if slot.status == _FAILED:
                        assert slot.error is not None
                        raise slot.error
                paused = [s for s in self.slots if s.status == _PAUSED]
                if not paused:
                    return [s.result for s in self.slots]
                if len(paused) < len(self.slots):
                    raise self._mismatch(
                        {
                            s.index: s.request.describe() if s.request else "returned from fn"
                            for s in self.slots
                        }
                    )
                replies = self._resolve([s.request for s in paused if s.request is not None])
        finally:
            if self.watched:
                _WATCHDOG.unwatch(self)
            for slot in self.slots:
                slot.stop()
                slot.result = None
            # Slots and run refer to each other: without this, the run's arguments and
            # results would live until the garbage collector's next pass.
            self.slots = []


def _record(
    request: _SyncRequest,
    example: Any,
    devices: Sequence[str],
    backend: str,
    duration: float | None = None,
) -> None:
    shape = tuple(int(d) for d in example.shape)
    _trace.record_collective(
        request.kind,
        reduce_op=request.signature[0] if request.kind == "all_reduce" else None,
        dtype=dtype_name(example.dtype),
        nbytes=_nbytes(example),
        shape=shape,
        participants=tuple(devices),
        backend=backend,
        source=request.source,
        duration=duration,
    )


def _nbytes(array: Any) -> int:
    shape = tuple(int(d) for d in array.shape)
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype_name(array.dtype)).itemsize


class EagerReplicaRunner:
    """Runs ``strategy.run``'s replicas eagerly: core's runner for eager backends.

    Core calls ``run(group, fn, per_replica_args)`` for a backend whose
    ``Capabilities.execution_model`` is ``"eager"``, with the backend's
    ``replica_runner`` (``polydist.backend.SupportsReplicaRunner``) or a default
    one. A compiled backend may call it too, for a call it cannot compile. A
    subclass may extend ``run`` with work around a whole run (calling
    ``super().run``).

    Args:
        mode: ``"greenlet"`` (default) runs replicas as greenlets on the calling
            thread; ``"thread"`` runs them on pooled threads (see the module doc).
        timeout: seconds a replica may run between two sync points (default
            ``$POLYDIST_TIMEOUT_SECONDS`` or 300). Thread mode raises
            ``DeadlineExceededError`` after it; greenlet mode can only report the
            replica on stderr (a blocked greenlet blocks the calling thread).
        wrap_channel: called as ``wrap_channel(channel, replica_id)`` for each
            replica of each run, ``replica_id`` its id among every worker's replicas
            (``group.replica_offset`` + its index here); what it returns is the
            replica's channel. A backend uses it to wrap the collectives, e.g. to
            make them differentiable (torch's autograd).
        lazy_replica_id: place each replica's ``replica_id_in_sync_group`` on its
            device only when the replica first asks for it (once per run) instead of
            before every run. Only for engines whose placement inside the replica
            function gives a value that outlives the call: not under a tracing
            transformation (a ``jax.jit`` there would leak a tracer).
    """

    def __init__(
        self,
        mode: Mode = "greenlet",
        timeout: float | None = None,
        *,
        wrap_channel: Callable[[ReplicaChannel, int], ReplicaChannel] | None = None,
        lazy_replica_id: bool = False,
    ) -> None:
        if mode not in ("greenlet", "thread"):
            raise ValueError(f"mode must be 'greenlet' or 'thread', got {mode!r}.")
        self._mode: Mode = mode
        self._timeout = timeout
        self._wrap_channel = wrap_channel
        self._lazy_replica_id = lazy_replica_id

    @property
    def lazy_replica_id(self) -> bool:
        """Whether replica ids are placed only when asked for (see the class doc)."""
        return self._lazy_replica_id

    @property
    def mode(self) -> Mode:
        return self._mode

    def runs_inline(self, replicas: int) -> bool:
        """Whether a run of ``replicas`` replicas runs on the calling thread: in thread
        mode, a lone replica does (it has nobody to wait for at its collectives)."""
        return self._mode == "thread" and replicas == 1

    def run(
        self,
        group: ReplicaGroup,
        fn: Callable[..., Any],
        per_replica_args: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
    ) -> list[Any]:
        """Calls ``fn(*args, **kwargs)`` once per replica of ``group`` (a run's group:
        `polydist.backend.replica_group`), each inside its ``ReplicaContext`` and device
        scope, and returns each replica's result in replica order."""
        # Read at every run, inline too: a bad $POLYDIST_TIMEOUT_SECONDS fails at once.
        timeout = self._timeout if self._timeout is not None else timeout_seconds_from_env()
        if self._mode == "thread" and len(per_replica_args) == 1:  # runs_inline
            # A lone replica on the calling thread, no scheduler: nobody to wait for.
            args, kwargs = per_replica_args[0]
            # Its collectives object and channel hold no state of a run: built once per
            # group (a strategy's run state) and runner, kept on the group.
            inline = group.run_cache.get(_INLINE)
            if inline is None or inline[0] is not self:
                collectives = _Collectives(group, self._wrap_channel, self._lazy_replica_id)
                inline = (self, collectives, collectives.channel(0, collectives))
                group.run_cache[_INLINE] = inline
            return [inline[1].run_replica(0, inline[1], fn, args, kwargs, inline[2])]
        run = _Run(
            group,
            fn,
            per_replica_args,
            self._mode,
            timeout,
            self._wrap_channel,
            self._lazy_replica_id,
        )
        return run.run()


#: A lone inline replica's ``(runner, _Collectives, channel)`` in its group's run_cache.
_INLINE = "inline_run"

#: The runner of an eager backend that configures none (`SupportsReplicaRunner`).
_DEFAULT_RUNNER = EagerReplicaRunner()


class ReplicaExecution:
    """How core runs ``strategy.run`` over one `ReplicaGroup`: the backend's features are
    read once, here, and each run reads its execution model (a backend may switch it,
    e.g. ``JaxProcessBackend.set_jit``)."""

    __slots__ = ("_compiles", "_supplies_runner", "asked", "direct", "group", "prepare", "prepared")

    def __init__(self, group: ReplicaGroup) -> None:
        self.group = group
        found = features(group.backend)
        self._supplies_runner = found.replica_runner
        self._compiles = found.compiled_run
        #: The backend's fast path for a call it has run before (`SupportsDirectRun`).
        self.direct: Callable[..., Any] | None = (
            cast("SupportsDirectRun", group.backend).run_direct if found.direct_run else None
        )
        #: Its prepared calls (`SupportsPreparedRun`): per replica function, what
        #: ``strategy.run`` calls first; and how often each was asked for in vain.
        self.prepare: Callable[..., Any] | None = (
            cast("SupportsPreparedRun", group.backend).prepare_direct
            if found.prepared_run and found.direct_run
            else None
        )
        self.prepared: dict[Any, Callable[[tuple[Any, ...]], Any]] = {}
        self.asked: dict[Any, int] = {}

    def run(
        self,
        fn: Callable[..., Any],
        per_replica_args: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
    ) -> list[Any]:
        group = self.group
        backend = group.backend
        if backend.capabilities.execution_model == "eager":
            # An annotation, not typing.cast: a call at run time, at every run.
            supplier: SupportsReplicaRunner = backend  # type: ignore[assignment]
            runner = supplier.replica_runner if self._supplies_runner else _DEFAULT_RUNNER
            return runner.run(group, fn, per_replica_args)
        if not self._compiles:
            raise TypeError(
                f"Backend {backend.name!r} declares Capabilities.execution_model="
                f"{backend.capabilities.execution_model!r} but has no run_replicas(group, fn, "
                "per_replica_args) (polydist.backend.SupportsCompiledRun), so strategy.run "
                "cannot run on it. Implement run_replicas, or declare execution_model='eager' "
                "to have core run the replicas."
            )
        return cast("SupportsCompiledRun", backend).run_replicas(group, fn, per_replica_args)
