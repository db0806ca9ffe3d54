from __future__ import annotations

import pytest

from polydist._base.devices import DeviceSpec, canonicalize

GPU1 = "/job:localhost/replica:0/task:0/device:GPU:1"


@pytest.mark.parametrize(
    "spec", ["/gpu:1", "GPU:1", "gpu:1", "/device:GPU:1", "cuda:1", GPU1, "/replica:0/device:GPU:1"]
)
def test_spellings_of_one_device(spec: str) -> None:
    assert canonicalize(spec) == GPU1


def test_job_and_task() -> None:
    spec = DeviceSpec.parse("/job:worker/replica:0/task:3/device:TPU:7")
    assert (spec.job, spec.task, spec.device_type, spec.device_index) == ("worker", 3, "TPU", 7)
    assert canonicalize("cpu") == "/job:localhost/replica:0/task:0/device:CPU:0"


@pytest.mark.parametrize("spec", ["", "gpu:x", "/foo:1", "gpu:0/cpu:0", "job:/x"])
def test_bad_strings(spec: str) -> None:
    with pytest.raises(ValueError, match="Invalid device string"):
        canonicalize(spec)
