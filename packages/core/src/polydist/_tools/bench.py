"""``polydist bench``: finds the benchmark scripts of a polydist checkout, runs them,
and tabulates their results (``benchmarks/results/*.json``) as ``BenchRow``s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polydist._tools.common import (
    _table,
    _UsageError,
)


@dataclass(frozen=True)
class BenchRow:
    """One ratio from a ``benchmarks/results/*.json`` file."""

    benchmark: str  # the results file's name without .json (e.g. "sim", "torch-cpu")
    case: str
    device: str
    ratio: float
    target: str  # e.g. "<= 3.0", or "" where no target applies to this row
    met: bool | None
    machine: str
    # When the figure was measured (UTC, YYYY-MM-DD): the row's "date", else its file's;
    # "" where neither says.
    date: str = ""


# One clause of a "target" sentence: "ratio_sequential <= 3.0 at 8 replicas",
# "ratio <= 1.1 at 1 replica on CPU"; clauses are separated by ";".
_TARGET_RE = re.compile(
    r"^\s*(?P<key>\w*ratio\w*)\s*(?P<op><=|<|>=|>)\s*(?P<value>\d+(?:\.\d+)?)"
    r"(?:\s+at\s+(?P<replicas>\d+)\s+replicas?)?(?:\s+on\s+(?P<device>[\w.-]+))?"
    r"(?P<rest>.*)$"
)
_COMPARE: dict[str, Callable[[float, float], bool]] = {
    "<=": lambda a, b: a <= b,
    "<": lambda a, b: a < b,
    ">=": lambda a, b: a >= b,
    ">": lambda a, b: a > b,
}


def _machine(payload: dict[str, Any]) -> str:
    """``"x86_64, 2 CPUs, Linux"``: short enough for a table cell."""
    m = payload.get("machine")
    if not isinstance(m, dict):
        return str(m) if m else ""
    parts = [str(m.get("processor") or ""), f"{m['cpu_count']} CPUs" if "cpu_count" in m else ""]
    parts.append(str(m.get("platform") or "").split("-", 1)[0])  # "Linux-6.8.0-...-glibc"
    return ", ".join(p for p in parts if p)


def _is_ratio(key: str, value: Any) -> bool:
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    return numeric and "ratio" in key


def _case_label(row: dict[str, Any], ratio_key: str) -> str:
    words = [v for k, v in row.items() if isinstance(v, str) and k not in ("device", "date")]
    replicas = row.get("replicas")
    if isinstance(replicas, int) and not isinstance(replicas, bool):
        words.append(f"{replicas} replica{'s' if replicas != 1 else ''}")
    for k, v in row.items():
        if isinstance(v, int) and not isinstance(v, bool) and k != "replicas":
            words.append(f"{k}={v}")
    suffix = (
        ratio_key.removeprefix("ratio").strip("_") if ratio_key.startswith("ratio") else ratio_key
    )
    label = ", ".join(words) or "-"
    return f"{label} ({suffix})" if suffix else label


def _rows_from_payload(name: str, payload: dict[str, Any]) -> list[BenchRow]:
    machine = _machine(payload)
    default_device = str(payload.get("device", ""))
    file_date = str(payload.get("date", ""))
    out: list[BenchRow] = []
    # The explicit form: "ratios": [{"case", "device", "ratio", "target", "met"}].
    explicit = payload.get("ratios")
    if isinstance(explicit, list):
        for r in explicit:
            met = r.get("met")
            out.append(
                BenchRow(
                    name,
                    str(r.get("case", "-")),
                    str(r.get("device", default_device)),
                    float(r["ratio"]),
                    str(r.get("target", "")),
                    met if isinstance(met, bool) else None,
                    machine,
                    str(r.get("date", file_date)),
                )
            )
        return out
    # The common form: "rows" with ratio* columns and a "target" sentence.
    clauses = [_TARGET_RE.match(c) for c in str(payload.get("target", "")).split(";")]
    targets = [m.groupdict() for m in clauses if m is not None]
    for row in payload.get("rows", []):
        if not isinstance(row, dict):
            continue
        device = str(row.get("device", default_device))
        replicas = row.get("replicas", payload.get("replicas"))
        for key, value in row.items():
            if not _is_ratio(key, value):
                continue
            target, met = str(row.get("target", "")), row.get("met")
            for t in targets:
                if t["key"] != key:
                    continue
                if t["replicas"] is not None and replicas != int(t["replicas"]):
                    continue
                if t["device"] is not None and t["device"].lower() not in device.lower():
                    continue
                target = f"{t['op']} {t['value']}"
                met = _COMPARE[t["op"]](float(value), float(t["value"]))
                if t["rest"].strip():
                    # A condition we cannot check ("for batches of >= 1 MiB"): show it,
                    # and do not claim the row met or missed the target.
                    target, met = f"{target} {t['rest'].strip()}", None
            out.append(
                BenchRow(
                    name,
                    _case_label(row, key),
                    device,
                    float(value),
                    target,
                    met if isinstance(met, bool) else None,
                    machine,
                    str(row.get("date", file_date)),
                )
            )
    return out


def _matches(name: str, only: str | None) -> bool:
    """``--only torch`` selects bench_torch.py and torch-cpu.json / torch-cuda.json."""
    if only is None:
        return True
    key = only.removesuffix(".py").removesuffix(".json").removeprefix("bench_")
    return name == key or name.startswith(key + "-")


def bench_rows(results_dir: Path, only: str | None = None) -> list[BenchRow]:
    """Every ratio in ``results_dir/*.json`` (optionally only benchmark ``only``).

    Raises ``ValueError`` naming the file when one is not valid JSON.
    """
    rows: list[BenchRow] = []
    for path in sorted(results_dir.glob("*.json")):
        if not _matches(path.stem, only):
            continue
        try:
            payload = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read {path}: {e}") from e
        if isinstance(payload, dict):
            try:
                rows += _rows_from_payload(path.stem, payload)
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"unexpected layout in {path}: {e!r}") from e
    return rows


def _is_benchmarks_dir(path: Path) -> bool:
    return path.is_dir() and (any(path.glob("bench_*.py")) or (path / "results").is_dir())


def find_benchmarks_dir(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """``benchmarks/`` of a polydist checkout: ``explicit``, else the one of the checkout
    this polydist package is installed from (an editable install), else ``None``.

    Never one found from the working directory: `polydist bench` runs the scripts it
    finds, so it must not pick up ``benchmarks/bench_*.py`` of whatever directory (or
    parent directory) it is started in.
    """
    if explicit is not None:
        path = Path(explicit)
        return path if path.is_dir() else None
    return _checkout_benchmarks_dir(Path(__file__).resolve())


def _checkout_benchmarks_dir(module: Path) -> Path | None:
    """``benchmarks/`` of the checkout that holds ``module`` (this file), if it is one."""
    # packages/core/src/polydist/_tools/bench.py -> the checkout's root is five levels up.
    parents = module.parents
    if len(parents) <= 5 or (parents[4].name, parents[3].name) != ("packages", "core"):
        return None  # installed from a wheel: no checkout
    root = parents[5]
    if not (root / "packages" / "core" / "pyproject.toml").is_file():
        return None
    candidate = root / "benchmarks"
    return candidate if _is_benchmarks_dir(candidate) else None


def _add_bench(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="run the benchmarks of a checkout and print the ratio table",
        description="Runs benchmarks/bench_*.py of the polydist checkout this package is "
        "installed from (or of --dir), then prints every ratio in "
        "benchmarks/results/*.json against its target. Exits 1 if a script fails.",
    )
    p.add_argument("--only", metavar="NAME", help="one benchmark, e.g. sim or torch")
    p.add_argument(
        "--no-run", action="store_true", help="do not run the scripts; read existing results"
    )
    p.add_argument(
        "--dir",
        metavar="PATH",
        help="the benchmarks directory (default: that of the checkout polydist is installed from)",
    )
    p.set_defaults(handler=_cmd_bench, parser=p)


def _cmd_bench(args: argparse.Namespace) -> int:
    from polydist.backend._contract import KNOWN_PACKAGES, available_backends

    bench_dir = find_benchmarks_dir(args.dir)
    if bench_dir is None:
        where = (
            f"{args.dir} is not a directory"
            if args.dir
            else "this polydist is not installed from a checkout with a benchmarks/ directory "
            "(pip install -e ./packages/core installs it from one)"
        )
        raise _UsageError(f"{where}. Pass the benchmarks directory: --dir PATH.")
    results = bench_dir / "results"
    scripts = [s for s in sorted(bench_dir.glob("bench_*.py")) if _matches(s.stem[6:], args.only)]
    if (
        args.only is not None
        and not scripts
        and not any(_matches(p.stem, args.only) for p in results.glob("*.json"))
    ):
        names = sorted({s.stem[6:] for s in bench_dir.glob("bench_*.py")})
        names += sorted({p.stem for p in results.glob("*.json")} - set(names))
        raise _UsageError(f"no benchmark named {args.only!r}; known: {', '.join(names) or 'none'}")

    failed: list[str] = []
    if not args.no_run:
        installed = available_backends()
        for script in scripts:
            backend = script.stem[6:]
            if backend in KNOWN_PACKAGES and backend not in installed:
                print(f"== {script.name}: skipped, pip install {KNOWN_PACKAGES[backend]} first")
                continue
            print(f"== running {script.relative_to(bench_dir.parent)}", flush=True)
            done = subprocess.run([sys.executable, str(script)], cwd=bench_dir.parent, check=False)
            if done.returncode != 0:
                failed.append(script.name)
                print(f"== {script.name} failed (exit code {done.returncode})", flush=True)
        if not scripts:
            print(f"no benchmark scripts (bench_*.py) in {bench_dir}")

    try:
        rows = bench_rows(results, args.only)
    except ValueError as e:
        print(f"polydist bench: error: {e}", file=sys.stderr)
        return 1
    print()
    if rows:
        print(f"Benchmark ratios from {results} (the target says which way is better):")
        print("\n".join(_bench_table(rows)))
    else:
        print(f"no results in {results}")
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


def _bench_table(rows: Sequence[BenchRow]) -> list[str]:
    def met(m: bool | None) -> str:
        return "-" if m is None else "yes" if m else "NO"

    def ratio(x: float) -> str:
        return f"{x:.2f}" if math.isfinite(x) else str(x)

    body = [
        [r.benchmark, r.case, r.device, ratio(r.ratio), r.target or "-", met(r.met), r.date or "-"]
        for r in rows
    ]
    headers = ["benchmark", "case", "device", "ratio", "target", "met", "date"]
    return _table(headers, body, right={3})
