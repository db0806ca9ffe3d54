"""polydist checkpoints: variables saved atomically as named arrays.

``save``/``restore`` (:mod:`polydist.checkpoint._save`) store a strategy's
variables; :mod:`polydist.checkpoint._io` has the on-disk layout (a safetensors
file beside a JSON manifest, readable by ``safetensors.numpy.load_file``) and
the atomicity argument. Values are stored bit for bit, ml_dtypes' bfloat16 and
float8_* included. ``polydist.train.Checkpoint`` and ``CheckpointManager``
(TF's object-based API) write the same format.
"""

from polydist.checkpoint._io import (
    FORMAT_VERSION,
    ArraySpec,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointPathError,
    JSONLike,
    JSONValue,
    Manifest,
    latest_checkpoint,
    list_checkpoints,
    read_arrays,
    read_manifest,
    write_arrays,
)
from polydist.checkpoint._save import CheckpointMismatchError, restore, save

__all__ = [
    "FORMAT_VERSION",
    "ArraySpec",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointPathError",
    "JSONLike",
    "JSONValue",
    "Manifest",
    "latest_checkpoint",
    "list_checkpoints",
    "read_arrays",
    "read_manifest",
    "restore",
    "save",
    "write_arrays",
]
