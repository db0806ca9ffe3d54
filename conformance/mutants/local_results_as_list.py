"""experimental_local_results returns a list instead of a tuple.

The rule lives in core (StrategyExtended._local_results): patched for this
backend only.
"""

from __future__ import annotations

from typing import Any

from polydist._strategies.strategy import StrategyExtended

from ._support import MutantSim, is_mutant

_original = StrategyExtended._local_results


def _local_results(self: StrategyExtended, value: Any) -> Any:
    result = _original(self, value)
    return list(result) if is_mutant(self.backend) else result


StrategyExtended._local_results = _local_results  # type: ignore[method-assign]


class MutantBackend(MutantSim):
    pass
