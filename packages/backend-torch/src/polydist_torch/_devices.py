"""TF device strings <-> torch devices.

``GPU:k`` is ``cuda:k``. Every ``CPU:k`` is torch's one ``cpu`` device: the
backend runs N *virtual* CPU replicas there, as TF does with logical CPUs.
"""

from __future__ import annotations

import functools

import torch

from polydist.backend.devices import DeviceSpec

__all__ = [
    "MAX_VIRTUAL_CPU_REPLICAS",
    "canonical_device",
    "cuda_device_count",
    "torch_device",
]

#: Virtual CPU replicas one strategy may have (each runs on a pooled thread).
MAX_VIRTUAL_CPU_REPLICAS = 1024


def canonical_device(kind: str, index: int) -> str:
    return f"/job:localhost/replica:0/task:0/device:{kind}:{index}"


def cuda_device_count() -> int:
    # device_count() does not initialise CUDA, and is 0 on CPU-only builds.
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@functools.lru_cache(maxsize=4096)
def torch_device(device: str) -> torch.device:
    """The torch device behind a TF device string (``/gpu:1``) or a torch one (``cuda:1``)."""
    spec = DeviceSpec.parse(device)
    if spec.device_type == "CPU":
        return torch.device("cpu")
    if spec.device_type == "GPU":
        return torch.device("cuda", spec.device_index)
    raise ValueError(
        f"The torch backend cannot place values on {device!r}: it runs replicas on CPU and "
        "CUDA devices ('/cpu:K', '/gpu:K' or 'cuda:K'). For TPUs and other XLA devices use "
        "backend=polydist_torch.XlaSpmdBackend() (torch-xla SPMD); see docs/backends/torch.md."
    )
