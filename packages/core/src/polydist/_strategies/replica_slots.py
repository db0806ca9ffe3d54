"""Where an eager replica runs: its own stack (a greenlet, or a pooled daemon thread; a
lone thread-mode replica needs neither and runs on the calling thread), the watchdog that
reports a replica stuck in a wait outside polydist, and the thread pool. ``eager.py``'s
runner drives them."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import greenlet

from polydist._collectives import trace as _trace
from polydist.errors import DeadlineExceededError

if TYPE_CHECKING:
    from polydist._strategies.eager import _Run, _SyncRequest

TIMEOUT_ENV = "POLYDIST_TIMEOUT_SECONDS"
IDLE_ENV = "POLYDIST_IDLE_THREAD_SECONDS"


class _Abort(BaseException):
    """Unwinds a paused replica's code when the run stops early.

    A BaseException so that user ``except Exception`` blocks don't swallow it.
    """


_NOT_STARTED, _RUNNING, _PAUSED, _DONE, _FAILED, _ABORTED = range(6)


class _Slot:
    """One replica of one run: its state, and how to switch to it."""

    def __init__(self, run: _Run, index: int) -> None:
        self.run = run
        self.index = index
        self.status = _NOT_STARTED
        self.request: _SyncRequest | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        self.inbox: Any = None
        self.abort = False

    def _body(self) -> None:  # on the replica's own stack
        try:
            if self.abort:
                raise _Abort()
            self.result = self.run.call_replica(self)
            self.status = _DONE
        except _Abort:
            self.status = _ABORTED
        except BaseException as e:  # reported by the scheduler
            self.error = e
            self.status = _FAILED
        finally:
            self.request = None

    def sync(self, request: _SyncRequest) -> Any:  # on the replica's own stack
        if self.abort:
            raise _Abort()
        self.request = request
        self.status = _PAUSED
        self._pause()
        if self.abort:
            raise _Abort()
        self.status = _RUNNING
        self.request = None
        reply, self.inbox = self.inbox, None
        return reply

    def advance(self, reply: Any) -> None:
        """Runs this replica until it pauses at a sync point or finishes."""
        self.inbox = reply
        if self.status == _NOT_STARTED:
            self.status = _RUNNING
        self._resume()

    def stop(self) -> None:
        """Unwinds a paused replica (the run ended early)."""
        self.abort = True
        if self.status == _PAUSED:
            self._resume()

    def _pause(self) -> None:
        raise NotImplementedError

    def _resume(self) -> None:
        raise NotImplementedError


class _GreenletPool(threading.local):
    """Idle greenlets of this thread; starting a fresh greenlet costs ~10x a reuse."""

    def __init__(self) -> None:
        self.idle: list[greenlet.greenlet] = []


_GREENLETS = _GreenletPool()
_MAX_IDLE_GREENLETS = 1024


def _greenlet_loop() -> None:
    # Tasks come through switch(), not as the greenlet's argument: greenlet holds its
    # arguments until the greenlet ends, and a task holds its run's values.
    while True:
        parent = greenlet.getcurrent().parent
        assert parent is not None
        task = parent.switch()  # wait idle in the pool for the next task
        task()
        del task  # the finished replica and what it returned belong to the caller now


class _GreenletSlot(_Slot):
    def __init__(self, run: _Run, index: int) -> None:
        super().__init__(run, index)
        self._greenlet: greenlet.greenlet | None = None

    def _pause(self) -> None:
        assert self._greenlet is not None
        parent = self._greenlet.parent
        assert parent is not None
        parent.switch()

    def _resume(self) -> None:
        run = self.run
        run.running = self  # what the watchdog samples: who runs, and since which switch
        run.switches += 1
        try:
            self._switch_in()
        finally:
            run.running = None

    def _switch_in(self) -> None:
        g = self._greenlet
        if g is None:
            idle = _GREENLETS.idle
            if idle:
                g = idle.pop()
            else:
                g = greenlet.greenlet(_greenlet_loop)
                g.switch()  # to its first wait for a task
            g.parent = greenlet.getcurrent()
            self._greenlet = g
            g.switch(self._body)
        else:
            g.switch()
        if self.status in (_DONE, _FAILED, _ABORTED):
            self._greenlet = None
            if len(_GREENLETS.idle) < _MAX_IDLE_GREENLETS:
                _GREENLETS.idle.append(g)


class _ThreadSlot(_Slot):
    def __init__(self, run: _Run, index: int) -> None:
        super().__init__(run, index)
        self._worker: _Worker | None = None

    def _pause(self) -> None:
        worker = self._worker
        assert worker is not None
        worker.done.release()
        worker.go.acquire()

    def _resume(self) -> None:
        if self._worker is None:
            self._worker = _POOL.take()
            self._worker.task = self._body
        worker = self._worker
        worker.go.release()
        timeout = self.run.timeout
        if not worker.done.acquire(timeout=timeout):
            self.abort = True  # it unwinds at its next sync point
            raise DeadlineExceededError(
                f"Replica {self.index} ({self.run.devices[self.index]}) neither reached a "
                f"collective nor returned within {timeout:g} s. On real hardware the other "
                "replicas would wait forever. Check for a blocking call or an endless loop in "
                f"the replica function, or raise ${TIMEOUT_ENV}."
            )


# -- the watchdog (greenlet mode) ----------------------------------------------------------


class _Watchdog:
    """Reports a greenlet-mode replica that neither syncs nor returns within the timeout.

    Greenlet replicas share the calling thread, so a replica blocked in a wait
    outside polydist (a ``threading.Event`` another replica would set, a queue, a
    lock) blocks them all, and nothing on that thread can interrupt it. A daemon
    thread samples the greenlet runs and writes a diagnostic to stderr (it cannot
    unblock the wait; thread mode raises ``DeadlineExceededError`` instead).
    """

    def __init__(self) -> None:
        self.runs: dict[int, _Run] = {}
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def watch(self, run: _Run) -> None:
        self.runs[id(run)] = run
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._loop, name="polydist-greenlet-watchdog", daemon=True
                    )
                    self._thread.start()

    def unwatch(self, run: _Run) -> None:
        self.runs.pop(id(run), None)

    def _loop(self) -> None:
        # id(run) -> (switches, id of the running slot, first seen at, reported): only
        # ids, and no run held across the sleep, so that no finished run stays alive.
        seen: dict[int, tuple[int, int, float, bool]] = {}
        poll = 1.0
        while True:
            time.sleep(poll)
            seen, poll = self._sample(seen)

    def _sample(
        self, seen: dict[int, tuple[int, int, float, bool]]
    ) -> tuple[dict[int, tuple[int, int, float, bool]], float]:
        now = time.monotonic()
        live = {}
        timeouts = []
        for key, run in list(self.runs.items()):  # one C-level copy: safe across threads
            slot, switches = run.running, run.switches
            timeouts.append(run.timeout)
            old = seen.get(key)
            if old is None or old[0] != switches or old[1] != id(slot):
                live[key] = (switches, id(slot), now, False)
                continue
            reported = old[3]
            if slot is not None and not reported and now - old[2] >= run.timeout:
                _report_stuck(run, slot, now - old[2])
                reported = True
            live[key] = (old[0], old[1], old[2], reported)
        return live, min(max(min(timeouts, default=4.0) / 4, 0.01), 1.0)


_WATCHDOG = _Watchdog()


def _new_watchdog_after_fork() -> None:
    global _WATCHDOG
    _WATCHDOG = _Watchdog()  # a forked child has no watchdog thread: it starts its own


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_watchdog_after_fork)


def _report_stuck(run: _Run, slot: _Slot, seconds: float) -> None:
    frame = sys._current_frames().get(run.thread_id)
    where = ""
    if frame is not None:
        code = frame.f_code
        inner = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        user = _trace.user_source_line(frame=frame)
        where = f" It is at {inner}" + (f", called from {user}" if user != inner else "") + "."
    print(
        f"polydist: replica {slot.index} ({run.devices[slot.index]}) has neither reached a "
        f"collective nor returned for {seconds:.3g} s (the timeout: {run.timeout:g} s).{where} "
        "In greenlet mode (the default) replicas take turns on one thread and only "
        "polydist's collectives and merge_call switch between them, so a replica that waits "
        "for something another replica would do (a threading.Event, a queue, a lock) waits "
        "forever. Exchange values through a collective or merge_call instead, or run the "
        "replicas on threads (SimBackend(replica_mode='thread'), "
        "EagerReplicaRunner(mode='thread')), where a stuck replica raises "
        "DeadlineExceededError. If the replica is only slow, raise the timeout "
        f"(timeout_seconds, or ${TIMEOUT_ENV}).",
        file=sys.stderr,
        flush=True,
    )


# -- the worker pool (thread mode) ------------------------------------------------------


class _Worker:
    """A daemon thread that runs one replica at a time.

    Handoffs use two bare locks, cheaper than Events: the scheduler releases
    ``go`` and waits on ``done``; the worker releases ``done`` when it pauses
    or finishes.
    """

    _counter = 0

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.go = threading.Lock()
        self.go.acquire()
        self.done = threading.Lock()
        self.done.acquire()
        self.task: Callable[[], None] | None = None
        _Worker._counter += 1
        self.thread = threading.Thread(
            target=self._loop, name=f"polydist-replica-worker-{_Worker._counter}", daemon=True
        )
        self.thread.start()

    def _loop(self) -> None:
        while True:
            if not self.go.acquire(timeout=self.pool.idle_seconds()):
                if self.pool.retire(self):
                    return
                continue  # taken just now; ``go`` is about to be released
            task, self.task = self.task, None
            if task is None:
                return
            task()  # a slot's _body, which catches everything
            del task  # the finished replica and what it returned belong to the caller now
            # Not busy before ``done`` wakes the caller (who may count busy workers at
            # once); idle only after, so a new taker cannot get this ``done`` release.
            self.pool.finished()
            self.done.release()
            self.pool.give_back(self)


class _Pool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._busy = 0

    @staticmethod
    def idle_seconds() -> float:
        return float(os.environ.get(IDLE_ENV, "2"))

    def take(self) -> _Worker:
        with self._lock:
            self._busy += 1
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = _Worker(self)
        worker.done.acquire(blocking=False)  # drop a stale release from an abandoned task
        return worker

    def finished(self) -> None:
        with self._lock:
            self._busy -= 1

    def give_back(self, worker: _Worker) -> None:
        with self._lock:
            self._idle.append(worker)

    def retire(self, worker: _Worker) -> bool:
        with self._lock:
            if worker in self._idle:
                self._idle.remove(worker)
                return True
            return False

    def busy(self) -> int:
        with self._lock:
            return self._busy


_POOL = _Pool()


def busy_workers() -> int:
    """How many pooled replica threads are running replica code (0 between runs)."""
    return _POOL.busy()


# -- the channel a ReplicaContext talks to ------------------------------------------------
