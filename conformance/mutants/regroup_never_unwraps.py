"""run's regrouping never unwraps a value that is the very same object on every replica.

Regrouping lives in core (polydist._valuetypes.values.regroup as used by _strategy):
the patch is global, so only the cases' documented results catch it.
"""

from __future__ import annotations

from typing import Any

from polydist._strategies import strategy as _strategy
from polydist._valuetypes.values import regroup

from ._support import MutantSim


def _regroup(values: Any, wrap_class: Any = None, always_wrap: bool = False) -> Any:
    if wrap_class is None:
        return regroup(values, always_wrap=True)
    return regroup(values, wrap_class, always_wrap=True)


_strategy.regroup = _regroup  # type: ignore[attr-defined]


class MutantBackend(MutantSim):
    pass
