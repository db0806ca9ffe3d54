"""MultiWorkerMirroredStrategy on torch.distributed (gloo): 2 worker processes x 2 replicas.

Each multi-process test starts the workers (``mw_program.py``) on 127.0.0.1 with
free ports, every process bounded by a timeout, and compares what they wrote
with the sim's MultiWorkerMirroredStrategy of the same cluster shape.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import polydist as pd
from polydist import _launch
from polydist.cluster_resolver import ClusterSpec, SimpleClusterResolver
from polydist_conformance import multiprocess
from polydist_conformance.tolerance import Reduction, within_bound
from polydist_sim import SimBackend

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX process groups")

HERE = Path(__file__).resolve().parent
PROGRAM = str(HERE / "mw_program.py")
sys.path.insert(0, str(HERE))
import mw_program  # noqa: E402

WORKERS = 2
D = mw_program.D


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    return env


def _launch_workers(out: Path, *args: str, timeout: float = 60) -> _launch.LaunchResult:
    log = io.StringIO()
    result = _launch.launch(
        WORKERS, PROGRAM, [str(out), *args], timeout=timeout, stdout=log, stderr=log, env=_env()
    )
    result.message += "\n" + log.getvalue()[-4000:]
    return result


def _start(out: Path, *args: str) -> list[subprocess.Popen[bytes]]:
    """The workers as plain processes (no launcher to stop the others when one fails)."""
    ports = _launch.free_ports(WORKERS)
    return [
        subprocess.Popen(
            [sys.executable, PROGRAM, str(out), *args],
            env=_launch.worker_environment(i, ports, base=_env()),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(WORKERS)
    ]


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def _error(out: Path, rank: int) -> dict[str, str]:
    path = out / f"error{rank}.json"
    assert path.exists(), f"worker {rank} wrote no error"
    return dict(json.loads(path.read_text()))


def _wait_progress(out: Path, rank: int, step: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    path = out / f"progress{rank}"
    while time.monotonic() < deadline:
        if path.exists() and path.read_text() and int(path.read_text()) >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"worker {rank} did not reach step {step} within {timeout} s")


# --------------------------------------------------------------------------- the sim's answer


@pytest.fixture(scope="module")
def sim_results() -> dict[str, list[np.ndarray]]:
    resolver = SimpleClusterResolver(
        ClusterSpec({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}),
        task_type="worker",
        task_id=0,
        num_accelerators={"GPU": D},
    )
    strategy = pd.MultiWorkerMirroredStrategy(resolver, backend=SimBackend(num_gpus=D))
    assert strategy.num_replicas_in_sync == WORKERS * D
    return mw_program.program(strategy)


@pytest.fixture(scope="module")
def torch_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list[np.ndarray]]]:
    out = tmp_path_factory.mktemp("compute")
    result = _launch_workers(out, "compute")
    assert result.exit_code == 0, result.message
    return [mw_program.load(out / f"worker{w}.npz") for w in range(WORKERS)]


def _as_global(per_worker: list[dict[str, list[np.ndarray]]], key: str) -> list[np.ndarray]:
    """Every replica's component, worker-major (each worker wrote its own D)."""
    parts = [r[key] for r in per_worker]
    assert all(len(p) == D for p in parts), f"{key}: experimental_local_results gave {parts}"
    return [c for p in parts for c in p]


def _same_everywhere(per_worker: list[dict[str, list[np.ndarray]]], key: str) -> np.ndarray:
    first = per_worker[0][key][0]
    for w, r in enumerate(per_worker[1:], start=1):
        assert np.array_equal(r[key][0], first), f"{key} differs on worker {w}"
    return first


def _check_sum(
    actual: np.ndarray, expected: np.ndarray, terms: list[np.ndarray], mean: bool
) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    reduction = Reduction.across_replicas(terms, mean=mean)
    ok = within_bound(actual, expected, reduction, oracle_exact=True)
    assert ok.all(), f"outside the bound at {np.argwhere(~ok).tolist()}: {actual} vs {expected}"


EXACT_PER_REPLICA = ("replica_id", "local_values", "all_reduce_int", "all_gather")
EXACT_CROSS_REPLICA = ("reduce_int_mean", "reduce_axis_mean", "gather", "host_sum", "bool_refused")


@pytest.mark.parametrize("key", EXACT_PER_REPLICA)
def test_per_replica_results_equal_the_sim_exactly(
    key: str,
    torch_results: list[dict[str, list[np.ndarray]]],
    sim_results: dict[str, list[np.ndarray]],
) -> None:
    got = _as_global(torch_results, key)
    assert len(got) == len(sim_results[key]) == WORKERS * D
    for r, (a, b) in enumerate(zip(got, sim_results[key])):
        assert a.dtype == b.dtype and np.array_equal(a, b), f"replica {r}: {a} != {b}"


@pytest.mark.parametrize("key", EXACT_CROSS_REPLICA)
def test_cross_replica_results_equal_the_sim_exactly(
    key: str,
    torch_results: list[dict[str, list[np.ndarray]]],
    sim_results: dict[str, list[np.ndarray]],
) -> None:
    got = _same_everywhere(torch_results, key)
    want = sim_results[key][0]
    assert got.dtype == want.dtype and np.array_equal(got, want), f"{got} != {want}"


def test_replica_ids_and_input_pipelines(torch_results: list[dict[str, list[np.ndarray]]]) -> None:
    assert [int(x) for x in _as_global(torch_results, "replica_id")] == [0, 1, 2, 3]
    assert float(_same_everywhere(torch_results, "host_sum")) == 1.5 * WORKERS
    assert _same_everywhere(torch_results, "bool_refused").tolist() == [True, True, True]
    pipelines = _same_everywhere(torch_results, "input_pipelines")
    assert {tuple(p) for p in pipelines.tolist()} == {(WORKERS, 0), (WORKERS, 1)}


@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
def test_sums_are_within_the_rounding_bound_of_the_sims(
    mean: bool,
    torch_results: list[dict[str, list[np.ndarray]]],
    sim_results: dict[str, list[np.ndarray]],
) -> None:
    terms = _as_global(torch_results, "local_values")
    name = "mean" if mean else "sum"
    for got, want in zip(
        _as_global(torch_results, f"all_reduce_{name}"), sim_results[f"all_reduce_{name}"]
    ):
        _check_sum(got, want, terms, mean)
    _check_sum(
        _same_everywhere(torch_results, f"reduce_{name}"),
        sim_results[f"reduce_{name}"][0],
        terms,
        mean,
    )


def test_sgd_matches_the_sim(
    torch_results: list[dict[str, list[np.ndarray]]],
    sim_results: dict[str, list[np.ndarray]],
) -> None:
    steps = sum(1 for k in sim_results if k.startswith("sgd_w_"))
    assert steps == 3
    for step in range(steps):
        local = _as_global(torch_results, f"sgd_local_{step}")
        totals = _as_global(torch_results, f"sgd_total_{step}")
        # Each step's all-reduce is within the bound of the exact sum of ITS inputs ...
        exact = np.asarray(
            [math.fsum(v) for v in np.stack(local).reshape(len(local), -1).T.astype(np.float64)],
        ).reshape(local[0].shape)
        reduction = Reduction.across_replicas(local)
        for t in totals:
            assert np.array_equal(t, totals[0])  # every replica got the same sum
            assert within_bound(t, exact.astype(np.float32), reduction, oracle_exact=False).all()
        # ... and the weights follow the sim's within float32 rounding.
        np.testing.assert_allclose(
            _same_everywhere(torch_results, f"sgd_w_{step}"),
            sim_results[f"sgd_w_{step}"][0],
            rtol=1e-5,
            atol=1e-6,
        )
    # The first step's gradients do not depend on earlier rounding: within the bound.
    for got, want in zip(_as_global(torch_results, "sgd_total_0"), sim_results["sgd_total_0"]):
        _check_sum(got, want, _as_global(torch_results, "sgd_local_0"), mean=False)


# --------------------------------------------------------------------------- checkpoints


def test_only_the_chief_writes_and_a_restart_resumes(tmp_path: Path) -> None:
    steps = "5"
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    for d in (whole, broken):
        (d / "ckpt").mkdir(parents=True)
    result = _launch_workers(whole, "train", "--steps", steps, "--ckpt", str(whole / "ckpt"))
    assert result.exit_code == 0, result.message
    saved = [mw_program.load(whole / f"train{w}.npz")["saved"][0] for w in range(WORKERS)]
    assert [int(s) for s in saved] == [5, 0]  # checkpoint.save returned None on worker 1
    assert [p.name for p in sorted((whole / "ckpt").glob("ckpt-*"))][-1] == "ckpt-4"

    # Worker 1 dies at step 3: the launcher stops worker 0; the restart resumes at step 3.
    args = ("train", "--steps", steps, "--ckpt", str(broken / "ckpt"))
    result = _launch_workers(broken, *args, "--die-at", "3")
    assert result.exit_code == 3 and result.failed_worker == 1, result.message
    assert pd.checkpoint.read_manifest(broken / "ckpt").step == 2
    assert not (broken / "train0.npz").exists()
    result = _launch_workers(broken, *args)
    assert result.exit_code == 0, result.message
    for w in range(WORKERS):
        resumed = mw_program.load(broken / f"train{w}.npz")
        uninterrupted = mw_program.load(whole / f"train{w}.npz")
        assert int(resumed["start"][0]) == 3
        assert np.array_equal(resumed["w"][0], uninterrupted["w"][0]), "restart changed w"


# --------------------------------------------------------------------------- faults

TIMEOUT = 5.0
# Noticing a dead peer's closed socket is immediate; naming it takes the heartbeat check.
DIAGNOSIS = 4.0


@pytest.fixture
def out(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize("victim", [1, 0], ids=["worker1-dies", "worker0-dies"])
def test_a_killed_worker_makes_the_survivor_raise_unavailable(out: Path, victim: int) -> None:
    procs = _start(out, "train", "--steps", "200", "--slow", "0.1", "--timeout", str(TIMEOUT))
    try:
        _wait_progress(out, victim, 2)
        procs[victim].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        survivor = 1 - victim
        code = procs[survivor].wait(timeout=TIMEOUT + DIAGNOSIS + 10)
        elapsed = time.monotonic() - killed
    finally:
        _stop(procs)
    assert code == 17
    assert elapsed < TIMEOUT + DIAGNOSIS, f"took {elapsed:.1f} s"
    error = _error(out, survivor)
    assert error["type"] == "UnavailableError", error
    assert (
        f"worker(s) {victim} (/job:worker/replica:0/task:{victim} at 127.0.0.1:" in error["message"]
    )
    assert "restart" in error["message"]


def test_a_worker_that_never_arrives_is_named(out: Path) -> None:
    procs = _start(out, "late", "--timeout", "3")
    try:
        code = procs[0].wait(timeout=30)
    finally:
        _stop(procs)
    assert code == 17
    error = _error(out, 0)
    assert error["type"] == "DeadlineExceededError", error
    assert "Worker(s) 1 (/job:worker/replica:0/task:1 at 127.0.0.1:" in error["message"]
    assert "did not join the cluster of 2 workers within 3 s" in error["message"]
    joined = float((out / "joined0").read_text()) if (out / "joined0").exists() else None
    assert joined is None  # the strategy was never created


def test_a_stalled_worker_is_named_after_the_timeout(out: Path) -> None:
    procs = _start(out, "train", "--steps", "6", "--stall-at", "2", "--timeout", "3")
    try:
        code = procs[0].wait(timeout=40)
    finally:
        _stop(procs)
    assert code == 17
    error = _error(out, 0)
    assert error["type"] == "DeadlineExceededError", error
    assert "did not complete within 3 s" in error["message"]
    assert "worker(s) 1 (/job:worker/replica:0/task:1" in error["message"]
    assert "alive but did not reach it" in error["message"]


def test_worker_0_unreachable(tmp_path: Path) -> None:
    """Worker 1 alone: nobody hosts the rendezvous, so it names worker 0 within the bound."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port0 = s.getsockname()[1]
    env = _launch.worker_environment(1, [port0, port0 + 1], base=_env())
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, PROGRAM, str(tmp_path), "compute", "--timeout", "2"],
        env=env,
        timeout=60,
        capture_output=True,
        check=False,
    )
    assert done.returncode == 17
    assert time.monotonic() - start < 20
    error = _error(tmp_path, 1)
    assert error["type"] == "DeadlineExceededError", error
    assert f"could not reach the cluster's rendezvous at 127.0.0.1:{port0}" in error["message"]
    assert "hosted by 0 (/job:worker/replica:0/task:0" in error["message"]


# --------------------------------------------------------------------------- disagreements

# Far beyond how long the test waits for the workers: only the check can end them in time.
MISMATCH_TIMEOUT = "300"


_line = multiprocess.mismatch_site


# case -> what each worker reached, as the message names it
MISMATCHES = {
    "op": (
        f"all_reduce(SUM) of float32[3] at {_line('op (worker 0)')} in sums",
        f"all_gather(axis=0) of float32[*] at {_line('op (worker 1)')} in gathers",
    ),
    "shape": (
        f"all_reduce(SUM) of float32[3] at {_line('shape')} in sums_ones",
        f"all_reduce(SUM) of float32[4] at {_line('shape')} in sums_ones",
    ),
    "reduce_op": (
        f"all_reduce(SUM) of float32[3] at {_line('reduce_op')} in mismatch",
        f"all_reduce(MEAN) of float32[3] at {_line('reduce_op')} in mismatch",
    ),
    "extra": (
        f"all_reduce(SUM) of float32[3] at {_line('extra (worker 0)')} in mismatch",
        f"all_gather(axis=0) of float32[*] at {_line('extra (worker 1)')} in mismatch",
    ),
}


def _mismatch_workers(out: Path, case: str) -> list[int | None]:
    procs = _start(out, "mismatch", "--case", case, "--timeout", MISMATCH_TIMEOUT)
    try:
        return [p.wait(timeout=120) for p in procs]
    finally:
        _stop(procs)


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_workers_that_disagree_on_a_collective_raise_collective_mismatch(
    out: Path, case: str
) -> None:
    assert _mismatch_workers(out, case) == [17, 17]
    for rank in range(WORKERS):
        error = _error(out, rank)
        assert error["type"] == "CollectiveMismatchError", error
        message = error["message"]
        assert message.startswith("Workers disagree on their collective #2;"), message
        for w, reached in enumerate(MISMATCHES[case]):
            assert f"\n  worker {w} (/job:worker/replica:0/task:{w} at 127.0.0.1:" in message
            assert f"): {reached}\n" in message, message


def test_a_worker_that_ended_is_named_by_the_one_still_calling(out: Path) -> None:
    assert _mismatch_workers(out, "early_exit") == [17, 0]
    assert (out / "done1").exists() and not (out / "done0").exists()
    error = _error(out, 0)
    assert error["type"] == "CollectiveMismatchError", error
    message = error["message"]
    reached = f"all_reduce(SUM) of float32[3] at {_line('early_exit (worker 0)')} in mismatch"
    assert "  worker 0 (/job:worker/replica:0/task:0 at 127.0.0.1:" in message
    assert f"): {reached}\n" in message, message
    assert "  worker 1 (/job:worker/replica:0/task:1 at 127.0.0.1:" in message
    assert "): left the cluster after 1 collective(s) (its program ended" in message, message


# --------------------------------------------------------------------------- torchrun


def test_torchrun_environment(tmp_path: Path, sim_results: dict[str, list[np.ndarray]]) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={WORKERS}",
            PROGRAM,
            str(tmp_path),
            "compute",
        ],
        env=_env(),
        timeout=90,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [mw_program.load(tmp_path / f"worker{w}.npz") for w in range(WORKERS)]
    assert [int(x) for x in _as_global(results, "replica_id")] == [0, 1, 2, 3]
    assert np.array_equal(_same_everywhere(results, "gather"), sim_results["gather"][0])


# --------------------------------------------------------------------------- in-process


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.usefixtures("no_cluster")
def test_without_a_cluster_it_is_one_worker() -> None:
    import torch

    from polydist_torch._multi_worker import MultiWorkerMirroredStrategy, TorchProcessGroupBackend

    backend = TorchProcessGroupBackend()
    strategy = MultiWorkerMirroredStrategy(local_devices=3, backend=backend)
    assert strategy.num_replicas_in_sync == 3
    assert strategy.extended._num_workers == 1 and strategy.extended.should_checkpoint
    assert backend.capabilities.multi_worker and not backend.connected
    out = strategy.run(
        lambda: _ctx_all_reduce(
            torch.ones(2) * (1 + pd.get_replica_context().replica_id_in_sync_group)
        )
    )
    assert [t.tolist() for t in strategy.experimental_local_results(out)] == [[6.0, 6.0]] * 3
    assert strategy.reduce(pd.ReduceOp.MEAN, out, axis=None).tolist() == [6.0, 6.0]


def _ctx_all_reduce(x: object) -> object:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return ctx.all_reduce(pd.ReduceOp.SUM, x)


@pytest.mark.usefixtures("no_cluster")
def test_single_worker_tf_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from polydist_torch._multi_worker import MultiWorkerMirroredStrategy, TorchProcessGroupBackend

    config = {"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    strategy = MultiWorkerMirroredStrategy(local_devices=2, backend=TorchProcessGroupBackend())
    assert strategy.extended.worker_devices == (
        "/job:worker/replica:0/task:0/device:CPU:0",
        "/job:worker/replica:0/task:0/device:CPU:1",
    )
    assert float(strategy.reduce("MEAN", np.float32(2.0), axis=None)) == 2.0


@pytest.mark.usefixtures("no_cluster")
def test_argument_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    from polydist_torch._multi_worker import MultiWorkerMirroredStrategy, TorchProcessGroupBackend

    with pytest.raises(ValueError, match="local_devices must be >= 1, got 0"):
        MultiWorkerMirroredStrategy(local_devices=0, backend=TorchProcessGroupBackend())
    with pytest.raises(
        TypeError, match="backend must be a polydist_torch.TorchProcessGroupBackend"
    ):
        MultiWorkerMirroredStrategy(backend=SimBackend())  # type: ignore[arg-type]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="set MASTER_ADDR and MASTER_PORT"):
        MultiWorkerMirroredStrategy(backend=TorchProcessGroupBackend())
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ValueError, match=r"\$RANK=2 is out of range for \$WORLD_SIZE=2"):
        MultiWorkerMirroredStrategy(backend=TorchProcessGroupBackend())


def test_bad_rendezvous_address() -> None:
    from polydist_torch._multi_worker import _split_address

    assert _split_address("10.0.0.1:2222") == ("10.0.0.1", 2222)
    assert _split_address("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError, match="must be 'host:port'"):
        _split_address("localhost")
