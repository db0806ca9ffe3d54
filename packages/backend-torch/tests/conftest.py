from __future__ import annotations

from collections.abc import Iterator

import pytest

from polydist.backend import busy_workers

# No warning filters: torch 2.13 + NumPy 2 import without warnings, and the one
# torch warning polydist could trigger ("torch.asarray: unspecified requires_grad
# now defaults to obj.requires_grad", from the MEAN of a tensor that tracks
# gradients) is avoided in polydist's mean_from_sum instead of filtered here.


@pytest.fixture(autouse=True)
def _no_busy_replica_threads() -> Iterator[None]:
    """Every test must leave no replica thread running replica code."""
    yield
    assert busy_workers() == 0, f"{busy_workers()} replica threads still busy after the test"


@pytest.fixture
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """For tests of virtual CPU replicas: where torch sees CUDA devices, they would be
    the replicas' devices (TF's rule), and a machine with one GPU has too few."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
