"""``polydist.contrib.distribute``: the tower-era API of seed 004 (``tf.contrib``'s TPUStrategy).

One test per member of seed 004's list, on the seed's ``TPUStrategy`` and on
the tower-era ``MirroredStrategy`` / ``OneDeviceStrategy``, plus the seed's
code examples (``call_for_each_tower`` with ``merge_call``,
``distribute_dataset``, ``worker_device_index``, ``colocate_vars_with``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist.cluster_resolver import TPUClusterResolver
from polydist.contrib import distribute
from polydist.data import Dataset
from polydist.errors import OutOfRangeError

VA = pd.VariableAggregation
GPU0 = "/job:localhost/replica:0/task:0/device:GPU:0"
GPU1 = "/job:localhost/replica:0/task:0/device:GPU:1"
CPU0 = "/job:localhost/replica:0/task:0/device:CPU:0"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TPU_NAME", "KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS", "POLYDIST_LOCAL_TPU"):
        monkeypatch.delenv(name, raising=False)


def mirrored() -> distribute.MirroredStrategy:
    return distribute.MirroredStrategy(["/gpu:0", "/gpu:1"])


def tpu(num_cores: int | None = 2, name: str = "v2-8", steps: int = 1) -> distribute.TPUStrategy:
    return distribute.TPUStrategy(TPUClusterResolver(tpu=name), steps, num_cores=num_cores)


def tower_id() -> int:
    ctx = distribute.get_tower_context()
    assert ctx is not None
    return ctx.tower_id


def floats(value: Any) -> list[Any]:
    return [np.asarray(v).tolist() for v in value.values]


def var(strategy: pd.Strategy, value: Any = 0.0, **kwargs: Any) -> Any:
    with strategy.scope():
        return pd.Variable(value, **kwargs)


# -- names and the seed's examples -----------------------------------------------------------------


def test_names() -> None:
    assert pd.contrib.distribute is distribute
    for cls in (distribute.MirroredStrategy, distribute.OneDeviceStrategy, distribute.TPUStrategy):
        assert issubclass(cls, distribute.DistributionStrategy)
        assert issubclass(cls, pd.compat.v1.Strategy) and issubclass(cls, pd.Strategy)
    assert isinstance(tpu(), pd.TPUStrategy)
    assert isinstance(mirrored(), pd.MirroredStrategy)


@pytest.mark.parametrize("make", [mirrored, tpu], ids=["mirrored", "tpu"])
def test_seed_call_for_each_tower_example(make: Any) -> None:
    distribution = make()

    # Called once in "cross-tower" context.
    def merge_fn(distribution: Any, three_plus_tower_id: Any) -> Any:
        # sum the values across towers
        return sum(distribution.unwrap(three_plus_tower_id))

    # Called once per tower in `distribution`, in a "tower" context.
    def fn(three: int) -> Any:
        tower_ctx = distribute.get_tower_context()
        assert tower_ctx is not None
        v = three + tower_ctx.tower_id
        # Computes the sum of the `v` values across all towers.
        s = tower_ctx.merge_call(merge_fn, v)
        return s + v

    with distribution.scope():
        # in "cross-tower" context
        assert distribute.get_tower_context() is None
        merged_results = distribution.call_for_each_tower(fn, 3)
        # merged_results has the values from every tower execution of `fn`.
        assert distribution.unwrap(merged_results) == [10, 11]  # 3+4 = 7, plus 3 and 4


def test_tower_context() -> None:
    distribution = mirrored()
    seen: list[tuple[int, int, bool, str, Any]] = []

    def fn(x: Any) -> Any:
        ctx = distribute.get_tower_context()
        assert ctx is not None
        distribute.require_tower_context(ctx)
        seen.append((ctx.tower_id, ctx.num_towers, ctx.is_single_tower, ctx.device, x))
        assert ctx.distribution_strategy is distribution
        assert distribute.get_distribution_strategy() is distribution
        assert distribute.get_cross_tower_context() is None
        return ctx.merge_call(lambda d, *a, **k: (a, k), x, key=x)

    out = distribution.call_for_each_tower(fn, pd.PerReplica(("a", "b")), run_concurrently=False)
    assert sorted(seen) == [(0, 2, False, GPU0, "a"), (1, 2, False, GPU1, "b")]
    args, kwargs = out
    assert args[0].values == ("a", "b") and kwargs["key"].values == ("a", "b")
    # The default tower context: one tower, merge_fn gets the default strategy.
    default = distribute.get_tower_context()
    assert default is not None and default.tower_id == 0 and default.num_towers == 1
    assert default.device == CPU0
    assert default.merge_call(lambda d, v: (d, v), 5) == (pd.get_strategy(), 5)
    assert not distribute.has_distribution_strategy()
    with distribution.scope():
        assert distribute.has_distribution_strategy()
        assert distribute.get_cross_tower_context() is distribution
        with pytest.raises(RuntimeError, match="Need to be inside `call_for_each_replica"):
            default.merge_call(lambda d: None)
    # TF's constructor: a single tower context entered by hand.
    with distribute.TowerContext(distribution, tower_id=1) as ctx:
        assert distribute.get_tower_context() is not None
        assert ctx.tower_id == 1 and ctx.device == GPU1


# -- seed 004's properties -------------------------------------------------------------------------


class TestProperties:
    def test_between_graph(self) -> None:
        assert tpu().between_graph is False
        assert mirrored().between_graph is False

    def test_is_single_tower(self) -> None:
        assert tpu(num_cores=2).is_single_tower is False
        assert tpu(num_cores=1).is_single_tower is True
        assert distribute.OneDeviceStrategy("/gpu:0").is_single_tower is True

    def test_num_hosts(self) -> None:
        assert tpu().num_hosts == 1
        assert tpu(None, "v3-32").num_hosts == 4

    def test_num_towers(self) -> None:
        assert tpu(num_cores=None).num_towers == 8
        assert tpu(num_cores=2).num_towers == 2
        assert mirrored().num_towers == 2

    def test_num_towers_per_host(self) -> None:
        assert tpu().num_towers_per_host == 8  # the cores of a host, as TF's metadata
        assert tpu(None, "v3-32").num_towers_per_host == 8

    def test_parameter_devices(self) -> None:
        assert tpu().parameter_devices == [
            "/job:worker/replica:0/task:0/device:TPU:0",
            "/job:worker/replica:0/task:0/device:TPU:1",
        ]
        assert mirrored().parameter_devices == [GPU0, GPU1]

    def test_should_checkpoint(self) -> None:
        assert tpu().should_checkpoint is True
        assert mirrored().should_checkpoint is True

    def test_should_init(self) -> None:
        assert tpu().should_init is True
        assert mirrored().should_init is True

    def test_should_save_summary(self) -> None:
        assert tpu().should_save_summary is True
        assert mirrored().should_save_summary is True

    def test_worker_device_index(self) -> None:
        # The seed's example: fn gets its tower's index into worker_devices.
        distribution = tpu()
        with distribution.scope():

            def fn(device_id: int) -> str:
                assert isinstance(device_id, int)
                return distribution.worker_devices[device_id]

            out = distribution.call_for_each_tower(fn, distribution.worker_device_index)
        assert distribution.unwrap(out) == distribution.worker_devices
        assert distribute.OneDeviceStrategy("/gpu:0").worker_device_index == 0
        with pytest.raises(RuntimeError, match="requires being in cross-replica context"):
            distribution.call_for_each_tower(lambda: distribution.worker_device_index)

    def test_worker_devices(self) -> None:
        assert tpu(num_cores=None).worker_devices == [
            f"/job:worker/replica:0/task:0/device:TPU:{i}" for i in range(8)
        ]
        assert mirrored().worker_devices == [GPU0, GPU1]
        assert distribute.OneDeviceStrategy("/gpu:1").worker_devices == [GPU1]


# -- seed 004's methods ----------------------------------------------------------------------------


class TestMethods:
    def test_init(self) -> None:
        s = distribute.TPUStrategy(TPUClusterResolver(tpu="v2-8"), steps_per_run=10)
        assert s.num_towers == 8 and s.steps_per_run == 10 and s.extended.steps_per_run == 10
        assert distribute.TPUStrategy().num_towers == 8  # the local slice, v3-8
        with pytest.raises(ValueError, match="num_cores=9 but the slice has 8 TPU cores"):
            tpu(num_cores=9)
        # The tower-era MirroredStrategy arguments.
        assert distribute.MirroredStrategy(num_gpus=3).worker_devices == [
            f"/job:localhost/replica:0/task:0/device:GPU:{i}" for i in range(3)
        ]
        assert distribute.MirroredStrategy(num_gpus=0).worker_devices == [CPU0]
        assert distribute.MirroredStrategy(num_gpus_per_worker=2).num_towers == 2
        ops = pd.ReductionToOneDevice()
        assert (
            distribute.MirroredStrategy(num_gpus=2, cross_tower_ops=ops).extended._cross_device_ops
            is ops
        )
        with pytest.raises(ValueError, match="Must only specify one of `devices` and `num_gpus`"):
            distribute.MirroredStrategy(["/gpu:0"], num_gpus=1)
        with pytest.raises(ValueError, match="not both"):
            distribute.MirroredStrategy(cross_tower_ops=ops, cross_device_ops=ops)

    def test_batch_reduce(self) -> None:
        s = tpu()
        per_tower = s.call_for_each_tower(lambda: np.float32(tower_id() + 1))
        v = var(s)
        with s.scope():
            total, on_var = s.batch_reduce(VA.SUM, [(per_tower, "/cpu:0"), (per_tower, v)])
            (mean,) = s.batch_reduce(VA.MEAN, [(per_tower, v)])
            first, everywhere = s.batch_reduce(
                VA.ONLY_FIRST_TOWER, [(per_tower, "/cpu:0"), (per_tower, None)]
            )
        assert float(total) == 3.0
        assert floats(on_var) == [3.0, 3.0]
        assert floats(mean) == [1.5, 1.5]
        assert float(first) == 1.0
        assert floats(everywhere) == [1.0, 1.0]

    def test_broadcast(self) -> None:
        s = tpu()
        with s.scope():
            out = s.broadcast(np.float32(7.0))
            assert isinstance(out, pd.Mirrored) and floats(out) == [7.0, 7.0]
            one = s.broadcast(np.arange(2.0), "/cpu:0")
            assert np.asarray(one).tolist() == [0.0, 1.0]
            listed = s.broadcast(np.float32(1.0), ["/gpu:0", "/gpu:1", "/gpu:2"])
            assert floats(listed) == [1.0, 1.0, 1.0]
        single = distribute.OneDeviceStrategy("/gpu:0")
        assert single.broadcast(3.0) == 3.0  # TF's OneDeviceStrategy: the tensor itself
        with pytest.raises(ValueError, match="non-empty list of device strings"):
            s.broadcast(1.0, [])

    def test_call_for_each_tower(self) -> None:
        s = tpu()
        out = s.call_for_each_tower(lambda a, b=0: a * 10 + b + tower_id(), 1, b=2)
        assert s.unwrap(out) == [12, 13]
        per_tower = pd.PerReplica((np.float32(1.0), np.float32(2.0)))
        assert floats(s.call_for_each_tower(lambda x: x * 2, per_tower)) == [2.0, 4.0]

        def nested() -> None:
            s.call_for_each_tower(lambda: None)

        with pytest.raises(RuntimeError, match="requires being in cross-replica context"):
            s.call_for_each_tower(nested)

    def test_colocate_vars_with(self) -> None:
        # The seed's example.
        distribution_strategy = tpu()
        with distribution_strategy.scope():
            var1 = pd.Variable(1.0)
            with distribution_strategy.colocate_vars_with(var1):
                # var2 and var3 will be created on the same device(s) as var1
                var2 = pd.Variable(2.0)
                var3 = pd.Variable(3.0)

            def fn(v1: Any, v2: Any, v3: Any) -> Any:
                return v1.assign_add(v2 + v3)

            # `fn` runs on every device `v1` is on, `v2` and `v3` will be there too.
            distribution_strategy.update(var1, fn, var2, var3)
        devices = [c.device for c in var1.values]
        assert [c.device for c in var2.values] == devices == [c.device for c in var3.values]
        assert [float(c.numpy()) for c in var1.values] == [6.0, 6.0]

    def test_configure(self) -> None:
        # TF's TPUStrategy.configure: isolate_session_state, and the slice's cluster_def.
        config: dict[str, Any] = {"allow_soft_placement": True}
        assert tpu().configure(session_config=config, cluster_spec=None) is None
        assert config == {
            "allow_soft_placement": True,
            "isolate_session_state": True,
            "cluster_def": {"job": [{"name": "worker", "tasks": {0: "v2-8-w-0:8470"}}]},
        }
        remote: dict[str, Any] = {}
        tpu(None, "v3-32").configure(remote)
        assert remote["cluster_def"]["job"][0]["tasks"] == {
            i: f"v3-32-w-{i}:8470" for i in range(4)
        }
        local: dict[str, Any] = {}
        distribute.TPUStrategy().configure(local)  # the local slice: no cluster to describe
        assert local == {"isolate_session_state": True}

    def test_distribute_dataset(self) -> None:
        # The seed's example: each tower reads its own elements of dataset_fn().
        def dataset_fn() -> Dataset:
            return Dataset.from_tensors([[1.0]]).repeat()

        distribution_strategy = tpu()
        with distribution_strategy.scope():
            distributed_dataset = distribution_strategy.distribute_dataset(dataset_fn)
            iterator = distributed_dataset.make_one_shot_iterator()
            tower_results = distribution_strategy.call_for_each_tower(
                lambda x: x * (tower_id() + 1), iterator.get_next()
            )
        assert floats(tower_results) == [[[1.0]], [[2.0]]]
        # Per-tower batches, dealt to the towers in turn.
        numbers = distribution_strategy.distribute_dataset(
            lambda: Dataset.from_tensor_slices(np.arange(6.0)).batch(1)
        )
        assert [floats(x) for x in numbers] == [[[0.0], [1.0]], [[2.0], [3.0]], [[4.0], [5.0]]]
        it = numbers.make_initializable_iterator()
        assert it.initializer == []
        assert floats(it.get_next()) == [[0.0], [1.0]]
        with pytest.raises(TypeError, match="dataset_fn must be a function"):
            distribution_strategy.distribute_dataset(Dataset.range(3))  # type: ignore[arg-type]

    def test_finalize(self) -> None:
        assert tpu().finalize() is None
        assert mirrored().finalize() is None

    def test_get_host_cpu_device(self) -> None:
        assert tpu(None, "v3-32").get_host_cpu_device(2) == "/job:worker/task:2/device:CPU:0"
        local = distribute.TPUStrategy()  # TPUClusterResolver("local"): no master
        assert local.get_host_cpu_device(0) == "/replica:0/task:0/device:CPU:0"

    def test_group(self) -> None:
        single = tpu(num_cores=1)
        assert single.group(np.float32(1.0)) == 1.0  # one value, no name: that value
        assert single.group(np.float32(1.0), name="train_op") is None
        s = tpu()
        assert s.group(s.call_for_each_tower(tower_id)) is None  # tf.group in eager: None

    def test_initialize(self) -> None:
        assert tpu().initialize() is None
        assert distribute.OneDeviceStrategy("/gpu:0").initialize() is None

    def test_map(self) -> None:
        s = tpu()
        out = s.map([1.0, 2.0, 3.0], lambda x, k: np.float32(x * k), 10)
        assert isinstance(out, pd.PerReplica)
        assert [o.get() for o in s.unwrap(out)] == [[10.0, 30.0], [20.0]]  # round-robin
        with s.scope():
            assert float(s.reduce(VA.SUM, out, "/cpu:0")) == 60.0
            assert float(s.reduce(VA.MEAN, out, "/cpu:0")) == 20.0  # over elements, not towers
            assert floats(s.reduce(VA.MEAN, out)) == [20.0, 20.0]
        single = distribute.OneDeviceStrategy("/gpu:0")
        one = single.map([1, 2], lambda x: np.float32(x))
        assert isinstance(one, distribute.MapOutput) and one.get() == [1.0, 2.0]
        assert float(single.reduce(VA.MEAN, one)) == 1.5

    def test_map_over_fewer_elements_than_towers(self) -> None:
        # TF's reduce skips the towers that got no element; it used to raise here.
        s = tpu(num_cores=4)
        out = s.map([1.0, 2.0], lambda x: np.float32(x))
        assert [o.get() for o in s.unwrap(out)] == [[1.0], [2.0], [], []]
        with s.scope():
            assert float(s.reduce(VA.SUM, out, "/cpu:0")) == 3.0
            assert float(s.reduce(VA.MEAN, out, "/cpu:0")) == 1.5  # over the 2 elements
            assert floats(s.reduce(VA.SUM, out)) == [3.0] * 4
            assert [float(r) for r in s.batch_reduce(VA.MEAN, [(out, "/cpu:0")])] == [1.5]
            with pytest.raises(ValueError, match="no elements"):
                s.reduce(VA.SUM, s.map([], lambda x: x), "/cpu:0")

    def test_non_slot_devices(self) -> None:
        s = tpu()
        v = var(s)
        # TF 1.12's TPUExtended: the host's CPU, not the TPU cores.
        assert s.non_slot_devices([v]) == ["/job:worker/replica:0/task:0/device:CPU:0"]
        assert distribute.OneDeviceStrategy("/gpu:1").non_slot_devices([]) == [GPU1]

    def test_read_var(self) -> None:
        s = tpu()
        tower_local = var(s, synchronization=pd.VariableSynchronization.ON_READ, aggregation=VA.SUM)
        s.call_for_each_tower(lambda: tower_local.assign(np.float32(tower_id() + 1)))
        with s.scope():
            assert float(s.read_var(tower_local)) == 3.0
            assert float(s.read_var(var(s, 4.0))) == 4.0

    def test_reduce(self) -> None:
        s = tpu()
        per_tower = s.call_for_each_tower(lambda: np.float32(tower_id() + 1))
        v = var(s)
        with s.scope():
            assert float(s.reduce(VA.SUM, per_tower, "/cpu:0")) == 3.0
            assert float(s.reduce(VA.MEAN, per_tower, destinations="/cpu:0")) == 1.5
            assert floats(s.reduce(VA.SUM, per_tower, v)) == [3.0, 3.0]
            assert floats(s.reduce(VA.SUM, per_tower)) == [3.0, 3.0]  # None: all-reduce
            assert floats(s.reduce(VA.MEAN, per_tower, ["/cpu:0", "/gpu:0"])) == [1.5, 1.5]
            assert float(s.reduce(VA.SUM, per_tower, ["/cpu:0"])) == 3.0
            # ONLY_FIRST_TOWER: tower 0's value, on the destinations.
            assert float(s.reduce(VA.ONLY_FIRST_TOWER, per_tower, "/cpu:0")) == 1.0
            assert floats(s.reduce("ONLY_FIRST_TOWER", per_tower)) == [1.0, 1.0]
            assert s.reduce(VA.ONLY_FIRST_TOWER, s.call_for_each_tower(tower_id)) == 0
            # A ReduceOp works too; a non-distributed value: MEAN keeps it, 0 stays 0.
            assert float(s.reduce(pd.ReduceOp.SUM, per_tower, "/cpu:0")) == 3.0
            assert float(s.reduce(VA.MEAN, np.float32(2.0), "/cpu:0")) == 2.0
            assert s.reduce(VA.SUM, 0) == 0
            with pytest.raises(ValueError, match="cannot be reduced with the given reduce op"):
                s.reduce(VA.SUM, np.float32(2.0), "/cpu:0")
            with pytest.raises(ValueError, match="Cannot reduce with aggregation"):
                s.reduce(VA.NONE, per_tower)

    def test_run_steps_on_dataset(self) -> None:
        s = tpu(steps=2)
        calls: list[tuple[Any, ...]] = []

        def step_fn(ctx: distribute.MultiStepContext, features: Any, labels: Any) -> None:
            calls.append((floats(features), floats(labels)))
            losses = s.call_for_each_tower(lambda f, y: (f * y).sum(), features, labels)
            ctx.set_last_step_output("loss", losses, aggregation=VA.MEAN)
            ctx.set_last_step_output("first", losses, aggregation=VA.ONLY_FIRST_TOWER)
            ctx.set_last_step_output("all", losses)  # no aggregation: per tower
            ctx.set_non_tensor_output("note", "ok")

            def tower_fn(f: Any) -> None:
                ctx.set_last_step_output("total", f.sum(), aggregation=VA.SUM)
                ctx.set_non_tensor_output("tower", tower_id())

            s.call_for_each_tower(tower_fn, features)

        def dataset_fn() -> Dataset:
            x = np.arange(8, dtype=np.float32)
            return Dataset.from_tensor_slices((x, x * 0 + 2)).batch(2)

        with s.scope():
            iterator = s.distribute_dataset(dataset_fn).make_one_shot_iterator()
            ctx = s.run_steps_on_dataset(step_fn, iterator, iterations=2, initial_loop_values=[0.0])
        # fn(ctx, *inputs): the tuple of (features, labels) is unpacked.
        assert calls == [
            ([[0.0, 1.0], [2.0, 3.0]], [[2.0, 2.0], [2.0, 2.0]]),
            ([[4.0, 5.0], [6.0, 7.0]], [[2.0, 2.0], [2.0, 2.0]]),
        ]
        assert isinstance(ctx, distribute.MultiStepContext)
        assert float(ctx.last_step_outputs["loss"]) == 22.0  # mean of 18 and 26
        assert float(ctx.last_step_outputs["first"]) == 18.0
        assert floats(ctx.last_step_outputs["all"]) == [18.0, 26.0]
        assert float(ctx.last_step_outputs["total"]) == 22.0
        assert ctx.non_tensor_outputs == {"note": "ok", "tower": [0, 1]}
        assert ctx.run_op is None and ctx.initial_loop_values == [0.0]
        with pytest.raises(OutOfRangeError):
            s.run_steps_on_dataset(lambda ctx, *x: None, iterator)
        # A single input is passed as it is.
        single = s.distribute_dataset(lambda: Dataset.from_tensor_slices(np.arange(4.0)).batch(1))
        got: list[Any] = []
        s.run_steps_on_dataset(
            lambda ctx, x: got.append(floats(x)), single.make_one_shot_iterator()
        )
        assert got == [[[0.0], [1.0]]]

    def test_scope(self) -> None:
        s = tpu()
        with s.scope() as entered:
            assert entered is s
            assert distribute.get_distribution_strategy() is s
            assert distribute.get_tower_context() is None
        assert distribute.get_distribution_strategy() is not s

    def test_unwrap(self) -> None:
        s = tpu()
        assert s.unwrap(s.call_for_each_tower(tower_id)) == [0, 1]
        assert s.unwrap(5) == [5]
        v = var(s)
        assert s.unwrap(v) == list(v.values)

    def test_update(self) -> None:
        s = tpu()
        v = var(s, 1.0)
        with s.scope():
            out = s.update(
                v, lambda c, delta, scale=1.0: c.assign_add(delta * scale), 2.0, scale=3.0
            )
        assert isinstance(out, pd.Mirrored)
        assert [float(c.numpy()) for c in v.values] == [7.0, 7.0]

    def test_update_non_slot(self) -> None:
        s = tpu()
        counter = var(s, 0)
        with s.scope():
            with s.colocate_vars_with(counter):
                step = pd.Variable(0)
            devices = s.non_slot_devices([counter])
            out = s.update_non_slot(devices, lambda n: step.assign_add(n), 5)
        # Once, on the host (TF 1.12's TPUExtended), updating every copy of ``step``.
        assert isinstance(out, pd.Mirrored) and [int(x) for x in out.values] == [5, 5]
        assert [int(c.numpy()) for c in step.values] == [5, 5]
        host_step = pd.Variable(0)  # a plain counter: one call, not one per tower
        assert int(s.update_non_slot(devices, lambda: host_step.assign_add(1))) == 1
        assert int(host_step.numpy()) == 1

    def test_value_container(self) -> None:
        s = tpu()
        v = var(s)
        assert s.value_container(v.values[1]) is v
        assert s.value_container(v) is v
        assert s.value_container(3) == 3
        assert v.values[0] in s.unwrap(s.value_container(v.values[0]))


def test_mirrored_and_one_device_tower_api() -> None:
    s = mirrored()
    assert s.unwrap(s.call_for_each_tower(lambda: tower_id() * 2)) == [0, 2]
    one = distribute.OneDeviceStrategy("/gpu:0")
    assert one.num_towers == 1 and one.is_single_tower
    assert one.call_for_each_tower(lambda x: x + tower_id(), 1) == 1
    assert float(one.reduce(VA.SUM, np.float32(2.0), "/cpu:0")) == 2.0  # one tower: SUM is fine
    # The v1 members are there too: the tower-era strategies are compat.v1 strategies.
    assert s.update_config_proto({}) == {"isolate_session_state": True}
