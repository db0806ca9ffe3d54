"""Communication trace: a record of every collective polydist issues.

Users write::

    with polydist.trace() as t:
        for batch in dataset:
            strategy.run(train_step, args=(batch,))
    print(t.summary())                    # per-step table
    t.save_chrome_trace("comm.json")      # open in ui.perfetto.dev or chrome://tracing

The core calls the module-level recording functions from every collective:
:func:`is_tracing` first (cheap), then :func:`begin_step` once per
``strategy.run`` call and :func:`record_collective` once per collective.

Recording is process-global: a collective issued on any thread is recorded in
every trace that is active at that moment, so replica threads of the simulator
land in the trace their driver thread opened. Nested traces each record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any

__all__ = [
    "DEFAULT_SKIP_PACKAGES",
    "USER_ROLE_MODULES",
    "CollectiveEvent",
    "Trace",
    "begin_step",
    "capture_collectives",
    "declare_internal_modules",
    "is_tracing",
    "record_collective",
    "trace",
    "user_source_line",
]

_registry_lock = threading.Lock()

#: Top-level modules whose frames are never reported as "the user's call site".
#: Backends add their own packages with `declare_internal_modules`.
DEFAULT_SKIP_PACKAGES: tuple[str, ...] = (
    "polydist",
    "threading",
    "contextlib",
    # Strategy.gather maps over nests with optree: its frames sit between the
    # user's call and the collective.
    "optree",
)

# Packages that backends declared their own internals (`declare_internal_modules`).
_declared_internal: tuple[str, ...] = ()


def declare_internal_modules(*packages: str) -> None:
    """Declares ``packages`` (top-level names, e.g. ``"polydist_jax"``, ``"torch"``) internal
    to a backend: `user_source_line` looks past their frames for the user's call site."""
    global _declared_internal
    for name in packages:
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(
                f"declare_internal_modules takes top-level package names such as "
                f"'polydist_jax', got {name!r}."
            )
    with _registry_lock:
        _declared_internal = _declared_internal + tuple(
            n for n in dict.fromkeys(packages) if n not in _declared_internal
        )


#: Modules inside a skipped package that play the user's role: their frames
#: are reported as call sites (``polydist demo`` traces its own training loop).
USER_ROLE_MODULES: frozenset[str] = frozenset({"polydist._tools.demo"})

#: Chrome-trace duration (µs) given to events that have neither a measured
#: duration nor a predicted time, so they stay visible in the viewer.
PLACEHOLDER_DURATION_US = 1.0


@dataclass(frozen=True)
class CollectiveEvent:
    """One collective operation, as seen by one trace.

    ``nbytes`` is the payload of one participant (what each device contributes
    or receives), not the sum over participants. ``start_time`` is in seconds
    since the trace began (``time.perf_counter`` clock). ``duration`` is the
    measured wall time on real backends and ``None`` on the simulator, where
    ``predicted_time`` (from :mod:`polydist_sim.cost_model`) may be set instead.
    """

    step: int
    op: str
    reduce_op: str | None
    dtype: str
    nbytes: int
    shape: tuple[int, ...]
    participants: tuple[str, ...]
    source: str
    backend: str
    start_time: float
    duration: float | None = None
    predicted_time: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of the fields (tuples become lists)."""
        d = asdict(self)
        d["shape"] = list(self.shape)
        d["participants"] = list(self.participants)
        return d


# --------------------------------------------------------------------------- formatting


def _format_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024.0
        if value < 1024.0 or unit == "TiB":
            break
    return f"{value:.2f} {unit}"


def _format_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s == 0:
        return "0 s"
    if s < 1e-3:
        return f"{s * 1e6:.2f} us"
    if s < 1.0:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.3f} s"


def _format_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]
) -> list[str]:
    widths = [len(h) for h in header]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def fmt(row: Sequence[str]) -> str:
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        ]
        return "  ".join(cells).rstrip()

    lines = [fmt(header), fmt(["-" * w for w in widths])]
    lines.extend(fmt(r) for r in rows)
    return lines


# --------------------------------------------------------------------------- Trace


class Trace:
    """The collectives recorded while a :func:`trace` block was active.

    A ``Trace`` can also be built directly from events (e.g. loaded from disk)
    with ``Trace(events, steps=...)``.

    With ``topology`` (a name from ``polydist_sim.cost_model.TOPOLOGIES`` or a
    ``Topology``), :meth:`fill_predicted_times` prices the events on it; the
    :func:`trace` block does so when it exits.
    """

    def __init__(
        self,
        events: Iterable[CollectiveEvent] = (),
        *,
        steps: int | None = None,
        topology: Any = None,
        algorithm: str = "auto",
    ) -> None:
        self._lock = threading.Lock()
        self._events: list[CollectiveEvent] = list(events)
        # Index of the current step; -1 until the first begin_step(). Events
        # recorded before the first step are filed under step 0.
        self._step = -1 if steps is None else steps - 1
        self._t0 = time.perf_counter()
        # Resolved now so that a bad name fails when the trace starts, not at its end.
        self._topology: Any = None if topology is None else _topology(topology, algorithm)
        self._algorithm = algorithm

    # ------------------------------------------------------------- recording (internal)

    def _begin_step(self) -> None:
        with self._lock:
            self._step += 1

    def _append(self, event_fields: dict[str, Any], now: float, start: float | None) -> None:
        with self._lock:
            t_start = (now if start is None else start) - self._t0
            self._events.append(
                CollectiveEvent(
                    step=max(self._step, 0), start_time=max(t_start, 0.0), **event_fields
                )
            )

    # ------------------------------------------------------------- queries

    @property
    def events(self) -> list[CollectiveEvent]:
        """The recorded events in recording order (a copy)."""
        with self._lock:
            return list(self._events)

    @property
    def steps(self) -> int:
        """Number of steps: ``strategy.run`` calls seen, or more if events say so."""
        with self._lock:
            last_event_step = max((e.step for e in self._events), default=-1)
            return max(self._step, last_event_step) + 1

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)

    def __iter__(self) -> Iterator[CollectiveEvent]:
        return iter(self.events)

    def by_step(self) -> dict[int, list[CollectiveEvent]]:
        """Events grouped by step; every step ``0 .. steps-1`` is a key (maybe empty)."""
        events = self.events
        grouped: dict[int, list[CollectiveEvent]] = {s: [] for s in range(self.steps)}
        for e in events:
            grouped.setdefault(e.step, []).append(e)
        return grouped

    def total_bytes(self) -> int:
        """Sum of ``nbytes`` over events: bytes moved *per participant*."""
        return sum(e.nbytes for e in self.events)

    @property
    def topology(self) -> str | None:
        """Name of the topology the events are priced on, or ``None``."""
        return None if self._topology is None else str(self._topology.name)

    # ------------------------------------------------------------- cost model

    def fill_predicted_times(
        self, topology: Any = None, algorithm: str | None = None, *, overwrite: bool = False
    ) -> None:
        """Sets ``predicted_time`` of the events from the alpha-beta cost model.

        ``topology`` defaults to the trace's own (from ``trace(topology=...)``).
        The trace is re-played on the topology as
        ``polydist_sim.cost_model.predict_trace`` does (scaled to its device
        count, bytes per participant fixed). Events that already have a
        ``predicted_time`` keep it unless ``overwrite``; ops the model does not
        know keep ``None``. Needs ``polydist-sim`` (the model lives there).
        """
        algorithm = self._algorithm if algorithm is None else algorithm
        topo = self._topology if topology is None else _topology(topology, algorithm)
        if topo is None:
            raise ValueError(
                "fill_predicted_times() needs a topology: pass one, or record with "
                "polydist.trace(topology=...)."
            )
        cost_model = _cost_model()
        with self._lock:
            known = [
                i
                for i, e in enumerate(self._events)
                if e.op in cost_model.OPS and (overwrite or e.predicted_time is None)
            ]
            times = cost_model.predict_trace([self._events[i] for i in known], topo, algorithm)
            for i, t in zip(known, times):
                self._events[i] = dataclasses.replace(self._events[i], predicted_time=float(t))

    # ------------------------------------------------------------- Chrome trace

    def to_chrome_trace(self) -> dict[str, Any]:
        """The trace in Chrome trace-event format (ui.perfetto.dev, chrome://tracing).

        One process (``pid``) per backend and one thread row (``tid``) per
        participant device; each collective appears as a complete (``"X"``)
        event on the row of every participating device. Times are in µs.
        Events without a measured ``duration`` use ``predicted_time`` or, if
        that is missing too, a 1 µs placeholder (``args.timing`` says which).
        Such events are laid out one after another on their devices' rows: a
        collective starts at its recorded time or when the previous one on any
        of its devices ends, whichever is later, so predicted durations (longer
        than the simulator's own gaps between collectives) never overlap.
        """
        events = self.events
        pids: dict[str, int] = {}
        tids: dict[tuple[str, str], int] = {}
        out: list[dict[str, Any]] = []
        meta: list[dict[str, Any]] = []
        # End (µs) of the last unmeasured event on each row, for the layout above.
        row_end: dict[tuple[str, str], float] = {}

        for e in events:
            if e.backend not in pids:
                pid = len(pids) + 1
                pids[e.backend] = pid
                meta.append(_meta("process_name", pid, 0, {"name": f"polydist[{e.backend}]"}))
                meta.append(_meta("process_sort_index", pid, 0, {"sort_index": pid}))
            pid = pids[e.backend]
            if e.duration is not None:
                dur_s, timing = e.duration, "measured"
            elif e.predicted_time is not None:
                dur_s, timing = e.predicted_time, "predicted"
            else:
                dur_s, timing = None, "placeholder"
            dur_us = PLACEHOLDER_DURATION_US if dur_s is None else max(dur_s * 1e6, 0.0)
            rows = [(e.backend, d) for d in e.participants or ("(no device)",)]
            ts_us = max(e.start_time * 1e6, 0.0)
            if timing != "measured":
                ts_us = max([ts_us, *(row_end.get(r, 0.0) for r in rows)])
                for r in rows:
                    row_end[r] = ts_us + dur_us
            args: dict[str, Any] = {
                "step": e.step,
                "reduce_op": e.reduce_op,
                "dtype": e.dtype,
                "shape": list(e.shape),
                "bytes": e.nbytes,
                "participants": list(e.participants),
                "source": e.source,
                "backend": e.backend,
                "timing": timing,
                "duration_s": e.duration,
                "predicted_time_s": e.predicted_time,
            }
            for device in e.participants or ("(no device)",):
                key = (e.backend, device)
                if key not in tids:
                    tid = sum(1 for b, _ in tids if b == e.backend) + 1
                    tids[key] = tid
                    meta.append(_meta("thread_name", pid, tid, {"name": device}))
                    meta.append(_meta("thread_sort_index", pid, tid, {"sort_index": tid}))
                out.append(
                    {
                        "name": e.op,
                        "cat": "collective",
                        "ph": "X",
                        "ts": ts_us,
                        "dur": dur_us,
                        "pid": pid,
                        "tid": tids[key],
                        "args": args,
                    }
                )
        return {"traceEvents": meta + out, "displayTimeUnit": "ms"}

    def save_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_chrome_trace` as JSON to ``path``."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_chrome_trace(), f)

    # ------------------------------------------------------------- text summary

    def summary(self) -> str:
        """A per-step plain-text table of the recorded collectives."""
        events = sorted(self.events, key=lambda e: e.step)  # stable: keeps order within a step
        steps = self.steps
        total = sum(e.nbytes for e in events)
        head = (
            f"polydist trace: {len(events)} collective{'s' if len(events) != 1 else ''} "
            f"in {steps} step{'s' if steps != 1 else ''}, "
            f"{_format_bytes(total)} per participant"
        )
        if not events:
            return head + "\n(no collectives recorded)"
        header = [
            "step",
            "op",
            "reduce_op",
            "dtype",
            "shape",
            "bytes",
            "participants",
            "source",
            "wall",
            "predicted",
        ]
        rows = [
            [
                str(e.step),
                e.op,
                e.reduce_op or "-",
                e.dtype,
                str(e.shape),
                _format_bytes(e.nbytes),
                str(len(e.participants)),
                e.source,
                _format_seconds(e.duration),
                _format_seconds(e.predicted_time),
            ]
            for e in events
        ]
        lines = [head, *_format_table(header, rows, right={0, 5, 6, 8, 9})]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return f"<Trace: {len(self)} collectives in {self.steps} steps>"


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


# --------------------------------------------------------------------------- recording API

# Copy-on-write tuple of active traces: readers need no lock.
_active: tuple[Trace, ...] = ()


@contextlib.contextmanager
def trace(topology: Any = None, *, algorithm: str = "auto") -> Iterator[Trace]:
    """Record every collective issued (on any thread) while the block runs.

    Yields a :class:`Trace`; it stays readable after the block exits. Traces
    nest: an inner trace and all enclosing traces record the same collectives,
    each numbering its own steps from 0.

    ``topology`` (e.g. ``"8xH100-NVLink"``, see
    ``polydist_sim.cost_model.TOPOLOGIES``) asks for the cost model's
    ``predicted_time`` of every event on that cluster, filled in when the
    block exits (``algorithm``: ``"ring"``, ``"tree"`` or ``"auto"``). It needs
    ``polydist-sim``; an unknown name raises ``ValueError`` at once.
    """
    global _active
    t = Trace(topology=topology, algorithm=algorithm)
    with _registry_lock:
        _active = (*_active, t)
    try:
        yield t
    finally:
        with _registry_lock:
            _active = tuple(x for x in _active if x is not t)
        if t._topology is not None:
            t.fill_predicted_times()


@contextlib.contextmanager
def capture_collectives() -> Iterator[Trace]:
    """Records the collectives of this block into a new `Trace` of its own, instead of
    the user's traces (a compiling backend replays them on every call of the program).

    Traces are global: other threads recording meanwhile land here too, which only costs
    them those events. A trace the user opens during the block stays open after it.
    """
    global _active
    capture = Trace()
    with _registry_lock:
        saved = _active
        _active = (capture,)
    try:
        yield capture
    finally:
        with _registry_lock:
            opened_meanwhile = tuple(t for t in _active if t is not capture)
            _active = saved + tuple(t for t in opened_meanwhile if t not in saved)


def _cost_model() -> Any:
    """``polydist_sim.cost_model``, imported by name: core does not depend on the sim."""
    try:
        return importlib.import_module("polydist_sim.cost_model")
    except ImportError as e:
        raise ImportError(
            "Predicted times come from polydist_sim.cost_model, which is not installed. "
            "Install it: pip install polydist-sim."
        ) from e


def _topology(topology: Any, algorithm: str) -> Any:
    cost_model = _cost_model()
    if algorithm not in cost_model.ALGORITHMS:
        raise ValueError(
            f"unknown algorithm {algorithm!r}; expected one of {', '.join(cost_model.ALGORITHMS)}"
        )
    return cost_model.get_topology(topology)


def is_tracing() -> bool:
    """Whether any trace is active. Cheap: call it before building event data."""
    return bool(_active)


def begin_step() -> None:
    """Start a new step in every active trace (the core calls it per ``strategy.run``)."""
    for t in _active:
        t._begin_step()


def record_collective(
    op: str,
    *,
    reduce_op: str | None,
    dtype: str,
    nbytes: int,
    shape: Sequence[int],
    participants: Sequence[str],
    backend: str,
    duration: float | None = None,
    predicted_time: float | None = None,
    source: str | None = None,
    start: float | None = None,
) -> None:
    """Record one collective in every active trace; a no-op when none is active.

    ``nbytes`` is bytes per participant. ``start`` is the ``time.perf_counter()``
    value when the collective began; by default it is ``now - duration`` (or
    ``now``). ``source`` defaults to :func:`user_source_line`.
    """
    active = _active
    if not active:
        return
    now = time.perf_counter()
    if start is None and duration is not None:
        start = now - duration
    fields: dict[str, Any] = {
        "op": str(op),
        "reduce_op": None if reduce_op is None else str(reduce_op),
        "dtype": str(dtype),
        "nbytes": int(nbytes),
        "shape": tuple(int(d) for d in shape),
        "participants": tuple(str(p) for p in participants),
        "source": user_source_line() if source is None else source,
        "backend": str(backend),
        "duration": None if duration is None else float(duration),
        "predicted_time": None if predicted_time is None else float(predicted_time),
    }
    for t in active:
        t._append(fields, now, start)


# --------------------------------------------------------------------------- call sites


def _skip_locations(skip: frozenset[str]) -> tuple[str, ...]:
    """Filesystem prefixes (package dirs, module files) of the skipped modules."""
    locations: list[str] = []
    for name in skip:
        mod = sys.modules.get(name)
        file = getattr(mod, "__file__", None)
        if not isinstance(file, str):
            continue
        path = os.path.normcase(os.path.abspath(file))
        if hasattr(mod, "__path__"):  # a package: everything under its directory
            locations.append(os.path.dirname(path) + os.sep)
        else:
            locations.append(path)
    return tuple(locations)


def _is_skipped(frame: FrameType, skip: frozenset[str], locations: tuple[str, ...]) -> bool:
    name = frame.f_globals.get("__name__")
    if name in USER_ROLE_MODULES:
        return False
    if isinstance(name, str) and name.partition(".")[0] in skip:
        return True
    if locations:
        filename = os.path.normcase(os.path.abspath(frame.f_code.co_filename))
        return any(filename == loc or filename.startswith(loc) for loc in locations)
    return False


def user_source_line(
    skip_packages: Iterable[str] | None = None, *, frame: FrameType | None = None
) -> str:
    """``"file.py:LINE in func"`` of the innermost caller outside ``skip_packages``
    (``None``: `DEFAULT_SKIP_PACKAGES` and the packages backends declared internal).

    Walks the stack outward from the caller and returns the first frame whose
    module (by ``__name__``'s top-level package, or by file location) is not
    one of ``skip_packages``. Returns ``"<unknown>"`` if every frame is skipped.
    ``frame`` starts the walk somewhere else (e.g. a paused replica's frame).
    """
    if skip_packages is None:
        skip_packages = DEFAULT_SKIP_PACKAGES + _declared_internal
    skip = frozenset(skip_packages)
    locations = _skip_locations(skip)
    if frame is None:
        frame = sys._getframe(1)
    while frame is not None:
        if not _is_skipped(frame, skip, locations):
            code = frame.f_code
            return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        frame = frame.f_back
    return "<unknown>"
