"""Every worker of a multi-worker cluster checkpoints (should_checkpoint is True off the chief).

The rule lives in core (``MultiWorkerExtended.should_checkpoint``): patched
for this backend only.
"""

from __future__ import annotations

from polydist._distributed.multi_worker import MultiWorkerExtended

from ._support import MutantSim, is_mutant

_original = MultiWorkerExtended.should_checkpoint


def _should_checkpoint(self: MultiWorkerExtended) -> bool:
    if is_mutant(self._backend):
        return True
    return bool(_original.fget(self))  # type: ignore[attr-defined]


MultiWorkerExtended.should_checkpoint = property(_should_checkpoint)  # type: ignore[assignment,method-assign]


class MutantBackend(MutantSim):
    pass
