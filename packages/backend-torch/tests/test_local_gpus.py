"""Several workers on one machine each get their own GPUs (torchrun's one process per GPU).

No GPU is needed: the GPU count and CUDA's state are patched, and the test reads the
``CUDA_VISIBLE_DEVICES`` a worker would start CUDA with.
"""

from __future__ import annotations

import pytest

from polydist_torch import _multi_worker
from polydist_torch._multi_worker import TorchProcessGroupBackend, _split_local_gpus

VISIBLE = "CUDA_VISIBLE_DEVICES"


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """8 GPUs, CUDA not started, worker 2 of 4 on this machine."""
    monkeypatch.setattr(_multi_worker, "cuda_device_count", lambda: 8)
    monkeypatch.setattr(_multi_worker, "_cuda_initialized", lambda: False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.delenv(VISIBLE, raising=False)
    return monkeypatch


def test_an_even_split_by_local_rank(machine: pytest.MonkeyPatch) -> None:
    assert TorchProcessGroupBackend().local_device_count(None) == ("GPU", 2)
    assert _multi_worker.os.environ[VISIBLE] == "4,5"


def test_local_devices_per_worker_and_a_listed_visible_set(machine: pytest.MonkeyPatch) -> None:
    machine.setenv(VISIBLE, "0, 2,4,6,8,10,12,14")  # the launcher's own list is split
    assert _split_local_gpus(1) == 1
    assert _multi_worker.os.environ[VISIBLE] == "4"


def test_nothing_is_split_for_one_worker_or_an_already_narrowed_set(
    machine: pytest.MonkeyPatch,
) -> None:
    machine.setenv("LOCAL_WORLD_SIZE", "1")
    assert _split_local_gpus(None) is None
    machine.setenv("LOCAL_WORLD_SIZE", "4")
    machine.setattr(_multi_worker, "cuda_device_count", lambda: 1)  # one GPU each already
    assert _split_local_gpus(None) is None
    machine.setattr(_multi_worker, "cuda_device_count", lambda: 0)  # a CPU machine
    assert _split_local_gpus(None) is None
    assert VISIBLE not in _multi_worker.os.environ


def test_too_many_gpus_per_worker_is_an_error(machine: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"local_devices=3 .*Ask for at most 2 per worker"):
        _split_local_gpus(3)
    assert VISIBLE not in _multi_worker.os.environ


def test_cuda_already_started_is_an_error(machine: pytest.MonkeyPatch) -> None:
    machine.setattr(_multi_worker, "_cuda_initialized", lambda: True)
    with pytest.raises(ValueError, match="CUDA is already initialized .*CUDA_VISIBLE_DEVICES"):
        _split_local_gpus(None)
