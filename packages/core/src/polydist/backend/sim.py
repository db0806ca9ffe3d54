"""The simulator backend (``backend="sim"``, the default), for backends and tools that
compare against the reference.

It ships with core so that ``pip install polydist`` alone runs ``MirroredStrategy()``;
``polydist_sim`` re-exports these names with its cost model. ``SimBackend(order)``
sums in one of :data:`REDUCTION_ORDERS`; :func:`sum_replicas` is that sum.
"""

from polydist._sim import MAX_DEVICES as MAX_DEVICES
from polydist._sim import REDUCTION_ORDERS as REDUCTION_ORDERS
from polydist._sim import ReductionOrder as ReductionOrder
from polydist._sim import SimBackend as SimBackend
from polydist._sim import sum_replicas as sum_replicas

__all__ = ["MAX_DEVICES", "REDUCTION_ORDERS", "ReductionOrder", "SimBackend", "sum_replicas"]
