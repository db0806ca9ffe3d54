"""Cross-replica methods (reduce, gather, scope) skip the context check for this backend.

The check lives in core (_context.require_cross_replica_or_default_context):
patched for this backend only.
"""

from __future__ import annotations

from typing import Any

from polydist._strategies import context as _context
from ._support import MutantSim, is_mutant

_original = _context.require_cross_replica_or_default_context


def _require(strategy: Any, message: str | None = None) -> None:
    if is_mutant(strategy.extended.backend):
        return
    _original(strategy, message)


_context.require_cross_replica_or_default_context = _require


class MutantBackend(MutantSim):
    pass
