"""MultiWorkerMirroredStrategy on simulated clusters (reference B17, B19, B22, B28, B29)."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist._distributed.cluster import id_in_cluster, is_chief, worker_count
from polydist.cluster_resolver import (
    ClusterSpec,
    SimpleClusterResolver,
    TFConfigClusterResolver,
    TPUClusterResolver,
    set_accelerator_device_lister,
)
from polydist.experimental import (
    CollectiveCommunication,
    CollectiveHints,
    CommunicationImplementation,
    CommunicationOptions,
)
from polydist_sim import SimBackend

# The example of TF's Strategy.cluster_resolver docs (seed 003).
SEED_TF_CONFIG = {
    "cluster": {
        "worker": ["localhost:12345", "localhost:23456"],
        "ps": ["localhost:34567"],
    },
    "task": {"type": "worker", "index": 0},
}
TWO_WORKERS = {"worker": ["localhost:12345", "localhost:23456"]}

SetConfig = Callable[..., None]


@pytest.fixture(autouse=True)
def _restore_device_lister() -> Iterator[None]:
    # Connecting a simulated cluster installs the sim's device lister: put the old one back.
    previous = set_accelerator_device_lister(None)
    set_accelerator_device_lister(previous)
    yield
    set_accelerator_device_lister(previous)


@pytest.fixture
def tf_config(monkeypatch: pytest.MonkeyPatch) -> SetConfig:
    """``tf_config(cluster, task_type, task_id)`` or ``tf_config(full_dict)`` sets TF_CONFIG."""
    monkeypatch.delenv("TF_CONFIG", raising=False)

    def set_config(cluster: dict[str, Any], task_type: str | None = None, task_id: int = 0) -> None:
        config = cluster if "cluster" in cluster else {"cluster": cluster}
        if task_type is not None:
            config = {**config, "task": {"type": task_type, "index": task_id}}
        monkeypatch.setenv("TF_CONFIG", json.dumps(config))

    return set_config


def sim(gpus: int = 0) -> SimBackend:
    return SimBackend(num_gpus=gpus)


def replica_id() -> int:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return int(ctx.replica_id_in_sync_group)


def values(x: Any) -> list[float]:
    return [float(np.asarray(v)) for v in x.values]


# -- the cluster from TF_CONFIG -------------------------------------------------------------


def test_seed_tf_config_example(tf_config: SetConfig) -> None:
    tf_config(SEED_TF_CONFIG)
    strategy = pd.MultiWorkerMirroredStrategy(backend=sim())
    resolver = strategy.cluster_resolver
    assert isinstance(resolver, TFConfigClusterResolver)
    assert resolver.task_type == "worker"
    assert resolver.task_id == 0
    # ps tasks do not take part: 2 workers of 1 CPU each.
    assert strategy.num_replicas_in_sync == 2
    assert strategy.extended._num_workers == 2
    assert strategy.extended.worker_devices == ("/job:worker/replica:0/task:0/device:CPU:0",)
    assert strategy.extended.should_checkpoint


@pytest.mark.parametrize("task_id", [0, 1])
def test_two_workers_two_gpus(tf_config: SetConfig, task_id: int) -> None:
    tf_config(TWO_WORKERS, "worker", task_id)
    strategy = pd.MultiWorkerMirroredStrategy(backend=sim(gpus=2))
    extended = strategy.extended
    assert strategy.num_replicas_in_sync == 4
    assert extended.worker_devices == tuple(
        f"/job:worker/replica:0/task:{task_id}/device:GPU:{d}" for d in range(2)
    )
    assert extended.parameter_devices == extended.worker_devices
    assert (extended._num_workers, extended._worker_index) == (2, task_id)
    assert extended._num_devices_per_worker == 2
    assert extended._simulated_workers == (0, 1)
    assert extended.should_checkpoint is (task_id == 0)
    assert extended.should_save_summary is (task_id == 0)
    assert extended._in_multi_worker_mode()

    # One run runs every worker's replicas; collectives span all of them.
    def step() -> tuple[Any, Any, Any]:
        ctx = pd.get_replica_context()
        assert ctx is not None
        rid = ctx.replica_id_in_sync_group
        return rid, ctx.all_reduce("SUM", np.float32(rid) + 1), ctx.devices[0]

    ids, sums, devices = strategy.run(step)
    assert [int(v) for v in ids.values] == [0, 1, 2, 3]
    assert values(sums) == [10.0] * 4
    assert devices.values[2] == "/job:worker/replica:0/task:1/device:GPU:0"
    # Local results are this worker's replicas only.
    local = strategy.experimental_local_results(ids)
    assert [int(v) for v in local] == [2 * task_id, 2 * task_id + 1]
    nested = strategy.experimental_local_results({"id": ids, "c": 7})
    assert [int(n["id"]) for n in nested] == [2 * task_id, 2 * task_id + 1]
    # Reductions and gathers span all workers too.
    assert float(strategy.reduce("SUM", ids, axis=None)) == 6.0
    assert float(strategy.reduce("MEAN", sums, axis=None)) == 10.0
    gathered = strategy.gather(strategy.run(lambda: np.full((1,), replica_id())), axis=0)
    np.testing.assert_array_equal(gathered, [0, 1, 2, 3])


def test_values_from_function_get_global_replica_ids(tf_config: SetConfig) -> None:
    tf_config(TWO_WORKERS, "worker", 1)
    strategy = pd.MultiWorkerMirroredStrategy(backend=sim(gpus=2))
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync)
    )
    assert strategy.experimental_local_results(per_replica) == ((2, 4), (3, 4))
    out = strategy.run(lambda v: v[0] * 10, args=(per_replica,))
    assert strategy.experimental_local_results(out) == (20, 30)


def test_chief_comes_first(tf_config: SetConfig) -> None:
    cluster = {"chief": ["c:1"], "worker": ["w0:1", "w1:1"]}
    tf_config(cluster, "chief", 0)
    chief = pd.MultiWorkerMirroredStrategy(backend=sim())
    assert chief.num_replicas_in_sync == 3
    assert chief.extended._worker_index == 0
    assert chief.extended.worker_devices == ("/job:chief/replica:0/task:0/device:CPU:0",)
    assert chief.extended.should_checkpoint
    tf_config(cluster, "worker", 0)
    worker = pd.MultiWorkerMirroredStrategy(backend=sim())
    assert worker.extended._worker_index == 1
    assert not worker.extended.should_checkpoint
    ids = worker.run(replica_id)
    assert worker.experimental_local_results(ids) == (1,)


def test_no_tf_config_is_a_single_local_worker(tf_config: SetConfig) -> None:
    strategy = pd.MultiWorkerMirroredStrategy(backend=sim(gpus=3))
    resolver = strategy.cluster_resolver
    assert isinstance(resolver, TFConfigClusterResolver)
    assert (resolver.task_type, resolver.task_id) == (None, None)
    assert strategy.num_replicas_in_sync == 3
    assert strategy.extended.worker_devices == tuple(
        f"/job:localhost/replica:0/task:0/device:GPU:{i}" for i in range(3)
    )
    assert (strategy.extended._num_workers, strategy.extended._worker_index) == (1, 0)
    assert strategy.extended.should_checkpoint
    assert not strategy.extended._in_multi_worker_mode()
    assert pd.MultiWorkerMirroredStrategy(backend=sim()).extended.worker_devices == (
        "/job:localhost/replica:0/task:0/device:CPU:0",
    )


def test_devices_per_worker_from_other_resolvers() -> None:
    resolver = SimpleClusterResolver(
        ClusterSpec(TWO_WORKERS), task_type="worker", task_id=1, num_accelerators={"GPU": 3}
    )
    strategy = pd.MultiWorkerMirroredStrategy(resolver, backend=sim())
    assert strategy.num_replicas_in_sync == 6
    assert strategy.extended.worker_devices[-1] == "/job:worker/replica:0/task:1/device:GPU:2"
    assert strategy.cluster_resolver is resolver
    no_gpus = SimpleClusterResolver(ClusterSpec(TWO_WORKERS), task_type="worker", task_id=0)
    assert pd.MultiWorkerMirroredStrategy(no_gpus, backend=sim()).num_replicas_in_sync == 2


def test_sim_device_lister_answers_num_accelerators(tf_config: SetConfig) -> None:
    tf_config(TWO_WORKERS, "worker", 1)
    strategy = pd.MultiWorkerMirroredStrategy(backend=sim(gpus=2))
    resolver = strategy.cluster_resolver
    assert resolver.num_accelerators() == {"GPU": 2}
    assert resolver.num_accelerators("worker", 0) == {"GPU": 2}
    assert TFConfigClusterResolver().num_accelerators() == {"GPU": 2}
    # Only simulated tasks have devices.
    tf_config({"worker": ["a:1", "b:1", "c:1"]}, "worker", 2)
    assert TFConfigClusterResolver().num_accelerators() == {}


def test_variables_span_every_worker(tf_config: SetConfig) -> None:
    tf_config(TWO_WORKERS, "worker", 1)
    strategy = pd.MultiWorkerMirroredStrategy(backend=sim(gpus=2))
    with strategy.scope():
        v = pd.Variable(0.0, aggregation=pd.VariableAggregation.MEAN)
    strategy.run(lambda: v.assign(np.float32(replica_id())))
    local = strategy.experimental_local_results(v)
    assert [float(np.asarray(c)) for c in local] == [1.5, 1.5]  # the mean over all 4 replicas
    assert [c.device for c in local] == list(strategy.extended.worker_devices)


# -- reductions of host values (B17, B29) -----------------------------------------------------


@pytest.mark.parametrize("gpus", [0, 2])
def test_host_tensor_reduce_sums_once_per_worker(tf_config: SetConfig, gpus: int) -> None:
    tf_config(TWO_WORKERS, "worker", 0)
    strategy = pd.MultiWorkerMirroredStrategy(backend=sim(gpus))
    one = np.float32(1.0)
    assert float(strategy.reduce("SUM", one, axis=None)) == 2.0
    assert float(strategy.reduce(pd.ReduceOp.MEAN, one, axis=None)) == 1.0
    assert float(strategy.extended.reduce_to("SUM", one, "/cpu:0")) == 2.0
    with strategy.scope():
        assert float(strategy.reduce("SUM", 1.0, axis=None)) == 2.0
    # batch_reduce of host tensors: each gives [2, 2] (B29).
    pairs = [(np.ones(2, np.float32), "/cpu:0"), (np.ones(2, np.float32), "/cpu:0")]
    out = strategy.extended.batch_reduce_to("SUM", pairs)
    np.testing.assert_array_equal(np.stack(out), [[2, 2], [2, 2]])


@pytest.mark.parametrize("gpus", [0, 2])
def test_host_value_gathers_once_per_worker(tf_config: SetConfig, gpus: int) -> None:
    # TF's CrossDeviceOps._gather makes a plain tensor one component per worker: every
    # worker's copy, concatenated in worker order (audit F1: the local copy came back).
    tf_config({"worker": ["a:1", "b:1", "c:1"]}, "worker", 1)
    strategy = pd.MultiWorkerMirroredStrategy(backend=sim(gpus))
    gathered = strategy.gather(np.array([7.0], np.float32), axis=0)
    np.testing.assert_array_equal(gathered, [7.0, 7.0, 7.0])
    matrix = np.arange(6, dtype=np.int32).reshape(2, 3)
    np.testing.assert_array_equal(
        strategy.gather(matrix, axis=1), np.concatenate([matrix] * 3, axis=1)
    )
    np.testing.assert_array_equal(
        strategy.gather(matrix, axis=-2), np.concatenate([matrix] * 3, axis=0)
    )
    nest = strategy.gather({"a": np.array([1.0, 2.0]), "b": np.zeros((1, 2), np.int64)}, axis=0)
    np.testing.assert_array_equal(nest["a"], [1.0, 2.0] * 3)
    np.testing.assert_array_equal(nest["b"], np.zeros((3, 2), np.int64))
    plain = pd.Variable(np.array([1.0, 2.0], np.float32))
    np.testing.assert_array_equal(strategy.gather(plain, axis=0), [1.0, 2.0] * 3)
    with pytest.raises(pd.errors.InvalidArgumentError, match="rank >= 1"):
        strategy.gather(np.float32(1.0), axis=0)


def test_host_value_gather_is_a_collective_in_the_trace(tf_config: SetConfig) -> None:
    from polydist._collectives.trace import trace

    tf_config(TWO_WORKERS, "worker", 0)
    strategy = pd.MultiWorkerMirroredStrategy(backend=sim())
    with trace() as t:
        strategy.gather(np.ones(3, np.float32), axis=0)
    [event] = [e for e in t.events if e.op == "gather"]
    assert event.participants == (
        "/job:worker/replica:0/task:0/device:CPU:0",
        "/job:worker/replica:0/task:1/device:CPU:0",
    )


def test_one_worker_gathers_a_host_value_as_it_is(tf_config: SetConfig) -> None:
    # TF's non-distributed rule: a single worker (of one or several devices) returns it.
    for strategy in (
        pd.MultiWorkerMirroredStrategy(backend=sim(gpus=2)),
        pd.MirroredStrategy(2, backend=sim(gpus=2)),
        pd.get_strategy(),
    ):
        host = np.array([7.0], np.float32)
        assert strategy.gather(host, axis=0) is host


def test_host_bool_is_not_summed_across_workers(tf_config: SetConfig) -> None:
    tf_config(TWO_WORKERS, "worker", 0)
    strategy = pd.MultiWorkerMirroredStrategy(backend=sim())
    for op in ("SUM", "MEAN"):
        message = rf"cannot SUM bool .*: got bool\[\] for ReduceOp\.{op}"
        with pytest.raises(TypeError, match=message):
            strategy.reduce(op, np.bool_(True), axis=None)


def test_batch_reduce_per_replica_two_workers(tf_config: SetConfig) -> None:
    # cross_device_ops_test: each of 2 workers (1 device) holds ones -> [[2, 2], [2, 2]].
    tf_config(TWO_WORKERS, "worker", 1)
    strategy = pd.MultiWorkerMirroredStrategy(backend=sim())
    ones = strategy.run(lambda: np.ones(2, np.float32))
    out = strategy.extended.batch_reduce_to("SUM", [(ones, ones), (ones, "/cpu:0")])
    assert isinstance(out[0], pd.Mirrored)
    assert len(out[0].values) == 2  # one copy per destination, i.e. per replica
    np.testing.assert_array_equal(np.stack([np.asarray(out[0]), out[1]]), [[2, 2], [2, 2]])


def test_single_worker_keeps_mirrored_rules(tf_config: SetConfig) -> None:
    two = pd.MultiWorkerMirroredStrategy(backend=sim(gpus=2))
    with pytest.raises(ValueError, match="cannot be reduced with the given reduce op"):
        two.reduce("SUM", np.float32(1), axis=None)
    one = pd.MultiWorkerMirroredStrategy(backend=sim())
    assert float(one.reduce("SUM", np.float32(1), axis=None)) == 1.0


def test_local_only_per_replica_is_refused(tf_config: SetConfig) -> None:
    tf_config(TWO_WORKERS, "worker", 0)
    strategy = pd.MultiWorkerMirroredStrategy(backend=sim(gpus=2))
    local = strategy.experimental_local_results(strategy.run(lambda: np.float32(1)))
    with pytest.raises(ValueError, match=r"needs one component per replica of every worker \(4\)"):
        strategy.reduce("SUM", pd.PerReplica(local), axis=None)


def test_mismatched_collectives_raise_at_once(tf_config: SetConfig) -> None:
    # B28 on real engines: DeadlineExceeded after timeout_seconds. The sim never waits.
    tf_config(TWO_WORKERS, "worker", 0)
    options = CommunicationOptions(timeout_seconds=1)
    strategy = pd.MultiWorkerMirroredStrategy(communication_options=options, backend=sim(2))

    def only_first_worker() -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        if replica_id() < 2:
            return ctx.all_reduce("SUM", np.float32(1))
        return np.float32(0)

    with pytest.raises(pd.CollectiveMismatchError, match="task:1/device:GPU:0"):
        strategy.run(only_first_worker)


# -- cluster validation ------------------------------------------------------------------------


def test_cluster_without_task_is_refused(tf_config: SetConfig) -> None:
    tf_config(TWO_WORKERS)
    with pytest.raises(ValueError, match="you must also specify `task_type` and `task_id`"):
        pd.MultiWorkerMirroredStrategy(backend=sim())


@pytest.mark.parametrize(
    ("cluster", "task_type", "task_id", "match"),
    [
        (SEED_TF_CONFIG["cluster"], "ps", 0, "Unexpected `task_type` 'ps'"),
        ({"trainer": ["a:1"]}, "trainer", 0, "Disallowed task type found in cluster spec"),
        (TWO_WORKERS, "worker", 2, "exceeds the maximum id of worker"),
        (TWO_WORKERS, "chief", 0, "`task_type` 'chief' not found in cluster_spec"),
        ({"chief": ["a:1", "b:1"]}, "chief", 0, "at most one 'chief' job"),
    ],
)
def test_invalid_clusters(
    tf_config: SetConfig, cluster: dict[str, Any], task_type: str, task_id: int, match: str
) -> None:
    tf_config(cluster, task_type, task_id)
    with pytest.raises(ValueError, match=match):
        pd.MultiWorkerMirroredStrategy(backend=sim())


def test_sparse_worker_indices_are_refused(tf_config: SetConfig) -> None:
    tf_config({"worker": {"0": "a:1", "2": "b:1"}}, "worker", 0)
    with pytest.raises(ValueError, match=r"numbered 0..1"):
        pd.MultiWorkerMirroredStrategy(backend=sim())


def test_argument_types_are_checked() -> None:
    with pytest.raises(TypeError, match="cluster_resolver must be a"):
        pd.MultiWorkerMirroredStrategy({"worker": ["a:1"]}, backend=sim())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="communication_options must be a"):
        pd.MultiWorkerMirroredStrategy(None, "NCCL", backend=sim())  # type: ignore[arg-type]


def test_backend_without_multi_worker(tf_config: SetConfig) -> None:
    backend = sim()
    backend.capabilities = dataclasses.replace(backend.capabilities, multi_worker=False, tpu=False)
    tf_config(TWO_WORKERS, "worker", 0)
    with pytest.raises(ValueError, match="declares neither Capabilities.multi_worker"):
        pd.MultiWorkerMirroredStrategy(backend=backend)
    # A one-worker cluster needs no multi-worker support: this machine's devices.
    tf_config({"worker": ["a:1"]}, "worker", 0)
    strategy = pd.MultiWorkerMirroredStrategy(backend=backend)
    assert strategy.extended.worker_devices == ("/job:localhost/replica:0/task:0/device:CPU:0",)


def test_multi_worker_util_rules() -> None:
    cluster = {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "ps": ["p:1"], "evaluator": ["e:1"]}
    assert worker_count(cluster, "worker") == 3
    assert worker_count(cluster, "evaluator") == 1
    assert [id_in_cluster(cluster, "worker", i) for i in range(2)] == [1, 2]
    assert id_in_cluster(cluster, "chief", 0) == 0
    assert is_chief(cluster, "chief", 0)
    assert is_chief(cluster, "evaluator", 0)
    assert not is_chief(cluster, "worker", 0)
    assert is_chief(TWO_WORKERS, "worker", 0)
    assert not is_chief(TWO_WORKERS, "worker", 1)
    with pytest.raises(ValueError, match="There is no id for task_type 'ps'"):
        id_in_cluster(cluster, "ps", 0)


# -- cluster_resolver property (B22) -----------------------------------------------------------


def test_cluster_resolver_only_for_multi_worker_and_tpu(tf_config: SetConfig) -> None:
    tf_config(SEED_TF_CONFIG)
    assert pd.MirroredStrategy(2).cluster_resolver is None
    assert pd.OneDeviceStrategy("/cpu:0").cluster_resolver is None
    assert pd.get_strategy().cluster_resolver is None
    for strategy in (
        pd.MultiWorkerMirroredStrategy(backend=sim()),
        pd.TPUStrategy(TPUClusterResolver(tpu="v3-8")),
    ):
        resolver = strategy.cluster_resolver
        assert resolver is not None
        assert isinstance(resolver.cluster_spec(), ClusterSpec)
        assert isinstance(resolver.master(), str)
        assert isinstance(resolver.num_accelerators(), dict)
        assert resolver.task_type == "worker"
        assert resolver.task_id == 0


# -- options and the experimental names --------------------------------------------------------


def test_communication_options() -> None:
    default = CommunicationOptions()
    assert (default.bytes_per_pack, default.timeout_seconds) == (0, None)
    assert default.implementation is CommunicationImplementation.AUTO
    assert CollectiveCommunication is CommunicationImplementation
    assert CommunicationOptions(implementation="nccl").implementation is (
        CommunicationImplementation.NCCL
    )
    merged = CommunicationOptions(bytes_per_pack=8, implementation="RING").merge(
        CommunicationOptions(timeout_seconds=5)
    )
    assert merged == CommunicationOptions(8, 5, CommunicationImplementation.RING)
    hints = CollectiveHints(bytes_per_pack=4, timeout_seconds=2.5)
    assert isinstance(hints, CommunicationOptions)
    assert (hints.bytes_per_pack, hints.timeout_seconds) == (4, 2.5)
    with pytest.raises(ValueError, match="`bytes_per_pack` must be >=0"):
        CommunicationOptions(bytes_per_pack=-1)
    with pytest.raises(ValueError, match="`timeout_seconds` must be None or a number >= 0"):
        CommunicationOptions(timeout_seconds=-1)
    with pytest.raises(ValueError, match="`implementation` must be a CommunicationImplementation"):
        CommunicationOptions(implementation="gloo")


def test_experimental_multi_worker_mirrored_strategy(tf_config: SetConfig) -> None:
    strategy = pd.experimental.MultiWorkerMirroredStrategy(
        CollectiveCommunication.NCCL, backend=sim()
    )
    assert strategy.extended._communication_options.implementation is (
        CommunicationImplementation.NCCL
    )
    assert isinstance(strategy, pd.MultiWorkerMirroredStrategy)
    # As in TF, every MultiWorkerMirroredStrategy passes for the experimental class.
    assert isinstance(pd.MultiWorkerMirroredStrategy(backend=sim()), type(strategy))


def test_deepcopy(tf_config: SetConfig) -> None:
    tf_config(TWO_WORKERS, "worker", 1)
    strategy = pd.MultiWorkerMirroredStrategy(backend=sim(gpus=2))
    clone = copy.deepcopy(strategy)
    assert clone.extended.worker_devices == strategy.extended.worker_devices
    assert clone.extended.backend is strategy.extended.backend
    assert [int(v) for v in clone.run(replica_id).values] == [0, 1, 2, 3]


class _PackRecordingSim(SimBackend):
    """The sim, with a `batch_all_reduce` that records each nest's bytes_per_pack."""

    def __init__(self, replica_mode: Any = "greenlet") -> None:
        super().__init__("sequential", replica_mode=replica_mode)
        self.packs: list[int] = []

    def batch_all_reduce(self, columns: Any, destinations: Any, bytes_per_pack: int) -> Any:
        self.packs.append(bytes_per_pack)
        return [self.all_reduce(column, destinations) for column in columns]


@pytest.mark.parametrize("mode", ["greenlet", "thread"])
def test_a_calls_options_are_merged_over_the_strategys(mode: str) -> None:
    # TF merges a collective's options over the strategy's: a non-default value wins.
    backend = _PackRecordingSim(mode)
    options = CommunicationOptions(bytes_per_pack=8)
    strategy = pd.MultiWorkerMirroredStrategy(communication_options=options, backend=backend)
    nest = [np.ones(2, np.float32), np.arange(3, dtype=np.float32)]

    def step(call_options: Any) -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce("SUM", nest, options=call_options)

    for call in (None, CommunicationOptions(bytes_per_pack=32), CommunicationOptions()):
        total = strategy.run(step, (call,))
        assert [t.tolist() for t in total] == [[1.0, 1.0], [0.0, 1.0, 2.0]]
    assert backend.packs == [8, 32, 8]
    mirrored = pd.MirroredStrategy(2, backend=backend)
    mirrored.run(step, (CommunicationOptions(bytes_per_pack=16),))
    assert backend.packs[-1] == 16


def test_a_collectives_options_must_be_communication_options() -> None:
    strategy = pd.MirroredStrategy(2, backend=SimBackend())
    ctx_error = "options must be a polydist.experimental.CommunicationOptions or None, got dict"

    def bad() -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce("SUM", 1.0, options={"bytes_per_pack": 8})

    with pytest.raises(TypeError, match=ctx_error):
        strategy.run(bad)
    value = strategy.experimental_distribute_values_from_function(lambda c: np.float32(1))
    with pytest.raises(TypeError, match=ctx_error):
        strategy.extended.batch_reduce_to("SUM", [(value, "/cpu:0")], options={})
    with pytest.raises(TypeError, match=ctx_error):
        strategy.extended.reduce_to("SUM", value, "/cpu:0", options={})
