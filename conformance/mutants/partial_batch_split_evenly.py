"""The legacy rebatch splits a batch evenly (sizes differ by at most one) instead of ceil(b/R).

TF's ``RebatchDataset`` cuts a batch of ``b`` into slices of ``ceil(b/R)``,
leaving trailing replicas empty (4 rows over 3 replicas: 2, 2, 0); this one
gives 2, 1, 1. The rule lives in core (``polydist.data._rebatch``) and cannot
see the backend: patched globally, so only the documented results catch it.
"""

from __future__ import annotations

import polydist._input.input_lib as input_lib
from polydist.data import _rebatch

from ._support import MutantSim


def _even_slices(batch_size: int, num_replicas: int) -> list[tuple[int, int]]:
    base, extra = divmod(batch_size, num_replicas)
    slices = []
    start = 0
    for replica in range(num_replicas):
        stop = start + base + (1 if replica < extra else 0)
        slices.append((start, stop))
        start = stop
    return slices


_rebatch.legacy_rebatch_slices = _even_slices
if hasattr(input_lib, "legacy_rebatch_slices"):  # imported by name there
    input_lib.legacy_rebatch_slices = _even_slices


class MutantBackend(MutantSim):
    pass
