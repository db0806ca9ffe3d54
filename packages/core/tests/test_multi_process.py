"""The engine-independent parts of one-process-per-worker MultiWorkerMirroredStrategy.

The strategies themselves run in worker processes: see the torch and JAX
backends' ``test_multi_worker_*.py``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist import errors
from polydist._distributed import multi_process as mp
from polydist.backend import Capabilities
from polydist.cluster_resolver import ClusterSpec, SimpleClusterResolver, TFConfigClusterResolver
from polydist.experimental import CommunicationOptions
from polydist_sim import SimBackend


def test_collective_timeout() -> None:
    assert mp.collective_timeout(None) == mp.DEFAULT_TIMEOUT_SECONDS == 60.0
    assert mp.collective_timeout(CommunicationOptions()) == 60.0
    assert mp.collective_timeout(CommunicationOptions(timeout_seconds=2.5)) == 2.5
    assert mp.collective_timeout(CommunicationOptions(timeout_seconds=0)) == mp.NO_TIMEOUT_SECONDS


def test_rendezvous_is_worker_0() -> None:
    spec = ClusterSpec({"worker": ["w0:1", "w1:2"], "chief": ["c:3"]})
    resolver = SimpleClusterResolver(spec, task_type="worker", task_id=1)
    assert mp.rendezvous_address(resolver) == "c:3"
    assert mp.task_addresses(spec, "worker", 1) == ["c:3", "w0:1", "w1:2"]
    assert mp.task_names(spec, "worker", 1)[2] == "/job:worker/replica:0/task:1"
    no_chief = SimpleClusterResolver(ClusterSpec({"worker": ["w0:1", "w1:2"]}))
    assert mp.rendezvous_address(no_chief) == "w0:1"
    assert mp.rendezvous_address(SimpleClusterResolver(ClusterSpec({}))) is None


def test_environment_cluster_resolver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert mp.environment_cluster_resolver("RANK", "WORLD_SIZE", "h:1", what="x") is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    resolver = mp.environment_cluster_resolver("RANK", "WORLD_SIZE", "h:1", what="torchrun")
    assert resolver is not None
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolver.cluster_spec().job_tasks("worker") == [
        "h:1",
        "unknown (torchrun rank 1)",
        "unknown (torchrun rank 2)",
    ]
    with pytest.raises(ValueError, match="rendezvous address is not"):
        mp.environment_cluster_resolver("RANK", "WORLD_SIZE", None, what="torchrun")
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match=r"\$RANK='x' and \$WORLD_SIZE='3' must be integers"):
        mp.environment_cluster_resolver("RANK", "WORLD_SIZE", "h:1", what="torchrun")


def test_tf_config_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    fallback = SimpleClusterResolver(
        ClusterSpec({"worker": ["a:1"]}), task_type="worker", task_id=0
    )
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert mp.default_cluster_resolver(None, fallback) is fallback
    assert isinstance(mp.default_cluster_resolver(None), TFConfigClusterResolver)
    config = {"cluster": {"worker": ["b:1"]}, "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    assert isinstance(mp.default_cluster_resolver(fallback), TFConfigClusterResolver)


class _Store:
    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.lock = threading.Lock()
        self.broken = False

    def set(self, key: str, value: str) -> None:
        if self.broken:
            raise ConnectionError("store gone")
        with self.lock:
            self.data[key] = value

    def get(self, key: str) -> str | None:
        if self.broken:
            raise ConnectionError("store gone")
        with self.lock:
            return self.data.get(key)


def test_heartbeats_tell_dead_from_behind() -> None:
    store = _Store()
    counts = [5, 5, 3]
    beats = [
        mp.Heartbeat(lambda: store, r, 3, lambda r=r: counts[r])  # type: ignore[misc]
        for r in range(3)
    ]
    try:
        threading.Event().wait(3 * mp.HEARTBEAT_SECONDS)
        beats[1].stop(wait=5)  # worker 1 "dies"; worker 2 lives but is at collective 3
        dead, behind = beats[0].diagnose(collectives=5)
        assert dead == [1]
        assert behind == [2]
        store.broken = True  # the store (hosted by worker 0) is gone
        threading.Event().wait(2 * mp.HEARTBEAT_SECONDS)
        assert beats[2].diagnose(collectives=3) == ([0], [])
    finally:
        for b in beats:
            b.stop(wait=5)


def test_describe_workers() -> None:
    names = ["/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1"]
    assert (
        mp.describe_workers([1], names, ["a:1", "b:2"]) == "1 (/job:worker/replica:0/task:1 at b:2)"
    )
    assert mp.describe_workers([0, 1], names) == (
        "0 (/job:worker/replica:0/task:0), 1 (/job:worker/replica:0/task:1)"
    )


def test_gathered_sizes_validate_every_workers_shape() -> None:
    rows = [mp.shape_row((2, 3)).tolist(), mp.shape_row((5, 3)).tolist()]
    assert rows == [[2, 2, 3], [2, 5, 3]]
    assert mp.gathered_sizes(rows, (2, 3), 0, rank=0) == [2, 5]
    with pytest.raises(errors.InvalidArgumentError) as raised:
        mp.gathered_sizes([[2, 2, 3], [2, 2, 4]], (2, 3), 0, rank=0)
    assert str(raised.value) == (
        "all_gather along axis 0: worker 0 has shape [2, 3] but worker 1 has [2, 4]; all "
        "dimensions except axis 0 must match on every worker's replicas."
    )
    with pytest.raises(errors.InvalidArgumentError, match="worker 1 has \\[2\\]"):
        mp.gathered_sizes([[2, 2, 3], [1, 2]], (2, 3), 0, rank=0)  # another rank


def test_resolve_cluster_refuses_arguments_of_the_wrong_type() -> None:
    options = CommunicationOptions(timeout_seconds=7)
    with pytest.raises(TypeError, match="got CommunicationOptions.*by keyword"):
        mp.resolve_cluster(options, None, "RANK", "WORLD_SIZE", None, what="torchrun")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="communication_options must be .* got int: 30"):
        mp.resolve_cluster(None, 30, "RANK", "WORLD_SIZE", None, what="torchrun")  # type: ignore[arg-type]


def test_resolve_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = ClusterSpec({"worker": ["w0:1", "w1:2"]})
    given = SimpleClusterResolver(spec, task_type="worker", task_id=1)
    options = CommunicationOptions(timeout_seconds=7)
    cluster = mp.resolve_cluster(given, options, "RANK", "WORLD_SIZE", "h:9", what="torchrun")
    assert cluster.resolver is given
    assert (cluster.addresses, cluster.rendezvous, cluster.timeout) == (["w0:1", "w1:2"], "w0:1", 7)
    # No resolver: the launcher's variables (TF_CONFIG would win).
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cluster = mp.resolve_cluster(None, None, "RANK", "WORLD_SIZE", "h:9", what="torchrun")
    assert (cluster.resolver.task_type, cluster.resolver.task_id) == ("worker", 1)
    assert cluster.addresses == ["h:9", "unknown (torchrun rank 1)"]
    assert (cluster.rendezvous, cluster.timeout) == ("h:9", mp.DEFAULT_TIMEOUT_SECONDS)
    # A cluster without this worker's task: no addresses (the strategy says what is missing).
    untasked = mp.resolve_cluster(SimpleClusterResolver(spec), None, "R", "W", None, what="x")
    assert (untasked.addresses, untasked.rendezvous) == ([], "w0:1")


def test_check_joining() -> None:
    assert mp.check_joining(1, 2, None) is False
    assert mp.check_joining(1, 2, (1, 2)) is True
    with pytest.raises(ValueError, match="worker_index 2 is out of range for a cluster of 2"):
        mp.check_joining(2, 2, None)
    with pytest.raises(ValueError, match="already is worker 0 of a cluster of 2; it cannot also"):
        mp.check_joining(1, 2, (0, 2))


def test_worker_task_names_and_capabilities() -> None:
    devices = [
        ["/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:0/device:GPU:0"],
        ["/job:chief/replica:0/task:0/device:CPU:0"],
    ]
    assert mp.worker_task_names(devices) == [
        "/job:worker/replica:0/task:0",
        "/job:chief/replica:0/task:0",
    ]
    caps = mp.process_capabilities(Capabilities(reduction_orders=("sequential",)))
    assert caps.multi_worker and caps.reduction_orders == ()
    assert caps.simulated_clusters is False


class _Membership(mp.ClusterMembership):
    engine_errors = (RuntimeError,)

    def translate(self, what: str, err: BaseException) -> errors.OpError:
        dead, behind = self.diagnose()
        return errors.UnavailableError(f"{self.collective(what)}: {err}; {dead} {behind}")


class _Checker:
    def __init__(self, error: Exception | None) -> None:
        self.error = error
        self.calls: list[tuple[object, ...]] = []

    def publish(self, *signature: object) -> tuple[object, ...]:
        self.calls.append(signature)
        return signature

    def confirm(self, pending: tuple[object, ...]) -> list[str]:
        self.calls.append(("confirm", pending[0]))
        if self.error is not None:
            raise self.error
        return ["", ""]


def _membership(checker: _Checker | None = None) -> _Membership:
    names = ["/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1"]
    member = _Membership(rank=0, world_size=2, timeout=3, names=names, addresses=["a:1", "b:2"])
    member.checker = checker  # type: ignore[assignment]
    return member


def test_a_failed_collective_fails_the_cluster() -> None:
    member = _membership()
    assert member.call("all_reduce", lambda: 5) == 5
    with pytest.raises(errors.UnavailableError) as raised:
        member.call("all_gather", lambda: _raise(RuntimeError("peer gone")))
    # No heartbeat: nobody is named.
    expected = "all_gather (collective #2 of worker 0) across 2 workers: peer gone; [] []"
    assert str(raised.value) == expected
    assert member.failure is raised.value and member.collectives == 2
    with pytest.raises(errors.UnavailableError, match="all_reduce cannot run: the cluster failed"):
        member.call("all_reduce", lambda: 5)
    assert member.collectives == 2
    # What the engine does not list as its errors passes through.
    other = _membership()
    with pytest.raises(KeyError):
        other.call("broadcast", lambda: _raise(KeyError("bug")))
    assert other.failure is None


def test_check_signature() -> None:
    agreeing = _Checker(None)
    member = _membership(agreeing)
    assert member.check_signature("all_reduce", "float32", (3,), None) == ["", ""]
    assert agreeing.calls == [
        ("all_reduce", "float32", (3,), None, "", None),
        ("confirm", "all_reduce"),
    ]
    # checked: the caller's work runs after the signature is published, before the wait.
    agreeing.calls.clear()

    def prepare() -> int:
        agreeing.calls.append(("prepare",))
        # At the check, the heartbeat counts the collective as reached (see entering).
        assert member.entering and member.collectives == 0
        return 7

    assert member.checked("all_gather", "int32", (2,), 0, prepare) == (7, ["", ""])
    assert not member.entering
    assert agreeing.calls == [
        ("all_gather", "int32", (2,), 0, "", None),
        ("prepare",),
        ("confirm", "all_gather"),
    ]
    # A pack's shapes travel with its signature.
    agreeing.calls.clear()
    member.checked("all_reduce", "float32", (5,), None, lambda: 0, parts=[(2,), (3,)])
    assert agreeing.calls[0] == ("all_reduce", "float32", (5,), None, "", [(2,), (3,)])
    assert _membership(None).checked("all_reduce", "float32", (3,), None, lambda: 8) == (8, None)
    mismatch = errors.CollectiveMismatchError("Workers disagree")
    member = _membership(_Checker(mismatch))
    with pytest.raises(errors.CollectiveMismatchError):
        member.check_signature("all_reduce")
    assert member.failure is None  # no worker issued it: still usable
    member = _membership(_Checker(RuntimeError("store gone")))
    with pytest.raises(errors.UnavailableError, match=r"all_reduce \(collective #1 of worker 0"):
        member.check_signature("all_reduce")
    assert member.collectives == 1 and member.failure is not None
    member.check_signature("all_reduce")  # a failed cluster checks nothing (call raises)
    _membership(None).check_signature("all_reduce")  # nor one without a store


def test_membership_names_the_workers() -> None:
    member = _membership()
    assert member.describe([1]) == "1 (/job:worker/replica:0/task:1 at b:2)"
    assert member.collective("all_reduce", 4) == (
        "all_reduce (collective #4 of worker 0) across 2 workers"
    )
    assert member.unavailable([1]) == (
        "worker(s) 1 (/job:worker/replica:0/task:1 at b:2) unavailable: its process stopped "
        "sending heartbeats (it exited, crashed, hung or lost its network)"
    )
    assert member.behind([1]).startswith(
        "worker(s) 1 (/job:worker/replica:0/task:1 at b:2) are alive but did not reach it"
    )


def test_once_per_process() -> None:
    made: list[object] = []

    def make() -> object:
        made.append(object())
        threading.Event().wait(0.05)  # the other threads arrive while it is being made
        return made[-1]

    get = mp.once_per_process(make)
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(get())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(made) == 1
    assert got == made * 4 and get() is made[0]


def _raise(error: Exception) -> None:
    raise error


def test_announce_publish_late_and_settle_go_to_the_checker() -> None:
    """An engine that exchanges a collective's digest itself (JAX's compiled step)."""

    class Announcing(_Checker):
        def announce(self, op: str) -> tuple[object, ...]:
            self.calls.append(("announce", op))
            if self.error is not None:
                raise self.error
            return (op,)

        def publish_late(self, pending: object) -> None:
            self.calls.append(("publish_late", pending))
            raise RuntimeError("the store is gone")  # dropped: the engine's wait reports it

        def settled(self, pending: object) -> None:
            self.calls.append(("settled", pending))

    checker = Announcing(None)
    member = _membership(checker)  # type: ignore[arg-type]
    pending = member.announce("strategy.run")
    member.publish_late(pending)
    member.settle(pending)
    assert checker.calls == [
        ("announce", "strategy.run"),
        ("publish_late", ("strategy.run",)),
        ("settled", ("strategy.run",)),
    ]
    assert member.failure is None and member.collectives == 0
    # A store that fails while announcing fails the cluster, as a failed check does.
    failing = _membership(Announcing(RuntimeError("store unreachable")))  # type: ignore[arg-type]
    with pytest.raises(errors.UnavailableError, match="store unreachable"):
        failing.announce("strategy.run")
    assert failing.failure is not None and failing.collectives == 1
    assert failing.announce("strategy.run") is None  # failed: nothing more is announced
    assert _membership().announce("strategy.run") is None  # no checker: no check


# -- MultiWorkerMirroredStrategy picks the engine through the backend ----------------------------


class _OneWorkerHere(SimBackend):
    """A sim that behaves as an engine with one process per worker: it joins a cluster
    but runs (and sums) only this worker's replicas, as torch's and JAX's engines do
    before their cross-process step."""

    def connect_cluster(
        self, worker_devices: Sequence[Sequence[str]], worker_index: int
    ) -> tuple[int, ...]:
        super().connect_cluster(worker_devices, worker_index)
        return (worker_index,)

    def local_device_count(self, requested: int | None) -> tuple[str, int] | None:
        return None if requested is None else ("GPU", requested)

    def broadcast_from_chief(self, value: Any, device: str) -> Any:
        return self.place(value, device)


class _Processes:
    """A `SupportsWorkerProcesses` that records what the strategy asked of it."""

    def __init__(self) -> None:
        self.engine = _OneWorkerHere(num_gpus=2)
        self.calls: list[str] = []

    def worker_cluster(
        self, cluster_resolver: Any, communication_options: Any
    ) -> pd.backend.ClusterToJoin:
        self.calls.append("cluster")
        resolver = cluster_resolver or TFConfigClusterResolver()
        return pd.backend.ClusterToJoin(resolver, [], None, 60.0)

    def worker_process_engine(
        self, cluster: pd.backend.ClusterToJoin, local_devices: int | None
    ) -> pd.backend.Backend:
        self.calls.append(f"engine {local_devices}")
        return self.engine


def _two_workers() -> SimpleClusterResolver:
    spec = ClusterSpec({"worker": ["host0:1", "host1:1"]})
    return SimpleClusterResolver(spec, task_type="worker", task_id=0)


def test_the_backend_supplies_the_engine_and_the_group() -> None:
    processes = _Processes()
    assert isinstance(processes, pd.backend.SupportsWorkerProcesses)
    strategy = pd.MultiWorkerMirroredStrategy(_two_workers(), backend=processes, local_devices=2)
    assert processes.calls == ["cluster", "engine 2"]
    extended = strategy.extended
    assert isinstance(extended, mp.MultiProcessExtended) and extended.backend is processes.engine
    assert strategy.num_replicas_in_sync == 4 and len(extended.worker_devices) == 2
    values = strategy.experimental_distribute_values_from_function(
        lambda c: np.float32(1 + 2 * c.replica_id_in_sync_group)  # worker 0: 1 and 3
    )
    # This fake engine sums only this worker's replicas (4); MEAN divides by every
    # worker's replicas (W x D = 4), which the group supplies, not by this worker's 2.
    assert float(strategy.reduce("SUM", values, axis=None)) == 4.0
    assert float(strategy.reduce("MEAN", values, axis=None)) == 1.0
    mirrored = strategy.extended.reduce_to("MEAN", values, values)
    assert [float(v) for v in mirrored.values] == [1.0, 1.0]
    # A host value: each worker's copy once, MEAN dividing by W = 2.
    assert float(strategy.reduce("MEAN", np.float32(6.0), axis=None)) == 3.0
    # IndexedSlices gather every worker's rows (here only this worker's): MEAN / (W x D).
    slices = strategy.experimental_distribute_values_from_function(
        lambda c: pd.IndexedSlices(
            np.full((1, 2), 2.0 + 4 * c.replica_id_in_sync_group, np.float32),
            np.asarray([c.replica_id_in_sync_group]),
            (4, 2),
        )
    )
    mean = strategy.reduce("MEAN", slices, axis=None)
    assert mean.values.tolist() == [[0.5, 0.5], [1.5, 1.5]]
    assert mean.indices.tolist() == [0, 1]


def test_a_sim_cluster_needs_no_engine_and_takes_no_local_devices() -> None:
    assert pd.backend.worker_processes("sim") is None
    assert pd.backend.worker_processes(SimBackend()) is None
    strategy = pd.MultiWorkerMirroredStrategy(_two_workers(), backend="sim")
    assert not isinstance(strategy.extended, mp.MultiProcessExtended)
    with pytest.raises(ValueError, match="local_devices=2 needs a backend with one process"):
        pd.MultiWorkerMirroredStrategy(_two_workers(), backend="sim", local_devices=2)
    with pytest.raises(ValueError, match="local_devices must be >= 1"):
        pd.MultiWorkerMirroredStrategy(backend="sim", local_devices=0)
