"""Tests for polydist._collectives.trace: recording, steps, call sites, Chrome JSON, summary."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import types
from typing import Any

import pytest

from polydist._collectives import trace as _trace
from polydist._collectives.trace import (
    CollectiveEvent,
    Trace,
    begin_step,
    declare_internal_modules,
    is_tracing,
    record_collective,
    trace,
    user_source_line,
)


def _record(op: str = "all_reduce", **kw: Any) -> None:
    args: dict[str, Any] = {
        "reduce_op": "SUM",
        "dtype": "float32",
        "nbytes": 16,
        "shape": (4,),
        "participants": ("/sim:0", "/sim:1"),
        "backend": "sim",
        "source": "x.py:1 in f",
    }
    args.update(kw)
    record_collective(op, **args)


def _event(**kw: Any) -> CollectiveEvent:
    fields: dict[str, Any] = {
        "step": 0,
        "op": "all_reduce",
        "reduce_op": "SUM",
        "dtype": "float32",
        "nbytes": 16,
        "shape": (4,),
        "participants": ("/sim:0", "/sim:1"),
        "source": "x.py:1 in f",
        "backend": "sim",
        "start_time": 0.0,
    }
    fields.update(kw)
    return CollectiveEvent(**fields)


# --------------------------------------------------------------------------- activation


def test_not_tracing_by_default_and_record_is_a_noop() -> None:
    assert not is_tracing()
    _record()  # must not raise
    begin_step()
    assert not is_tracing()


def test_trace_activates_and_deactivates() -> None:
    with trace() as t:
        assert is_tracing()
        _record()
    assert not is_tracing()
    assert len(t) == 1
    _record()  # after exit: not recorded
    assert len(t) == 1


def test_trace_deactivates_on_exception() -> None:
    with pytest.raises(RuntimeError, match="boom"), trace():
        raise RuntimeError("boom")
    assert not is_tracing()


def test_nested_traces_both_record_with_their_own_steps() -> None:
    with trace() as outer:
        begin_step()
        _record("all_reduce")
        with trace() as inner:
            begin_step()
            _record("all_gather")
        begin_step()
        _record("broadcast")
    assert [e.op for e in outer.events] == ["all_reduce", "all_gather", "broadcast"]
    assert [e.step for e in outer.events] == [0, 1, 2]
    assert [e.op for e in inner.events] == ["all_gather"]
    assert [e.step for e in inner.events] == [0]
    assert outer.steps == 3
    assert inner.steps == 1


def test_step_counter_restarts_in_each_trace() -> None:
    for _ in range(2):
        with trace() as t:
            for _ in range(3):
                begin_step()
                _record()
                _record("reduce_to")
        assert [e.step for e in t.events] == [0, 0, 1, 1, 2, 2]
        assert t.steps == 3


def test_events_before_first_step_belong_to_step_zero() -> None:
    with trace() as t:
        _record("broadcast")
        begin_step()
        _record("all_reduce")
        _record("reduce", reduce_op="MEAN")  # after run(), before the next run()
        begin_step()
    assert [e.step for e in t.events] == [0, 0, 0]
    assert t.steps == 2
    assert t.by_step() == {0: t.events, 1: []}


def test_empty_trace() -> None:
    with trace() as t:
        pass
    assert t.steps == 0
    assert t.events == []
    assert t.total_bytes() == 0
    assert t.by_step() == {}
    assert t.to_chrome_trace() == {"traceEvents": [], "displayTimeUnit": "ms"}


def test_recording_from_many_threads() -> None:
    n_threads, per_thread = 8, 50
    barrier = threading.Barrier(n_threads)

    def worker(i: int) -> None:
        barrier.wait()
        for _ in range(per_thread):
            _record(participants=(f"/sim:{i}",))

    with trace() as t:
        begin_step()
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert len(t) == n_threads * per_thread
    assert {e.participants[0] for e in t.events} == {f"/sim:{i}" for i in range(n_threads)}
    assert all(e.step == 0 for e in t.events)


def test_fields_are_recorded_and_coerced() -> None:
    with trace() as t:
        begin_step()
        record_collective(
            "all_gather",
            reduce_op=None,
            dtype="bfloat16",
            nbytes=1024,
            shape=[2, 256],
            participants=["/gpu:0", "/gpu:1", "/gpu:2"],
            backend="torch",
            duration=2.5e-4,
            predicted_time=1e-4,
            source="train.py:7 in step",
        )
    (e,) = t.events
    assert e.op == "all_gather"
    assert e.reduce_op is None
    assert e.dtype == "bfloat16"
    assert e.nbytes == 1024
    assert e.shape == (2, 256)
    assert e.participants == ("/gpu:0", "/gpu:1", "/gpu:2")
    assert e.backend == "torch"
    assert e.duration == 2.5e-4
    assert e.predicted_time == 1e-4
    assert e.source == "train.py:7 in step"
    assert e.start_time >= 0.0
    assert e.to_dict()["shape"] == [2, 256]


def test_start_time_is_relative_and_monotonic() -> None:
    with trace() as t:
        _record()
        _record()
    first, second = t.events
    assert 0.0 <= first.start_time <= second.start_time < 60.0


def test_event_is_frozen() -> None:
    e = _event()
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.step = 3  # type: ignore[misc]


def test_total_bytes_and_by_step() -> None:
    t = Trace(
        [_event(step=0, nbytes=100), _event(step=0, nbytes=20), _event(step=2, nbytes=3)],
        steps=4,
    )
    assert t.total_bytes() == 123
    assert t.steps == 4
    grouped = t.by_step()
    assert list(grouped) == [0, 1, 2, 3]
    assert [e.nbytes for e in grouped[0]] == [100, 20]
    assert grouped[1] == []
    assert [e.nbytes for e in grouped[2]] == [3]


def test_steps_cover_events_beyond_begin_step_count() -> None:
    assert Trace([_event(step=5)]).steps == 6


# --------------------------------------------------------------------------- call sites


def test_source_is_the_callers_line() -> None:
    with trace() as t:
        line = sys._getframe().f_lineno + 1
        record_collective("all_reduce", reduce_op="SUM", dtype="float32", nbytes=4, shape=(), participants=("/sim:0",), backend="sim")  # fmt: skip  # noqa: E501
    (e,) = t.events
    assert e.source == f"test_trace.py:{line} in test_source_is_the_callers_line"


def _fake_module(name: str, filename: str, source: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__file__ = filename
    exec(compile(source, filename, "exec"), mod.__dict__)
    return mod


_FAKE_BACKEND_SRC = """
from polydist._collectives.trace import record_collective

def all_reduce(nbytes):
    return _inner(nbytes)

def _inner(nbytes):
    record_collective("all_reduce", reduce_op="SUM", dtype="float32", nbytes=nbytes,
                      shape=(1,), participants=("/sim:0", "/sim:1"), backend="sim")
"""


def test_source_skips_backend_package_frames() -> None:
    # A backend's package is internal once the backend declares it so.
    fake = _fake_module(
        "fake_backend_pkg._fake_backend", "/nowhere/_fake_backend.py", _FAKE_BACKEND_SRC
    )
    with trace() as before:
        fake.all_reduce(8)
    assert before.events[0].source == "_fake_backend.py:8 in _inner"
    declare_internal_modules("fake_backend_pkg")
    with trace() as t:
        line = sys._getframe().f_lineno + 1
        fake.all_reduce(8)
    (e,) = t.events
    assert e.source == f"test_trace.py:{line} in test_source_skips_backend_package_frames"


def test_declare_internal_modules_takes_top_level_names() -> None:
    with pytest.raises(ValueError, match="top-level package names"):
        declare_internal_modules("fake_backend_pkg.sub")


def test_source_skips_threading_frames_but_finds_user_function_in_thread() -> None:
    declare_internal_modules("fake_jax_pkg")
    fake = _fake_module("fake_jax_pkg._fake_backend", "/nowhere/_fake_jax.py", _FAKE_BACKEND_SRC)
    lines: list[int] = []

    def replica_fn() -> None:
        lines.append(sys._getframe().f_lineno + 1)
        fake.all_reduce(8)

    with trace() as t:
        th = threading.Thread(target=replica_fn)
        th.start()
        th.join()
    (e,) = t.events
    assert e.source == f"test_trace.py:{lines[0]} in replica_fn"


def test_user_source_line_custom_skip_packages() -> None:
    helper = _fake_module(
        "mylib.helpers",
        "/nowhere/helpers.py",
        "from polydist._collectives.trace import user_source_line\n"
        "def where(skip):\n"
        "    return user_source_line(skip_packages=skip)\n",
    )
    line = sys._getframe().f_lineno + 1
    got = helper.where(("mylib",))
    assert got == f"test_trace.py:{line} in test_user_source_line_custom_skip_packages"
    # Without skipping mylib, its own frame is the answer.
    assert helper.where(()) == "helpers.py:3 in where"


def test_user_source_line_skips_by_file_location() -> None:
    # A frame without a polydist __name__ but whose file is inside the polydist package.
    pkg_dir = _trace.__file__.rsplit("trace.py", 1)[0]
    mod = types.ModuleType("not_polydist")
    src = (
        "from polydist._collectives.trace import user_source_line\n"
        "def f():\n    return user_source_line()\n"
    )
    exec(compile(src, pkg_dir + "_virtual.py", "exec"), mod.__dict__)
    line = sys._getframe().f_lineno + 1
    got = mod.f()
    assert got == f"test_trace.py:{line} in test_user_source_line_skips_by_file_location"


def test_user_source_line_direct_call() -> None:
    line = sys._getframe().f_lineno + 1
    got = user_source_line()
    assert got == f"test_trace.py:{line} in test_user_source_line_direct_call"


# --------------------------------------------------------------------------- Chrome trace

_PH_VALUES = {"X", "M"}
_META_NAMES = {"process_name", "thread_name", "process_sort_index", "thread_sort_index"}


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def validate_chrome_trace(doc: object) -> None:
    """A small schema check for the Chrome trace-event JSON we emit."""
    assert isinstance(doc, dict)
    assert set(doc) == {"traceEvents", "displayTimeUnit"}
    assert doc["displayTimeUnit"] in ("ms", "ns")
    events = doc["traceEvents"]
    assert isinstance(events, list)
    named_processes: set[int] = set()
    named_threads: set[tuple[int, int]] = set()
    complete: list[dict[str, Any]] = []
    for ev in events:
        assert isinstance(ev, dict)
        for key in ("name", "ph", "pid", "tid", "args"):
            assert key in ev, f"missing {key!r} in {ev}"
        assert ev["ph"] in _PH_VALUES
        assert isinstance(ev["name"], str)
        assert ev["name"]
        assert isinstance(ev["pid"], int)
        assert not isinstance(ev["pid"], bool)
        assert isinstance(ev["tid"], int)
        assert not isinstance(ev["tid"], bool)
        assert isinstance(ev["args"], dict)
        if ev["ph"] == "M":
            assert ev["name"] in _META_NAMES
            assert set(ev) == {"name", "ph", "pid", "tid", "args"}
            if ev["name"] == "process_name":
                assert isinstance(ev["args"]["name"], str)
                named_processes.add(ev["pid"])
            elif ev["name"] == "thread_name":
                assert isinstance(ev["args"]["name"], str)
                named_threads.add((ev["pid"], ev["tid"]))
            else:
                assert isinstance(ev["args"]["sort_index"], int)
        else:
            assert set(ev) == {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"}
            assert ev["cat"] == "collective"
            assert _is_number(ev["ts"])
            assert ev["ts"] >= 0
            assert _is_number(ev["dur"])
            assert ev["dur"] >= 0
            args = ev["args"]
            assert isinstance(args["step"], int)
            assert args["step"] >= 0
            assert isinstance(args["dtype"], str)
            assert isinstance(args["bytes"], int)
            assert args["bytes"] >= 0
            assert args["reduce_op"] is None or isinstance(args["reduce_op"], str)
            assert isinstance(args["participants"], list)
            assert all(isinstance(p, str) for p in args["participants"])
            assert isinstance(args["source"], str)
            assert args["timing"] in ("measured", "predicted", "placeholder")
            complete.append(ev)
    # Every process and thread row that carries events has a name.
    for ev in complete:
        assert ev["pid"] in named_processes
        assert (ev["pid"], ev["tid"]) in named_threads


def _sample_trace() -> Trace:
    return Trace(
        [
            _event(step=0, start_time=0.5, duration=None, predicted_time=2e-6),
            _event(
                step=0,
                op="all_gather",
                reduce_op=None,
                start_time=0.75,
                duration=3e-3,
                participants=("/gpu:0", "/gpu:1"),
                backend="torch",
                shape=(2, 3),
            ),
            _event(
                step=1, op="broadcast", reduce_op=None, start_time=1.0, participants=("/sim:1",)
            ),
        ]
    )


def test_chrome_trace_validates_and_has_expected_content() -> None:
    doc = _sample_trace().to_chrome_trace()
    validate_chrome_trace(doc)
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    # One complete event per participating device.
    assert len(xs) == 2 + 2 + 1
    sim_pid = next(
        e["pid"]
        for e in doc["traceEvents"]
        if e["name"] == "process_name" and e["args"]["name"] == "polydist[sim]"
    )
    torch_pid = next(
        e["pid"]
        for e in doc["traceEvents"]
        if e["name"] == "process_name" and e["args"]["name"] == "polydist[torch]"
    )
    assert sim_pid != torch_pid
    threads = {
        (e["pid"], e["args"]["name"]): e["tid"]
        for e in doc["traceEvents"]
        if e["name"] == "thread_name"
    }
    assert set(threads) == {
        (sim_pid, "/sim:0"),
        (sim_pid, "/sim:1"),
        (torch_pid, "/gpu:0"),
        (torch_pid, "/gpu:1"),
    }
    ar = [e for e in xs if e["name"] == "all_reduce"]
    assert [e["tid"] for e in ar] == [threads[(sim_pid, "/sim:0")], threads[(sim_pid, "/sim:1")]]
    assert ar[0]["ts"] == pytest.approx(0.5e6)
    assert ar[0]["dur"] == pytest.approx(2.0)  # predicted 2 µs
    assert ar[0]["args"]["timing"] == "predicted"
    ag = next(e for e in xs if e["name"] == "all_gather")
    assert ag["dur"] == pytest.approx(3000.0)  # measured 3 ms
    assert ag["args"]["timing"] == "measured"
    assert ag["args"]["shape"] == [2, 3]
    bc = next(e for e in xs if e["name"] == "broadcast")
    assert bc["dur"] == _trace.PLACEHOLDER_DURATION_US
    assert bc["args"]["timing"] == "placeholder"
    assert bc["args"]["step"] == 1
    assert bc["tid"] == threads[(sim_pid, "/sim:1")]


def test_chrome_trace_of_live_recording_validates() -> None:
    with trace() as t:
        for _ in range(3):
            begin_step()
            _record(duration=1e-5)
            _record("broadcast", reduce_op=None, participants=())
    validate_chrome_trace(t.to_chrome_trace())


def test_save_chrome_trace_json_round_trip(tmp_path: Any) -> None:
    t = _sample_trace()
    path = tmp_path / "trace.json"
    t.save_chrome_trace(path)
    loaded = json.loads(path.read_text(encoding="utf-8"))
    validate_chrome_trace(loaded)
    assert loaded == json.loads(json.dumps(t.to_chrome_trace()))
    t.save_chrome_trace(str(tmp_path / "again.json"))
    assert json.loads((tmp_path / "again.json").read_text(encoding="utf-8")) == loaded


def test_validator_rejects_bad_documents() -> None:
    good = _sample_trace().to_chrome_trace()
    bad_ph = json.loads(json.dumps(good))
    bad_ph["traceEvents"][-1]["ph"] = "Q"
    with pytest.raises(AssertionError):
        validate_chrome_trace(bad_ph)
    bad_ts = json.loads(json.dumps(good))
    bad_ts["traceEvents"][-1]["ts"] = -1.0
    with pytest.raises(AssertionError):
        validate_chrome_trace(bad_ts)
    no_meta = {
        "traceEvents": [e for e in good["traceEvents"] if e["ph"] == "X"],
        "displayTimeUnit": "ms",
    }
    with pytest.raises(AssertionError):
        validate_chrome_trace(no_meta)


# --------------------------------------------------------------------------- summary


def test_summary_exact() -> None:
    t = Trace(
        [
            _event(
                step=0,
                op="all_reduce",
                reduce_op="SUM",
                dtype="float32",
                nbytes=4096,
                shape=(32, 32),
                participants=("/sim:0", "/sim:1"),
                source="train.py:12 in step_fn",
                predicted_time=1.5e-5,
            ),
            _event(
                step=0,
                op="reduce_to",
                reduce_op="MEAN",
                dtype="float32",
                nbytes=4,
                shape=(),
                participants=("/sim:0", "/sim:1"),
                source="train.py:20 in main",
            ),
            _event(
                step=1,
                op="all_gather",
                reduce_op=None,
                dtype="int64",
                nbytes=3 * 2**20,
                shape=(393216,),
                participants=("/gpu:0", "/gpu:1", "/gpu:2", "/gpu:3"),
                source="train.py:12 in step_fn",
                backend="torch",
                duration=2.5e-3,
            ),
        ]
    )
    expected = "\n".join(
        [
            "polydist trace: 3 collectives in 2 steps, 3.00 MiB per participant",
            "step  op          reduce_op  dtype    shape         bytes  participants  source                     wall  predicted",  # noqa: E501
            "----  ----------  ---------  -------  ---------  --------  ------------  ----------------------  -------  ---------",  # noqa: E501
            "   0  all_reduce  SUM        float32  (32, 32)   4.00 KiB             2  train.py:12 in step_fn        -   15.00 us",  # noqa: E501
            "   0  reduce_to   MEAN       float32  ()              4 B             2  train.py:20 in main           -          -",  # noqa: E501
            "   1  all_gather  -          int64    (393216,)  3.00 MiB             4  train.py:12 in step_fn  2.50 ms          -",  # noqa: E501
        ]
    )
    assert t.summary() == expected
    assert str(t) == expected
    assert repr(t) == "<Trace: 3 collectives in 2 steps>"


def test_summary_empty() -> None:
    assert Trace().summary() == (
        "polydist trace: 0 collectives in 0 steps, 0 B per participant\n(no collectives recorded)"
    )


def test_summary_singular_and_large_units() -> None:
    t = Trace([_event(nbytes=5 * 2**30, duration=1.25)])
    first, _, _, row = t.summary().splitlines()
    assert first == "polydist trace: 1 collective in 1 step, 5.00 GiB per participant"
    assert row.endswith("5.00 GiB             2  x.py:1 in f  1.250 s          -")


def _record_bytes(nbytes: int) -> None:
    record_collective(
        "all_reduce",
        reduce_op="SUM",
        dtype="float32",
        nbytes=nbytes,
        shape=(1,),
        participants=("/sim:0", "/sim:1"),
        backend="sim",
    )


def test_capture_collectives_takes_the_events_from_the_users_traces() -> None:
    from polydist.backend.tracing import capture_collectives

    with trace() as user:
        _record_bytes(4)
        with capture_collectives() as captured:
            _record_bytes(8)
            with trace() as opened_inside:  # opened during the capture: stays open after
                _record_bytes(12)
        _record_bytes(16)
    assert [e.nbytes for e in captured.events] == [8, 12]
    assert [e.nbytes for e in user.events] == [4, 16]
    assert [e.nbytes for e in opened_inside.events] == [12]
    assert not is_tracing()
