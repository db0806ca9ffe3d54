"""A MirroredVariable with aggregation ONLY_FIRST_REPLICA takes the LAST replica's update.

The rule lives in core (``polydist._valuetypes.variables._apply_aggregation``): patched
for this backend only.
"""

from __future__ import annotations

from typing import Any

from polydist._valuetypes import variables as _variables
from polydist._valuetypes.variables import VariableAggregation

from ._support import MutantSim, is_mutant

_original = _variables._apply_aggregation


def _apply_aggregation(strategy: Any, value: Any, aggregation: Any, destinations: Any) -> Any:
    if is_mutant(strategy.extended.backend) and aggregation is (
        VariableAggregation.ONLY_FIRST_REPLICA
    ):
        last = strategy.experimental_local_results(value)[-1]
        return strategy.extended.broadcast_to(last, destinations=destinations)
    return _original(strategy, value, aggregation, destinations)


_variables._apply_aggregation = _apply_aggregation


class MutantBackend(MutantSim):
    pass
