"""Torch backend overhead: an MLP training step under strategy.run vs hand-written PyTorch.

The workload is the sim benchmark's MLP (1024 -> 1024 -> 1024 -> 1, ReLU,
float32) with a global batch of 1024 split evenly over the replicas. Each
step: forward and backward on each replica's shard, the gradients all-reduced
(SUM; the loss is already divided by the global batch), an SGD step on every
replica's copy of the model, and the loss reduced to the host.

The baseline does the same arithmetic by hand in one run: the same per-shard
forward/backward on each model copy, the gradients summed in replica order,
the sum copied to every copy, one optimizer step per copy, the losses summed.
So the ratio measures what polydist adds (threads, rendezvous, bookkeeping),
not a different algorithm. With one replica the baseline is the plain loop
(``zero_grad``, ``backward``, ``step``: the sum of one gradient is itself, so
nothing is copied, as polydist's one-replica ``all_reduce`` and ``reduce`` copy
nothing); until 2026-11-27 it copied every gradient twice and the loss to the host
there too, which put polydist's one-replica rows below 1.

Rows: 1 replica (MirroredStrategy and OneDeviceStrategy; target ratio <= 1.10),
N virtual CPU replicas (scaling), and CUDA replicas when CUDA is available.
And memory (``_memory``): peak RSS of a fresh process per contestant whose state
is one float32 variable of ``--memory-mb`` MB and a delta of its size that each of
4 steps adds (1 replica): polydist ``v.assign_add(delta, read_value=False)`` in
``strategy.run`` against hand-written ``x.add_(delta)`` (target <= 1.1); on CUDA
also ``torch.cuda.max_memory_allocated``. ``--memory-only`` measures only that and
updates the memory part of an earlier run's results file.

Writes benchmarks/results/torch-<device>.json (e.g. torch-cpu.json).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _memory
from _common import machine, median_seconds, write_results

import polydist as pd
from polydist_torch import TorchBackend

HIDDEN = 1024
GLOBAL_BATCH = 1024
TARGET_RATIO_ONE_REPLICA = 1.10
# Issue 20: at 8 virtual CPU replicas, the median over interleaved rounds of
# (polydist's step / the hand-written step of the same round).
TARGET_PAIRED_RATIO_EIGHT_REPLICAS = 1.10


def make_model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, 1),
    ).to(device)


class Setup:
    """N model copies, optimizers and data shards, one per replica, on ``devices``."""

    def __init__(self, devices: list[torch.device]) -> None:
        n = len(devices)
        base = make_model(devices[0])
        self.models = [copy.deepcopy(base).to(d) for d in devices]
        self.optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in self.models]
        g = torch.Generator().manual_seed(1)
        x = torch.randn(GLOBAL_BATCH, HIDDEN, generator=g)
        y = torch.randn(GLOBAL_BATCH, 1, generator=g)
        self.xs = [s.to(d) for s, d in zip(x.chunk(n), devices)]
        self.ys = [s.to(d) for s, d in zip(y.chunk(n), devices)]


def shard_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).sum() / GLOBAL_BATCH


def hand_written_step(setup: Setup) -> torch.Tensor:
    if len(setup.models) == 1:
        # One replica: the plain loop a user writes (the sum of one gradient is itself:
        # nothing to copy; polydist's one-replica all_reduce and reduce copy nothing).
        (model,), (opt,), (x,), (y,) = setup.models, setup.optimizers, setup.xs, setup.ys
        model.zero_grad()
        loss = shard_loss(model, x, y)
        loss.backward()
        opt.step()
        if loss.device.type == "cuda":
            torch.cuda.synchronize()
        return loss.detach()
    losses, grads = [], []
    for model, x, y in zip(setup.models, setup.xs, setup.ys):
        model.zero_grad()
        loss = shard_loss(model, x, y)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad for p in model.parameters()])
    with torch.no_grad():
        totals = [g.clone() for g in grads[0]]
        for replica_grads in grads[1:]:
            for t, g in zip(totals, replica_grads):
                t.add_(g.to(t.device))
        for model, opt in zip(setup.models, setup.optimizers):
            for p, t in zip(model.parameters(), totals):
                p.grad = t.to(p.device, copy=True)
            opt.step()
        total_loss = losses[0].to("cpu", copy=True)
        for v in losses[1:]:
            total_loss.add_(v.to("cpu"))
    if total_loss.device.type == "cuda":
        torch.cuda.synchronize()
    return total_loss


def replica_step(model: nn.Module, opt: torch.optim.Optimizer, x: Any, y: Any) -> Any:
    ctx = pd.get_replica_context()
    assert ctx is not None
    model.zero_grad()
    loss = shard_loss(model, x, y)
    loss.backward()
    params = list(model.parameters())
    for p, g in zip(params, ctx.all_reduce("SUM", [p.grad for p in params])):
        p.grad = g
    opt.step()
    return loss.detach()


def strategy_step(strategy: pd.Strategy, args: tuple[Any, ...]) -> Any:
    total = strategy.reduce("SUM", strategy.run(replica_step, args=args), axis=None)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return total


def measure(strategy: pd.Strategy, devices: list[torch.device], repeats: int) -> dict[str, float]:
    hand = Setup(devices)
    under = Setup(devices)
    parts = (under.models, under.optimizers, under.xs, under.ys)
    if isinstance(strategy, pd.OneDeviceStrategy):
        args: tuple[Any, ...] = tuple(p[0] for p in parts)  # TF's OneDevice takes plain values
    else:
        args = tuple(pd.PerReplica(p) for p in parts)
    hand_times, polydist_times = interleaved_times(
        lambda: hand_written_step(hand), lambda: strategy_step(strategy, args), repeats=repeats
    )
    # The ratio uses the fastest of each: on a shared machine the slow samples measure
    # the other processes. The medians are kept for reference.
    return {
        "hand_written_s": min(hand_times),
        "polydist_s": min(polydist_times),
        "ratio": min(polydist_times) / min(hand_times),
        "hand_written_median_s": statistics.median(hand_times),
        "polydist_median_s": statistics.median(polydist_times),
        "ratio_of_medians": statistics.median(polydist_times) / statistics.median(hand_times),
        # Each round times both back to back: load from other processes hits both alike.
        "paired_median_ratio": statistics.median(
            p / h for p, h in zip(polydist_times, hand_times, strict=True)
        ),
    }


def interleaved_times(
    a: Callable[[], Any], b: Callable[[], Any], *, repeats: int, warmup: int = 2
) -> tuple[list[float], list[float]]:
    """Wall times of ``a`` and ``b``, timed in alternation (ABBA...) so that load from
    other processes on a shared machine hits both alike."""
    for _ in range(warmup):
        a()
        b()
    times: dict[int, list[float]] = {0: [], 1: []}
    for i in range(repeats):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for which in order:
            fn = a if which == 0 else b
            start = time.perf_counter()
            fn()
            times[which].append(time.perf_counter() - start)
    return times[0], times[1]


def trivial_run_us_per_replica(strategy: pd.Strategy, device: torch.device, repeats: int) -> float:
    # On the replicas' device: a host tensor would add a copy to the GPU to each run.
    one = torch.ones(1, device=device)

    def step() -> Any:
        return strategy.run(lambda: pd.get_replica_context().all_reduce("SUM", one))

    return median_seconds(step, repeats=repeats) / strategy.num_replicas_in_sync * 1e6


# --------------------------------------------------------------------------- memory

MEMORY_STEPS = 3  # steps after the first


def memory_child(contestant: str, megabytes: int, steps: int) -> None:
    """One contestant in this fresh process (see ``_memory``): the state one float32
    tensor, a delta of the same size (as a gradient is) that each step adds to it.
    ``hand``: ``x.add_(delta)``; ``polydist``: ``v.assign_add(delta,
    read_value=False)`` in ``strategy.run`` (1 replica); ``polydist_read_value``: the
    same with the default ``read_value=True`` (the new value returned: one more copy)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    delta: list[torch.Tensor] = []

    def device_peak() -> int | None:
        return int(torch.cuda.max_memory_allocated(device)) if cuda else None

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    if contestant == "hand":

        def make(size: int) -> Any:
            delta.append(torch.ones(size, device=device))
            x = torch.tensor(np.zeros(size, np.float32), device=device)
            sync()
            return x

        def step(x: Any) -> Any:
            x.add_(delta[0])
            sync()
            return x

        def check(x: Any) -> float:
            return float(x[0])

    else:
        strategy = pd.MirroredStrategy(1, backend=TorchBackend())
        read_value = contestant == "polydist_read_value"

        def make(size: int) -> Any:
            delta.append(torch.ones(size, device=device))
            with strategy.scope():
                v = pd.Variable(np.zeros(size, np.float32))
            sync()
            return v

        def step(v: Any) -> Any:
            strategy.run(lambda: v.assign_add(delta[0], read_value=read_value))
            sync()
            return v

        def check(v: Any) -> float:
            return float(v.values[0].value()[0])  # one element (numpy() copies it all)

    _memory.child(make, step, check, megabytes, steps, device_peak)


def memory(megabytes: int) -> dict[str, Any]:
    result = _memory.compare(__file__, megabytes, dict(os.environ), MEMORY_STEPS)
    default = _memory.compare(
        __file__, megabytes, dict(os.environ), MEMORY_STEPS, ("hand", "polydist_read_value")
    )
    # Not a target: what the default read_value=True (a copy of the new value) costs.
    result["with_read_value_true"] = {
        k: default[k] for k in ("peak_rss_mb", "steps_peak_rss_mb", "ratio", "ratio_steps")
    }
    return result


def memory_row(mem: dict[str, Any], device: str) -> dict[str, Any]:
    return {
        "strategy": f"peak RSS, {mem['variable_mb']} MB variable + a delta of its size, "
        f"assign_add(read_value=False) in strategy.run x {mem['steps']} / hand-written add_",
        "replicas": 1,
        "device": device,
        "memory_ratio": mem["ratio"],
        "memory_ratio_steps": mem["ratio_steps"],
    }


MEMORY_TARGET = f"memory_ratio <= {_memory.TARGET}; memory_ratio_steps <= {_memory.TARGET}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)"
    )
    parser.add_argument("--memory-mb", type=int, default=400)
    parser.add_argument(
        "--memory-child",
        choices=["hand", "polydist", "polydist_read_value"],
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--memory-only",
        action="store_true",
        help="measure memory only and update that part of an earlier run's results file",
    )
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child, args.memory_mb, MEMORY_STEPS)
        return 0
    cuda = torch.cuda.is_available()
    if args.memory_only:
        mem = memory(args.memory_mb)
        name = "torch-" + ("cuda" if cuda else "cpu")
        path = _memory.merge(name, mem, memory_row(mem, "cuda" if cuda else "cpu"))
        data = json.loads(path.read_text())
        if MEMORY_TARGET not in data.get("target", ""):
            data["target"] = f"{data.get('target', '')}; {MEMORY_TARGET}".strip("; ")
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        print(f"wrote {path}")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)

    backend = TorchBackend()
    cpu = torch.device("cpu")
    rows: list[dict[str, Any]] = []

    def record(kind: str, strategy: pd.Strategy, devices: list[torch.device]) -> None:
        row: dict[str, Any] = {
            "strategy": kind,
            "replicas": strategy.num_replicas_in_sync,
            "device": devices[0].type,
            "per_replica_batch": GLOBAL_BATCH // len(devices),
        }
        row.update(measure(strategy, devices, args.repeats))
        row["trivial_run_us_per_replica"] = trivial_run_us_per_replica(strategy, devices[0], 50)
        rows.append(row)
        print(
            f"{kind:18s} {row['replicas']:2d} x {row['device']:4s}  hand-written "
            f"{row['hand_written_s'] * 1e3:8.2f} ms  polydist {row['polydist_s'] * 1e3:8.2f} ms  "
            f"x{row['ratio']:.3f} (medians x{row['ratio_of_medians']:.3f}, paired "
            f"x{row['paired_median_ratio']:.3f})  (trivial run: "
            f"{row['trivial_run_us_per_replica']:.0f} us/replica)",
            flush=True,
        )

    # Warm the process up first (allocator, thread pools, kernel caches): without this
    # the first row measured about twice the later ones.
    warm = Setup([cpu])
    for _ in range(10):
        hand_written_step(warm)
    del warm
    record("OneDeviceStrategy", pd.OneDeviceStrategy("/cpu:0", backend=backend), [cpu])
    for n in args.replicas:
        strategy = pd.MirroredStrategy([f"/cpu:{i}" for i in range(n)], backend=backend)
        record("MirroredStrategy", strategy, [cpu] * n)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        gpu0 = torch.device("cuda", 0)
        record("OneDeviceStrategy", pd.OneDeviceStrategy("/gpu:0", backend=backend), [gpu0])
        for n in sorted({1, gpus}):
            strategy = pd.MirroredStrategy(n, backend=backend)
            record("MirroredStrategy", strategy, [torch.device("cuda", i) for i in range(n)])
        # Without torch.device as a context in the replicas (a torch function mode that
        # every torch call passes through): what TF's placement of factories costs.
        plain = TorchBackend(replica_default_device=False)
        record("OneDevice, no dflt", pd.OneDeviceStrategy("/gpu:0", backend=plain), [gpu0])
        strategy = pd.MirroredStrategy(gpus, backend=plain)
        record("Mirrored, no dflt", strategy, [torch.device("cuda", i) for i in range(gpus)])

    one_cpu = [r for r in rows if r["device"] == "cpu" and r["replicas"] == 1]
    cpu_mirrored = {
        r["replicas"]: r for r in rows if r["device"] == "cpu" and "Mirr" in r["strategy"]
    }
    device_name = torch.cuda.get_device_name(0) if gpus else "cpu"
    mem = memory(args.memory_mb)
    rows.append(memory_row(mem, "cuda" if gpus else "cpu"))
    timing_met = all(r["ratio"] <= TARGET_RATIO_ONE_REPLICA for r in one_cpu) and all(
        r["paired_median_ratio"] <= TARGET_PAIRED_RATIO_EIGHT_REPLICAS
        for n, r in cpu_mirrored.items()
        if n == 8
    )
    payload = {
        "benchmark": "MLP training step: strategy.run + all_reduce(grads) + reduce(loss) "
        "vs hand-written PyTorch doing the same arithmetic",
        "device": device_name,
        "torch": torch.__version__,
        "backend": repr(backend),
        "model": f"MLP {HIDDEN}->{HIDDEN}->{HIDDEN}->1 ReLU float32, SGD",
        "global_batch": GLOBAL_BATCH,
        "machine": machine() | {"torch_threads": torch.get_num_threads()},
        "rows": rows,
        "target": f"ratio <= {TARGET_RATIO_ONE_REPLICA} at 1 replica on CPU; "
        f"paired_median_ratio <= {TARGET_PAIRED_RATIO_EIGHT_REPLICAS} at 8 replicas on CPU; "
        f"{MEMORY_TARGET}",
        "timing_target_met": timing_met,
        "target_met": timing_met and mem["met"],
        "memory": mem,
        "load_average_after": list(os.getloadavg()),
        "cpu_step_time_vs_1_replica": {
            str(n): r["polydist_s"] / cpu_mirrored[1]["polydist_s"]
            for n, r in sorted(cpu_mirrored.items())
            if 1 in cpu_mirrored
        },
    }
    name = "torch-" + ("cuda" if gpus else "cpu")
    path = write_results(name, payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
