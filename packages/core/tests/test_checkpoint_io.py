"""Tests of polydist.checkpoint's storage layer (named arrays on disk, atomic writes)."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

try:
    import ml_dtypes
except ImportError:  # optional: its tests are skipped without it
    ml_dtypes = None

from polydist.checkpoint import (
    ArraySpec,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    JSONLike,
    Manifest,
    _io,
    _read,
    latest_checkpoint,
    list_checkpoints,
    read_arrays,
    read_manifest,
    write_arrays,
)

TMP_PREFIX = ".polydist-tmp-"

ALL_DTYPES = [
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.longdouble,
    np.complex64,
    np.complex128,
    np.clongdouble,
]


def assert_identical(got: np.ndarray, want: np.ndarray) -> None:
    """Same dtype (byte order included), shape and bits."""
    assert got.dtype == want.dtype
    assert got.dtype.str == want.dtype.str
    assert got.shape == want.shape
    assert _significant_bytes(got) == _significant_bytes(want)


#: x87 long doubles: 80 significant bits in a 16-byte slot whose padding NumPy may
#: leave uninitialised (e.g. when copying a 0-d array), so only 10 bytes per slot count.
_X87 = np.finfo(np.longdouble).nmant == 63 and np.dtype(np.longdouble).itemsize == 16


def _significant_bytes(a: np.ndarray) -> bytes:
    flat = np.ascontiguousarray(a).reshape(-1)
    if _X87 and a.dtype.type in (np.longdouble, np.clongdouble):
        return flat.view(np.uint8).reshape(-1, 16)[:, :10].tobytes()
    return flat.tobytes()


def sample(dtype: Any, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(dt)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    return (rng.standard_normal(shape) * 1e3).astype(dt)


def manifest_doc(ckpt: Path) -> dict[str, Any]:
    """The manifest without its checksum: edited and written back, it reads as a manifest
    of a polydist from before checksums, so the reader's other checks are reached."""
    doc: dict[str, Any] = json.loads((ckpt / "manifest.json").read_text("utf-8"))
    doc.pop("sha256_of_the_rest", None)
    return doc


def data_file(ckpt: Path, name: str) -> Path:
    """The .npy file of ``name`` in a checkpoint of the legacy layout (format 1 or 2)."""
    (entry,) = [a for a in manifest_doc(ckpt)["arrays"] if a["name"] == name]
    return ckpt / str(entry["file"])


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(TMP_PREFIX))


# --------------------------------------------------------------------------- round trips


def test_round_trip_all_dtypes_and_shapes(tmp_path: Path) -> None:
    arrays: dict[str, np.ndarray | np.generic] = {}
    for i, dt in enumerate(ALL_DTYPES):
        for shape in [(), (0,), (5,), (2, 3, 4), (1, 0, 2)]:
            arrays[f"{np.dtype(dt).name}/{shape}"] = sample(dt, shape, seed=i)
    arrays["big_endian"] = sample(">f8", (3, 2)).astype(">f8")
    arrays["big_endian_int"] = np.arange(6, dtype=">i4")
    arrays["scalar"] = np.float32(2.5)
    arrays["special"] = np.array([np.nan, -0.0, np.inf, -np.inf, 5e-324])
    path = write_arrays(tmp_path, arrays, step=7)
    assert path == tmp_path / "ckpt-7"
    got = read_arrays(tmp_path)
    assert list(got) == list(arrays)
    for name, want in arrays.items():
        assert_identical(got[name], np.asarray(want))
    assert read_arrays(path).keys() == got.keys()


def test_names_with_slashes_colons_and_unicode(tmp_path: Path) -> None:
    names = [
        "dense/kernel:0",
        "dense/bias:0",
        "../../etc/passwd",
        "/abs:1",
        "",
        "ünïcødé/層:0",
        "a\\b\nc",
        ".polydist-tmp-x",
        "manifest.json",
    ]
    arrays = {n: np.full((2,), i, np.int32) for i, n in enumerate(names)}
    ckpt = write_arrays(tmp_path, arrays)
    assert sorted(p.name for p in ckpt.iterdir()) == ["manifest.json", "tensors.safetensors"]
    # the safetensors file names its tensors as the checkpoint does
    plain = safetensors.numpy.load_file(ckpt / "tensors.safetensors")
    assert sorted(plain) == sorted(names)
    assert all(plain[n].tolist() == arrays[n].tolist() for n in names)
    got = read_arrays(tmp_path)
    assert list(got) == names
    for n in names:
        assert_identical(got[n], arrays[n])
    assert read_manifest(tmp_path).names == tuple(names)


def test_non_contiguous_and_chunked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_read, "_CHUNK_BYTES", 7)  # many tiny chunks, sizes not multiples
    base = np.arange(3 * 5 * 4, dtype=np.float64).reshape(3, 5, 4)
    arrays: dict[str, np.ndarray] = {
        "transposed": base.T,
        "strided": base[::2, 1::2, ::-1],
        "fortran": np.asfortranarray(base),
        "scalar": np.array(3, np.int16),
        "contiguous": base,
        "wide_rows": np.arange(40, dtype=np.int8).reshape(2, 20)[:, ::3],
    }
    write_arrays(tmp_path, arrays)
    got = read_arrays(tmp_path)
    for name, want in arrays.items():
        assert_identical(got[name], want)


_dtypes = (
    hnp.boolean_dtypes()
    | hnp.integer_dtypes(endianness="?")
    | hnp.unsigned_integer_dtypes(endianness="?")
    | hnp.floating_dtypes(endianness="?")
    | hnp.complex_number_dtypes(endianness="?")
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.text(max_size=12),
        hnp.arrays(_dtypes, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)),
        max_size=4,
    )
)
def test_round_trip_property(arrays: dict[str, np.ndarray]) -> None:
    with tempfile.TemporaryDirectory() as d:
        write_arrays(d, arrays, metadata={"n": len(arrays)})
        got = read_arrays(d)
        assert list(got) == list(arrays)
        for name, want in arrays.items():
            assert_identical(got[name], want)
        m = read_manifest(d)
        assert m.arrays == {n: ArraySpec(a.shape, a.dtype) for n, a in arrays.items()}


def test_select_names_and_order(tmp_path: Path) -> None:
    arrays = {n: np.array([i]) for i, n in enumerate("abcd")}
    write_arrays(tmp_path, arrays)
    got = read_arrays(tmp_path, ["c", "a", "c"])
    assert list(got) == ["c", "a"]
    assert_identical(got["a"], arrays["a"])
    assert read_arrays(tmp_path, iter([])) == {}
    with pytest.raises(TypeError, match=r"\['a'\]"):
        read_arrays(tmp_path, "a")


def test_manifest_and_metadata(tmp_path: Path) -> None:
    meta: dict[str, JSONLike] = {
        "lr": 0.1,
        "epoch": 3,
        "tags": ("a", "b"),
        "nested": {"x": [1, None, True]},
    }
    write_arrays(
        tmp_path, {"w:0": np.zeros((2, 3), np.float32), "s": np.int64(1)}, metadata=meta, step=4
    )
    m = read_manifest(tmp_path)
    assert isinstance(m, Manifest)
    assert m.step == 4
    assert m.path == tmp_path / "ckpt-4"
    assert m.names == ("w:0", "s")
    shape, dtype = m.arrays["w:0"]
    assert (shape, dtype) == ((2, 3), np.dtype(np.float32))
    assert m.arrays["s"] == ArraySpec((), np.dtype(np.int64))
    assert m.arrays["w:0"].nbytes == 24
    assert dict(m.metadata) == {
        "lr": 0.1,
        "epoch": 3,
        "tags": ["a", "b"],
        "nested": {"x": [1, None, True]},
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.step = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        m.metadata["lr"] = 1.0  # type: ignore[index]
    assert read_manifest(tmp_path / "ckpt-4") == m


# --------------------------------------------------------------------------- pointer, listing


def test_pointer_and_listing(tmp_path: Path) -> None:
    root = tmp_path / "run"
    assert latest_checkpoint(root) is None
    assert list_checkpoints(root) == []
    assert write_arrays(root, {"x": np.array(1)}) == root / "ckpt-1"  # creates root
    assert write_arrays(root, {"x": np.array(2)}) == root / "ckpt-2"
    assert write_arrays(root, {"x": np.array(10)}, step=10) == root / "ckpt-10"
    assert write_arrays(root, {"x": np.array(11)}) == root / "ckpt-11"
    # the pointer names the last write, even if its step is not the highest
    assert write_arrays(root, {"x": np.array(5)}, step=5) == root / "ckpt-5"
    assert latest_checkpoint(root) == root / "ckpt-5"
    assert read_arrays(root)["x"] == 5
    assert read_manifest(root).step == 5
    assert json.loads((root / "checkpoint").read_text("utf-8"))["latest"] == "ckpt-5"
    assert list_checkpoints(root) == [root / f"ckpt-{s}" for s in (1, 2, 5, 10, 11)]
    assert read_arrays(root / "ckpt-10")["x"] == 10
    # without pointer file: the highest step
    (root / "checkpoint").unlink()
    assert latest_checkpoint(root) == root / "ckpt-11"
    assert read_arrays(root)["x"] == 11


def test_readers_ignore_leftovers_and_incomplete(tmp_path: Path) -> None:
    write_arrays(tmp_path, {"x": np.array(1)}, step=1)
    fake = tmp_path / f"{TMP_PREFIX}ckpt-9-deadbeef"
    fake.mkdir()
    (fake / "manifest.json").write_text("{}")
    (tmp_path / f"{TMP_PREFIX}pointer-1234").write_text('{"latest": "ckpt-9"}')
    (tmp_path / "ckpt-8").mkdir()  # no manifest: not a complete checkpoint
    (tmp_path / "ckpt-x").mkdir()
    (tmp_path / "notes.txt").write_text("hi")
    assert list_checkpoints(tmp_path) == [tmp_path / "ckpt-1"]
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-1"
    with pytest.raises(CheckpointCorruptError, match=r"manifest\.json is missing.*ckpt-1"):
        read_arrays(tmp_path / "ckpt-8")
    assert write_arrays(tmp_path, {"x": np.array(2)}) == tmp_path / "ckpt-9"
    assert leftovers(tmp_path) == []
    assert (tmp_path / "notes.txt").exists()


def test_max_to_keep(tmp_path: Path) -> None:
    for s in range(1, 6):
        write_arrays(tmp_path, {"x": np.array(s)}, step=s, max_to_keep=2)
    assert list_checkpoints(tmp_path) == [tmp_path / "ckpt-4", tmp_path / "ckpt-5"]
    write_arrays(tmp_path, {"x": np.array(6)}, step=6)  # default: keep all
    assert len(list_checkpoints(tmp_path)) == 3
    # the new checkpoint is never deleted, even when its step is the lowest
    write_arrays(tmp_path, {"x": np.array(3)}, step=3, max_to_keep=1)
    assert list_checkpoints(tmp_path) == [tmp_path / "ckpt-3"]
    assert read_arrays(tmp_path)["x"] == 3
    assert leftovers(tmp_path) == []
    with pytest.raises(ValueError, match="max_to_keep"):
        write_arrays(tmp_path, {"x": np.array(0)}, max_to_keep=0)


def test_rewriting_latest_step_is_refused(tmp_path: Path) -> None:
    write_arrays(tmp_path, {"x": np.array(1)}, step=1)
    write_arrays(tmp_path, {"x": np.array(2)}, step=2)
    with pytest.raises(CheckpointError, match=r"ckpt-2.*latest"):
        write_arrays(tmp_path, {"x": np.array(-2)}, step=2)
    assert read_arrays(tmp_path)["x"] == 2
    # an older, non-latest step may be rewritten (it becomes the latest)
    write_arrays(tmp_path, {"x": np.array(-1)}, step=1)
    assert read_arrays(tmp_path)["x"] == -1
    assert read_arrays(tmp_path / "ckpt-2")["x"] == 2
    assert leftovers(tmp_path) == []


def test_failed_write_cleans_up_and_keeps_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_arrays(tmp_path, {"x": np.array(1)}, step=1)

    def boom(stage: str, detail: str) -> None:
        if stage == "array-written" and detail == "b":
            raise RuntimeError("disk on fire")

    monkeypatch.setattr(_io, "_test_hook", boom)
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_arrays(tmp_path, {"a": np.ones(3), "b": np.ones(3), "c": np.ones(3)}, step=2)
    assert leftovers(tmp_path) == []
    assert list_checkpoints(tmp_path) == [tmp_path / "ckpt-1"]
    assert read_arrays(tmp_path)["x"] == 1


# --------------------------------------------------------------------------- damage


@pytest.fixture
def two_ckpts(tmp_path: Path, write_legacy: Callable[..., Path]) -> Path:
    """Two checkpoints of the legacy layout (a .npy file per array): its reader's checks."""
    write_legacy(tmp_path, {"dense/kernel:0": np.arange(100.0), "b": np.ones(3)}, step=1)
    write_legacy(tmp_path, {"dense/kernel:0": np.arange(1000.0), "b": np.ones(3)}, step=2)
    return tmp_path / "ckpt-2"


@pytest.fixture
def two_new(tmp_path: Path) -> Path:
    """Two checkpoints of format 3 (safetensors)."""
    write_arrays(tmp_path, {"dense/kernel:0": np.arange(100.0), "b": np.ones(3)}, step=1)
    write_arrays(tmp_path, {"dense/kernel:0": np.arange(1000.0), "b": np.ones(3)}, step=2)
    return tmp_path / "ckpt-2"


def _tensor_offset(tensors: Path, key: str) -> int:
    """Where ``key``'s data starts in a safetensors file (its header says)."""
    raw = tensors.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return 8 + n + int(json.loads(raw[8 : 8 + n])[key]["data_offsets"][0])


def test_safetensors_damage(two_new: Path) -> None:
    tensors = two_new / "tensors.safetensors"
    pristine = tensors.read_bytes()
    raw = bytearray(pristine)
    raw[_tensor_offset(tensors, "dense/kernel:0") + 5] ^= 0x10
    tensors.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError) as info:
        read_arrays(two_new.parent)
    msg = str(info.value)
    assert "variable 'dense/kernel:0'" in msg and "checksum mismatch" in msg
    assert "ckpt-1" in msg  # what to restore from instead
    assert_identical(read_arrays(two_new, ["b"])["b"], np.ones(3))  # the others still read
    tensors.write_bytes(pristine[:-8])
    with pytest.raises(CheckpointCorruptError, match=r"safetensors file is unreadable.*ckpt-1"):
        read_arrays(two_new)
    tensors.write_bytes(pristine[:3])
    with pytest.raises(CheckpointCorruptError, match=r"safetensors file is unreadable"):
        read_arrays(two_new)
    tensors.unlink()
    with pytest.raises(CheckpointCorruptError, match=r"tensors.safetensors is missing.*ckpt-1"):
        read_arrays(two_new)
    # another safetensors file in its place: same names, other dtype
    safetensors.numpy.save_file(
        {"dense/kernel:0": np.arange(1000, dtype=np.float32), "b": np.ones(3)}, tensors
    )
    with pytest.raises(CheckpointCorruptError, match=r"manifest says shape \(1000,\) dtype <f8"):
        read_arrays(two_new)
    assert read_arrays(two_new.parent / "ckpt-1")["dense/kernel:0"].shape == (100,)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d.update(tensors_file="x.safetensors"), "tensors_file"),
        (lambda d: d["arrays"][0].update(key="__metadata__"), "tensor key"),
        (lambda d: d["arrays"][1].update(key=d["arrays"][0]["key"]), "duplicate tensor key"),
        (lambda d: d["arrays"][0].update(encoding="zip"), "unknown encoding"),
        (lambda d: d["arrays"][0].update(dtype="O"), "unsupported dtype"),
        (lambda d: d["arrays"][0].update(shape=[3]), "nbytes"),
    ],
)
def test_invalid_format_3_manifest(two_new: Path, edit: Any, match: str) -> None:
    doc = manifest_doc(two_new)
    edit(doc)
    (two_new / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointCorruptError, match=match):
        read_manifest(two_new)


def test_corrupt_array_bytes(two_ckpts: Path) -> None:
    f = data_file(two_ckpts, "dense/kernel:0")
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x10
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError) as info:
        read_arrays(two_ckpts.parent)
    msg = str(info.value)
    assert "variable 'dense/kernel:0'" in msg
    assert "checksum mismatch" in msg
    assert "ckpt-1" in msg  # what to restore from instead
    assert isinstance(info.value, ValueError)
    # other variables of the checkpoint can still be read
    assert_identical(read_arrays(two_ckpts, ["b"])["b"], np.ones(3))


def test_truncated_and_missing_array_file(two_ckpts: Path) -> None:
    f = data_file(two_ckpts, "dense/kernel:0")
    f.write_bytes(f.read_bytes()[:-8])
    with pytest.raises(CheckpointCorruptError, match=r"'dense/kernel:0'.*truncated.*8000.*7992"):
        read_arrays(two_ckpts)
    f.write_bytes(f.read_bytes() + b"x" * 16)
    with pytest.raises(CheckpointCorruptError, match=r"'dense/kernel:0'.*beyond"):
        read_arrays(two_ckpts)
    f.unlink()
    with pytest.raises(CheckpointCorruptError, match=r"'dense/kernel:0'.*missing.*ckpt-1"):
        read_arrays(two_ckpts)
    f.write_bytes(b"garbage")
    with pytest.raises(CheckpointCorruptError, match=r"'dense/kernel:0'.*header"):
        read_arrays(two_ckpts)


def test_array_file_swapped(two_ckpts: Path) -> None:
    np.save(data_file(two_ckpts, "dense/kernel:0"), np.arange(1000, dtype=np.float32))
    with pytest.raises(CheckpointCorruptError, match=r"'dense/kernel:0'.*manifest says.*<f8.*<f4"):
        read_arrays(two_ckpts)


def test_truncated_manifest(two_ckpts: Path) -> None:
    m = two_ckpts / "manifest.json"
    m.write_bytes(m.read_bytes()[: len(m.read_bytes()) // 2])
    with pytest.raises(CheckpointCorruptError, match=r"manifest is not valid JSON.*ckpt-1"):
        read_arrays(two_ckpts.parent)
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        read_manifest(two_ckpts)
    # the other checkpoint is unaffected
    assert read_arrays(two_ckpts.parent / "ckpt-1")["dense/kernel:0"].shape == (100,)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d.update(format="other"), "format"),
        (lambda d: d.update(step=-1), "step"),
        (lambda d: d["arrays"][0].update(file="../ckpt-1/000000.npy"), "file name"),
        (lambda d: d["arrays"][0].update(dtype="O"), "dtype"),
        (lambda d: d["arrays"][0].update(shape=[3]), "nbytes"),
        (lambda d: d["arrays"][0].update(sha256="xyz"), "sha256"),
        (lambda d: d["arrays"].append(dict(d["arrays"][0])), "twice"),
        (lambda d: d.update(metadata=[]), "metadata"),
    ],
)
def test_invalid_manifest(two_ckpts: Path, edit: Any, match: str) -> None:
    doc = manifest_doc(two_ckpts)
    edit(doc)
    (two_ckpts / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointCorruptError, match=match):
        read_manifest(two_ckpts)


def test_manifest_checksum(two_new: Path) -> None:
    two_ckpts = two_new
    m = two_ckpts / "manifest.json"
    doc = json.loads(m.read_text("utf-8"))
    doc["arrays"][0]["name"] = "dense/kernel:1"  # still valid JSON, and plausible
    m.write_text(json.dumps(doc))
    with pytest.raises(CheckpointCorruptError, match="sha256_of_the_rest does not match"):
        read_manifest(two_ckpts)


def test_newer_format_version(two_ckpts: Path) -> None:
    doc = manifest_doc(two_ckpts)
    doc["format_version"] = 99
    (two_ckpts / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"newer polydist.*upgrade"):
        read_arrays(two_ckpts)


def test_missing_name(two_ckpts: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        read_arrays(two_ckpts.parent, ["dense/kernel:0", "dense/kernel"])
    assert not isinstance(info.value, CheckpointCorruptError)
    msg = str(info.value)
    assert "no variable 'dense/kernel'" in msg
    assert "did you mean 'dense/kernel:0'" in msg
    assert "'b'" in msg  # lists what the checkpoint has


def test_not_found(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no such"):
        read_arrays(tmp_path / "nope")
    with pytest.raises(FileNotFoundError):
        read_manifest(tmp_path / "nope")
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint in"):
        read_arrays(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointNotFoundError, match="not a directory"):
        read_arrays(tmp_path / "file")


def test_damaged_pointer(two_ckpts: Path) -> None:
    root = two_ckpts.parent
    (root / "checkpoint").write_text('{"format": "polydist.checkpoint.pointer", "lat')
    with pytest.raises(CheckpointCorruptError, match=r"pointer file is damaged.*ckpt-1, ckpt-2"):
        latest_checkpoint(root)
    with pytest.raises(CheckpointCorruptError, match="pointer"):
        read_arrays(root)
    assert read_arrays(two_ckpts)["b"].shape == (3,)  # explicit path still works
    write_arrays(root, {"x": np.array(3)}, step=3)  # a write repairs the pointer
    assert latest_checkpoint(root) == root / "ckpt-3"
    # pointer naming a deleted checkpoint
    for p in (root / "ckpt-3").iterdir():
        p.unlink()
    (root / "ckpt-3").rmdir()
    with pytest.raises(CheckpointNotFoundError, match=r"names 'ckpt-3'.*ckpt-1, ckpt-2"):
        read_arrays(root)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "value",
    [
        np.array(["a"]),
        np.array([object()]),
        np.array(["2020-01-01"], dtype="datetime64[D]"),
        np.zeros(2, dtype=[("a", "f4")]),
        np.ma.masked_array([1.0], mask=[True]),
        [1.0, 2.0],
    ],
)
def test_unsupported_arrays(tmp_path: Path, value: Any) -> None:
    with pytest.raises(TypeError, match="variable 'v'"):
        write_arrays(tmp_path, {"v": value})
    assert not tmp_path.joinpath("checkpoint").exists()


def test_bad_arguments(tmp_path: Path) -> None:
    x = {"x": np.zeros(1)}
    with pytest.raises(TypeError, match="str"):
        write_arrays(tmp_path, {1: np.zeros(1)})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"metadata\['a'\]\[1\].*\.item\(\)"):
        write_arrays(tmp_path, x, metadata={"a": [1, np.int64(2)]})  # type: ignore[list-item]
    with pytest.raises(TypeError, match="keys must be str"):
        write_arrays(tmp_path, x, metadata={"a": {1: 2}})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="NaN"):
        write_arrays(tmp_path, x, metadata={"loss": float("nan")})
    with pytest.raises(ValueError, match="step"):
        write_arrays(tmp_path, x, step=-1)
    with pytest.raises(TypeError, match="step"):
        write_arrays(tmp_path, x, step=True)
    assert list(tmp_path.iterdir()) == []


def test_error_hierarchy() -> None:
    assert issubclass(CheckpointNotFoundError, CheckpointError)
    assert issubclass(CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(CheckpointCorruptError, CheckpointError)
    assert issubclass(CheckpointCorruptError, ValueError)


# --------------------------------------------------------------------------- crash safety

CHILD = r"""
import sys, time
import numpy as np
from polydist.checkpoint import _io

root, stage, detail, signal_file, total_mb = sys.argv[1:]

def hook(s, d):
    if s == stage and detail in ("*", d):
        with open(signal_file, "w") as f:
            f.write(s)
        time.sleep(600)  # wait here to be SIGKILLed

_io._test_hook = hook
n = int(total_mb) * 2**20 // 8 // 4
arrays = {f"big/w{i}:0": np.full(n, 100.0 + i) for i in range(4)}
_io.write_arrays(root, arrays, step=2, metadata={"step": 2})
print("finished without pausing", file=sys.stderr)
"""


def start_child(args: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def kill_when_signalled(proc: subprocess.Popen[bytes], signal_file: Path) -> None:
    deadline = time.monotonic() + 180
    while not signal_file.exists():
        if proc.poll() is not None:
            err = proc.communicate()[1].decode(errors="replace")
            pytest.fail(f"child exited early ({proc.returncode}) before pausing:\n{err}")
        if time.monotonic() > deadline:
            pytest.fail("child did not reach the pause point in time")
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize(
    ("stage", "detail", "total_mb", "renamed"),
    [
        ("tensors-started", "*", 8, False),  # test_crash_at_random_moments kills mid-write
        ("array-written", "big/w3:0", 8, False),
        ("manifest-written", "*", 8, False),
        ("before-rename", "*", 8, False),
        ("before-pointer", "*", 8, True),
        ("pointer-tmp-written", "*", 8, True),
    ],
)
def test_crash_mid_save_keeps_previous_checkpoint(
    tmp_path: Path, stage: str, detail: str, total_mb: int, renamed: bool
) -> None:
    root = tmp_path / "ckpts"
    prev = {"dense/kernel:0": sample(np.float32, (64, 32)), "step": np.array(1)}
    write_arrays(root, prev, step=1, metadata={"step": 1})
    signal_file = tmp_path / "paused"
    with start_child([CHILD, str(root), stage, detail, str(signal_file), str(total_mb)]) as proc:
        try:
            kill_when_signalled(proc, signal_file)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=60)

    # the previous checkpoint is intact, still the latest, and reads back exactly
    assert latest_checkpoint(root) == root / "ckpt-1"
    got = read_arrays(root)
    assert got.keys() == prev.keys()
    for name, want in prev.items():
        assert_identical(got[name], want)
    assert read_manifest(root).metadata == {"step": 1}
    if renamed:  # killed after the new checkpoint was complete but before it was committed
        assert list_checkpoints(root) == [root / "ckpt-1", root / "ckpt-2"]
        assert read_arrays(root / "ckpt-2")["big/w0:0"][0] == 100.0
    else:
        assert list_checkpoints(root) == [root / "ckpt-1"]
        assert leftovers(root), "the killed writer should have left its temporary directory"

    # the next write succeeds (rewriting the uncommitted step 2) and cleans up
    new = {"dense/kernel:0": sample(np.float32, (64, 32), seed=2)}
    assert write_arrays(root, new, step=2) == root / "ckpt-2"
    assert leftovers(root) == []
    assert latest_checkpoint(root) == root / "ckpt-2"
    assert_identical(read_arrays(root)["dense/kernel:0"], new["dense/kernel:0"])
    assert_identical(read_arrays(root / "ckpt-1")["step"], prev["step"])


LOOP_CHILD = r"""
import sys
import numpy as np
from pathlib import Path
from polydist.checkpoint import _io

root, ready = sys.argv[1:]
Path(ready).write_text("ready")
while True:
    latest = _io.latest_checkpoint(root)
    step = 1 if latest is None else _io.read_manifest(latest).step + 1
    arrays = {f"w{i}": np.full((256, 1024), float(step * 10 + i)) for i in range(3)}
    _io.write_arrays(root, arrays, step=step, metadata={"step": step}, max_to_keep=3)
"""


def test_crash_at_random_moments(tmp_path: Path) -> None:
    """Kill a writer that saves in a loop at random moments; checkpoints stay consistent."""
    root = tmp_path / "ckpts"
    rng = random.Random(1234)
    for round_ in range(6):
        ready = tmp_path / f"ready{round_}"
        with start_child([LOOP_CHILD, str(root), str(ready)]) as proc:
            try:
                deadline = time.monotonic() + 120
                while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.005)
                time.sleep(rng.uniform(0.0, 0.4))
                assert proc.poll() is None, proc.communicate()[1].decode(errors="replace")
            finally:
                proc.kill()
                proc.communicate(timeout=60)
        latest = latest_checkpoint(root)
        if latest is None:
            continue
        for ckpt in list_checkpoints(root):
            m = read_manifest(ckpt)
            assert ckpt.name == f"ckpt-{m.step}"
            assert m.metadata == {"step": m.step}
            got = read_arrays(ckpt)
            for i in range(3):
                assert_identical(got[f"w{i}"], np.full((256, 1024), float(m.step * 10 + i)))
        assert latest in list_checkpoints(root)
    # a later write cleans whatever the last killed writer left behind
    final = write_arrays(root, {"x": np.array(1)})
    assert latest_checkpoint(root) == final
    assert leftovers(root) == []


# --------------------------------------------------------------------------- ml_dtypes

needs_ml_dtypes = pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes")
ML_FLOATS = [
    n
    for n in (
        "bfloat16",
        "float8_e3m4",
        "float8_e4m3",
        "float8_e4m3b11fnuz",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(ml_dtypes, n)
]
# The keys of a manifest entry in format version 1.
V1_KEYS = {"name", "file", "shape", "dtype", "nbytes", "sha256"}


def ml_dtype(name: str) -> np.dtype[Any]:
    return np.dtype(getattr(ml_dtypes, name))


def every_bit_pattern(name: str) -> np.ndarray:
    """Every value of the dtype, NaN payloads, infinities and -0.0 included."""
    dtype = ml_dtype(name)
    return np.arange(2 ** (8 * dtype.itemsize), dtype=f"u{dtype.itemsize}").view(dtype)


@needs_ml_dtypes
@pytest.mark.parametrize("name", ML_FLOATS)
def test_ml_dtypes_round_trip_bit_for_bit(tmp_path: Path, name: str) -> None:
    dtype = ml_dtype(name)
    every = every_bit_pattern(name)
    arrays = {
        "every": every,
        "strided": every[:48].reshape(4, 12)[:, ::3],  # not contiguous
        "scalar": every[-1:].reshape(()),
        "empty": every[:0].reshape(0, 3),
    }
    path = write_arrays(tmp_path, arrays)
    doc = manifest_doc(path)
    assert doc["format_version"] == 3
    # bfloat16 is safetensors' BF16; the float8s safetensors' NumPy loader cannot read
    # back are stored by their bits (U8), which any safetensors reader reads.
    encoding = "native" if name == "bfloat16" else "bits"
    assert [(a["dtype"], a["encoding"]) for a in doc["arrays"]] == [(name, encoding)] * 4
    plain = safetensors.numpy.load_file(path / "tensors.safetensors")
    if name == "bfloat16":
        assert_identical(plain["every"], every)
    else:
        assert plain["every"].tolist() == np.arange(every.size).tolist()
    assert read_manifest(tmp_path).arrays["strided"] == ArraySpec((4, 4), dtype)
    got = read_arrays(tmp_path)
    for key, want in arrays.items():
        assert_identical(got[key], want)


@needs_ml_dtypes
def test_mixed_legacy_format_2_checkpoint_still_reads(
    tmp_path: Path, write_legacy: Callable[..., Path]
) -> None:
    bf16 = ml_dtype("bfloat16")
    special = np.array([0x7FC0, 0xFFC1, 0x7F81, 0x7F80, 0xFF80, 0x8000, 0x0001], np.uint16)
    arrays = {
        "f32": np.array([np.nan, -0.0, np.inf, 1.5], np.float32),
        "bf16": special.view(bf16),  # NaNs (payload, negative, signalling), +-inf, -0.0
        "count": np.int64(3),
    }
    path = write_legacy(tmp_path, arrays)
    assert manifest_doc(path)["format_version"] == 2
    entries = {a["name"]: a for a in manifest_doc(path)["arrays"]}
    assert set(entries["f32"]) == V1_KEYS and entries["f32"]["dtype"] == "<f4"
    assert set(entries["count"]) == V1_KEYS
    assert set(entries["bf16"]) == V1_KEYS | {"storage_dtype"}
    got = read_arrays(path)
    for key, want in arrays.items():
        assert_identical(got[key], np.asarray(want))
    assert got["bf16"].view(np.uint16).tolist() == special.tolist()


def test_legacy_format_1_checkpoints_still_read(
    tmp_path: Path, write_legacy: Callable[..., Path]
) -> None:
    path = write_legacy(tmp_path, {"w": np.arange(3.0), "b": np.zeros(2, np.float32)})
    doc = manifest_doc(path)
    assert doc["format_version"] == 1
    assert all(set(a) == V1_KEYS for a in doc["arrays"])
    assert read_arrays(tmp_path)["w"].tolist() == [0.0, 1.0, 2.0]
    assert read_manifest(tmp_path).format_version == 1
    # a new write beside it is format 3, and the pointer's layout stays that of format 1
    write_arrays(tmp_path, {"w": np.arange(4.0)})
    assert read_manifest(tmp_path).format_version == 3
    assert json.loads((tmp_path / "checkpoint").read_text())["format_version"] == 1
    assert read_arrays(path)["w"].tolist() == [0.0, 1.0, 2.0]


def test_older_readers_refuse_format_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_arrays(tmp_path, {"w": np.ones(2)})
    monkeypatch.setattr(_read, "FORMAT_VERSION", 2)  # polydist before safetensors
    with pytest.raises(CheckpointError, match=r"version 3 was written by a newer polydist"):
        read_arrays(tmp_path)


@needs_ml_dtypes
def test_reading_ml_dtypes_without_it_says_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_arrays(tmp_path, {"w": np.ones(2, ml_dtype("bfloat16"))})
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes now fails
    with pytest.raises(CheckpointError) as info:
        read_arrays(tmp_path)
    assert not isinstance(info.value, CheckpointCorruptError)
    assert str(info.value) == (
        f"{path / 'manifest.json'}: variable 'w' is stored as bfloat16, a dtype of the "
        "ml_dtypes package, which is not installed: pip install ml_dtypes to read this checkpoint"
    )
    # NumPy's dtypes need no ml_dtypes, to write or to read.
    write_arrays(tmp_path / "plain", {"x": np.ones(2)})
    assert read_arrays(tmp_path / "plain")["x"].tolist() == [1.0, 1.0]


@needs_ml_dtypes
def test_ml_dtype_unknown_to_the_installed_ml_dtypes(tmp_path: Path) -> None:
    path = write_arrays(tmp_path, {"w": np.ones(2, ml_dtype("float8_e4m3fn"))})
    doc = manifest_doc(path)
    doc["arrays"][0]["dtype"] = "float8_e9m9"
    (path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"float8_e9m9.*pip install -U ml_dtypes"):
        read_manifest(path)


@needs_ml_dtypes
@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d.update(format_version=1), "storage_dtype is not part of format version 1"),
        (lambda d: d["arrays"][0].update(storage_dtype="<f2"), "unsupported dtype 'bfloat16'"),
        (lambda d: d["arrays"][0].update(storage_dtype="|u1"), "cannot be stored as '|u1'"),
        (lambda d: d["arrays"][0].update(dtype="<V2"), "unsupported dtype '<V2'"),
        (lambda d: d["arrays"][0].update(dtype="int4"), "unsupported dtype 'int4'"),
        (lambda d: d["arrays"][0].update(dtype="complex32"), "unsupported dtype 'complex32'"),
        (lambda d: d["arrays"][0].pop("storage_dtype"), "unsupported dtype 'bfloat16'"),
    ],
)
def test_invalid_ml_dtypes_manifest(
    tmp_path: Path, write_legacy: Callable[..., Path], edit: Any, match: str
) -> None:
    path = write_legacy(tmp_path, {"w": np.ones(2, ml_dtype("bfloat16"))})
    doc = manifest_doc(path)
    edit(doc)
    (path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointCorruptError, match=re.escape(match)):
        read_manifest(path)


@needs_ml_dtypes
def test_damaged_ml_dtypes_file(tmp_path: Path, write_legacy: Callable[..., Path]) -> None:
    path = write_legacy(tmp_path, {"w": np.ones((2, 3), ml_dtype("bfloat16"))})
    np.save(data_file(path, "w"), np.ones((2, 3), np.float16))  # same size, other dtype
    with pytest.raises(CheckpointCorruptError, match=r"manifest says shape \(2, 3\) dtype <u2"):
        read_arrays(path)


@needs_ml_dtypes
@pytest.mark.parametrize(
    "name",
    [n for n in ("int4", "uint4", "int2") if hasattr(ml_dtypes, n)],
)
def test_sub_byte_ml_dtypes_integers_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(TypeError, match=rf"variable 'v': dtype {name} .* sub-byte integer"):
        write_arrays(tmp_path, {"v": np.zeros(3, ml_dtype(name))})
    assert list(tmp_path.iterdir()) == []


@needs_ml_dtypes
@pytest.mark.parametrize(
    "name",
    [n for n in ("float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn") if hasattr(ml_dtypes, n)],
)
def test_sub_byte_ml_dtypes_floats_round_trip_bit_for_bit(tmp_path: Path, name: str) -> None:
    dtype = ml_dtype(name)
    bits = int(ml_dtypes.finfo(dtype).bits)
    every = np.arange(2**bits, dtype=np.uint8).view(dtype)  # each value, a byte each
    write_arrays(tmp_path, {"v": every})
    back = read_arrays(tmp_path)["v"]
    assert back.dtype == dtype
    assert np.array_equal(back.view(np.uint8), every.view(np.uint8))


@needs_ml_dtypes
@pytest.mark.skipif(not hasattr(ml_dtypes, "complex32"), reason="ml_dtypes without complex32")
def test_other_ml_dtypes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="dtype complex32 cannot be checkpointed; supported are"):
        write_arrays(tmp_path, {"v": np.zeros(3, ml_dtype("complex32"))})
    assert list(tmp_path.iterdir()) == []


def test_numpy_dtypes_do_not_import_ml_dtypes(tmp_path: Path) -> None:
    code = (
        "import sys, numpy as np\n"
        "from polydist.checkpoint import read_arrays, write_arrays\n"
        "write_arrays(sys.argv[1], {'w': np.ones(3, np.float16), 'i': np.arange(2)})\n"
        "assert read_arrays(sys.argv[1])['w'].tolist() == [1.0, 1.0, 1.0]\n"
        "assert 'ml_dtypes' not in sys.modules, 'ml_dtypes was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=120)
