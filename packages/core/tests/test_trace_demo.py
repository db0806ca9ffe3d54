"""``polydist.trace()`` over the README demo on the sim: every collective, the
Chrome trace JSON checked against the trace-event schema, and cost-model times."""

from __future__ import annotations

import inspect
import io
import itertools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist._collectives import trace as _trace
from polydist._collectives.trace import CollectiveEvent, Trace
from polydist._tools import demo as _demo
from polydist._tools.cli import main
from polydist_sim import cost_model

REPLICAS = 4
STEPS = 3
GPUS = tuple(f"/job:localhost/replica:0/task:0/device:GPU:{i}" for i in range(REPLICAS))

# --------------------------------------------------------------------------- schema
# The Trace Event Format (Chrome's "JSON Object Format"): a dict with a
# "traceEvents" list. We emit two phases: "X" (complete events: a begin
# timestamp "ts" and a duration "dur", both in microseconds) and "M" (metadata
# naming processes and threads).

_X_KEYS: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "cat": str,
    "ph": str,
    "ts": (int, float),
    "dur": (int, float),
    "pid": int,
    "tid": int,
    "args": dict,
}
_M_KEYS: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "ph": str,
    "pid": int,
    "tid": int,
    "args": dict,
}
_M_ARGS: dict[str, tuple[str, type]] = {
    "process_name": ("name", str),
    "thread_name": ("name", str),
    "process_sort_index": ("sort_index", int),
    "thread_sort_index": ("sort_index", int),
}


def _check_keys(event: dict[str, Any], schema: dict[str, type | tuple[type, ...]]) -> None:
    assert set(event) == set(schema), f"keys {sorted(event)} != {sorted(schema)}"
    for key, types_ in schema.items():
        value = event[key]
        assert isinstance(value, types_), f"{key}={value!r} is not {types_}"
        assert not isinstance(value, bool), f"{key} is a bool"
        if isinstance(value, float):
            assert math.isfinite(value), f"{key}={value!r}"


def validate_trace_events(doc: Any) -> list[dict[str, Any]]:
    """Asserts ``doc`` is a valid trace-event document; returns its "X" events."""
    assert isinstance(doc, dict)
    assert isinstance(doc.get("traceEvents"), list)
    assert doc.get("displayTimeUnit", "ms") in ("ms", "ns")
    named: set[tuple[str, int, int]] = set()
    complete: list[dict[str, Any]] = []
    for event in doc["traceEvents"]:
        assert isinstance(event, dict)
        if event.get("ph") == "M":
            _check_keys(event, _M_KEYS)
            arg, arg_type = _M_ARGS[event["name"]]
            assert isinstance(event["args"].get(arg), arg_type)
            scope = "process" if event["name"].startswith("process") else "thread"
            named.add((scope, event["pid"], event["tid"] if scope == "thread" else 0))
        elif event.get("ph") == "X":
            _check_keys(event, _X_KEYS)
            assert event["ts"] >= 0
            assert event["dur"] >= 0
            complete.append(event)
        else:
            raise AssertionError(f"unexpected phase in {event}")
    for event in complete:
        assert ("process", event["pid"], 0) in named, "every process is named"
        assert ("thread", event["pid"], event["tid"]) in named, "every thread row is named"
    # "X" events on one row must nest or follow each other; viewers drop events
    # that overlap partially.
    rows: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for event in complete:
        rows.setdefault((event["pid"], event["tid"]), []).append(
            (event["ts"], event["ts"] + event["dur"])
        )
    for spans in rows.values():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end - 1e-6, f"overlapping events: one ends at {end}, next at {start}"
    return complete


def test_validator_rejects_what_viewers_reject() -> None:
    good = Trace(
        [
            CollectiveEvent(
                0, "all_reduce", "SUM", "float32", 4, (), GPUS[:2], "x.py:1", "sim", 0.0
            ),
        ]
    ).to_chrome_trace()
    validate_trace_events(good)

    def broken(change: Any) -> None:
        doc = json.loads(json.dumps(good))
        change(doc["traceEvents"])
        with pytest.raises(AssertionError):
            validate_trace_events(doc)

    x_index = next(i for i, e in enumerate(good["traceEvents"]) if e["ph"] == "X")
    broken(lambda evs: evs[x_index].pop("dur"))
    broken(lambda evs: evs[x_index].update(ts="0"))
    broken(lambda evs: evs[x_index].update(pid=True))
    broken(lambda evs: evs[x_index].update(ph="B"))
    broken(lambda evs: evs.append({**evs[x_index], "ts": evs[x_index]["dur"] / 2}))  # overlap
    broken(lambda evs: evs.append({**evs[x_index], "tid": 99}))  # unnamed thread row
    broken(lambda evs: evs[0]["args"].pop("name"))


# --------------------------------------------------------------------------- the demo


def _all_reduce_line() -> int:
    lines, first = inspect.getsourcelines(_demo.run_demo)
    return first + next(i for i, line in enumerate(lines) if "ctx.all_reduce(" in line)


def _traced_demo(**trace_kwargs: Any) -> Trace:
    with pd.trace(**trace_kwargs) as t:
        assert _demo.run_demo(replicas=REPLICAS, steps=STEPS, out=io.StringIO())
    return t


def test_trace_records_every_collective_of_the_demo() -> None:
    t = _traced_demo()
    # Each step all-reduces one nest (grad_w, grad_b, loss_sum): one event per leaf.
    assert t.steps == STEPS
    assert len(t) == 3 * STEPS
    source = f"demo.py:{_all_reduce_line()} in replica_step"
    for step, events in t.by_step().items():
        assert [(e.op, e.reduce_op, e.dtype, e.shape, e.nbytes) for e in events] == [
            ("all_reduce", "SUM", "float32", (_demo.FEATURES,), 4 * _demo.FEATURES),
            ("all_reduce", "SUM", "float32", (), 4),
            ("all_reduce", "SUM", "float32", (), 4),
        ], step
        for e in events:
            assert e.participants == GPUS
            assert e.source == source
            assert e.backend == "sim"
            assert e.duration is None
            assert e.predicted_time is None


def test_chrome_trace_of_the_demo_matches_the_schema(tmp_path: Path) -> None:
    t = _traced_demo(topology="8xH100-NVLink")
    path = tmp_path / "demo.json"
    t.save_chrome_trace(path)
    doc = json.loads(path.read_text(encoding="utf-8"))
    complete = validate_trace_events(doc)
    assert len(complete) == len(t) * REPLICAS  # one event per participating device
    threads = {
        (m["pid"], m["tid"]): m["args"]["name"]
        for m in doc["traceEvents"]
        if m["name"] == "thread_name"
    }
    # The REPLICAS events of one collective share a start; group them by it.
    by_start: dict[float, list[dict[str, Any]]] = {}
    for x in complete:
        assert x["name"] == "all_reduce"
        assert x["args"]["timing"] == "predicted"
        by_start.setdefault(x["ts"], []).append(x)
    assert len(by_start) == len(t)
    for e, (ts, xs) in zip(t.events, sorted(by_start.items())):
        assert {threads[(x["pid"], x["tid"])] for x in xs} == set(GPUS)  # one row per device
        assert {x["args"]["step"] for x in xs} == {e.step}
        # Microseconds: the duration is the predicted seconds times 1e6, and a
        # collective starts no earlier than when it was recorded.
        assert e.predicted_time is not None
        assert all(x["dur"] == pytest.approx(e.predicted_time * 1e6) for x in xs)
        assert ts >= e.start_time * 1e6 - 1e-6


def test_topology_fills_predicted_times_from_the_cost_model() -> None:
    t = _traced_demo(topology="2x8xH100-100Gbps", algorithm="ring")
    assert t.topology == "2x8xH100-100Gbps"
    expected = cost_model.predict_trace(t.events, "2x8xH100-100Gbps", "ring")
    assert [e.predicted_time for e in t.events] == pytest.approx(expected)
    assert all(p is not None and p > 0 for p in (e.predicted_time for e in t.events))
    # Re-pricing on another topology, after the fact.
    t.fill_predicted_times("tpu-v5e-16", overwrite=True)
    assert [e.predicted_time for e in t.events] == pytest.approx(
        cost_model.predict_trace(t.events, "tpu-v5e-16", "ring")
    )


def test_fill_predicted_times_needs_a_topology() -> None:
    t = _traced_demo()
    assert t.topology is None
    with pytest.raises(ValueError, match=r"needs a topology"):
        t.fill_predicted_times()
    t.fill_predicted_times("8xH100-NVLink")
    assert all(e.predicted_time is not None for e in t.events)


def test_unknown_topology_or_algorithm_fails_when_the_trace_starts() -> None:
    with pytest.raises(ValueError, match=r"unknown topology 'nope'; known topologies: 2x8x"):
        pd.trace(topology="nope").__enter__()
    with pytest.raises(ValueError, match=r"unknown algorithm 'fast'"):
        pd.trace(topology="8xH100-NVLink", algorithm="fast").__enter__()
    assert not _trace.is_tracing()


def test_cli_trace_file_matches_the_schema(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cli.json"
    assert main(["demo", "--replicas", "2", "--steps", "2", "--trace", str(path)]) == 0
    capsys.readouterr()
    complete = validate_trace_events(json.loads(path.read_text(encoding="utf-8")))
    assert len(complete) == 3 * 2 * 2


# --------------------------------------------------------------------------- other collectives


def test_strategy_collectives_name_the_user_line() -> None:
    strategy = pd.MirroredStrategy(2)
    per_replica = strategy.run(lambda: np.ones(3, np.float32))
    with pd.trace() as t:
        line = inspect.currentframe().f_lineno  # type: ignore[union-attr]
        strategy.gather(per_replica, axis=0)  # line + 1
        strategy.reduce("SUM", per_replica, axis=None)  # line + 2
        strategy.extended.reduce_to("MEAN", np.ones(2, np.float32), per_replica)  # line + 3
    name = Path(__file__).name
    fn = "test_strategy_collectives_name_the_user_line"
    assert [(e.op, e.source) for e in t.events] == [
        ("gather", f"{name}:{line + 1} in {fn}"),
        ("reduce_to", f"{name}:{line + 2} in {fn}"),
        ("broadcast", f"{name}:{line + 3} in {fn}"),
    ]
    assert t.events[2].nbytes == 8
    assert t.events[2].participants == GPUS[:2]


def test_wall_time_is_recorded_where_timing_is_real() -> None:
    import dataclasses

    import numpy as np

    import polydist as pd
    from polydist_sim import SimBackend

    def step() -> object:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce("SUM", np.ones(4, np.float32))

    sim = SimBackend()
    timed = SimBackend()
    timed.capabilities = dataclasses.replace(timed.capabilities, measured_timing=True)
    with pd.trace() as on_sim:
        pd.MirroredStrategy(2, backend=sim).run(step)
    with pd.trace() as on_timed:
        pd.MirroredStrategy(2, backend=timed).run(step)
    assert [e.duration for e in on_sim.events] == [None]
    (event,) = on_timed.events
    assert event.op == "all_reduce"
    assert event.duration is not None and event.duration >= 0.0
