"""examples/tutorial_flax.py runs to the end: trains, checkpoints, restores in a fresh
process, trains on, and matches single-device training (it exits non-zero otherwise)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tutorial_flax.py"


def test_tutorial_flax(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),  # XLA_FLAGS from conftest: 8 replicas
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "Number of devices: 8" in output
    # Two epochs before the checkpoint, two after it, in the second process.
    epochs = re.findall(r"Epoch (\d+), Loss: ([\d.]+), Accuracy: ([\d.]+)", output)
    assert [int(e) for e, _, _ in epochs] == [1, 2, 3, 4], output
    losses = [float(loss) for _, loss, _ in epochs]
    assert losses[-1] < losses[0], output  # it learns
    assert re.search(r"Restored step 8: ", output), output  # 1024 / 256 = 4 steps an epoch
    match = re.search(r"Weights equal single-device training \(largest difference (\S+)\)", output)
    assert match is not None, output
    assert float(match.group(1)) <= 1e-4
    assert any((tmp_path / "checkpoints").iterdir())
