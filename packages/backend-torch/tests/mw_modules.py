"""A worker of test_modules.py's multi-worker test: torchrun starts two of these.

Each worker has 2 virtual CPU replicas (4 in all), trains a distributed module
with one distributed Adam on its replicas' parts of fixed global batches, and
writes its final weights to ``OUT/worker<rank>.pt``. With ``sync_batch_norm`` the
model has an ``nn.SyncBatchNorm``, whose statistics span all 4 replicas.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import polydist as pd
import polydist_torch

REPLICAS_PER_WORKER = 2
STEPS = 3


def make_model(norm: type[nn.Module] | None = None) -> nn.Module:
    # Each worker its own seed: the variables start from worker 0's values (TF's
    # broadcast), which the single-device reference (no RANK) builds too.
    torch.manual_seed(int(os.environ.get("RANK", "0")))
    if norm is None:
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    # No bias before the norm: its gradient is 0 up to rounding, which Adam would scale
    # up to full steps of noise.
    layers = [nn.Linear(6, 16, bias=False), norm(16), nn.Tanh(), nn.Linear(16, 3)]
    return nn.Sequential(*layers)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
        for _ in range(STEPS)
    ]


def main(out: Path, norm: type[nn.Module] | None) -> None:
    options = pd.experimental.CommunicationOptions(timeout_seconds=150)
    strategy = polydist_torch.MultiWorkerMirroredStrategy(
        communication_options=options, local_devices=REPLICAS_PER_WORKER
    )
    with strategy.scope():
        model = polydist_torch.distribute_module(make_model(norm))
        opt = polydist_torch.distribute_optimizer(torch.optim.Adam(model.parameters(), lr=0.01))

    def step(x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = F.cross_entropy(model(x), y, reduction="sum") / 8
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    replicas = strategy.num_replicas_in_sync
    for batch in batches():
        # Replica r (of all 4) gets the r-th quarter of the global batch.
        parts = strategy.experimental_distribute_values_from_function(
            lambda ctx, batch=batch: tuple(
                t.chunk(replicas)[ctx.replica_id_in_sync_group] for t in batch
            )
        )
        strategy.run(step, args=parts)
    pd.debugging.check_replicas_identical(strategy)
    torch.save(model.state_dict(), out / f"worker{os.environ['RANK']}.pt")
    polydist_torch.shutdown_multi_worker()


if __name__ == "__main__":
    main(Path(sys.argv[1]), nn.SyncBatchNorm if sys.argv[2:] == ["sync_batch_norm"] else None)
