"""``polydist.compat.v1.distribute.experimental``: ``tf.compat.v1.distribute.experimental``."""

from polydist._base.communication import CollectiveCommunication as CollectiveCommunication
from polydist._base.communication import CommunicationImplementation as CommunicationImplementation
from polydist._base.communication import CommunicationOptions as CommunicationOptions
from polydist._v1.compat_v1 import (
    CollectiveAllReduceStrategyV1 as MultiWorkerMirroredStrategy,
)
from polydist._v1.compat_v1 import TPUStrategyV1 as TPUStrategy

__all__ = [
    "CollectiveCommunication",
    "CommunicationImplementation",
    "CommunicationOptions",
    "MultiWorkerMirroredStrategy",
    "TPUStrategy",
]
