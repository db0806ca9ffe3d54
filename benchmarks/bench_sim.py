"""Sim overhead: strategy.run + all_reduce + reduce per step vs a plain NumPy loop.

Two workloads, each computing per-replica gradients that are all-reduced,
with the loss reduced to the host:

* ``linear``: least squares, 128 examples x 1024 features per replica
  (a light step: ~0.05 ms of NumPy per replica, so polydist's overhead shows);
* ``mlp``: the JAX/torch benchmarks' MLP (1024 -> 1024 -> 1024 -> 1, ReLU)
  with a per-replica batch of 1024 / replicas (at least 8 examples).

The baseline is the same arithmetic written as a NumPy loop over replicas,
with the same (sequential) summation order, in the same run: each round calls
the plain loop and the sim in both orders in turn, and each time is the
median over rounds (so that all see the same clock, caches and load). We
also report the cost of a trivial ``run`` with one ``all_reduce``, per
replica, and the reduction alone (``sum_replicas`` of the linear workload's
gradient and loss) at each replica count, against the plain loop's ``+``.

Targets (issues 2 and 20): the light linear step with the default (exact)
reduction at most 3x the plain loop at 8 replicas (goal 1.5x); linear growth
(the reduction's cost per replica at N replicas at most 1.5x its cost at 8).
``--before FILE`` embeds the rows of an earlier results file (the same script
run on the code before a change, on the same machine) as ``before``.
Writes benchmarks/results/sim.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved_medians, machine, median_seconds, today, write_results

import polydist as pd
from polydist_sim import SimBackend, sum_replicas

FEATURES = 1024
LINEAR_BATCH = 128
HIDDEN = 1024
MLP_GLOBAL_BATCH = 1024


def linear_data(n: int) -> tuple[list[Any], list[Any], np.ndarray]:
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(LINEAR_BATCH, FEATURES)).astype(np.float32) for _ in range(n)]
    ys = [rng.normal(size=LINEAR_BATCH).astype(np.float32) for _ in range(n)]
    w = rng.normal(size=FEATURES).astype(np.float32)
    return xs, ys, w


def linear_grads(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[list[Any], Any]:
    err = x @ w - y
    return [x.T @ err], np.sum(err * err)


def mlp_data(n: int) -> tuple[list[Any], list[Any], list[np.ndarray]]:
    rng = np.random.default_rng(0)
    batch = max(8, MLP_GLOBAL_BATCH // n)
    xs = [rng.normal(size=(batch, HIDDEN)).astype(np.float32) for _ in range(n)]
    ys = [rng.normal(size=(batch, 1)).astype(np.float32) for _ in range(n)]
    scale = np.float32(1 / np.sqrt(HIDDEN))
    params = [
        rng.normal(size=(HIDDEN, HIDDEN)).astype(np.float32) * scale,
        rng.normal(size=(HIDDEN, HIDDEN)).astype(np.float32) * scale,
        rng.normal(size=(HIDDEN, 1)).astype(np.float32) * scale,
    ]
    return xs, ys, params


def mlp_grads(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[list[Any], Any]:
    w1, w2, w3 = params
    h1 = np.maximum(x @ w1, 0)
    h2 = np.maximum(h1 @ w2, 0)
    err = h2 @ w3 - y
    d3 = h2.T @ err
    e2 = (err @ w3.T) * (h2 > 0)
    d2 = h1.T @ e2
    e1 = (e2 @ w2.T) * (h1 > 0)
    d1 = x.T @ e1
    return [d1, d2, d3], np.sum(err * err)


WORKLOADS = {"linear": (linear_data, linear_grads), "mlp": (mlp_data, mlp_grads)}


def plain_loop(grads_fn: Any, params: Any, xs: list[Any], ys: list[Any]) -> Any:
    per_replica = [grads_fn(params, x, y) for x, y in zip(xs, ys)]
    totals = [g.copy() for g in per_replica[0][0]]
    for grads, _ in per_replica[1:]:
        totals = [t + g for t, g in zip(totals, grads)]
    copies = [[t.copy() for t in totals] for _ in per_replica]  # every replica holds the sum
    loss = per_replica[0][1]
    for _, replica_loss in per_replica[1:]:
        loss = loss + replica_loss
    return copies, loss


def strategy_step(strategy: pd.Strategy, grads_fn: Any, params: Any, xs: Any, ys: Any) -> Any:
    def fn(x: np.ndarray, y: np.ndarray) -> Any:
        grads, loss = grads_fn(params, x, y)
        ctx = pd.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce("SUM", grads), loss

    grads, losses = strategy.run(fn, args=(xs, ys))
    return grads, strategy.reduce("SUM", losses, axis=None)


def plain_sum(values: list[np.ndarray]) -> np.ndarray:
    total = values[0].copy()
    for v in values[1:]:
        total = total + v
    return total


def reduction_rows(replicas: list[int], repeats: int) -> list[dict[str, Any]]:
    """``sum_replicas`` of the linear workload's gradient (1024 float32) and loss
    (a float32 scalar), per order, against the plain loop's ``+`` of the same values."""
    rows = []
    base: dict[str, float] = {}
    for n in replicas:
        if n < 2:
            continue
        rng = np.random.default_rng(n)
        grads = list(rng.normal(size=(n, FEATURES)).astype(np.float32))
        losses = list(rng.normal(size=n).astype(np.float32) ** 2)
        fns = {"plain": lambda: (plain_sum(grads), plain_sum(losses))}
        for order in ("sequential", "exact"):
            fns[order] = lambda o=order: (sum_replicas(grads, o), sum_replicas(losses, o))
        times = interleaved_medians(fns, repeats=repeats * 10 if n <= 64 else repeats * 3)
        row: dict[str, Any] = {"workload": "reduction only", "replicas": n}
        row["plain_numpy_s"] = times["plain"]
        for order in ("sequential", "exact"):
            row[f"sum_{order}_s"] = times[order]
            per_replica = times[order] / n
            base.setdefault(order, per_replica)  # the first (smallest) count, normally 8
            row[f"ratio_{order}_per_replica_vs_{replicas_base(replicas)}"] = (
                per_replica / base[order]
            )
        rows.append(row)
        print(
            f"reduction {n:4d} replicas  plain {times['plain'] * 1e6:9.1f} us  "
            f"sequential {times['sequential'] * 1e6:9.1f} us  "
            f"exact {times['exact'] * 1e6:9.1f} us  "
            f"({times['exact'] / n * 1e6:.2f} us per replica)",
            flush=True,
        )
    return rows


def replicas_base(replicas: list[int]) -> int:
    return min(n for n in replicas if n >= 2)


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.CalledProcessError):
        return ""
    return out.stdout.strip()


def trivial_step(strategy: pd.Strategy) -> Any:
    return strategy.run(lambda: pd.get_replica_context().all_reduce("SUM", np.float32(1)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, nargs="*", default=[1, 8, 64, 512])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    parser.add_argument("--before", type=Path, help="results of the code before a change")
    parser.add_argument("--out", type=Path, help="write here instead of benchmarks/results/")
    args = parser.parse_args()

    rows = []
    for workload in args.workloads:
        make_data, grads_fn = WORKLOADS[workload]
        for n in args.replicas:
            if workload == "mlp" and n > 64:
                continue  # 512 replicas of 4 MB gradients need ~8 GB for the copies alone
            xs, ys, params = make_data(n)
            repeats = max(3, args.repeats if n <= 64 else args.repeats // 3)
            xs_d, ys_d = pd.PerReplica(xs), pd.PerReplica(ys)
            strategies = {
                order: pd.MirroredStrategy(n, backend=SimBackend(order))
                for order in ("sequential", "exact")
            }
            times = interleaved_medians(
                {
                    "plain": lambda: plain_loop(grads_fn, params, xs, ys),
                    **{
                        order: lambda s=s: strategy_step(s, grads_fn, params, xs_d, ys_d)
                        for order, s in strategies.items()
                    },
                },
                repeats=repeats,
            )
            baseline = times["plain"]
            row: dict[str, Any] = {"workload": workload, "replicas": n, "plain_numpy_s": baseline}
            for order in strategies:
                row[f"sim_{order}_s"] = times[order]
                row[f"ratio_{order}"] = times[order] / baseline
            rows.append(row)
            print(
                f"{workload:6s} {n:4d} replicas  plain {baseline * 1e3:9.2f} ms  "
                f"sim(sequential) {row['sim_sequential_s'] * 1e3:9.2f} ms "
                f"x{row['ratio_sequential']:.2f}  "
                f"sim(exact) {row['sim_exact_s'] * 1e3:9.2f} ms x{row['ratio_exact']:.2f}",
                flush=True,
            )

    reduction = reduction_rows(args.replicas, args.repeats)
    rows += reduction

    overhead = {}
    for n in args.replicas:
        strategy = pd.MirroredStrategy(n, backend=SimBackend("sequential"))
        per_run = median_seconds(lambda: trivial_step(strategy), repeats=max(5, args.repeats))
        overhead[str(n)] = per_run / n * 1e6
        print(
            f"trivial run with one all_reduce, {n:4d} replicas: {overhead[str(n)]:.1f} us/replica"
        )

    def growth(workload: str, order: str = "sequential") -> float | None:
        by_n = {r["replicas"]: r for r in rows if r["workload"] == workload}
        largest = max(by_n, default=0)
        if 8 not in by_n or largest <= 8:
            return None
        # Ratio at the largest replica count vs at 8: ~1.0 means cost grows linearly.
        return float(by_n[largest][f"ratio_{order}"] / by_n[8][f"ratio_{order}"])

    base = replicas_base(args.replicas)
    payload: dict[str, Any] = {
        "benchmark": "sim run + all_reduce + reduce per step vs plain NumPy loop",
        "device": "CPU (NumPy simulator)",
        "machine": machine(),
        "commit": git_commit(),
        "notes": "ratio = sim time / plain NumPy loop time, medians over rounds that call "
        "the plain loop and the sim in both orders in turn. 'reduction only' rows time "
        "sum_replicas of one gradient (1024 float32) and one loss per replica; their ratio "
        f"is the cost per replica relative to {base} replicas (1.0 = linear growth). "
        "The machine is shared: compare ratios measured in one run, not absolute times "
        "across runs.",
        "rows": rows,
        "trivial_run_us_per_replica": overhead,
        "ratio_growth_from_8_to_most_replicas": {
            w: {order: growth(w, order) for order in ("sequential", "exact")}
            for w in args.workloads
        },
        "target": "ratio_exact <= 3.0 at 8 replicas; ratio_sequential <= 3.0 at 8 replicas; "
        f"ratio_exact_per_replica_vs_{base} <= 1.5; goal: ratio_exact 1.5 at 8 replicas",
        "target_met_at_8": {
            r["workload"]: bool(r["ratio_exact"] <= 3.0)
            for r in rows
            if r["replicas"] == 8 and "ratio_exact" in r
        },
    }
    if args.before is not None:
        before = json.loads(args.before.read_text(encoding="utf-8"))
        payload["before"] = {
            "commit": before.get("commit", ""),
            "notes": "the same script on the code before the change, same machine, just before",
            "rows": before.get("rows", []),
            "trivial_run_us_per_replica": before.get("trivial_run_us_per_replica", {}),
        }
    if args.out is None:
        path = write_results("sim", payload)
    else:
        path = args.out
        payload.setdefault("date", today())
        path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    print(f"wrote {path}")
    for workload in args.workloads:
        for order in ("sequential", "exact"):
            g = growth(workload, order)
            if g is not None:
                print(f"{workload} ({order}): ratio at the most replicas / at 8 = {g:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
