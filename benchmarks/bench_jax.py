"""JAX backend overhead: ``strategy.run`` vs the same step hand-written with jax.shard_map.

Workload: the MLP of the sim and torch benchmarks (1024 -> 1024 -> 1024 -> 1,
ReLU, float32), global batch 1024 split over the replicas. One training step
computes per-replica gradients, all-reduces them (MEAN) and applies SGD;
params are explicit inputs and outputs of ``run`` (no variables yet).

* polydist: ``strategy.run(step, (params, x, y))``, params passed as
  ``polydist_jax.replicate(...)`` the first time, then as ``run``'s outputs.
* baseline: ``jax.jit(jax.shard_map(...))`` with ``in_specs=(P(), P("d"), P("d"))``,
  written by hand, params replicated.

Both run in the same process, interleaved step by step (the machine may be
shared, so load hits both alike); we report the median step time of each,
the median of the per-round ratios (target <= 1.05) and the compiles after
the first step (target 0). Also the cost of ``run`` itself: a trivial function,
polydist vs the hand-written jit(shard_map), in microseconds.

``python benchmarks/bench_jax.py`` uses every device of JAX's default
platform; on CPU it sets ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
(8 fake devices) unless XLA_FLAGS already names a count. Writes
``benchmarks/results/jax-<platform>.json``. No timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median_seconds, write_results

import polydist as pd
from polydist_jax import JaxBackend, replicate

# Typed names for the JAX functions that have no annotations (mypy --strict).
P: Callable[..., Any] = PartitionSpec
block: Callable[[Any], Any] = jax.block_until_ready
psum: Callable[..., Any] = jax.lax.psum

HIDDEN = 1024
GLOBAL_BATCH = 1024
LR = 0.01


def init_params(seed: int) -> list[jax.Array]:
    rng = np.random.default_rng(seed)
    scale = np.float32(1 / np.sqrt(HIDDEN))
    shapes = [(HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, 1)]
    return [jnp.asarray(rng.normal(size=s).astype(np.float32) * scale) for s in shapes]


def loss_fn(params: list[Any], x: Any, y: Any) -> Any:
    w1, w2, w3 = params
    h = jax.nn.relu(x @ w1)
    h = jax.nn.relu(h @ w2)
    return jnp.mean((h @ w3 - y) ** 2)


def sgd(params: list[Any], grads: list[Any]) -> list[Any]:
    return [p - LR * g for p, g in zip(params, grads, strict=True)]


def polydist_step(params: list[Any], x: Any, y: Any) -> Any:
    ctx = pd.get_replica_context()
    assert ctx is not None
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return sgd(params, ctx.all_reduce("MEAN", grads)), loss


def hand_written(mesh: Mesh, n: int) -> Any:
    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P("d")))
    def step(params: list[Any], x: Any, y: Any) -> Any:
        # pcast: the gradient of a replicated input would already be summed over replicas.
        varying = jax.lax.pcast(params, "d", to="varying")
        loss, grads = jax.value_and_grad(loss_fn)(varying, x, y)
        grads = [psum(g, "d") / n for g in grads]
        return sgd(params, grads), loss[None]

    return step


def interleaved(a: Any, b: Any, rounds: int) -> tuple[list[float], list[float]]:
    """Wall times of ``a()`` and ``b()``, alternating them (and which goes first) each round,
    so that load from other processes hits both alike."""
    ta: list[float] = []
    tb: list[float] = []
    for i in range(rounds):
        order = ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta))
        for fn, samples in order:
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return ta, tb


def paired_ratio(ta: list[float], tb: list[float]) -> float:
    """Median over rounds of a's time / b's time in the same round."""
    return statistics.median(x / y for x, y in zip(ta, tb, strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15, help="timed MLP steps of each")
    parser.add_argument("--trivial-repeats", type=int, default=300)
    args = parser.parse_args()

    devices = jax.devices()
    n = len(devices)
    platform = devices[0].platform
    backend = JaxBackend()
    strategy = pd.MirroredStrategy(backend=backend)
    mesh = Mesh(np.array(devices), ("d",))

    rng = np.random.default_rng(0)
    x_host = rng.normal(size=(GLOBAL_BATCH, HIDDEN)).astype(np.float32)
    y_host = rng.normal(size=(GLOBAL_BATCH, 1)).astype(np.float32)
    split = NamedSharding(mesh, P("d"))
    x_global, y_global = jax.device_put(x_host, split), jax.device_put(y_host, split)
    # The same device buffers, seen per replica.
    x_pr = pd.PerReplica([s.data for s in x_global.addressable_shards])
    y_pr = pd.PerReplica([s.data for s in y_global.addressable_shards])

    state: dict[str, Any] = {
        "pd": replicate(strategy, init_params(1)),
        "hand": jax.device_put(init_params(1), NamedSharding(mesh, P())),
    }
    hand = hand_written(mesh, n)

    def run_polydist() -> None:
        state["pd"], loss = strategy.run(polydist_step, (state["pd"], x_pr, y_pr))
        block((state["pd"], loss))

    def run_hand() -> None:
        state["hand"], loss = hand(state["hand"], x_global, y_global)
        block((state["hand"], loss))

    start = time.perf_counter()
    run_polydist()
    first_step_s = time.perf_counter() - start
    compiles_first = backend.compile_count
    run_hand()
    pd_times, hand_times = interleaved(run_polydist, run_hand, args.rounds)
    pd_s, hand_s = statistics.median(pd_times), statistics.median(hand_times)
    recompiles = backend.compile_count - compiles_first
    ratio = paired_ratio(pd_times, hand_times)
    print(
        f"{n} x {platform}: MLP step  polydist {pd_s * 1e3:.2f} ms  hand-written "
        f"{hand_s * 1e3:.2f} ms  ratio {ratio:.3f}  recompiles after step 1: {recompiles}"
    )

    # Both computed the same steps from the same start: they must agree.
    for a, b in zip(state["pd"], state["hand"], strict=True):
        first = strategy.experimental_local_results(a)[0]  # one replica: a plain array
        np.testing.assert_allclose(np.asarray(first), np.asarray(b), rtol=1e-4, atol=1e-6)

    # The cost of run itself: a trivial function on one small per-replica array.
    small_global = jax.device_put(np.arange(4 * n, dtype=np.float32), split)
    small_pr = pd.PerReplica([s.data for s in small_global.addressable_shards])

    def trivial(x: Any) -> Any:
        return x + 1

    raw = jax.jit(jax.shard_map(trivial, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    for _ in range(5):  # warm up both (compiles)
        block((strategy.run(trivial, (small_pr,)), raw(small_global)))
    trivial_times = interleaved(
        lambda: block(strategy.run(trivial, (small_pr,))),
        lambda: block(raw(small_global)),
        args.trivial_repeats,
    )
    trivial_pd, trivial_raw = (statistics.median(t) for t in trivial_times)

    def trivial_all_reduce(x: Any) -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce("SUM", x)

    trivial_ar = median_seconds(
        lambda: block(strategy.run(trivial_all_reduce, (small_pr,))),
        repeats=args.trivial_repeats,
        warmup=5,
    )
    overhead_us = (trivial_pd - trivial_raw) * 1e6
    print(
        f"trivial run: polydist {trivial_pd * 1e6:.0f} us, hand-written jit(shard_map) "
        f"{trivial_raw * 1e6:.0f} us, overhead {overhead_us:.0f} us per run; "
        f"with one all_reduce {trivial_ar * 1e6:.0f} us"
    )

    payload = {
        "benchmark": "JAX backend: strategy.run MLP training step vs hand-written "
        "jax.jit(jax.shard_map(...)), same process, interleaved",
        "device": (
            f"{n} x CPU (XLA host platform; fake devices from "
            f"--xla_force_host_platform_device_count, sharing {os.cpu_count()} cores)"
            if platform == "cpu"
            else f"{n} x {devices[0].device_kind} ({platform})"
        ),
        "jax": jax.__version__,
        "machine": machine(),
        "workload": {
            "model": "MLP 1024 -> 1024 -> 1024 -> 1, ReLU, float32, MSE, SGD",
            "global_batch": GLOBAL_BATCH,
            "replicas": n,
        },
        "mlp_step": {
            "polydist_median_s": pd_s,
            "hand_written_median_s": hand_s,
            "ratio": ratio,
            "ratio_definition": "median over rounds of (polydist step / hand-written step), "
            "the two interleaved",
            "ratio_of_medians": pd_s / hand_s,
            "first_step_s_including_compile": first_step_s,
            "compiles_first_step": compiles_first,
            "recompiles_after_first_step": recompiles,
            "rounds": args.rounds,
        },
        "trivial_run": {
            "polydist_us": trivial_pd * 1e6,
            "hand_written_us": trivial_raw * 1e6,
            "overhead_us": overhead_us,
            "with_one_all_reduce_us": trivial_ar * 1e6,
        },
        "target": "ratio <= 1.05 and 0 recompiles after the first step",
        "target_met": bool(ratio <= 1.05 and recompiles == 0),
    }
    path = write_results(f"jax-{platform}", payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
