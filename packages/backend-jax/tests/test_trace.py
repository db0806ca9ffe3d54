"""polydist.trace() sees every collective of every step, though the program is traced once."""

from __future__ import annotations

from typing import Any

import numpy as np
from jax_testutil import distribute

import polydist as pd
from polydist.backend.tracing import Trace
from polydist_jax import JaxBackend
from polydist_sim import SimBackend

N = 4


def ctx() -> pd.ReplicaContext:
    c = pd.get_replica_context()
    assert c is not None
    return c


def step(x: Any) -> Any:
    total = ctx().all_reduce("SUM", {"a": x, "b": x[:1]})
    mean = ctx().merge_call(lambda s, v: s.reduce("MEAN", v, axis=None), args=(x,))
    return ctx().all_gather(total["a"] + mean, 0)


def summary(t: Trace) -> list[tuple[Any, ...]]:
    return [(e.step, e.op, e.reduce_op, e.dtype, e.shape, e.nbytes, e.source) for e in t.events]


def test_every_step_records_like_the_sim() -> None:
    traces = []
    for backend in (JaxBackend(), SimBackend("sequential")):
        strategy = pd.MirroredStrategy(N, backend=backend)
        x = distribute(strategy, [np.full(3, r, np.float32) for r in range(N)])
        with pd.trace() as t:
            for _ in range(3):
                strategy.run(step, (x,))
            strategy.reduce("SUM", x, axis=None)
        traces.append(t)
    got, want = traces
    assert summary(got) == summary(want)
    assert got.steps == 3
    ops = [e.op for e in got.by_step()[1]]
    assert ops == ["all_reduce", "all_reduce", "merge_call", "reduce_to", "all_gather"]
    assert all(e.backend == "jax" for e in got.events)
    assert all("test_trace.py" in e.source for e in got.events)
    assert got.events[0].participants[1] == "/job:localhost/replica:0/task:0/device:CPU:1"


def test_compiling_outside_a_trace_still_records_later_steps() -> None:
    backend = JaxBackend()
    strategy = pd.MirroredStrategy(N, backend=backend)
    x = distribute(strategy, [np.full(3, r, np.float32) for r in range(N)])
    strategy.run(step, (x,))  # compiled here, no trace active
    with pd.trace() as t:
        strategy.run(step, (x,))
    assert [e.op for e in t.events] == [
        "all_reduce",
        "all_reduce",
        "merge_call",
        "reduce_to",
        "all_gather",
    ]
    assert backend.compile_count == 1


def test_compiling_inside_a_trace_records_once() -> None:
    strategy = pd.MirroredStrategy(N, backend=JaxBackend())
    x = distribute(strategy, [np.full(3, r, np.float32) for r in range(N)])
    with pd.trace() as outer, pd.trace() as inner:
        strategy.run(step, (x,))
    assert len(outer.events) == len(inner.events) == 5
