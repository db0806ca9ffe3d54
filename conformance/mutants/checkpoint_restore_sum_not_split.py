"""checkpoint.restore puts a SUM SyncOnReadVariable's saved sum in EVERY copy (not sum / N).

So the restored variable reads ``N`` times the saved sum. The rule lives in
core (``polydist.checkpoint._save._restored_copies``): patched for this
backend only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polydist._valuetypes.variables import SyncOnReadVariable, VariableAggregation, _components, _copy
from polydist.checkpoint import _save

from ._support import MutantSim, is_mutant

_original = _save._restored_copies


def _restored_copies(var: Any, stored: np.ndarray) -> list[Any]:
    if (
        is_mutant(var._backend)
        and isinstance(var, SyncOnReadVariable)
        and var.aggregation is VariableAggregation.SUM
    ):
        xp = var._backend.array_namespace()
        value = xp.asarray(stored)
        return [c._place(_copy(value, xp)) for c in _components(var)]
    return _original(var, stored)


_save._restored_copies = _restored_copies


class MutantBackend(MutantSim):
    pass
