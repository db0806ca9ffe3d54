"""``torch.amp.GradScaler`` under a strategy: one scaler per replica, used as one.

A ``GradScaler`` keeps one state per optimizer (whether its gradients were
unscaled, what its inf check found) and one scale, so replicas sharing one
would mix them up and each replica's ``update()`` would move the scale. TF's
``LossScaleOptimizer``, built under the scope, is one object with per-replica
use; :func:`distribute_grad_scaler` gives torch's loop the same: inside
``strategy.run`` every call reaches the replica's own copy. The copies stay
equal, because a ``DistributedOptimizer`` sums the gradients before a scaler
unscales and checks them, so every replica sees the same infs and skips the
same steps.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

import polydist as pd
from polydist_torch._modules import _local_devices, _replica_index, _strategy_for

__all__ = ["DistributedGradScaler", "distribute_grad_scaler"]


class DistributedGradScaler:
    """A ``torch.amp.GradScaler`` per replica, called as one (see :func:`distribute_grad_scaler`).

    Inside ``strategy.run`` every method and attribute is the replica's own
    scaler's. Outside, ``update()``, ``load_state_dict()`` and the ``set_*``
    methods reach every replica's; the others are replica 0's (the scaler you
    passed), whose state every replica shares.
    """

    def __init__(self, scaler: torch.amp.GradScaler, strategy: pd.Strategy) -> None:
        if isinstance(scaler, DistributedGradScaler):
            raise TypeError(
                f"polydist_torch.distribute_grad_scaler: {scaler!r} is already distributed."
            )
        if not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(
                "polydist_torch.distribute_grad_scaler takes a torch.amp.GradScaler, got "
                f"{type(scaler).__name__}."
            )
        count = len(_local_devices(strategy))
        object.__setattr__(self, "_strategy", strategy)
        object.__setattr__(
            self, "_replicas", (scaler, *(copy.deepcopy(scaler) for _ in range(count - 1)))
        )

    @property
    def replicas(self) -> tuple[torch.amp.GradScaler, ...]:
        """The per-replica scalers, in local replica order (``replicas[0]`` is yours)."""
        replicas: tuple[torch.amp.GradScaler, ...] = self._replicas
        return replicas

    def _current(self) -> torch.amp.GradScaler:
        return self.replicas[_replica_index(self._strategy, "this DistributedGradScaler") or 0]

    def _everyone(self) -> tuple[torch.amp.GradScaler, ...]:
        r = _replica_index(self._strategy, "this DistributedGradScaler")
        return self.replicas if r is None else (self.replicas[r],)

    def scale(self, outputs: Any) -> Any:
        return self._current().scale(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self._current().unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        return self._current().step(optimizer, *args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        for scaler in self._everyone():
            scaler.update(new_scale)

    def get_scale(self) -> float:
        return self._current().get_scale()

    def is_enabled(self) -> bool:
        return self._current().is_enabled()

    def set_growth_factor(self, new_factor: float) -> None:
        for scaler in self._everyone():
            scaler.set_growth_factor(new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        for scaler in self._everyone():
            scaler.set_backoff_factor(new_factor)

    def set_growth_interval(self, new_interval: int) -> None:
        for scaler in self._everyone():
            scaler.set_growth_interval(new_interval)

    def state_dict(self) -> dict[str, Any]:
        """Replica 0's ``state_dict`` (torch's format; every replica holds the same)."""
        return self._current().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads ``state_dict`` into every replica's scaler (outside ``strategy.run``)."""
        for scaler in self._everyone():
            scaler.load_state_dict(copy.deepcopy(state_dict))

    def __getattr__(self, name: str) -> Any:
        # get_growth_factor(), _enabled, ...: the replica's own scaler's.
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._current(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"DistributedGradScaler.{name}: set it through the scaler's methods "
            "(set_growth_factor, load_state_dict, ...), which reach every replica's copy."
        )

    def __repr__(self) -> str:
        return f"DistributedGradScaler({self.replicas[0]!r}, replicas={len(self.replicas)})"


def distribute_grad_scaler(
    scaler: torch.amp.GradScaler, strategy: pd.Strategy | None = None
) -> DistributedGradScaler:
    """One ``torch.amp.GradScaler`` for every replica of ``strategy`` (default: the scope's).

    torch.amp's loop, unchanged, inside the replica function::

        scaler = polydist_torch.distribute_grad_scaler(torch.amp.GradScaler("cuda"))

        def step(x, y):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = pd.nn.compute_average_loss(loss_fn(model(x), y))
            scaler.scale(loss).backward()
            scaler.step(optimizer)      # a DistributedOptimizer: sums, then checks for infs
            scaler.update()
            optimizer.zero_grad()

    Each replica gets its own copy (yours is replica 0's), as TF's
    ``LossScaleOptimizer`` keeps per-replica state behind one object. The
    copies stay equal: the optimizer sums the gradients before a scaler
    unscales and checks them, so every replica skips the same steps and moves
    its scale alike. ``polydist.train.Checkpoint(scaler=scaler)`` saves replica
    0's ``state_dict`` and restores every copy.
    """
    chosen = _strategy_for(strategy, "polydist_torch.distribute_grad_scaler")
    return DistributedGradScaler(scaler, chosen)
