"""A multi-worker training loop that checkpoints its model, optimizer and iterator with a
CheckpointManager, run under ``polydist launch -n 2``
(``polydist_conformance.checkpoint_worker``): stopped and restarted, it ends where an
uninterrupted run ends, with the simulator's weights; a worker that cannot read the
chief's checkpoints fails on every worker instead of training from its initial
weights."""

from __future__ import annotations

import os
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
    unset=("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"),
    env={"TORCH_CPP_LOG_LEVEL": "ERROR", "CUDA_VISIBLE_DEVICES": "", "ENGINE": "torch"},
)


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The simulator's MultiWorkerMirroredStrategy of 2 workers, uninterrupted."""
    return checkpoint_worker.simulated(ENGINE, tmp_path_factory.mktemp("sim"))


def test_a_restarted_run_ends_as_the_uninterrupted_one(tmp_path: Path, sim: dict[str, Any]) -> None:
    checkpoint_worker.run(ENGINE, str(tmp_path / "whole"), str(tmp_path / "whole"), "0")
    whole = checkpoint_worker.load(tmp_path / "whole")
    assert whole[0]["steps"] == 6 and len(sim["seen"]) == 6  # the last step partial
    assert whole[0]["seen"] == whole[1]["seen"] == sim["seen"]
    np.testing.assert_allclose(whole[0]["w"], sim["w"], rtol=1e-6, atol=1e-6)
    # One directory for both workers (one machine): only the chief writes in it.
    ckpt = str(tmp_path / "ckpt")
    checkpoint_worker.run(ENGINE, ckpt, str(tmp_path / "first"), "3")
    checkpoint_worker.run(ENGINE, ckpt, str(tmp_path / "second"), "0")
    first, second = (
        checkpoint_worker.load(tmp_path / "first"),
        checkpoint_worker.load(tmp_path / "second"),
    )
    for w in range(2):
        assert first[w]["seen"] + second[w]["seen"] == whole[w]["seen"]
        assert second[w]["w"] == whole[w]["w"]  # bit for bit
        assert second[w]["steps"] == 6
        # The non-chief lists what the chief keeps (max_to_keep=2), not every save.
        assert second[w]["checkpoints"] == ["ckpt-5", "ckpt-6"]
    assert sorted(n for n in os.listdir(ckpt) if n[0] != ".") == ["checkpoint", "ckpt-5", "ckpt-6"]


def test_a_worker_without_the_chiefs_checkpoint_fails_on_every_worker(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    checkpoint_worker.run(ENGINE, ckpt, str(tmp_path / "first"), "2", "--per-worker-dir")
    assert not os.path.exists(os.path.join(ckpt, "worker1"))  # only the chief writes
    code, out = checkpoint_worker.launch(
        ENGINE, ckpt, str(tmp_path / "second"), "0", "--per-worker-dir"
    )
    assert code != 0
    for w in range(2):  # each raised it, before any step
        assert f"[worker {w}] " in out and "would restore different checkpoints" in out, out
    assert "worker 0: the checkpoint of step 2" in out, out
    assert "worker 1 (this worker): no checkpoint" in out, out
    assert not list(tmp_path.glob("second.*.json"))
