"""An example polydist backend, written outside polydist against its public contract.

``ThreadsBackend`` (registered as ``backend="threads"``) runs each replica of
``strategy.run`` on a thread of its own, concurrently, with NumPy arrays; the
replicas' collectives meet in shared memory. See ``docs/extending.md``.
"""

from polydist_example_backend._backend import DEFAULT_DEVICES as DEFAULT_DEVICES
from polydist_example_backend._backend import ThreadsBackend as ThreadsBackend
from polydist_example_backend._backend import ThreadsRunner as ThreadsRunner
from polydist_example_backend._backend import sum_in_replica_order as sum_in_replica_order

__all__ = ["DEFAULT_DEVICES", "ThreadsBackend", "ThreadsRunner", "sum_in_replica_order"]
