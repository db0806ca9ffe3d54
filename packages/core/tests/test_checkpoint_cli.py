"""``polydist checkpoint inspect|convert``, and checkpoints that other tools read (issue 19
item 4): the tensors are a safetensors file that ``safetensors.numpy.load_file`` reads alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import polydist as pd
from polydist import checkpoint
from polydist._tools.cli import main
from polydist.checkpoint._io import read_pointer

VA = pd.VariableAggregation
VS = pd.VariableSynchronization


def _saved(root: Path, steps: tuple[int, ...] = (4, 5)) -> dict[str, pd.Variable]:
    s = pd.MirroredStrategy(2)
    with s.scope():
        v = {
            "kernel": pd.Variable(np.arange(6, dtype=np.float32).reshape(3, 2), name="d/kernel"),
            "count": pd.Variable(
                np.int64(0), name="count", synchronization=VS.ON_READ, aggregation=VA.SUM
            ),
        }
    s.run(lambda: v["count"].assign_add(3))
    for step in steps:
        checkpoint.save(root, s, step=step)
    return v


def test_a_checkpoint_loads_with_safetensors_alone(tmp_path: Path) -> None:
    _saved(tmp_path)
    code = (
        "import sys, json\n"
        "from safetensors.numpy import load_file\n"
        "t = load_file(sys.argv[1])\n"
        "assert 'polydist' not in sys.modules\n"
        "print(json.dumps({k: [str(v.dtype), v.tolist()] for k, v in t.items()}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "ckpt-5" / "tensors.safetensors")],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert json.loads(out) == {
        "d/kernel": ["float32", [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]],
        "count": ["int64", 6],  # the SUM of the two copies, as the manifest says
    }
    manifest = json.loads((tmp_path / "ckpt-5" / "manifest.json").read_text())
    assert manifest["tensors_file"] == "tensors.safetensors"
    assert [a["name"] for a in manifest["arrays"]] == ["d/kernel", "count"]


def test_inspect_lists_variables_shapes_dtypes_and_the_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _saved(tmp_path)
    assert main(["checkpoint", "inspect", str(tmp_path), "--verify"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"checkpoint {tmp_path / 'ckpt-5'}"
    assert lines[1] == "  step 5, format version 3"
    assert "(the latest); its checkpoints: ckpt-4, ckpt-5" in lines[2]
    assert lines[3].split() == ["name", "shape", "dtype", "synchronization/aggregation"]
    assert lines[4].split() == [
        "d/kernel",
        "(3,",
        "2)",
        "float32",
        "ON_WRITE/NONE",
        "(MirroredVariable)",
    ]
    assert lines[5].split() == ["count", "()", "int64", "ON_READ/SUM", "(SyncOnReadVariable)"]
    assert "2 variable(s), 32 bytes" in out
    assert "verified: every array matches its checksum" in out
    assert main(["checkpoint", "inspect", str(tmp_path / "ckpt-4")]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "  step 4, format version 3"


def test_inspect_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["checkpoint", "inspect", str(tmp_path / "nope")]) == 2
    assert "no such checkpoint" in capsys.readouterr().err
    _saved(tmp_path, steps=(1,))
    tensors = tmp_path / "ckpt-1" / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-1])
    assert main(["checkpoint", "inspect", str(tmp_path)]) == 0  # the manifest alone is fine
    capsys.readouterr()
    assert main(["checkpoint", "inspect", str(tmp_path), "--verify"]) == 1
    assert "unreadable" in capsys.readouterr().err
    assert main(["checkpoint"]) == 2
    assert "choose an action" in capsys.readouterr().err


def test_convert_rewrites_legacy_checkpoints(
    tmp_path: Path, write_legacy: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    old = tmp_path / "old"
    write_legacy(old, {"w": np.arange(3.0)}, step=2, metadata={"note": "a"}, pointer=False)
    write_legacy(old, {"w": np.arange(4.0)}, step=7)
    new = tmp_path / "new"
    assert main(["checkpoint", "convert", str(old), str(new)]) == 0
    assert "(format 1) ->" in capsys.readouterr().out
    assert [p.name for p in checkpoint.list_checkpoints(new)] == ["ckpt-2", "ckpt-7"]
    assert checkpoint.latest_checkpoint(new) == new / "ckpt-7"
    m = checkpoint.read_manifest(new / "ckpt-2")
    assert (m.format_version, m.step, dict(m.metadata)) == (3, 2, {"note": "a"})
    assert checkpoint.read_arrays(new)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    w = pd.Variable(np.zeros(3), name="w")
    checkpoint.restore(new / "ckpt-2", w)
    assert w.numpy().tolist() == [0.0, 1.0, 2.0]
    assert main(["checkpoint", "convert", str(tmp_path / "nope"), str(new)]) == 2


def test_convert_keeps_names_and_what_a_manager_manages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CheckpointManager's model-<n> checkpoints keep their names, and its pointer
    entries (the managed checkpoints, their timestamps): a manager of the same
    checkpoint_name on the converted directory manages them (once renamed ckpt-<n>, and
    the list dropped: it managed nothing)."""
    w = pd.Variable(np.float32(1.0), name="w")
    ck = pd.train.Checkpoint(w=w)
    src = tmp_path / "src"
    manager = pd.train.CheckpointManager(ck, src, max_to_keep=3, checkpoint_name="model")
    for i in range(4):
        w.assign(np.float32(i))
        manager.save()
    want = read_pointer(src)
    assert want is not None and want["all"] == ["model-2", "model-3", "model-4"]
    dst = tmp_path / "dst"
    assert main(["checkpoint", "convert", str(src), str(dst)]) == 0
    assert f"-> {dst / 'model-4'}" in capsys.readouterr().out
    assert [p.name for p in checkpoint.list_checkpoints(dst)] == ["model-2", "model-3", "model-4"]
    got = read_pointer(dst)
    assert got is not None
    for key in ("latest", "all", "timestamps", "last_preserved_timestamp"):
        assert got[key] == want[key], key
    w2 = pd.Variable(np.float32(0.0), name="w")
    ck2 = pd.train.Checkpoint(w=w2)
    again = pd.train.CheckpointManager(ck2, dst, max_to_keep=3, checkpoint_name="model")
    assert again.checkpoints == [os.fspath(dst / f"model-{n}") for n in (2, 3, 4)]
    assert again.restore_or_initialize() == os.fspath(dst / "model-4")
    assert float(w2.numpy()) == 3.0
    again.save()  # it goes on: model-5, and model-2 pruned
    assert [p.name for p in checkpoint.list_checkpoints(dst)] == ["model-3", "model-4", "model-5"]
    # one checkpoint as SRC: its own name too
    one = tmp_path / "one"
    assert main(["checkpoint", "convert", str(src / "model-3"), str(one)]) == 0
    assert checkpoint.latest_checkpoint(one) == one / "model-3"
    assert checkpoint.read_manifest(one).step == 3


def test_inspect_a_train_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    class Stateful:
        def state_dict(self) -> dict[str, object]:
            return {"w": np.ones(2), "lr": 0.5}

        def load_state_dict(self, state: dict[str, object]) -> None:
            pass

    pd.train.Checkpoint(opt=Stateful(), v=pd.Variable(1.0, name="v")).save(tmp_path / "c")
    assert main(["checkpoint", "inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "opt/w" in out and "state_dict of Stateful" in out
    assert "save_counter" in out and "step 1" in out
    assert "metadata:" not in out  # the state dicts' JSON is polydist's own
