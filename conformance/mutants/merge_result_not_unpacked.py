"""merge_call hands every replica merge_fn's whole PerReplica result, not its component.

The rule lives in core's eager runner (select_replica in _Run._merge_call):
patched for this backend only.
"""

from __future__ import annotations

from typing import Any

from polydist._strategies import eager as _eager
from ._support import MutantSim, is_mutant, patched

_original = _eager._Run._merge_call


def _merge_call(self: Any, requests: Any) -> Any:
    if not is_mutant(self.backend):
        return _original(self, requests)
    with patched(_eager, "select_replica", lambda replica, value: value):
        return _original(self, requests)


_eager._Run._merge_call = _merge_call  # type: ignore[method-assign]


class MutantBackend(MutantSim):
    pass
