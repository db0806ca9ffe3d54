"""Storage layer of polydist checkpoints: named NumPy arrays on disk, written atomically.

Layout of a checkpoint root directory (format version 3)::

    root/
      checkpoint            JSON pointer file naming the latest complete checkpoint
      ckpt-1/
        manifest.json       format version, step, metadata, and per array: name, its
                            key in the tensors file, shape, dtype, encoding, nbytes,
                            sha256 of the stored bytes; last, the sha256 of the rest
        tensors.safetensors every array, written with the safetensors library
      ckpt-2/
      .polydist-tmp-*       leftovers of a writer that crashed; ignored by readers,
                            removed by the next writer
      .polydist-lock        advisory lock serialising writers (POSIX only)

The tensors file is a plain safetensors file: ``safetensors.numpy.load_file`` (or
safetensors' torch, JAX and other loaders) reads it without polydist, each tensor under
its variable's name.  Most dtypes are stored as themselves (bool, integers, float16/32/64,
complex64, bfloat16 as BF16); the rest by an encoding the manifest names (see
:func:`_encode`): the float8/float6/float4 dtypes of ml_dtypes by their bits (U8, as
safetensors' NumPy loader cannot read back its F8 types), complex128 as float64
(real, imaginary) pairs, any other dtype (long double) as its raw bytes.  Readers
decode them, so values come back bit for bit (NaN payloads, -0.0, byte order included).

Format versions 1 and 2 (polydist before safetensors) stored one plain ``.npy`` file
per array (``000000.npy``, ...; version 2 ml_dtypes floats by their bits, with a
``storage_dtype``).  They are still read; ``polydist checkpoint convert`` rewrites
them in version 3.  A reader refuses a version newer than it knows ("written by a
newer polydist") instead of misreading it.

Atomicity: a checkpoint is assembled in a temporary directory inside ``root``; every
file and the temporary directory are fsynced, the directory is renamed to
``ckpt-<step>`` and ``root`` is fsynced; only then is the pointer file replaced
(write a temporary file, fsync, ``os.replace``, fsync ``root``).  A ``ckpt-<step>``
directory therefore always holds a complete checkpoint and the pointer always names
one, whatever moment a writer is killed at.  Old checkpoints (``max_to_keep``) are
deleted only after the pointer names the new one, and are first renamed out of the
way so that a half-deleted directory never looks like a checkpoint.

Only one process may write into a root directory at a time (other writers on the
same host wait on ``.polydist-lock``).  Readers need no lock, but a reader of an old
checkpoint can fail if a concurrent writer prunes it (``max_to_keep``).
"""

from __future__ import annotations

import contextlib
import json
import operator
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from polydist.checkpoint._format import (
    _BASE_VERSION,
    _LOCK_NAME,
    _MANIFEST_FORMAT,
    _MANIFEST_NAME,
    _POINTER_FORMAT,
    _POINTER_NAME,
    _SAFETENSORS_VERSION,
    _TENSORS_NAME,
    _TMP_PREFIX,
    FORMAT_VERSION,
    ArraySpec,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointPathError,
    JSONLike,
    JSONValue,
    Manifest,
    PathLike,
    _dump_json,
    _encode,
    _normalize_json,
    _prepare_arrays,
    _with_checksum,
)
from polydist.checkpoint._read import (
    _parse_step,
    _sha256,
    latest_checkpoint,
    list_checkpoints,
    read_arrays,
    read_manifest,
    read_pointer,
)

if sys.platform != "win32":
    import fcntl

__all__ = [
    "FORMAT_VERSION",
    "ArraySpec",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointPathError",
    "JSONLike",
    "JSONValue",
    "Manifest",
    "latest_checkpoint",
    "list_checkpoints",
    "read_arrays",
    "delete_checkpoint",
    "read_manifest",
    "read_pointer",
    "write_arrays",
    "write_checkpoint",
]


# Test-only: if set, called as ``_test_hook(stage, detail)`` at points of a write
# ("tensors-started", "array-written", "manifest-written", "before-rename", "before-pointer",
# "pointer-tmp-written", "pointer-written") so that tests can kill a writer mid-save.
_test_hook: Callable[[str, str], None] | None = None


# --------------------------------------------------------------------------- helpers


def _hook(stage: str, detail: str = "") -> None:
    if _test_hook is not None:
        _test_hook(stage, detail)


def _fsync_dir(path: Path) -> None:
    if sys.platform == "win32":  # directories cannot be opened for fsync there
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file_durably(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def _writer_lock(root: Path) -> Iterator[None]:
    if sys.platform == "win32":
        yield
        return
    lock = root / _LOCK_NAME
    try:  # O_NOFOLLOW: a symlink planted as the lock must not make us create or lock its target
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if not lock.is_symlink():
            raise
        raise OSError(
            e.errno, f"the checkpoint's lock file is a symlink; remove it (it is never one): {lock}"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove_leftovers(root: Path) -> None:
    with os.scandir(root) as it:
        leftovers = [Path(e.path) for e in it if e.name.startswith(_TMP_PREFIX)]
    for p in leftovers:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()


# --------------------------------------------------------------------------- array files


def _write_tensors_file(
    path: Path, prepared: list[tuple[str, np.ndarray, np.dtype[Any] | None]], step: int
) -> list[dict[str, object]]:
    """Writes every array into one safetensors file (fsynced); the manifest's entries."""
    from safetensors.numpy import save_file  # only writers need it

    tensors: dict[str, np.ndarray] = {}
    items: list[dict[str, object]] = []
    for name, arr, ml_bits in prepared:
        stored, encoding = _encode(arr, ml_bits)
        # "__metadata__" is the safetensors header's own entry: store that name elsewhere.
        key = name if name != "__metadata__" else "__metadata__:0"
        while key in tensors:
            key += ":0"
        tensors[key] = stored
        item: dict[str, object] = {"name": name, "key": key, "shape": list(arr.shape)}
        item["dtype"] = arr.dtype.name if ml_bits is not None else arr.dtype.str
        item.update(encoding=encoding, nbytes=arr.nbytes, sha256=_sha256(stored))
        items.append(item)
    header = {"format": _MANIFEST_FORMAT, "step": str(step), "manifest": _MANIFEST_NAME}
    _hook("tensors-started", path.name)
    save_file(tensors, str(path), metadata=header)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    for name, _, _ in prepared:
        _hook("array-written", name)
    return items


# --------------------------------------------------------------------------- pointer


def _write_pointer(root: Path, name: str, extra: Mapping[str, JSONValue] | None = None) -> None:
    doc = {
        **(extra or {}),
        "format": _POINTER_FORMAT,
        "format_version": _BASE_VERSION,  # the pointer's layout is that of version 1
        "latest": name,
        "updated_unix": time.time(),
    }
    tmp = root / f"{_TMP_PREFIX}pointer-{uuid.uuid4().hex}"
    try:
        text = json.dumps(_with_checksum(doc), indent=1, ensure_ascii=True, allow_nan=False)
        _write_file_durably(tmp, (text + "\n").encode("utf-8"))
        _hook("pointer-tmp-written", name)
        os.replace(tmp, root / _POINTER_NAME)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(root)


# --------------------------------------------------------------------------- public API


def write_arrays(
    directory: PathLike,
    arrays: Mapping[str, np.ndarray[Any, Any] | np.generic[Any]],
    *,
    metadata: Mapping[str, JSONLike] | None = None,
    step: int | None = None,
    max_to_keep: int | None = None,
) -> Path:
    """Atomically write ``arrays`` as checkpoint ``directory/ckpt-<step>`` and make it latest.

    ``step`` defaults to one more than the highest step in ``directory`` (1 if none).
    An existing checkpoint of the same step is replaced unless it is the latest one
    (that raises CheckpointError: replacing it could not be atomic).  ``metadata``
    must be JSON-serialisable.  With ``max_to_keep``, the oldest (lowest step)
    checkpoints beyond that many are deleted once the new one is the latest.

    Returns the new checkpoint's directory.
    """
    root = Path(directory)
    prepared = _prepare_arrays(arrays)
    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a mapping with str keys, got {type(metadata)!r}")
    meta = _normalize_json(dict(metadata or {}), "")
    if step is not None:
        if isinstance(step, bool):
            raise TypeError("step must be an int, not bool")
        step = operator.index(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
    if max_to_keep is not None:
        if isinstance(max_to_keep, bool) or operator.index(max_to_keep) < 1:
            raise ValueError(f"max_to_keep must be None or an int >= 1, got {max_to_keep!r}")
        max_to_keep = operator.index(max_to_keep)

    _make_root(root)
    with _writer_lock(root):
        _remove_leftovers(root)
        if step is None:
            step = _next_step(root)
        final = _commit(root, f"ckpt-{step}", prepared, meta, step, pointer={})
        if max_to_keep is not None:
            _prune(root, keep=final.name, max_to_keep=max_to_keep)
    return final


def write_checkpoint(
    path: PathLike,
    arrays: Mapping[str, np.ndarray[Any, Any] | np.generic[Any]],
    *,
    step: int,
    metadata: Mapping[str, JSONLike] | None = None,
    pointer: Mapping[str, JSONLike] | None = None,
) -> Path:
    """Atomically writes ``arrays`` as the checkpoint directory ``path`` (any name).

    With ``pointer`` (a mapping, maybe empty), the pointer file of ``path``'s parent
    then names it as the latest, with ``pointer``'s entries added (what
    ``polydist.train.CheckpointManager`` records); without, no pointer is written
    (``polydist.train.Checkpoint.write``).  As :func:`write_arrays` otherwise.
    """
    final = Path(path)
    if not final.name or final.name.startswith(".") or final.name in (_POINTER_NAME, _LOCK_NAME):
        raise ValueError(
            f"cannot write a checkpoint to {final}: its last component must name the "
            f"checkpoint directory (not empty, not starting with '.', not {_POINTER_NAME!r}); "
            "pass a path such as 'ckpts/model'"
        )
    prepared = _prepare_arrays(arrays)
    meta = _normalize_json(dict(metadata or {}), "")
    extra = None if pointer is None else _normalize_json(dict(pointer), "(pointer)")
    if isinstance(step, bool) or operator.index(step) < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    root = final.parent
    _make_root(root)
    with _writer_lock(root):
        _remove_leftovers(root)
        return _commit(root, final.name, prepared, meta, operator.index(step), pointer=extra)


def _commit(
    root: Path,
    name: str,
    prepared: list[tuple[str, np.ndarray, np.dtype[Any] | None]],
    meta: JSONValue,
    step: int,
    *,
    pointer: JSONValue,
) -> Path:
    """Writes ``root/name`` atomically (the writer lock held); with ``pointer`` (a dict of
    extra entries, not None) the pointer file then names it."""
    final = root / name
    if os.path.lexists(final) and name == _current_latest_name(root):
        raise CheckpointError(
            f"{final} already exists and is the latest checkpoint; it cannot be replaced "
            "atomically. Write a different step, or delete it first"
        )

    tmp = root / f"{_TMP_PREFIX}{name}-{uuid.uuid4().hex}"
    tmp.mkdir()
    displaced: Path | None = None
    try:
        items = _write_tensors_file(tmp / _TENSORS_NAME, prepared, step)
        doc = {
            "format": _MANIFEST_FORMAT,
            "format_version": _SAFETENSORS_VERSION,
            "step": step,
            "created_unix": time.time(),
            "metadata": meta,
            "tensors_file": _TENSORS_NAME,
            "arrays": items,
        }
        text = _dump_json(_with_checksum(doc)) + "\n"
        _write_file_durably(tmp / _MANIFEST_NAME, text.encode("utf-8"))
        _hook("manifest-written", name)
        _fsync_dir(tmp)
        _hook("before-rename", name)
        if os.path.lexists(final):  # an older or never-committed one: move it aside
            displaced = root / f"{_TMP_PREFIX}replaced-{name}-{uuid.uuid4().hex}"
            os.rename(final, displaced)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if displaced is not None and not os.path.lexists(final):
            with contextlib.suppress(OSError):
                os.rename(displaced, final)  # put the displaced checkpoint back
        raise
    _fsync_dir(root)
    if displaced is not None:
        shutil.rmtree(displaced, ignore_errors=True)
    if isinstance(pointer, dict):
        _hook("before-pointer", name)
        _write_pointer(root, name, pointer)
        _hook("pointer-written", name)
    return final


def delete_checkpoint(path: PathLike) -> None:
    """Deletes the checkpoint directory ``path``; it stops looking like a checkpoint at
    once (renamed aside first), so a crash midway never leaves half of one."""
    p = Path(path)
    if not (p / _MANIFEST_NAME).is_file():
        return
    trash = p.parent / f"{_TMP_PREFIX}deleted-{p.name}-{uuid.uuid4().hex}"
    os.rename(p, trash)
    _fsync_dir(p.parent)
    shutil.rmtree(trash, ignore_errors=True)


def _make_root(root: Path) -> None:
    """Creates the checkpoint root; a file in its place is refused with a clear error."""
    for p in (root, *root.parents):
        if p.exists() and not p.is_dir():
            what = "is" if p == root else f"is inside {p}, which is"
            raise CheckpointPathError(
                f"cannot save a checkpoint to {root}: it {what} an existing file, not a "
                "directory. Checkpoints are directories (ckpt-<step>/ and a pointer file): "
                "pass a directory path (a new one is created), or move the file away"
            )
        if p.exists():
            break
    root.mkdir(parents=True, exist_ok=True)


def _next_step(root: Path) -> int:
    with os.scandir(root) as it:
        steps = [s for e in it if (s := _parse_step(e.name, "ckpt")) is not None]
    return max(steps, default=0) + 1


def _current_latest_name(root: Path) -> str | None:
    try:
        latest = latest_checkpoint(root)
    except CheckpointError:  # damaged pointer: the new write will replace it
        ckpts = list_checkpoints(root)
        latest = ckpts[-1] if ckpts else None
    return latest.name if latest is not None else None


def _prune(root: Path, keep: str, max_to_keep: int) -> None:
    others = [p for p in list_checkpoints(root, "ckpt") if p.name != keep]
    doomed = others[: max(0, len(others) - (max_to_keep - 1))]
    trash: list[Path] = []
    for p in doomed:  # rename first: a half-deleted directory must not look like a checkpoint
        t = root / f"{_TMP_PREFIX}deleted-{p.name}-{uuid.uuid4().hex}"
        os.rename(p, t)
        trash.append(t)
    if trash:
        _fsync_dir(root)
    for t in trash:
        shutil.rmtree(t, ignore_errors=True)
