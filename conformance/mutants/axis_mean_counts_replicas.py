"""reduce(MEAN, value, axis) divides by the replica count instead of the element count.

The axis rule lives in core (Strategy._reduce_with_axis): patched for this
backend only.
"""

from __future__ import annotations

from typing import Any

from polydist import ReduceOp
from polydist._strategies.strategy import Strategy

from ._support import MutantSim, is_mutant

_original = Strategy._reduce_with_axis


def _reduce_with_axis(self: Strategy, reduce_op: ReduceOp, value: Any, axis: Any) -> Any:
    if reduce_op is ReduceOp.MEAN and is_mutant(self.extended.backend):
        total = _original(self, ReduceOp.SUM, value, axis)
        return total / self.num_replicas_in_sync
    return _original(self, reduce_op, value, axis)


Strategy._reduce_with_axis = _reduce_with_axis  # type: ignore[method-assign]


class MutantBackend(MutantSim):
    pass
