"""The backend-neutral input pipeline: tf.data's ``Dataset`` API over NumPy arrays.

``Dataset`` pipelines feed the strategies' ``experimental_distribute_dataset``;
``InputContext`` / ``InputOptions`` / ``InputReplicationMode`` are the
``tf.distribute`` input types. The rules that split a dataset across workers
and replicas live in ``polydist.data._rebatch``.
"""

from polydist.data._dataset import AUTOTUNE as AUTOTUNE
from polydist.data._dataset import INFINITE_CARDINALITY as INFINITE_CARDINALITY
from polydist.data._dataset import SHARD_HINT as SHARD_HINT
from polydist.data._dataset import UNKNOWN_CARDINALITY as UNKNOWN_CARDINALITY
from polydist.data._dataset import Dataset as Dataset
from polydist.data._input import InputContext as InputContext
from polydist.data._input import InputOptions as InputOptions
from polydist.data._input import InputReplicationMode as InputReplicationMode
from polydist.data._options import AutoShardPolicy as AutoShardPolicy
from polydist.data._options import DistributeOptions as DistributeOptions
from polydist.data._options import Options as Options
from polydist.data._rebatch import AutoShardWarning as AutoShardWarning
from polydist.data._sources import TextLineDataset as TextLineDataset
from polydist.data._spec import TensorSpec as TensorSpec

__all__ = [
    "AUTOTUNE",
    "INFINITE_CARDINALITY",
    "SHARD_HINT",
    "UNKNOWN_CARDINALITY",
    "AutoShardPolicy",
    "AutoShardWarning",
    "Dataset",
    "DistributeOptions",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "Options",
    "TensorSpec",
    "TextLineDataset",
]
