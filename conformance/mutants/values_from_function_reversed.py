"""experimental_distribute_values_from_function gives replica r the value of replica n-1-r.

The rule lives in core (Strategy.experimental_distribute_values_from_function):
patched for this backend only.
"""

from __future__ import annotations

from typing import Any

from polydist._strategies.strategy import Strategy
from polydist._valuetypes.values import ValueContext

from ._support import MutantSim, is_mutant

_original = Strategy.experimental_distribute_values_from_function


def _values_from_function(self: Strategy, value_fn: Any) -> Any:
    if not is_mutant(self.extended.backend):
        return _original(self, value_fn)
    n = self.num_replicas_in_sync

    def reversed_fn(ctx: ValueContext) -> Any:
        return value_fn(ValueContext(n - 1 - ctx.replica_id_in_sync_group, n))

    return _original(self, reversed_fn)


Strategy.experimental_distribute_values_from_function = _values_from_function  # type: ignore[method-assign]


class MutantBackend(MutantSim):
    pass
