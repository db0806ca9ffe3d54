"""MultiWorkerMirroredStrategy on jax.distributed (gloo): 2 worker processes x 2 CPU devices.

The tests every engine shares (`polydist_conformance.multiprocess_tests`) run the
workers (``mw_program.py``) as `TestMultiWorker`; below are JAX's own: compiled steps
(against eager ones), and the faults JAX reports its own way (the watchdog's exit,
the coordinator's death).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import polydist as pd
from polydist_conformance import multiprocess
from polydist_conformance import multiprocess_tests as mpt
from polydist_jax._multi_worker import WATCHDOG_EXIT_CODE

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX process groups")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import mw_program  # noqa: E402  (conftest puts this directory on sys.path too)

ENGINE = mpt.Engine(
    HERE / "mw_program.py",
    # The workers set their own device count (jax_num_cpu_devices), not the tests' 8.
    unset=("TF_CONFIG", "XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "POLYDIST_PROCESS_ID"),
    # XLA:CPU wherever the tests run (on a GPU machine JAX would take the GPU).
    env={"MW_PROGRAM_JIT": "1", "JAX_PLATFORMS": "cpu"},
)
# The workers' environment for MultiWorkerMirroredStrategy(jit=False).
EAGER = {"MW_PROGRAM_JIT": "0"}


class TestMultiWorker(mpt.MultiWorkerTests):
    engine = ENGINE


# --------------------------------------------------------------------------- compiled steps

PerWorker = list[mpt.Results]


@pytest.fixture(scope="module")
def sim_compiled() -> mpt.Results:
    return mw_program.compiled_program(mpt.sim_strategy())


@pytest.fixture(scope="module", params=[True, False], ids=["compiled", "eager"])
def jax_compiled(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[bool, PerWorker]:
    jit = bool(request.param)
    out = tmp_path_factory.mktemp("compiled")
    # Worker 1 reaches step 1 late (longer than the agreement's 0.25 s before its probe
    # publishes to the store): waited for, with no false mismatch.
    args = ("compiled", "--stall-worker-1", "0.6")
    result = ENGINE.launch(out, *args, timeout=120, env=None if jit else EAGER)
    assert result.exit_code == 0, result.message
    return jit, [mw_program.load(out / f"compiled{w}.npz") for w in range(mpt.WORKERS)]


def test_steps_with_variables_equal_the_sim_exactly(
    jax_compiled: tuple[bool, PerWorker], sim_compiled: mpt.Results
) -> None:
    _, per_worker = jax_compiled
    assert len(sim_compiled) == 8 * mw_program.STEPS + 4
    for key, want in sim_compiled.items():
        if len(want) == 1:  # a cross-replica result, or one object for every replica
            assert all(len(r[key]) == 1 for r in per_worker), key
            got = [mpt.same_everywhere(per_worker, key)]
        else:
            got = mpt.as_global(per_worker, key)
        assert len(got) == len(want), key
        for r, (a, b) in enumerate(zip(got, want)):
            assert a.dtype == b.dtype and np.array_equal(a, b), f"{key}, replica {r}: {a} != {b}"


def test_a_step_compiles_once_and_workers_with_other_shapes_fall_back_together(
    jax_compiled: tuple[bool, PerWorker],
) -> None:
    jit, per_worker = jax_compiled
    for r in per_worker:
        # mw_program.STEPS runs of one step function: one trace on each worker, one of
        # the function that creates a variable, and one of the gather whose shapes are
        # even on each worker but differ between them: traced for its digest (the
        # workers agree on the traced program), which differs, so it ran eagerly on
        # both (its result equals the sim's above).
        assert int(r["compile_count"][0]) == (3 if jit else 0)
        assert int(r["eager_fallback_count"][0]) == (1 if jit else 0)
    assert [int(x) for x in mpt.as_global(per_worker, "replica_id_0")] == [0, 1, 2, 3]


@pytest.mark.parametrize("case", mw_program.PROGRAM_CASES)
def test_workers_whose_closures_trace_other_collectives_raise_mismatch(
    tmp_path: Path, case: str
) -> None:
    """The agreement's digest describes the traced program (its collectives, their shapes,
    dtypes and reduce ops), not only the function's name and inputs: workers whose step
    closes over other values do not run two different programs (wrong values on worker 0,
    a timeout blaming it on worker 1, or no error at all for SUM against MEAN). They fall
    back to eager runs together, whose collective checks raise CollectiveMismatchError."""
    codes = ENGINE.run(tmp_path, "programs", "--case", case, "--timeout", "30", timeout=90)
    assert codes == [17, 17], [mpt.stderr(tmp_path, w)[-2000:] for w in range(mpt.WORKERS)]
    for w in range(mpt.WORKERS):
        raised = mpt.error(tmp_path, w)
        assert raised["type"] == "CollectiveMismatchError", raised
    want = {
        "shape": ("all_reduce(SUM) of float32[3]", "all_reduce(SUM) of float32[4]"),
        "reduce_op": ("all_reduce(SUM) of float32[3]", "all_reduce(MEAN) of float32[3]"),
        "op": ("all_reduce(SUM) of float32[3]", "all_gather(axis=0) of float32[*]"),
    }[case]
    message = mpt.error(tmp_path, 0)["message"]
    assert all(w in message for w in want), message


def test_a_mismatch_after_many_identical_steps_is_still_caught(tmp_path: Path) -> None:
    """Each compiled step carries its own agreement (its first collective): after 20
    identical steps alternating two programs, a step where worker 0 runs one and worker
    1 the other (both compiled and agreed on before) is still found, and both raise
    CollectiveMismatchError in their eager fallback."""
    args = ("programs", "--case", "shape", "--same-steps", "20", "--timeout", "30")
    codes = ENGINE.run(tmp_path, *args, timeout=90)
    assert codes == [17, 17], [mpt.stderr(tmp_path, w)[-2000:] for w in range(mpt.WORKERS)]
    for w in range(mpt.WORKERS):
        raised = mpt.error(tmp_path, w)
        assert raised["type"] == "CollectiveMismatchError", raised
        message = raised["message"]
        assert "float32[3]" in message and "float32[4]" in message, message


def test_a_worker_that_cannot_compile_a_step_meets_the_others_compiled_agreement(
    tmp_path: Path,
) -> None:
    """Worker 0's replicas hold inputs of different shapes (it cannot compile the call)
    while worker 1's are even: worker 0's agreement alone meets worker 1's compiled step,
    which then runs nothing; both run the call eagerly, and compiled again after."""
    codes = ENGINE.run(tmp_path, "uneven_here", "--timeout", "30", timeout=90)
    assert codes == [0, 0], [mpt.stderr(tmp_path, w)[-2000:] for w in range(mpt.WORKERS)]
    per_worker = [mw_program.load(tmp_path / f"uneven_here{w}.npz") for w in range(mpt.WORKERS)]
    even = np.concatenate([np.arange(2) + 10 * r for r in range(4)]) * 2
    uneven = np.concatenate([np.arange(2), np.arange(3) + 10, np.arange(2) + 20, np.arange(2) + 30])
    for r in per_worker:
        assert int(r["eager_fallback_count"][0]) == 1
        for key, want in (("out_0", even), ("out_1", uneven * 2), ("out_2", even)):
            assert len(r[key]) == mw_program.D, key
            for got in r[key]:
                assert np.array_equal(got, want.astype(np.float32)), (key, got, want)


def test_workers_of_one_replica_pass_their_returned_parameters_back_exactly(
    tmp_path: Path,
) -> None:
    """One replica per worker: each step's outputs are held whole on the worker's
    device, and the parameters it returns are the next step's inputs as they are. Every
    step's parameters and rank-0 loss are exact (integer-valued float32) on both
    workers."""
    codes = ENGINE.run(tmp_path, "one_device", "--timeout", "30", timeout=90)
    assert codes == [0, 0], [mpt.stderr(tmp_path, w)[-2000:] for w in range(mpt.WORKERS)]
    per_worker = [mw_program.load(tmp_path / f"one_device{w}.npz") for w in range(mpt.WORKERS)]
    w = np.array([1, 2, 3], np.float32)
    x_sum = np.array([1, 2, 4], np.float32) * 3  # worker 0's x plus worker 1's (twice it)
    for s in range(mw_program.ONE_DEVICE_STEPS):
        grad = x_sum * w
        w = w - np.float32(0.5) * grad
        for r in per_worker:
            assert np.array_equal(r[f"w_{s}"][0], w), (s, r[f"w_{s}"][0], w)
            assert r[f"loss_{s}"][0] == grad.sum(), (s, r[f"loss_{s}"][0], grad.sum())
    for r in per_worker:
        assert int(r["loss_rank"][0]) == 0
        assert bool(r["placed"][0])
        # Each step waited for the agreement alone: one (workers, digest words) array.
        waited = r["waited"][0]
        assert waited.shape == (mw_program.ONE_DEVICE_STEPS, 1, 2), waited
        assert (waited[:, 0, 0] == mpt.WORKERS).all() and (waited[:, 0, 1] > 1).all()


# --------------------------------------------------------------------------- faults


def test_when_the_coordinator_dies_jax_ends_the_others(tmp_path: Path) -> None:
    """Worker 0 hosts JAX's coordination service: JAX itself aborts the others at once."""
    code, elapsed = mpt.kill_a_worker(ENGINE, tmp_path, victim=0)
    assert elapsed < mpt.TIMEOUT + mpt.DIAGNOSIS, f"took {elapsed:.1f} s"
    if code == 17:  # polydist saw the failed collective first
        assert "worker(s) 0 (" in mpt.error(tmp_path, 1)["message"]
    else:
        assert code == -signal.SIGABRT, mpt.stderr(tmp_path, 1)[-3000:]
        assert "JAX distributed service detected fatal errors" in mpt.stderr(tmp_path, 1)


def test_a_worker_that_never_arrives_ends_the_others_within_the_bound(tmp_path: Path) -> None:
    assert ENGINE.run(tmp_path, "late", "--timeout", "3", wait=[0], timeout=40) == [
        WATCHDOG_EXIT_CODE
    ]
    err = mpt.stderr(tmp_path, 0)
    assert "polydist: DeadlineExceededError: worker 0 of 2 could not join the cluster" in err
    assert "within 3 s" in err and "coordinator at 127.0.0.1:" in err
    assert not (tmp_path / "joined0").exists()


@pytest.mark.parametrize("jit", [True, False], ids=["compiled", "eager"])
def test_a_stalled_collective_is_named_and_ends_the_process(tmp_path: Path, jit: bool) -> None:
    args = ("train", "--steps", "6", "--stall-at", "2", "--timeout", "3")
    codes = ENGINE.run(tmp_path, *args, wait=[0], env=None if jit else EAGER)
    err = mpt.stderr(tmp_path, 0)
    assert codes == [WATCHDOG_EXIT_CODE], err[-3000:]
    # A compiled step is one program (its collectives inside); eagerly, the all_reduce.
    what = "strategy.run" if jit else "all_reduce"
    assert f"polydist: DeadlineExceededError: {what} (collective #" in err
    mpt.names_a_stalled_worker_1(err)


def test_a_program_that_initialized_jax_itself_exits_cleanly(tmp_path: Path) -> None:
    """polydist's exit handler (it stops the heartbeat before JAX shuts down) is registered
    also when the program ran jax.distributed.initialize before creating the strategy."""
    engine = mpt.Engine(HERE / "own_init_program.py", unset=ENGINE.unset)
    result = engine.launch(tmp_path, timeout=120)
    assert result.exit_code == 0, result.message
    assert "polydist:" not in result.message and "Traceback" not in result.message
    for w in range(mpt.WORKERS):
        exited = json.loads((tmp_path / f"exit{w}.json").read_text())
        assert exited == {
            "sum": 1.0 + 2.0 + 3.0 + 4.0,
            "bfloat16_sum": ["bfloat16", 2.0, 10.0],
            "heartbeat_running": False,
        }, w


# --------------------------------------------------------------------------- the watchdog

# The watchdog ends its process (os._exit): each case runs in a child process of its own.
_WATCHDOG_CHILD = """
import threading
from polydist_jax._multi_worker import _Watchdog

watchdog = _Watchdog()
diagnosing = {name: threading.Event() for name in ("first", "second")}
release = {name: threading.Event() for name in ("first", "second")}

def diagnosis(name):
    def explain():
        diagnosing[name].set()
        release[name].wait(30)
        return f"the {name} call is late"
    return explain
"""


def _run_watchdog_child(body: str) -> subprocess.CompletedProcess[str]:
    code = _WATCHDOG_CHILD + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_a_call_that_returns_while_the_watchdog_diagnoses_it_does_not_end_the_process() -> None:
    child = _run_watchdog_child(
        """
        first = watchdog.arm(0.05, diagnosis("first"))
        assert diagnosing["first"].wait(30), "the watchdog did not fire"
        watchdog.disarm(first)  # the late call returns during its diagnosis...
        second = watchdog.arm(0.05, diagnosis("second"))  # ...and the next call starts
        release["first"].set()  # the watchdog decides on the first call
        # It went on to watch the second call: it did not end the process for the first.
        assert diagnosing["second"].wait(30), "the watchdog stopped watching"
        watchdog.disarm(second)
        release["second"].set()
        print("still running")
        """
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout == "still running\n"
    assert "polydist:" not in child.stderr


def test_a_late_call_ends_the_process_even_after_an_older_call_disarms() -> None:
    child = _run_watchdog_child(
        """
        import time
        older = watchdog.arm(60, lambda: "the older call is late")
        watchdog.arm(0.05, lambda: "the current call is late")
        watchdog.disarm(older)  # stale: the current call stays armed
        time.sleep(20)  # the watchdog ends it long before
        print("not ended")
        """
    )
    assert child.returncode == WATCHDOG_EXIT_CODE, child.stderr[-3000:]
    assert "polydist: the current call is late\n" in child.stderr
    assert "older" not in child.stderr and child.stdout == ""


def test_a_probe_that_finds_the_call_cannot_complete_ends_the_process_at_once() -> None:
    child = _run_watchdog_child(
        """
        import time
        probed = []
        def probe():
            probed.append(time.monotonic())
            return "a peer is at another collective" if len(probed) == 2 else None
        start = time.monotonic()
        watchdog.arm(60, lambda: "late", probe)
        time.sleep(20)  # the probe's second look ends it long before
        print("not ended")
        """
    )
    assert child.returncode == WATCHDOG_EXIT_CODE, child.stderr[-3000:]
    assert "polydist: a peer is at another collective\n" in child.stderr
    assert "late" not in child.stderr and child.stdout == ""


def test_a_probe_s_finding_ends_the_process_even_if_the_call_failed_meanwhile() -> None:
    # The peer that raised the mismatch exits, which can break this worker's collective
    # while the probe lingers: the probe's diagnosis is still the one that ends it.
    child = _run_watchdog_child(
        """
        import time
        def probe():
            watchdog.disarm(armed)  # the call failed while the probe looked
            return "the peer is at another collective"
        armed = watchdog.arm(60, lambda: "late", probe)
        time.sleep(20)
        print("not ended")
        """
    )
    assert child.returncode == WATCHDOG_EXIT_CODE, child.stderr[-3000:]
    assert "polydist: the peer is at another collective\n" in child.stderr
    assert child.stdout == ""


def test_a_probe_stops_when_its_call_returns() -> None:
    child = _run_watchdog_child(
        """
        import time
        probed = []
        armed = watchdog.arm(60, lambda: "late", lambda: probed.append(1) or "stop")
        watchdog.disarm(armed)  # the call returned before the first probe
        time.sleep(1)
        print(len(probed))
        """
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout == "0\n"


def test_a_worker_that_ended_is_named_by_the_one_still_calling(tmp_path: Path) -> None:
    """Worker 1 ends after one collective; worker 0 (the coordination service's host)
    calls another and names worker 1 as gone. JAX then aborts worker 1's exit when worker
    0's process leaves (docs/multi-host.md), so its code is 0 or SIGABRT."""
    args = ("mismatch", "--case", "early_exit", "--timeout", mpt.MISMATCH_TIMEOUT)
    codes = ENGINE.run(tmp_path, *args, timeout=120)
    assert codes[0] == 17 and codes[1] in (0, -signal.SIGABRT), codes
    error = mpt.error(tmp_path, 0)
    assert error["type"] == "CollectiveMismatchError", error
    message = error["message"]
    where = multiprocess.mismatch_site("early_exit (worker 0)")
    assert f"): all_reduce(SUM) of float32[3] at {where} in mismatch\n" in message, message
    assert "): left the cluster after 1 collective(s) (its program ended" in message, message


@pytest.mark.parametrize(
    ("jit", "case", "fail_at", "late"),
    [(False, "before", 0, 0.0), (False, "after", 3, 0.0), (True, "traced", 1, 4.0)],
    ids=["eager-before", "eager-after", "compiled-traced"],
)
def test_an_error_caught_in_a_step_fails_the_cluster_on_both(
    tmp_path: Path, jit: bool, case: str, fail_at: int, late: float
) -> None:
    """An error escapes strategy.run on worker 1 only and the program catches it and goes
    on. Eagerly, replica 3 raises while its worker's other replica waits in a collective
    that never runs across the workers; compiled, worker 1 raises while its step is
    traced, so it never joins the step worker 0 runs. Both workers raise from then on
    (worker 1 CancelledError; worker 0, which starts the compiled step late enough to
    see worker 1's heartbeat, CollectiveMismatchError naming worker 1's error, before it
    issues the step), no step returns a wrong value, and neither waits in JAX's
    shutdown at exit (exit code 1)."""
    steps = fail_at + 3
    args = ("caught", "--case", case, "--fail-at", str(fail_at), "--steps", str(steps))
    args += ("--slow", str(late), "--timeout", "20")
    codes = ENGINE.run(tmp_path, *args, timeout=90, env=None if jit else EAGER)
    said = [mpt.stderr(tmp_path, w)[-2000:] for w in range(mpt.WORKERS)]
    # Worker 1's exit may meet JAX's abort once worker 0 (the coordinator) is gone.
    assert codes[0] == 1 and codes[1] in (1, -signal.SIGABRT), (codes, said)
    assert "(skipping JAX's shutdown)" in said[0], said[0]
    outcomes = [json.loads((tmp_path / f"caught{w}.json").read_text()) for w in range(mpt.WORKERS)]
    for w, steps_of in enumerate(outcomes):
        assert len(steps_of) == steps
        for step, outcome in enumerate(steps_of):
            if step < fail_at:
                assert outcome == {"values": [multiprocess.caught_expected(step)] * mpt.D}
            else:  # never a value: every step from the failed one on raises
                assert "values" not in outcome, (w, step, outcome)
    failed, survivor = outcomes[1], outcomes[0]
    raised = (
        f"worker 1 fails while its step {fail_at} is traced"
        if case == "traced"
        else f"replica 3 fails {case} its all_reduce"
    )
    assert failed[fail_at] == {"type": "ValueError", "message": raised}
    for later in failed[fail_at + 1 :]:
        assert later["type"] == "CancelledError", later
        assert "cannot run: the cluster failed earlier" in later["message"]
        assert f"strategy.run raised ValueError: {raised}" in later["message"]
    first = survivor[fail_at]
    message = first["message"]
    if case == "traced" and first["type"] == "UnavailableError":
        # On a loaded machine worker 0 may reach the step before worker 1's heartbeat
        # says it failed: then worker 1's exit breaks the step, which names worker 1.
        assert "worker 1 (" in message and "restart them all" in message, first
    else:
        assert first["type"] == "CollectiveMismatchError", first
        assert "worker(s) 1 raised an error that left the cluster's collectives out of step" in (
            message
        )
        assert "  worker 1 (/job:worker/replica:0/task:1 at 127.0.0.1:" in message
        assert f"strategy.run raised ValueError: {raised}" in message
        assert "restart them all" in message
    for later in survivor[fail_at + 1 :]:  # each an error (no values: checked above)
        assert "cannot run: the cluster failed earlier" in later["message"], later


@pytest.mark.parametrize("linger", [0.0, 10.0], ids=["exits", "stays"])
def test_an_error_traced_on_one_worker_ends_the_peer_in_its_step(
    tmp_path: Path, linger: float
) -> None:
    """Worker 1 raises while its compiled step is traced (and catches it) while worker 0
    already waits in that step's agreement, which XLA cannot leave: worker 0 ends (the
    watchdog's probe finds worker 1's published failure: exit code 75; certain when
    worker 1's process stays) or, when worker 1's exit broke the step first, raises
    UnavailableError naming worker 1's error; never a value from the failed step on."""
    args = ("caught", "--case", "traced", "--fail-at", "1", "--steps", "4", "--timeout", "20")
    codes = ENGINE.run(tmp_path, *args, "--linger", str(linger), timeout=90)
    said = mpt.stderr(tmp_path, 0)
    assert codes[0] in (1, WATCHDOG_EXIT_CODE) and codes[1] in (1, -signal.SIGABRT), codes
    if linger:
        assert codes[0] == WATCHDOG_EXIT_CODE, said[-3000:]
        failed = json.loads((tmp_path / "caught1.json").read_text())
        assert [o["type"] for o in failed[1:]] == ["ValueError", "CancelledError", "CancelledError"]
    raised = "strategy.run raised ValueError: worker 1 fails while its step 1 is traced"
    if codes[0] == WATCHDOG_EXIT_CODE:
        assert "polydist: CollectiveMismatchError: Collective #2 cannot run: worker 0 " in said
        assert raised in said and "exits with code 75" in said, said[-3000:]
    else:
        survivor = json.loads((tmp_path / "caught0.json").read_text())
        assert survivor[0] == {"values": [multiprocess.caught_expected(0)] * mpt.D}
        assert all("values" not in outcome for outcome in survivor[1:]), survivor
        message = survivor[1]["message"]
        assert survivor[1]["type"] == "UnavailableError", survivor[1]
        assert raised in message and "left the cluster's collectives out of step" in message


def test_workers_that_disagree_eagerly_raise_collective_mismatch(tmp_path: Path) -> None:
    """TestMultiWorker's cases run compiled steps: one whose programs differ runs eagerly,
    where each collective is checked, so the message names the collectives inside the
    step. Here the workers run eagerly from the start (jit=False)."""
    mpt.check_mismatch(ENGINE, tmp_path, "op", TestMultiWorker.mismatch_at, env=EAGER)


# --------------------------------------------------------------------------- in-process


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("TF_CONFIG", "POLYDIST_PROCESS_ID", "POLYDIST_NUM_PROCESSES"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.usefixtures("no_cluster")
def test_without_a_cluster_it_is_one_worker() -> None:
    import jax.numpy as jnp

    from polydist_jax import JaxProcessBackend

    strategy = pd.MultiWorkerMirroredStrategy(local_devices=3, backend="jax")
    assert isinstance(strategy.extended.backend, JaxProcessBackend)
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
    config = {
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
        "task": {"type": "worker", "index": 0},
    }
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    with pytest.raises(RuntimeError, match="JAX's backends have already started"):
        pd.MultiWorkerMirroredStrategy(local_devices=2, backend="jax")
    monkeypatch.setenv("POLYDIST_BACKEND", "jax")  # the engine comes from the default too
    with pytest.raises(RuntimeError, match="JAX's backends have already started"):
        pd.MultiWorkerMirroredStrategy()


@pytest.mark.usefixtures("no_cluster")
def test_deprecated_alias_warns_and_still_works() -> None:
    from polydist_jax import JaxProcessBackend, MultiWorkerMirroredStrategy

    with pytest.warns(
        DeprecationWarning, match=r"use polydist.MultiWorkerMirroredStrategy\(backend='jax'\)"
    ):
        strategy = MultiWorkerMirroredStrategy(local_devices=2, jit=False)
    assert isinstance(strategy, pd.MultiWorkerMirroredStrategy)
    backend = strategy.extended.backend
    assert isinstance(backend, JaxProcessBackend) and not backend.jit
    assert strategy.num_replicas_in_sync == 2
    # One worker without local_devices needs no engine: the jax backend itself.
    assert pd.MultiWorkerMirroredStrategy(backend="jax").extended.backend is (
        pd.backend.get_backend("jax")
    )


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


def test_a_compiled_step_against_a_gather_is_a_mismatch_on_both(tmp_path: Path) -> None:
    """Worker 0's compiled step exchanges the program's digest in an XLA collective, not
    through the store; worker 1 is at a store-checked gather instead. Worker 1 raises
    CollectiveMismatchError naming the step's line; worker 0's gather cannot complete, so
    its watchdog, probing the store, ends it at once with the same diagnosis (not after
    the 300 s timeout)."""
    args = ("mismatch", "--case", "run_or_gather", "--timeout", mpt.MISMATCH_TIMEOUT)
    codes = ENGINE.run(tmp_path, *args, timeout=60)
    # Worker 1's exit may meet JAX's abort once worker 0 (the coordinator) is gone.
    assert codes[0] == WATCHDOG_EXIT_CODE and codes[1] in (17, -signal.SIGABRT), codes
    step = f"strategy.run at {multiprocess.mismatch_site('run_or_gather (run)')} in mismatch"
    gather = multiprocess.mismatch_site("run_or_gather (worker 1)")
    gather = f"all_gather(axis=0) of float32[*] at {gather} in mismatch"
    error = mpt.error(tmp_path, 1)
    assert error["type"] == "CollectiveMismatchError", error
    message = error["message"]
    assert message.startswith("Workers disagree on their collective #2;"), message
    assert "  worker 0 (/job:worker/replica:0/task:0 at 127.0.0.1:" in message
    assert f"): {step}\n" in message, message
    assert f"): {gather}\n" in message, message
    said = mpt.stderr(tmp_path, 0)
    assert "polydist: CollectiveMismatchError: Workers disagree on their collective #2: " in said
    assert f"is at a compiled {step}, worker 1 (/job:worker/replica:0/task:1 at " in said, said
    assert f"is at {gather.removesuffix(' in mismatch').rsplit(' at ', 1)[0]} instead" in said


# --------------------------------------------------------------------------- the example

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "multi_worker_train.py"


@pytest.mark.skipif(not EXAMPLE.exists(), reason="runs from a checkout of the repository")
def test_the_multi_worker_example_trains_to_the_sims_weights_and_resumes(tmp_path: Path) -> None:
    mpt.check_multi_worker_example(ENGINE, EXAMPLE, "jax", tmp_path)


# --------------------------------------------------------------------------- the coordinator

# Worker 0 of a one-process cluster: which addresses listen on the coordinator's port.
_BIND_CHILD = """
import ipaddress, json, socket, sys
import polydist_jax

with socket.socket() as s:  # a free port
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
polydist_jax.initialize_multi_worker(f"127.0.0.1:{port}", 1, 0, timeout_seconds=30)
listening = []
for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
    with open(table) as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                # /proc writes each 32-bit word of the address in host (little-endian) order.
                words = [address[i : i + 8] for i in range(0, len(address), 8)]
                raw = b"".join(bytes.fromhex(word)[::-1] for word in words)
                ip = ipaddress.ip_address(raw)
                listening.append(str(getattr(ip, "ipv4_mapped", None) or ip))
print(json.dumps(listening))
"""


@pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="reads Linux's /proc/net")
def test_the_coordinator_listens_only_on_the_address_the_cluster_gives() -> None:
    """jax.distributed's default binds [::]:PORT, every interface; polydist binds the
    coordinator address itself (127.0.0.1 here, as under `polydist launch`)."""
    env = {k: v for k, v in os.environ.items() if k not in ENGINE.unset}
    env.pop("JAX_COORDINATOR_BIND_ADDRESS", None)
    child = subprocess.run(
        [sys.executable, "-c", _BIND_CHILD],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "JAX_PLATFORMS": "cpu"},
    )
    assert child.returncode == 0, child.stderr[-3000:]
    listening = json.loads(child.stdout.strip().splitlines()[-1])
    assert listening == ["127.0.0.1"], listening


def test_the_bind_address_is_explicit_else_jax_s_variable_else_the_coordinator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from polydist_jax._multi_worker import _bind_address

    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    assert _bind_address("10.0.0.5:1234") == "10.0.0.5:1234"
    assert _bind_address("10.0.0.5:1234", "[::]:1234") == "[::]:1234"
    monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", "0.0.0.0:1234")
    assert _bind_address("10.0.0.5:1234") == "0.0.0.0:1234"
    with pytest.raises(ValueError, match=r"'host0' is not HOST:PORT.*\[::\]:1234"):
        _bind_address("10.0.0.5:1234", "host0")


def test_a_host_name_that_is_loopback_only_here_binds_every_interface(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TF_CONFIG's "host0:1234" on a host whose /etc/hosts maps its own name to 127.0.1.1:
    the other hosts reach it by its network address, so loopback would lock them out."""
    import socket

    from polydist_jax._multi_worker import _bind_address

    resolved = {"host0": "127.0.1.1", "host1": "10.0.0.6", "localhost": "127.0.0.1"}

    def getaddrinfo(host: str, port: object) -> list[tuple[object, ...]]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (resolved[host], 0))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    assert _bind_address("host0:1234") == "[::]:1234"
    assert _bind_address("host1:1234") == "host1:1234"
    assert _bind_address("localhost:1234") == "localhost:1234"
    assert _bind_address("127.0.0.1:1234") == "127.0.0.1:1234"
    assert _bind_address("host0:1234", "127.0.1.1:1234") == "127.0.1.1:1234"
