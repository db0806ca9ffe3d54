"""The tests of ``MultiWorkerMirroredStrategy`` on one process per worker that engines share.

A backend's test module subclasses `MultiWorkerTests` (its name starting with ``Test``)
and sets ``engine`` to an `Engine`: the backend's worker script, which calls
``polydist_conformance.multiprocess.main`` with the engine's strategy, and the
environment its workers need. The tests start 2 worker processes x
`multiprocess.D` replicas on 127.0.0.1 with free ports, every process bounded by a
timeout, and compare what they wrote with the sim's MultiWorkerMirroredStrategy of the
same cluster shape, or check what the survivors raise when a worker is killed or the
workers disagree on a collective. The helpers below serve the backend's own tests of
that kind (faults its engine reports its own way, modes of its own).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

import polydist as pd
from polydist.backend import launch as _launch
from polydist.cluster_resolver import ClusterSpec, SimpleClusterResolver
from polydist_conformance import multiprocess
from polydist_conformance.tolerance import Reduction, within_bound
from polydist_sim import SimBackend

__all__ = [
    "DIAGNOSIS",
    "MISMATCHES",
    "MISMATCH_TIMEOUT",
    "TIMEOUT",
    "WORKERS",
    "Engine",
    "MultiWorkerTests",
    "Results",
    "as_global",
    "check_a_killed_worker_is_named",
    "check_mismatch",
    "check_multi_worker_example",
    "check_sum",
    "error",
    "kill_a_worker",
    "names_a_stalled_worker_1",
    "same_everywhere",
    "sim_strategy",
    "stderr",
    "stop",
    "wait_progress",
]

WORKERS = 2
D = multiprocess.D
#: What a worker wrote: per-replica results (its replicas') and cross-replica ones
#: (one-element lists), by name.
Results = dict[str, list[np.ndarray]]

#: ``--timeout`` of the fault tests' workers.
TIMEOUT = 5.0
# Noticing a dead peer's closed socket is immediate; naming it takes the heartbeat check.
DIAGNOSIS = 4.0
# Far beyond how long the tests wait for the workers: only the check can end them in time.
MISMATCH_TIMEOUT = "300"


@dataclasses.dataclass(frozen=True)
class Engine:
    """How a backend's tests run its worker script."""

    #: The script: ``python PROGRAM OUT MODE [OPTIONS]`` is one worker.
    program: Path
    #: Variables the workers must not inherit from the test process (another cluster's).
    unset: tuple[str, ...] = ()
    #: Variables every worker gets.
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def environment(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The workers' base environment (``polydist launch`` adds the cluster's)."""
        env = {k: v for k, v in os.environ.items() if k not in self.unset}
        env.update(self.env)
        env.update(extra or {})
        return env

    def launch(
        self, out: Path, *args: str, timeout: float = 60, env: Mapping[str, str] | None = None
    ) -> _launch.LaunchResult:
        """The workers under ``polydist launch`` (which stops the others when one fails);
        the result's message ends with their output."""
        log = io.StringIO()
        result = _launch.launch(
            WORKERS,
            str(self.program),
            [str(out), *args],
            timeout=timeout,
            stdout=log,
            stderr=log,
            env=self.environment(env),
        )
        result.message += "\n" + log.getvalue()[-4000:]
        return result

    def start(
        self, out: Path, *args: str, env: Mapping[str, str] | None = None
    ) -> list[subprocess.Popen[bytes]]:
        """The workers as plain processes (no launcher to stop the others when one fails);
        worker i's stderr goes to ``out/stderr<i>``. Stop them with `stop`."""
        ports = _launch.free_ports(WORKERS)
        procs = []
        for i in range(WORKERS):
            with (out / f"stderr{i}").open("wb") as err:  # the child keeps its own copy
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(self.program), str(out), *args],
                        env=_launch.worker_environment(i, ports, base=self.environment(env)),
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                    )
                )
        return procs

    def run(
        self,
        out: Path,
        *args: str,
        wait: Sequence[int] = tuple(range(WORKERS)),
        timeout: float = 60,
        env: Mapping[str, str] | None = None,
    ) -> list[int]:
        """`start`, then the exit codes of the workers ``wait``, each waited for up to
        ``timeout`` s; every worker is stopped before it returns."""
        procs = self.start(out, *args, env=env)
        try:
            return [procs[w].wait(timeout=timeout) for w in wait]
        finally:
            stop(procs)


def stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def error(out: Path, rank: int) -> dict[str, str]:
    """The error worker ``rank`` wrote (``type``, ``message``) before exiting with 17."""
    path = out / f"error{rank}.json"
    assert path.exists(), f"worker {rank} wrote no error"
    return dict(json.loads(path.read_text()))


def stderr(out: Path, rank: int) -> str:
    """What worker ``rank`` wrote to stderr (workers from `Engine.start`)."""
    return (out / f"stderr{rank}").read_text(errors="replace")


def wait_progress(out: Path, rank: int, step: int, timeout: float = 30) -> None:
    """Until training worker ``rank`` (``--slow``) has finished step ``step``."""
    deadline = time.monotonic() + timeout
    path = out / f"progress{rank}"
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if text.strip() and int(text) >= step:  # read once: the worker rewrites it
            return
        time.sleep(0.02)
    raise AssertionError(f"worker {rank} did not reach step {step} within {timeout} s")


# --------------------------------------------------------------------------- the sim's answer


def sim_strategy() -> pd.Strategy:
    """The sim's MultiWorkerMirroredStrategy of the workers' cluster (all in this process)."""
    resolver = SimpleClusterResolver(
        ClusterSpec({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}),
        task_type="worker",
        task_id=0,
        num_accelerators={"GPU": D},
    )
    strategy = pd.MultiWorkerMirroredStrategy(resolver, backend=SimBackend(num_gpus=D))
    assert strategy.num_replicas_in_sync == WORKERS * D
    return strategy


def as_global(per_worker: Sequence[Results], key: str) -> list[np.ndarray]:
    """Every replica's component, worker-major (each worker wrote its own D)."""
    parts = [r[key] for r in per_worker]
    assert all(len(p) == D for p in parts), f"{key}: experimental_local_results gave {parts}"
    return [c for p in parts for c in p]


def same_everywhere(per_worker: Sequence[Results], key: str) -> np.ndarray:
    """The cross-replica result ``key``, which every worker must have got alike."""
    first = per_worker[0][key][0]
    for w, r in enumerate(per_worker[1:], start=1):
        assert np.array_equal(r[key][0], first), f"{key} differs on worker {w}"
    return first


def check_sum(
    actual: np.ndarray, expected: np.ndarray, terms: list[np.ndarray], mean: bool
) -> None:
    """``actual`` (a sum or mean of ``terms``) is within the rounding bound of the sim's."""
    assert actual.dtype == expected.dtype, f"{actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{actual.shape} != {expected.shape}"
    reduction = Reduction.across_replicas(terms, mean=mean)
    ok = within_bound(actual, expected, reduction, oracle_exact=True)
    assert ok.all(), f"outside the bound at {np.argwhere(~ok).tolist()}: {actual} vs {expected}"


# --------------------------------------------------------------------------- faults


def kill_a_worker(engine: Engine, out: Path, victim: int) -> tuple[int, float]:
    """Trains, kills worker ``victim`` (SIGKILL) after its step 2, and waits for the other
    one to exit: its exit code, and how many seconds after the kill it came."""
    # --slow 0.3: the kill lands in the pause after step 2 even when this process polls
    # late on a loaded machine (with 0.1 it once landed in step 3's compiled collective).
    procs = engine.start(out, "train", "--steps", "300", "--slow", "0.3", "--timeout", f"{TIMEOUT}")
    try:
        wait_progress(out, victim, 2, timeout=60)
        procs[victim].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code = procs[1 - victim].wait(timeout=TIMEOUT + DIAGNOSIS + 10)
        elapsed = time.monotonic() - killed
    finally:
        stop(procs)
    return code, elapsed


def check_a_killed_worker_is_named(engine: Engine, out: Path, victim: int) -> None:
    """The survivor of `kill_a_worker` raises ``UnavailableError`` naming the victim."""
    code, elapsed = kill_a_worker(engine, out, victim)
    survivor = 1 - victim
    assert code == 17, stderr(out, survivor)[-3000:]
    assert elapsed < TIMEOUT + DIAGNOSIS, f"took {elapsed:.1f} s"
    raised = error(out, survivor)
    assert raised["type"] == "UnavailableError", raised
    where = f"worker(s) {victim} (/job:worker/replica:0/task:{victim} at 127.0.0.1:"
    assert where in raised["message"], raised["message"]
    assert "restart" in raised["message"]


def names_a_stalled_worker_1(message: str) -> None:
    """``message`` says worker 1 is alive but did not reach worker 0's collective within
    ``--timeout 3``."""
    assert "did not complete within 3 s" in message, message
    assert "worker(s) 1 (/job:worker/replica:0/task:1 at 127.0.0.1:" in message, message
    assert "alive but did not reach it" in message, message


_line = multiprocess.mismatch_site

#: ``--case`` of mode ``mismatch`` -> what each worker reached, as the message names it.
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
    # Eager engines (each collective checked); a compiled step is one collective instead.
    "run_or_gather": (
        f"all_reduce(SUM) of float32[3] at {_line('run_or_gather (worker 0)')} in sums_again",
        f"all_gather(axis=0) of float32[*] at {_line('run_or_gather (worker 1)')} in mismatch",
    ),
}


def check_mismatch(
    engine: Engine, out: Path, case: str, at: str, env: Mapping[str, str] | None = None
) -> None:
    """Both workers of mode ``mismatch --case case`` raise ``CollectiveMismatchError``,
    which begins ``Workers disagree on their collective <at>`` and names what each reached."""
    codes = engine.run(
        out, "mismatch", "--case", case, "--timeout", MISMATCH_TIMEOUT, timeout=120, env=env
    )
    assert codes == [17, 17], stderr(out, 0)[-3000:]
    for rank in range(WORKERS):
        raised = error(out, rank)
        assert raised["type"] == "CollectiveMismatchError", raised
        message = raised["message"]
        assert message.startswith(f"Workers disagree on their collective {at}"), message
        for w, reached in enumerate(MISMATCHES[case]):
            assert f"\n  worker {w} (/job:worker/replica:0/task:{w} at 127.0.0.1:" in message
            assert f"): {reached}\n" in message, message


def check_multi_worker_example(engine: Engine, example: Path, name: str, ckpt: Path) -> None:
    """The repository's ``examples/multi_worker_train.py`` with ``--engine name`` on
    `WORKERS` processes (``engine``'s environment): every worker ends with the same
    weights, within rounding of the simulator's, and a restart from the chief's
    checkpoints in ``ckpt`` resumes after the last step (the same weights)."""

    def run() -> str:
        log = io.StringIO()
        result = _launch.launch(
            WORKERS,
            str(example),
            ["--engine", name, "--ckpt", str(ckpt)],
            timeout=180,
            stdout=log,
            stderr=log,
            env=engine.environment(),
        )
        assert result.exit_code == 0, f"{result.message}\n{log.getvalue()[-3000:]}"
        return log.getvalue()

    out = run()
    weights = re.findall(r"worker (\d): w = (\[.*\])", out)
    assert sorted(w for w, _ in weights) == [str(w) for w in range(WORKERS)], out
    assert len({w for _, w in weights}) == 1, out  # every worker holds the same weights
    diffs = [float(d) for d in re.findall(r"largest difference from the sim: (\S+)", out)]
    assert len(diffs) == WORKERS, out
    assert max(diffs) <= 1e-6, out
    again = run()
    assert re.findall(r"worker \d: w = (\[.*\])", again) == [weights[0][1]] * WORKERS, again


# --------------------------------------------------------------------------- the tests


class MultiWorkerTests:
    """The shared tests; a backend's ``Test...`` subclass sets ``engine`` and
    ``mismatch_at``."""

    engine: ClassVar[Engine]
    #: What ``CollectiveMismatchError``'s message names after "their collective " (the
    #: engine's numbering of collectives).
    mismatch_at: ClassVar[str] = "#"

    @pytest.fixture(scope="class")
    @classmethod
    def sim_results(cls) -> Results:
        return multiprocess.program(sim_strategy())

    @pytest.fixture(scope="class")
    @classmethod
    def worker_results(cls, tmp_path_factory: pytest.TempPathFactory) -> list[Results]:
        out = tmp_path_factory.mktemp("compute")
        result = cls.engine.launch(out, "compute")
        assert result.exit_code == 0, result.message
        return [multiprocess.load(out / f"worker{w}.npz") for w in range(WORKERS)]

    @pytest.mark.parametrize(
        "key",
        [
            "replica_id",
            "local_values",
            "all_reduce_int",
            "all_gather",
            "variable_int16",
            *(f"all_reduce_{dtype}" for dtype in multiprocess.NARROW_DTYPES),
            *(f"all_reduce_nest_{i}" for i in range(len(multiprocess.NEST))),
            *(f"batch_reduce_{i}" for i in range(len(multiprocess.NEST) + 1)),
            # The same with a call's own options (bytes_per_pack=8: several packs).
            *(f"all_reduce_nest_packed_{i}" for i in range(len(multiprocess.NEST))),
            *(f"batch_reduce_packed_{i}" for i in range(len(multiprocess.NEST) + 1)),
            "batch_reduce_mean_0",
            "batch_reduce_mean_1",
        ],
    )
    def test_per_replica_results_equal_the_sim_exactly(
        self, key: str, worker_results: list[Results], sim_results: Results
    ) -> None:
        got = as_global(worker_results, key)
        assert len(got) == len(sim_results[key]) == WORKERS * D
        for r, (a, b) in enumerate(zip(got, sim_results[key])):
            assert a.dtype == b.dtype, f"replica {r}: {a.dtype} != {b.dtype}"
            assert np.array_equal(a, b), f"replica {r}: {a} != {b}"

    @pytest.mark.parametrize(
        "key",
        [
            "reduce_int_mean",
            "reduce_axis_mean",
            "merge_axis_mean",
            "gather",
            "host_sum",
            "host_gather",
            "bool_refused",
            *(f"gather_{dtype}" for dtype in multiprocess.NARROW_DTYPES),
        ],
    )
    def test_cross_replica_results_equal_the_sim_exactly(
        self, key: str, worker_results: list[Results], sim_results: Results
    ) -> None:
        got = same_everywhere(worker_results, key)
        want = sim_results[key][0]
        assert got.dtype == want.dtype, f"{got.dtype} != {want.dtype}"
        assert np.array_equal(got, want), f"{got} != {want}"

    def test_replica_ids_and_input_pipelines(self, worker_results: list[Results]) -> None:
        assert [int(x) for x in as_global(worker_results, "replica_id")] == [0, 1, 2, 3]
        assert float(same_everywhere(worker_results, "host_sum")) == 1.5 * WORKERS
        # Each worker's own host value, gathered in worker order on every worker.
        gathered = same_everywhere(worker_results, "host_gather_workers")
        assert gathered.tolist() == [[w, w] for w in range(WORKERS)], gathered
        assert same_everywhere(worker_results, "bool_refused").tolist() == [True, True, True]
        pipelines = same_everywhere(worker_results, "input_pipelines")
        assert {tuple(p) for p in pipelines.tolist()} == {(WORKERS, 0), (WORKERS, 1)}

    @pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
    def test_sums_are_within_the_rounding_bound_of_the_sims(
        self, mean: bool, worker_results: list[Results], sim_results: Results
    ) -> None:
        terms = as_global(worker_results, "local_values")
        name = "mean" if mean else "sum"
        for got, want in zip(
            as_global(worker_results, f"all_reduce_{name}"), sim_results[f"all_reduce_{name}"]
        ):
            check_sum(got, want, terms, mean)
        check_sum(
            same_everywhere(worker_results, f"reduce_{name}"),
            sim_results[f"reduce_{name}"][0],
            terms,
            mean,
        )

    def test_sgd_matches_the_sim(self, worker_results: list[Results], sim_results: Results) -> None:
        steps = sum(1 for k in sim_results if k.startswith("sgd_w_"))
        assert steps == 3
        for step in range(steps):
            local = as_global(worker_results, f"sgd_local_{step}")
            totals = as_global(worker_results, f"sgd_total_{step}")
            # Each step's all-reduce is within the bound of the exact sum of ITS inputs ...
            columns = np.stack(local).reshape(len(local), -1).T.astype(np.float64)
            exact = np.asarray([math.fsum(v) for v in columns]).reshape(local[0].shape)
            reduction = Reduction.across_replicas(local)
            for t in totals:
                assert np.array_equal(t, totals[0])  # every replica got the same sum
                assert within_bound(
                    t, exact.astype(np.float32), reduction, oracle_exact=False
                ).all()
            # ... and the weights follow the sim's within float32 rounding.
            np.testing.assert_allclose(
                same_everywhere(worker_results, f"sgd_w_{step}"),
                sim_results[f"sgd_w_{step}"][0],
                rtol=1e-5,
                atol=1e-6,
            )
        # The first step's gradients do not depend on earlier rounding: within the bound.
        for got, want in zip(as_global(worker_results, "sgd_total_0"), sim_results["sgd_total_0"]):
            check_sum(got, want, as_global(worker_results, "sgd_local_0"), mean=False)

    def test_only_the_chief_writes_and_a_restart_resumes(self, tmp_path: Path) -> None:
        steps = "5"
        whole, broken = tmp_path / "whole", tmp_path / "broken"
        for d in (whole, broken):
            (d / "ckpt").mkdir(parents=True)
        result = self.engine.launch(whole, "train", "--steps", steps, "--ckpt", str(whole / "ckpt"))
        assert result.exit_code == 0, result.message
        saved = [multiprocess.load(whole / f"train{w}.npz")["saved"][0] for w in range(WORKERS)]
        assert [int(s) for s in saved] == [5, 0]  # checkpoint.save returned None on worker 1
        assert [p.name for p in sorted((whole / "ckpt").glob("ckpt-*"))][-1] == "ckpt-4"

        # Worker 1 dies at step 3: the launcher stops worker 0; the restart resumes after
        # the latest checkpoint.
        args = ("train", "--steps", steps, "--ckpt", str(broken / "ckpt"))
        result = self.engine.launch(broken, *args, "--die-at", "3")
        assert result.exit_code == 3, result.message
        assert result.failed_worker == 1, result.message
        # The chief may be stopped before its save after step 2 lands; saves are atomic,
        # so the latest complete checkpoint is that one or the one before.
        last = pd.checkpoint.read_manifest(broken / "ckpt").step
        assert last in (1, 2)
        assert not (broken / "train0.npz").exists()
        result = self.engine.launch(broken, *args)
        assert result.exit_code == 0, result.message
        for w in range(WORKERS):
            resumed = multiprocess.load(broken / f"train{w}.npz")
            uninterrupted = multiprocess.load(whole / f"train{w}.npz")
            assert int(resumed["start"][0]) == last + 1
            assert np.array_equal(resumed["w"][0], uninterrupted["w"][0]), "restart changed w"

    def test_a_killed_worker_makes_the_survivor_raise_unavailable(self, tmp_path: Path) -> None:
        check_a_killed_worker_is_named(self.engine, tmp_path, victim=1)

    @pytest.mark.parametrize("case", ["op", "shape", "reduce_op", "extra"])
    def test_workers_that_disagree_on_a_collective_raise_collective_mismatch(
        self, tmp_path: Path, case: str
    ) -> None:
        check_mismatch(self.engine, tmp_path, case, self.mismatch_at)
