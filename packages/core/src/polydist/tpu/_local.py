"""`LocalTPUSystem`: the TPU cores a backend runs ``TPUStrategy`` on.

A backend whose replicas run on real devices (JAX, torch-xla) describes them
with one of these, returned by its optional ``local_tpu_system()`` method (see
``docs/extending.md``). ``TPUClusterResolver("local")`` then reports these
cores instead of a simulated slice, and ``TPUStrategy`` maps its device
assignment onto them. The simulator has no such method: its local TPU is the
simulated slice named by ``$POLYDIST_LOCAL_TPU``.

Core ``k`` is the TF device ``/job:localhost/replica:0/task:0/device:TPU:k``
and sits at ``device_coordinates[k]`` of the mesh; the backend maps that name
to its own device.

Real TPU devices know their place in the mesh: JAX's ``jax.Device`` and
torch-xla's device attributes have ``coords`` (the chip's ``x, y, z``) and
``core_on_chip``. `LocalTPUSystem.from_devices` builds the system from such
devices, and `assigned_devices` finds the device of each (replica, logical
core) of a `DeviceAssignment`: the one at ``core_assignment[r][c]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from polydist.tpu._device_assignment import DeviceAssignment
from polydist.tpu._topology import MESH_RANK, Topology

__all__ = ["LocalTPUSystem", "assigned_devices", "physical_coordinates"]


def physical_coordinates(device: Any) -> tuple[int, int, int, int]:
    """``(x, y, z, core)`` of a TPU device: ``(*device.coords, device.core_on_chip)``.

    ``device`` is anything with ``platform == "tpu"``, ``coords`` and
    ``core_on_chip`` (a ``jax.Device`` on TPU, for one).
    """
    platform = getattr(device, "platform", None)
    if platform != "tpu":
        raise ValueError(
            f"{device!r} is a {platform!r} device; only TPU devices have mesh coordinates "
            "(device.coords, device.core_on_chip)."
        )
    coords = tuple(int(c) for c in device.coords)
    if len(coords) != 3:
        raise ValueError(f"{device!r} has coords {coords}; a TPU chip's coordinates are (x, y, z).")
    return (coords[0], coords[1], coords[2], int(device.core_on_chip))


def assigned_devices(
    devices: Sequence[Any], device_assignment: DeviceAssignment | None = None
) -> tuple[tuple[Any, ...], ...]:
    """``[replica][logical_core]``: the device that runs each logical core.

    Without an assignment, replica ``r`` runs on ``devices[r]``. With one, on the
    device whose `physical_coordinates` are ``core_assignment[r][c]``.
    """
    if device_assignment is None:
        return tuple((d,) for d in devices)
    at: dict[tuple[int, ...], Any] = {physical_coordinates(d): d for d in devices}
    out = []
    for r in range(device_assignment.num_replicas):
        row = []
        for c in range(device_assignment.num_cores_per_replica):
            position = device_assignment.coordinates(r, c)
            device = at.get(position)
            if device is None:
                raise ValueError(
                    f"The device assignment puts replica {r}, logical core {c} at (x, y, z, "
                    f"core) = {position}, where there is no TPU device. Build it from these "
                    "devices' topology (LocalTPUSystem.from_devices(devices).topology())."
                )
            row.append(device)
        out.append(tuple(row))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class LocalTPUSystem:
    """The TPU cores attached to this process, as a backend sees them.

    Attributes:
      mesh_shape: ``(x, y, z, cores_per_chip)``, the physical mesh.
      device_coordinates: core ``k``'s ``(x, y, z, core)`` position in the mesh,
        for ``k = 0 .. num_cores - 1``.
      generation: the TPU generation (``"v4"``, ...) for
        ``TPUExtended.tpu_hardware_feature``; ``""`` if unknown.
      stand_ins: ``()`` on real TPUs. Where the backend has no TPUs, the
        backend devices that stand in for the cores (``stand_ins[k]`` runs core
        ``k``), as the simulator's slices stand in for real ones.
    """

    mesh_shape: tuple[int, int, int, int]
    device_coordinates: tuple[tuple[int, int, int, int], ...]
    generation: str = ""
    stand_ins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.device_coordinates:
            raise ValueError("A LocalTPUSystem needs at least one core; got no coordinates.")
        for k, coords in enumerate(self.device_coordinates):
            if len(coords) != MESH_RANK:
                raise ValueError(
                    f"device_coordinates[{k}] = {coords} must be {MESH_RANK} integers "
                    "(x, y, z, core)."
                )
        if self.stand_ins and len(self.stand_ins) != len(self.device_coordinates):
            raise ValueError(
                f"stand_ins names {len(self.stand_ins)} devices for "
                f"{len(self.device_coordinates)} cores; give one per core, or () on real TPUs."
            )
        self.topology()  # rejects coordinates outside the mesh and duplicates

    @classmethod
    def from_devices(
        cls, devices: Sequence[Any], *, generation: str = "", stand_ins: Sequence[str] = ()
    ) -> LocalTPUSystem:
        """The system whose core ``k`` is ``devices[k]``, placed at its
        `physical_coordinates`; the mesh spans ``0 .. max + 1`` along each axis."""
        if not devices:
            raise ValueError("A LocalTPUSystem needs at least one TPU device; got none.")
        positions = [physical_coordinates(d) for d in devices]
        first: dict[tuple[int, int, int, int], Any] = {}
        for device, position in zip(devices, positions, strict=True):
            other = first.setdefault(position, device)
            if other is not device:
                raise ValueError(
                    f"Devices {getattr(other, 'id', other)!r} and "
                    f"{getattr(device, 'id', device)!r} are both at (x, y, z, core) = "
                    f"{position}; each TPU core has its own place."
                )
        x, y, z, core = (max(p[axis] for p in positions) + 1 for axis in range(MESH_RANK))
        return cls(
            mesh_shape=(x, y, z, core),
            device_coordinates=tuple(positions),
            generation=generation,
            stand_ins=tuple(stand_ins),
        )

    @property
    def num_cores(self) -> int:
        """The number of TPU cores (TF TPU devices)."""
        return len(self.device_coordinates)

    @property
    def is_stand_in(self) -> bool:
        """True where other devices stand in for TPU cores (no TPU here)."""
        return bool(self.stand_ins)

    def topology(self) -> Topology:
        """The `Topology`: one task, whose TPU device ``k`` is core ``k``."""
        return Topology(
            mesh_shape=self.mesh_shape, device_coordinates=[list(self.device_coordinates)]
        )
