"""``polydist.contrib.distribute``: TF 1.11's tower-era ``tf.contrib.distribute``.

A *tower* is TF 1.11's name for a replica. Code written for it runs with
the import changed::

    from polydist.contrib import distribute      # TF: tf.contrib.distribute

    distribution = distribute.MirroredStrategy(["/gpu:0", "/gpu:1"])

    def merge_fn(distribution, three_plus_tower_id):
        return sum(distribution.unwrap(three_plus_tower_id))

    def fn(three):
        tower_ctx = distribute.get_tower_context()   # TF: tf.get_tower_context()
        v = three + tower_ctx.tower_id
        s = tower_ctx.merge_call(merge_fn, v)
        return s + v

    with distribution.scope():
        merged_results = distribution.call_for_each_tower(fn, 3)
    distribution.unwrap(merged_results)              # [10, 11]

The strategies are the `polydist.compat.v1` ones with the tower API on top
(``call_for_each_tower``, ``reduce(aggregation, value, destinations)``,
``run_steps_on_dataset``, ...), so the v1 and v2 methods work on them too.
"""

from polydist._v1.tower import DistributionStrategy as DistributionStrategy
from polydist._v1.tower import MapOutput as MapOutput
from polydist._v1.tower import MirroredStrategy as MirroredStrategy
from polydist._v1.tower import OneDeviceStrategy as OneDeviceStrategy
from polydist._v1.tower import PerDeviceDataset as PerDeviceDataset
from polydist._v1.tower import TowerContext as TowerContext
from polydist._v1.tower import TowerMultiStepContext as MultiStepContext
from polydist._v1.tower import TPUStrategy as TPUStrategy
from polydist._v1.tower import get_cross_tower_context as get_cross_tower_context
from polydist._v1.tower import get_distribution_strategy as get_distribution_strategy
from polydist._v1.tower import get_tower_context as get_tower_context
from polydist._v1.tower import has_distribution_strategy as has_distribution_strategy
from polydist._v1.tower import require_tower_context as require_tower_context

__all__ = [
    "DistributionStrategy",
    "MapOutput",
    "MirroredStrategy",
    "MultiStepContext",
    "OneDeviceStrategy",
    "PerDeviceDataset",
    "TPUStrategy",
    "TowerContext",
    "get_cross_tower_context",
    "get_distribution_strategy",
    "get_tower_context",
    "has_distribution_strategy",
    "require_tower_context",
]
