"""examples/tutorial_sim.py: TF's custom-training tutorial on the simulator, run as a user would.

It trains, evaluates with polydist.metrics, saves with CheckpointManager, restores
in a fresh process, continues, and compares its weights with single-device
training (exit status 1 on a mismatch)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "examples" / "tutorial_sim.py"


@pytest.mark.skipif(not SCRIPT.exists(), reason="runs from a checkout of the repository")
def test_tutorial_sim_trains_resumes_and_matches_one_device() -> None:
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    epochs = re.findall(r"^Epoch (\d), Loss: ([\d.]+), Accuracy: ([\d.]+)", out, re.M)
    assert [e[0] for e in epochs] == ["1", "2", "3", "4"], out
    assert float(epochs[-1][1]) < float(epochs[0][1])  # it learns
    assert re.search(r"^restored .*ckpt-2 \(epoch 2\)$", out, re.M), out
    assert "4 replicas match single-device training" in out
    worst = float(re.search(r"largest difference from single-device training: (\S+)", out)[1])
    assert worst < 1e-5
