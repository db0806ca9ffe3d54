"""A MirroredVariable with aggregation NONE, written in replica context, updates ALL copies.

TF has each replica write only its own copy (they diverge to 1, 2, 3);
here every replica writes every copy, so the last writer wins and nothing
diverges. The rule lives in core (``MirroredVariable._update_replica``):
patched for this backend only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from polydist._valuetypes.variables import MirroredVariable, VariableAggregation

from ._support import MutantSim, is_mutant

_original = MirroredVariable._update_replica


def _update_replica(
    self: MirroredVariable,
    ctx: Any,
    update_fn: Callable[..., Any],
    value: Any,
    **kwargs: Any,
) -> Any:
    if is_mutant(self._backend) and self._aggregation is VariableAggregation.NONE:
        index = self._replica_in_context()
        assert index is not None
        results = [update_fn(component, value, **kwargs) for component in self._values]
        return results[index]
    return _original(self, ctx, update_fn, value, **kwargs)


MirroredVariable._update_replica = _update_replica  # type: ignore[method-assign]


class MutantBackend(MutantSim):
    pass
