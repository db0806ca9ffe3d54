"""A multi-worker training loop on jax.distributed that checkpoints its model, optimizer
and iterator with a CheckpointManager, run under ``polydist launch -n 2``
(``polydist_conformance.checkpoint_worker``, 2 worker processes of one XLA:CPU
device): stopped and restarted, it ends where an uninterrupted run ends, with the
simulator's weights; a worker that cannot read the chief's checkpoints fails on every
worker instead of training from its initial weights. The JAX twin of backend-torch's
test of the same name."""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from polydist_conformance import checkpoint_worker
from polydist_conformance import multiprocess_tests as mpt

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX process groups")

PROGRAM = Path(checkpoint_worker.__file__)
ENGINE = mpt.Engine(
    PROGRAM,
    # The workers take JAX's one CPU device each, not the tests' 8.
    unset=("TF_CONFIG", "XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "POLYDIST_PROCESS_ID"),
    # XLA:CPU wherever the tests run (on a GPU machine JAX would take the GPU).
    env={"JAX_PLATFORMS": "cpu", "ENGINE": "jax"},
)


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The simulator's MultiWorkerMirroredStrategy of 2 workers, uninterrupted."""
    return checkpoint_worker.simulated(ENGINE, tmp_path_factory.mktemp("sim"))


def test_a_restarted_run_ends_as_the_uninterrupted_one(tmp_path: Path, sim: dict[str, Any]) -> None:
    checkpoint_worker.run(ENGINE, str(tmp_path / "whole"), str(tmp_path / "whole"), "0")
    whole = checkpoint_worker.load(tmp_path / "whole")
    assert whole[0]["steps"] == whole[1]["steps"] == 6 and len(sim["seen"]) == 6
    assert whole[0]["seen"] == whole[1]["seen"] == sim["seen"]  # the last step partial
    assert whole[0]["w"] == whole[1]["w"]
    np.testing.assert_allclose(whole[0]["w"], sim["w"], rtol=1e-6, atol=1e-6)
    assert whole[0]["w"] != [0.0, 0.0, 0.0]  # it trained
    # One directory for both workers (one machine): only the chief writes in it.
    ckpt = str(tmp_path / "ckpt")
    checkpoint_worker.run(ENGINE, ckpt, str(tmp_path / "first"), "3")
    first = checkpoint_worker.load(tmp_path / "first")
    assert [f["steps"] for f in first] == [3, 3]
    checkpoint_worker.run(ENGINE, ckpt, str(tmp_path / "second"), "0")
    second = checkpoint_worker.load(tmp_path / "second")
    for w in range(2):
        assert first[w]["seen"] + second[w]["seen"] == whole[w]["seen"]
        assert len(second[w]["seen"]) == 3  # resumed at step 4, not from the start
        assert second[w]["w"] == whole[w]["w"]  # bit for bit
        assert second[w]["steps"] == 6
        # The non-chief lists what the chief keeps (max_to_keep=2), not every save.
        assert second[w]["checkpoints"] == ["ckpt-5", "ckpt-6"]
    assert sorted(n for n in os.listdir(ckpt) if n[0] != ".") == ["checkpoint", "ckpt-5", "ckpt-6"]


def _manifest_word(checkpoint: Path) -> str:
    """The first word of the manifest's hash, as the restore check prints it."""
    digest = hashlib.sha256((checkpoint / "manifest.json").read_bytes()).digest()
    return f"{int.from_bytes(digest[:4], 'little') % 2**31:08x}"


def test_a_worker_without_the_chiefs_checkpoint_fails_on_every_worker(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    checkpoint_worker.run(ENGINE, str(ckpt), str(tmp_path / "first"), "2", "--per-worker-dir")
    assert sorted(os.listdir(ckpt)) == ["worker0"]  # only the chief writes
    chiefs = sorted(n for n in os.listdir(ckpt / "worker0") if n[0] != ".")
    assert chiefs == ["checkpoint", "ckpt-1", "ckpt-2"]
    word = _manifest_word(ckpt / "worker0" / "ckpt-2")
    # Plain worker processes (no launcher stopping the other when one exits): each
    # worker's own exit code and stderr (ckpt/stderr<i>).
    args = (str(tmp_path / "second"), "0", "--per-worker-dir")
    codes = ENGINE.run(ckpt, *args, timeout=120)
    said = [mpt.stderr(ckpt, w) for w in range(2)]
    # Both raised, before any step. Worker 1's exit may meet JAX's abort once worker 0
    # (the coordinator) is gone.
    assert codes[0] == 1 and codes[1] in (1, -signal.SIGABRT), (codes, said)
    for w in range(2):
        raised = "CheckpointMismatchError: The workers would restore different checkpoints"
        assert raised in said[w], said[w][-3000:]
        assert "Every worker raised this error; nothing was restored." in said[w]
    assert f"worker 0 (this worker): the checkpoint of step 2 (manifest {word})" in said[0]
    assert "worker 1: no checkpoint" in said[0], said[0][-3000:]
    assert f"looked in {str(ckpt / 'worker0' / 'ckpt-2')!r}" in said[0], said[0][-3000:]
    assert f"worker 0: the checkpoint of step 2 (manifest {word})" in said[1]
    assert "worker 1 (this worker): no checkpoint" in said[1], said[1][-3000:]
    assert f"looked in {str(ckpt / 'worker1')!r}" in said[1], said[1][-3000:]
    assert not list(tmp_path.glob("second.*.json"))
    # Nothing was saved or restored: the chief's checkpoints are as they were.
    assert sorted(n for n in os.listdir(ckpt / "worker0") if n[0] != ".") == chiefs
    assert _manifest_word(ckpt / "worker0" / "ckpt-2") == word
    assert not (ckpt / "worker1").exists()
