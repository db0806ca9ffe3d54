"""The out-of-place all-reduce across worker processes: recycled memory, TF semantics.

Workers (``mw_out_of_place.py``) run under ``polydist launch`` on 127.0.0.1:
2 workers (one exact rounding per element, so even random floats must match
NumPy's sum bit for bit) and 3 (gloo's ring order; integer-valued data, so
every summation order is exact).
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from polydist.backend import launch as _launch

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX process groups")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import mw_out_of_place as program  # noqa: E402


def _launch_workers(
    workers: int, out: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[_launch.LaunchResult, str]:
    base = dict(os.environ)
    for key in ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        base.pop(key, None)
    base["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    base["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU, also on a GPU machine
    log = io.StringIO()
    result = _launch.launch(
        workers,
        str(HERE / "mw_out_of_place.py"),
        [str(out), *args],
        timeout=240,
        stdout=log,
        stderr=log,
        env={**base, **(env or {})},
    )
    return result, result.message + "\n" + log.getvalue()[-4000:]


def _run(workers: int, out: Path) -> list[dict[str, np.ndarray]]:
    result, log = _launch_workers(workers, out)
    assert result.exit_code == 0, log
    loaded = []
    for w in range(workers):
        with np.load(out / f"worker{w}.npz") as data:
            loaded.append({k: data[k] for k in data.files})
    return loaded


@pytest.fixture(scope="module", params=[2, 3], ids=["2-workers", "3-workers"])
def run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, np.ndarray]]]:
    workers: int = request.param
    return workers, _run(workers, tmp_path_factory.mktemp(f"w{workers}"))


def _input(case: str, worker: int, replica: int = 0) -> np.ndarray:
    x = program.inputs(case, worker, replica)
    return x.T if case == "matrix_t" else x


def _sum(case: str, workers: int, replicas: int = 1) -> np.ndarray:
    """The sum in worker order (exact for every case but 'random', where 2 terms round once)."""
    terms = [_input(case, w, r) for w in range(workers) for r in range(replicas)]
    total = terms[0].copy()
    for t in terms[1:]:
        total = total + t
    return total


@pytest.mark.parametrize("case", program.CASES)
def test_group_all_reduce_is_the_sum_and_leaves_the_input(
    case: str, run: tuple[int, list[dict[str, np.ndarray]]]
) -> None:
    workers, results = run
    want = _sum(case, workers)
    for w, r in enumerate(results):
        got = r[f"group_{case}"]
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape)
        assert np.array_equal(got, results[0][f"group_{case}"]), f"worker {w} differs from 0"
        if case == "random" and workers > 2:
            _check_rounding(got, [_input(case, v) for v in range(workers)])
        else:
            assert np.array_equal(got, want), f"worker {w}: {case} sum differs"
        assert np.array_equal(r[f"group_{case}_input_after"], _input(case, w)), "input changed"


def _check_rounding(got: np.ndarray, terms: list[np.ndarray]) -> None:
    """Within the error bound of a float32 sum in any order: n-1 roundings of at most
    u = 2**-24 each, relative to the sum of magnitudes (the float64 sums are exact here)."""
    exact = np.sum([t.astype(np.float64) for t in terms], axis=0)
    magnitude = np.sum([np.abs(t.astype(np.float64)) for t in terms], axis=0)
    k = len(terms) - 1
    bound = k * 2.0**-24 / (1 - k * 2.0**-24) * magnitude
    assert (np.abs(got.astype(np.float64) - exact) <= bound).all()


def test_strategy_one_replica_per_worker(run: tuple[int, list[dict[str, np.ndarray]]]) -> None:
    workers, results = run
    total = _sum("ints", workers)
    for w, r in enumerate(results):
        assert np.array_equal(r["one_sum"], total), "a result still held was overwritten"
        assert np.array_equal(r["one_sum_x3"], 3 * total)
        assert r["one_mean"].dtype == np.float32
        assert np.array_equal(r["one_mean"], total / np.float32(workers))
        assert np.array_equal(r["one_input_after"], _input("ints", w))
        assert bool(r["one_recycled"]), "the dropped result's memory was not reused"
        assert bool(r["one_held_kept"])
        assert np.array_equal(r["one_reduce"], total)


def test_strategy_two_replicas_per_worker(run: tuple[int, list[dict[str, np.ndarray]]]) -> None:
    workers, results = run
    total = _sum("ints", workers, replicas=2)
    for w, r in enumerate(results):
        assert np.array_equal(r["two_sum"], np.stack([total, total]))
        assert np.array_equal(r["two_sum_after_add"], np.stack([total + 1, total]))
        assert bool(r["two_distinct"])
        assert np.array_equal(
            r["two_inputs_after"], np.stack([_input("ints", w, 0), _input("ints", w, 1)])
        )


def test_a_stalled_peer_is_named_after_the_timeout(tmp_path: Path) -> None:
    # Without the collective check, the stalled peer is met inside gloo's all_reduce.
    result, log = _launch_workers(2, tmp_path, "stall", env={"POLYDIST_CHECK_COLLECTIVES": "0"})
    assert result.exit_code == 17 and result.failed_worker == 0, log
    error = json.loads((tmp_path / "error0.json").read_text())
    assert error["type"] == "DeadlineExceededError", error
    assert (
        "all_reduce (collective #2 of worker 0) across 2 workers did not complete within 3 s"
        in (error["message"])
    )
    assert "worker(s) 1 (/job:worker/replica:0/task:1" in error["message"]
    assert "alive but did not reach it" in error["message"]
    assert error["after"] < 3 + 10


def test_unchecked_collectives_carry_no_presence_flag(tmp_path: Path) -> None:
    # With checks off the flag serves nothing, and gloo sums a round size faster.
    result, log = _launch_workers(2, tmp_path, "unchecked", env={"POLYDIST_CHECK_COLLECTIVES": "0"})
    assert result.exit_code == 0, log
    total = _sum("ints", 2)
    for w in range(2):
        with np.load(tmp_path / f"worker{w}.npz") as r:
            assert np.array_equal(r["one_sum"], total)
            assert np.array_equal(r["one_sum_again"], total)
            assert np.array_equal(
                r["nest"], np.concatenate([total[:1000], total[:20_000], total[:7]])
            )
            assert np.array_equal(r["two_sum"], np.stack([_sum("ints", 2, replicas=2)] * 2))
            # One replica: the input's size, twice; the nest packed (21,007 floats); two
            # replicas: their local sum, the input's size.
            assert r["issued"].tolist() == [program.BIG, program.BIG, 21_007, program.BIG], r[
                "issued"
            ]


def _nest_sum(workers: int, replicas: int = 1) -> list[np.ndarray]:
    """Each `program.NEST` array's sum in worker order (exact: integer-valued data)."""
    terms = [program.nest_inputs(w, r) for w in range(workers) for r in range(replicas)]
    totals = [t.copy() for t in terms[0]]
    for term in terms[1:]:
        totals = [(a + b).astype(a.dtype) for a, b in zip(totals, term, strict=True)]
    return totals


@pytest.mark.parametrize("name", ["packed", "packed_small"])
def test_a_nest_all_reduced_in_packs_gives_each_arrays_sum(
    name: str, run: tuple[int, list[dict[str, np.ndarray]]]
) -> None:
    workers, results = run
    want = _nest_sum(workers)
    for w, r in enumerate(results):
        for i, total in enumerate(want):
            got = r[f"{name}_{i}"]
            assert got.dtype == total.dtype and got.shape == total.shape, (i, got.dtype, got.shape)
            assert np.array_equal(got, total), f"worker {w}: array {i} of the nest"
        assert r[f"{name}_own_tensors"].all(), "a packed result is a view of the pack"
        # One collective per dtype (5); packs of <= 64 bytes split float32's 6 arrays in 4.
        assert int(r[f"{name}_collectives"]) == (5 if name == "packed" else 8)
        # A one-element result has memory of its own (keeping it keeps no pack alive),
        # other small ones share one copy of the pack's tail; large ones in one pack
        # share the pack's.
        assert bool(r[f"{name}_scalar_own_memory"])
        assert bool(r[f"{name}_small_share_a_tail"]) == (name == "packed")
        assert bool(r[f"{name}_big_share_memory"]) == (name == "packed")
        assert np.array_equal(r[f"{name}_after_add"], want[3]), "results share elements"
        inputs = np.concatenate([a.ravel().real for a in program.nest_inputs(w)])
        assert np.array_equal(r["packed_inputs_after"], inputs), "an input changed"


def test_a_nest_with_two_replicas_per_worker(run: tuple[int, list[dict[str, np.ndarray]]]) -> None:
    workers, results = run
    want = _nest_sum(workers, replicas=2)
    for r in results:
        for i, total in enumerate(want):
            assert np.array_equal(r[f"packed_two_{i}"], np.stack([total, total])), i


def test_gradients_flow_through_a_packed_all_reduce(
    run: tuple[int, list[dict[str, np.ndarray]]],
) -> None:
    # loss_w = (w + 3) * sum(y0) + sum(y1), y = all_reduce(2 x): the gradient of x0 is
    # 2 * sum over workers of (w + 3); of x1, 2 * workers.
    workers, results = run
    scale = 2.0 * sum(w + 3 for w in range(workers))
    want = np.asarray([scale, scale, 2.0 * workers, 2.0 * workers, 2.0 * workers], np.float32)
    for r in results:
        assert np.array_equal(r["packed_grads"], want)


def test_workers_packing_other_shapes_raise_collective_mismatch(tmp_path: Path) -> None:
    result, log = _launch_workers(2, tmp_path, "pack_mismatch")
    assert result.exit_code != 0, log
    for w in range(2):
        raised = json.loads((tmp_path / f"error{w}.json").read_text())
        assert raised["type"] == "CollectiveMismatchError", raised
        message = raised["message"]
        assert "all_reduce(SUM) of 2 float32 arrays packed: [2] [4,1] at" in message, message
        assert "all_reduce(SUM) of 2 float32 arrays packed: [4] [2,1] at" in message, message


def test_batch_reduce_to_packs_per_destination(
    run: tuple[int, list[dict[str, np.ndarray]]],
) -> None:
    workers, results = run
    want = _nest_sum(workers)
    for r in results:
        # Packed when every destination is on its value's devices (TF's rule), one
        # collective per dtype; else one by one (the other destination: a device).
        assert int(r["batch_collectives"]) == 5
        assert int(r["batch_mixed_collectives"]) == 2 * len(want)
        for i in range(len(want)):
            assert np.array_equal(r[f"batch_{i}"], want[i]), i
        for i in range(2 * len(want)):
            assert np.array_equal(r[f"batch_mixed_{i}"], want[i % len(want)]), i
