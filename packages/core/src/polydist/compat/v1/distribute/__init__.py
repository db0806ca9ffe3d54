"""``polydist.compat.v1.distribute``: the names of ``tf.compat.v1.distribute``.

``experimental`` holds ``TPUStrategy`` and ``MultiWorkerMirroredStrategy``
(``tf.compat.v1.distribute.experimental``).
"""

from polydist import cluster_resolver as cluster_resolver
from polydist._base.reduce_op import ReduceOp as ReduceOp
from polydist._collectives.cross_device_ops import CrossDeviceOps as CrossDeviceOps
from polydist._collectives.cross_device_ops import (
    HierarchicalCopyAllReduce as HierarchicalCopyAllReduce,
)
from polydist._collectives.cross_device_ops import NcclAllReduce as NcclAllReduce
from polydist._collectives.cross_device_ops import ReductionToOneDevice as ReductionToOneDevice
from polydist._strategies.context import experimental_set_strategy as experimental_set_strategy
from polydist._strategies.context import get_replica_context as get_replica_context
from polydist._strategies.context import get_strategy as get_strategy
from polydist._strategies.context import has_strategy as has_strategy
from polydist._strategies.context import in_cross_replica_context as in_cross_replica_context
from polydist._strategies.replica_context import ReplicaContext as ReplicaContext
from polydist._strategies.strategy import RunOptions as RunOptions
from polydist._v1.compat_v1 import MirroredStrategyV1 as MirroredStrategy
from polydist._v1.compat_v1 import OneDeviceStrategyV1 as OneDeviceStrategy
from polydist._v1.compat_v1 import StrategyExtendedV1 as StrategyExtended
from polydist._v1.compat_v1 import StrategyV1 as Strategy
from polydist.compat.v1.distribute import experimental as experimental
from polydist.data import InputContext as InputContext
from polydist.data import InputReplicationMode as InputReplicationMode

__all__ = [
    "CrossDeviceOps",
    "HierarchicalCopyAllReduce",
    "InputContext",
    "InputReplicationMode",
    "MirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "RunOptions",
    "Strategy",
    "StrategyExtended",
    "cluster_resolver",
    "experimental",
    "experimental_set_strategy",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]
