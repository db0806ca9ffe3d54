"""Peak memory of a training step, polydist against hand-written code, one fresh
process per contestant (shared by bench_jax.py and bench_torch.py).

Each contestant runs in its own new Python process (``script --memory-child NAME
--memory-mb N``), so that nothing one allocated, cached or compiled shows up in
the other's figures. The child:

1. makes its state, one float32 array of ``N`` MB, from ``np.zeros`` (its pages
   are untouched until copied, so the state's own bytes are what is resident),
   waits for it to be made and drops the host array;
2. notes the peak RSS so far (``created_peak``: imports and making the state) and
   the RSS now (``state``);
3. resets the kernel's peak-RSS mark (``/proc/self/clear_refs``, Linux) and runs
   ``steps + 1`` training steps, the first of which compiles, waiting for each;
4. prints one JSON line: those figures, the peak RSS over the steps
   (``VmHWM`` since the reset, ``steps_peak``), the process's own peak
   (``ru_maxrss``) and, on a GPU, the device's peak bytes in use.

The ratios are polydist / hand-written for the process peak and for the steps'
peak; the target applies to both.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import RESULTS, today

TARGET = 1.1  # peak memory, polydist / hand-written with donation or in-place updates


def _status_kb(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def _max_rss_kb() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _reset_peak() -> bool:
    try:  # Linux: "5" resets the peak RSS (VmHWM) to the current RSS
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def child(
    make_state: Callable[[int], Any],
    step: Callable[[Any], Any],
    check: Callable[[Any], float],
    megabytes: int,
    steps: int,
    device_peak: Callable[[], int | None] = lambda: None,
) -> None:
    """One contestant, in this fresh process: prints its figures as one JSON line.

    ``make_state(size)`` makes and returns the state from ``np.zeros(size,
    float32)``, made (waited for); ``step(state)`` runs one training step (adds 1 to
    every element) and returns the state, waited for; ``check(state)`` reads one
    element back; ``device_peak()`` is the accelerator's peak bytes in use, or None.
    """
    size = megabytes * 1024 * 1024 // 4
    state = make_state(size)
    created_peak = _status_kb("VmHWM") or _max_rss_kb()
    resident = _status_kb("VmRSS")
    reset = _reset_peak()
    for _ in range(steps + 1):
        state = step(state)
    steps_peak = _status_kb("VmHWM") if reset else None
    value = check(state)
    if value != steps + 1:
        raise AssertionError(f"after {steps + 1} steps of +1 the state holds {value}")
    report = {
        "created_peak_kb": created_peak,
        "state_kb": resident,
        "steps_peak_kb": steps_peak,
        "peak_kb": _max_rss_kb(),
        "device_peak_bytes": device_peak(),
    }
    print(json.dumps(report))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def compare(
    script: str,
    megabytes: int,
    env: dict[str, str],
    steps: int,
    contestants: tuple[str, str] = ("hand", "polydist"),
) -> dict[str, Any]:
    """Runs each contestant in a fresh process; their figures in MB and the ratios."""
    figures: dict[str, dict[str, Any]] = {}
    for name in contestants:
        out = subprocess.run(
            [sys.executable, script, "--memory-child", name, "--memory-mb", str(megabytes)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if out.returncode:
            raise RuntimeError(f"memory child {name!r} failed:\n{out.stderr[-4000:]}")
        figures[name] = json.loads(out.stdout.strip().splitlines()[-1])
    hand, pd_ = (figures[c] for c in contestants)

    def mb(key: str) -> dict[str, float | None]:
        return {c: (f[key] / 1024 if f[key] is not None else None) for c, f in figures.items()}

    ratio = _ratio(pd_["peak_kb"], hand["peak_kb"])
    steps_ratio = _ratio(pd_["steps_peak_kb"], hand["steps_peak_kb"])
    device_ratio = _ratio(pd_["device_peak_bytes"], hand["device_peak_bytes"])
    gated = [r for r in (ratio, steps_ratio, device_ratio) if r is not None]
    result: dict[str, Any] = {
        "variable_mb": megabytes,
        "steps": steps + 1,
        "peak_rss_mb": mb("peak_kb"),
        "created_peak_rss_mb": mb("created_peak_kb"),
        "state_rss_mb": mb("state_kb"),
        "steps_peak_rss_mb": mb("steps_peak_kb"),
        "steps_growth_mb": {
            c: (f["steps_peak_kb"] - f["state_kb"]) / 1024
            if f["steps_peak_kb"] is not None and f["state_kb"] is not None
            else None
            for c, f in figures.items()
        },
        "ratio": ratio,
        "ratio_steps": steps_ratio,
        "target": f"<= {TARGET} (process peak RSS and peak RSS over the steps"
        + (", device peak bytes" if device_ratio is not None else "")
        + ")",
        "met": bool(gated) and all(r <= TARGET for r in gated),
    }
    if device_ratio is not None:
        result["device_peak_mb"] = {c: f["device_peak_bytes"] / 2**20 for c, f in figures.items()}
        result["ratio_device"] = device_ratio
    print(
        f"memory, {megabytes} MB state, 1 replica, {steps + 1} steps: peak RSS "
        f"{contestants[1]} {pd_['peak_kb'] / 1024:.0f} MB, {contestants[0]} "
        f"{hand['peak_kb'] / 1024:.0f} MB, ratio {ratio:.3f}; over the steps: "
        f"ratio {steps_ratio if steps_ratio is None else round(steps_ratio, 3)}"
        + (f"; device peak ratio {device_ratio:.3f}" if device_ratio is not None else "")
    )
    return result


def merge(name: str, memory: dict[str, Any], row: dict[str, Any]) -> Path:
    """Puts ``memory`` and its ratio ``row`` (replacing an older one: a row whose
    ``case`` or ``strategy`` starts with "peak RSS") into the results file ``name`` of
    an earlier full run, keeping that run's other figures, and recomputes its
    ``target_met`` (the timing targets' ``timing_target_met`` and the memory one)."""
    path = RESULTS / f"{name}.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data["memory"] = memory
    key = "ratios" if "ratios" in data else "rows"
    # The memory figures are measured now, the file's others earlier.
    data[key] = [r for r in data.get(key, []) if not is_memory_row(r)] + [row | {"date": today()}]
    data.setdefault("timing_target_met", data.get("target_met", True))
    data["target_met"] = bool(data["timing_target_met"]) and bool(memory["met"])
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def is_memory_row(row: dict[str, Any]) -> bool:
    return str(row.get("case") or row.get("strategy") or "").startswith("peak RSS")
