"""Distributed values as a backend handles them.

``DistributedValues`` (``PerReplica``, ``Mirrored``) and ``DistributedVariable`` hold
one value per replica; :func:`select_replica` picks replica ``r``'s value out of a
nest of them, :func:`regroup` combines one nest per replica into one nest of
distributed values (what a backend that runs its own replicas hands ``merge_fn``), and
:func:`value_container` returns the distributed value a component belongs to (or the
value itself).
"""

from polydist._valuetypes.values import DistributedValues as DistributedValues
from polydist._valuetypes.values import Mirrored as Mirrored
from polydist._valuetypes.values import PerReplica as PerReplica
from polydist._valuetypes.values import regroup as regroup
from polydist._valuetypes.values import select_replica as select_replica
from polydist._valuetypes.values import value_container as value_container
from polydist._valuetypes.variables import DistributedVariable as DistributedVariable
from polydist._valuetypes.variables import MirroredVariable as MirroredVariable
from polydist._valuetypes.variables import SyncOnReadVariable as SyncOnReadVariable
from polydist._valuetypes.variables import Variable as Variable

__all__ = [
    "DistributedValues",
    "DistributedVariable",
    "Mirrored",
    "MirroredVariable",
    "PerReplica",
    "SyncOnReadVariable",
    "Variable",
    "regroup",
    "select_replica",
    "value_container",
]
