"""Shared helpers for the benchmark scripts: timing and the results file."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def median_seconds(fn: Callable[[], Any], *, repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn`` over ``repeats`` calls, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def interleaved_medians(
    fns: dict[str, Callable[[], Any]], *, repeats: int, warmup: int = 2
) -> dict[str, float]:
    """Median wall time of each function, calling them in turn each round (after
    ``warmup`` rounds), so that a baseline and what it is compared with see the same
    machine state (clock, caches, other load)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }


def today() -> str:
    """The day a figure is measured (UTC, YYYY-MM-DD): the benchmarks page shows it."""
    return time.strftime("%Y-%m-%d", time.gmtime())


def write_results(name: str, payload: dict[str, Any]) -> Path:
    payload.setdefault("date", today())
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return path
