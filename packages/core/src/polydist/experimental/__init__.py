"""``polydist.experimental``: TF's ``tf.distribute.experimental`` names."""

from polydist._base.communication import CollectiveCommunication as CollectiveCommunication
from polydist._base.communication import CollectiveHints as CollectiveHints
from polydist._base.communication import CommunicationImplementation as CommunicationImplementation
from polydist._base.communication import CommunicationOptions as CommunicationOptions
from polydist._distributed.multi_worker import (
    ExperimentalMultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
)
from polydist._valuetypes.values import ValueContext as ValueContext

__all__ = [
    "CollectiveCommunication",
    "CollectiveHints",
    "CommunicationImplementation",
    "CommunicationOptions",
    "MultiWorkerMirroredStrategy",
    "ValueContext",
]
