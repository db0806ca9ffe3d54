"""Damaged checkpoints (issue 22 item 8): every failure is a CheckpointCorruptError, and
the variables keep their values.

A seeded loop flips one byte of, or truncates, one file of a small checkpoint (the
pointer, the manifest, each data file, with extra weight on the headers, where NumPy's
.npy parser once raised ``tokenize.TokenError``) and restores it. Each restore either
gives back the saved values (harmless damage: padding) or raises CheckpointCorruptError
with every variable unchanged.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import polydist as pd
from polydist import checkpoint
from polydist.checkpoint import CheckpointCorruptError, CheckpointError, CheckpointPathError

SAVED = {
    "w": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
    "step": np.array(12345, np.int64),
    "mask": np.array([True, False, True]),
}
SENTINEL = {k: np.full(v.shape, 9, v.dtype) for k, v in SAVED.items()}


def _variables() -> dict[str, pd.Variable]:
    return {k: pd.Variable(v.copy(), name=k) for k, v in SENTINEL.items()}


def _damage(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    if rng.random() < 0.25:
        cut = rng.randrange(len(data))
        path.write_bytes(bytes(data[:cut]))
        return f"{path.name} truncated to {cut} of {len(data)} bytes"
    # Headers (the first 128 bytes) half the time: they hold the structure.
    i = rng.randrange(min(128, len(data))) if rng.random() < 0.5 else rng.randrange(len(data))
    data[i] ^= rng.randrange(1, 256)
    path.write_bytes(bytes(data))
    return f"{path.name} byte {i} flipped"


def _files(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.iterdir() if p.is_file())


@pytest.mark.parametrize("seed", range(4))
def test_damaged_checkpoints_raise_corrupt_and_change_nothing(tmp_path: Path, seed: int) -> None:
    pristine = tmp_path / "pristine"
    saved = _variables()
    for k, v in saved.items():
        v.assign(SAVED[k])
    checkpoint.save(pristine, saved, step=1)
    rng = random.Random(seed)
    outcomes: dict[str, int] = {"restored": 0, "corrupt": 0}
    for trial in range(75):
        root = tmp_path / f"t{trial}"
        shutil.copytree(pristine, root)
        files = [root / "checkpoint", *_files(root / "ckpt-1")]
        what = _damage(rng.choice(files), rng)
        variables = _variables()
        try:
            checkpoint.restore(root, variables)
        except CheckpointCorruptError:
            outcomes["corrupt"] += 1
            for k, v in variables.items():
                assert np.asarray(v.numpy()).tobytes() == SENTINEL[k].tobytes(), (what, k)
        except Exception as e:  # any other error is the failure under test
            pytest.fail(f"{what}: {type(e).__name__}: {e}")
        else:
            outcomes["restored"] += 1
            for k, v in variables.items():
                assert np.asarray(v.numpy()).tobytes() == SAVED[k].tobytes(), (what, k)
        shutil.rmtree(root)
    assert outcomes["corrupt"] > 0  # the loop does damage checkpoints


@pytest.mark.parametrize(
    "header",
    [
        # tokenize.TokenError from NumPy's header parser (an unterminated bracket)
        b"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }".replace(b"}", b"("),
        b"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), '''",  # unterminated string
        b"{'descr': '<f4', 'fortran_order': False, 'shape': [2, 'x'], }",  # TypeError
    ],
)
def test_unparsable_npy_headers_are_corrupt(
    tmp_path: Path, header: bytes, write_legacy: Callable[..., Path]
) -> None:
    write_legacy(tmp_path, {"w": SAVED["w"]})  # the .npy layout of format 1
    data = tmp_path / "ckpt-1" / "000000.npy"
    raw = bytearray(data.read_bytes())
    start = 10  # magic (6), version (2), header length (2)
    length = int.from_bytes(raw[8:10], "little")
    raw[start : start + length] = header.ljust(length - 1) + b"\n"
    data.write_bytes(bytes(raw))
    fresh = _variables()
    with pytest.raises(CheckpointCorruptError, match="header of .* is unreadable"):
        checkpoint.restore(tmp_path, {"w": fresh["w"]})
    assert np.asarray(fresh["w"].numpy()).tobytes() == SENTINEL["w"].tobytes()


def test_saving_where_a_file_is_says_what_to_do(tmp_path: Path) -> None:
    target = tmp_path / "model.ckpt"
    target.write_text("not a directory")
    v = pd.Variable(1.0, name="v")
    with pytest.raises(CheckpointPathError, match=r"is an existing file, not a directory.*pass a"):
        checkpoint.save(target, v)
    with pytest.raises(CheckpointPathError, match=r"inside .*model.ckpt, which is an existing"):
        checkpoint.save(target / "sub", v)
    assert issubclass(CheckpointPathError, CheckpointError)
    assert issubclass(CheckpointPathError, FileExistsError)  # what the bare error was
    assert target.read_text() == "not a directory"
