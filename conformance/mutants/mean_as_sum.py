"""all_reduce ignores its op: MEAN is computed as SUM.

The MEAN-from-SUM step lives in core (ReplicaContext.all_reduce): patched
for this backend only.
"""

from __future__ import annotations

from typing import Any

from polydist import ReduceOp
from polydist._base.reduce_op import as_reduce_op
from polydist._strategies.replica_context import ReplicaContext

from ._support import MutantSim, is_mutant

_original = ReplicaContext.all_reduce


def _all_reduce(self: ReplicaContext, reduce_op: Any, value: Any, options: Any = None) -> Any:
    if is_mutant(self.strategy.extended.backend) and as_reduce_op(reduce_op) is ReduceOp.MEAN:
        reduce_op = ReduceOp.SUM
    return _original(self, reduce_op, value, options)


ReplicaContext.all_reduce = _all_reduce  # type: ignore[method-assign]


class MutantBackend(MutantSim):
    pass
