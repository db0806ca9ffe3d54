"""polydist_sim: the NumPy simulator backend's public names, and its cost model.

The simulator itself ships with core (``polydist._sim``; ``backend="sim"``, the
default, needs nothing else). This package re-exports its names, so
``from polydist_sim import SimBackend`` keeps working, and adds
:mod:`polydist_sim.cost_model`. Select the sim with ``backend="sim"`` or pass a
configured ``SimBackend``, e.g.
``MirroredStrategy(8, backend=SimBackend("sequential"))``.
"""

from polydist._sim import MAX_DEVICES as MAX_DEVICES
from polydist._sim import REDUCTION_ORDERS as REDUCTION_ORDERS
from polydist._sim import ReductionOrder as ReductionOrder
from polydist._sim import SimBackend as SimBackend
from polydist._sim import sum_replicas as sum_replicas

__all__ = ["MAX_DEVICES", "REDUCTION_ORDERS", "ReductionOrder", "SimBackend", "sum_replicas"]
