"""Several workers on one host must not claim the same GPUs (torchrun --nproc-per-node=K).

No GPU is needed: the GPU count is patched.
"""

from __future__ import annotations

import pytest

from polydist_torch import _multi_worker
from polydist_torch._multi_worker import TorchProcessGroupBackend


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """8 GPUs, 4 workers on this host, nothing narrowed."""
    monkeypatch.setattr(_multi_worker, "cuda_device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return monkeypatch


@pytest.mark.parametrize("requested", [None, 1])
def test_workers_that_would_share_gpus_are_told_how_to_split_them(
    host: pytest.MonkeyPatch, requested: int | None
) -> None:
    with pytest.raises(
        ValueError,
        match=r"4 workers run on this host \(LOCAL_WORLD_SIZE=4\), and each would use the 8 "
        r"GPU\(s\).*CUDA_VISIBLE_DEVICES=\$LOCAL_RANK",
    ):
        TorchProcessGroupBackend().local_device_count(requested)


def test_gpus_given_per_worker_one_worker_per_host_or_no_gpus_pass(
    host: pytest.MonkeyPatch,
) -> None:
    backend = TorchProcessGroupBackend()
    host.setenv("CUDA_VISIBLE_DEVICES", "2")  # set for this worker: taken as its own
    host.setattr(_multi_worker, "cuda_device_count", lambda: 1)
    assert backend.local_device_count(None) is None  # TF's rule: the GPU it sees
    assert backend.local_device_count(1) == ("GPU", 1)
    host.delenv("CUDA_VISIBLE_DEVICES")
    host.setenv("LOCAL_WORLD_SIZE", "1")  # one worker per host: all of its GPUs
    host.setattr(_multi_worker, "cuda_device_count", lambda: 8)
    assert backend.local_device_count(8) == ("GPU", 8)
    host.setenv("LOCAL_WORLD_SIZE", "4")
    host.setattr(_multi_worker, "cuda_device_count", lambda: 0)  # CPU replicas
    assert backend.local_device_count(2) == ("CPU", 2)
