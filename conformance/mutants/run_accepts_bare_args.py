"""Strategy.run accepts a bare argument (wraps it in a tuple) instead of raising ValueError.

The check lives in core (Strategy.run): patched for this backend only.
"""

from __future__ import annotations

from typing import Any

from polydist._strategies.strategy import Strategy

from ._support import MutantSim, is_mutant

_original = Strategy.run


def _run(self: Strategy, fn: Any, args: Any = (), kwargs: Any = None, options: Any = None) -> Any:
    if is_mutant(self.extended.backend):
        if not isinstance(args, list | tuple):
            args = (args,)
        if kwargs is not None and not isinstance(kwargs, dict):
            kwargs = dict(enumerate(kwargs))
    return _original(self, fn, args, kwargs, options)


Strategy.run = _run  # type: ignore[method-assign]


class MutantBackend(MutantSim):
    pass
