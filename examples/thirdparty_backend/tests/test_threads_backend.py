"""The example backend's own behaviour; the conformance suite checks the rest
(``pytest --pyargs polydist_conformance --polydist-backend=threads``)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from polydist_example_backend import ThreadsBackend, sum_in_replica_order

import polydist as pd
from polydist.backend import Backend, get_backend
from polydist.errors import CollectiveMismatchError, DeadlineExceededError


def test_is_a_backend_and_registered() -> None:
    backend: Backend = ThreadsBackend()  # the static proof; isinstance is the runtime one
    assert isinstance(backend, Backend)
    assert "threads" in pd.available_backends()
    assert isinstance(get_backend("threads"), ThreadsBackend)


def test_replicas_run_at_the_same_time() -> None:
    # Each replica waits for all the others outside polydist: a runner that takes turns
    # (the sim) can never pass this barrier.
    strategy = pd.MirroredStrategy(4, backend=ThreadsBackend())
    barrier = threading.Barrier(4, timeout=30)

    def step() -> int:
        return barrier.wait()

    arrived = strategy.experimental_local_results(strategy.run(step))
    assert sorted(arrived) == [0, 1, 2, 3]


def test_all_reduce_adds_in_float64_and_every_replica_gets_the_same_bits() -> None:
    strategy = pd.MirroredStrategy(4, backend=ThreadsBackend())
    parts = np.array([1e8, 1.0, -1e8, 1.0], dtype=np.float32)

    def step() -> object:
        ctx = pd.get_replica_context()
        assert ctx is not None
        mine = parts[int(ctx.replica_id_in_sync_group)]
        return ctx.all_reduce(pd.ReduceOp.SUM, np.asarray(mine, dtype=np.float32))

    results = strategy.experimental_local_results(strategy.run(step))
    # Adding in float32, 1e8 + 1 rounds back to 1e8 and the sum is 1.
    assert [r.dtype for r in results] == [np.float32] * 4
    assert [float(r) for r in results] == [2.0] * 4
    assert len({id(r) for r in results}) == 4  # each replica owns its result


def test_sum_in_replica_order_keeps_integer_dtype_and_wraps() -> None:
    big = np.array([2**31 - 1], dtype=np.int32)
    total = sum_in_replica_order([big, np.array([1], dtype=np.int32)])
    assert total.dtype == np.int32
    assert total.tolist() == [-(2**31)]
    assert big.tolist() == [2**31 - 1]  # inputs untouched


def test_all_gather_concatenates_uneven_sizes_in_replica_order() -> None:
    strategy = pd.MirroredStrategy(3, backend=ThreadsBackend())

    def step() -> object:
        ctx = pd.get_replica_context()
        assert ctx is not None
        r = int(ctx.replica_id_in_sync_group)
        return ctx.all_gather(np.full((r + 1,), r, dtype=np.int64), axis=0)

    for result in strategy.experimental_local_results(strategy.run(step)):
        assert result.tolist() == [0, 1, 1, 2, 2, 2]


def test_merge_call_runs_once_on_the_calling_thread_in_cross_replica_context() -> None:
    strategy = pd.MirroredStrategy(4, backend=ThreadsBackend())
    calls: list[tuple[str, bool, list[int]]] = []

    def merge_fn(s: pd.Strategy, value: pd.PerReplica) -> pd.PerReplica:
        values = [int(v) for v in s.experimental_local_results(value)]
        calls.append((threading.current_thread().name, pd.in_cross_replica_context(), values))
        return pd.PerReplica([np.int64(v * 10) for v in values])

    def step() -> object:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return ctx.merge_call(merge_fn, args=(np.int64(int(ctx.replica_id_in_sync_group)),))

    results = strategy.experimental_local_results(strategy.run(step))
    assert calls == [(threading.current_thread().name, True, [0, 1, 2, 3])]
    assert [int(r) for r in results] == [0, 10, 20, 30]


def test_an_error_in_merge_fn_is_raised_and_stops_the_replicas() -> None:
    strategy = pd.MirroredStrategy(3, backend=ThreadsBackend(timeout_seconds=30))

    def merge_fn(s: pd.Strategy) -> None:
        raise ValueError("merge_fn failed")

    def step() -> object:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return ctx.merge_call(merge_fn)

    with pytest.raises(ValueError, match="merge_fn failed"):
        strategy.run(step)
    # The backend is usable afterwards.
    ids = strategy.run(lambda: pd.get_replica_context().replica_id_in_sync_group)  # type: ignore[union-attr]
    assert [int(i) for i in strategy.experimental_local_results(ids)] == [0, 1, 2]


def test_a_replica_that_skips_a_collective_raises_mismatch() -> None:
    strategy = pd.MirroredStrategy(2, backend=ThreadsBackend(timeout_seconds=30))

    def step() -> object:
        ctx = pd.get_replica_context()
        assert ctx is not None
        if int(ctx.replica_id_in_sync_group) == 0:
            return np.float32(0)
        return ctx.all_reduce(pd.ReduceOp.SUM, np.float32(1))

    with pytest.raises(CollectiveMismatchError, match=r"replica 0 .*returned from fn"):
        strategy.run(step)


def test_replicas_disagreeing_on_shapes_raise_mismatch() -> None:
    strategy = pd.MirroredStrategy(2, backend=ThreadsBackend(timeout_seconds=30))

    def step() -> object:
        ctx = pd.get_replica_context()
        assert ctx is not None
        size = int(ctx.replica_id_in_sync_group) + 1
        return ctx.all_reduce(pd.ReduceOp.SUM, np.ones(size, dtype=np.float32))

    with pytest.raises(CollectiveMismatchError, match=r"float32\[2\]"):
        strategy.run(step)


def test_an_error_in_one_replica_is_raised_and_stops_the_others() -> None:
    strategy = pd.MirroredStrategy(3, backend=ThreadsBackend(timeout_seconds=30))

    def step() -> object:
        ctx = pd.get_replica_context()
        assert ctx is not None
        if int(ctx.replica_id_in_sync_group) == 1:
            raise KeyError("replica 1 failed")
        return ctx.all_reduce(pd.ReduceOp.SUM, np.float32(1))

    with pytest.raises(KeyError, match="replica 1 failed"):
        strategy.run(step)


def test_a_replica_that_never_arrives_raises_deadline_exceeded() -> None:
    strategy = pd.MirroredStrategy(2, backend=ThreadsBackend(timeout_seconds=0.5))
    release = threading.Event()

    def step() -> object:
        ctx = pd.get_replica_context()
        assert ctx is not None
        if int(ctx.replica_id_in_sync_group) == 1:
            release.wait(30)  # stuck until the test lets it go
        return ctx.all_reduce(pd.ReduceOp.SUM, np.float32(1))

    timer = threading.Timer(2.0, release.set)
    timer.start()
    try:
        with pytest.raises(DeadlineExceededError, match=r"for replica\(s\) \[1\]"):
            strategy.run(step)
    finally:
        timer.cancel()
        release.set()


def test_devices_are_checked() -> None:
    backend = ThreadsBackend(num_devices=2)
    with pytest.raises(ValueError, match="at most 2"):
        pd.MirroredStrategy(3, backend=backend)
    with pytest.raises(ValueError, match="cannot place replicas"):
        pd.MirroredStrategy(["/gpu:0"], backend=backend)
    assert backend.replica_devices(None) == ("/job:localhost/replica:0/task:0/device:CPU:0",)


def test_collectives_appear_in_traces_with_their_wall_time() -> None:
    strategy = pd.MirroredStrategy(2, backend=ThreadsBackend())

    def step() -> object:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce(pd.ReduceOp.SUM, np.ones((3,), dtype=np.float32))

    with pd.trace() as trace:
        strategy.run(step)
    events = [e for e in trace.events if e.op == "all_reduce"]
    assert len(events) == 1
    assert events[0].shape == (3,)
    assert events[0].nbytes == 12
    assert events[0].duration is not None
    assert "test_threads_backend.py" in events[0].source


def test_a_slow_replica_does_not_time_out_the_others_while_it_computes() -> None:
    # The timeout bounds each wait, not the step: progress restarts it.
    strategy = pd.MirroredStrategy(2, backend=ThreadsBackend(timeout_seconds=5))

    def step() -> object:
        ctx = pd.get_replica_context()
        assert ctx is not None
        if int(ctx.replica_id_in_sync_group) == 1:
            time.sleep(0.05)
        return ctx.all_reduce(pd.ReduceOp.SUM, np.float32(1))

    results = strategy.experimental_local_results(strategy.run(step))
    assert [float(r) for r in results] == [2.0, 2.0]
