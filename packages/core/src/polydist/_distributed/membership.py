"""The multi-process kit of one-process-per-worker engines: heartbeats and the
cluster membership they feed (who is alive, who joined, agreement on collectives),
capabilities of such an engine, and one eager replica runner per worker.

The strategy side (``MultiProcessExtended``, cluster resolution) is in
:mod:`polydist._distributed.multi_process`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol, TypeVar

from polydist import errors
from polydist._collectives.check import (
    CollectiveChecker,
    Pending,
    SignatureStore,
    checks_enabled,
)
from polydist.backend._contract import (
    Capabilities,
)

# -- liveness: heartbeats through the engine's key-value store --------------------------------

#: How often each worker writes its heartbeat.
HEARTBEAT_SECONDS = 0.5
# How long the survivors watch the heartbeats after a failure before naming the dead.
_SILENCE_SECONDS = 4 * HEARTBEAT_SECONDS
# How long a worker whose fast collective failed waits for its peers' signatures of it.
_AFTER_FAILURE_SECONDS = 1.0


class HeartbeatStore(Protocol):
    """The cluster's key-value store (torch's ``TCPStore``, JAX's coordination service)."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> str | None:
        """The value, or ``None`` if the key is not set."""
        ...

    def delete(self, key: str) -> None: ...


class Heartbeat:
    """A daemon thread that writes ``"<beat> <collectives> <fast> <failed>"`` under
    ``hb/<worker>`` every `HEARTBEAT_SECONDS` and watches the other workers' entries
    (``<fast>``: the number of the latest collective this worker issued on the check's
    fast path, 0 for none; see ``polydist._collectives.check``; ``<failed>``: 1 once an
    error on this worker left the cluster out of step, `ClusterMembership.abandon`).

    When a collective fails, `diagnose` tells the workers whose heartbeat stopped
    (dead, hung or cut off) from those alive but behind (they have not entered
    this worker's current collective). The store lives in worker 0's process:
    when it is unreachable, worker 0 is the one gone.
    """

    def __init__(
        self,
        make_store: Callable[[], HeartbeatStore],
        rank: int,
        world_size: int,
        collectives: Callable[[], int | None],
        fast: Callable[[], int] = lambda: 0,
        failed: Callable[[], bool] = lambda: False,
    ) -> None:
        self._make_store = make_store
        self._rank = rank
        self._others = [r for r in range(world_size) if r != rank]
        self._collectives = collectives
        self._fast_now = fast
        self._failed_now = failed
        self._fast: dict[int, int] = {}  # worker -> its latest fast collective
        self._failed: list[int] = []  # the workers whose heartbeat says they abandoned
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._store_error: BaseException | None = None
        # worker -> (its last entry (beat, collectives), when it last changed)
        self._seen: dict[int, tuple[tuple[int, int], float]] = {}
        self._started = self._watched = time.monotonic()  # _watched: the last look
        self._chores: list[Callable[[HeartbeatStore], None]] = []
        self._thread = threading.Thread(
            target=self._loop, name=f"polydist-heartbeat-{rank}", daemon=True
        )
        self._thread.start()

    def _loop(self) -> None:
        try:
            store = self._make_store()
            beat = 0
            while not self._stop.is_set():
                count = self._collectives()
                if count is None:  # the group is gone
                    return
                beat += 1
                failed = int(self._failed_now())
                store.set(f"hb/{self._rank}", f"{beat} {count} {self._fast_now()} {failed}")
                self._watch(store)
                for chore in list(self._chores):
                    chore(store)
                self._stop.wait(HEARTBEAT_SECONDS)
        except Exception as e:  # the store (worker 0) is gone, or the process is exiting
            with self._lock:
                self._store_error = e

    def _watch(self, store: HeartbeatStore) -> None:
        now = time.monotonic()
        for r in self._others:
            value = store.get(f"hb/{r}")
            if value is None:
                continue
            beat, count, *rest = (int(x) for x in value.split())
            with self._lock:
                self._fast[r] = rest[0] if rest else 0
                if len(rest) > 1 and rest[1] and r not in self._failed:
                    self._failed.append(r)
                previous = self._seen.get(r)
                if previous is None or previous[0] != (beat, count):
                    self._seen[r] = ((beat, count), now)
        with self._lock:
            self._watched = now

    def add_chore(self, chore: Callable[[HeartbeatStore], None]) -> None:
        """Runs ``chore(store)`` after each beat, on the heartbeat's thread and store
        connection (it must be quick: a late beat looks like a dead worker)."""
        self._chores.append(chore)

    def fast_at(self, n: int) -> list[int]:
        """The workers whose latest heartbeat says they are in fast collective ``n``."""
        with self._lock:
            return [r for r, fast in self._fast.items() if fast == n]

    def failed(self) -> list[int]:
        """The workers whose heartbeat says an error on them left the cluster out of step
        (`ClusterMembership.abandon`): they will not join another collective."""
        with self._lock:
            return list(self._failed)

    def silent(self, seconds: float = 2 * _SILENCE_SECONDS) -> list[int]:
        """The workers whose heartbeat this thread has seen unchanged for ``seconds`` (dead,
        hung or cut off); ``[0]`` when the store (worker 0's) is unreachable. Does not wait.
        Measured against this thread's own last look, so a starved thread names nobody."""
        with self._lock:
            if self._store_error is not None:
                return [0] if self._rank != 0 else []
            now = self._watched
            if now - self._started < seconds:
                return []
            return [
                r
                for r in self._others
                if (seen := self._seen.get(r)) is None or now - seen[1] > seconds
            ]

    def diagnose(self, collectives: int) -> tuple[list[int], list[int]]:
        """(dead, behind) after a failed collective, this worker's number ``collectives``.

        Sleeps ~2 s so that every live worker writes fresh heartbeats first.
        """
        if not self._others:
            return [], []
        failed_at = time.monotonic()
        time.sleep(_SILENCE_SECONDS)
        # A beat written just before a worker died may be read up to one interval later.
        since = failed_at + 1.2 * HEARTBEAT_SECONDS
        with self._lock:
            if self._store_error is not None:
                return ([0] if self._rank != 0 else []), []
            latest = {
                r: seen[0] if (seen := self._seen.get(r)) is not None and seen[1] > since else None
                for r in self._others
            }
        dead = [r for r in self._others if latest[r] is None]
        behind = [r for r in self._others if (v := latest[r]) is not None and v[1] < collectives]
        return dead, behind

    def stop(self, wait: float = 0.0) -> None:
        """Stops the thread; waits up to ``wait`` s for it to end (call it at exit: a
        daemon thread killed inside an engine's C++ call can abort the process)."""
        self._stop.set()
        if wait > 0 and self._thread is not threading.current_thread():
            self._thread.join(wait)


def describe_workers(
    ranks: Sequence[int], names: Sequence[str], addresses: Sequence[str] = ()
) -> str:
    """``"1 (/job:worker/replica:0/task:1 at host:port)"`` for each worker, comma-separated."""
    parts = []
    for r in ranks:
        where = f" at {addresses[r]}" if r < len(addresses) and addresses[r] else ""
        parts.append(f"{r} ({names[r]}{where})" if r < len(names) else str(r))
    return ", ".join(parts)


# -- the engines' halves ---------------------------------------------------------------------


class ClusterStore(HeartbeatStore, SignatureStore, Protocol):
    """The cluster's key-value store, as the heartbeat and the collective check use it."""


class ClusterMembership:
    """This process's membership in a cluster of worker processes, which an engine
    subclasses: the workers (``names`` and ``addresses`` by worker index), how many
    collectives this process has entered, its heartbeat and collective check (`watch`),
    the failure that ended the cluster, and how messages name the workers.

    A collective runs through `call`; the engine's errors in it (``engine_errors``)
    become polydist's through the engine's `translate`.
    """

    #: What the engine raises when a collective, or the store, fails.
    engine_errors: ClassVar[tuple[type[Exception], ...]] = (Exception,)

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        timeout: float,
        names: Sequence[str],
        addresses: Sequence[str],
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.names = list(names)
        self.addresses = list(addresses)
        self.collectives = 0  # how many collectives this process has entered
        # At the collective check of the next one: its heartbeat counts it as reached,
        # or a peer waiting there for a stuck third would look behind too.
        self.entering = False
        self.failure: errors.OpError | errors.CollectiveMismatchError | None = None
        self.in_fast = 0  # the latest collective issued on the check's fast path
        # An error on this worker left the cluster out of step (`abandon`).
        self.abandoned = False
        # id() of the latest CollectiveMismatchError every worker raised alike (the
        # cluster stays usable after it, so `abandon` lets it pass).
        self._agreed_mismatch: int | None = None
        self.heartbeat: Heartbeat | None = None
        self.checker: CollectiveChecker | None = None

    def watch(
        self,
        make_store: Callable[[], ClusterStore],
        *,
        check_timeout: float | None = None,
        overlap_writes: bool = False,
        release: Callable[[str], None] | None = None,
    ) -> None:
        """Starts the heartbeat (whose thread makes its own store) and the collective
        check (on another ``make_store()``), which waits ``check_timeout`` (default
        ``timeout``) for the others' signatures. ``release``: the engine's way to
        complete a fast peer's collective (`CollectiveChecker`'s; it must not raise)."""
        me = weakref.ref(self)

        def collectives() -> int | None:
            member = me()
            return None if member is None else member.collectives + member.entering

        def fast() -> int:
            member = me()
            return 0 if member is None else member.in_fast

        def failed() -> bool:
            member = me()
            return member is not None and member.abandoned

        self.heartbeat = Heartbeat(
            make_store, self.rank, self.world_size, collectives, fast, failed
        )
        self.checker = CollectiveChecker(
            make_store(),
            self.rank,
            self.world_size,
            timeout=self.timeout if check_timeout is None else check_timeout,
            heartbeat=self.heartbeat,
            names=self.names,
            addresses=self.addresses,
            enabled=checks_enabled(),
            overlap_writes=overlap_writes,
            release=release,
        )

    # -- collectives ---------------------------------------------------------------------------
    def check_signature(
        self,
        op: str,
        dtype: Any = None,
        shape: Sequence[int] = (),
        axis: int | None = None,
        payload: str = "",
    ) -> list[str] | None:
        """Before collective ``op`` of an array of ``dtype`` and ``shape`` (``dtype=None``:
        ``op`` alone): raises ``CollectiveMismatchError`` unless every worker is about to run
        the same one (see ``polydist._collectives.check``); a missing peer or store fails
        the cluster (`failed`). Returns every worker's ``payload`` (rank order), or
        ``None`` when nothing was compared."""
        return self.checked(op, dtype, shape, axis, lambda: None, payload)[1]

    def checked(
        self,
        op: str,
        dtype: Any,
        shape: Sequence[int],
        axis: int | None,
        prepare: Callable[[], _T],
        payload: str = "",
        parts: Sequence[Sequence[int]] | None = None,
    ) -> tuple[_T, list[str] | None]:
        """`check_signature`, running ``prepare()`` (the caller's work before the
        collective) while this worker's signature travels: (its result, the payloads).
        ``parts``: the shapes of the arrays packed into the collective, if several."""
        if self.checker is None or self.failure is not None:
            # no store to compare through (or `call` raises the failure)
            return prepare(), None
        self.entering = True
        try:
            pending = self.checker.publish(op, dtype, shape, axis, payload, parts)
            prepared = prepare()
            return prepared, self.checker.confirm(pending)
        except errors.CollectiveMismatchError as e:
            self._mismatched(e)  # no worker issued it: the cluster is still usable
            raise
        except self.engine_errors as e:
            self.collectives += 1  # the collective it was entering, for the diagnosis
            raise self.failed(op, e) from e
        finally:
            self.entering = False

    def checked_wire(
        self,
        op: str,
        dtype: Any,
        shape: Sequence[int],
        prepare: Callable[[], _T],
        wire: str | None,
        parts: Sequence[Sequence[int]] | None = None,
    ) -> tuple[_T, Pending | None]:
        """`checked` for a collective whose buffer carries a presence flag (every worker
        adds 1; ``wire`` names what the engine issues, e.g. ``"cpu float32 1025"``;
        ``None``: no flag, an ordinary check): the check may take the fast path
        (``Pending.fast``: no waiting, see ``polydist._collectives.check``). Returns
        ``prepare()``'s result and the check (``None``: unchecked) for `call` and
        `arrived`."""
        if self.checker is None or self.failure is not None:
            return prepare(), None
        self.entering = True
        try:
            pending = self.checker.publish(op, dtype, shape, None, "", parts, wire=wire)
            prepared = prepare()
            if pending is not None and pending.fast:
                self.in_fast = pending.n  # the heartbeat tells the peers
            else:
                self.checker.confirm(pending)
            return prepared, pending
        except errors.CollectiveMismatchError as e:
            self._mismatched(e)  # every worker issued the same number of collectives
            raise
        except self.engine_errors as e:
            self.collectives += 1
            raise self.failed(op, e) from e
        finally:
            self.entering = False

    def arrived(self, pending: Pending | None, present: int) -> None:
        """After `checked_wire`'s collective: its presence flag summed to ``present``.
        Short of the number of workers, a peer at another collective released this
        worker's fast one: raises that ``CollectiveMismatchError``."""
        if pending is None or self.checker is None:
            return  # unchecked: a short sum is a mismatch the program chose not to check
        if present == self.world_size:
            if pending.fast:
                self.checker.settled(pending)
            return
        mismatch = self.checker.fast_mismatch(pending)
        self._mismatched(mismatch)
        raise mismatch

    def _mismatched(self, mismatch: errors.CollectiveMismatchError) -> None:
        """Every worker raises ``mismatch`` at the same collective: the cluster stays
        usable (`abandon` lets it pass), unless a peer abandoned it (then it failed)."""
        if getattr(self.checker, "peer_failed", False):  # (a stand-in checker may lack it)
            self.failure = mismatch
        else:
            self._agreed_mismatch = id(mismatch)

    def abandon(self, err: BaseException, where: str = "strategy.run") -> None:
        """``err`` escaped ``where`` on this worker, whose replicas may have left the
        cluster's collectives out of step: one waited in a collective that another
        replica's error kept from running across the workers, so this worker's collective
        count lags the peers' and its next step's collectives would pair with their
        current ones (wrong values, not an error). The cluster fails: this worker's next
        collective raises ``CancelledError``, and the check publishes the failure
        (`CollectiveChecker.abandon`, the heartbeat's flag), so that the peers' pending
        or next collective raises ``CollectiveMismatchError`` naming this worker and
        ``err``. Nothing happens for one worker, a cluster that failed already, or a
        mismatch every worker raised alike (the workers are still in step)."""
        if self.world_size < 2 or self.failure is not None or id(err) == self._agreed_mismatch:
            return
        said = " ".join(str(err).split())
        if len(said) > _REASON_CHARS:
            said = said[: _REASON_CHARS - 3] + "..."
        raised = f"{type(err).__name__}: {said}" if said else type(err).__name__
        reason = f"{where} raised {raised} (after {self.collectives} collective(s))"
        self.failure = errors.CancelledError(
            f"{where} raised {raised} on worker {self.describe([self.rank])} after its "
            f"collective #{self.collectives}, which may have left the cluster's collectives "
            "out of step (a replica raised while others waited in a collective, which then "
            "never ran across the workers): no collective can run any more, and the other "
            "workers raise too. Stop every worker and restart them all, from the latest "
            "checkpoint (polydist launch stops the others when one fails)"
        )
        if self.checker is not None:
            try:
                self.checker.abandon(reason)
            except Exception:  # the store (worker 0) is gone: the peers see that instead
                pass
        # Then the heartbeat's flag, for the peers in a fast collective (they read the
        # signature just written).
        self.abandoned = True

    def announce(self, op: str) -> Pending | None:
        """For an engine that compares the workers' digests of collective ``op`` in a
        collective of its own (cheaper than the store's round trip): numbers ``op`` as the
        check does, without a store round trip (`CollectiveChecker.announce`). `settle`
        follows once that exchange completed; `publish_late` meanwhile, if it is slow.
        ``None``: no check."""
        if self.checker is None or self.failure is not None:
            return None
        try:
            return self.checker.announce(op)
        except self.engine_errors as e:
            self.collectives += 1
            raise self.failed(op, e) from e

    def publish_late(self, pending: Pending | None) -> None:
        """`announce`'s signature, written after all, so that a peer at another collective
        raises ``CollectiveMismatchError`` (safe from another thread; errors are dropped:
        the engine's own wait reports a gone store)."""
        if self.checker is not None:
            try:
                self.checker.publish_late(pending)
            except Exception:
                pass

    def settle(self, pending: Pending | None) -> None:
        """`announce`'s collective completed on every worker (`CollectiveChecker.settled`)."""
        if self.checker is not None:
            self.checker.settled(pending)

    def call(self, what: str, fn: Callable[[], Any], pending: Pending | None = None) -> Any:
        """``fn()``, collective ``what``; an engine error in it fails the cluster (`failed`),
        and once failed, no collective runs. ``pending``: `checked_wire`'s check of it;
        when fast, an error there may be a peer that left or is at another collective
        (`CollectiveChecker.mismatch_after`), raised as ``CollectiveMismatchError``."""
        if self.failure is not None:
            raise type(self.failure)(
                f"{what} cannot run: the cluster failed earlier and cannot be used any more "
                f"({self.failure}). Stop every worker and restart them."
            )
        self.collectives += 1
        try:
            return fn()
        except self.engine_errors as e:
            if pending is not None and pending.fast and self.checker is not None:
                try:
                    mismatch = self.checker.mismatch_after(pending, _AFTER_FAILURE_SECONDS)
                except Exception:  # the store is gone too: the engine's diagnosis follows
                    mismatch = None
                if mismatch is not None:
                    self.failure = mismatch
                    raise mismatch from e
            raise self.failed(what, e) from e

    def failed(self, what: str, err: BaseException) -> errors.OpError:
        """Records and returns `translate`'s error for ``err``, which ended ``what``: the
        cluster's failure."""
        failure = self.translate(what, err)
        self.failure = failure
        return failure

    def translate(self, what: str, err: BaseException) -> errors.OpError:
        """The ``UnavailableError`` or ``DeadlineExceededError`` for the engine's ``err``,
        which ended collective ``what``, naming the workers at fault (`diagnose`)."""
        raise NotImplementedError(f"{type(self).__name__} must implement translate")

    # -- naming the workers ----------------------------------------------------------------
    def diagnose(self, collectives: int | None = None) -> tuple[list[int], list[int]]:
        """(dead, behind) after collective number ``collectives`` (default: the latest) failed:
        see `Heartbeat.diagnose`; nobody without a heartbeat."""
        if self.heartbeat is None:
            return [], []
        return self.heartbeat.diagnose(self.collectives if collectives is None else collectives)

    def describe(self, ranks: Sequence[int]) -> str:
        """`describe_workers` of this cluster's workers ``ranks``."""
        return describe_workers(ranks, self.names, self.addresses)

    def collective(self, what: str, n: int | None = None) -> str:
        """How messages name collective number ``n`` (default: the latest), ``what``."""
        n = self.collectives if n is None else n
        return f"{what} (collective #{n} of worker {self.rank}) across {self.world_size} workers"

    def unavailable(self, dead: Sequence[int]) -> str:
        """Why messages name the ``dead`` workers of `diagnose`."""
        return (
            f"worker(s) {self.describe(dead)} unavailable: its process stopped sending "
            "heartbeats (it exited, crashed, hung or lost its network)"
        )

    def behind(self, late: Sequence[int]) -> str:
        """Why messages name the ``late`` workers (``behind``) of `diagnose`."""
        return (
            f"worker(s) {self.describe(late)} are alive but did not reach it (they are stuck, "
            "slower than the timeout, or running different collectives)"
        )

    def close(self, wait: float = 0.0) -> None:
        """Leaves the collective check (unless the cluster failed) and stops the heartbeat,
        waiting up to ``wait`` s for its thread (see `Heartbeat.stop`)."""
        if self.checker is not None and self.failure is None:
            self.checker.leave()  # a peer still at a collective raises CollectiveMismatchError
        if self.heartbeat is not None:
            self.heartbeat.stop(wait)


_T = TypeVar("_T")

# How much of an error's message `ClusterMembership.abandon` publishes.
_REASON_CHARS = 300


def once_per_process(make: Callable[[], _T]) -> Callable[[], _T]:
    """A function that returns the one ``make()`` of this process, made on its first call
    (thread-safe): an engine's shared backend, its watchdog."""
    made: list[_T] = []
    lock = threading.Lock()

    def get() -> _T:
        with lock:
            if not made:
                made.append(make())
            return made[0]

    return get


def process_capabilities(capabilities: Capabilities) -> Capabilities:
    """An engine backend's ``capabilities`` with one process per worker: ``multi_worker``;
    no simulated clusters; no exact reduction order (the engine's sum across workers)."""
    return dataclasses.replace(
        capabilities, multi_worker=True, reduction_orders=(), simulated_clusters=False
    )
