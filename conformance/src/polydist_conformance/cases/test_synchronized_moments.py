"""``polydist.nn.synchronized_moments``: a synchronized batch norm's statistics.

Every replica gets the mean and variance of the whole global batch, whatever
share of it each holds (none, for the last partial batch). The inputs are small
integers whose every partial sum, mean and squared deviation is exact in
float32, so each backend must match the oracle and the documented values bit
for bit, in whatever order it sums.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist_conformance import Conformance
from polydist_conformance.cases._helpers import distribute, per_replica

# Columns: 1 3 0 4 2 2 5 7 (mean 3, variance 36/8) and 2 6 1 1 5 1 0 4 (2.5, 34/8).
_UNEVEN = [
    [[1, 2], [3, 6]],
    [],
    [[0, 1], [4, 1], [2, 5], [2, 1]],
    [[5, 0], [7, 4]],
]
_EVEN = [[[1, 2], [3, 6]], [[0, 1], [4, 1]], [[2, 5], [2, 1]], [[5, 0], [7, 4]]]


def _parts(rows: list[list[list[int]]]) -> list[np.ndarray]:
    return [np.asarray(r, dtype=np.float32).reshape(-1, 2) for r in rows]


@pytest.mark.parametrize(
    "rows",
    [
        pytest.param(_EVEN, id="even"),
        pytest.param(
            _UNEVEN,
            id="uneven_with_an_empty_replica",
            marks=pytest.mark.requires("dynamic_shapes"),
        ),
    ],
)
def test_every_replica_gets_the_global_batch_moments(
    conformance: Conformance, rows: list[list[list[int]]]
) -> None:
    parts = _parts(rows)

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        values = distribute(strategy, xp, parts)
        return strategy.run(
            lambda x: pd.nn.synchronized_moments(x, axes=[0], return_count=True), args=(values,)
        )

    mean = np.asarray([3.0, 2.5], np.float32)
    variance = np.asarray([4.5, 4.25], np.float32)
    count = np.asarray([8.0, 8.0], np.float32)
    expected = tuple(per_replica([v] * 4) for v in (mean, variance, count))
    conformance.check(program, replicas=4, expected=expected)


def test_keepdims_and_mask(conformance: Conformance) -> None:
    """A mask leaves elements out (Flax's ``BatchNorm(mask=...)``); ``keepdims``
    keeps the reduced axis. Every replica holds four rows (one shape everywhere), of
    which the mask keeps the eight rows above: replica 1 counts none."""
    parts = [np.full((4, 2), -77.0, np.float32) for _ in range(4)]
    masks = [np.zeros((4, 1), bool) for _ in range(4)]
    for r, rows in enumerate(_parts(_UNEVEN)):
        parts[r][: len(rows)] = rows
        masks[r][: len(rows)] = True

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        values = distribute(strategy, xp, parts)
        keep = distribute(strategy, xp, masks)
        return strategy.run(
            lambda x, m: pd.nn.synchronized_moments(x, axes=0, keepdims=True, mask=m),
            args=(values, keep),
        )

    mean = np.asarray([[3.0, 2.5]], np.float32)
    variance = np.asarray([[4.5, 4.25]], np.float32)
    conformance.check(
        program, replicas=4, expected=(per_replica([mean] * 4), per_replica([variance] * 4))
    )
