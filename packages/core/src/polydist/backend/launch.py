"""Launching worker processes on this machine, for tests of multi-process backends.

:func:`launch` runs one process per worker of a local cluster (what
``polydist launch`` does), each with its ``TF_CONFIG`` (:func:`worker_environment`),
on free ports (:func:`free_ports`), and returns a :class:`LaunchResult` per worker
with its exit status and output; it never hangs (every wait has a timeout).
"""

from polydist._distributed.launch import LaunchResult as LaunchResult
from polydist._distributed.launch import free_ports as free_ports
from polydist._distributed.launch import launch as launch
from polydist._distributed.launch import worker_environment as worker_environment

__all__ = ["LaunchResult", "free_ports", "launch", "worker_environment"]
