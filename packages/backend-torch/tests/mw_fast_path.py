"""A torch worker for the fast-path tests (test_multi_worker_fast_path.py).

``python mw_fast_path.py OUT MODE`` under ``polydist launch -n 2``, one replica per
worker. Modes:

* ``mismatch``: 5 identical steps (a nest all-reduced: from the third on, the check's
  fast path), then worker 0 repeats the step while worker 1 all-reduces something else;
* ``left``: 5 identical steps, then worker 1 ends while worker 0 repeats the step;
* ``optimizer``: ``distribute_optimizer``'s gradient bucket against sums written by hand;
* ``bucket_mismatch``: 5 training steps (the bucket's sum, from the third on on the fast
  path), then worker 0 trains once more while worker 1 all-reduces something else.

A worker that fails writes ``OUT/error<i>.json`` and exits with code 17; one that
finishes writes ``OUT/done<i>``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

import polydist as pd
import polydist_torch

GLOBAL_BATCH = 8
torch.set_num_threads(1)  # the same sums in the workers and the reference


def _ctx() -> pd.ReplicaContext:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return ctx


def _sums(v: Any) -> Any:
    return _ctx().all_reduce(pd.ReduceOp.SUM, v)  # fast path: the step


def _other(v: Any) -> Any:
    return _ctx().all_reduce(pd.ReduceOp.SUM, v[0][:2])  # fast path: the other call


def steps(strategy: pd.Strategy, rank: int, mode: str) -> None:
    nest = [torch.ones(3, 4) * (rank + 1), torch.ones(4) * (rank + 1)]
    for _ in range(5):
        out = strategy.experimental_local_results(strategy.run(_sums, args=(nest,)))[0]
        assert torch.equal(out[0], torch.full((3, 4), 3.0)), out
    if mode == "left" and rank == 1:
        return
    if mode == "mismatch" and rank == 1:
        strategy.run(_other, args=(nest,))
    else:
        strategy.run(_sums, args=(nest,))


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(GLOBAL_BATCH, 5, generator=g, dtype=torch.float64).float()
    y = torch.randn(GLOBAL_BATCH, 1, generator=g, dtype=torch.float64).float()
    half = GLOBAL_BATCH // 2
    return x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(5, 3)
        self.out = nn.Linear(3, 1)
        self.unused = nn.Linear(2, 2)  # never in the forward: no gradient anywhere

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))  # type: ignore[no-any-return]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def _loss(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).sum() / GLOBAL_BATCH


def optimizer(strategy: pd.Strategy, rank: int, out: Path) -> None:
    """Every step's weights equal a hand-written step on the two shards' summed
    gradients (two workers: gloo's sum is exact-rounded in either order)."""
    with strategy.scope():
        model = polydist_torch.distribute_module(_model())
    opt = polydist_torch.distribute_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    shards = [_data(r) for r in range(2)]
    x, y = shards[rank]
    names = [n for n, _ in model.named_parameters()]
    report: dict[str, Any] = {"same_grad_object": [], "kept_intact": []}

    def reference_step() -> None:
        ref_opt.zero_grad()
        grads = []
        for sx, sy in shards:
            reference.zero_grad()
            _loss(reference, sx, sy).backward()
            grads.append(
                [p.grad.clone() if p.grad is not None else None for p in reference.parameters()]
            )
        for p, g0, g1 in zip(reference.parameters(), *grads, strict=True):
            p.grad = None if g0 is None else g0 + g1
        ref_opt.step()

    def check(step: str) -> None:
        for name, p, q in zip(names, model.parameters(), reference.parameters(), strict=True):
            assert p.dtype == q.dtype and torch.equal(p.detach(), q.detach()), (step, name, p, q)

    kept: dict[str, Any] = {}

    def replica(mode: str) -> Any:
        if mode == "keep":
            opt.zero_grad(set_to_none=False)
        else:
            opt.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        params = list(model.parameters())
        before = [p.grad for p in params]
        opt.step()
        # backward() accumulated into the bucket's own tensors, which step() summed
        # where they are (no copy): p.grad is the same object, now the sum.
        report["same_grad_object"].append(
            [p.grad is b for p, b in zip(params, before, strict=True) if b is not None]
        )
        # A gradient kept from an earlier step keeps its values (fresh memory was taken).
        if kept:
            report["kept_intact"].append(
                [torch.equal(g, v) for g, v in zip(kept["grads"], kept["values"], strict=True)]
            )
        if mode == "hold":
            kept["grads"] = [p.grad for p in params if p.grad is not None]
            kept["values"] = [g.clone() for g in kept["grads"]]
        assert model.unused.weight.grad is None  # no gradient on any worker: stays None
        return loss.detach()

    for step, mode in enumerate(["none", "none", "keep", "hold", "none", "keep"]):
        strategy.run(replica, args=(mode,))
        reference_step()
        check(f"step {step} ({mode})")
    unused = model.unused.weight.detach().clone()
    # A parameter that changes dtype: the bucket is rebuilt (a stale float32 bucket would
    # round the float64 gradients).
    for module in (model, reference):
        for p in module.parameters():
            p.data = p.data.double()
    opt.zero_grad()  # the float32 gradients go too (as for any torch model)
    shards = [(sx.double(), sy.double()) for sx, sy in shards]
    x, y = shards[rank]
    kept.clear()
    for step in range(2):
        strategy.run(replica, args=("keep",))
        reference_step()
        check(f"float64 step {step}")
    assert torch.equal(model.unused.weight.detach(), unused.double())
    (out / f"report{rank}.json").write_text(json.dumps(report))


def bucket_mismatch(strategy: pd.Strategy, rank: int) -> None:
    with strategy.scope():
        model = polydist_torch.distribute_module(_model())
    opt = polydist_torch.distribute_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(rank)

    def train() -> Any:
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()  # fast path: the bucket
        opt.zero_grad()
        return loss.detach()

    for _ in range(5):
        strategy.run(train)
    if rank == 1:
        strategy.run(_other, args=([torch.ones(3, 4)],))
    else:
        strategy.run(train)


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ.get("RANK", "0"))
    try:
        options = pd.experimental.CommunicationOptions(timeout_seconds=300)
        strategy = pd.MultiWorkerMirroredStrategy(
            communication_options=options, local_devices=1, backend="torch"
        )
        if mode == "optimizer":
            optimizer(strategy, rank, out)
        elif mode == "bucket_mismatch":
            bucket_mismatch(strategy, rank)
        else:
            steps(strategy, rank, mode)
        (out / f"done{rank}").write_text(f"{time.time()}")
    except Exception as e:
        (out / f"error{rank}.json").write_text(
            json.dumps(
                {"type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}
            )
        )
        sys.stdout.flush()
        os._exit(17)


if __name__ == "__main__":
    main()
