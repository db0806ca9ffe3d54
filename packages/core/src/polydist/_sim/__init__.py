"""The simulator backend (``backend="sim"``, the default), part of core so that
``pip install polydist`` alone runs ``MirroredStrategy()``.

Core registers it as the ``sim`` entry point of ``polydist.backends``. Its public
names are re-exported by ``polydist_sim`` (the ``polydist-sim`` package, which
adds the cost model): configure it there, e.g.
``MirroredStrategy(8, backend=polydist_sim.SimBackend("sequential"))``.
"""

from polydist._sim._backend import MAX_DEVICES as MAX_DEVICES
from polydist._sim._backend import SimBackend as SimBackend
from polydist._sim._reduction import REDUCTION_ORDERS as REDUCTION_ORDERS
from polydist._sim._reduction import ReductionOrder as ReductionOrder
from polydist._sim._reduction import sum_replicas as sum_replicas

__all__ = ["MAX_DEVICES", "REDUCTION_ORDERS", "ReductionOrder", "SimBackend", "sum_replicas"]
