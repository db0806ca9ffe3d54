"""MultiWorkerMirroredStrategy on torch.distributed (gloo): 2 worker processes x 2 replicas.

The tests every engine shares (`polydist_conformance.multiprocess_tests`) run the
workers (``mw_program.py``) as `TestMultiWorker`; below are torch's own: the faults
torch reports its own way (worker 0's death, a missing or unreachable worker),
a worker that ended early, and torchrun's environment.
"""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import polydist as pd
from polydist.backend import launch as _launch
from polydist_conformance import multiprocess
from polydist_conformance import multiprocess_tests as mpt
from polydist_sim import SimBackend

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX process groups")

ENGINE = mpt.Engine(
    Path(__file__).resolve().parent / "mw_program.py",
    unset=("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"),
    # gloo on CPU wherever the tests run: on a GPU machine the workers would otherwise
    # take GPUs (and two on one GPU is refused).
    env={"TORCH_CPP_LOG_LEVEL": "ERROR", "CUDA_VISIBLE_DEVICES": ""},
)


class TestMultiWorker(mpt.MultiWorkerTests):
    engine = ENGINE
    mismatch_at = "#2;"

    def test_torchrun_environment(self, tmp_path: Path, sim_results: mpt.Results) -> None:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={mpt.WORKERS}",
                str(ENGINE.program),
                str(tmp_path),
                "compute",
            ],
            env=ENGINE.environment(),
            timeout=90,
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        results = [multiprocess.load(tmp_path / f"worker{w}.npz") for w in range(mpt.WORKERS)]
        assert [int(x) for x in mpt.as_global(results, "replica_id")] == [0, 1, 2, 3]
        assert np.array_equal(mpt.same_everywhere(results, "gather"), sim_results["gather"][0])


# --------------------------------------------------------------------------- faults


def test_a_killed_worker_0_makes_the_survivor_raise_unavailable(tmp_path: Path) -> None:
    """Worker 0 hosts the store: worker 1 names it all the same."""
    mpt.check_a_killed_worker_is_named(ENGINE, tmp_path, victim=0)


def test_a_worker_that_never_arrives_is_named(tmp_path: Path) -> None:
    assert ENGINE.run(tmp_path, "late", "--timeout", "3", wait=[0], timeout=30) == [17]
    error = mpt.error(tmp_path, 0)
    assert error["type"] == "DeadlineExceededError", error
    assert "Worker(s) 1 (/job:worker/replica:0/task:1 at 127.0.0.1:" in error["message"]
    assert "did not join the cluster of 2 workers within 3 s" in error["message"]
    assert not (tmp_path / "joined0").exists()  # the strategy was never created


def test_a_stalled_worker_is_named_after_the_timeout(tmp_path: Path) -> None:
    args = ("train", "--steps", "6", "--stall-at", "2", "--timeout", "3")
    assert ENGINE.run(tmp_path, *args, wait=[0], timeout=40) == [17]
    error = mpt.error(tmp_path, 0)
    assert error["type"] == "DeadlineExceededError", error
    mpt.names_a_stalled_worker_1(error["message"])


def test_worker_0_unreachable(tmp_path: Path) -> None:
    """Worker 1 alone: nobody hosts the rendezvous, so it names worker 0 within the bound."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port0 = s.getsockname()[1]
    env = _launch.worker_environment(1, [port0, port0 + 1], base=ENGINE.environment())
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(ENGINE.program), str(tmp_path), "compute", "--timeout", "2"],
        env=env,
        timeout=60,
        capture_output=True,
        check=False,
    )
    assert done.returncode == 17
    assert time.monotonic() - start < 20
    error = mpt.error(tmp_path, 1)
    assert error["type"] == "DeadlineExceededError", error
    assert f"could not reach the cluster's rendezvous at 127.0.0.1:{port0}" in error["message"]
    assert "hosted by 0 (/job:worker/replica:0/task:0" in error["message"]


# --------------------------------------------------------------------------- disagreements


def test_a_worker_that_ended_is_named_by_the_one_still_calling(tmp_path: Path) -> None:
    args = ("mismatch", "--case", "early_exit", "--timeout", mpt.MISMATCH_TIMEOUT)
    assert ENGINE.run(tmp_path, *args, timeout=120) == [17, 0]
    assert (tmp_path / "done1").exists() and not (tmp_path / "done0").exists()
    error = mpt.error(tmp_path, 0)
    assert error["type"] == "CollectiveMismatchError", error
    message = error["message"]
    where = multiprocess.mismatch_site("early_exit (worker 0)")
    reached = f"all_reduce(SUM) of float32[3] at {where} in mismatch"
    assert "  worker 0 (/job:worker/replica:0/task:0 at 127.0.0.1:" in message
    assert f"): {reached}\n" in message, message
    assert "  worker 1 (/job:worker/replica:0/task:1 at 127.0.0.1:" in message
    assert "): left the cluster after 1 collective(s) (its program ended" in message, message


@pytest.mark.parametrize(("case", "fail_at"), [("before", 0), ("after", 3)])
def test_an_error_caught_in_a_step_fails_the_cluster_on_both(
    tmp_path: Path, case: str, fail_at: int
) -> None:
    """Replica 3 (worker 1) raises inside strategy.run and the program catches it and goes
    on: its worker's other replica waited in a collective that never ran across the
    workers, so their collectives are out of step. Both workers raise from then on (worker
    1 CancelledError, worker 0 CollectiveMismatchError naming worker 1's error), and no
    step returns a wrong value. Step 3 is in the fast path (a repeated step)."""
    steps = fail_at + 3
    args = ("caught", "--case", case, "--fail-at", str(fail_at), "--steps", str(steps))
    assert ENGINE.run(tmp_path, *args, "--timeout", "20", timeout=90) == [0, 0]
    outcomes = [json.loads((tmp_path / f"caught{w}.json").read_text()) for w in range(mpt.WORKERS)]
    for w, steps_of in enumerate(outcomes):
        assert len(steps_of) == steps
        for step, outcome in enumerate(steps_of):
            if step < fail_at:
                assert outcome == {"values": [multiprocess.caught_expected(step)] * mpt.D}
            else:  # never a value: every step from the failed one on raises
                assert "values" not in outcome, (w, step, outcome)
    failed, survivor = outcomes[1], outcomes[0]
    assert failed[fail_at]["type"] == "ValueError"
    assert f"replica 3 fails {case} its all_reduce" in failed[fail_at]["message"]
    for later in failed[fail_at + 1 :]:
        assert later["type"] == "CancelledError", later
        assert "cannot run: the cluster failed earlier" in later["message"]
        assert "strategy.run raised ValueError: replica 3 fails" in later["message"]
    first = survivor[fail_at]
    assert first["type"] == "CollectiveMismatchError", first
    message = first["message"]
    assert "worker(s) 1 raised an error that left the cluster's collectives out of step" in (
        message
    )
    assert "  worker 1 (/job:worker/replica:0/task:1 at 127.0.0.1:" in message
    assert f"strategy.run raised ValueError: replica 3 fails {case} its all_reduce" in message
    assert "restart them all" in message
    for later in survivor[fail_at + 1 :]:
        assert later["type"] == "CollectiveMismatchError", later
        assert "cannot run: the cluster failed earlier" in later["message"]


# --------------------------------------------------------------------------- in-process


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.usefixtures("no_cluster")
@pytest.mark.usefixtures("cpu_only")
def test_without_a_cluster_it_is_one_worker() -> None:
    import torch

    from polydist_torch._multi_worker import TorchProcessGroupBackend

    backend = TorchProcessGroupBackend()
    strategy = pd.MultiWorkerMirroredStrategy(local_devices=3, backend=backend)
    assert strategy.extended.backend is backend
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
@pytest.mark.usefixtures("cpu_only")
def test_single_worker_tf_config(monkeypatch: pytest.MonkeyPatch) -> None:
    config = {"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    strategy = pd.MultiWorkerMirroredStrategy(local_devices=2, backend="torch")
    assert strategy.extended.worker_devices == (
        "/job:worker/replica:0/task:0/device:CPU:0",
        "/job:worker/replica:0/task:0/device:CPU:1",
    )
    assert float(strategy.reduce("MEAN", np.float32(2.0), axis=None)) == 2.0


@pytest.mark.usefixtures("no_cluster")
@pytest.mark.usefixtures("cpu_only")
def test_the_backend_picks_the_process_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from polydist_torch._multi_worker import TorchProcessGroupBackend

    by_name = pd.MultiWorkerMirroredStrategy(backend="torch", local_devices=2)
    assert isinstance(by_name.extended.backend, TorchProcessGroupBackend)
    assert by_name.num_replicas_in_sync == 2
    monkeypatch.setenv("POLYDIST_BACKEND", "torch")
    from_env = pd.MultiWorkerMirroredStrategy(local_devices=2)
    assert from_env.extended.backend is by_name.extended.backend  # the process's engine
    # One worker without local_devices needs no engine: the torch backend itself.
    plain = pd.MultiWorkerMirroredStrategy()
    assert plain.extended.backend is pd.backend.get_backend("torch")
    assert plain.num_replicas_in_sync == 1


@pytest.mark.usefixtures("no_cluster")
@pytest.mark.usefixtures("cpu_only")
def test_deprecated_alias_warns_and_still_works() -> None:
    from polydist_torch import MultiWorkerMirroredStrategy
    from polydist_torch._multi_worker import TorchProcessGroupBackend

    backend = TorchProcessGroupBackend()
    with pytest.warns(
        DeprecationWarning,
        match=r"use polydist.MultiWorkerMirroredStrategy\(backend='torch'\)",
    ):
        strategy = MultiWorkerMirroredStrategy(local_devices=2, backend=backend)
    assert isinstance(strategy, pd.MultiWorkerMirroredStrategy)
    assert strategy.extended.backend is backend and strategy.num_replicas_in_sync == 2
    with (
        pytest.warns(DeprecationWarning, match="is deprecated"),
        pytest.raises(TypeError, match="backend must be a polydist_torch.TorchProcessGroupBackend"),
    ):
        MultiWorkerMirroredStrategy(backend=SimBackend())  # type: ignore[arg-type]


@pytest.mark.usefixtures("no_cluster")
def test_argument_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="local_devices must be >= 1, got 0"):
        pd.MultiWorkerMirroredStrategy(local_devices=0, backend="torch")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="set MASTER_ADDR and MASTER_PORT"):
        pd.MultiWorkerMirroredStrategy(backend="torch")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ValueError, match=r"\$RANK=2 is out of range for \$WORLD_SIZE=2"):
        pd.MultiWorkerMirroredStrategy(backend="torch")


def test_bad_rendezvous_address() -> None:
    from polydist_torch._multi_worker import _split_address

    assert _split_address("10.0.0.1:2222") == ("10.0.0.1", 2222)
    assert _split_address("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError, match="must be 'host:port'"):
        _split_address("localhost")


# --------------------------------------------------------------------------- under polydist launch

PROBE = Path(__file__).resolve().parent / "mw_probe.py"


def launch_probe(*args: str, env: dict[str, str] | None = None) -> str:
    """``polydist launch -n 2 mw_probe.py ARGS``: its output, every worker's lines."""
    log = io.StringIO()
    result = _launch.launch(
        2,
        str(PROBE),
        list(args),
        timeout=120,
        stdout=log,
        stderr=log,
        env={**ENGINE.environment(), **(env or {})},
    )
    assert result.exit_code == 0, f"{result.message}\n{log.getvalue()[-3000:]}"
    out = log.getvalue()
    assert "[worker 0] worker 0: sum 3.0" in out and "[worker 1] worker 1: sum 3.0" in out, out
    return out


@pytest.mark.skipif(sys.platform != "linux", reason="all of 127.0.0.0/8 is loopback on Linux")
def test_the_rendezvous_listens_on_the_clusters_address_only() -> None:
    """Issue 22 item 12: TCPStore's own server listened on every interface, whatever the
    cluster said; under polydist launch (127.0.0.1) nothing else may reach it."""
    out = launch_probe()
    assert "[worker 0] worker 0: from 127.0.0.1 True" in out, out
    assert "[worker 0] worker 0: from 127.0.0.2 False" in out, out


def test_worker_0_listens_on_its_own_address_or_says_it_cannot() -> None:
    from polydist_torch._multi_worker import _listen_on

    with _listen_on("127.0.0.1", 0) as sock:  # type: ignore[union-attr]
        assert sock.getsockname()[0] == "127.0.0.1"
        with pytest.raises(OSError, match="in use"):  # the port is taken: no silent fallback
            _listen_on("127.0.0.1", sock.getsockname()[1])
    # TEST-NET-1 (RFC 5737) is no machine's address: the store falls back to every interface.
    assert _listen_on("192.0.2.1", 0) is None


def test_worker_0_names_a_host_it_cannot_resolve() -> None:
    from polydist_torch._multi_worker import _ProcessGroup

    names = ["/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1"]
    with pytest.raises(pd.errors.UnavailableError) as raised:
        _ProcessGroup.join(
            "no-such-host.invalid:2222",
            rank=0,
            world_size=2,
            timeout=2,
            names=names,
            addresses=["no-such-host.invalid:2222", "127.0.0.1:2223"],
            dist_backend="gloo",
        )
    message = str(raised.value)
    assert "cannot host the cluster's rendezvous at no-such-host.invalid:2222" in message
    assert "Is 'no-such-host.invalid' right? Worker 0 must resolve it" in message


def test_launch_prints_no_gloo_connection_lines_unless_asked() -> None:
    """Issue 22 item 15: torch <= 2.9's gloo prints a "[Gloo] Rank i is connected to ..."
    line per worker on standard output (``--old-gloo`` prints it as that gloo does)."""
    out = launch_probe("--old-gloo")
    assert "[Gloo]" not in out, out
    assert "[worker 1] worker 1: joined" in out, out  # the worker's own output is kept
    asked = launch_probe("--old-gloo", env={"GLOO_LOG_LEVEL": "INFO"})
    for worker in (0, 1):
        assert f"[worker {worker}] [Gloo] Rank {worker} is connected to 1 peer ranks" in asked


def test_a_step_against_a_gather_raises_collective_mismatch_on_both(tmp_path: Path) -> None:
    """Worker 0 runs a step (its all_reduce is checked), worker 1 gathers: both raise."""
    mpt.check_mismatch(ENGINE, tmp_path, "run_or_gather", TestMultiWorker.mismatch_at)


def test_a_save_on_the_chief_only_raises_collective_mismatch_before_writing(
    tmp_path: Path,
) -> None:
    """Audit F3: the chief's read of a SyncOnRead SUM variable in checkpoint.save paired up
    with worker 1's all_reduce of a float32 scalar (the same signature): the chief saved
    11.0 instead of 3.0 and worker 1 got 11. The save's collectives are now its own."""
    codes = ENGINE.run(
        tmp_path, "mismatch", "--case", "chief_only_save", "--timeout", mpt.MISMATCH_TIMEOUT
    )
    assert codes == [17, 17], mpt.stderr(tmp_path, 0)[-3000:]
    for rank in range(mpt.WORKERS):
        raised = mpt.error(tmp_path, rank)
        assert raised["type"] == "CollectiveMismatchError", raised
        message = raised["message"]
        assert message.startswith("Workers disagree on their collective #"), message
        site = multiprocess.mismatch_site("chief_only_save (worker 0)")
        assert f"): checkpoint save: all_reduce(SUM) of float32[] at {site} in mismatch\n" in (
            message
        )
        assert "\n  worker 1 (/job:worker/replica:0/task:1 at 127.0.0.1:" in message
        assert "): all_reduce(SUM) of float32[] at " in message, message
        assert "Worker(s) 0 are in a checkpoint save, worker(s) 1 are not." in message
        assert "every worker must call it, not only the chief" in message
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").iterdir())


# --------------------------------------------------------------------------- the example

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "multi_worker_train.py"


@pytest.mark.skipif(not EXAMPLE.exists(), reason="runs from a checkout of the repository")
def test_the_multi_worker_example_trains_to_the_sims_weights_and_resumes(tmp_path: Path) -> None:
    mpt.check_multi_worker_example(ENGINE, EXAMPLE, "torch", tmp_path)
