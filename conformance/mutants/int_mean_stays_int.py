"""MEAN of integers stays an integer (floor division) instead of becoming float64.

The MEAN rule lives in core (polydist._base.arrays.mean_from_sum, applied by the reduce
tail in polydist._collectives.cross_device_ops.apply_mean), which cannot
tell which backend it serves: the patch is global, the oracle shares it, and
only the cases' documented results catch it.
"""

from __future__ import annotations

from typing import Any

from polydist._collectives import cross_device_ops as _cross_device_ops

from polydist._strategies import replica_context as _replica_context
from ._support import MutantSim


def _mean_from_sum(xp: Any, total: Any, count: int) -> Any:
    if xp.isdtype(total.dtype, ("integral", "bool")):
        return xp.asarray(total // count)
    return xp.asarray(total / count)


_replica_context.mean_from_sum = _mean_from_sum  # type: ignore[attr-defined]
_cross_device_ops.mean_from_sum = _mean_from_sum  # type: ignore[attr-defined]  # the reduce tail


class MutantBackend(MutantSim):
    pass
