"""``nn.SyncBatchNorm`` over a strategy's replicas.

torch's ``SyncBatchNorm`` syncs over a ``torch.distributed`` process group, so
the replicas of one process, which share a rank, would each normalize with
their own batch statistics; and under gloo it refuses CPU tensors.
:func:`distribute_module` gives each ``SyncBatchNorm`` layer this subclass
instead: inside ``strategy.run`` with more than one replica in sync, its
training-mode statistics are ``polydist.nn.synchronized_moments`` of every
replica's examples (one ``all_gather`` through the replica context, with its
timeout and diagnosis; across worker processes too), and the running
statistics take torch's update with the global count. Everywhere else
(evaluation, one replica, outside ``run``) it is ``nn.BatchNorm``'s forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import polydist as pd

__all__ = ["ReplicaSyncBatchNorm", "adopt_sync_batch_norms"]


class ReplicaSyncBatchNorm(nn.SyncBatchNorm):
    """An ``nn.SyncBatchNorm`` whose statistics span the replicas in sync (see the module doc)."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickled (torch.save of the module, copy.deepcopy) as the nn.SyncBatchNorm it
        # was, so a saved module loads without polydist. (object.__new__, not
        # copyreg.__newobj__, which insists on the instance's own class.)
        reduced = super().__reduce_ex__(protocol)
        return (object.__new__, (nn.SyncBatchNorm,), *reduced[2:])

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        ctx = pd.get_replica_context()
        if not self.training or ctx is None or ctx.num_replicas_in_sync == 1:
            # Keras' synchronized layer uses the local batch outside replica context.
            out: torch.Tensor = nn.modules.batchnorm._BatchNorm.forward(self, input)
            return out
        self._check_input_dim(input)
        self._check_non_zero_input_channels(input)
        factor = 0.0 if self.momentum is None else self.momentum
        running_mean, running_var = self.running_mean, self.running_var
        tracked = self.num_batches_tracked
        if not self.track_running_stats or running_mean is None or running_var is None:
            running_mean = running_var = tracked = None
        if tracked is not None:
            tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as torch
                factor = 1.0 / float(tracked.item())
        axes = [0, *range(2, input.dim())]
        mean, var, count = pd.nn.synchronized_moments(input, axes, return_count=True)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                # torch keeps the unbiased variance of the (global) batch.
                unbiased = var * count / (count - 1)
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype) * factor)
                running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype) * factor)
        shape = (1, -1) + (1,) * (input.dim() - 2)
        normalized: torch.Tensor = (input - mean.reshape(shape)) * torch.rsqrt(
            var + self.eps
        ).reshape(shape)
        if self.weight is not None:
            normalized = normalized * self.weight.reshape(shape)
        if self.bias is not None:
            normalized = normalized + self.bias.reshape(shape)
        return normalized.to(input.dtype)


def adopt_sync_batch_norms(module: nn.Module, what: str) -> list[str]:
    """Turns ``module``'s ``nn.SyncBatchNorm`` layers into :class:`ReplicaSyncBatchNorm`
    (their class only: the same object, parameters and ``state_dict``; pickled, they are
    ``nn.SyncBatchNorm`` again); returns their names."""
    synced: list[tuple[str, Any]] = [
        (k, m) for k, m in module.named_modules() if isinstance(m, nn.SyncBatchNorm)
    ]
    grouped = [k for k, m in synced if m.process_group is not None]
    if grouped:
        raise ValueError(
            f"{what}: nn.SyncBatchNorm layers {grouped[:5]} name a process_group. Under a "
            "strategy a SyncBatchNorm syncs over all the replicas in sync (as Keras' "
            "BatchNormalization(synchronized=True)), which a subgroup of ranks cannot "
            "express: build them with process_group=None."
        )
    for _, m in synced:
        if type(m) is nn.SyncBatchNorm:
            m.__class__ = ReplicaSyncBatchNorm
        elif not isinstance(m, ReplicaSyncBatchNorm):
            raise TypeError(
                f"{what}: {type(m).__name__} subclasses nn.SyncBatchNorm; polydist syncs "
                "nn.SyncBatchNorm itself across replicas and cannot tell what the subclass "
                "changes. Use nn.SyncBatchNorm, or nn.BatchNorm1d/2d/3d (per-replica "
                "statistics)."
            )
    return [k for k, _ in synced]
