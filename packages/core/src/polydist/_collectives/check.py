"""Workers agree on every cross-process collective, or all raise ``CollectiveMismatchError``.

With one process per worker (`polydist._distributed.multi_process`), nothing makes two
processes call the same collective: on gloo a disagreement hangs until the
timeout, crashes the process (``gloo::EnforceNotMet`` aborts it when the
sizes differ) or silently returns wrong values (a float32 tensor summed with
an int32 one of the same size). So before each cross-process collective,
`CollectiveChecker.publish` writes this worker's *signature* of it (op,
reduce op, dtype, shape) under ``cc/<n>/<worker>`` in the engine's key-value
store (torch's ``TCPStore``, JAX's coordination service: the store the
heartbeats use); `CollectiveChecker.confirm` then waits for every other
worker's signature of collective ``n``. Different signatures raise
`CollectiveMismatchError` on every worker, before any of them issues the
collective (each sees all signatures), so nothing hangs and nothing is
corrupted; the workers then swap the user's call sites for the message
(found only on a mismatch: finding the line costs more than the check). A
worker that never publishes is a missing peer: the wait ends when its
heartbeat stops or after the collective timeout, and the engine names it
(``UnavailableError`` / ``DeadlineExceededError``).

Cost: one store write (on a thread of its own where writes wait for a
reply) and one blocking store read per collective, a round trip to worker
0's store (see docs/multi-host.md). `CollectiveChecker.confirm` does the
waiting, so that the caller's own work between the two (torch copies the
input) overlaps the round trip.
An engine may compare a collective in an exchange of its own that is cheaper
than the round trip (JAX's compiled step: an XLA all-gather of the program's
digest): `CollectiveChecker.announce` numbers it without a store write,
`CollectiveChecker.settled` ends it, and only if the exchange waits does the
engine `publish_late` the signature and `peek` at the peers', so that a peer at
another collective raises the mismatch.
**Fast path: a collective the workers' history predicts.** Training repeats
the same collectives step after step. Every worker keeps the same table of
which signature followed which in the collectives all of them agreed on; when
an engine can carry an in-band *presence flag* in a collective (an extra
element of an all-reduce's buffer, to which every worker adds 1: the engine's
own collective, no other), it passes ``wire`` (what it will issue, e.g.
``cpu float32 1048577``) to `CollectiveChecker.publish`. If the signature is
the one the table predicts, the check is *fast*: nothing is written or read,
and the engine issues the collective at once; the worker's heartbeat says that
it is in fast collective ``n``. This is safe because the prediction is the same
on every worker (the same agreed history), so workers that all take the fast
path run the same collective. A worker whose collective is not the predicted
one takes the slow path; while it waits for the others' signatures it looks at
their heartbeats, and a peer in fast collective ``n`` is a mismatch: it first
issues the collective that peer waits in, with zeros (``release``, with the wire
the table recorded for the predicted signature, so sizes match and nothing hangs
or aborts), whose presence flag then sums to less than the number of workers,
and raises `CollectiveMismatchError`. The fast peers see the short sum
(`CollectiveChecker.fast_mismatch`) and raise the same diagnosis, call sites
included. A peer that left or died while a fast peer waits in the collective
shows as the engine's failure there, which the engine looks up
(`CollectiveChecker.mismatch_after`). After any mismatch, prediction stops for
the rest of the run. So a repeated step costs no store traffic at all; a
mismatch against a fast peer is found within about a heartbeat (0.5 to 1 s).

``$POLYDIST_CHECK_COLLECTIVES=0`` (a polydist extension) turns the check
off; every worker publishes its setting when it joins, and the check runs
only when all workers have it on.

The engine knows the array it sends (dtype, shape). The reduce op comes
from its caller (`collective_intent`): the eager replica runner, which also
names the paused replica's line, or the strategy's cross-replica ``reduce``.
Otherwise the call site is the innermost frame outside polydist.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol

from polydist._base.arrays import dtype_name
from polydist._collectives import trace as _trace
from polydist.errors import CollectiveMismatchError

__all__ = [
    "CHECK_ENV",
    "CollectiveChecker",
    "Pending",
    "PeerMissing",
    "SignatureStore",
    "checks_enabled",
    "collective_intent",
    "collective_purpose",
]

#: Environment variable: ``0`` turns the cross-process check off (default ``1``).
CHECK_ENV = "POLYDIST_CHECK_COLLECTIVES"

# How long each store read waits before the waiter looks at the peers' heartbeats.
_SLICE_SECONDS = 0.5
# What a worker publishes as its next signature when it leaves the cluster.
_LEFT = "left"
# ... and when an error on it left the cluster's collectives out of step (`abandon`).
_FAILED = "failed"
# How a mismatch names a worker whose signature did not arrive.
_ABSENT = "(did not publish its collective)"
#: How long worker 0 waits for the others to read a mismatch before raising it.
_LINGER_SECONDS = 5.0


def checks_enabled() -> bool:
    """Whether this process checks its collectives against the other workers' (`CHECK_ENV`)."""
    value = os.environ.get(CHECK_ENV, "1").strip().lower()
    if value in ("1", "true", "yes", "on", ""):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(
        f"${CHECK_ENV}={os.environ[CHECK_ENV]!r}: expected 1 (check that every worker calls the "
        "same collectives, the default) or 0 (do not check). Set it the same on every worker."
    )


# -- what the caller of a collective meant ------------------------------------------------


class _Intent(threading.local):
    def __init__(self) -> None:
        self.active = False
        self.reduce_op: str | None = None
        self.source: Callable[[], str] | None = None
        self.purpose: str | None = None


_INTENT = _Intent()


class collective_intent:  # a class used like a function: ``with collective_intent(...)``
    """Tells the engine below the reduce op and the user's call site of the collectives
    issued inside (the outermost one wins: ``reduce(MEAN, axis=0)`` stays MEAN)."""

    __slots__ = ("_reduce_op", "_set", "_source")

    def __init__(self, reduce_op: str | None, source: Callable[[], str] | None = None) -> None:
        self._reduce_op = reduce_op
        self._source = source
        self._set = False

    def __enter__(self) -> None:
        if not _INTENT.active:
            _INTENT.active = True
            _INTENT.reduce_op = self._reduce_op
            _INTENT.source = self._source
            self._set = True

    def __exit__(self, *exc: object) -> None:
        if self._set:
            self._set = False
            _INTENT.active = False
            _INTENT.reduce_op = None
            _INTENT.source = None


#: What a collective can be part of (`collective_purpose`) -> the advice a mismatch
#: against it gives.
PURPOSES = {
    "checkpoint save": (
        "A checkpoint save (polydist.checkpoint.save, train.Checkpoint.save or write, "
        "CheckpointManager.save) reads SyncOnRead variables with collectives, so every "
        "worker must call it, not only the chief: the others take part in the reads and "
        "write nothing (see docs/multi-host.md). The save failed before writing anything."
    ),
    "checkpoint restore": (
        "A checkpoint restore (polydist.checkpoint.restore, train.Checkpoint.restore or "
        "read, CheckpointManager.restore_or_initialize) checks with one collective that "
        "every worker restores the same checkpoint, so every worker must call it, also "
        "one that found no checkpoint (restore(None)); see docs/multi-host.md. Nothing "
        "was restored."
    ),
}


class collective_purpose:  # used like a function: ``with collective_purpose(...)``
    """Marks the collectives issued inside as part of ``purpose`` (a key of `PURPOSES`):
    their signatures say so, so that they never pair up with a user's collective of the
    same array on another worker (the outermost one wins)."""

    __slots__ = ("_purpose", "_set")

    def __init__(self, purpose: str) -> None:
        if purpose not in PURPOSES:
            raise ValueError(f"unknown collective purpose {purpose!r}; expected one of {PURPOSES}")
        self._purpose = purpose
        self._set = False

    def __enter__(self) -> None:
        if _INTENT.purpose is None:
            _INTENT.purpose = self._purpose
            self._set = True

    def __exit__(self, *exc: object) -> None:
        if self._set:
            self._set = False
            _INTENT.purpose = None


# -- the check ------------------------------------------------------------------------------


class SignatureStore(Protocol):
    """The cluster's key-value store, as the check uses it (one connection per checker)."""

    def set(self, key: str, value: str) -> None: ...

    def get_all(self, keys: Sequence[str], seconds: float) -> list[str] | None:
        """The values of ``keys``, waiting up to ``seconds`` for them to be set; ``None`` if
        some are still missing then. Raises if the store is unreachable."""
        ...


class PeerMissing(RuntimeError):
    """A peer did not publish its signature (gone, or not at this collective): the engine
    turns this into its ``UnavailableError`` / ``DeadlineExceededError`` diagnosis."""


class _Heartbeats(Protocol):
    def silent(self) -> list[int]: ...

    def add_chore(self, chore: Callable[[Any], None]) -> None: ...


#: How much of a pack's list of shapes a signature spells out (then a digest of it all).
_PARTS_TEXT = 240


def _signature(
    op: str,
    dtype: Any,
    shape: Sequence[int],
    axis: int | None,
    parts: Sequence[Sequence[int]] | None = None,
) -> str:
    if dtype is None:  # a whole compiled step: its program is compared by the engine
        return op
    dims: list[str] = [str(int(d)) for d in shape]
    if axis is not None and dims:
        dims[axis] = "*"  # all_gather: sizes along the axis may differ
    reduce_op = _INTENT.reduce_op if _INTENT.active else None
    what = f"{op}({reduce_op})" if reduce_op else f"{op}(axis={axis})" if axis is not None else op
    if _INTENT.purpose is not None:
        what = f"{_INTENT.purpose}: {what}"
    if parts is None:
        return f"{what} of {dtype_name(dtype)}[{','.join(dims)}]"
    # A pack of several arrays: every worker must pack the same shapes, in the same order.
    shapes = _parts_text(tuple(map(tuple, parts)))
    return f"{what} of {len(parts)} {dtype_name(dtype)} arrays packed: {shapes}"


@functools.lru_cache(maxsize=256)  # a training step packs the same shapes every time
def _parts_text(parts: tuple[tuple[int, ...], ...]) -> str:
    shapes = " ".join(f"[{','.join(str(int(d)) for d in p)}]" for p in parts)
    if len(shapes) > _PARTS_TEXT:
        digest = hashlib.sha256(shapes.encode()).hexdigest()[:16]
        shapes = f"{shapes[:_PARTS_TEXT]} ... (all shapes: digest {digest})"
    return shapes


class Pending(NamedTuple):
    """A signature `CollectiveChecker.publish` wrote, awaiting `CollectiveChecker.confirm`."""

    n: int
    signature: str
    payload: str
    written: Future[None] | None  # the write, when it runs on the publisher thread
    #: Predicted (the fast path): the engine issues the collective without waiting.
    fast: bool = False


def _fields(text: str) -> tuple[str, str, str | None]:
    """A published value: (signature, payload, wire of a fast collective or None)."""
    parts = text.split("\n", 2)
    return parts[0], parts[1] if len(parts) > 1 else "", parts[2] if len(parts) > 2 else None


class CollectiveChecker:
    """Publishes this worker's signature of each cross-process collective and compares it
    with every other worker's (see the module doc).

    Args:
        store: a connection to the cluster's store for this checker's thread.
        rank, world_size: this worker and the cluster size.
        timeout: how long to wait for a peer's signature (the collective timeout).
        heartbeat: the process's `polydist._distributed.multi_process.Heartbeat`: a wait ends early
            when a peer's heartbeat stops, and its thread deletes old signatures.
        names, addresses: the workers' task names and addresses, for messages.
        enabled: this process's setting (`checks_enabled`).
        overlap_writes: write each signature on a thread of its own while waiting for
            the others' (for a store whose writes wait for a reply; ``store`` must then
            be safe to use from two threads).
        release: ``release(wire)`` issues the engine's collective that a fast peer
            waits in (``wire`` as that peer published it), with zeros, so that the
            peer's presence flag shows the mismatch (see the module doc); without it,
            no collective takes the fast path.
    """

    def __init__(
        self,
        store: SignatureStore,
        rank: int,
        world_size: int,
        *,
        timeout: float,
        heartbeat: _Heartbeats | None,
        names: Sequence[str],
        addresses: Sequence[str] = (),
        enabled: bool = True,
        overlap_writes: bool = False,
        release: Callable[[str], None] | None = None,
    ) -> None:
        self._store = store
        self._release = release
        # The agreed history's table (the same on every worker): signature -> the next one.
        self._next: dict[str | None, str] = {}
        self._wires: dict[str | None, str] = {}  # a signature's wire (the same everywhere)
        self._last: str | None = None
        self._predicting = release is not None
        # (n, the signature predicted for collective n, its wire), set by `publish`.
        self._predicted: tuple[int, str | None, str | None] = (0, None, None)
        self._publisher = (
            ThreadPoolExecutor(1, thread_name_prefix=f"polydist-check-{rank}")
            if overlap_writes and enabled
            else None
        )
        self._rank = rank
        self._others = [r for r in range(world_size) if r != rank]
        self._timeout = timeout
        self._heartbeat = heartbeat
        self._names = list(names)
        self._addresses = list(addresses)
        self._enabled: bool | None = None if enabled else False
        self.seq = 0  # collectives checked (or, with checks off, counted)
        self._passed = 0  # every worker has published signatures up to here
        self._deleted = 0  # this worker's signatures up to here are deleted
        #: A peer published that an error left the cluster out of step (`abandon`).
        self.peer_failed = False
        store.set(f"cc/mode/{rank}", "1" if enabled else "0")
        if heartbeat is not None:
            heartbeat.add_chore(self._delete_old)

    @property
    def enabled(self) -> bool | None:
        """Whether collectives are checked; ``None`` until the workers' settings are known."""
        return self._enabled

    def _learn_mode(self) -> None:
        if self._enabled is None:
            modes = self._wait([f"cc/mode/{r}" for r in self._others], "their first collective")
            self._enabled = all(m == "1" for m in modes)  # the same answer on every worker

    def publish(
        self,
        op: str,
        dtype: Any = None,
        shape: Sequence[int] = (),
        axis: int | None = None,
        payload: str = "",
        parts: Sequence[Sequence[int]] | None = None,
        wire: str | None = None,
    ) -> Pending | None:
        """Called right before this worker issues a cross-process collective ``op`` of an
        array of ``dtype`` and ``shape`` (``axis``: an all_gather's; ``dtype=None``: ``op``
        alone): publishes this worker's signature and returns at once (``None``: checks
        are off), so that the caller's own work (copying the input) overlaps the store's
        round trip. `confirm` must follow, in the same call stack, before the collective
        is issued. ``payload`` (one line, not compared) travels with the signature.
        ``parts``: the shapes of the arrays packed into this collective (``shape`` is
        then the pack's), compared too. ``wire``: the engine's collective for this
        signature, which carries a presence flag: the check may then be fast
        (``Pending.fast``; see the module doc): `confirm` returns at once and the
        engine calls `fast_mismatch` when the flag's sum is short."""
        self._learn_mode()
        self.seq += 1
        if not self._enabled:
            return None
        mine = _signature(op, dtype, shape, axis, parts)
        key, value = f"cc/{self.seq}/{self._rank}", f"{mine}\n{payload}"
        if self._predicting:
            predicted = self._next.get(self._last)
            self._predicted = (self.seq, predicted, self._wires.get(predicted))
            self._next[self._last] = self._last = mine
            if wire is not None:
                self._wires[mine] = wire
                if predicted == mine:  # nothing to write: the heartbeat says where it is
                    return Pending(self.seq, mine, payload, None, fast=True)
        if self._publisher is None:
            self._store.set(key, value)
            return Pending(self.seq, mine, payload, None)
        # The write's round trip overlaps the caller's work and the wait for the others'.
        return Pending(self.seq, mine, payload, self._publisher.submit(self._store.set, key, value))

    def confirm(self, pending: Pending | None) -> list[str] | None:
        """Waits for the other workers' signatures of ``pending``'s collective: raises
        `CollectiveMismatchError` when another worker is at a different one, `PeerMissing`
        when one does not get there (see the module doc). Returns every worker's payload
        in rank order, or ``None`` when checks are off."""
        if pending is None or pending.fast:
            return None
        n = pending.n
        theirs = self._wait([f"cc/{n}/{r}" for r in self._others], f"collective #{n}", n)
        if pending.written is not None:
            pending.written.result()
        self._passed = n
        fields = [_fields(t) for t in theirs]
        # A fast peer where this worker is not fast is a mismatch even if the signatures
        # read alike: the prediction is the same everywhere, so their collectives differ
        # (at least in the wire: the presence flag).
        if any(f[0] != pending.signature or f[2] is not None for f in fields):
            self._predicting = False
            wires = [f[2] for f in fields if f[2] is not None]
            # (Not with a failed peer: it never joins, so the release would wait for it.)
            if wires and self._release is not None and all(f[0] != _FAILED for f in fields):
                # Fast peers issued their collective: complete it (with zeros) so that
                # they see the mismatch instead of waiting in it.
                self._release(wires[0])
            calls = dict(zip(self._others, theirs))
            calls[self._rank] = f"{pending.signature}\n{pending.payload}"
            raise self._mismatch(n, calls, self._call_sites(n, calls))
        payloads = [f[1] for f in fields]
        payloads.insert(self._rank, pending.payload)
        return payloads

    def fast_mismatch(self, pending: Pending) -> CollectiveMismatchError:
        """The engine's fast collective ``pending`` completed, but its presence flag
        summed to less than the number of workers: a peer at another collective
        released it (see the module doc). Reads what every worker was at and returns
        the mismatch (call sites included) to raise."""
        found = self.mismatch_after(pending, min(self._timeout, _LINGER_SECONDS))
        if found is not None:
            return found
        self._predicting = False
        calls = {r: f"{_ABSENT}\n" for r in self._others}
        calls[self._rank] = f"{pending.signature}\n{pending.payload}\nissued"
        return self._mismatch(pending.n, calls, {})

    def mismatch_after(self, pending: Pending, seconds: float) -> CollectiveMismatchError | None:
        """After fast collective ``pending`` did not complete normally (the engine failed
        in it, or `fast_mismatch`): the mismatch if another worker published a different
        collective (or left), waiting up to ``seconds`` for the others' signatures;
        ``None`` if those that published agree."""
        n = pending.n
        keys = [f"cc/{n}/{r}" for r in self._others]
        everyone = self._store.get_all(keys, seconds)
        got: list[str | None] = list(everyone) if everyone is not None else []
        if everyone is None:  # those present now
            for key in keys:
                found = self._store.get_all([key], 0.001)
                got.append(found[0] if found is not None else None)
        calls = {r: t for r, t in zip(self._others, got) if t is not None}
        if all(_fields(t)[0] == pending.signature for t in calls.values()):
            return None
        fast_at = getattr(self._heartbeat, "fast_at", None)
        for r in fast_at(n) if fast_at is not None else ():
            calls.setdefault(r, f"{pending.signature}\n\nissued")  # fast at n, as this one
        self._predicting = False
        for r in self._others:
            calls.setdefault(r, f"{_ABSENT}\n")
        calls[self._rank] = f"{pending.signature}\n{pending.payload}\nissued"
        return self._mismatch(n, calls, self._call_sites(n, calls))

    def announce(self, op: str) -> Pending | None:
        """Numbers collective ``op`` like `publish`, but writes nothing yet: the engine
        compares the workers' digests of it in a collective of its own (cheaper than the
        store's round trip), then calls `settled`. If that exchange does not complete
        promptly, `publish_late` writes the signature, so that a peer at another,
        store-checked collective (waiting in `confirm`) raises the mismatch."""
        self._learn_mode()
        self.seq += 1
        if not self._enabled:
            return None
        mine = _signature(op, None, (), None)
        if self._predicting:
            self._next[self._last] = self._last = mine
        return Pending(self.seq, mine, "", None)

    def publish_late(self, pending: Pending | None) -> None:
        """Writes `announce`'s signature ``pending`` (any thread; once is enough)."""
        if pending is not None:
            value = f"{pending.signature}\n{pending.payload}"
            self._store.set(f"cc/{pending.n}/{self._rank}", value)

    def settled(self, pending: Pending | None) -> None:
        """Every worker reached `announce`'s collective ``pending`` and the engine found
        that they agree: no store read."""
        if pending is not None:
            self._passed = max(self._passed, pending.n)

    def peek(self, pending: Pending | None, seconds: float = 0.001) -> dict[int, str]:
        """The other workers' signatures of ``pending``'s collective that differ from this
        worker's, read without waiting (for a diagnosis, while the engine's own exchange
        of ``pending`` does not complete): worker -> what it is at. ``seconds``: how long
        each read may take (after a failure, a loaded store may need more than a probe's
        millisecond)."""
        if pending is None:
            return {}
        found = {}
        for r in self._others:
            got = self._store.get_all([f"cc/{pending.n}/{r}"], seconds)
            text = got[0] if got is not None else pending.signature
            call = _fields(text)[0]
            if call != pending.signature:  # its call site is not known yet
                if call == _FAILED:
                    self.peer_failed = True
                found[r] = self._describe(text, None) if call in (_LEFT, _FAILED) else call
        return found

    def report_site(self, pending: Pending, site: str, readers: Sequence[int]) -> None:
        """After `peek` found ``readers`` at another collective than `announce`'s
        ``pending`` (they raise the mismatch): publishes this worker's call site of it for
        their messages, and lingers as `_call_sites` does."""
        self._store.set(f"cc/{pending.n}/where/{self._rank}", site)
        self._linger(pending.n, readers)

    def _call_sites(self, n: int, calls: dict[int, str]) -> dict[int, str]:
        """After mismatch ``n``, which every worker saw: each publishes the user's line of
        its collective (found only now: finding it costs more than the check itself) and
        reads the others'. Worker 0 returns once the others have read (`_linger`)."""
        source = _INTENT.source if _INTENT.active and _INTENT.source is not None else None
        sites = {self._rank: source() if source is not None else _trace.user_source_line()}
        peers = [r for r in self._others if _fields(calls[r])[0] not in (_LEFT, _FAILED, _ABSENT)]
        try:
            self._store.set(f"cc/{n}/where/{self._rank}", sites[self._rank])
            seconds = min(self._timeout, _LINGER_SECONDS)
            got = self._store.get_all([f"cc/{n}/where/{r}" for r in peers], seconds)
            sites.update(zip(peers, got or ()))
            self._linger(n, peers)
        except Exception:  # the store is gone already: the mismatch is still the news
            pass
        return sites

    def _linger(self, n: int, readers: Sequence[int]) -> None:
        """Every worker saw mismatch ``n``: worker 0, whose process holds the store on both
        engines, waits (briefly) until the others have read it before raising, or a peer
        still reading would find the store gone and report worker 0 as unavailable."""
        self._store.set(f"cc/{n}/seen/{self._rank}", "1")
        if self._rank != 0:
            return
        deadline = time.monotonic() + min(self._timeout, _LINGER_SECONDS)
        keys = [f"cc/{n}/seen/{r}" for r in readers]
        while keys and time.monotonic() < deadline:
            if self._store.get_all(keys, _SLICE_SECONDS / 4) is not None:
                return
            if self._heartbeat is not None and self._heartbeat.silent():
                return

    def abandon(self, reason: str) -> None:
        """Publishes that this worker calls no more collectives: an error on it
        (``reason``, e.g. ``strategy.run raised ValueError: ...``) left the cluster's
        collectives out of step. A peer at this worker's next collective (or at the
        collective it left) then raises `CollectiveMismatchError` naming it, and a peer
        that would take the fast path learns it from this worker's heartbeat instead."""
        self._predicting = False
        if self._enabled is False:
            return
        text = " ".join(reason.split())  # one line: the value's fields are lines
        self._store.set(f"cc/{self.seq + 1}/{self._rank}", f"{_FAILED}\n{text}")

    def leave(self) -> None:
        """Publishes that this worker left the cluster (its program ended, or it called
        ``shutdown``): a peer still at a collective then raises `CollectiveMismatchError`."""
        if self._enabled is False or getattr(sys, "last_value", None) is not None:
            return  # checks are off, or the program ended with an uncaught exception
        try:
            self._store.set(f"cc/{self.seq + 1}/{self._rank}", f"{_LEFT}\n{self.seq}")
        except Exception:  # the store (worker 0) is gone: nobody to tell
            pass

    def _wait(self, keys: list[str], what: str, n: int = 0) -> list[str]:
        """The values of ``keys``; for collective ``n``, a peer whose heartbeat says it is
        in fast collective ``n`` reads as the predicted signature with its wire."""
        deadline = time.monotonic() + self._timeout
        while True:
            remaining = deadline - time.monotonic()
            values = self._store.get_all(keys, max(min(_SLICE_SECONDS, remaining), 0.001))
            if values is not None:
                return values
            fast_at = getattr(self._heartbeat, "fast_at", None)
            at, predicted, wire = self._predicted
            if n and at == n and wire is not None and fast_at is not None:
                fast = fast_at(n)
                if fast:
                    got: list[str] = []
                    for key, r in zip(keys, self._others):
                        if r in fast:
                            got.append(f"{predicted}\n\n{wire}")
                            continue
                        found = self._store.get_all([key], 0.001)
                        got.append(found[0] if found is not None else f"{_ABSENT}\n")
                    return got
            if time.monotonic() >= deadline:
                raise PeerMissing(
                    f"timed out after {self._timeout:g} s waiting for the other workers to "
                    f"reach {what}"
                )
            silent = self._heartbeat.silent() if self._heartbeat is not None else []
            if silent:
                raise PeerMissing(
                    f"worker(s) {', '.join(map(str, silent))} stopped sending heartbeats while "
                    f"worker {self._rank} waited for them to reach {what}"
                )

    def _describe(self, text: str, site: str | None) -> str:
        call, rest, _ = _fields(text)
        if call == _ABSENT:
            return call
        if call == _LEFT:
            return (
                f"left the cluster after {rest} collective(s) (its program ended, or it "
                "called shutdown)"
            )
        if call == _FAILED:
            return f"{rest}; it calls no more collectives"
        return f"{call} at {site or '(its call site did not arrive)'}"

    def _mismatch(
        self, n: int, calls: dict[int, str], sites: dict[int, str]
    ) -> CollectiveMismatchError:
        failed = [r for r in sorted(calls) if _fields(calls[r])[0] == _FAILED]
        if failed:
            return self._failed_peer(n, calls, sites, failed)
        if any(_fields(text)[2] is not None for text in calls.values()):
            what = (
                "so no worker used it (those that issued it, as the repeat of earlier "
                "collectives, were released with zeros and dropped its result)."
            )
        else:
            what = "so no worker issued it."
        lines = [
            f"Workers disagree on their collective #{n}; on real hardware this program would "
            f"hang, crash or compute wrong values, {what}",
        ]
        for r in sorted(calls):
            name = self._names[r] if r < len(self._names) else "?"
            at = f" at {self._addresses[r]}" if r < len(self._addresses) else ""
            lines.append(f"  worker {r} ({name}{at}): {self._describe(calls[r], sites.get(r))}")
        for purpose, advice in PURPOSES.items():
            inside = [r for r, text in calls.items() if text.startswith(f"{purpose}: ")]
            if inside and len(inside) < len(calls):
                others = [r for r in sorted(calls) if r not in inside]
                lines.append(
                    f"Worker(s) {', '.join(map(str, inside))} are in a {purpose}, worker(s) "
                    f"{', '.join(map(str, others))} are not. {advice}"
                )
        lines.append(
            "Every worker must call the same collectives (all_reduce, all_gather, reduce, "
            "gather, variable creation) in the same order, with the same shapes, dtypes and "
            "reduce ops. Make the control flow around collectives identical on all workers "
            "(e.g. do not branch on the task index or on data-dependent values around a "
            "collective)."
        )
        return CollectiveMismatchError("\n".join(lines))

    def _failed_peer(
        self, n: int, calls: dict[int, str], sites: dict[int, str], failed: Sequence[int]
    ) -> CollectiveMismatchError:
        """The mismatch when workers ``failed`` published `abandon`: the cluster is out of
        step for good (prediction stops and `peer_failed` is set)."""
        self.peer_failed = True
        self._predicting = False
        lines = [
            f"Collective #{n} cannot run: worker(s) {', '.join(map(str, failed))} raised an "
            "error that left the cluster's collectives out of step (a replica raised while "
            "others waited in a collective, which then never ran across the workers), so no "
            "worker issued it; run on, the workers would pair one step's collectives with "
            "another's and compute wrong values.",
        ]
        for r in sorted(calls):
            name = self._names[r] if r < len(self._names) else "?"
            at = f" at {self._addresses[r]}" if r < len(self._addresses) else ""
            lines.append(f"  worker {r} ({name}{at}): {self._describe(calls[r], sites.get(r))}")
        lines.append(
            "The cluster cannot be used any more: stop every worker and restart them all, from "
            "the latest checkpoint (polydist launch stops the others when one fails). Do not "
            "catch an error of strategy.run and go on in a multi-worker program."
        )
        return CollectiveMismatchError("\n".join(lines))

    def _delete_old(self, store: Any) -> None:
        """A heartbeat chore: deletes this worker's signatures that no worker reads any more
        (every worker published ``n``, so all are past their check of ``n - 1``)."""
        failed = getattr(self._heartbeat, "failed", None)
        if self._predicting and failed is not None and failed():
            self._predicting = False  # a peer abandoned the cluster: check through the store
        budget = time.monotonic() + _SLICE_SECONDS / 2  # keep the heartbeat on time
        upto = self._passed - 1
        while self._deleted < upto and time.monotonic() < budget:
            self._deleted += 1
            store.delete(f"cc/{self._deleted}/{self._rank}")
