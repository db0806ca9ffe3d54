"""examples/multi_worker_train.py on 2 torch worker processes (`polydist launch`): the
simulator's weights, and a restart from the chief's checkpoint changes nothing."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pytest

from polydist import _launch

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "multi_worker_train.py"


def _launch_example(*args: str) -> str:
    log = io.StringIO()
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "RANK", "WORLD_SIZE")}
    result = _launch.launch(
        2, str(EXAMPLE), ["--engine", "torch", *args], timeout=180, stdout=log, stderr=log, env=env
    )
    assert result.exit_code == 0, f"{result.message}\n{log.getvalue()[-3000:]}"
    return log.getvalue()


@pytest.mark.skipif(not EXAMPLE.exists(), reason="runs from a checkout of the repository")
def test_two_torch_workers_train_to_the_sims_weights_and_resume(tmp_path: Path) -> None:
    out = _launch_example("--ckpt", str(tmp_path))
    weights = re.findall(r"worker (\d): w = (\[.*\])", out)
    assert sorted(w for w, _ in weights) == ["0", "1"], out
    assert weights[0][1] == weights[1][1], out  # every worker holds the same weights
    diffs = [float(d) for d in re.findall(r"largest difference from the sim: (\S+)", out)]
    assert len(diffs) == 2 and max(diffs) <= 1e-6, out
    # Started again, the workers resume after the last step: the same weights.
    again = _launch_example("--ckpt", str(tmp_path))
    assert re.findall(r"worker \d: w = (\[.*\])", again) == [weights[0][1]] * 2, again
