"""StrategyExtended.update in replica context runs once per replica instead of via merge_call.

Every replica then updates every copy, so ``update(v, assign_add, 1)``
adds N. The rule lives in core (``StrategyExtended.update``): patched for
this backend only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from polydist._strategies import context as _context

from polydist._valuetypes import variables as _variables
from polydist._strategies.extended_mixin import ExtendedVariablesMixin

from ._support import MutantSim, is_mutant

_original = ExtendedVariablesMixin.update


def _update(
    self: Any,
    var: Any,
    fn: Callable[..., Any],
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    group: bool = True,
) -> Any:
    mode = _context.current_mode()
    in_replica_context = mode.replica_context is not None and not _context.is_default_mode(mode)
    if is_mutant(self._backend) and in_replica_context:
        return _variables.update_components(self, var, fn, tuple(args), dict(kwargs or {}), group)
    return _original(self, var, fn, args, kwargs, group)


ExtendedVariablesMixin.update = _update  # type: ignore[method-assign]


class MutantBackend(MutantSim):
    pass
