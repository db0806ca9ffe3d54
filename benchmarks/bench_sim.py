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
replica.

Target (issue 2): at most 3x the plain loop at 8 replicas, linear growth.
Writes benchmarks/results/sim.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved_medians, machine, median_seconds, write_results

import polydist as pd
from polydist_sim import SimBackend

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


def trivial_step(strategy: pd.Strategy) -> Any:
    return strategy.run(lambda: pd.get_replica_context().all_reduce("SUM", np.float32(1)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, nargs="*", default=[1, 8, 64, 512])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
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

    overhead = {}
    for n in args.replicas:
        strategy = pd.MirroredStrategy(n, backend=SimBackend("sequential"))
        per_run = median_seconds(lambda: trivial_step(strategy), repeats=max(5, args.repeats))
        overhead[str(n)] = per_run / n * 1e6
        print(
            f"trivial run with one all_reduce, {n:4d} replicas: {overhead[str(n)]:.1f} us/replica"
        )

    def growth(workload: str) -> float | None:
        by_n = {r["replicas"]: r for r in rows if r["workload"] == workload}
        largest = max(by_n, default=0)
        if 8 not in by_n or largest <= 8:
            return None
        # Ratio at the largest replica count vs at 8: ~1.0 means cost grows linearly.
        return float(by_n[largest]["ratio_sequential"] / by_n[8]["ratio_sequential"])

    payload = {
        "benchmark": "sim run + all_reduce + reduce per step vs plain NumPy loop",
        "device": "CPU (NumPy simulator)",
        "machine": machine(),
        "notes": "ratio = sim time / plain NumPy loop time, medians over rounds that call "
        "the plain loop and the sim in both orders in turn.",
        "rows": rows,
        "trivial_run_us_per_replica": overhead,
        "ratio_growth_from_8_to_most_replicas": {w: growth(w) for w in args.workloads},
        "target": "ratio_sequential <= 3.0 at 8 replicas; ratio growth about 1 (linear)",
        "target_met_at_8": {
            r["workload"]: bool(r["ratio_sequential"] <= 3.0) for r in rows if r["replicas"] == 8
        },
    }
    path = write_results("sim", payload)
    print(f"wrote {path}")
    for workload in args.workloads:
        g = growth(workload)
        if g is not None:
            print(f"{workload}: ratio at the most replicas / at 8 = {g:.2f} (1.0 = linear growth)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
