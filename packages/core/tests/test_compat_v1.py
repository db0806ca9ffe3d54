"""``polydist.compat.v1``: the TF 1 strategies of seeds 001 (Mirrored) and 003 (TPUStrategy).

One test per member of each seed's list, with exact values, plus the seeds'
code examples (``make_input_fn_iterator``, ``experimental_make_numpy_dataset``,
the ``TF_CONFIG`` example of ``cluster_resolver``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import polydist as pd
import polydist.compat.v1 as v1
from polydist.cluster_resolver import (
    TFConfigClusterResolver,
    TPUClusterResolver,
    set_accelerator_device_lister,
)
from polydist.data import AutoShardPolicy, Dataset, InputContext, Options
from polydist.errors import OutOfRangeError
from polydist_sim import SimBackend

GPUS = ["/gpu:0", "/gpu:1"]
GPU0 = "/job:localhost/replica:0/task:0/device:GPU:0"
GPU1 = "/job:localhost/replica:0/task:0/device:GPU:1"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("TF_CONFIG", "TPU_NAME", "KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS", "POLYDIST_LOCAL_TPU"):
        monkeypatch.delenv(name, raising=False)
    # Simulated clusters install the sim's device lister: put the old one back.
    previous = set_accelerator_device_lister(None)
    set_accelerator_device_lister(previous)
    yield
    set_accelerator_device_lister(previous)


def mirrored() -> v1.MirroredStrategy:
    return v1.MirroredStrategy(GPUS)


def tpu(name: str = "v2-8", **kwargs: Any) -> v1.TPUStrategy:
    return v1.TPUStrategy(TPUClusterResolver(tpu=name), **kwargs)


def replica_id() -> int:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return int(ctx.replica_id_in_sync_group)


def floats(value: Any) -> list[Any]:
    return [np.asarray(v).tolist() for v in value.values]


def data_sharded(dataset: Dataset) -> Dataset:
    """DATA sharding: what AUTO falls back to for in-memory sources, without the warning."""
    options = Options()
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
    return dataset.with_options(options)


def batches(n: int, batch: int) -> Dataset:
    return data_sharded(Dataset.from_tensor_slices(np.arange(n, dtype=np.float32)).batch(batch))


# -- names --------------------------------------------------------------------------------------


def test_tf_module_paths() -> None:
    assert v1.distribute.MirroredStrategy is v1.MirroredStrategy
    assert v1.distribute.OneDeviceStrategy is v1.OneDeviceStrategy
    assert v1.distribute.experimental.TPUStrategy is v1.TPUStrategy
    assert v1.distribute.experimental.MultiWorkerMirroredStrategy is v1.MultiWorkerMirroredStrategy
    assert v1.distribute.Strategy is v1.Strategy
    assert v1.distribute.StrategyExtended is v1.StrategyExtended
    assert v1.distribute.ReplicaContext is pd.ReplicaContext
    assert v1.distribute.get_strategy is pd.get_strategy
    assert v1.distribute.InputReplicationMode is pd.InputReplicationMode
    assert pd.compat.v1 is v1
    # TF's class names, and the v1 classes are the v2 ones plus the v1 members.
    assert v1.MirroredStrategy.__name__ == "MirroredStrategyV1"
    assert v1.TPUStrategy.__name__ == "TPUStrategyV1"
    s = mirrored()
    assert isinstance(s, pd.MirroredStrategy) and isinstance(s, v1.Strategy)
    assert isinstance(s.extended, v1.StrategyExtended)
    assert isinstance(tpu(), pd.TPUStrategy) and isinstance(tpu().extended, pd.StrategyExtended)


# -- seed 001: compat.v1 MirroredStrategy ---------------------------------------------------------


class TestMirroredStrategyV1:
    def test_init(self) -> None:
        s = v1.MirroredStrategy(devices=GPUS, cross_device_ops=pd.ReductionToOneDevice())
        assert s.extended.worker_devices == (GPU0, GPU1)
        with pytest.raises(ValueError, match="No duplicates allowed"):
            v1.MirroredStrategy(["/gpu:0", "/gpu:0"])

    def test_extended(self) -> None:
        ext = mirrored().extended
        assert isinstance(ext, v1.StrategyExtended)
        assert ext.parameter_devices == (GPU0, GPU1)
        assert ext.steps_per_run == 1

    def test_num_replicas_in_sync(self) -> None:
        assert mirrored().num_replicas_in_sync == 2
        assert v1.MirroredStrategy(["/cpu:0"]).num_replicas_in_sync == 1

    def test_experimental_distribute_dataset(self) -> None:
        s = mirrored()
        dist = s.experimental_distribute_dataset(batches(8, 4))
        steps = [floats(x) for x in dist]
        assert steps == [[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0], [6.0, 7.0]]]
        for x in s.experimental_distribute_dataset(batches(4, 4)):
            out = s.experimental_run_v2(lambda b: b * 2, args=(x,))
            assert floats(out) == [[0.0, 2.0], [4.0, 6.0]]

    def test_experimental_distribute_datasets_from_function(self) -> None:
        s = mirrored()
        contexts: list[InputContext] = []

        def dataset_fn(ctx: InputContext) -> Dataset:
            contexts.append(ctx)
            batch = ctx.get_per_replica_batch_size(4)
            return Dataset.from_tensors([[1.0]]).repeat().batch(batch)

        inputs = s.experimental_distribute_datasets_from_function(dataset_fn)
        assert [
            (c.num_input_pipelines, c.input_pipeline_id, c.num_replicas_in_sync) for c in contexts
        ] == [(1, 0, 2)]
        first = next(iter(inputs))
        assert [np.shape(v) for v in first.values] == [(2, 1, 1), (2, 1, 1)]

    def test_experimental_local_results(self) -> None:
        s = mirrored()
        out = s.experimental_run_v2(lambda: replica_id() + 10)
        assert s.experimental_local_results(out) == (10, 11)
        assert s.experimental_local_results(5) == (5,)

    def test_experimental_make_numpy_dataset(self) -> None:
        # Seed 001's example.
        s = mirrored()
        numpy_input = np.ones([10], dtype=np.float32)
        dataset = s.experimental_make_numpy_dataset(numpy_input)
        assert isinstance(dataset, Dataset)
        assert [float(x) for x in dataset.as_numpy_iterator()] == [1.0] * 10
        dist_dataset = s.experimental_distribute_dataset(dataset.batch(4, drop_remainder=True))
        assert [floats(x) for x in dist_dataset] == [[[1.0, 1.0], [1.0, 1.0]]] * 2
        # ``session`` is a TF 1 graph-mode argument: accepted, unused.
        with_session = s.experimental_make_numpy_dataset({"x": np.arange(3)}, session=object())
        assert [int(e["x"]) for e in with_session.as_numpy_iterator()] == [0, 1, 2]

    def test_experimental_run(self) -> None:
        s = mirrored()
        iterator = s.make_dataset_iterator(batches(4, 4))
        out = s.experimental_run(lambda x: x + replica_id(), iterator)
        assert floats(out) == [[0.0, 1.0], [3.0, 4.0]]
        # Without an iterator, fn takes no arguments.
        assert s.experimental_run(replica_id).values == (0, 1)

    def test_experimental_run_v2(self) -> None:
        s = mirrored()
        out = s.experimental_run_v2(
            lambda a, b=0: a * (replica_id() + 1) + b, args=(2,), kwargs={"b": 1}
        )
        assert out.values == (3, 5)
        with pytest.raises(ValueError, match="must be a list or tuple"):
            s.experimental_run_v2(lambda a: a, args=2)  # type: ignore[arg-type]

    def test_make_dataset_iterator(self) -> None:
        s = mirrored()
        with s.scope():
            iterator = s.make_dataset_iterator(batches(8, 4))
            assert iterator.initialize() == []
            assert floats(iterator.get_next()) == [[0.0, 1.0], [2.0, 3.0]]
            assert floats(iterator.get_next()) == [[4.0, 5.0], [6.0, 7.0]]
            with pytest.raises(OutOfRangeError):
                iterator.get_next()
            # initialize() starts over (TF eager re-creates the iterator); so does .initializer.
            assert iterator.initialize() == []
            assert floats(iterator.get_next()) == [[0.0, 1.0], [2.0, 3.0]]
            assert iterator.initializer == []
            assert [floats(x) for x in iterator] == [
                [[0.0, 1.0], [2.0, 3.0]],
                [[4.0, 5.0], [6.0, 7.0]],
            ]

    def test_make_input_fn_iterator(self) -> None:
        # Seed 001's example, verbatim but for the names.
        strategy = mirrored()
        global_batch_size = 4
        contexts: list[InputContext] = []

        def input_fn(input_context: InputContext) -> Dataset:
            contexts.append(input_context)
            batch_size = input_context.get_per_replica_batch_size(global_batch_size)
            d = Dataset.from_tensors([[1.0]]).repeat().batch(batch_size)
            return d.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)

        def replica_fn(x: Any) -> Any:
            return x * (replica_id() + 1)

        with strategy.scope():
            iterator = strategy.make_input_fn_iterator(input_fn)
            replica_results = strategy.experimental_run(replica_fn, iterator)
        # input_fn is called once per worker, with TF's InputContext.
        assert [
            (c.num_input_pipelines, c.input_pipeline_id, c.num_replicas_in_sync) for c in contexts
        ] == [(1, 0, 2)]
        assert floats(replica_results) == [[[[1.0]], [[1.0]]], [[[2.0]], [[2.0]]]]
        assert float(strategy.reduce("SUM", replica_results, axis=0).sum()) == 6.0
        # The iterator's values can also go to extended.call_for_each_replica.
        with strategy.scope():
            assert iterator.initialize() == []
            out = strategy.extended.call_for_each_replica(
                lambda x: x.shape, args=(iterator.get_next(),)
            )
        assert out == (2, 1, 1)
        with pytest.raises(ValueError, match="Input replication mode not supported"):
            strategy.make_input_fn_iterator(input_fn, pd.InputReplicationMode.PER_REPLICA)

    def test_reduce(self) -> None:
        s = mirrored()
        per_replica = s.experimental_run_v2(lambda: np.arange(4.0).reshape(2, 2)[replica_id()])
        # v1: axis defaults to None (across replicas only).
        assert np.asarray(s.reduce(pd.ReduceOp.SUM, per_replica)).tolist() == [2.0, 4.0]
        assert np.asarray(s.reduce("MEAN", per_replica)).tolist() == [1.0, 2.0]
        assert float(s.reduce("SUM", per_replica, axis=0)) == 6.0
        assert float(s.reduce("MEAN", per_replica, axis=0)) == 1.5

    def test_scope(self) -> None:
        s = mirrored()
        assert not pd.in_cross_replica_context()
        with s.scope() as entered:
            assert entered is s
            assert pd.get_strategy() is s and pd.in_cross_replica_context()
            v = pd.Variable(1.0)
        assert isinstance(v, pd.MirroredVariable)
        assert [c.device for c in v.values] == [GPU0, GPU1]

    def test_update_config_proto(self) -> None:
        s = mirrored()
        config = {"allow_soft_placement": True, "graph_options": {"build_cost_model": 1}}
        updated = s.update_config_proto(config)
        # TF's MirroredExtended sets isolate_session_state on a copy.
        assert updated == {
            "allow_soft_placement": True,
            "graph_options": {"build_cost_model": 1},
            "isolate_session_state": True,
        }
        assert config == {"allow_soft_placement": True, "graph_options": {"build_cost_model": 1}}
        updated["graph_options"]["build_cost_model"] = 2
        assert config["graph_options"]["build_cost_model"] == 1  # a deep copy
        with pytest.raises(TypeError, match="a dict of ConfigProto fields"):
            s.update_config_proto("allow_soft_placement: true")


# -- the other v1 members (TF's StrategyV1 / StrategyExtendedV1) -----------------------------------


class TestV1Members:
    def test_steps_per_run(self) -> None:
        assert mirrored().steps_per_run == 1
        assert v1.OneDeviceStrategy("/gpu:0").extended.steps_per_run == 1

    def test_unwrap(self) -> None:
        s = mirrored()
        assert s.unwrap(s.experimental_run_v2(replica_id)) == (0, 1)
        assert s.unwrap(3.0) == (3.0,)

    def test_colocate_vars_with(self) -> None:
        s = v1.MirroredStrategy(["/gpu:2", "/gpu:3"])
        with s.scope():
            v = pd.Variable(1.0)
            with s.colocate_vars_with(v):
                slot = pd.Variable(0.0)
        assert [c.device for c in slot.values] == [c.device for c in v.values]

    def test_group(self) -> None:
        s = mirrored()
        one = v1.OneDeviceStrategy("/gpu:0")
        assert one.group(np.float32(2.0)) == 2.0  # TF's special case: one value, no name
        assert one.group(np.float32(2.0), name="g") is None  # tf.group in eager: None
        assert s.group(s.experimental_run_v2(replica_id)) is None

    def test_configure(self) -> None:
        s = mirrored()
        config: dict[str, Any] = {"log_device_placement": False}
        assert s.configure(session_config=config) is None
        assert config == {"log_device_placement": False, "isolate_session_state": True}
        with pytest.raises(NotImplementedError, match="MultiWorkerMirroredStrategy"):
            s.configure(cluster_spec={"worker": ["a:1", "b:2"]}, task_type="worker", task_id=0)
        one = v1.OneDeviceStrategy("/gpu:0")
        config = {"a": 1}
        one.configure(config, cluster_spec={"worker": ["a:1"]}, task_type="worker", task_id=0)
        assert config == {"a": 1}  # TF's default: nothing to configure

    def test_extended_call_for_each_replica(self) -> None:
        s = mirrored()
        out = s.extended.call_for_each_replica(
            lambda a, b: a + b + replica_id(), args=(1,), kwargs={"b": 2}
        )
        assert out.values == (3, 4)

    def test_extended_experimental_make_numpy_dataset(self) -> None:
        s = mirrored()
        ds = s.extended.experimental_make_numpy_dataset((np.arange(3), np.arange(3) * 2))
        assert [tuple(int(x) for x in e) for e in ds.as_numpy_iterator()] == [
            (0, 0),
            (1, 2),
            (2, 4),
        ]

    def test_extended_experimental_run_steps_on_iterator(self) -> None:
        s = mirrored()
        seen: list[Any] = []

        def step_fn(ctx: v1.MultiStepContext, inputs: Any) -> None:
            seen.append(floats(inputs))
            per_replica = s.extended.call_for_each_replica(lambda x: x.sum(), args=(inputs,))
            ctx.set_last_step_output("sum", per_replica, reduce_op=pd.ReduceOp.SUM)
            ctx.set_last_step_output("raw", per_replica)  # not reduced: the PerReplica
            ctx.set_non_tensor_output("step", len(seen))

            def replica_fn(x: Any) -> None:
                ctx.set_last_step_output("mean", x.sum(), reduce_op="MEAN")  # replica context
                ctx.set_non_tensor_output("replica", replica_id())

            s.extended.call_for_each_replica(replica_fn, args=(inputs,))

        with s.scope():
            iterator = s.make_dataset_iterator(batches(12, 4))
            ctx = s.extended.experimental_run_steps_on_iterator(
                step_fn, iterator, iterations=2, initial_loop_values={"sum": 0.0}
            )
        assert seen == [[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0], [6.0, 7.0]]]
        assert float(ctx.last_step_outputs["sum"]) == 22.0  # the last step's: 9 + 13
        assert float(ctx.last_step_outputs["mean"]) == 11.0
        assert floats(ctx.last_step_outputs["raw"]) == [9.0, 13.0]
        assert ctx.non_tensor_outputs == {"step": 2, "replica": (0, 1)}
        assert ctx.run_op is None  # the steps have run already (TF eager)
        assert ctx.initial_loop_values == {"sum": 0.0}
        assert floats(iterator.get_next()) == [[8.0, 9.0], [10.0, 11.0]]  # the loop read 2 steps

        def no_op(ctx: Any, inputs: Any) -> None:
            s.extended.call_for_each_replica(lambda: ctx.set_last_step_output("x", 1.0))

        with pytest.raises(ValueError, match="without a reduction: pass reduce_op"):
            s.extended.experimental_run_steps_on_iterator(
                no_op, s.make_dataset_iterator(batches(4, 4))
            )
        with pytest.raises(OutOfRangeError):
            s.extended.experimental_run_steps_on_iterator(
                lambda ctx, x: None, s.make_dataset_iterator(batches(4, 4)), iterations=2
            )
        with pytest.raises(TypeError, match="must have a get_next"):
            s.extended.experimental_run_steps_on_iterator(lambda ctx, x: None, [1, 2])
        with pytest.raises(ValueError, match="iterations must be an int >= 0"):
            s.extended.experimental_run_steps_on_iterator(
                lambda ctx, x: None, iterator, iterations=-1
            )

    def test_extended_v1_members_need_cross_replica_context(self) -> None:
        s = mirrored()

        def fn() -> None:
            s.extended.experimental_make_numpy_dataset(np.arange(2))

        with pytest.raises(RuntimeError, match="requires being in cross-replica context"):
            s.experimental_run_v2(fn)

    def test_one_device(self) -> None:
        s = v1.OneDeviceStrategy("/gpu:1")
        assert s.num_replicas_in_sync == 1
        with s.scope():
            iterator = s.make_dataset_iterator(batches(4, 2))
        assert np.asarray(s.experimental_run(lambda x: x * 2, iterator)).tolist() == [0.0, 2.0]
        assert s.update_config_proto({"a": {"b": 1}}) == {"a": {"b": 1}}  # TF's default: a copy

    def test_default_strategy_is_v2(self) -> None:
        # tf.compat.v1.distribute.get_strategy() outside a scope: the default strategy,
        # which has the v2 API only in polydist.
        assert v1.get_strategy() is pd.get_strategy()
        assert not isinstance(v1.get_strategy(), v1.Strategy)


# -- seed 003: compat.v1 TPUStrategy ---------------------------------------------------------------


class TestTPUStrategyV1:
    def test_init(self) -> None:
        s = tpu("v3-8", steps_per_run=100)
        assert s.num_replicas_in_sync == 8
        assert s.extended.steps_per_run == 100
        assert tpu().extended.steps_per_run == 1  # TF: None means 1
        with pytest.raises(ValueError, match="steps_per_run must be an int >= 1"):
            tpu(steps_per_run=0)
        topology = TPUClusterResolver(tpu="v3-8").get_tpu_system_metadata().topology
        assert topology is not None
        assignment = pd.tpu.DeviceAssignment.build(topology, num_replicas=1)
        single = tpu("v3-8", device_assignment=assignment)
        assert single.num_replicas_in_sync == 1
        assert single.extended.worker_devices == ("/job:worker/replica:0/task:0/device:TPU:0",)

    def test_default_resolver(self) -> None:
        s = v1.TPUStrategy()  # no TPU_NAME: the local simulated slice (v3-8)
        assert s.num_replicas_in_sync == 8
        assert s.cluster_resolver.get_master() == ""

    def test_cluster_resolver(self) -> None:
        resolver = TPUClusterResolver(tpu="v3-32")
        s = v1.TPUStrategy(resolver)
        assert s.cluster_resolver is resolver
        assert s.cluster_resolver.task_type == "worker"
        assert v1.MirroredStrategy(GPUS).cluster_resolver is None

    def test_extended(self) -> None:
        ext = tpu("v3-32").extended
        assert isinstance(ext, v1.StrategyExtended) and isinstance(ext, pd.StrategyExtended)
        assert ext.num_hosts == 4 and ext.num_replicas_per_host == 8
        assert ext.experimental_require_static_shapes is True

    def test_num_replicas_in_sync(self) -> None:
        assert tpu("v2-8").num_replicas_in_sync == 8
        assert tpu("v3-32").num_replicas_in_sync == 32

    def test_steps_per_run(self) -> None:
        s = tpu(steps_per_run=5)
        assert s.steps_per_run == 5 == s.extended.steps_per_run

    def test_distribute_datasets_from_function(self) -> None:
        s = tpu("v2-8")

        def dataset_fn(ctx: InputContext) -> Dataset:
            assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (
                1,
                0,
                8,
            )
            return batches(16, 2)

        first = next(iter(s.distribute_datasets_from_function(dataset_fn)))
        assert floats(first) == [[2.0 * r, 2.0 * r + 1] for r in range(8)]

    def test_experimental_distribute_dataset(self) -> None:
        s = tpu("v2-8")
        first = next(iter(s.experimental_distribute_dataset(batches(16, 16))))
        assert floats(first) == [[2.0 * r, 2.0 * r + 1] for r in range(8)]

    def test_experimental_distribute_values_from_function(self) -> None:
        s = tpu("v2-8")
        values = s.experimental_distribute_values_from_function(
            lambda ctx: np.float32(ctx.replica_id_in_sync_group)
        )
        assert floats(values) == [float(r) for r in range(8)]

    def test_experimental_local_results(self) -> None:
        s = tpu("v2-8")
        assert s.experimental_local_results(s.run(replica_id)) == tuple(range(8))

    def test_experimental_make_numpy_dataset(self) -> None:
        ds = tpu().experimental_make_numpy_dataset(np.arange(4, dtype=np.int32))
        assert [int(x) for x in ds.as_numpy_iterator()] == [0, 1, 2, 3]

    def test_experimental_run(self) -> None:
        s = tpu("v2-8")
        with s.scope():
            iterator = s.make_dataset_iterator(batches(16, 16))
        out = s.experimental_run(lambda x: x.sum(), iterator)
        assert floats(out) == [4.0 * r + 1 for r in range(8)]

    def test_experimental_run_v2_and_run(self) -> None:
        s = tpu("v2-8")

        def fn() -> Any:
            ctx = pd.get_replica_context()
            assert ctx is not None
            return ctx.all_reduce("SUM", np.float32(1.0))

        assert floats(s.experimental_run_v2(fn)) == [8.0] * 8
        assert floats(s.run(fn)) == [8.0] * 8

    def test_make_dataset_iterator(self) -> None:
        s = tpu("v2-8")
        iterator = s.make_dataset_iterator(batches(32, 16))
        assert iterator.initialize() == []
        assert floats(iterator.get_next())[0] == [0.0, 1.0]
        assert floats(iterator.get_next())[0] == [16.0, 17.0]

    def test_make_input_fn_iterator(self) -> None:
        s = tpu("v2-8")

        def input_fn(ctx: InputContext) -> Dataset:
            return (
                Dataset.from_tensors(np.float32(ctx.input_pipeline_id))
                .repeat()
                .batch(ctx.get_per_replica_batch_size(16))
            )

        with s.scope():
            iterator = s.make_input_fn_iterator(input_fn)
            out = s.experimental_run(lambda x: x.shape, iterator)
        assert out == (2,)

    def test_reduce(self) -> None:
        s = tpu("v2-8")
        per_replica = s.run(lambda: np.float32(replica_id()))
        assert float(s.reduce("SUM", per_replica)) == 28.0  # axis=None by default
        assert float(s.reduce("MEAN", per_replica, axis=None)) == 3.5

    def test_scope(self) -> None:
        s = tpu("v2-8")
        with s.scope():
            assert pd.get_strategy() is s
            v = pd.Variable(0.0)
        assert len(v.values) == 8

    def test_update_config_proto(self) -> None:
        # A remote slice: TF sets isolate_session_state and the slice's cluster_def.
        updated = tpu("v3-32").update_config_proto({"allow_soft_placement": True})
        assert updated == {
            "allow_soft_placement": True,
            "isolate_session_state": True,
            "cluster_def": {
                "job": [
                    {
                        "name": "worker",
                        "tasks": {i: f"v3-32-w-{i}:8470" for i in range(4)},
                    }
                ]
            },
        }
        # The local slice has no cluster spec: no cluster_def.
        assert v1.TPUStrategy().update_config_proto({}) == {"isolate_session_state": True}

    def test_configure(self) -> None:
        config: dict[str, Any] = {}
        s = v1.TPUStrategy()
        s.configure(config, cluster_spec={"worker": ["x:1"]}, task_type="worker", task_id=0)
        assert config == {"isolate_session_state": True}  # TF ignores the cluster arguments

    def test_experimental_run_steps_on_iterator(self) -> None:
        s = tpu("v2-8", steps_per_run=2)

        def step_fn(ctx: v1.MultiStepContext, inputs: Any) -> None:
            out = s.extended.call_for_each_replica(lambda x: x.sum(), args=(inputs,))
            ctx.set_last_step_output("loss", out, reduce_op="SUM")

        with s.scope():
            iterator = s.make_dataset_iterator(batches(32, 16))
            ctx = s.extended.experimental_run_steps_on_iterator(step_fn, iterator, iterations=2)
        assert float(ctx.last_step_outputs["loss"]) == float(np.arange(16, 32).sum())

    def test_model_parallel_members(self) -> None:
        s = tpu("v2-8")
        x = np.zeros(2)
        assert s.experimental_replicate_to_logical_devices(x) is x


# -- seed 003: the TF_CONFIG example of cluster_resolver, through compat.v1 -----------------------


def test_tf_config_example(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "TF_CONFIG",
        json.dumps(
            {
                "cluster": {
                    "worker": ["localhost:12345", "localhost:23456"],
                    "ps": ["localhost:34567"],
                },
                "task": {"type": "worker", "index": 0},
            }
        ),
    )
    # This implicitly uses TF_CONFIG for the cluster and current task info.
    strategy = v1.distribute.experimental.MultiWorkerMirroredStrategy(backend=SimBackend())
    assert isinstance(strategy.cluster_resolver, TFConfigClusterResolver)
    ran = []
    if strategy.cluster_resolver.task_type == "worker":
        ran.append("worker")
    elif strategy.cluster_resolver.task_type == "ps":
        ran.append("ps")
    assert ran == ["worker"]
    assert strategy.cluster_resolver.task_id == 0
    assert strategy.num_replicas_in_sync == 2  # the ps task runs no replica
    assert isinstance(strategy, pd.MultiWorkerMirroredStrategy)
    assert isinstance(strategy, pd.experimental.MultiWorkerMirroredStrategy)
    # The v1 members, on the multi-worker strategy.
    updated = strategy.update_config_proto({})
    assert updated == {
        "graph_options": {
            "rewrite_options": {
                "scoped_allocator_optimization": "ON",
                "scoped_allocator_opts": {"enable_op": ["CollectiveReduce"]},
            }
        },
        "experimental": {"collective_group_leader": "/job:worker/replica:0/task:0"},
        "device_filters": ["/job:worker/task:0"],
    }
    # configure() with the strategy's own cluster updates the session config in place.
    config: dict[str, Any] = {}
    cluster = {"worker": ["localhost:12345", "localhost:23456"], "ps": ["localhost:34567"]}
    strategy.configure(config, cluster_spec=cluster, task_type="worker", task_id=0)
    assert config == updated
    with strategy.scope():
        iterator = strategy.make_dataset_iterator(batches(4, 4))
    out = strategy.experimental_run(lambda x: x.sum(), iterator)
    assert floats(out) == [1.0, 5.0]  # both simulated workers' replicas


def test_multi_worker_v1_without_cluster() -> None:
    s = v1.MultiWorkerMirroredStrategy(
        pd.experimental.CommunicationImplementation.NCCL, backend=SimBackend(num_gpus=2)
    )
    assert s.num_replicas_in_sync == 2
    assert s.update_config_proto({}) == {
        "graph_options": {
            "rewrite_options": {
                "scoped_allocator_optimization": "ON",
                "scoped_allocator_opts": {"enable_op": ["CollectiveReduce"]},
            }
        },
        "experimental": {"collective_nccl": True},
    }
    with pytest.raises(NotImplementedError, match="another cluster"):
        s.configure(cluster_spec={"worker": ["a:1", "b:1"]}, task_type="worker", task_id=0)
