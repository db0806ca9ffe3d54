"""polydist: tf.distribute's Strategy API for JAX, PyTorch and a NumPy simulator.

Names, arguments, results and error classes follow ``tf.distribute``::

    import polydist as pd

    strategy = pd.MirroredStrategy(8)          # 8 simulated GPUs on the sim backend
    def step(x):
        ctx = pd.get_replica_context()
        return ctx.all_reduce(pd.ReduceOp.SUM, x)
    per_replica = strategy.run(step, args=(1.0,))
    strategy.reduce("MEAN", per_replica, axis=None)
"""

from polydist import checkpoint as checkpoint
from polydist import cluster_resolver as cluster_resolver
from polydist import compat as compat
from polydist import config as config
from polydist import contrib as contrib
from polydist import debugging as debugging
from polydist import errors as errors
from polydist import experimental as experimental
from polydist import metrics as metrics
from polydist import nn as nn
from polydist import train as train
from polydist._base.reduce_op import ReduceOp as ReduceOp
from polydist._collectives.cross_device_ops import CrossDeviceOps as CrossDeviceOps
from polydist._collectives.cross_device_ops import (
    HierarchicalCopyAllReduce as HierarchicalCopyAllReduce,
)
from polydist._collectives.cross_device_ops import NcclAllReduce as NcclAllReduce
from polydist._collectives.cross_device_ops import ReductionToOneDevice as ReductionToOneDevice
from polydist._collectives.trace import trace as trace
from polydist._distributed.multi_worker import (
    MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
)
from polydist._distributed.tpu_strategy import TPUStrategy as TPUStrategy
from polydist._input.input_lib import DistributedDataset as DistributedDataset
from polydist._input.input_lib import DistributedIterator as DistributedIterator
from polydist._input.input_lib import PartialBatchWarning as PartialBatchWarning
from polydist._strategies.context import experimental_set_strategy as experimental_set_strategy
from polydist._strategies.context import get_cross_replica_context as get_cross_replica_context
from polydist._strategies.context import get_replica_context as get_replica_context
from polydist._strategies.context import get_strategy as get_strategy
from polydist._strategies.context import has_strategy as has_strategy
from polydist._strategies.context import in_cross_replica_context as in_cross_replica_context
from polydist._strategies.mirrored import MirroredStrategy as MirroredStrategy
from polydist._strategies.mirrored import OneDeviceStrategy as OneDeviceStrategy
from polydist._strategies.replica_context import ReplicaContext as ReplicaContext
from polydist._strategies.strategy import RunOptions as RunOptions
from polydist._strategies.strategy import Strategy as Strategy
from polydist._strategies.strategy import StrategyExtended as StrategyExtended
from polydist._valuetypes.indexed_slices import IndexedSlices as IndexedSlices
from polydist._valuetypes.values import DistributedValues as DistributedValues
from polydist._valuetypes.values import Mirrored as Mirrored
from polydist._valuetypes.values import PerReplica as PerReplica
from polydist._valuetypes.variables import MirroredVariable as MirroredVariable
from polydist._valuetypes.variables import ReplicaDivergenceWarning as ReplicaDivergenceWarning
from polydist._valuetypes.variables import SyncOnReadVariable as SyncOnReadVariable
from polydist._valuetypes.variables import Variable as Variable
from polydist._valuetypes.variables import VariableAggregation as VariableAggregation
from polydist._valuetypes.variables import VariableSynchronization as VariableSynchronization
from polydist.backend._contract import available_backends as available_backends
from polydist.backend._contract import get_backend as get_backend
from polydist.data import InputContext as InputContext
from polydist.data import InputOptions as InputOptions
from polydist.data import InputReplicationMode as InputReplicationMode
from polydist.errors import CollectiveMismatchError as CollectiveMismatchError

__version__ = "0.1.0"

__all__ = [
    "CollectiveMismatchError",
    "CrossDeviceOps",
    "DistributedDataset",
    "DistributedIterator",
    "DistributedValues",
    "HierarchicalCopyAllReduce",
    "IndexedSlices",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "Mirrored",
    "MirroredStrategy",
    "MirroredVariable",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "PartialBatchWarning",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "ReplicaDivergenceWarning",
    "RunOptions",
    "Strategy",
    "StrategyExtended",
    "SyncOnReadVariable",
    "TPUStrategy",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "available_backends",
    "checkpoint",
    "cluster_resolver",
    "compat",
    "config",
    "contrib",
    "debugging",
    "errors",
    "experimental",
    "experimental_set_strategy",
    "get_backend",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "metrics",
    "nn",
    "trace",
    "train",
]
