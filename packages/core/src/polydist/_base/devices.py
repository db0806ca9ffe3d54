"""Device strings in TF's form, canonicalised.

Backends name devices with canonical TF strings such as
``/job:localhost/replica:0/task:0/device:GPU:0``. Users may write any of TF's
short forms (``/gpu:0``, ``GPU:0``, ``/device:GPU:0``) or torch's ``cuda:0``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

__all__ = ["DeviceSpec", "canonicalize", "HOST_DEVICE"]

_TYPE_ALIASES = {"GPU": "GPU", "CUDA": "GPU", "CPU": "CPU", "TPU": "TPU", "XLA": "XLA"}

_PART = re.compile(
    r"^(?:(?P<job>job:[A-Za-z0-9_]+)|(?P<replica>replica:\d+)|(?P<task>task:\d+)"
    r"|(?:device:)?(?P<type>[A-Za-z_]+)(?::(?P<index>\d+|\*))?)$"
)


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed device: job, replica, task, device type and index."""

    job: str = "localhost"
    replica: int = 0
    task: int = 0
    device_type: str = "CPU"
    device_index: int = 0

    def to_string(self) -> str:
        return (
            f"/job:{self.job}/replica:{self.replica}/task:{self.task}"
            f"/device:{self.device_type}:{self.device_index}"
        )

    @staticmethod
    def parse(spec: str, *, job: str = "localhost", task: int = 0) -> DeviceSpec:
        """Parses any TF or torch spelling of a device."""
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(_bad(spec))
        text = spec.strip()
        fields: dict[str, object] = {"job": job, "replica": 0, "task": task}
        seen_type = False
        parts = [p for p in text.strip("/").split("/") if p]
        for part in parts:
            m = _PART.match(part)
            if m is None:
                raise ValueError(_bad(spec))
            if m.group("job"):
                fields["job"] = m.group("job").split(":", 1)[1]
            elif m.group("replica"):
                fields["replica"] = int(m.group("replica").split(":", 1)[1])
            elif m.group("task"):
                fields["task"] = int(m.group("task").split(":", 1)[1])
            else:
                dtype = _TYPE_ALIASES.get(m.group("type").upper())
                if dtype is None or seen_type:
                    raise ValueError(_bad(spec))
                seen_type = True
                fields["device_type"] = dtype
                index = m.group("index")
                fields["device_index"] = 0 if index in (None, "*") else int(index)
        if not seen_type:
            raise ValueError(_bad(spec))
        return DeviceSpec(**fields)  # type: ignore[arg-type]


def _bad(spec: object) -> str:
    return (
        f"Invalid device string {spec!r}: expected a device such as '/gpu:0', 'GPU:1', "
        "'cuda:0', '/cpu:0' or '/job:localhost/replica:0/task:0/device:TPU:3'."
    )


def canonicalize(spec: str, *, job: str = "localhost", task: int = 0) -> str:
    """Returns the canonical TF string for ``spec``, e.g. ``/gpu:1`` ->
    ``/job:localhost/replica:0/task:0/device:GPU:1``."""
    if not isinstance(spec, str):
        raise ValueError(_bad(spec))
    return _canonical(spec, job, task)


@functools.lru_cache(maxsize=1024)
def _canonical(spec: str, job: str, task: int) -> str:
    # Called on every reduce and placement with a handful of distinct strings.
    return DeviceSpec.parse(spec, job=job, task=task).to_string()


HOST_DEVICE = "/job:localhost/replica:0/task:0/device:CPU:0"
