"""Device strings for backends: TF's canonical names and their parts.

Core and every backend speak canonical TF device strings
(``/job:localhost/replica:0/task:0/device:GPU:0``). A backend parses the ones core
passes it with :class:`DeviceSpec` and maps them to its own devices.
"""

from polydist._base.devices import DeviceSpec as DeviceSpec
from polydist._base.devices import canonicalize as canonicalize

__all__ = ["DeviceSpec", "canonicalize"]
