"""experimental_distribute_dataset drops the last partial global batch instead of splitting it.

As if every ``batch()`` had ``drop_remainder=True``: ``range(10).batch(4)``
over 3 replicas loses its last step ``[8] [9] []``. The rule lives in core
(``Strategy.experimental_distribute_dataset``): patched for this backend only.
"""

from __future__ import annotations

from typing import Any

from polydist._strategies.strategy import Strategy
from polydist.data._dataset import Dataset, _BatchDataset

from ._support import MutantSim, is_mutant

_original = Strategy.experimental_distribute_dataset


def _drop_partial_batches(dataset: Dataset) -> Dataset:
    def replace(node: Dataset) -> Dataset | None:
        if isinstance(node, _BatchDataset) and not node.drop_remainder:
            return _BatchDataset(node._inputs[0], node.batch_size, True)
        return None

    return dataset._rewrite(replace)


def _distribute_dataset(self: Strategy, dataset: Any, options: Any = None) -> Any:
    if is_mutant(self.extended.backend) and isinstance(dataset, Dataset):
        dataset = _drop_partial_batches(dataset)
    return _original(self, dataset, options)


Strategy.experimental_distribute_dataset = _distribute_dataset  # type: ignore[method-assign]


class MutantBackend(MutantSim):
    pass
