"""``TPUStrategy`` on JAX: the local TPU cores, from the devices' physical coordinates.

On TPUs every JAX device knows its place in the TPU mesh: ``device.coords``
(the chip's ``x, y, z``) and ``device.core_on_chip``.
`polydist.tpu.LocalTPUSystem.from_devices` turns the devices into a
`polydist.tpu.Topology` whose TPU device ``k`` (TF's ``/device:TPU:k``) is
``devices[k]``, so a ``DeviceAssignment`` built from it
names physical cores: replica ``r`` runs on the device at
``core_assignment[r][0]`` (`polydist.tpu.assigned_devices`). The compiled
run's ``"replica"`` mesh follows ``worker_devices``, so mesh position ``r`` is
that device.

Without TPUs, the devices of JAX's default platform (CPU or GPU) stand in for
TPU cores, as the simulator's slices stand in for real ones: a chain of chips
``(i, 0, 0)`` with one core each, in JAX's device order.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from polydist.tpu import LocalTPUSystem
from polydist_jax import _devices

__all__ = ["local_tpu_system"]

# JAX's device_kind -> the generation names of polydist.tpu's slices.
_GENERATIONS = {"TPU v2": "v2", "TPU v3": "v3", "TPU v4": "v4", "TPU v5 lite": "v5e"}


@dataclasses.dataclass(frozen=True)
class _StandIn:
    """A CPU or GPU device as a TPU core: chip ``(index, 0, 0)``, core 0."""

    id: int
    index: int
    platform: str = "tpu"
    core_on_chip: int = 0

    @property
    def coords(self) -> tuple[int, int, int]:
        return (self.index, 0, 0)


@functools.cache
def local_tpu_system() -> LocalTPUSystem:
    """The TPU cores of ``TPUStrategy`` on JAX: its TPUs, or its default platform's
    devices standing in for them (cached: JAX's devices are fixed once it starts)."""
    if jax.process_count() > 1:
        raise NotImplementedError(
            f"TPUStrategy drives every TPU core from one process, but JAX runs "
            f"{jax.process_count()} processes here (one per host), each seeing only its own "
            "devices. Run a single-host TPU, or one process per host with "
            "MultiWorkerMirroredStrategy."
        )
    tpus = _devices.platform_devices("TPU")
    if tpus:
        kind = str(getattr(tpus[0], "device_kind", ""))
        return LocalTPUSystem.from_devices(tpus, generation=_GENERATIONS.get(kind, ""))
    devices = _devices.platform_devices(_devices.default_kind())
    return LocalTPUSystem.from_devices(
        [_StandIn(d.id, i) for i, d in enumerate(devices)],
        stand_ins=[_devices.device_string(d) for d in devices],
    )
