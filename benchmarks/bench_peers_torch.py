"""polydist's torch backend beside Lightning Fabric, Hugging Face Accelerate and
hand-written PyTorch, training the same MLP in the same run.

Workload (the MLP of the issue's peer comparison): 512 -> 512 -> 512 -> 1, ReLU,
biases, float32, mean squared error, SGD (lr 0.01), batch 1024, CPU, one replica
per process. Contestants, each with its own copy of the same initial model,
interleaved round by round (rotating which goes first; the machine may be shared,
so load hits all alike). The rounds are split between ``--trials`` trials, each
with fresh contestants made in a rotated order: where a contestant's tensors
land in memory moved its step by up to 1% on the test machine, more than any
framework's own cost here, so no contestant keeps one layout's luck:

* ``hand``: plain PyTorch: forward, ``loss.backward()``, ``optimizer.step()``,
  ``optimizer.zero_grad()``;
* ``polydist``: ``polydist_torch.distribute_module`` + ``distribute_optimizer``
  under ``pd.MirroredStrategy(["/cpu:0"], backend="torch")``, the step inside
  ``strategy.run`` and the loss through ``strategy.reduce``, as docs/frameworks/torch.md
  does it;
* ``fabric``: ``lightning.fabric.Fabric(accelerator="cpu", devices=1)``,
  ``fabric.setup(model, optimizer)``, ``fabric.backward(loss)``;
* ``accelerate``: ``accelerate.Accelerator(cpu=True)``,
  ``accelerator.prepare(model, optimizer)``, ``accelerator.backward(loss)``.

With ``--device cuda`` every contestant trains on the first GPU (polydist on
``/gpu:0``; Fabric with ``accelerator="cuda"``; Accelerate on its default device),
each step waits for the GPU before its time is taken, and one more contestant runs:
``polydist_no_default``, polydist with ``TorchBackend(replica_default_device=False)``
(no default-device function mode in the replica: see docs/backends/torch.md).
Results go to ``torch-peers-cuda.json``.

The same contestants then train a 32 -> 32 -> 32 -> 1 MLP on batches of 32
(``--small-rounds``): a step of a few hundred microseconds, where what each
framework adds per step (its fixed host cost) is most of the difference, which
the 512-wide step's 17-20 ms hide below its noise.

Fabric and Accelerate are optional (benchmark-only dependencies, never the
packages'): a missing one is skipped and said so; ``nox -s bench-torch`` installs
both. Each ratio is the median over rounds of (a's step / b's step in the same
round). After the timed rounds every contestant has made the same steps from the
same start, so their weights are checked to agree. Writes
``benchmarks/results/torch-peers-cpu.json`` (without torch and polydist-torch it
only says so and exits 0). No timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, write_results

import polydist as pd

try:
    import torch
    from torch import nn

    import polydist_torch
except ImportError as e:  # `polydist bench` runs every script: say why, do not fail
    print(f"bench_peers_torch.py: skipped, {e.name} is not installed (pip install polydist-torch)")
    raise SystemExit(0) from None

FEATURES = HIDDEN = 512
GLOBAL_BATCH = 1024
LR = 0.01
STEP_TARGET = 1.02  # polydist's step / the hand-written step (issue 20 item 2)
# The same step on a tiny MLP, where the frameworks' fixed cost per step is the step.
SMALL_WIDTH = SMALL_BATCH = 32


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, 1),
    )


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum() / GLOBAL_BATCH


Step = Callable[[], torch.Tensor]
DEVICE = torch.device("cpu")  # --device


def hand_contestant(base: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[Step, nn.Module]:
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> torch.Tensor:
        loss = mse(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step, model


def polydist_contestant(
    base: nn.Module, x: torch.Tensor, y: torch.Tensor, default_device: bool = True
) -> tuple[Step, nn.Module]:
    backend: Any = "torch"
    if not default_device:
        backend = polydist_torch.TorchBackend(replica_default_device=False)
    where = "/gpu:0" if DEVICE.type == "cuda" else "/cpu:0"
    strategy = pd.MirroredStrategy([where], backend=backend)
    with strategy.scope():
        model = polydist_torch.distribute_module(copy.deepcopy(base))
        opt = polydist_torch.distribute_optimizer(torch.optim.SGD(model.parameters(), lr=LR))

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = mse(model(x), y)
        loss.backward()
        opt.step()  # sums the gradients across replicas (here one), then steps
        opt.zero_grad()
        return loss.detach()

    def step() -> torch.Tensor:
        per_replica = strategy.run(train_step, args=(x, y))
        return strategy.reduce("SUM", per_replica, axis=None)  # type: ignore[no-any-return]

    return step, model


def fabric_contestant(
    base: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> tuple[Step, nn.Module] | None:
    try:
        from lightning.fabric import Fabric  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        try:
            from lightning_fabric import Fabric  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            return None
    fabric = Fabric(accelerator=DEVICE.type, devices=1)
    model = copy.deepcopy(base)
    wrapped, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))

    def step() -> torch.Tensor:
        loss = mse(wrapped(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step, model


def accelerate_contestant(
    base: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> tuple[Step, nn.Module] | None:
    try:
        from accelerate import Accelerator  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    accelerator = Accelerator(cpu=DEVICE.type == "cpu")
    model = copy.deepcopy(base)
    wrapped, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))

    def step() -> torch.Tensor:
        loss = mse(wrapped(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step, model


def interleaved(fns: dict[str, Step], rounds: int) -> dict[str, list[float]]:
    """Wall times of each function, calling them in turn each round (rotating which
    goes first), so that load from other processes hits all alike."""
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    cuda = DEVICE.type == "cuda"
    for i in range(rounds):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            start = time.perf_counter()
            fns[name]()
            if cuda:  # the step's time is the GPU's too
                torch.cuda.synchronize()
            samples[name].append(time.perf_counter() - start)
    return samples


def paired_ratio(ta: list[float], tb: list[float]) -> float:
    """Median over rounds of a's time / b's time in the same round."""
    return statistics.median(a / b for a, b in zip(ta, tb, strict=True))


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except ImportError:
        return None
    return str(mod.__version__)


def workload(
    width: int, batch: int, rounds: int, args: argparse.Namespace, skipped: list[str]
) -> dict[str, Any]:
    """Every contestant trains the MLP of this width and batch: ``rounds`` interleaved
    rounds in ``args.trials`` trials; the result rows and what the JSON keeps."""
    device = device_label()
    global FEATURES, HIDDEN, GLOBAL_BATCH
    FEATURES = HIDDEN = width
    GLOBAL_BATCH = batch
    base = make_model().to(DEVICE)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH, FEATURES, generator=g).to(DEVICE)
    y = torch.randn(GLOBAL_BATCH, 1, generator=g).to(DEVICE)

    makers: dict[str, Callable[..., tuple[Step, nn.Module] | None]] = {
        "hand": hand_contestant,
        "polydist": polydist_contestant,
        "fabric": fabric_contestant,
        "accelerate": accelerate_contestant,
    }
    if DEVICE.type == "cuda":
        makers["polydist_no_default"] = lambda b, x, y: polydist_contestant(
            b, x, y, default_device=False
        )
    times: dict[str, list[float]] = {}
    # Per trial: each contestant's rounds, and the ratios of that trial alone.
    trials: list[dict[str, Any]] = []
    order = list(makers)
    per_trial = max(1, rounds // args.trials)
    for trial in range(args.trials):
        # Fresh contestants each trial, made in a rotated order: where each one's
        # tensors land in memory moves a step by up to 1% (measured), more than the
        # frameworks' own costs, so no contestant keeps one layout's luck.
        k = trial % len(order)
        contestants: dict[str, tuple[Step, nn.Module]] = {}
        for name in order[k:] + order[:k]:
            if name in skipped:
                continue
            made = makers[name](base, x, y)
            if made is None:
                skipped.append(name)
                print(f"{name}: not installed, skipped (nox -s bench-torch installs it)")
            else:
                contestants[name] = made
        fns = {name: contestants[name][0] for name in order if name in contestants}
        for _ in range(args.warmup):
            for fn in fns.values():
                fn()
        got = interleaved(fns, per_trial)
        for name, t in got.items():
            times.setdefault(name, []).extend(t)
        trials.append(
            {
                "made_in_order": [n for n in order[k:] + order[:k] if n in contestants],
                "rounds": per_trial,
                "to_hand": {n: paired_ratio(t, got["hand"]) for n, t in got.items() if n != "hand"},
            }
        )

        # Every contestant made the same steps from the same start: the same weights.
        reference = [p.detach() for p in contestants["hand"][1].parameters()]
        for name, (_, model) in contestants.items():
            params = [p.detach() for p in model.parameters()]
            assert len(params) == len(reference), name
            for p, r in zip(params, reference, strict=True):
                torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-6, msg=f"{name} diverged")
        del contestants, fns

    # Rounds of every trial pooled: each ratio is the median of a's step / b's step
    # over all rounds (paired within a round).
    medians = {name: statistics.median(t) for name, t in times.items()}
    to_hand = {n: paired_ratio(t, times["hand"]) for n, t in times.items() if n != "hand"}
    to_peers = {
        f"polydist_vs_{peer}": paired_ratio(times["polydist"], times[peer])
        for peer in ("fabric", "accelerate")
        if peer in times
    }
    for done in trials:
        print(
            f"trial (made {', '.join(done['made_in_order'])}): "
            + ", ".join(f"{n} x{r:.4f}" for n, r in done["to_hand"].items())
        )
    for name in times:
        extra = f"  x{to_hand[name]:.3f} of hand-written" if name in to_hand else ""
        print(f"{device}: MLP {width} step  {name:10s} {medians[name] * 1e3:7.3f} ms{extra}")
    for name, ratio in to_peers.items():
        print(f"MLP {width}: {name}: x{ratio:.3f}")

    label = "MLP 512 step" if width == 512 else f"MLP {width} step (batch {batch}: the fixed cost)"
    ratios: list[dict[str, Any]] = []
    for name, ratio in to_hand.items():
        row: dict[str, Any] = {
            "case": f"{label}, {name} / hand-written PyTorch",
            "device": device,
            "ratio": ratio,
        }
        if name == "polydist" and width == 512 and DEVICE.type == "cpu":
            row["target"] = f"<= {STEP_TARGET}"
            row["met"] = bool(ratio <= STEP_TARGET)
        ratios.append(row)
    for name, ratio in to_peers.items():
        ratios.append(
            {
                "case": f"{label}, {name.replace('_vs_', ' / ')}",
                "device": device,
                "ratio": ratio,
                "target": "<= 1.0",
                "met": bool(ratio <= 1.0),
            }
        )
    return {
        "rows": ratios,
        "median_s": medians,
        "rounds": per_trial * args.trials,
        "trials": trials,
    }


def device_label() -> str:
    if DEVICE.type == "cuda":
        return f"1 x {torch.cuda.get_device_name(DEVICE)}"
    return "1 x CPU"


def main() -> int:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=800)
    parser.add_argument("--small-rounds", type=int, default=4000)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--trials",
        type=int,
        default=4,
        help="fresh contestants this many times, made in a rotated order; the rounds "
        "are split between them",
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where every contestant trains (cuda: the first GPU)",
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_peers_torch.py: --device cuda, but torch sees no CUDA device")
        return 1
    DEVICE = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)

    skipped: list[str] = []
    big = workload(512, 1024, args.rounds, args, skipped)
    small = workload(SMALL_WIDTH, SMALL_BATCH, args.small_rounds, args, skipped)
    ratios = big["rows"] + small["rows"]
    payload = {
        "benchmark": "MLP training step (512 -> 512 -> 512 -> 1, batch 1024, SGD, float32, "
        f"1 {args.device.upper()} replica): polydist's torch backend (distribute_module + "
        "distribute_optimizer in strategy.run) beside Lightning Fabric, Hugging Face "
        "Accelerate and hand-written PyTorch, interleaved in one run; ratio: median over "
        "rounds of a's step / b's step, the rounds of every trial (fresh contestants, "
        "made in a rotated order) pooled; "
        "'small': the same on a 32-wide MLP, batch 32 (the fixed cost per step)",
        "device": args.device if args.device == "cpu" else device_label(),
        "torch": torch.__version__,
        "lightning": _version("lightning") or _version("lightning_fabric"),
        "accelerate": _version("accelerate"),
        "skipped": skipped,
        "median_s": big["median_s"],
        "rounds": big["rounds"],
        "trials": big["trials"],
        "small": {k: v for k, v in small.items() if k != "rows"}
        | {"width": SMALL_WIDTH, "batch": SMALL_BATCH},
        "machine": machine() | {"torch_threads": torch.get_num_threads()},
        "load_average_after": list(os.getloadavg()),
        "ratios": ratios,
    }
    path = write_results(f"torch-peers-{args.device}", payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
