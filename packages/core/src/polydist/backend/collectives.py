"""What a backend's collectives need from core: the pack sizes of a nest's
``all_reduce`` (as TF packs them) and the ``CommunicationOptions`` of the call being
issued.

``pack_by_size`` and ``pack_by_dtype`` split a nest's arrays into the packs TF would
send; ``current_call_options`` returns the options passed to the collective being
issued now (``ReplicaContext.all_reduce(..., options=...)``), and ``bytes_per_pack``
merges them over the strategy's as TF does. ``batch_all_reduce`` calls a backend's
``all_reduce`` once per column, or its ``batch_all_reduce`` where it has one.
"""

from polydist._base.communication import bytes_per_pack as bytes_per_pack
from polydist._base.communication import current_call_options as current_call_options
from polydist.backend._contract import batch_all_reduce as batch_all_reduce
from polydist.backend._contract import pack_by_dtype as pack_by_dtype
from polydist.backend._contract import pack_by_size as pack_by_size

__all__ = [
    "batch_all_reduce",
    "bytes_per_pack",
    "current_call_options",
    "pack_by_dtype",
    "pack_by_size",
]
