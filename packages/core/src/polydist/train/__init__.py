"""polydist.train: TF's object-based checkpoints (``tf.train``).

``Checkpoint(**objects)`` saves and restores named objects (polydist Variables and
nests of them, nested Checkpoints, torch modules and optimizers through
``state_dict()``/``load_state_dict()``, objects with a ``variables`` sequence, and
classes registered with :func:`register_checkpointable`); ``CheckpointManager`` keeps
the newest ``max_to_keep`` of them; :func:`latest_checkpoint` finds the newest in a
directory. They write the format of :mod:`polydist.checkpoint`: a safetensors file
beside a JSON manifest, saved atomically.
"""

from polydist.train._checkpoint import (
    Checkpoint,
    CheckpointLoadStatus,
    InitializationOnlyStatus,
    register_checkpointable,
)
from polydist.train._manager import CheckpointManager, latest_checkpoint

__all__ = [
    "Checkpoint",
    "CheckpointLoadStatus",
    "CheckpointManager",
    "InitializationOnlyStatus",
    "latest_checkpoint",
    "register_checkpointable",
]
