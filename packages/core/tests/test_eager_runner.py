"""EagerReplicaRunner: lone replicas run inline in thread mode; runs keep nothing alive."""

from __future__ import annotations

import gc
import io
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist.backend import EagerReplicaRunner, busy_workers, timeout_seconds_from_env
from polydist_sim import SimBackend


def _ctx() -> pd.ReplicaContext:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return ctx


@pytest.fixture
def no_gc() -> Iterator[None]:
    """Only reference counting frees objects: a reference cycle would keep them."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_runs_inline() -> None:
    assert EagerReplicaRunner("thread").runs_inline(1)
    assert not EagerReplicaRunner("thread").runs_inline(2)
    assert not EagerReplicaRunner("greenlet").runs_inline(1)


@pytest.mark.usefixtures("no_gc")
@pytest.mark.parametrize("mode", ["greenlet", "thread"])
@pytest.mark.parametrize("replicas", [1, 3])
def test_a_run_keeps_neither_its_arguments_nor_its_results(mode: str, replicas: int) -> None:
    strategy = pd.MirroredStrategy(replicas, backend=SimBackend(replica_mode=mode))  # type: ignore[arg-type]
    arg = np.arange(4, dtype=np.float32)

    def fn(x: Any) -> Any:
        return _ctx().all_reduce("SUM", x) + _ctx().replica_id_in_sync_group

    out = strategy.run(fn, args=(arg,))
    results = [weakref.ref(r) for r in strategy.experimental_local_results(out)]
    assert [np.asarray(r()).tolist() for r in results] == [
        [replicas * i + r for i in range(4)] for r in range(replicas)
    ]
    arg_ref = weakref.ref(arg)
    del out, arg
    assert all(r() is None for r in results)
    assert arg_ref() is None


def test_a_lone_thread_mode_replica_runs_on_the_calling_thread() -> None:
    strategy = pd.MirroredStrategy(1, backend=SimBackend(replica_mode="thread"))
    seen: dict[str, Any] = {}

    def merge_fn(s: pd.Strategy, value: Any) -> Any:
        seen["merge_thread"] = threading.get_ident()
        seen["merge_replica_context"] = pd.get_replica_context()
        seen["merge_cross_replica"] = pd.in_cross_replica_context()
        return s.reduce("SUM", value, axis=None)

    def fn() -> Any:
        seen["replica_thread"] = threading.get_ident()
        total = _ctx().all_reduce("SUM", np.float32(2.0))
        return _ctx().merge_call(merge_fn, args=(total * 3,))

    out = strategy.run(fn)
    assert float(out) == 6.0
    here = threading.get_ident()
    assert seen["replica_thread"] == seen["merge_thread"] == here
    assert seen["merge_replica_context"] is None and seen["merge_cross_replica"] is True
    assert pd.get_replica_context() is not None  # the default context again, outside run
    assert not pd.in_cross_replica_context()
    assert busy_workers() == 0


def test_several_thread_mode_replicas_still_get_threads() -> None:
    strategy = pd.MirroredStrategy(2, backend=SimBackend(replica_mode="thread"))

    def fn() -> Any:
        _ctx().all_reduce("SUM", np.float32(1.0))  # both wait here, each on its thread
        return threading.get_ident()

    out = strategy.run(fn)
    threads = set(strategy.experimental_local_results(out))
    assert len(threads) == 2 and threading.get_ident() not in threads


def test_a_lone_replica_s_error_reaches_the_caller() -> None:
    strategy = pd.MirroredStrategy(1, backend=SimBackend(replica_mode="thread"))

    def fn() -> Any:
        _ctx().all_reduce("SUM", np.float32(1.0))
        raise KeyError("from the replica")

    with pytest.raises(KeyError, match="from the replica"):
        strategy.run(fn)
    assert float(strategy.run(lambda: _ctx().all_reduce("SUM", np.float32(1.5)))) == 1.5


@pytest.mark.parametrize("text", ["abc", "-5", "0", "nan", "inf", "1e999"])
def test_a_bad_timeout_variable_is_named_in_the_error(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.setenv("POLYDIST_TIMEOUT_SECONDS", text)
    message = rf"\$POLYDIST_TIMEOUT_SECONDS must be a positive number of seconds .*got '{text}'"
    with pytest.raises(ValueError, match=message):
        timeout_seconds_from_env()
    # A run reads it (thread mode used to accept -5, and 'abc' failed without its name).
    strategy = pd.MirroredStrategy(2, backend=SimBackend(replica_mode="thread"))
    with pytest.raises(ValueError, match=message):
        strategy.run(lambda: 1.0)


def test_the_timeout_variable_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLYDIST_TIMEOUT_SECONDS", " 2.5 ")
    assert timeout_seconds_from_env() == 2.5
    monkeypatch.setenv("POLYDIST_TIMEOUT_SECONDS", "")
    assert timeout_seconds_from_env() == 300.0
    monkeypatch.delenv("POLYDIST_TIMEOUT_SECONDS")
    assert timeout_seconds_from_env(60.0) == 60.0


def test_a_greenlet_replica_blocked_outside_polydist_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Greenlet replicas share one thread: replica 0 waiting for an Event blocks replica 1
    # too, and nothing on that thread can end the wait. The watchdog reports it on stderr;
    # here the report itself sets the Event, so the test ends (the 30 s bound: without
    # the watchdog, nobody sets it).
    monkeypatch.setenv("POLYDIST_TIMEOUT_SECONDS", "0.2")
    reported = threading.Event()

    class Stderr(io.StringIO):
        def write(self, text: str) -> int:
            written = super().write(text)
            reported.set()
            return written

    stderr = Stderr()
    monkeypatch.setattr(sys, "stderr", stderr)
    strategy = pd.MirroredStrategy(2, backend=SimBackend())

    def step() -> Any:
        ctx = _ctx()
        if int(ctx.replica_id_in_sync_group) == 0:
            reported.wait(timeout=30)
        return ctx.all_reduce("SUM", np.float32(1))

    result = strategy.run(step)
    assert [float(v) for v in strategy.experimental_local_results(result)] == [2.0, 2.0]
    report = stderr.getvalue()
    assert "replica 0 (" in report
    assert "neither reached a collective nor returned" in report
    assert "test_eager_runner.py" in report  # the replica's own line
    assert "replica_mode='thread'" in report


def test_timeout_variable_changes_take_effect_after_it_was_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The parse is remembered per text (runs read the variable every time): a new text,
    # a bad one or none after a good one still counts at once.
    monkeypatch.setenv("POLYDIST_TIMEOUT_SECONDS", "7")
    assert timeout_seconds_from_env() == 7.0
    assert timeout_seconds_from_env() == 7.0
    monkeypatch.setenv("POLYDIST_TIMEOUT_SECONDS", "9.5")
    assert timeout_seconds_from_env() == 9.5
    monkeypatch.setenv("POLYDIST_TIMEOUT_SECONDS", "-1")
    with pytest.raises(ValueError, match="must be a positive number"):
        timeout_seconds_from_env()
    monkeypatch.setenv("POLYDIST_TIMEOUT_SECONDS", "7")
    assert timeout_seconds_from_env() == 7.0
    monkeypatch.delenv("POLYDIST_TIMEOUT_SECONDS")
    assert timeout_seconds_from_env(60.0) == 60.0


def test_no_worker_counts_as_busy_once_run_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker preempted between waking the caller and rejoining the pool is not busy."""
    from polydist._strategies import replica_slots

    original = replica_slots._Pool.give_back

    def slow_give_back(self: Any, worker: Any) -> None:
        threading.Event().wait(0.05)  # the worker thread loses the CPU here
        original(self, worker)

    monkeypatch.setattr(replica_slots._Pool, "give_back", slow_give_back)
    strategy = pd.MirroredStrategy(2, backend=SimBackend(replica_mode="thread"))
    for _ in range(3):
        strategy.run(lambda: _ctx().all_reduce("SUM", np.float32(1.0)))
        assert busy_workers() == 0
