"""``polydist.train.CheckpointManager`` and ``latest_checkpoint``: keeping the newest
``max_to_keep`` checkpoints of a ``polydist.train.Checkpoint`` (TF's
``tf.train.CheckpointManager``).
"""

from __future__ import annotations

import os
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from polydist._collectives.check import collective_purpose
from polydist._valuetypes.variables import Variable
from polydist.checkpoint._io import (
    CheckpointNotFoundError,
    delete_checkpoint,
    read_pointer,
)
from polydist.checkpoint._io import (
    latest_checkpoint as _latest_path,
)
from polydist.checkpoint._save import (
    _saved_value,
)
from polydist.train._checkpoint import (
    Checkpoint,
)


def latest_checkpoint(
    checkpoint_dir: str | os.PathLike[str], latest_filename: Any = None
) -> str | None:
    """The path of the latest checkpoint in ``checkpoint_dir`` (as ``save`` returned it),
    or None if there is none (TF's ``tf.train.latest_checkpoint``)."""
    try:
        path = _latest_path(checkpoint_dir)
    except CheckpointNotFoundError as e:
        warnings.warn(f"latest_checkpoint: {e}", UserWarning, stacklevel=2)
        return None
    return None if path is None else os.fspath(path)


class CheckpointManager:
    """Keeps the newest ``max_to_keep`` checkpoints of a ``Checkpoint`` in ``directory``
    (TF's ``tf.train.CheckpointManager``).

    Args:
        checkpoint: the ``Checkpoint`` to save and restore.
        directory: where checkpoints go (``<directory>/<checkpoint_name>-<n>``).
        max_to_keep: how many to keep (the newest); ``None`` keeps all.
        keep_checkpoint_every_n_hours: also keep one checkpoint every this many hours.
        checkpoint_name: the checkpoints' name prefix.
        step_counter: a Variable read by ``save`` when ``checkpoint_interval`` is set.
        checkpoint_interval: save only when ``step_counter`` advanced by this much.
        init_fn: called by ``restore_or_initialize`` when there is no checkpoint.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: str | os.PathLike[str],
        max_to_keep: int | None,
        keep_checkpoint_every_n_hours: float | None = None,
        checkpoint_name: str = "ckpt",
        step_counter: Any = None,
        checkpoint_interval: int | None = None,
        init_fn: Callable[[], Any] | None = None,
    ) -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(
                f"CheckpointManager: checkpoint must be a polydist.train.Checkpoint, got "
                f"{type(checkpoint).__qualname__}; wrap the objects: Checkpoint(model=model)"
            )
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or max_to_keep <= 0):
            raise ValueError(
                f"Expected a positive integer or `None` for `max_to_keep`, got {max_to_keep!r}."
            )
        if checkpoint_interval is not None and step_counter is None:
            raise ValueError(
                "`step_counter` should be passed if `checkpoint_interval` is not None."
            )
        if not checkpoint_name or "/" in checkpoint_name or checkpoint_name.startswith("."):
            raise ValueError(
                f"checkpoint_name must be a plain name such as 'ckpt', got {checkpoint_name!r}"
            )
        self._checkpoint = checkpoint
        self._directory = os.fspath(directory)
        self._max_to_keep = max_to_keep
        self._keep_hours = keep_checkpoint_every_n_hours
        self._name = checkpoint_name
        self._step_counter = step_counter
        self._checkpoint_interval = checkpoint_interval
        self._init_fn = init_fn
        self._last_checkpoint_step: int | None = None
        self._maybe_delete: OrderedDict[str, float] = OrderedDict()
        now = time.time()
        self._last_preserved = now
        self._latest: str | None = None
        pointer = read_pointer(self._directory)
        if pointer is not None:
            root = Path(self._directory)
            latest = pointer.get("latest")
            if isinstance(latest, str) and (root / latest / "manifest.json").is_file():
                self._latest = os.fspath(root / latest)
            names = pointer.get("all")
            stamps = pointer.get("timestamps")
            preserved = pointer.get("last_preserved_timestamp")
            # TF's CheckpointState: a state without one reads as 0 (every one managed)
            self._last_preserved = float(preserved) if isinstance(preserved, (int, float)) else 0.0
            if isinstance(names, list):
                if not isinstance(stamps, list) or len(stamps) != len(names):
                    stamps = [self._last_preserved] * len(names)
                for n, t in zip(names, stamps):
                    if not isinstance(n, str) or not isinstance(t, (int, float)):
                        continue
                    if not (root / n / "manifest.json").is_file():
                        continue
                    t = min(float(t), now)
                    if t > self._last_preserved:
                        self._maybe_delete[os.fspath(root / n)] = t

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    @property
    def checkpoint_interval(self) -> int | None:
        return self._checkpoint_interval

    @property
    def latest_checkpoint(self) -> str | None:
        """The path of the newest checkpoint, or None."""
        return self._latest

    @property
    def checkpoints(self) -> list[str]:
        """The managed checkpoints, oldest first (those kept by
        ``keep_checkpoint_every_n_hours`` are no longer managed)."""
        return list(self._maybe_delete)

    def _record_state(self) -> dict[str, Any]:
        return {
            "all": [Path(p).name for p in self._maybe_delete],
            "timestamps": list(self._maybe_delete.values()),
            "last_preserved_timestamp": self._last_preserved,
        }

    def save(
        self, checkpoint_number: Any = None, check_interval: bool = True, options: Any = None
    ) -> str | None:
        """Saves a checkpoint numbered ``checkpoint_number`` (default the incremented
        ``save_counter``) and deletes the oldest beyond ``max_to_keep``. Returns its path,
        or None when ``checkpoint_interval`` says it is not yet time. A save that raises
        leaves the manager as it was (``checkpoints``, the interval's last step), so a
        retry saves; ``save_counter`` stays incremented, as in TF."""
        last_step = self._last_checkpoint_step
        if self._checkpoint_interval is not None:
            current = int(np.asarray(_value(self._step_counter)))
            if self._last_checkpoint_step is not None:
                if current == self._last_checkpoint_step:
                    return None
                if (
                    check_interval
                    and current < self._last_checkpoint_step + self._checkpoint_interval
                ):
                    return None
            self._last_checkpoint_step = current
        try:
            with collective_purpose("checkpoint save"):  # see checkpoint.save
                return self._save(checkpoint_number)
        except BaseException:
            self._last_checkpoint_step = last_step
            raise

    def _save(self, checkpoint_number: Any) -> str:
        counter = self._checkpoint.save_counter
        counter.assign(np.asarray(self._checkpoint._counter_value() + 1, dtype=counter.dtype))
        number = (
            self._checkpoint._counter_value()
            if checkpoint_number is None
            else int(np.asarray(_value(checkpoint_number)))
        )
        path = os.fspath(Path(self._directory) / f"{self._name}-{number}")
        kept = self._maybe_delete.copy()
        self._maybe_delete.pop(path, None)
        self._maybe_delete[path] = time.time()  # the record written lists it
        try:
            out = self._checkpoint._write_to(Path(path), number, self._record_state())
        except BaseException:
            self._maybe_delete = kept
            raise
        self._latest = path
        if out is None:
            # not the chief: it wrote nothing, so deletes nothing, but lists what the chief keeps
            self._sweep(delete=False)
            return path
        self._sweep()
        from polydist.checkpoint._io import _write_pointer  # the same pointer, pruned

        _write_pointer(Path(self._directory), Path(path).name, self._record_state())
        return path

    def _sweep(self, delete: bool = True) -> None:
        if not self._max_to_keep:
            return
        while len(self._maybe_delete) > self._max_to_keep:
            path, stamp = self._maybe_delete.popitem(last=False)
            if self._keep_hours and stamp - self._keep_hours * 3600.0 >= self._last_preserved:
                self._last_preserved = stamp
                continue
            if delete:
                delete_checkpoint(path)

    def restore_or_initialize(self) -> str | None:
        """Restores the latest checkpoint and returns its path; without one, calls
        ``init_fn`` (if given) and returns None."""
        if self._latest is not None:
            self._checkpoint.restore(self._latest)
            if self._checkpoint_interval is not None:
                self._last_checkpoint_step = int(np.asarray(_value(self._step_counter)))
            return self._latest
        # A worker that finds none while another restores one fails here, on every worker.
        self._checkpoint._agree(None, self._directory)
        if self._init_fn is not None:
            self._init_fn()
        return None


def _value(x: Any) -> Any:
    if isinstance(x, Variable):
        return _saved_value(x)
    return x
