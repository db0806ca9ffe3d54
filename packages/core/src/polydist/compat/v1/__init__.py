"""``polydist.compat.v1``: the TF 1 strategy API of ``tf.compat.v1.distribute``.

Code written for ``tf.compat.v1.distribute`` runs with the import changed::

    import polydist.compat.v1 as v1          # TF: tf.compat.v1.distribute

    strategy = v1.MirroredStrategy(["/gpu:0", "/gpu:1"])
    with strategy.scope():
        iterator = strategy.make_input_fn_iterator(input_fn)
        per_replica = strategy.experimental_run(replica_fn, iterator)
    total = strategy.reduce("SUM", per_replica)   # axis=None by default in v1

The v1 strategies are the v2 ones (``polydist.MirroredStrategy``, ...) plus
the members TF 2 removed: ``experimental_run``, ``make_dataset_iterator``,
``make_input_fn_iterator``, ``experimental_make_numpy_dataset``,
``update_config_proto``, ``configure``, ``unwrap``, ``group``,
``steps_per_run`` and, on ``strategy.extended``,
``experimental_run_steps_on_iterator``. ``polydist.compat.v1.distribute``
mirrors TF's module path (``tf.compat.v1.distribute.MirroredStrategy``,
``tf.compat.v1.distribute.experimental.TPUStrategy``).

There are no graphs or sessions: everything runs when called (TF's eager
mode), an iterator's ``initialize()`` restarts it and returns ``[]``, and a
session config is a dict of ``ConfigProto`` fields.
"""

from polydist._strategies.context import experimental_set_strategy as experimental_set_strategy
from polydist._strategies.context import get_replica_context as get_replica_context
from polydist._strategies.context import get_strategy as get_strategy
from polydist._strategies.context import has_strategy as has_strategy
from polydist._strategies.context import in_cross_replica_context as in_cross_replica_context
from polydist._strategies.replica_context import ReplicaContext as ReplicaContext
from polydist._v1.compat_v1 import (
    CollectiveAllReduceStrategyV1 as MultiWorkerMirroredStrategy,
)
from polydist._v1.compat_v1 import InputIterator as InputIterator
from polydist._v1.compat_v1 import MirroredStrategyV1 as MirroredStrategy
from polydist._v1.compat_v1 import MultiStepContext as MultiStepContext
from polydist._v1.compat_v1 import OneDeviceStrategyV1 as OneDeviceStrategy
from polydist._v1.compat_v1 import StrategyExtendedV1 as StrategyExtended
from polydist._v1.compat_v1 import StrategyV1 as Strategy
from polydist._v1.compat_v1 import TPUStrategyV1 as TPUStrategy
from polydist.compat.v1 import distribute as distribute
from polydist.data import InputContext as InputContext
from polydist.data import InputReplicationMode as InputReplicationMode

__all__ = [
    "InputContext",
    "InputIterator",
    "InputReplicationMode",
    "MirroredStrategy",
    "MultiStepContext",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "ReplicaContext",
    "Strategy",
    "StrategyExtended",
    "TPUStrategy",
    "distribute",
    "experimental_set_strategy",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]
