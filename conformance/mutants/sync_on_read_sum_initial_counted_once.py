"""A SUM SyncOnReadVariable counts its initial value once, not once per replica.

Only replica 0's copy starts with the initial value (the others start at
zero), so a variable created with 5 on N replicas reads 5 instead of 5 N.
Variable creation lives in core (``polydist._valuetypes.variables.create_variable``):
patched for this backend only.
"""

from __future__ import annotations

from typing import Any

from polydist._valuetypes import variables as _variables
from polydist._valuetypes.variables import SyncOnReadVariable, VariableAggregation

from ._support import MutantSim, is_mutant

_original = _variables.create_variable


def _create_variable(extended: Any, **kwargs: Any) -> Any:
    var = _original(extended, **kwargs)
    if (
        is_mutant(extended.backend)
        and isinstance(var, SyncOnReadVariable)
        and var.aggregation is VariableAggregation.SUM
    ):
        xp = extended.backend.array_namespace()
        for component in var.values[1:]:
            component._write_storage(component._place(xp.zeros_like(component._read_storage())))
    return var


_variables.create_variable = _create_variable


class MutantBackend(MutantSim):
    pass
