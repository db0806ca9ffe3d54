"""A cross-replica assign(x) of a SUM SyncOnReadVariable stores x (not x / N) in every copy.

So ``assign(9)`` reads back ``9 N``. The rule lives in core
(``SyncOnReadVariable._update_cross_replica``): patched for this backend only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from polydist._valuetypes import variables as _variables
from polydist._valuetypes.variables import SyncOnReadVariable, VariableAggregation

from ._support import MutantSim, is_mutant

_original = SyncOnReadVariable._update_cross_replica


def _update_cross_replica(
    self: SyncOnReadVariable, update_fn: Callable[..., Any], value: Any, **kwargs: Any
) -> Any:
    if (
        is_mutant(self._backend)
        and update_fn is _variables._assign_fn
        and self._aggregation is VariableAggregation.SUM
    ):
        for component in self._values:
            update_fn(component, value, read_value=False)
        return self.read_value() if kwargs.get("read_value", True) else None
    return _original(self, update_fn, value, **kwargs)


SyncOnReadVariable._update_cross_replica = _update_cross_replica  # type: ignore[method-assign]


class MutantBackend(MutantSim):
    pass
