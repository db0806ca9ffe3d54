"""A SyncOnReadVariable read in cross-replica context gives replica 0's copy, not the SUM/MEAN.

The rule lives in core (``SyncOnReadVariable._cross_replica_value``):
patched for this backend only.
"""

from __future__ import annotations

from typing import Any

from polydist._valuetypes.variables import SyncOnReadVariable, VariableAggregation

from ._support import MutantSim, is_mutant

_original = SyncOnReadVariable._cross_replica_value


def _cross_replica_value(self: SyncOnReadVariable) -> Any:
    if is_mutant(self._backend) and self._aggregation in (
        VariableAggregation.SUM,
        VariableAggregation.MEAN,
    ):
        return self._values[0]._read_storage()
    return _original(self)


SyncOnReadVariable._cross_replica_value = _cross_replica_value  # type: ignore[method-assign]


class MutantBackend(MutantSim):
    pass
