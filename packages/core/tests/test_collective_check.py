"""Cross-process collective agreement (polydist._collectives.check), with an in-memory store.

Each "worker" is a thread with its own `CollectiveChecker` over one shared store, as each
process has its own over the engine's store; the engines' tests run real processes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from polydist import errors
from polydist._collectives.check import (
    CHECK_ENV,
    CollectiveChecker,
    PeerMissing,
    checks_enabled,
    collective_intent,
    collective_purpose,
)
from polydist._distributed import multi_process as _multi_process
from polydist._distributed.multi_process import Heartbeat
from polydist.errors import CollectiveMismatchError


class MemoryStore:
    """A `SignatureStore` and `HeartbeatStore` in memory, shared by a test's workers."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: str) -> None:
        with self._changed:
            self.data[key] = value
            self._changed.notify_all()

    def get(self, key: str) -> str | None:
        with self._changed:
            return self.data.get(key)

    def delete(self, key: str) -> None:
        with self._changed:
            del self.data[key]

    def get_all(self, keys: Sequence[str], seconds: float) -> list[str] | None:
        with self._changed:
            if not self._changed.wait_for(lambda: all(k in self.data for k in keys), seconds):
                return None
            return [self.data[k] for k in keys]


class FakeHeartbeat:
    def __init__(self, silent: Sequence[int] = ()) -> None:
        self._silent = list(silent)
        self.chores: list[Callable[[Any], None]] = []

    def silent(self) -> list[int]:
        return self._silent

    def add_chore(self, chore: Callable[[Any], None]) -> None:
        self.chores.append(chore)


def _checker(
    store: MemoryStore,
    rank: int,
    *,
    enabled: bool = True,
    timeout: float = 20.0,
    heartbeat: FakeHeartbeat | None = None,
    overlap: bool = False,
    world: int = 2,
) -> CollectiveChecker:
    return CollectiveChecker(
        store,
        rank,
        world,
        timeout=timeout,
        heartbeat=heartbeat,
        names=[f"/job:worker/replica:0/task:{r}" for r in range(world)],
        addresses=[f"10.0.0.{r + 1}:2222" for r in range(world)],
        enabled=enabled,
        overlap_writes=overlap,
    )


def _check(c: CollectiveChecker, *signature: Any, **kwargs: Any) -> list[str] | None:
    """What an engine does around a collective: publish, then confirm."""
    return c.confirm(c.publish(*signature, **kwargs))


def _together(*calls: Callable[[], None]) -> list[BaseException | None]:
    """Runs each worker's calls on its own thread; what each raised (None: nothing)."""
    raised: list[BaseException | None] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            calls[i]()
        except BaseException as e:  # reported to the test
            raised[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a worker's check did not return"
    return raised


def _line_of(text: str) -> int:
    """The line number of ``text`` in this file (the call sites the messages name)."""
    lines = Path(__file__).read_text().splitlines()
    hits = [n for n, line in enumerate(lines, start=1) if line.endswith(text)]
    assert len(hits) == 1, (text, hits)
    return hits[0]


@pytest.mark.parametrize("overlap", [False, True], ids=["write-then-wait", "overlapped"])
def test_agreeing_workers_pass_and_old_signatures_are_deleted(overlap: bool) -> None:
    store = MemoryStore()
    beats = [FakeHeartbeat(), FakeHeartbeat()]
    checkers = [_checker(store, r, heartbeat=beats[r], overlap=overlap) for r in range(2)]

    def steps(rank: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(3):
                with collective_intent("SUM"):
                    _check(checkers[rank], "all_reduce", np.dtype(np.float32), (3,))
            _check(checkers[rank], "all_gather", np.dtype(np.int64), (4 + rank, 2), axis=0)

        return run

    assert _together(steps(0), steps(1)) == [None, None]
    assert [c.seq for c in checkers] == [4, 4] and [c.enabled for c in checkers] == [True, True]
    # Signatures only: call sites travel after a mismatch (see the mismatch tests).
    assert store.data["cc/1/0"] == "all_reduce(SUM) of float32[3]\n"
    assert store.data["cc/4/1"] == "all_gather(axis=0) of int64[*,2]\n"
    for beat in beats:
        for chore in beat.chores:
            chore(store)  # what the heartbeat thread does after each beat
    # Every worker published #4, so all are past their check of #3: #1-#3 are gone.
    assert sorted(k for k in store.data if not k.startswith("cc/mode")) == ["cc/4/0", "cc/4/1"]


@pytest.mark.parametrize("overlap", [False, True], ids=["write-then-wait", "overlapped"])
def test_different_ops_raise_on_every_worker_naming_both_calls(overlap: bool) -> None:
    store = MemoryStore()
    a, b = _checker(store, 0, overlap=overlap), _checker(store, 1, overlap=overlap)

    def worker0() -> None:
        with collective_intent("SUM", lambda: "train.py:10 in step"):
            _check(a, "all_reduce", np.dtype(np.float32), (3,))

    def worker1() -> None:
        b.confirm(b.publish("all_gather", np.dtype(np.float32), (3,), axis=0))  # the call site

    raised = _together(worker0, worker1)
    line = _line_of("# the call site")
    for e in raised:
        assert isinstance(e, CollectiveMismatchError)
        lines = str(e).splitlines()
        assert lines[0].startswith("Workers disagree on their collective #1;")
        assert lines[1] == (
            "  worker 0 (/job:worker/replica:0/task:0 at 10.0.0.1:2222): all_reduce(SUM) of "
            "float32[3] at train.py:10 in step"
        )
        assert lines[2] == (
            "  worker 1 (/job:worker/replica:0/task:1 at 10.0.0.2:2222): all_gather(axis=0) of "
            f"float32[*] at test_collective_check.py:{line} in worker1"
        )
        assert "Every worker must call the same collectives" in lines[3]


@pytest.mark.parametrize("overlap", [False, True], ids=["write-then-wait", "overlapped"])
def test_publish_returns_before_the_others_arrive_and_confirm_compares(overlap: bool) -> None:
    """The caller's work between publish and confirm overlaps the wait: worker 0 copies
    while worker 1 has not published yet; confirm then compares as check does."""
    store = MemoryStore()
    a, b = _checker(store, 0, overlap=overlap), _checker(store, 1, overlap=overlap)
    published = threading.Event()
    order: list[str] = []

    def worker0() -> None:
        pending = a.publish("all_reduce", np.dtype(np.float32), (3,), payload="p0")
        order.append("worker 0 published")
        published.set()
        assert "cc/1/1" not in store.data  # worker 1 waits for us: no signature of its yet
        order.append("worker 0 prepared")
        assert a.confirm(pending) == ["p0", "p1"]
        pending = a.publish("all_reduce", np.dtype(np.float32), (3,))
        with pytest.raises(CollectiveMismatchError, match="worker 1 .*int32"):
            a.confirm(pending)

    def worker1() -> None:
        assert published.wait(10)
        assert _check(b, "all_reduce", np.dtype(np.float32), (3,), payload="p1") == ["p0", "p1"]
        order.append("worker 1 confirmed")
        with pytest.raises(CollectiveMismatchError, match="worker 0 .*float32"):
            _check(b, "all_reduce", np.dtype(np.int32), (3,))

    assert _together(worker0, worker1) == [None, None]
    assert order[:2] == ["worker 0 published", "worker 0 prepared"]


def test_a_call_site_that_does_not_arrive_is_named_so() -> None:
    """After a mismatch the workers swap call sites; a peer that publishes its signature
    but never its call site (it died right then) does not stall the message."""
    store = MemoryStore()
    a = _checker(store, 0, timeout=0.3)
    store.set("cc/mode/1", "1")
    store.set("cc/1/1", "all_gather(axis=0) of float32[*]\n")
    with pytest.raises(CollectiveMismatchError) as raised:
        _check(a, "all_reduce", np.dtype(np.float32), (3,))
    assert (
        "worker 1 (/job:worker/replica:0/task:1 at 10.0.0.2:2222): all_gather(axis=0) of "
        "float32[*] at (its call site did not arrive)"
    ) in str(raised.value)
    assert store.data["cc/1/where/0"].startswith("test_collective_check.py:")


@pytest.mark.parametrize(
    ("mine", "theirs"),
    [
        (("SUM", "float32", (3,), None), ("MEAN", "float32", (3,), None)),  # reduce op
        (("SUM", "float32", (3,), None), ("SUM", "int32", (3,), None)),  # dtype, same bytes
        (("SUM", "float32", (3,), None), ("SUM", "float32", (1, 3), None)),  # rank
        ((None, "float32", (4, 3), 0), (None, "float32", (4, 2), 0)),  # gather: other dims
        ((None, "float32", (4, 3), 0), (None, "float32", (4, 3), 1)),  # gather: axis
    ],
)
def test_any_difference_but_the_gathered_size_is_a_mismatch(
    mine: tuple[Any, ...], theirs: tuple[Any, ...]
) -> None:
    store = MemoryStore()
    checkers = [_checker(store, 0), _checker(store, 1)]

    def call(c: CollectiveChecker, spec: tuple[Any, ...]) -> Callable[[], None]:
        reduce_op, dtype, shape, axis = spec

        def run() -> None:
            with collective_intent(reduce_op):
                op = "all_reduce" if axis is None else "all_gather"
                _check(c, op, np.dtype(dtype), shape, axis)

        return run

    raised = _together(call(checkers[0], mine), call(checkers[1], theirs))
    assert all(isinstance(e, CollectiveMismatchError) for e in raised), raised


def test_with_three_workers_the_odd_one_out_makes_all_raise() -> None:
    store = MemoryStore()
    checkers = [_checker(store, r, world=3) for r in range(3)]

    def call(rank: int) -> Callable[[], None]:
        size = 4 if rank == 2 else 3
        return lambda: _check(checkers[rank], "all_reduce", np.dtype(np.float32), (size,))

    raised = _together(call(0), call(1), call(2))
    for e in raised:
        assert isinstance(e, CollectiveMismatchError)
        assert "\n  worker 1 (/job:worker/replica:0/task:1 at 10.0.0.2:2222): all_reduce of " in (
            str(e)
        )
        assert "): all_reduce of float32[4] at " in str(e)
        assert str(e).count("all_reduce of float32[3] at ") == 2


def test_gathers_of_different_sizes_along_the_axis_agree() -> None:
    store = MemoryStore()
    a, b = _checker(store, 0), _checker(store, 1)
    raised = _together(
        lambda: _check(a, "all_gather", np.dtype(np.float32), (4, 3), axis=0),
        lambda: _check(b, "all_gather", np.dtype(np.float32), (1, 3), axis=0),
    )
    assert raised == [None, None]


def test_a_compiled_step_is_compared_by_name() -> None:
    store = MemoryStore()
    a, b = _checker(store, 0), _checker(store, 1)
    assert _together(lambda: _check(a, "strategy.run"), lambda: _check(b, "strategy.run")) == [
        None,
        None,
    ]
    raised = _together(
        lambda: _check(a, "strategy.run"),
        lambda: _check(b, "all_reduce", np.dtype(np.float32), ()),
    )
    assert all(isinstance(e, CollectiveMismatchError) for e in raised)
    assert "): strategy.run at " in str(raised[0])
    assert "): all_reduce of float32[] at " in str(raised[0])


def test_a_worker_that_left_is_named_by_the_one_still_calling() -> None:
    store = MemoryStore()
    a, b = _checker(store, 0), _checker(store, 1)
    assert _together(
        lambda: _check(a, "broadcast", np.dtype(np.float32), (2,)),
        lambda: _check(b, "broadcast", np.dtype(np.float32), (2,)),
    ) == [None, None]
    b.leave()
    with pytest.raises(CollectiveMismatchError) as info:
        _check(a, "broadcast", np.dtype(np.float32), (2,))
    assert (
        "  worker 1 (/job:worker/replica:0/task:1 at 10.0.0.2:2222): left the cluster after 1 "
        "collective(s) (its program ended, or it called shutdown)"
    ) in str(info.value)


def test_checks_run_only_when_every_worker_has_them_on() -> None:
    store = MemoryStore()
    a, b = _checker(store, 0), _checker(store, 1, enabled=False)
    raised = _together(
        lambda: _check(a, "all_reduce", np.dtype(np.float32), (3,)),
        lambda: _check(b, "all_gather", np.dtype(np.float32), (5,), axis=0),
    )
    assert raised == [None, None]  # not compared: worker 1 turned the check off
    assert (a.enabled, b.enabled) == (False, False) and (a.seq, b.seq) == (1, 1)
    assert sorted(store.data) == ["cc/mode/0", "cc/mode/1"]


def test_a_missing_peer_ends_the_wait_after_the_timeout() -> None:
    store = MemoryStore()
    _checker(store, 1)  # joined, then never reaches the collective
    a = _checker(store, 0, timeout=0.3)
    with pytest.raises(PeerMissing, match=r"timed out after 0.3 s .* reach collective #1"):
        _check(a, "all_reduce", np.dtype(np.float32), (3,))


def test_a_silent_peer_ends_the_wait_before_the_timeout() -> None:
    store = MemoryStore()
    _checker(store, 1)
    a = _checker(store, 0, timeout=600, heartbeat=FakeHeartbeat(silent=[1]))
    with pytest.raises(PeerMissing, match=r"worker\(s\) 1 stopped sending heartbeats"):
        _check(a, "all_reduce", np.dtype(np.float32), (3,))


def test_the_outermost_intent_wins() -> None:
    store = MemoryStore()
    a, b = _checker(store, 0), _checker(store, 1)

    def nested(c: CollectiveChecker) -> Callable[[], None]:
        def run() -> None:
            with collective_intent("MEAN"), collective_intent("SUM"):
                _check(c, "all_reduce", np.dtype(np.float32), ())

        return run

    assert _together(nested(a), nested(b)) == [None, None]
    assert store.data["cc/1/0"].startswith("all_reduce(MEAN) of float32[]\n")


def test_a_checkpoint_saves_collective_never_pairs_with_a_users() -> None:
    # Audit F3: the save's read (a SUM of a float32 scalar) and another worker's
    # all_reduce of one had the same signature, so they paired up.
    store = MemoryStore()
    a, b = _checker(store, 0), _checker(store, 1)

    def save() -> None:
        with collective_purpose("checkpoint save"), collective_intent("SUM"):
            _check(a, "all_reduce", np.dtype(np.float32), ())

    def user() -> None:
        with collective_intent("SUM"):
            _check(b, "all_reduce", np.dtype(np.float32), ())

    raised = _together(save, user)
    for e in raised:
        assert isinstance(e, CollectiveMismatchError), raised
        assert "): checkpoint save: all_reduce(SUM) of float32[] at " in str(e)
        assert "Worker(s) 0 are in a checkpoint save, worker(s) 1 are not." in str(e)
        assert "every worker must call it, not only the chief" in str(e)
    with pytest.raises(ValueError, match="unknown collective purpose"):
        collective_purpose("restore")


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("0", False), ("off", False)])
def test_the_environment_variable(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: bool
) -> None:
    monkeypatch.setenv(CHECK_ENV, value)
    assert checks_enabled() is expected


def test_a_bad_environment_variable_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHECK_ENV, "sometimes")
    with pytest.raises(ValueError, match=r"POLYDIST_CHECK_COLLECTIVES='sometimes': expected 1"):
        checks_enabled()


def test_heartbeats_name_a_silent_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_multi_process, "HEARTBEAT_SECONDS", 0.05)
    store = MemoryStore()
    watcher = Heartbeat(lambda: store, 0, 3, lambda: 0)
    alive = Heartbeat(lambda: store, 1, 3, lambda: 0)  # worker 2 never beats
    try:
        deadline = time.monotonic() + 10
        while watcher.silent(0.5) != [2] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watcher.silent(0.5) == [2]
        alive.stop(wait=5)
        while watcher.silent(0.5) != [1, 2] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watcher.silent(0.5) == [1, 2]
    finally:
        watcher.stop(wait=5)
        alive.stop(wait=5)


def test_worker_0_raises_a_mismatch_only_after_the_others_have_read_it() -> None:
    # Worker 0's process holds the store: leaving first would make a slower peer see
    # "worker 0 unavailable" instead of the mismatch.
    store = MemoryStore()
    first, second = _checker(store, 0), _checker(store, 1)
    store.set("cc/mode/1", "1")
    store.set("cc/1/1", "all_reduce(SUM) of float32[4]\npeer.py:1")
    raised_at: list[float] = []

    def worker_0() -> None:
        with pytest.raises(CollectiveMismatchError):
            _check(first, "all_reduce", np.dtype("float32"), (3,))
        raised_at.append(time.monotonic())

    thread = threading.Thread(target=worker_0)
    thread.start()
    time.sleep(0.3)
    assert not raised_at, "worker 0 raised before worker 1 read the signatures"
    seen_at = time.monotonic()
    with pytest.raises(CollectiveMismatchError, match=r"float32\[3\]"):
        _check(second, "all_reduce", np.dtype("float32"), (4,))
    thread.join(10)
    assert raised_at and raised_at[0] >= seen_at
    assert store.data["cc/1/seen/0"] == store.data["cc/1/seen/1"] == "1"


def test_packs_compare_the_shapes_they_hold() -> None:
    store = MemoryStore()
    a, b = _checker(store, 0), _checker(store, 1)
    f32 = np.dtype(np.float32)

    def packed(c: CollectiveChecker, parts: list[tuple[int, ...]]) -> Callable[[], None]:
        def run() -> None:
            with collective_intent("SUM"):
                _check(c, "all_reduce", f32, (6,), parts=parts)

        return run

    assert _together(packed(a, [(2,), (4,)]), packed(b, [(2,), (4,)])) == [None, None]
    # As many elements of one dtype in another layout: a mismatch, naming both layouts.
    raised = _together(packed(a, [(2,), (4,)]), packed(b, [(4,), (2,)]))
    assert all(isinstance(e, CollectiveMismatchError) for e in raised), raised
    assert "): all_reduce(SUM) of 2 float32 arrays packed: [2] [4] at " in str(raised[0])
    assert "): all_reduce(SUM) of 2 float32 arrays packed: [4] [2] at " in str(raised[0])


def test_a_long_pack_is_named_by_its_first_shapes_and_a_digest_of_all() -> None:
    store = MemoryStore()
    a, b = _checker(store, 0), _checker(store, 1)
    f32 = np.dtype(np.float32)
    mine = [(i, 3) for i in range(100)]
    theirs = [*mine[:-1], (100, 3)]  # differs only past what the message spells out
    raised = _together(
        lambda: _check(a, "all_reduce", f32, (14850,), parts=mine),
        lambda: _check(b, "all_reduce", f32, (14850,), parts=theirs),
    )
    assert all(isinstance(e, CollectiveMismatchError) for e in raised), raised
    lines = [line for line in str(raised[0]).splitlines() if "arrays packed" in line]
    assert len(lines) == 2
    for line in lines:
        assert "all_reduce of 100 float32 arrays packed: [0,3] [1,3] [2,3]" in line
        assert " ... (all shapes: digest " in line
    assert lines[0].split("digest ")[1][:16] != lines[1].split("digest ")[1][:16]


# -- collectives the engine compares itself (announce / settled / publish_late / peek) ------


def _checking_pair() -> tuple[MemoryStore, tuple[CollectiveChecker, CollectiveChecker]]:
    """Two workers' checkers on one store, past their first collective (checks known on)."""
    store = MemoryStore()
    pair = (_checker(store, 0), _checker(store, 1))
    for c in pair:
        c._enabled = True
    return store, pair


def test_an_announced_collective_is_numbered_but_writes_nothing() -> None:
    """A compiled JAX step: its digest travels in an engine collective, not the store."""
    store, (w0, w1) = _checking_pair()
    pending = w0.announce("strategy.run")
    assert pending is not None and pending.n == 1 and w0.seq == 1
    assert not [k for k in store.data if k.startswith("cc/1/")]
    w0.settled(pending)
    assert w0._passed == 1
    # The next collective is #2 on both workers: the numbering stays aligned.
    assert w1.announce("strategy.run") is not None
    raised = _together(
        lambda: _check(w0, "all_reduce", np.dtype(np.float32), (3,)),
        lambda: _check(w1, "all_reduce", np.dtype(np.float32), (3,)),
    )
    assert raised == [None, None]
    assert "cc/2/0" in store.data and "cc/2/1" in store.data


def test_an_announced_collective_published_late_is_a_peer_s_mismatch() -> None:
    store, (w0, w1) = _checking_pair()
    pending = w0.announce("strategy.run")
    assert pending is not None
    assert w0.peek(pending) == {}  # worker 1 has not published collective #1 yet
    done: list[BaseException | None] = []

    def gather() -> None:
        try:
            _check(w1, "all_gather", np.dtype(np.float32), (3,), axis=0)
        except BaseException as e:
            done.append(e)

    thread = threading.Thread(target=gather)
    thread.start()
    deadline = time.monotonic() + 10
    while "cc/1/1" not in store.data and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w0.peek(pending) == {1: "all_gather(axis=0) of float32[*]"}
    w0.publish_late(pending)
    w0.report_site(pending, "train.py:7 in main", [1])
    thread.join(20)
    assert len(done) == 1 and isinstance(done[0], CollectiveMismatchError), done
    message = str(done[0])
    assert message.startswith("Workers disagree on their collective #1;"), message
    assert "  worker 0 (/job:worker/replica:0/task:0 at 10.0.0.1:2222): strategy.run at " in message
    assert "strategy.run at train.py:7 in main\n" in message, message
    assert store.data["cc/1/seen/1"] == "1"  # worker 0 lingered until worker 1 had read it


def test_announce_with_checks_off_returns_none() -> None:
    store = MemoryStore()
    w0 = _checker(store, 0, enabled=False)
    assert w0.announce("strategy.run") is None
    assert w0.seq == 1
    w0.settled(None)
    w0.publish_late(None)
    assert w0.peek(None) == {}


def test_peek_names_a_peer_that_left() -> None:
    _, (w0, w1) = _checking_pair()
    pending = w0.announce("strategy.run")
    w1.leave()  # its program ended before collective #1
    found = w0.peek(pending)
    assert list(found) == [1]
    assert found[1].startswith("left the cluster after 0 collective(s) (its program ended"), found


# --------------------------------------------------------------------------- the fast path


class FastHeartbeat(FakeHeartbeat):
    """A heartbeat that reports the workers in a fast collective (``fast_at``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fast: dict[int, int] = {}  # worker -> its fast collective

    def fast_at(self, n: int) -> list[int]:
        return [r for r, at in self.fast.items() if at == n]


class FakeEngine:
    """The workers' engine: a collective completes once every worker issued it (a peer's
    release counts, with a presence of 0) and returns the presence flags' sum."""

    WIRE = "cpu float32 4"

    def __init__(self, world: int = 2) -> None:
        self.world = world
        self.lock = threading.Condition()
        self.waiting: list[int] = []  # presence flags of the collective in flight
        self.sums: list[int] = []  # each completed collective's sum
        self.released: list[str] = []

    def release(self, wire: str) -> None:
        self.released.append(wire)
        self.issue(0)

    def issue(self, presence: int) -> int:
        with self.lock:
            n = len(self.sums)
            self.waiting.append(presence)
            if len(self.waiting) == self.world:
                self.sums.append(sum(self.waiting))
                self.waiting = []
                self.lock.notify_all()
            assert self.lock.wait_for(lambda: len(self.sums) > n, 10), "a collective hangs"
            return self.sums[n]


def _fast_checker(
    store: MemoryStore, rank: int, heartbeat: FastHeartbeat, engine: FakeEngine
) -> CollectiveChecker:
    return CollectiveChecker(
        store,
        rank,
        2,
        timeout=20.0,
        heartbeat=heartbeat,
        names=[f"/job:worker/replica:0/task:{r}" for r in range(2)],
        addresses=[f"10.0.0.{r + 1}:2222" for r in range(2)],
        release=engine.release,
    )


def _reduce(c: CollectiveChecker, heartbeat: FastHeartbeat, rank: int, engine: FakeEngine) -> bool:
    """One all_reduce of float32[3] as an engine with a presence flag runs it; whether
    the check was fast (the engine's wire, waiting only in the collective)."""
    with collective_intent("SUM"):
        pending = c.publish("all_reduce", np.dtype(np.float32), (3,), wire=engine.WIRE)
        assert pending is not None
        if pending.fast:
            heartbeat.fast[rank] = pending.n
        else:
            c.confirm(pending)
        present = engine.issue(1)
        if present != 2:
            raise c.fast_mismatch(pending)  # the fast worker's call site
        return pending.fast


def test_a_repeated_collective_is_predicted_and_takes_the_fast_path() -> None:
    """From the third identical collective on, no signature is written or waited for."""
    store = MemoryStore()
    engine = FakeEngine()
    beats = [FastHeartbeat(), FastHeartbeat()]
    checkers = [_fast_checker(store, r, beats[r], engine) for r in range(2)]
    fast: list[list[bool]] = [[], []]
    turn = threading.Barrier(2)

    def steps(rank: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(6):
                fast[rank].append(_reduce(checkers[rank], beats[rank], rank, engine))
                turn.wait(10)

        return run

    assert _together(steps(0), steps(1)) == [None, None]
    assert fast == [[False, False, True, True, True, True]] * 2
    assert sorted(k for k in store.data if k.startswith("cc/") and "mode" not in k) == [
        "cc/1/0",
        "cc/1/1",
        "cc/2/0",
        "cc/2/1",
    ]
    # Without a wire (no presence flag in the engine's collective) nothing is fast.
    plain = _checker(MemoryStore(), 0, world=1)
    assert not any(
        (plain.publish("all_reduce", np.dtype(np.float32), (3,)) or pytest.fail("unchecked")).fast
        for _ in range(4)
    )


def test_a_mismatch_after_many_identical_steps_raises_on_both_with_call_sites() -> None:
    """Worker 0 repeats its step (fast: it issues the collective at once); worker 1
    calls another collective: worker 1 sees worker 0 in the fast collective through its
    heartbeat, releases it with zeros, and both raise, naming both calls."""
    store = MemoryStore()
    engine = FakeEngine()
    shared = FastHeartbeat()  # both workers see each other's fast collective
    checkers = [_fast_checker(store, r, shared, engine) for r in range(2)]
    turn = threading.Barrier(2)

    def worker0() -> None:
        for _ in range(5):
            _reduce(checkers[0], shared, 0, engine)
            turn.wait(10)
        _reduce(checkers[0], shared, 0, engine)

    def worker1() -> None:
        for _ in range(5):
            _reduce(checkers[1], shared, 1, engine)
            turn.wait(10)
        c = checkers[1]
        with collective_intent("SUM"):
            c.confirm(c.publish("all_reduce", np.dtype(np.float32), (4,), wire="cpu float32 5"))

    raised = _together(worker0, worker1)
    line0 = _line_of("# the fast worker's call site")
    for e in raised:
        assert isinstance(e, CollectiveMismatchError), raised
        lines = str(e).splitlines()
        assert lines[0].startswith("Workers disagree on their collective #6;"), lines[0]
        assert "were released with zeros and dropped its result" in lines[0]
        assert lines[1].startswith(
            "  worker 0 (/job:worker/replica:0/task:0 at 10.0.0.1:2222): all_reduce(SUM) of "
            "float32[3] at test_collective_check.py:"
        ), lines[1]
        assert lines[1].endswith(f":{line0} in _reduce"), lines[1]
        assert lines[2].startswith(
            "  worker 1 (/job:worker/replica:0/task:1 at 10.0.0.2:2222): all_reduce(SUM) of "
            "float32[4] at test_collective_check.py:"
        ), lines[2]
        assert lines[2].endswith(" in worker1"), lines[2]
    assert engine.released == [FakeEngine.WIRE]  # the wire of worker 0's collective
    # Prediction stops after a mismatch: the next collective is checked through the store.
    assert checkers[0].publish("all_reduce", np.dtype(np.float32), (3,), wire="w").fast is False


def test_a_peer_that_left_while_a_fast_collective_waits_is_named() -> None:
    store = MemoryStore()
    engine = FakeEngine()
    beat = FastHeartbeat()
    c = _fast_checker(store, 0, beat, engine)
    store.set("cc/mode/1", "1")
    for n in (1, 2):  # two agreed collectives, then a predicted one
        store.set(f"cc/{n}/1", "all_reduce(SUM) of float32[3]\n")
        with collective_intent("SUM"):
            c.confirm(c.publish("all_reduce", np.dtype(np.float32), (3,), wire="w"))
    with collective_intent("SUM"):
        pending = c.publish("all_reduce", np.dtype(np.float32), (3,), wire="w")
    assert pending is not None and pending.fast
    assert c.mismatch_after(pending, 0.01) is None  # worker 1 published nothing: no verdict
    store.set("cc/3/1", "left\n2")  # worker 1's program ended (the engine then fails)
    error = c.mismatch_after(pending, 0.01)
    assert isinstance(error, CollectiveMismatchError)
    assert "worker 1 (/job:worker/replica:0/task:1 at 10.0.0.2:2222): left the cluster after 2" in (
        str(error)
    )


def test_heartbeats_tell_which_fast_collective_a_worker_is_in() -> None:
    """The fast path writes nothing: a peer learns from the heartbeat (``<beat>
    <collectives> <fast>``) that this worker waits in its fast collective n."""
    store = MemoryStore()
    fast = [0]
    watcher = Heartbeat(lambda: store, 0, 2, lambda: 0)
    worker = Heartbeat(lambda: store, 1, 2, lambda: 7, lambda: fast[0])
    try:
        deadline = time.monotonic() + 10
        while "hb/1" not in store.data and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.data["hb/1"].split()[1:] == ["7", "0", "0"]
        fast[0] = 7
        while watcher.fast_at(7) != [1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watcher.fast_at(7) == [1] and watcher.fast_at(6) == []
        assert store.data["hb/0"].split()[2] == "0"  # a worker with no fast collective
    finally:
        watcher.stop(wait=5)
        worker.stop(wait=5)


# --------------------------------------------------------------------------- a worker abandons


def test_heartbeats_tell_that_a_worker_abandoned_the_cluster() -> None:
    """``<beat> <collectives> <fast> <failed>``: the peers learn the flag, and a peer's
    check stops predicting (its next collective goes through the store)."""
    store = MemoryStore()
    failed = [False]
    watcher = Heartbeat(lambda: store, 0, 2, lambda: 0)
    worker = Heartbeat(lambda: store, 1, 2, lambda: 3, failed=lambda: failed[0])
    try:
        deadline = time.monotonic() + 10
        while "hb/1" not in store.data and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watcher.failed() == []
        failed[0] = True
        while watcher.failed() != [1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watcher.failed() == [1] and worker.failed() == []
    finally:
        watcher.stop(wait=5)
        worker.stop(wait=5)


def test_a_peer_at_the_abandoned_collective_raises_naming_the_error() -> None:
    """Worker 1 abandons after one agreed collective: worker 0, at collective #2, raises
    CollectiveMismatchError naming worker 1's error, and knows that the peer failed."""
    store = MemoryStore()
    a, b = _checker(store, 0), _checker(store, 1)
    _together(
        lambda: _check(a, "all_reduce", np.dtype(np.float32), (3,)),
        lambda: _check(b, "all_reduce", np.dtype(np.float32), (3,)),
    )
    b.abandon("strategy.run raised ValueError: replica 3\nfails (after 1 collective(s))")
    with pytest.raises(CollectiveMismatchError) as raised:
        _check(a, "all_reduce", np.dtype(np.float32), (3,))
    message = str(raised.value)
    assert message.startswith("Collective #2 cannot run: worker(s) 1 raised an error"), message
    assert (
        "  worker 1 (/job:worker/replica:0/task:1 at 10.0.0.2:2222): strategy.run raised "
        "ValueError: replica 3 fails (after 1 collective(s)); it calls no more collectives"
    ) in message
    assert "restart them all" in message
    assert a.peer_failed and not b.peer_failed


class _Membership(_multi_process.ClusterMembership):
    engine_errors = (RuntimeError,)

    def translate(self, what: str, err: BaseException) -> errors.OpError:
        return errors.UnavailableError(f"{what}: {err}")


def _membership(store: MemoryStore, rank: int) -> _Membership:
    member = _Membership(
        rank=rank,
        world_size=2,
        timeout=20.0,
        names=[f"/job:worker/replica:0/task:{r}" for r in range(2)],
        addresses=[f"10.0.0.{r + 1}:2222" for r in range(2)],
    )
    member.checker = _checker(store, rank)
    return member


def test_an_error_that_escaped_a_run_fails_the_cluster_on_both_workers() -> None:
    """`ClusterMembership.abandon`: this worker's next collective raises CancelledError
    (without running), the peer's CollectiveMismatchError; then the peer's cluster has
    failed too."""
    store = MemoryStore()
    a, b = _membership(store, 0), _membership(store, 1)
    b.abandon(ValueError("replica 3 fails"))
    assert b.abandoned and isinstance(b.failure, errors.CancelledError)
    ran: list[int] = []
    b.checked("all_reduce", np.dtype(np.float32), (3,), None, lambda: None)  # no check
    with pytest.raises(errors.CancelledError) as raised:
        b.call("all_reduce", lambda: ran.append(1))
    assert ran == []
    message = str(raised.value)
    assert message.startswith("all_reduce cannot run: the cluster failed earlier"), message
    assert "strategy.run raised ValueError: replica 3 fails on worker 1 (" in message
    assert "after its collective #0" in message
    b.abandon(RuntimeError("again"))  # once failed, nothing more is published
    assert "again" not in store.data["cc/1/1"]
    with pytest.raises(CollectiveMismatchError, match=r"worker\(s\) 1 raised an error"):
        a.checked("all_reduce", np.dtype(np.float32), (3,), None, lambda: None)
    assert isinstance(a.failure, CollectiveMismatchError)
    with pytest.raises(CollectiveMismatchError, match="cannot run: the cluster failed earlier"):
        a.call("all_reduce", lambda: ran.append(1))
    assert ran == []


def test_a_mismatch_every_worker_raised_does_not_fail_the_cluster() -> None:
    """A CollectiveMismatchError of the check (every worker raises it at the same
    collective) escaping strategy.run leaves the cluster usable; any other error ends it,
    and one worker has nobody to tell."""
    store = MemoryStore()
    a, b = _membership(store, 0), _membership(store, 1)
    raised = _together(
        lambda: a.checked("all_reduce", np.dtype(np.float32), (3,), None, lambda: None),
        lambda: b.checked("all_reduce", np.dtype(np.float32), (4,), None, lambda: None),
    )
    assert all(isinstance(e, CollectiveMismatchError) for e in raised)
    for member, error in zip((a, b), raised, strict=True):
        assert error is not None
        member.abandon(error)
        assert member.failure is None and not member.abandoned
    a.abandon(CollectiveMismatchError("replicas of worker 0 disagree"))  # not the check's
    assert isinstance(a.failure, errors.CancelledError)
    alone = _Membership(rank=0, world_size=1, timeout=1.0, names=["w"], addresses=[""])
    alone.abandon(ValueError("x"))
    assert alone.failure is None
