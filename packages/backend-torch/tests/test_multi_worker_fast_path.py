"""The collective check's fast path and DistributedOptimizer's gradient bucket on
torch.distributed (gloo): 2 worker processes x 1 replica (``mw_fast_path.py``).

A repeated collective is predicted and issued without waiting for the peers'
signatures (``polydist._collectives.check``); a disagreement after many identical
steps, or a peer that left, must still raise ``CollectiveMismatchError`` on every
worker, naming each worker's call. ``distribute_optimizer`` sums its gradients in a
flat bucket of its own (no copy), which must give the hand-written sums and be
rebuilt when the parameters change.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from polydist_conformance import multiprocess_tests as mpt

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX process groups")

PROGRAM = Path(__file__).resolve().parent / "mw_fast_path.py"
ENGINE = mpt.Engine(
    PROGRAM,
    unset=("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"),
    env={"TORCH_CPP_LOG_LEVEL": "ERROR", "CUDA_VISIBLE_DEVICES": ""},
)


def _line(marker: str) -> str:
    lines = PROGRAM.read_text().splitlines()
    (n,) = [i for i, text in enumerate(lines, start=1) if text.endswith(f"# fast path: {marker}")]
    return f"mw_fast_path.py:{n}"


def test_a_mismatch_after_many_identical_steps_raises_on_both(tmp_path: Path) -> None:
    """Worker 0's sixth step is predicted (fast: issued at once); worker 1 calls another
    all_reduce: both raise, naming both calls, and nothing hangs."""
    assert ENGINE.run(tmp_path, "mismatch", timeout=120) == [17, 17]
    step = f"all_reduce(SUM) of 2 float32 arrays packed: [3,4] [4] at {_line('the step')}"
    other = f"all_reduce(SUM) of float32[2,4] at {_line('the other call')}"
    for rank in range(2):
        error = mpt.error(tmp_path, rank)
        assert error["type"] == "CollectiveMismatchError", error
        message = error["message"]
        assert message.startswith("Workers disagree on their collective #6;"), message
        assert "  worker 0 (/job:worker/replica:0/task:0 at 127.0.0.1:" in message
        assert f"): {step} in _sums\n" in message, message
        assert f"): {other} in _other\n" in message, message


def test_a_peer_that_left_during_a_fast_collective_is_named(tmp_path: Path) -> None:
    assert ENGINE.run(tmp_path, "left", timeout=120) == [17, 0]
    error = mpt.error(tmp_path, 0)
    assert error["type"] == "CollectiveMismatchError", error
    assert "): left the cluster after 5 collective(s) (its program ended" in error["message"]


def test_the_optimizers_gradient_bucket_sums_as_written_by_hand(tmp_path: Path) -> None:
    assert ENGINE.run(tmp_path, "optimizer", timeout=120) == [0, 0], mpt.error(tmp_path, 0)
    for rank in range(2):
        report = json.loads((tmp_path / f"report{rank}.json").read_text())
        # With zero_grad() or zero_grad(set_to_none=False), backward() accumulated into
        # the bucket and step() summed it in place (no copy): p.grad is the same object.
        # Not at the first step (the bucket is made then: autograd's gradients are
        # copied in), nor at the first after the parameters became float64 (rebuilt).
        same, copied = [True] * 4, [False] * 4
        assert report["same_grad_object"] == [copied, *[same] * 5, copied, same], report
        # The gradients held after step 3 keep their values through steps 4 and 5.
        assert report["kept_intact"] == [[True] * 4] * 2, report


def test_a_mismatch_at_the_optimizers_bucket_raises_on_both(tmp_path: Path) -> None:
    """Worker 0's sixth training step sums its gradient bucket on the fast path (issued at
    once, no store round trip); worker 1 calls another all_reduce: both raise, naming
    both calls, and nothing hangs."""
    assert ENGINE.run(tmp_path, "bucket_mismatch", timeout=120) == [17, 17]
    # The bucket: each parameter's gradient, then the has-gradient flags (the unused
    # layer's too).
    shapes = "[3,5] [3] [1,3] [1] [2,2] [2] [6]"
    bucket = f"all_reduce(SUM) of 7 float32 arrays packed: {shapes} at {_line('the bucket')}"
    other = f"all_reduce(SUM) of float32[2,4] at {_line('the other call')}"
    for rank in range(2):
        error = mpt.error(tmp_path, rank)
        assert error["type"] == "CollectiveMismatchError", error
        message = error["message"]
        assert message.startswith("Workers disagree on their collective #"), message
        assert f"): {bucket} in train\n" in message, message
        assert f"): {other} in _other\n" in message, message
