"""examples/tutorial_torch.py (TF's custom-training tutorial in torch.nn + torch.optim) runs
and ends where single-device training does; CI runs it here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tutorial_torch.py"


@pytest.mark.skipif(not EXAMPLE.exists(), reason="runs from a checkout of the repository")
def test_tutorial_trains_restarts_and_matches_single_device(tmp_path: Path) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        cwd=tmp_path,
        env=env,
        timeout=300,
        capture_output=True,
        text=True,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    epochs = [line for line in out.splitlines() if line.startswith("Epoch ")]
    assert [line.split(",")[0] for line in epochs] == [f"Epoch {e}" for e in (1, 2, 3, 4)]
    assert "restored " in out and "(epoch 2)" in out  # the fresh process resumed
    # It learns: the last epoch's test accuracy (synthetic data, 4 epochs).
    assert float(epochs[-1].rsplit("Test Accuracy: ", 1)[1]) > 80.0
    assert "4 replicas match single-device training" in out
