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
import difflib
import hashlib
import importlib
import json
import math
import operator
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any, NamedTuple, TypeAlias, TypeGuard

import numpy as np

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

#: Newest version of the on-disk format this module reads and writes.  A manifest is
#: written with the lowest version that can describe it: 1 (the pointer file, and
#: checkpoints of NumPy dtypes only) or 2 (it holds ml_dtypes arrays stored by their bits).
FORMAT_VERSION = 3
_BASE_VERSION = 1
_ML_DTYPES_VERSION = 2  # first version with storage_dtype entries
_SAFETENSORS_VERSION = 3  # tensors in one safetensors file

_MANIFEST_FORMAT = "polydist.checkpoint"
_POINTER_FORMAT = "polydist.checkpoint.pointer"
_MANIFEST_NAME = "manifest.json"
_TENSORS_NAME = "tensors.safetensors"
_POINTER_NAME = "checkpoint"
_CHECKSUM_KEY = "sha256_of_the_rest"
_TMP_PREFIX = ".polydist-tmp-"
_LOCK_NAME = ".polydist-lock"
# ``<name>-<number>``: ckpt-3 (write_arrays), and train.Checkpoint.save's "<prefix>-<n>".
_CKPT_RE = re.compile(r"(?!\.)([^/\\]+?)-(0|[1-9][0-9]*)")
_FILE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.npy")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_SUPPORTED_KINDS = "biufc"  # bool, signed/unsigned integer, floating, complex
_ML_NAME_RE = re.compile(r"[a-z][a-z0-9_]*")
_ML_FLOAT_PREFIXES = ("bfloat", "float")

# Arrays are streamed to and from disk in pieces of this many bytes.
_CHUNK_BYTES = 16 * 1024 * 1024

# Test-only: if set, called as ``_test_hook(stage, detail)`` at points of a write
# ("tensors-started", "array-written", "manifest-written", "before-rename", "before-pointer",
# "pointer-tmp-written", "pointer-written") so that tests can kill a writer mid-save.
_test_hook: Callable[[str, str], None] | None = None

JSONValue: TypeAlias = bool | int | float | str | list["JSONValue"] | dict[str, "JSONValue"] | None
"""A JSON value as read back from a manifest."""

JSONLike: TypeAlias = (
    bool | int | float | str | Sequence["JSONLike"] | Mapping[str, "JSONLike"] | None
)
"""What ``metadata`` may hold: JSON values; tuples are stored as lists."""

PathLike: TypeAlias = str | os.PathLike[str]


# --------------------------------------------------------------------------- errors


class CheckpointError(Exception):
    """Base class of checkpoint storage errors."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint where one was expected."""


class CheckpointPathError(CheckpointError, FileExistsError):
    """A checkpoint would be written where a file (not a directory) is."""


class CheckpointCorruptError(CheckpointError, ValueError):
    """A checkpoint is damaged: unreadable manifest, missing/truncated file, bad checksum."""


# --------------------------------------------------------------------------- manifest


class ArraySpec(NamedTuple):
    """Shape and dtype of one stored array."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Manifest:
    """What a checkpoint holds, read without loading any array data."""

    path: Path
    """The checkpoint directory (``.../ckpt-<step>``)."""
    step: int
    arrays: Mapping[str, ArraySpec]
    """Variable name -> (shape, dtype), in the order they were written."""
    metadata: Mapping[str, JSONValue]
    format_version: int = FORMAT_VERSION

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.arrays)


@dataclass(frozen=True)
class _Entry:
    name: str
    file: str
    """The data file: the .npy file (versions 1, 2) or the safetensors file (version 3)."""
    spec: ArraySpec
    sha256: str
    storage: np.dtype[Any]
    """The dtype of the stored data: ``spec.dtype``, or the bits of an ml_dtypes dtype
    (.npy), or what :func:`_encode` stores it as (safetensors)."""
    key: str = ""
    """The tensor's name in the safetensors file (version 3)."""
    encoding: str = ""
    """How the tensor holds the value (version 3): see :func:`_encode`."""


# --------------------------------------------------------------------------- helpers


def _hook(stage: str, detail: str = "") -> None:
    if _test_hook is not None:
        _test_hook(stage, detail)


def _parse_step(name: str, prefix: str | None = None) -> int | None:
    """The number of a ``<prefix>-<number>`` checkpoint name (any prefix if None)."""
    m = _CKPT_RE.fullmatch(name)
    if m is None or (prefix is not None and m.group(1) != prefix):
        return None
    return int(m.group(2))


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


def _describe_available(root: Path, exclude: str | None = None, limit: int = 10) -> str:
    ckpts = [p for p in list_checkpoints(root) if p.name != exclude]
    if not ckpts:
        return f"no other checkpoint is available in {root}"
    shown = ckpts[-limit:]
    more = f" (and {len(ckpts) - len(shown)} older)" if len(ckpts) > len(shown) else ""
    return f"available checkpoints in {root}: " + ", ".join(p.name for p in shown) + more


def _restore_hint(ckpt_dir: Path) -> str:
    others = [p for p in list_checkpoints(ckpt_dir.parent) if p.name != ckpt_dir.name]
    if not others:
        return f"no other checkpoint is available in {ckpt_dir.parent} to restore from"
    return "restore from an earlier checkpoint; " + _describe_available(
        ckpt_dir.parent, exclude=ckpt_dir.name
    )


def _fmt_spec(shape: Sequence[int], dtype: np.dtype[Any]) -> str:
    return f"shape {tuple(shape)} dtype {dtype.str} ({dtype.name})"


# --------------------------------------------------------------------------- validation


_SUPPORTED = (
    "supported are bool, NumPy's integer, floating and complex dtypes, and ml_dtypes' "
    "floats (bfloat16, float8_*, float6_*, float4_e2m1fn)"
)


def _ml_float_bits(dtype: np.dtype[Any]) -> tuple[int | None, bool]:
    """(bits per element, is a float) of an ml_dtypes dtype; bits None for a dtype that
    is not ml_dtypes' or not a real number (complex32)."""
    # An ml_dtypes dtype exists only once ml_dtypes is imported: never import it here.
    ml = sys.modules.get("ml_dtypes")
    if ml is None:
        return None, False
    if not _ML_NAME_RE.fullmatch(dtype.name) or getattr(ml, dtype.name, None) is None:
        return None, False
    if np.dtype(getattr(ml, dtype.name)) != dtype:
        return None, False
    is_float = dtype.name.startswith(_ML_FLOAT_PREFIXES)
    try:
        bits = int((ml.finfo if is_float else ml.iinfo)(dtype).bits)
    except (TypeError, ValueError):  # complex32 and other non-real types
        return None, False
    return bits, is_float


def _check_dtype(dtype: np.dtype[Any], name: str) -> np.dtype[Any] | None:
    """Refuses dtypes a checkpoint cannot hold; for an ml_dtypes float, returns the
    unsigned integer dtype its bits are stored as (None for NumPy's own dtypes)."""
    if dtype.isbuiltin == 2:  # a NumPy extension dtype, such as ml_dtypes'
        bits, is_float = _ml_float_bits(dtype)
        if bits is not None and bits < 8 * dtype.itemsize and not is_float:
            # Variables refuse these too; sub-byte floats are stored a byte per element.
            raise TypeError(
                f"variable {name!r}: dtype {dtype.name} cannot be checkpointed: it is one of "
                f"ml_dtypes' sub-byte integer dtypes ({bits} bits per element; int4, uint4, "
                f"int2, ...), which checkpoints do not store; {_SUPPORTED}. Cast it first, "
                "e.g. with .astype(np.int8)"
            )
        if bits is None or not is_float:
            raise TypeError(
                f"variable {name!r}: dtype {dtype.name} cannot be checkpointed; "
                f"{_SUPPORTED} (cast it, e.g. with .astype(np.float32))"
            )
        return np.dtype(f"u{dtype.itemsize}")
    if dtype.kind not in _SUPPORTED_KINDS or dtype.fields is not None or dtype.subdtype:
        raise TypeError(
            f"variable {name!r}: dtype {dtype!r} cannot be checkpointed; {_SUPPORTED} "
            "(cast it, e.g. with .astype(np.float32))"
        )
    return None


def _ml_dtype_for_reading(
    dtype_name: str, path: Path, where: str, bad: Callable[[str], CheckpointCorruptError]
) -> np.dtype[Any]:
    """ml_dtypes' dtype named ``dtype_name``, imported only now that a checkpoint has one."""
    try:
        ml: ModuleType = importlib.import_module("ml_dtypes")
    except ImportError:
        raise CheckpointError(
            f"{path}: {where} is stored as {dtype_name}, a dtype of the ml_dtypes package, "
            "which is not installed: pip install ml_dtypes to read this checkpoint"
        ) from None
    scalar = getattr(ml, dtype_name, None)
    if scalar is None:
        version = getattr(ml, "__version__", "?")
        raise CheckpointError(
            f"{path}: {where} is stored as {dtype_name}, which the installed ml_dtypes {version} "
            "does not define: upgrade it (pip install -U ml_dtypes) to read this checkpoint"
        )
    try:
        dtype: np.dtype[Any] = np.dtype(scalar)
    except TypeError:
        dtype = np.dtype(np.void)
    bits, is_float = _ml_float_bits(dtype)
    if dtype.name != dtype_name or bits is None or not is_float:
        raise bad(f"{where}: unsupported dtype {dtype_name!r} (not an ml_dtypes float)")
    return dtype


def _prepare_arrays(
    arrays: Mapping[str, np.ndarray[Any, Any] | np.generic[Any]],
) -> list[tuple[str, np.ndarray, np.dtype[Any] | None]]:
    if not isinstance(arrays, Mapping):
        raise TypeError(f"arrays must be a mapping of name -> np.ndarray, got {type(arrays)!r}")
    out: list[tuple[str, np.ndarray, np.dtype[Any] | None]] = []
    for name, value in arrays.items():
        if not isinstance(name, str):
            raise TypeError(f"array names must be str, got {name!r} ({type(name).__name__})")
        if isinstance(value, np.ma.MaskedArray):
            raise TypeError(f"variable {name!r}: masked arrays cannot be checkpointed")
        if not isinstance(value, (np.ndarray, np.generic)):
            raise TypeError(
                f"variable {name!r}: expected a NumPy array, got {type(value).__name__}; "
                "convert it with np.asarray(...) first"
            )
        arr = np.asarray(value)
        out.append((name, arr, _check_dtype(arr.dtype, name)))
    return out


def _normalize_json(value: object, where: str) -> JSONValue:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"metadata{where} = {value!r}: JSON has no NaN or infinity")
        return float(value)
    if isinstance(value, Mapping):
        obj: dict[str, JSONValue] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"metadata{where}: keys must be str, got {k!r}")
            obj[k] = _normalize_json(v, f"{where}[{k!r}]")
        return obj
    if isinstance(value, (list, tuple)):
        return [_normalize_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    hint = " (convert NumPy scalars with .item())" if isinstance(value, np.generic) else ""
    raise TypeError(
        f"metadata{where}: {type(value).__name__} is not JSON-serialisable; use None, bool, "
        f"int, float, str, list/tuple or dict with str keys{hint}"
    )


# --------------------------------------------------------------------------- array files


def _iter_chunks(arr: np.ndarray) -> Iterator[np.ndarray]:
    """The C-order bytes of ``arr`` as uint8 arrays of at most about _CHUNK_BYTES."""
    if arr.size == 0:
        return
    if arr.flags.c_contiguous:
        flat = arr.reshape(-1).view(np.uint8)
        for start in range(0, flat.size, _CHUNK_BYTES):
            yield flat[start : start + _CHUNK_BYTES]
    else:  # ndim >= 1: copy blocks of leading-axis rows, never the whole array
        rows = max(1, _CHUNK_BYTES // max(1, arr[0].nbytes))
        for start in range(0, arr.shape[0], rows):
            block = np.ascontiguousarray(arr[start : start + rows])
            yield block.reshape(-1).view(np.uint8)


# safetensors' NumPy loader (``safetensors.numpy.load_file``) reads these dtypes back as
# themselves; bfloat16 as ml_dtypes' (safetensors' BF16).  Others are encoded, see _encode.
_NATIVE_KINDS = "biu"
_NATIVE_FLOATS = frozenset({"f2", "f4", "f8", "c8"})
_ENCODINGS = ("native", "bits", "complex", "bytes")


def _encode(arr: np.ndarray, ml_bits: np.dtype[Any] | None) -> tuple[np.ndarray, str]:
    """The little-endian, C-contiguous array safetensors stores for ``arr``, and how.

    ``native``: the array itself (bool, integers, float16/32/64, complex64, bfloat16).
    ``bits``: an ml_dtypes float safetensors' NumPy loader cannot read back (float8_*,
    float6_*, float4_e2m1fn), as the unsigned integers of its bits (U8).
    ``complex``: complex128 as float64 (real, imaginary) pairs, a trailing axis of 2.
    ``bytes``: any other dtype (long double, complex long double) as its raw bytes, a
    trailing axis of ``itemsize`` uint8.  The manifest names the real dtype.
    """
    dtype = arr.dtype
    if ml_bits is not None:
        if dtype.name == "bfloat16":  # (ascontiguousarray makes a 0-d array 1-d: reshape)
            return np.ascontiguousarray(arr).reshape(arr.shape), "native"
        flat = np.ascontiguousarray(arr).reshape(-1).view(ml_bits)
        return flat.astype(ml_bits.newbyteorder("<"), copy=False).reshape(arr.shape), "bits"
    little = dtype.newbyteorder("<") if dtype.byteorder != "|" else dtype
    if dtype.kind in _NATIVE_KINDS or little.str[1:] in _NATIVE_FLOATS:
        return np.ascontiguousarray(arr, dtype=little).reshape(arr.shape), "native"
    if little.str == "<c16":
        flat = np.ascontiguousarray(arr, dtype=little).reshape(-1).view("<f8")
        return flat.reshape((*arr.shape, 2)), "complex"
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return flat.reshape((*arr.shape, dtype.itemsize)), "bytes"


def _stored_dtype(dtype: np.dtype[Any], encoding: str) -> np.dtype[Any]:
    """The dtype (native byte order) safetensors hands back for a tensor stored as ``encoding``."""
    if encoding == "native":
        return dtype if dtype.isbuiltin == 2 else dtype.newbyteorder("=")
    if encoding == "bits":
        return np.dtype(f"u{dtype.itemsize}")
    if encoding == "complex":
        return np.dtype(np.float64)
    return np.dtype(np.uint8)


def _stored_shape(spec: ArraySpec, encoding: str) -> tuple[int, ...]:
    if encoding == "complex":
        return (*spec.shape, 2)
    if encoding == "bytes":
        return (*spec.shape, spec.dtype.itemsize)
    return spec.shape


def _decode(tensor: np.ndarray, entry: _Entry) -> np.ndarray:
    spec = entry.spec
    if entry.encoding == "native":
        return tensor.astype(spec.dtype, copy=False)
    flat = np.ascontiguousarray(tensor).reshape(-1)
    if entry.encoding == "bits":
        return flat.view(spec.dtype).reshape(spec.shape)
    if entry.encoding == "complex":
        return flat.view(np.complex128).reshape(spec.shape).astype(spec.dtype, copy=False)
    return flat.view(spec.dtype).reshape(spec.shape)


def _sha256(arr: np.ndarray) -> str:
    digest = hashlib.sha256()
    for chunk in _iter_chunks(arr):
        digest.update(chunk.data)
    return digest.hexdigest()


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


def _read_tensors(ckpt_dir: Path, entries: Sequence[_Entry]) -> dict[str, np.ndarray]:
    """The arrays of ``entries`` from a version 3 checkpoint's safetensors file, verified."""
    from safetensors import safe_open  # only version 3 readers need it

    out: dict[str, np.ndarray] = {}
    if not entries:
        return out
    path = ckpt_dir / entries[0].file
    if not path.is_file():
        raise CheckpointCorruptError(
            f"{path} is missing (file deleted?): it holds the tensors of "
            + ", ".join(repr(e.name) for e in entries[:5])
            + ("..." if len(entries) > 5 else "")
            + "; "
            + _restore_hint(ckpt_dir)
        )
    try:
        with safe_open(str(path), framework="np") as f:
            for entry in entries:
                where = f"variable {entry.name!r} (tensor {entry.key!r} of {path})"
                tensor = f.get_tensor(entry.key)
                want = (_stored_shape(entry.spec, entry.encoding), entry.storage)
                if (tuple(tensor.shape), tensor.dtype) != want:
                    raise CheckpointCorruptError(
                        f"{where}: the manifest says {_fmt_spec(*want)} but the file holds "
                        f"{_fmt_spec(tensor.shape, tensor.dtype)} (file damaged or replaced?); "
                        + _restore_hint(ckpt_dir)
                    )
                found = _sha256(tensor)
                if found != entry.sha256:
                    raise CheckpointCorruptError(
                        f"{where}: checksum mismatch (file damaged?): the manifest expects "
                        f"sha256 {entry.sha256}, the file has {found}; " + _restore_hint(ckpt_dir)
                    )
                out[entry.name] = _decode(tensor, entry)
    except CheckpointCorruptError:
        raise
    except Exception as e:  # safetensors' errors on damaged bytes: SafetensorError and others
        raise CheckpointCorruptError(
            f"{path}: the safetensors file is unreadable ({type(e).__name__}: {e}) "
            "(file damaged or truncated?); " + _restore_hint(ckpt_dir)
        ) from None
    return out


def _read_array_file(ckpt_dir: Path, entry: _Entry) -> np.ndarray:
    path = ckpt_dir / entry.file
    name, spec = entry.name, entry.spec
    try:
        f = open(path, "rb")  # noqa: SIM115 -- closed by the with below
    except FileNotFoundError:
        raise CheckpointCorruptError(
            f"variable {name!r}: its data file {path} is missing (file deleted?); "
            + _restore_hint(ckpt_dir)
        ) from None
    with f:
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f"unsupported .npy format version {version}")
        except Exception as e:  # NumPy's header parser raises many kinds
            # (ValueError, SyntaxError, tokenize.TokenError, TypeError, ...) on damaged bytes.
            raise CheckpointCorruptError(
                f"variable {name!r}: the header of {path} is unreadable "
                f"({type(e).__name__}: {e}) (file damaged?); " + _restore_hint(ckpt_dir)
            ) from None
        if tuple(shape) != spec.shape or dtype != entry.storage or fortran:
            found = _fmt_spec(shape, dtype) + (" Fortran order" if fortran else "")
            raise CheckpointCorruptError(
                f"variable {name!r}: the manifest says {_fmt_spec(spec.shape, entry.storage)} "
                f"but {path} holds {found} (file damaged or replaced?); " + _restore_hint(ckpt_dir)
            )
        out = np.empty(spec.shape, entry.storage)
        view = out.reshape(-1).view(np.uint8).data
        digest = hashlib.sha256()
        total, pos = spec.nbytes, 0
        while pos < total:
            n = f.readinto(view[pos : pos + _CHUNK_BYTES])
            if not n:
                raise CheckpointCorruptError(
                    f"variable {name!r}: {path} is truncated: expected {total} data bytes, "
                    f"found {pos} (file damaged or partly copied?); " + _restore_hint(ckpt_dir)
                )
            digest.update(view[pos : pos + n])
            pos += n
        if f.read(1):
            raise CheckpointCorruptError(
                f"variable {name!r}: {path} has data beyond the expected {total} bytes "
                "(file damaged or replaced?); " + _restore_hint(ckpt_dir)
            )
    found_sha = digest.hexdigest()
    if found_sha != entry.sha256:
        raise CheckpointCorruptError(
            f"variable {name!r}: checksum mismatch (file damaged?): the manifest expects "
            f"sha256 {entry.sha256}, {path} has {found_sha}; " + _restore_hint(ckpt_dir)
        )
    if entry.storage != spec.dtype:  # ml_dtypes' bits: to native byte order, then view
        return out.astype(entry.storage.newbyteorder("="), copy=False).view(spec.dtype)
    return out


# --------------------------------------------------------------------------- manifest I/O


def _load_manifest(ckpt_dir: Path) -> tuple[Manifest, dict[str, _Entry]]:
    path = ckpt_dir / _MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointCorruptError(
            f"{ckpt_dir} is not a complete checkpoint: {_MANIFEST_NAME} is missing; "
            + _restore_hint(ckpt_dir)
        ) from None

    def bad(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"{path}: invalid manifest: {what} (file damaged, or not written by polydist?); "
            + _restore_hint(ckpt_dir)
        )

    try:
        doc = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointCorruptError(
            f"{path}: manifest is not valid JSON ({e}); it is truncated or damaged; "
            + _restore_hint(ckpt_dir)
        ) from None
    if not _checksum_ok(doc):
        raise bad(f"its {_CHECKSUM_KEY} does not match its contents")
    if not isinstance(doc, dict) or doc.get("format") != _MANIFEST_FORMAT:
        raise bad(f'expected a JSON object with "format": {_MANIFEST_FORMAT!r}')
    version = doc.get("format_version")
    if not _is_int(version) or version < 1:
        raise bad(f"format_version must be a positive integer, found {version!r}")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {version} was written by a newer polydist; "
            f"this one reads versions up to {FORMAT_VERSION}: upgrade polydist"
        )
    step = doc.get("step")
    if not _is_int(step) or step < 0:
        raise bad(f"step must be a non-negative integer, found {step!r}")
    metadata = doc.get("metadata")
    if not isinstance(metadata, dict):
        raise bad(f"metadata must be a JSON object, found {type(metadata).__name__}")
    items = doc.get("arrays")
    if not isinstance(items, list):
        raise bad('"arrays" must be a list')

    entries: dict[str, _Entry] = {}
    files: set[str] = set()
    keys: set[str] = set()
    tensors_file = doc.get("tensors_file")
    if version >= _SAFETENSORS_VERSION and tensors_file != _TENSORS_NAME:
        raise bad(f'"tensors_file" must be {_TENSORS_NAME!r}, found {tensors_file!r}')
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad(f"arrays[{i}] must be an object")
        name, file, shape = item.get("name"), item.get("file"), item.get("shape")
        dtype_str, nbytes, sha = item.get("dtype"), item.get("nbytes"), item.get("sha256")
        if not isinstance(name, str):
            raise bad(f"arrays[{i}].name must be a string")
        where = f"variable {name!r}"
        if name in entries:
            raise bad(f"{where} is listed twice")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise bad(f"{where}: shape must be a list of non-negative integers, found {shape!r}")
        if version >= _SAFETENSORS_VERSION:
            key, encoding = item.get("key"), item.get("encoding")
            if not isinstance(key, str) or key in keys or key == "__metadata__":
                raise bad(f"{where}: bad or duplicate tensor key {key!r}")
            if not isinstance(encoding, str) or encoding not in _ENCODINGS:
                raise bad(f"{where}: unknown encoding {encoding!r}")
            numpy_dtype = _numpy_dtype(dtype_str)
            if numpy_dtype is not None and numpy_dtype.kind in _SUPPORTED_KINDS:
                dtype = numpy_dtype
            elif isinstance(dtype_str, str) and _ML_NAME_RE.fullmatch(dtype_str):
                dtype = _ml_dtype_for_reading(dtype_str, path, where, bad)
            else:
                raise bad(f"{where}: unsupported dtype {dtype_str!r}")
            entry = _Entry(
                name,
                _TENSORS_NAME,
                ArraySpec(tuple(shape), dtype),
                str(sha),
                _stored_dtype(dtype, encoding),
                key,
                encoding,
            )
            keys.add(key)
        else:
            if not isinstance(file, str) or not _FILE_RE.fullmatch(file) or file in files:
                raise bad(f"{where}: bad or duplicate file name {file!r}")
            storage_str = item.get("storage_dtype")
            storage = _numpy_dtype(dtype_str if storage_str is None else storage_str)
            if storage is None or storage.kind not in _SUPPORTED_KINDS:
                raise bad(f"{where}: unsupported dtype {dtype_str!r}")
            if storage_str is None:
                dtype = storage
            elif version < _ML_DTYPES_VERSION:
                raise bad(f"{where}: storage_dtype is not part of format version {version}")
            elif storage.kind != "u" or not (
                isinstance(dtype_str, str) and _ML_NAME_RE.fullmatch(dtype_str)
            ):
                raise bad(f"{where}: unsupported dtype {dtype_str!r} stored as {storage_str!r}")
            else:
                dtype = _ml_dtype_for_reading(dtype_str, path, where, bad)
                if dtype.itemsize != storage.itemsize:
                    raise bad(f"{where}: {dtype_str} cannot be stored as {storage_str!r}")
            entry = _Entry(name, file, ArraySpec(tuple(shape), dtype), str(sha), storage)
            files.add(file)
        if nbytes != entry.spec.nbytes:
            raise bad(f"{where}: nbytes {nbytes!r} does not match {_fmt_spec(shape, dtype)}")
        if not isinstance(sha, str) or not _SHA256_RE.fullmatch(sha):
            raise bad(f"{where}: sha256 must be 64 lowercase hex digits, found {sha!r}")
        entries[name] = entry

    manifest = Manifest(
        path=ckpt_dir,
        step=step,
        arrays=MappingProxyType({n: e.spec for n, e in entries.items()}),
        metadata=MappingProxyType(metadata),
        format_version=version,
    )
    return manifest, entries


def _numpy_dtype(text: object) -> np.dtype[Any] | None:
    """The NumPy dtype whose ``.str`` is ``text`` (as the writer stores it), else None."""
    if not isinstance(text, str):
        return None
    try:
        dtype = np.dtype(text)
    except (TypeError, ValueError):
        return None
    # isbuiltin 2: an extension dtype registered under this name, never written as one.
    return dtype if dtype.str == text and dtype.isbuiltin != 2 else None


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _canonical(doc: Mapping[str, object]) -> bytes:
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return text.encode("ascii")


def _dump_json(doc: Mapping[str, object]) -> str:
    return json.dumps(doc, indent=1, ensure_ascii=True, allow_nan=False)


def _with_checksum(doc: Mapping[str, object]) -> dict[str, object]:
    """``doc`` and the sha256 of its canonical JSON, so that any damage to a manifest or
    pointer (a flipped byte that still parses: a name, a shape, a step) is detected."""
    return {**doc, _CHECKSUM_KEY: hashlib.sha256(_canonical(doc)).hexdigest()}


def _checksum_ok(doc: object) -> bool:
    """Whether ``doc`` matches its checksum; documents written before checksums have none."""
    if not isinstance(doc, dict) or _CHECKSUM_KEY not in doc:
        return True
    rest = {k: v for k, v in doc.items() if k != _CHECKSUM_KEY}
    try:
        digest = hashlib.sha256(_canonical(rest)).hexdigest()
    except (ValueError, TypeError, RecursionError):
        return False
    return bool(doc[_CHECKSUM_KEY] == digest)


# --------------------------------------------------------------------------- pointer


def _read_pointer(root: Path) -> str | None:
    """Name of the checkpoint the pointer file names, None if there is no pointer."""
    path = root / _POINTER_NAME
    try:
        raw = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except IsADirectoryError:
        raise CheckpointCorruptError(
            f"{path} is a directory, expected polydist's checkpoint pointer file"
        ) from None
    try:
        try:
            doc = json.loads(raw.decode("utf-8"))
        except RecursionError:
            raise ValueError("nested too deeply") from None
        if not _checksum_ok(doc):
            raise ValueError(f"its {_CHECKSUM_KEY} does not match its contents")
        if not isinstance(doc, dict) or doc.get("format") != _POINTER_FORMAT:
            raise ValueError(f'expected a JSON object with "format": {_POINTER_FORMAT!r}')
        name = doc.get("latest")
        if not isinstance(name, str) or _parse_step(name) is None:
            raise ValueError(f'"latest" must name a <name>-<step> directory, found {name!r}')
    except ValueError as e:  # includes JSONDecodeError and UnicodeDecodeError
        raise CheckpointCorruptError(
            f"{path}: the checkpoint pointer file is damaged ({e}); pass a checkpoint "
            f"directory explicitly ({_describe_available(root)}), or delete {path} to "
            "fall back to the checkpoint with the highest step"
        ) from None
    return name


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


def list_checkpoints(directory: PathLike, checkpoint_name: str | None = None) -> list[Path]:
    """The complete checkpoints (``<name>-<step>`` with a manifest) in ``directory``, by
    step: ``ckpt-<step>`` as ``write_arrays`` names them, and those of
    ``polydist.train`` (``checkpoint_name`` selects one name; by default every one).

    Damage inside a listed checkpoint is only detected when it is read.  Returns ``[]``
    if ``directory`` does not exist.
    """
    root = Path(directory)
    try:
        with os.scandir(root) as it:
            found = [
                (s, e.name) for e in it if (s := _parse_step(e.name, checkpoint_name)) is not None
            ]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [root / n for _, n in sorted(found) if (root / n / _MANIFEST_NAME).is_file()]


def latest_checkpoint(directory: PathLike) -> Path | None:
    """The checkpoint the pointer file of ``directory`` names; None if there is none.

    Without a pointer file (e.g. a writer died before writing its first pointer), the
    complete checkpoint with the highest step is returned.  Raises
    CheckpointCorruptError if the pointer file is damaged and CheckpointNotFoundError
    if it names a checkpoint that no longer exists.
    """
    root = Path(directory)
    name = _read_pointer(root)
    if name is None:
        ckpts = list_checkpoints(root)
        return ckpts[-1] if ckpts else None
    target = root / name
    if not (target / _MANIFEST_NAME).is_file():
        raise CheckpointNotFoundError(
            f"{root / _POINTER_NAME} names {name!r} as the latest checkpoint but {target} "
            f"is missing or incomplete (deleted by hand?); pass a checkpoint directory "
            f"explicitly ({_describe_available(root)}), or delete the pointer file to fall "
            "back to the checkpoint with the highest step"
        )
    return target


def _resolve(path: PathLike) -> Path:
    p = Path(path)
    if (p / _MANIFEST_NAME).is_file():
        return p
    if not p.exists():
        raise CheckpointNotFoundError(f"{p}: no such checkpoint or checkpoint directory")
    if not p.is_dir():
        raise CheckpointNotFoundError(
            f"{p} is not a directory; pass a checkpoint directory (ckpt-<step>) or the "
            "directory holding them"
        )
    latest = latest_checkpoint(p)
    if latest is not None:
        return latest
    if _parse_step(p.name) is not None:  # looks like a checkpoint, but has no manifest
        raise CheckpointCorruptError(
            f"{p} is not a complete checkpoint: {_MANIFEST_NAME} is missing; " + _restore_hint(p)
        )
    raise CheckpointNotFoundError(
        f"no checkpoint in {p}: expected ckpt-<step> directories and a "
        f"{_POINTER_NAME!r} pointer file as written by write_arrays"
    )


def read_manifest(path: PathLike) -> Manifest:
    """Read and validate the manifest of a checkpoint (no array data is read).

    ``path`` is a checkpoint directory or a directory holding checkpoints (then the
    latest one, as named by its pointer file, is used).
    """
    manifest, _ = _load_manifest(_resolve(path))
    return manifest


def read_arrays(path: PathLike, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Read arrays of a checkpoint, verifying them against its manifest and checksums.

    ``path`` is a checkpoint directory or a directory holding checkpoints (then the
    latest one, as named by its pointer file, is used).  ``names`` selects arrays (the
    result follows its order); by default all are read, in the order written.
    """
    if isinstance(names, (str, bytes)):
        raise TypeError(
            f"names must be an iterable of names, not a single {type(names).__name__}; "
            f"wrap it in a list: [{names!r}]"
        )
    ckpt_dir = _resolve(path)
    manifest, entries = _load_manifest(ckpt_dir)
    wanted = list(entries) if names is None else list(dict.fromkeys(names))
    missing = [n for n in wanted if n not in entries]
    if missing:
        have = list(entries)
        shown = ", ".join(repr(n) for n in have[:20]) + (", ..." if len(have) > 20 else "")
        close = difflib.get_close_matches(missing[0], have, n=3)
        did_you_mean = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        raise CheckpointError(
            f"checkpoint {ckpt_dir} (step {manifest.step}) has no variable "
            + ", ".join(repr(n) for n in missing)
            + f"{did_you_mean}; it has {len(have)} variable(s): {shown or '(none)'}"
        )
    if manifest.format_version >= _SAFETENSORS_VERSION:
        return _read_tensors(ckpt_dir, [entries[n] for n in wanted])
    return {n: _read_array_file(ckpt_dir, entries[n]) for n in wanted}


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


def read_pointer(directory: PathLike) -> dict[str, JSONValue] | None:
    """The pointer file of ``directory`` as a dict (``"latest"`` and what the writer
    added), None if there is none; CheckpointCorruptError if it is damaged."""
    root = Path(directory)
    if _read_pointer(root) is None:
        return None
    doc = json.loads((root / _POINTER_NAME).read_bytes().decode("utf-8"))
    return {k: v for k, v in doc.items() if k != _CHECKSUM_KEY}


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
