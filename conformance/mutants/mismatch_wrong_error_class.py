"""Replicas that disagree on a collective raise a plain RuntimeError, not CollectiveMismatchError.

The check lives in core's eager runner (_Run._mismatch): patched for this
backend only.
"""

from __future__ import annotations

from typing import Any

from polydist._strategies import eager as _eager
from ._support import MutantSim, is_mutant

_original = _eager._Run._mismatch


def _mismatch(self: Any, states: dict[int, str]) -> Any:
    error = _original(self, states)
    if is_mutant(self.backend):
        return RuntimeError(str(error))
    return error


_eager._Run._mismatch = _mismatch  # type: ignore[method-assign]


class MutantBackend(MutantSim):
    pass
