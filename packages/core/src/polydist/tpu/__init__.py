"""TPU topology, device assignment and a catalog of simulated TPU slices.

Pure Python (NumPy only) re-implementations of ``tf.tpu.experimental.Topology``,
``tf.tpu.experimental.DeviceAssignment`` and ``DeviceOrderMode``, plus
`simulated_slice` / `SIMULATED_SLICES`, which describe real Cloud TPU slice
shapes so that TPU code paths can run without TPU hardware, and
`LocalTPUSystem`, the TPU cores a backend on real devices (JAX, torch-xla)
runs ``TPUStrategy`` on. `initialize_tpu_system` and `shutdown_tpu_system` are
``tf.tpu.experimental``'s start-up and shut-down calls.
"""

from polydist.tpu._device_assignment import (
    SINGLE_CORE_ASSIGNMENT,
    DeviceAssignment,
    DeviceOrderMode,
    device_assignment,
)
from polydist.tpu._local import LocalTPUSystem, assigned_devices
from polydist.tpu._slices import SIMULATED_SLICES, SliceSpec, known_slice_names, simulated_slice
from polydist.tpu._system import initialize_tpu_system, shutdown_tpu_system
from polydist.tpu._topology import Topology

__all__ = [
    "SIMULATED_SLICES",
    "SINGLE_CORE_ASSIGNMENT",
    "DeviceAssignment",
    "DeviceOrderMode",
    "LocalTPUSystem",
    "SliceSpec",
    "Topology",
    "assigned_devices",
    "device_assignment",
    "initialize_tpu_system",
    "known_slice_names",
    "shutdown_tpu_system",
    "simulated_slice",
]
