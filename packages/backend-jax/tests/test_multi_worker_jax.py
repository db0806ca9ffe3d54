"""MultiWorkerMirroredStrategy on jax.distributed (gloo): 2 worker processes x 2 CPU devices.

Each multi-process test starts the workers (``mw_program.py``) on 127.0.0.1 with
free ports, every process bounded by a timeout, and compares what they wrote
with the sim's MultiWorkerMirroredStrategy of the same cluster shape.
"""

from __future__ import annotations

import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import polydist as pd
from polydist import _launch
from polydist.cluster_resolver import ClusterSpec, SimpleClusterResolver
from polydist_conformance import multiprocess
from polydist_conformance.tolerance import Reduction, within_bound
from polydist_jax._multi_worker import WATCHDOG_EXIT_CODE
from polydist_sim import SimBackend

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX process groups")

HERE = Path(__file__).resolve().parent
PROGRAM = str(HERE / "mw_program.py")
sys.path.insert(0, str(HERE))
import mw_program  # noqa: E402  (conftest puts this directory on sys.path too)

WORKERS = 2
D = mw_program.D


def _env(jit: bool = True) -> dict[str, str]:
    env = dict(os.environ)
    # The workers set their own device count (jax_num_cpu_devices), not the tests' 8.
    for key in ("TF_CONFIG", "XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "POLYDIST_PROCESS_ID"):
        env.pop(key, None)
    env["MW_PROGRAM_JIT"] = "1" if jit else "0"
    return env


def _launch_workers(
    out: Path, *args: str, timeout: float = 60, jit: bool = True
) -> _launch.LaunchResult:
    log = io.StringIO()
    result = _launch.launch(
        WORKERS, PROGRAM, [str(out), *args], timeout=timeout, stdout=log, stderr=log, env=_env(jit)
    )
    result.message += "\n" + log.getvalue()[-4000:]
    return result


def _start(out: Path, *args: str, jit: bool = True) -> list[subprocess.Popen[bytes]]:
    """The workers as plain processes (no launcher to stop the others when one fails);
    worker i's stderr goes to ``out/stderr<i>``."""
    ports = _launch.free_ports(WORKERS)
    procs = []
    for i in range(WORKERS):
        with (out / f"stderr{i}").open("wb") as err:  # the child keeps its own copy
            procs.append(
                subprocess.Popen(
                    [sys.executable, PROGRAM, str(out), *args],
                    env=_launch.worker_environment(i, ports, base=_env(jit)),
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            )
    return procs


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


def _sim_strategy() -> pd.Strategy:
    resolver = SimpleClusterResolver(
        ClusterSpec({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}),
        task_type="worker",
        task_id=0,
        num_accelerators={"GPU": D},
    )
    strategy = pd.MultiWorkerMirroredStrategy(resolver, backend=SimBackend(num_gpus=D))
    assert strategy.num_replicas_in_sync == WORKERS * D
    return strategy


@pytest.fixture(scope="module")
def sim_results() -> dict[str, list[np.ndarray]]:
    return mw_program.program(_sim_strategy())


@pytest.fixture(scope="module")
def jax_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list[np.ndarray]]]:
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
    jax_results: list[dict[str, list[np.ndarray]]],
    sim_results: dict[str, list[np.ndarray]],
) -> None:
    got = _as_global(jax_results, key)
    assert len(got) == len(sim_results[key]) == WORKERS * D
    for r, (a, b) in enumerate(zip(got, sim_results[key])):
        assert a.dtype == b.dtype and np.array_equal(a, b), f"replica {r}: {a} != {b}"


@pytest.mark.parametrize("key", EXACT_CROSS_REPLICA)
def test_cross_replica_results_equal_the_sim_exactly(
    key: str,
    jax_results: list[dict[str, list[np.ndarray]]],
    sim_results: dict[str, list[np.ndarray]],
) -> None:
    got = _same_everywhere(jax_results, key)
    want = sim_results[key][0]
    assert got.dtype == want.dtype and np.array_equal(got, want), f"{got} != {want}"


def test_replica_ids_and_input_pipelines(jax_results: list[dict[str, list[np.ndarray]]]) -> None:
    assert [int(x) for x in _as_global(jax_results, "replica_id")] == [0, 1, 2, 3]
    assert float(_same_everywhere(jax_results, "host_sum")) == 1.5 * WORKERS
    assert _same_everywhere(jax_results, "bool_refused").tolist() == [True, True, True]
    pipelines = _same_everywhere(jax_results, "input_pipelines")
    assert {tuple(p) for p in pipelines.tolist()} == {(WORKERS, 0), (WORKERS, 1)}


@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
def test_sums_are_within_the_rounding_bound_of_the_sims(
    mean: bool,
    jax_results: list[dict[str, list[np.ndarray]]],
    sim_results: dict[str, list[np.ndarray]],
) -> None:
    terms = _as_global(jax_results, "local_values")
    name = "mean" if mean else "sum"
    for got, want in zip(
        _as_global(jax_results, f"all_reduce_{name}"), sim_results[f"all_reduce_{name}"]
    ):
        _check_sum(got, want, terms, mean)
    _check_sum(
        _same_everywhere(jax_results, f"reduce_{name}"),
        sim_results[f"reduce_{name}"][0],
        terms,
        mean,
    )


def test_sgd_matches_the_sim(
    jax_results: list[dict[str, list[np.ndarray]]],
    sim_results: dict[str, list[np.ndarray]],
) -> None:
    steps = sum(1 for k in sim_results if k.startswith("sgd_w_"))
    assert steps == 3
    for step in range(steps):
        local = _as_global(jax_results, f"sgd_local_{step}")
        totals = _as_global(jax_results, f"sgd_total_{step}")
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
            _same_everywhere(jax_results, f"sgd_w_{step}"),
            sim_results[f"sgd_w_{step}"][0],
            rtol=1e-5,
            atol=1e-6,
        )
    # The first step's gradients do not depend on earlier rounding: within the bound.
    for got, want in zip(_as_global(jax_results, "sgd_total_0"), sim_results["sgd_total_0"]):
        _check_sum(got, want, _as_global(jax_results, "sgd_local_0"), mean=False)


# --------------------------------------------------------------------------- compiled steps

Results = list[dict[str, list[np.ndarray]]]


@pytest.fixture(scope="module")
def sim_compiled() -> dict[str, list[np.ndarray]]:
    return mw_program.compiled_program(_sim_strategy())


@pytest.fixture(scope="module", params=[True, False], ids=["compiled", "eager"])
def jax_compiled(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[bool, Results]:
    jit = bool(request.param)
    out = tmp_path_factory.mktemp("compiled")
    result = _launch_workers(out, "compiled", jit=jit, timeout=120)
    assert result.exit_code == 0, result.message
    return jit, [mw_program.load(out / f"compiled{w}.npz") for w in range(WORKERS)]


def test_steps_with_variables_equal_the_sim_exactly(
    jax_compiled: tuple[bool, Results], sim_compiled: dict[str, list[np.ndarray]]
) -> None:
    _, per_worker = jax_compiled
    assert len(sim_compiled) == 8 * mw_program.STEPS + 4
    for key, want in sim_compiled.items():
        if len(want) == 1:  # a cross-replica result, or one object for every replica
            assert all(len(r[key]) == 1 for r in per_worker), key
            got = [_same_everywhere(per_worker, key)]
        else:
            got = _as_global(per_worker, key)
        assert len(got) == len(want), key
        for r, (a, b) in enumerate(zip(got, want)):
            assert a.dtype == b.dtype and np.array_equal(a, b), f"{key}, replica {r}: {a} != {b}"


def test_a_step_compiles_once_and_workers_with_other_shapes_fall_back_together(
    jax_compiled: tuple[bool, Results],
) -> None:
    jit, per_worker = jax_compiled
    for r in per_worker:
        # mw_program.STEPS runs of one step function: one trace on each worker, and one
        # of the function that creates a variable. The gather whose shapes are even on
        # each worker but differ between them ran eagerly on both (its result equals
        # the sim's above).
        assert int(r["compile_count"][0]) == (2 if jit else 0)
        assert int(r["eager_fallback_count"][0]) == (1 if jit else 0)
    assert [int(x) for x in _as_global(per_worker, "replica_id_0")] == [0, 1, 2, 3]


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


def _stderr(out: Path, rank: int) -> str:
    return (out / f"stderr{rank}").read_text(errors="replace")


def test_a_killed_worker_makes_the_survivor_raise_unavailable(tmp_path: Path) -> None:
    out = tmp_path
    procs = _start(out, "train", "--steps", "300", "--slow", "0.1", "--timeout", str(TIMEOUT))
    try:
        _wait_progress(out, 1, 2, timeout=60)
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code = procs[0].wait(timeout=TIMEOUT + DIAGNOSIS + 10)
        elapsed = time.monotonic() - killed
    finally:
        _stop(procs)
    assert code == 17, _stderr(out, 0)[-3000:]
    assert elapsed < TIMEOUT + DIAGNOSIS, f"took {elapsed:.1f} s"
    error = _error(out, 0)
    assert error["type"] == "UnavailableError", error
    assert "worker(s) 1 (/job:worker/replica:0/task:1 at 127.0.0.1:" in error["message"]
    assert "restart" in error["message"]


def test_when_the_coordinator_dies_jax_ends_the_others(tmp_path: Path) -> None:
    """Worker 0 hosts JAX's coordination service: JAX itself aborts the others at once."""
    out = tmp_path
    procs = _start(out, "train", "--steps", "300", "--slow", "0.1", "--timeout", str(TIMEOUT))
    try:
        _wait_progress(out, 0, 2, timeout=60)
        procs[0].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code = procs[1].wait(timeout=TIMEOUT + DIAGNOSIS + 10)
        elapsed = time.monotonic() - killed
    finally:
        _stop(procs)
    assert elapsed < TIMEOUT + DIAGNOSIS, f"took {elapsed:.1f} s"
    if code == 17:  # polydist saw the failed collective first
        assert "worker(s) 0 (" in _error(out, 1)["message"]
    else:
        assert code == -signal.SIGABRT, _stderr(out, 1)[-3000:]
        assert "JAX distributed service detected fatal errors" in _stderr(out, 1)


def test_a_worker_that_never_arrives_ends_the_others_within_the_bound(tmp_path: Path) -> None:
    out = tmp_path
    procs = _start(out, "late", "--timeout", "3")
    try:
        code = procs[0].wait(timeout=40)
    finally:
        _stop(procs)
    assert code == WATCHDOG_EXIT_CODE
    err = _stderr(out, 0)
    assert "polydist: DeadlineExceededError: worker 0 of 2 could not join the cluster" in err
    assert "within 3 s" in err and "coordinator at 127.0.0.1:" in err
    assert not (out / "joined0").exists()


@pytest.mark.parametrize("jit", [True, False], ids=["compiled", "eager"])
def test_a_stalled_collective_is_named_and_ends_the_process(tmp_path: Path, jit: bool) -> None:
    out = tmp_path
    procs = _start(out, "train", "--steps", "6", "--stall-at", "2", "--timeout", "3", jit=jit)
    try:
        code = procs[0].wait(timeout=60)
    finally:
        _stop(procs)
    assert code == WATCHDOG_EXIT_CODE, _stderr(out, 0)[-3000:]
    err = _stderr(out, 0)
    # A compiled step is one program (its collectives inside); eagerly, the all_reduce.
    what = "strategy.run" if jit else "all_reduce"
    assert f"polydist: DeadlineExceededError: {what} (collective #" in err
    assert "did not complete within 3 s" in err
    assert "worker(s) 1 (/job:worker/replica:0/task:1 at 127.0.0.1:" in err
    assert "alive but did not reach it" in err


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
    "extra": (
        f"all_reduce(SUM) of float32[3] at {_line('extra (worker 0)')} in mismatch",
        f"all_gather(axis=0) of float32[*] at {_line('extra (worker 1)')} in mismatch",
    ),
}


@pytest.mark.parametrize(
    ("case", "jit"),
    [("op", True), ("op", False), ("shape", True), ("extra", True)],
    ids=["op-compiled", "op-eager", "shape-compiled", "extra-compiled"],
)
def test_workers_that_disagree_on_a_collective_raise_collective_mismatch(
    tmp_path: Path, case: str, jit: bool
) -> None:
    """A compiled step whose programs differ runs eagerly (see above), where each
    collective is checked; so the message names the collectives inside the step."""
    procs = _start(tmp_path, "mismatch", "--case", case, "--timeout", MISMATCH_TIMEOUT, jit=jit)
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        _stop(procs)
    assert codes == [17, 17], _stderr(tmp_path, 0)[-3000:]
    for rank in range(WORKERS):
        error = _error(tmp_path, rank)
        assert error["type"] == "CollectiveMismatchError", error
        message = error["message"]
        assert message.startswith("Workers disagree on their collective #"), message
        for w, reached in enumerate(MISMATCHES[case]):
            assert f"\n  worker {w} (/job:worker/replica:0/task:{w} at 127.0.0.1:" in message
            assert f"): {reached}\n" in message, message


# --------------------------------------------------------------------------- in-process


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("TF_CONFIG", "POLYDIST_PROCESS_ID", "POLYDIST_NUM_PROCESSES"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.usefixtures("no_cluster")
def test_without_a_cluster_it_is_one_worker() -> None:
    import jax.numpy as jnp

    from polydist_jax._multi_worker import MultiWorkerMirroredStrategy

    strategy = MultiWorkerMirroredStrategy(local_devices=3)
    assert strategy.num_replicas_in_sync == 3
    assert strategy.extended._num_workers == 1 and strategy.extended.should_checkpoint
    backend = strategy.extended.backend
    assert backend.capabilities.multi_worker and not backend.connected  # type: ignore[attr-defined]

    def step() -> object:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce(pd.ReduceOp.SUM, jnp.ones(2) * (1 + ctx.replica_id_in_sync_group))

    out = strategy.run(step)
    assert [v.tolist() for v in strategy.experimental_local_results(out)] == [[6.0, 6.0]] * 3
    assert strategy.reduce(pd.ReduceOp.MEAN, out, axis=None).tolist() == [6.0, 6.0]


@pytest.mark.usefixtures("no_cluster")
def test_joining_after_jax_started_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    from polydist_jax._multi_worker import MultiWorkerMirroredStrategy

    config = {
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
        "task": {"type": "worker", "index": 0},
    }
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    with pytest.raises(RuntimeError, match="JAX's backends have already started"):
        MultiWorkerMirroredStrategy(local_devices=2)


def test_initialize_needs_the_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    from polydist_jax._multi_worker import initialize

    for key in (
        "JAX_COORDINATOR_ADDRESS",
        "POLYDIST_COORDINATOR_ADDRESS",
        "POLYDIST_NUM_PROCESSES",
    ):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="needs the coordinator address"):
        initialize()
