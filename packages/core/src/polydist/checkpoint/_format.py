"""What one checkpoint's files hold: format versions, the manifest's types, the dtype
rules and the encodings of arrays in the safetensors file, and the checksummed JSON.

No file-system access here: :mod:`polydist.checkpoint._io` reads and writes the files
(its docstring has the on-disk layout and the atomicity argument).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple, TypeAlias, TypeGuard

import numpy as np

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
