"""TPUStrategy.gather accepts sizes that differ along the axis (TPU needs the same shape).

The rule lives in core (``TPUExtended._gather_needs_same_shape``): patched
for this backend only.
"""

from __future__ import annotations

from polydist._distributed.tpu_strategy import TPUExtended

from ._support import MutantSim, is_mutant


def _needs_same_shape(self: TPUExtended) -> bool:
    return not is_mutant(self._backend)


TPUExtended._gather_needs_same_shape = property(_needs_same_shape)  # type: ignore[assignment]


class MutantBackend(MutantSim):
    pass
