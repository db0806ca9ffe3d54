"""Strategy.run, regrouping, contexts and local results (reference sections A and B)."""

from __future__ import annotations

import collections
import copy
from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist.experimental import ValueContext


def replica_id() -> int:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return int(ctx.replica_id_in_sync_group)


def test_replica_ids_cover_each_value_once() -> None:
    strategy = pd.MirroredStrategy(5)
    result = strategy.run(replica_id)
    assert isinstance(result, pd.PerReplica)
    assert result.values == (0, 1, 2, 3, 4)


def test_replica_id_is_int32_array_like_tf() -> None:
    strategy = pd.MirroredStrategy(2)
    ids = strategy.run(lambda: pd.get_replica_context().replica_id_in_sync_group)
    assert [np.asarray(v).dtype for v in ids.values] == [np.int32, np.int32]
    assert [int(v) for v in ids.values] == [0, 1]


def test_contexts_transition_as_documented() -> None:
    strategy = pd.MirroredStrategy(2)
    default_ctx = pd.get_replica_context()
    assert default_ctx is not None and default_ctx.num_replicas_in_sync == 1
    assert not pd.has_strategy()
    assert not pd.in_cross_replica_context()
    assert pd.get_cross_replica_context() is None
    with strategy.scope():
        assert pd.get_replica_context() is None
        assert pd.has_strategy()
        assert pd.in_cross_replica_context()
        assert pd.get_strategy() is strategy
        assert pd.get_cross_replica_context() is strategy
        seen = strategy.run(
            lambda: (
                pd.get_replica_context() is not None,
                pd.in_cross_replica_context(),
                pd.get_strategy() is strategy,
            )
        )
        assert seen == (True, False, True)
    assert not pd.has_strategy()
    assert pd.get_strategy() is not strategy


def test_run_kwargs_and_nested_outputs_two_device_example() -> None:
    # TF's TwoDeviceDistributionTestBase._test_run: [1, 2] then a + 2b + 2 == [6, 14].
    strategy = pd.MirroredStrategy(2)
    x = strategy.run(lambda: np.float32(replica_id() + 1))
    assert [float(v) for v in x.values] == [1.0, 2.0]
    out = strategy.run(lambda *, x: {"a": x * 2, "b": x * x}, kwargs={"x": x})
    assert isinstance(out, dict)
    final = strategy.run(lambda a, b: a + 2 * b + 2, args=(out["a"], out["b"]))
    assert [float(v) for v in final.values] == [6.0, 14.0]


def test_identical_object_is_unwrapped_and_containers_kept() -> None:
    Point = collections.namedtuple("Point", "x y")
    constant = np.ones(3)
    strategy = pd.MirroredStrategy(3)
    out = strategy.run(lambda: {"c": constant, "p": Point(replica_id(), constant), "l": [None]})
    assert out["c"] is constant
    assert isinstance(out["p"], Point)
    assert out["p"].y is constant
    assert isinstance(out["p"].x, pd.PerReplica)
    assert out["p"].x.values == (0, 1, 2)
    assert out["l"] == [None]


def test_different_structures_across_replicas_is_a_clear_error() -> None:
    strategy = pd.MirroredStrategy(2)
    with pytest.raises(ValueError, match="replica 1 returned tuple of length 1"):
        strategy.run(lambda: (1, 2) if replica_id() == 0 else (1,))


def test_run_args_must_be_list_or_tuple() -> None:
    strategy = pd.MirroredStrategy(2)
    with pytest.raises(ValueError, match="must be a list or tuple"):
        strategy.run(lambda x: x, args=5)  # type: ignore[arg-type]


def test_experimental_run_v2_is_run() -> None:
    strategy = pd.MirroredStrategy(2)
    assert strategy.experimental_run_v2(replica_id).values == (0, 1)


def test_per_replica_args_are_split_and_plain_args_shared() -> None:
    strategy = pd.MirroredStrategy(3)
    per_replica = pd.PerReplica([10, 20, 30])
    shared = object()
    out = strategy.run(lambda a, b: (a, b is shared), args=(per_replica, shared))
    assert out[0].values == (10, 20, 30)
    assert out[1] is True


class TestLocalResults:
    def test_per_replica(self) -> None:
        strategy = pd.MirroredStrategy(2)
        assert strategy.experimental_local_results(pd.PerReplica([1, 2])) == (1, 2)

    def test_plain_value(self) -> None:
        strategy = pd.MirroredStrategy(2)
        assert strategy.experimental_local_results(7) == (7,)

    def test_dict_of_constants_gives_one_dict_per_replica(self) -> None:
        # StrategyLocalResultTest.testLocalResultForDictionary.
        strategy = pd.MirroredStrategy(2)
        result = strategy.run(lambda: {"a": np.float32(1.0), "b": np.float32(2.0)})
        got = strategy.experimental_local_results(result)
        assert got == ({"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 2.0})

    def test_nested_list_and_tuple(self) -> None:
        strategy = pd.MirroredStrategy(2)
        value = [pd.PerReplica([1, 2]), (pd.PerReplica([3, 4]), "x")]
        assert strategy.experimental_local_results(value) == ([1, (3, "x")], [2, (4, "x")])

    def test_structure_without_tensors(self) -> None:
        strategy = pd.MirroredStrategy(2)
        assert strategy.experimental_local_results({"a": "s"}) == ({"a": "s"}, {"a": "s"})


def test_distribute_values_from_function_gives_n_ones() -> None:
    strategy = pd.MirroredStrategy(4)
    seen: list[ValueContext] = []

    def value_fn(ctx: ValueContext) -> int:
        seen.append(ctx)
        return 1

    values = strategy.experimental_distribute_values_from_function(value_fn)
    assert isinstance(values, pd.PerReplica)
    assert values.values == (1, 1, 1, 1)
    assert [(c.replica_id_in_sync_group, c.num_replicas_in_sync) for c in seen] == [
        (0, 4),
        (1, 4),
        (2, 4),
        (3, 4),
    ]
    assert int(strategy.reduce("SUM", values, axis=None)) == 4


def test_num_replicas_and_worker_devices() -> None:
    strategy = pd.MirroredStrategy(["/gpu:0", "GPU:1", "cuda:2"])
    assert strategy.num_replicas_in_sync == 3
    assert strategy.extended.worker_devices == (
        "/job:localhost/replica:0/task:0/device:GPU:0",
        "/job:localhost/replica:0/task:0/device:GPU:1",
        "/job:localhost/replica:0/task:0/device:GPU:2",
    )
    assert strategy.cluster_resolver is None


def test_mirrored_strategy_default_devices_is_cpu_like_tf_on_a_laptop() -> None:
    strategy = pd.MirroredStrategy()
    assert strategy.extended.worker_devices == ("/job:localhost/replica:0/task:0/device:CPU:0",)


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        ([], "at least one device"),
        (["/gpu:0", "GPU:0"], "No duplicates"),
        (["/banana:0"], "Invalid device string"),
        ("/gpu:0", "list of device strings"),
        (["/gpu:5000"], "out of range"),
        (0, "at least one replica"),
    ],
)
def test_bad_devices_get_clear_errors(devices: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pd.MirroredStrategy(devices)  # type: ignore[arg-type]


def test_copy_raises_and_deepcopy_works() -> None:
    strategy = pd.MirroredStrategy(2)
    with pytest.raises(RuntimeError, match="Must only deepcopy"):
        copy.copy(strategy)
    clone = copy.deepcopy(strategy)
    assert clone is not strategy
    assert clone.extended.backend is strategy.extended.backend
    assert clone.run(replica_id).values == (0, 1)


class TestScopes:
    def test_mixing_strategies_raises(self) -> None:
        a, b = pd.MirroredStrategy(2), pd.MirroredStrategy(2)
        with a.scope(), pytest.raises(RuntimeError, match="Mixing different"), b.scope():
            pass

    def test_same_scope_can_be_reentered(self) -> None:
        a = pd.MirroredStrategy(2)
        with a.scope(), a.scope():
            assert pd.get_strategy() is a
        assert not pd.has_strategy()

    def test_scope_inside_run_requires_cross_replica(self) -> None:
        a = pd.MirroredStrategy(2)

        def fn() -> None:
            with a.scope():
                pass

        with pytest.raises(RuntimeError, match="cross-replica context"):
            a.run(fn)

    def test_experimental_set_strategy(self) -> None:
        a = pd.MirroredStrategy(2)
        pd.experimental_set_strategy(a)
        try:
            assert pd.get_strategy() is a
            assert pd.in_cross_replica_context()
        finally:
            pd.experimental_set_strategy(None)
        assert not pd.has_strategy()

    def test_experimental_set_strategy_inside_scope_raises(self) -> None:
        a = pd.MirroredStrategy(2)
        with a.scope(), pytest.raises(RuntimeError, match="Must not be called inside"):
            pd.experimental_set_strategy(a)

    def test_default_strategy_scope_cannot_nest(self) -> None:
        default = pd.get_strategy()
        a = pd.MirroredStrategy(2)
        with a.scope(), pytest.raises(RuntimeError, match="Must not nest"), default.scope():
            pass


class TestDefaultAndOneDevice:
    def test_default_strategy_run_and_reduce(self) -> None:
        default = pd.get_strategy()
        assert default.num_replicas_in_sync == 1
        assert default.run(lambda x: x + 1, args=(1,)) == 2
        assert default.reduce("SUM", 5, axis=None) == 5
        assert default.experimental_local_results(3) == (3,)
        got = default.reduce("MEAN", np.array([1, 2, 3, 4], dtype=np.int32), axis=0)
        assert got.dtype == np.float64 and float(got) == 2.5

    def test_default_replica_context_collectives_are_identity(self) -> None:
        ctx = pd.get_replica_context()
        assert ctx is not None
        assert ctx.all_reduce("SUM", 3.0) == 3.0
        assert ctx.merge_call(lambda s, v: (s is pd.get_strategy(), v), args=(4,)) == (True, 4)

    def test_default_replica_context_devices_is_the_current_device(self) -> None:
        # TF's base ReplicaContext.devices: (device_util.current(),), here the host CPU;
        # the default strategy's own worker_devices still raises, as in TF.
        host = ("/job:localhost/replica:0/task:0/device:CPU:0",)
        ctx = pd.get_replica_context()
        assert ctx is not None and ctx.devices == host
        assert pd.get_strategy().run(lambda: pd.get_replica_context().devices) == host
        with pytest.raises(RuntimeError, match="worker_devices"):
            _ = pd.get_strategy().extended.worker_devices
        one = pd.OneDeviceStrategy("/gpu:1")
        assert one.run(lambda: pd.get_replica_context().devices) == (
            "/job:localhost/replica:0/task:0/device:GPU:1",
        )

    def test_one_device_strategy(self) -> None:
        s = pd.OneDeviceStrategy("/gpu:0")
        assert s.num_replicas_in_sync == 1
        assert s.extended.worker_devices == ("/job:localhost/replica:0/task:0/device:GPU:0",)
        assert int(s.run(replica_id)) == 0
        assert s.reduce("SUM", np.float32(3), axis=None) == 3
        assert s.cluster_resolver is None

    @pytest.mark.parametrize("kind", ["default", "one_device", "one_device_v1"])
    def test_distribute_values_from_function_returns_the_value(self, kind: str) -> None:
        # TF's OneDeviceExtended and _DefaultDistributionExtended: value_fn(ValueContext()),
        # not a PerReplica; `run` passes it on as it is.
        strategy = {
            "default": pd.get_strategy,
            "one_device": lambda: pd.OneDeviceStrategy("/cpu:0"),
            "one_device_v1": lambda: pd.compat.v1.distribute.OneDeviceStrategy("/cpu:0"),
        }[kind]()
        seen: list[tuple[int, int]] = []

        def value_fn(ctx: ValueContext) -> Any:
            seen.append((ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync))
            return np.array([1.0, 2.0], np.float32)

        value = strategy.experimental_distribute_values_from_function(value_fn)
        assert seen == [(0, 1)]
        assert isinstance(value, np.ndarray) and value.tolist() == [1.0, 2.0]
        doubled = strategy.run(lambda x: x * 2, args=(value,))
        assert isinstance(doubled, np.ndarray) and doubled.tolist() == [2.0, 4.0]
        assert strategy.experimental_local_results(value) == (value,)
        assert float(strategy.reduce("SUM", value, axis=0)) == 3.0
        assert strategy.gather(value, axis=0) is value

    def test_one_replica_mirrored_strategy_still_wraps(self) -> None:
        values = pd.MirroredStrategy(1).experimental_distribute_values_from_function(lambda _: 7)
        assert isinstance(values, pd.PerReplica) and values.values == (7,)


def test_one_scope_object_entered_again_inside_itself_leaves_cleanly() -> None:
    strategy = pd.MirroredStrategy(["/cpu:0", "/cpu:1"])
    scope = strategy.scope()
    with scope as entered:
        assert entered is strategy
        with scope:
            assert pd.get_strategy() is strategy
        assert pd.get_strategy() is strategy and pd.in_cross_replica_context()
    assert not pd.has_strategy()
    other = pd.MirroredStrategy(["/cpu:0"])
    with pytest.raises(RuntimeError, match="Mixing different"), strategy.scope(), other.scope():
        pass
    assert not pd.has_strategy()
