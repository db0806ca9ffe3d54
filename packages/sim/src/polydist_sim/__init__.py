"""polydist_sim: the NumPy simulator backend's public names, and its cost model.

The simulator itself ships with core (``polydist.backend.sim``; ``backend="sim"``, the
default, needs nothing else). This package re-exports its names, so
``from polydist_sim import SimBackend`` keeps working, and adds
:mod:`polydist_sim.cost_model`. Select the sim with ``backend="sim"`` or pass a
configured ``SimBackend``, e.g.
``MirroredStrategy(8, backend=SimBackend("sequential"))``.
"""

from polydist.backend.sim import MAX_DEVICES as MAX_DEVICES
from polydist.backend.sim import REDUCTION_ORDERS as REDUCTION_ORDERS
from polydist.backend.sim import ReductionOrder as ReductionOrder
from polydist.backend.sim import SimBackend as SimBackend
from polydist.backend.sim import sum_replicas as sum_replicas
from polydist.backend.tracing import declare_internal_modules

# A trace's call site is the user's line, not the cost model's.
declare_internal_modules("polydist_sim")

__all__ = ["MAX_DEVICES", "REDUCTION_ORDERS", "ReductionOrder", "SimBackend", "sum_replicas"]
