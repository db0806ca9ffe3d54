"""MultiWorkerMirroredStrategy counts a host value once per replica, not once per worker.

TF reduces a plain host value with a collective among the workers' CPUs,
so SUM gives W x value (B.17); this gives W x D x value. The rule lives in
core (``MultiWorkerExtended._reduce_host_value``): patched for this backend only.
"""

from __future__ import annotations

from typing import Any

from polydist._distributed.multi_worker import MultiWorkerExtended
from polydist._base.reduce_op import ReduceOp

from ._support import MutantSim, is_mutant

_original = MultiWorkerExtended._reduce_host_value


def _reduce_host_value(
    self: MultiWorkerExtended, reduce_op: ReduceOp, value: Any, destinations: Any
) -> Any:
    result = _original(self, reduce_op, value, destinations)
    if is_mutant(self._backend) and reduce_op is ReduceOp.SUM:
        return result * self._num_devices_per_worker
    return result


MultiWorkerExtended._reduce_host_value = _reduce_host_value  # type: ignore[method-assign]


class MutantBackend(MutantSim):
    pass
