"""Canonical TF device strings <-> ``jax.Device`` objects.

``/job:localhost/replica:0/task:0/device:GPU:k`` is the k-th device of
``jax.devices("gpu")``; likewise ``CPU:k`` and ``TPU:k``. The index is the
position in JAX's list for that platform, not ``Device.id`` (which is global
across processes and platforms). Where JAX has no TPUs, ``TPU:k`` is the k-th
device of its default platform, standing in for TPU core k (``TPUStrategy``,
see ``polydist_jax._tpu``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax

from polydist.backend.devices import DeviceSpec

__all__ = ["device_string", "jax_device", "platform_devices", "validate"]

# TF's device types and the JAX platform names behind them (cuda and rocm are both "gpu").
_PLATFORM_OF_TYPE = {"CPU": "cpu", "GPU": "gpu", "TPU": "tpu"}
_TYPE_OF_PLATFORM = {"cpu": "CPU", "gpu": "GPU", "cuda": "GPU", "rocm": "GPU", "tpu": "TPU"}

_FORCE_FLAG_HINT = (
    "On CPU, fake devices come from XLA_FLAGS=--xla_force_host_platform_device_count=N "
    "(or jax.config.update('jax_num_cpu_devices', N)), set before JAX first runs."
)


def device_type(device: jax.Device) -> str:
    """``"CPU"``, ``"GPU"`` or ``"TPU"`` for a JAX device."""
    kind = _TYPE_OF_PLATFORM.get(device.platform)
    if kind is None:
        raise ValueError(
            f"polydist does not know JAX platform {device.platform!r} (device {device}); "
            "it maps cpu, gpu (cuda/rocm) and tpu."
        )
    return kind


@functools.cache
def platform_devices(kind: str) -> tuple[jax.Device, ...]:
    """JAX's local devices of TF device type ``kind``, or ``()`` if the platform is absent."""
    platform = _PLATFORM_OF_TYPE.get(kind)
    if platform is None:
        return ()
    try:
        return tuple(d for d in jax.devices(platform) if d.process_index == jax.process_index())
    except RuntimeError:  # JAX raises RuntimeError for a platform it has no backend for
        return ()


def device_string(device: jax.Device) -> str:
    """The canonical TF string of a JAX device."""
    kind = device_type(device)
    index = platform_devices(kind).index(device)
    return DeviceSpec(device_type=kind, device_index=index).to_string()


@functools.cache
def jax_device(device: str) -> jax.Device:
    """The JAX device behind a TF device string (any of TF's spellings)."""
    spec = DeviceSpec.parse(device)
    _check_local(device, spec)
    devices = platform_devices(spec.device_type)
    stand_ins = spec.device_type == "TPU" and not devices
    if stand_ins:
        devices = platform_devices(default_kind())
    if not devices:
        raise ValueError(
            f"JAX has no {spec.device_type} devices here, so it cannot place on {device!r}. "
            f"Available: {', '.join(_available()) or 'none'}."
        )
    if spec.device_index >= len(devices):
        kind = default_kind() if stand_ins else spec.device_type
        hint = f" {_FORCE_FLAG_HINT}" if kind == "CPU" else ""
        if stand_ins:
            raise ValueError(
                f"Device {device!r} is out of range: JAX has no TPUs here, and its "
                f"{len(devices)} {kind} device(s) stand in for TPU:0..{len(devices) - 1}.{hint}"
            )
        raise ValueError(
            f"Device {device!r} is out of range: JAX has {len(devices)} {spec.device_type} "
            f"device(s), indices 0..{len(devices) - 1}.{hint}"
        )
    return devices[spec.device_index]


def validate(devices: Sequence[str]) -> None:
    for d in devices:
        jax_device(d)


def _check_local(device: str, spec: DeviceSpec) -> None:
    if spec.job != "localhost" or spec.task != 0 or spec.replica != 0:
        raise ValueError(
            f"Device {device!r} is on another worker; single-machine strategies take devices "
            "of this machine (/job:localhost/task:0). Multi-worker JAX is not supported yet."
        )
    if spec.device_type not in _PLATFORM_OF_TYPE:
        raise ValueError(
            f"The jax backend cannot place replicas on {device!r}: it maps CPU, GPU and TPU "
            "devices."
        )


def _available() -> list[str]:
    return [device_string(d) for kind in ("CPU", "GPU", "TPU") for d in platform_devices(kind)]


def default_kind() -> str:
    """The TF device type of JAX's default platform."""
    return device_type(jax.devices()[0])


def out_of_range_message(count: int, kind: str, available: int) -> str:
    hint = f" {_FORCE_FLAG_HINT}"
    if kind != "CPU":  # fewer accelerators than asked: both ways out
        hint = (
            f" Ask for at most {available} replica(s), or run on CPU devices with "
            f"JAX_PLATFORMS=cpu.{hint}"
        )
    return (
        f"MirroredStrategy({count}) needs {count} devices but JAX's default platform has "
        f"{available} {kind} device(s).{hint}"
    )
