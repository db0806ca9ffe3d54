"""The reading side of polydist checkpoints: finding them in a directory, loading and
checking a manifest, and reading the arrays back bit for bit.

The on-disk layout and the atomicity argument are in :mod:`polydist.checkpoint._io`
(the writers); :mod:`polydist.checkpoint._format` has what the files hold.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import MappingProxyType

import numpy as np

from polydist.checkpoint._format import (
    _CHECKSUM_KEY,
    _CKPT_RE,
    _ENCODINGS,
    _FILE_RE,
    _MANIFEST_FORMAT,
    _MANIFEST_NAME,
    _ML_DTYPES_VERSION,
    _ML_NAME_RE,
    _POINTER_FORMAT,
    _POINTER_NAME,
    _SAFETENSORS_VERSION,
    _SHA256_RE,
    _SUPPORTED_KINDS,
    _TENSORS_NAME,
    FORMAT_VERSION,
    ArraySpec,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    JSONValue,
    Manifest,
    PathLike,
    _checksum_ok,
    _decode,
    _Entry,
    _fmt_spec,
    _is_int,
    _ml_dtype_for_reading,
    _numpy_dtype,
    _stored_dtype,
    _stored_shape,
)

# Arrays are streamed to and from disk in pieces of this many bytes.
_CHUNK_BYTES = 16 * 1024 * 1024


def _parse_step(name: str, prefix: str | None = None) -> int | None:
    """The number of a ``<prefix>-<number>`` checkpoint name (any prefix if None)."""
    m = _CKPT_RE.fullmatch(name)
    if m is None or (prefix is not None and m.group(1) != prefix):
        return None
    return int(m.group(2))


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


def _sha256(arr: np.ndarray) -> str:
    digest = hashlib.sha256()
    for chunk in _iter_chunks(arr):
        digest.update(chunk.data)
    return digest.hexdigest()


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


def read_pointer(directory: PathLike) -> dict[str, JSONValue] | None:
    """The pointer file of ``directory`` as a dict (``"latest"`` and what the writer
    added), None if there is none; CheckpointCorruptError if it is damaged."""
    root = Path(directory)
    if _read_pointer(root) is None:
        return None
    doc = json.loads((root / _POINTER_NAME).read_bytes().decode("utf-8"))
    return {k: v for k, v in doc.items() if k != _CHECKSUM_KEY}
