"""polydist.Variable and distributed variables: the reference tables, exactly.

Reference: "Values and variables" and section B items 10, 11, 23-27 and 30 of
shared/reference/tf-distribute-and-peers.md.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist._base.devices import HOST_DEVICE
from polydist._valuetypes import variables as _variables
from polydist.debugging import ReplicaDivergenceError, check_replicas_identical
from polydist.errors import InvalidArgumentError
from polydist_sim import SimBackend

VA = pd.VariableAggregation
VS = pd.VariableSynchronization
REPO = Path(__file__).resolve().parents[3]


def rid() -> int:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return int(ctx.replica_id_in_sync_group)


def copies(v: Any) -> list[Any]:
    return [c.numpy().tolist() for c in v.values]


def mirrored_var(strategy: pd.Strategy, value: Any = 0.0, **kwargs: Any) -> Any:
    with strategy.scope():
        return pd.Variable(value, **kwargs)


# -- enums ----------------------------------------------------------------------------------


def test_enums_match_tf_members_and_values() -> None:
    assert {m.name: m.value for m in VS} == {"AUTO": 0, "NONE": 1, "ON_WRITE": 2, "ON_READ": 3}
    assert {m.name: m.value for m in VA} == {
        "NONE": 0,
        "SUM": 1,
        "MEAN": 2,
        "ONLY_FIRST_REPLICA": 3,
    }
    assert VA.ONLY_FIRST_TOWER is VA.ONLY_FIRST_REPLICA
    assert pd.ReduceOp.from_variable_aggregation(VA.SUM) is pd.ReduceOp.SUM
    assert pd.ReduceOp.from_variable_aggregation(VA.MEAN) is pd.ReduceOp.MEAN


# -- plain variables -------------------------------------------------------------------------


class TestPlainVariable:
    def test_outside_scope_is_a_single_copy_on_the_host(self) -> None:
        v = pd.Variable(1.0)
        assert type(v) is pd.Variable
        assert not isinstance(v, pd.DistributedValues)
        assert v.name == "Variable:0"
        assert v.dtype == np.float32 and v.shape == ()
        assert v.device == HOST_DEVICE
        assert v.trainable is True
        assert v.synchronization is VS.AUTO and v.aggregation is VA.NONE
        assert v.distribute_strategy is None
        assert repr(v) == "<polydist.Variable 'Variable:0' shape=() dtype=float32, numpy=1.0>"

    def test_eager_names_are_not_uniquified(self) -> None:
        # TF 2 eager: every unnamed variable is 'Variable:0'.
        assert [pd.Variable(0).name for _ in range(2)] == ["Variable:0", "Variable:0"]
        assert pd.Variable(0, name="w").name == "w:0"

    def test_tf_dtype_rules(self) -> None:
        assert pd.Variable(1).dtype == np.int32
        assert pd.Variable([1.0, 2.0]).dtype == np.float32
        assert pd.Variable(np.zeros(3)).dtype == np.float64
        assert pd.Variable(np.zeros(3), dtype="float32").dtype == np.float32
        assert pd.Variable(1, dtype=np.float64).dtype == np.float64
        assert pd.Variable(0.1, dtype=np.float64).numpy() == 0.1  # no float32 detour
        with pytest.raises(TypeError, match="cannot convert initial_value of dtype float32"):
            pd.Variable(1.5, dtype="int32")

    def test_initial_value_required_and_callable_called_once(self) -> None:
        with pytest.raises(ValueError, match="initial_value must be specified"):
            pd.Variable()
        calls = []
        v = pd.Variable(lambda: calls.append(1) or np.ones(2, np.float32))
        assert calls == [1] and v.numpy().tolist() == [1.0, 1.0]

    def test_invalid_options(self) -> None:
        with pytest.raises(ValueError, match="Invalid variable aggregation mode: 'sum'"):
            pd.Variable(1.0, aggregation="sum")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="Invalid variable synchronization mode: 7"):
            pd.Variable(1.0, synchronization=7)  # type: ignore[arg-type]
        assert pd.Variable(1.0, aggregation=1).aggregation is VA.SUM  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="name must be a str"):
            pd.Variable(1.0, name=3)  # type: ignore[arg-type]

    def test_trainable_defaults_to_false_for_on_read(self) -> None:
        assert pd.Variable(0.0, synchronization=VS.ON_READ).trainable is False
        assert pd.Variable(0.0, synchronization=VS.ON_READ, trainable=True).trainable is True
        assert pd.Variable(0.0, trainable=False).trainable is False

    def test_assign_family_and_return_values(self) -> None:
        v = pd.Variable(1.0)
        assert v.assign(2.0) is v
        assert v.assign_add(0.5) is v and float(v) == 2.5
        assert v.assign_sub(1, read_value=False) is None and float(v) == 1.5
        assert v.read_value().dtype == np.float32

    def test_assign_checks_shape_and_kind(self) -> None:
        v = pd.Variable([1.0, 2.0])
        with pytest.raises(
            ValueError, match=r"shape \(\) to variable 'Variable:0' of shape \(2,\)"
        ):
            v.assign(1.0)
        with pytest.raises(InvalidArgumentError, match="shapes must be equal"):
            v.assign_add(1.0)
        i = pd.Variable(1)
        with pytest.raises(TypeError, match="Cannot assign a float32"):
            i.assign(2.5)
        v.assign(np.array([3, 4], np.int64))  # int -> float widens: allowed
        assert v.numpy().tolist() == [3.0, 4.0] and v.dtype == np.float32

    def test_stored_value_is_never_aliased(self) -> None:
        source = np.ones(3, np.float32)
        v = pd.Variable(source)
        source[0] = 5.0
        assert v.numpy().tolist() == [1.0, 1.0, 1.0]
        out = v.numpy()
        out[1] = 7.0
        assert v.numpy().tolist() == [1.0, 1.0, 1.0]
        with pytest.raises(ValueError, match="read-only"):
            v.value()[0] = 9.0
        copy = v.read_value()
        copy += 1
        assert v.numpy().tolist() == [1.0, 1.0, 1.0]

    def test_operators_act_on_the_value(self) -> None:
        v = pd.Variable([1.0, 2.0])
        assert (v + 1).tolist() == [2.0, 3.0]
        assert (2 * v).tolist() == [2.0, 4.0]
        assert (v - v).tolist() == [0.0, 0.0]
        assert (1 / v).tolist() == [1.0, 0.5]
        assert (v**2).tolist() == [1.0, 4.0]
        assert (-v).tolist() == [-1.0, -2.0]
        assert (v < 1.5).tolist() == [True, False]
        assert (v >= 2).tolist() == [False, True]
        assert float(v @ np.ones(2, np.float32)) == 3.0
        assert float(v[1]) == 2.0
        assert np.asarray(v).tolist() == [1.0, 2.0]
        assert [float(x) for x in v] == [1.0, 2.0]
        s = pd.Variable(2.5)
        assert float(s) == 2.5 and int(s) == 2 and bool(s) and f"{s:.2f}" == "2.50"
        # == and != are identity, so variables can be dict keys.
        assert {v: 1}[v] == 1 and v != pd.Variable([1.0, 2.0])


# -- creation under a strategy -------------------------------------------------------------


class TestCreation:
    def test_table_auto_and_on_write_mirrored_on_read_sync_on_read(self) -> None:
        strategy = pd.MirroredStrategy(3)
        with strategy.scope():
            auto = pd.Variable(1.0)
            on_write = pd.Variable(1.0, synchronization=VS.ON_WRITE)
            on_read = pd.Variable(1.0, synchronization=VS.ON_READ)
        assert type(auto) is pd.MirroredVariable and type(on_write) is pd.MirroredVariable
        assert type(on_read) is pd.SyncOnReadVariable
        assert auto.synchronization is VS.ON_WRITE  # AUTO becomes ON_WRITE (TF)
        assert on_read.synchronization is VS.ON_READ and on_read.trainable is False
        for v in (auto, on_read):
            assert isinstance(v, pd.Variable) and isinstance(v, pd.DistributedValues)
            assert len(v.values) == 3 and all(type(c) is pd.Variable for c in v.values)
            assert v.distribute_strategy is strategy
        assert isinstance(auto, pd.Mirrored) and not isinstance(on_read, pd.Mirrored)

    def test_sync_none_raises_tf_message(self) -> None:
        strategy = pd.MirroredStrategy(2)
        with strategy.scope(), pytest.raises(ValueError) as info:
            pd.Variable(1.0, name="v", synchronization=VS.NONE)
        assert str(info.value) == (
            "`NONE` variable synchronization mode is not supported with tf.distribute "
            "strategy. Please change the `synchronization` for variable: v"
        )

    @pytest.mark.parametrize("sync", [VS.ON_WRITE, VS.ON_READ])
    def test_mean_with_non_float_dtype_raises_at_creation(self, sync: VS) -> None:
        strategy = pd.MirroredStrategy(2)
        with strategy.scope(), pytest.raises(ValueError, match="aggregation=MEAN and a non-float"):
            pd.Variable(1, aggregation=VA.MEAN, synchronization=sync)
        pd.Variable(1, aggregation=VA.MEAN)  # outside a strategy: a plain variable, allowed

    def test_component_names_like_tf(self) -> None:
        strategy = pd.MirroredStrategy(3)
        with strategy.scope():
            unnamed = pd.Variable(0.0)
            foo = pd.Variable(0.0, name="foo")
            scoped = pd.Variable(0.0, name="common/var1")
        assert [c.name for c in unnamed.values] == [
            "Variable:0",
            "Variable/replica_1:0",
            "Variable/replica_2:0",
        ]
        assert foo.name == "foo:0" and foo.values[1].name == "foo/replica_1:0"
        assert scoped.name == "common/var1:0" and scoped.values[2].name == "common/var1/replica_2:0"

    def test_component_devices_match_worker_devices(self) -> None:
        strategy = pd.MirroredStrategy(["/gpu:0", "/gpu:1"])
        v = mirrored_var(strategy, np.zeros(2, np.float32))
        assert tuple(c.device for c in v.values) == strategy.extended.worker_devices
        assert v.device == strategy.extended.worker_devices[0]
        assert strategy.run(lambda: v.device).values == strategy.extended.worker_devices

    def test_callable_initial_value_gives_identical_copies(self) -> None:
        rng = np.random.default_rng(0)
        strategy = pd.MirroredStrategy(4)
        v = mirrored_var(strategy, lambda: rng.normal(size=3).astype(np.float32))
        check_replicas_identical([v])
        assert len({c.numpy().tobytes() for c in v.values}) == 1

    def test_components_map_back_to_their_container(self) -> None:
        strategy = pd.MirroredStrategy(3)
        v = mirrored_var(strategy)
        assert strategy.extended.value_container(v.values[1]) is v
        assert strategy.extended.value_container(v) is v
        assert strategy.run(lambda: v) is v
        assert strategy.run(lambda: v._get_on_device_or_primary()) is v  # regroup: container
        assert strategy.experimental_local_results(v) == v.values

    def test_one_device_strategy_makes_a_plain_variable_on_its_device(self) -> None:
        strategy = pd.OneDeviceStrategy("/gpu:1")
        with strategy.scope():
            v = pd.Variable(1.0, synchronization=VS.NONE)  # TF: no NONE check here
            m = pd.Variable(1, aggregation=VA.MEAN)
        assert type(v) is pd.Variable and type(m) is pd.Variable
        assert v.device == "/job:localhost/replica:0/task:0/device:GPU:1"
        assert v.distribute_strategy is strategy
        assert strategy.extended.variable_created_in_scope(v)
        assert strategy.extended.non_slot_devices([v]) == v.device

    def test_variable_created_in_run_is_shared_and_created_once(self) -> None:
        strategy = pd.MirroredStrategy(3)
        before = len(_variables.tracked_variables(strategy.extended))

        def fn() -> Any:
            return pd.Variable(np.float32(rid() + 10), name="inner")

        v = strategy.run(fn)
        assert type(v) is pd.MirroredVariable  # the same container on every replica
        assert len(_variables.tracked_variables(strategy.extended)) == before + 1
        assert copies(v) == [10.0, 10.0, 10.0]  # replica 0's initial value everywhere

    def test_mismatching_names_in_run_raise(self) -> None:
        strategy = pd.MirroredStrategy(2)
        with pytest.raises(RuntimeError, match="mismatching name on device 1"):
            strategy.run(lambda: pd.Variable(0.0, name=f"v{rid()}"))

    def test_variable_of_another_strategy_is_refused(self) -> None:
        a, b = pd.MirroredStrategy(2), pd.MirroredStrategy(2)
        v = mirrored_var(a)
        with b.scope(), pytest.raises(RuntimeError, match="Mixing different"):
            v.assign(1.0)
        assert not b.extended.variable_created_in_scope(v)
        assert a.extended.variable_created_in_scope(v)
        assert not a.extended.variable_created_in_scope(pd.Variable(1.0))
        default = pd.get_strategy()
        assert default.extended.variable_created_in_scope(pd.Variable(1.0))
        assert not default.extended.variable_created_in_scope(v)


# -- MirroredVariable updates ---------------------------------------------------------------


class TestMirroredUpdates:
    @pytest.mark.parametrize(
        ("aggregation", "method", "expected"),
        [
            (VA.SUM, "assign_add", [6.0, 6.0, 6.0]),
            (VA.MEAN, "assign", [2.0, 2.0, 2.0]),
            (VA.ONLY_FIRST_REPLICA, "assign", [1.0, 1.0, 1.0]),
        ],
    )
    def test_replica_context_table(
        self, aggregation: VA, method: str, expected: list[float]
    ) -> None:
        # 3 replicas each write id + 1.
        strategy = pd.MirroredStrategy(3)
        v = mirrored_var(strategy, 0.0, aggregation=aggregation)
        out = strategy.run(lambda: getattr(v, method)(np.float32(rid() + 1)))
        assert copies(v) == expected
        assert [float(x) for x in out.values] == expected  # each replica gets the new value
        assert check_replicas_identical(strategy) >= 1

    def test_replica_context_none_diverges_and_warns_once(self) -> None:
        strategy = pd.MirroredStrategy(3)
        v = mirrored_var(strategy, 0.0, name="w")
        with pytest.warns(pd.ReplicaDivergenceWarning, match=r"'w:0'.*replica\(s\) 1, 2 differ"):
            strategy.run(lambda: v.assign(np.float32(rid() + 1)))
        assert copies(v) == [1.0, 2.0, 3.0]  # TF's values are kept
        assert strategy.run(lambda: float(v.read_value())).values == (1.0, 2.0, 3.0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            strategy.run(lambda: v.assign(np.float32(rid() + 5)))  # once per variable
        assert copies(v) == [5.0, 6.0, 7.0]

    def test_cross_replica_write_of_per_replica_values_diverges_and_warns_once(self) -> None:
        # TF gives each copy its own replica's component of a PerReplica or a
        # SyncOnReadVariable written in cross-replica context: kept, and warned about.
        strategy = pd.MirroredStrategy(3)
        v = mirrored_var(strategy, 0.0, name="w")
        with strategy.scope():
            counts = pd.Variable(
                0.0,
                synchronization=pd.VariableSynchronization.ON_READ,
                aggregation=VA.SUM,
            )
        strategy.run(lambda: counts.assign(np.float32(rid() + 1)))
        assert float(counts.read_value()) == 6.0
        with pytest.warns(
            pd.ReplicaDivergenceWarning,
            match=r"'w:0'.*replica\(s\) 1, 2 differ.*SyncOnReadVariable in cross-replica",
        ):
            v.assign(counts)
        assert copies(v) == [1.0, 2.0, 3.0]  # TF's values are kept
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            v.assign_add(pd.PerReplica([np.float32(1), np.float32(0), np.float32(5)]))
        assert copies(v) == [2.0, 2.0, 8.0]  # once per variable
        same = mirrored_var(strategy, 0.0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # equal components leave the copies equal
            same.assign(pd.PerReplica([np.float32(4)] * 3))
            same.assign(strategy.reduce("SUM", counts, axis=None))
        assert copies(same) == [6.0, 6.0, 6.0]

    def test_replica_context_none_with_equal_values_does_not_warn(self) -> None:
        strategy = pd.MirroredStrategy(3)
        v = mirrored_var(strategy, 0.0)
        strategy.run(lambda: v.assign_add(np.float32(1.0)))
        assert copies(v) == [1.0, 1.0, 1.0]

    def test_sum_assign_sub(self) -> None:
        strategy = pd.MirroredStrategy(3)
        v = mirrored_var(strategy, 10.0, aggregation=VA.SUM)
        strategy.run(lambda: v.assign_sub(np.float32(rid() + 1)))
        assert copies(v) == [4.0, 4.0, 4.0]

    def test_sum_of_a_value_that_is_the_same_object_everywhere_raises(self) -> None:
        # TF: a Python literal is not per-replica; summing it is ill-defined.
        strategy = pd.MirroredStrategy(2)
        v = mirrored_var(strategy, 0.0, aggregation=VA.SUM)
        one = np.float32(1.0)
        with pytest.raises(ValueError, match="cannot be reduced with the given reduce op"):
            strategy.run(lambda: v.assign_add(one))

    def test_mean_of_a_shared_literal_is_that_value(self) -> None:
        strategy = pd.MirroredStrategy(2)
        v = mirrored_var(strategy, 0.0, aggregation=VA.MEAN)
        strategy.run(lambda: v.assign(2.0))
        assert copies(v) == [2.0, 2.0]

    def test_mean_update_of_int_variable_with_distributed_value(self) -> None:
        # B.26. Creation already rejects int MEAN (TF 2.21), so build one as the old TF
        # test did to reach the replica-context check.
        strategy = pd.MirroredStrategy(2)
        v = mirrored_var(strategy, 1, aggregation=VA.SUM)
        v._aggregation = VA.MEAN
        with pytest.raises(ValueError, match="Cannot update non-float variables"):
            strategy.run(lambda: v.assign(rid()))
        strategy.run(lambda: v.assign(2))  # the same value everywhere is allowed
        assert copies(v) == [2, 2]

    def test_cross_replica_assign_writes_every_copy(self) -> None:
        strategy = pd.MirroredStrategy(3)
        v = mirrored_var(strategy, 1.0)
        with strategy.scope():
            out = v.assign(3.0)
        assert isinstance(out, pd.Mirrored) and [float(x) for x in out.values] == [3.0] * 3
        assert copies(v) == [3.0, 3.0, 3.0]
        v.assign_add(1.0)  # outside the scope too (testAssignOutOfScope)
        assert copies(v) == [4.0, 4.0, 4.0]
        assert v.assign_sub(2.0, read_value=False) is None
        assert copies(v) == [2.0, 2.0, 2.0] and float(v.read_value()) == 2.0

    def test_cross_replica_reads_replica_zero_and_ops_use_it(self) -> None:
        strategy = pd.MirroredStrategy(2)
        v = mirrored_var(strategy, np.array([1.0, 2.0], np.float32))
        v.values[1].assign(np.array([5.0, 6.0], np.float32))  # diverge by hand
        assert v.numpy().tolist() == [1.0, 2.0]
        assert (v * 2).tolist() == [2.0, 4.0]
        doubled = strategy.run(lambda: v * 2)
        assert [x.tolist() for x in doubled.values] == [[2.0, 4.0], [10.0, 12.0]]
        assert v.shape == (2,) and v.dtype == np.float32 and v.trainable

    def test_thread_replica_mode(self) -> None:
        strategy = pd.MirroredStrategy(3, backend=SimBackend(replica_mode="thread"))
        v = mirrored_var(strategy, 0.0, aggregation=VA.SUM)
        strategy.run(lambda: v.assign_add(np.float32(rid() + 1)))
        assert copies(v) == [6.0, 6.0, 6.0]


# -- SyncOnReadVariable ----------------------------------------------------------------------


class TestSyncOnRead:
    @pytest.mark.parametrize(
        ("aggregation", "read"), [(VA.SUM, 6.0), (VA.MEAN, 2.0), (VA.ONLY_FIRST_REPLICA, 1.0)]
    )
    def test_local_writes_and_aggregated_read(self, aggregation: VA, read: float) -> None:
        strategy = pd.MirroredStrategy(3)
        v = mirrored_var(strategy, 0.0, synchronization=VS.ON_READ, aggregation=aggregation)
        strategy.run(lambda: v.assign(np.float32(rid() + 1)))
        assert copies(v) == [1.0, 2.0, 3.0]  # each replica wrote its own copy
        assert strategy.run(lambda: float(v.read_value())).values == (1.0, 2.0, 3.0)
        assert float(v.read_value()) == read and float(v.numpy()) == read
        with strategy.scope():
            assert float(v.value()) == read
            assert float(strategy.extended.read_var(v)) == read

    def test_none_aggregation_has_no_cross_replica_value(self) -> None:
        strategy = pd.MirroredStrategy(2)
        v = mirrored_var(strategy, 0.0, synchronization=VS.ON_READ, name="m")
        with pytest.raises(ValueError, match="'m:0' has aggregation NONE"):
            v.read_value()

    def test_cross_replica_assign_sum_stores_value_over_n(self) -> None:
        strategy = pd.MirroredStrategy(3)
        v = mirrored_var(strategy, 0.0, synchronization=VS.ON_READ, aggregation=VA.SUM)
        with strategy.scope():
            out = v.assign(9.0)
        assert copies(v) == [3.0, 3.0, 3.0]
        assert float(out) == 9.0 and float(v.read_value()) == 9.0

    def test_cross_replica_assign_sum_int_keeps_the_total(self) -> None:
        # TF stores cast(10 / 3) = 3 in each copy and reads 9; polydist splits exactly.
        strategy = pd.MirroredStrategy(3)
        v = mirrored_var(strategy, 0, synchronization=VS.ON_READ, aggregation=VA.SUM)
        out = v.assign(10)
        assert copies(v) == [4, 3, 3] and int(out) == 10 and int(v.read_value()) == 10
        assert v.assign(-10, read_value=False) is None
        assert copies(v) == [-2, -4, -4] and int(v.read_value()) == -10
        v.assign(9)  # N divides it: TF's copies
        assert copies(v) == [3, 3, 3] and int(v.read_value()) == 9
        small = mirrored_var(strategy, np.int8(0), synchronization=VS.ON_READ, aggregation=VA.SUM)
        small.assign(np.int8(-128))
        assert copies(small) == [-42, -43, -43] and int(small.read_value()) == -128
        assert small.read_value().dtype == np.int8

    @pytest.mark.parametrize("method", ["assign_add", "assign_sub"])
    def test_cross_replica_assign_add_sub_of_sum_raise(self, method: str) -> None:
        strategy = pd.MirroredStrategy(2)
        v = mirrored_var(strategy, 0.0, synchronization=VS.ON_READ, aggregation=VA.SUM)
        with strategy.scope(), pytest.raises(ValueError, match=f"does not support `{method}`"):
            getattr(v, method)(1.0)

    def test_cross_replica_updates_of_mean_apply_to_each_copy(self) -> None:
        strategy = pd.MirroredStrategy(2)
        v = mirrored_var(strategy, 0.0, synchronization=VS.ON_READ, aggregation=VA.MEAN)
        v.assign(4.0)
        assert copies(v) == [4.0, 4.0]
        v.assign_add(1.0)
        v.assign_sub(0.5, read_value=False)
        assert copies(v) == [4.5, 4.5] and float(v.read_value()) == 4.5

    def test_reduce_and_local_results(self) -> None:
        strategy = pd.MirroredStrategy(3)
        v = mirrored_var(strategy, 0.0, synchronization=VS.ON_READ, aggregation=VA.SUM)
        strategy.run(lambda: v.assign_add(np.float32(rid())))
        assert float(strategy.reduce("SUM", v, axis=None)) == 3.0
        assert float(strategy.reduce("MEAN", v, axis=None)) == 1.0
        assert [float(c) for c in strategy.experimental_local_results(v)] == [0.0, 1.0, 2.0]

    def test_all_reduce_of_only_first_replica_variable(self) -> None:
        # B.10 (testSyncOnReadVariableInput): each replica assigns 3*id, then all_reduce.
        strategy = pd.MirroredStrategy(3)
        v = mirrored_var(
            strategy, 0.0, synchronization=VS.ON_READ, aggregation=VA.ONLY_FIRST_REPLICA
        )

        def fn() -> Any:
            v.assign(np.float32(3 * rid()))
            return pd.get_replica_context().all_reduce("SUM", v)

        out = strategy.run(fn)
        assert [float(x) for x in out.values] == [9.0, 9.0, 9.0]

    def test_only_first_replica_on_write_vs_on_read(self) -> None:
        # B.24: ON_WRITE keeps replica 0's update everywhere; ON_READ diverges and
        # read_var returns replica 0's copy.
        strategy = pd.MirroredStrategy(3)
        on_write = mirrored_var(strategy, 0.0, aggregation=VA.ONLY_FIRST_REPLICA)
        on_read = mirrored_var(
            strategy, 0.0, synchronization=VS.ON_READ, aggregation=VA.ONLY_FIRST_REPLICA
        )

        def fn() -> None:
            on_write.assign(np.float32(rid() + 1))
            on_read.assign(np.float32(rid() + 1))

        strategy.run(fn)
        assert copies(on_write) == [1.0, 1.0, 1.0]
        assert copies(on_read) == [1.0, 2.0, 3.0]
        with strategy.scope():
            assert float(strategy.extended.read_var(on_read)) == 1.0
            assert float(strategy.extended.read_var(on_write)) == 1.0


# -- StrategyExtended members --------------------------------------------------------------


class TestExtended:
    def test_update_cross_replica_returns_mirrored(self) -> None:
        # TF's docstring example: update(v, lambda c: c.assign(1.0)) is a Mirrored of 1.0.
        strategy = pd.MirroredStrategy(2)
        v = mirrored_var(strategy, 5.0, aggregation=VA.SUM)
        with strategy.scope():
            result = strategy.extended.update(v, lambda c: c.assign(1.0))
        assert isinstance(result, pd.Mirrored) and [float(x) for x in result.values] == [1.0, 1.0]
        assert copies(v) == [1.0, 1.0]

    def test_update_unwraps_mirrored_args_and_groups(self) -> None:
        strategy = pd.MirroredStrategy(2)
        v = mirrored_var(strategy, 0.0)
        delta = pd.Mirrored([np.float32(2.0), np.float32(2.0)])
        with strategy.scope():
            names, got = strategy.extended.update(v, lambda c, d: (c.name, float(d)), (delta,))
            assert names.values == ("Variable:0", "Variable/replica_1:0")  # a nest regroups
            assert isinstance(got, pd.Mirrored) and got.values == (2.0, 2.0)
            ungrouped = strategy.extended.update(
                v, lambda c, d: c.assign_add(d), args=(delta,), group=False
            )
        assert isinstance(ungrouped, tuple) and [float(x) for x in ungrouped] == [2.0, 2.0]
        assert copies(v) == [2.0, 2.0]

    def test_update_in_replica_context_goes_through_merge_call(self) -> None:
        strategy = pd.MirroredStrategy(3)
        v = mirrored_var(strategy, 0.0)
        with pd.trace() as t:
            strategy.run(lambda: strategy.extended.update(v, lambda c, x: c.assign_add(x), (1.0,)))
        assert copies(v) == [1.0, 1.0, 1.0]
        assert [e.op for e in t.events] == ["merge_call"]

    def test_update_of_a_plain_variable(self) -> None:
        strategy = pd.OneDeviceStrategy("/cpu:0")
        with strategy.scope():
            v = pd.Variable(1.0)
            assert strategy.extended.update(v, lambda c: c.assign_add(1.0)) is v
            assert strategy.extended.update(v, lambda c: float(c), group=False) == (2.0,)

    def test_replica_context_private_update(self) -> None:
        # B.11 (ReplicaCtxUpdateTest): tensor and literal args leave identical copies.
        strategy = pd.MirroredStrategy(3)
        v = mirrored_var(strategy, 1.0)

        def fn() -> None:
            ctx = pd.get_replica_context()
            assert ctx is not None
            ctx._update(v, lambda c, x: c.assign(x), args=(np.float32(5.0),))
            ctx._update(v, lambda c, x: c.assign_add(x), args=(2.0,))
            ctx._update(v, lambda c, x: c.assign_sub(x), kwargs={"x": np.float32(1.0)})

        strategy.run(fn)
        assert copies(v) == [6.0, 6.0, 6.0]
        assert "_update" not in dir(pd)

    def test_update_non_slot_and_non_slot_devices(self) -> None:
        strategy = pd.MirroredStrategy(2)
        counter = mirrored_var(strategy, 0)
        with strategy.scope():
            devices = strategy.extended.non_slot_devices([counter])
            assert devices == strategy.extended.worker_devices
            out = strategy.extended.update_non_slot(devices, lambda: counter.assign_add(1))
        assert isinstance(out, pd.Mirrored)
        assert copies(counter) == [1, 1]  # each call updated one replica's copy
        default = pd.get_strategy().extended
        a, b = pd.Variable(0, name="b"), pd.Variable(0, name="a")
        assert default.non_slot_devices([a, b]) is b
        assert default.update_non_slot(b, lambda: 7) == 7

    def test_broadcast_to(self) -> None:
        strategy = pd.MirroredStrategy(3)
        v = mirrored_var(strategy)
        with strategy.scope():
            assert strategy.extended.broadcast_to(1.0, destinations=v) == 1.0  # TF fast path
            out = strategy.extended.broadcast_to(np.arange(2.0), destinations=v)
            assert isinstance(out, pd.Mirrored) and len(out.values) == 3
            one = strategy.extended.broadcast_to(np.arange(2.0), destinations="/gpu:1")
            assert one.tolist() == [0.0, 1.0]
            with pytest.raises(ValueError, match="needs destinations"):
                strategy.extended.broadcast_to(np.arange(2.0), destinations=None)
        with pytest.raises(RuntimeError, match="cross-replica context"):
            strategy.run(lambda: strategy.extended.broadcast_to(np.ones(1), destinations=v))

    def test_reduce_to_and_batch_reduce_to_a_variable(self) -> None:
        strategy = pd.MirroredStrategy(2)
        v = mirrored_var(strategy)
        values = strategy.run(lambda: np.float32(rid() + 1))
        with strategy.scope():
            out = strategy.extended.reduce_to("SUM", values, destinations=v)
            assert isinstance(out, pd.Mirrored) and [float(x) for x in out.values] == [3.0, 3.0]
            batch = strategy.extended.batch_reduce_to("MEAN", [(values, v), (values, "/cpu:0")])
        assert [float(x) for x in batch[0].values] == [1.5, 1.5] and float(batch[1]) == 1.5
        # A MirroredVariable reduces as its copies: MEAN is its value, SUM is refused.
        assert float(strategy.reduce("MEAN", v, axis=None)) == 0.0
        with pytest.raises(ValueError, match="Cannot SUM a Mirrored"):
            strategy.reduce("SUM", v, axis=None)

    @pytest.mark.parametrize("cdo", [None, pd.NcclAllReduce()])
    def test_reduce_to_a_list_of_devices_is_refused(self, cdo: Any) -> None:
        # TF's reduce_to asserts that destinations is not a list or tuple (polydist took
        # the first device and returned one array).
        strategy = pd.MirroredStrategy(2, cross_device_ops=cdo)
        values = strategy.run(lambda: np.float32(rid() + 1))
        ext = strategy.extended
        for devices in (["/gpu:0", "/gpu:1"], ("/gpu:0",)):
            with pytest.raises(ValueError, match="reduce_to takes one destination, not a"):
                ext.reduce_to("SUM", values, devices)
            with pytest.raises(ValueError, match="batch_reduce_to takes one destination"):
                ext.batch_reduce_to("SUM", [(values, "/cpu:0"), (values, devices)])
        # Several devices: a distributed value on them (a Mirrored there), as TF allows.
        out = ext.reduce_to("SUM", values, values)
        assert isinstance(out, pd.Mirrored) and [float(x) for x in out.values] == [3.0, 3.0]

    def test_colocate_vars_with(self) -> None:
        strategy = pd.MirroredStrategy(["/gpu:2", "/gpu:3"])
        v = mirrored_var(strategy)
        with pytest.raises(RuntimeError, match='Need to be inside "with strategy.scope\\(\\)"'):
            strategy.extended.colocate_vars_with(v)
        plain = pd.Variable(1.0)
        with strategy.scope():
            with pytest.raises(ValueError, match="must only be passed a variable created in"):
                strategy.extended.colocate_vars_with(plain)
            with strategy.extended.colocate_vars_with(v):
                slot = pd.Variable(0.0, name="slot")
        assert [c.device for c in slot.values] == [c.device for c in v.values]

    def test_properties(self) -> None:
        ext = pd.MirroredStrategy(2).extended
        assert ext.parameter_devices == ext.worker_devices
        assert ext.experimental_require_static_shapes is False
        assert ext.should_checkpoint and ext.should_save_summary and ext.experimental_should_init
        assert ext.experimental_between_graph is False


# -- divergence diagnostics -------------------------------------------------------------------


class TestCheckReplicasIdentical:
    def test_strategy_variables(self) -> None:
        strategy = pd.MirroredStrategy(4)
        w = mirrored_var(strategy, np.zeros(3, np.float32), name="w")
        mirrored_var(strategy, 0.0, synchronization=VS.ON_READ, aggregation=VA.SUM)
        assert check_replicas_identical(strategy) == 1  # SyncOnRead copies may differ
        w.values[2].assign(np.array([0.0, 1e-7, 0.0], np.float32))
        with pytest.raises(ReplicaDivergenceError) as info:
            check_replicas_identical(strategy)
        message = str(info.value)
        assert (
            "MirroredVariable 'w:0': replica(s) 2 (/job:localhost/replica:0/task:0/device:GPU:2)"
            in message
        )
        assert "index (1,): 0.0 (replica 0) vs 1.0000000116860974e-07 (replica 2)" in message
        assert isinstance(info.value, InvalidArgumentError)
        with strategy.scope():
            with pytest.raises(ReplicaDivergenceError):
                check_replicas_identical()  # None: the current strategy
            w.assign(np.zeros(3, np.float32))
            assert check_replicas_identical() == 1

    def test_nest_of_values(self) -> None:
        strategy = pd.MirroredStrategy(2)
        good = pd.Mirrored([np.ones(2), np.ones(2)])
        bad = pd.Mirrored([np.ones(2), np.array([1.0, np.nan])])
        per_replica = pd.PerReplica([np.zeros(1), np.ones(1)])
        v = mirrored_var(strategy, 0.0, name="v")
        assert check_replicas_identical({"a": good, "p": per_replica, "v": v}) == 2
        with pytest.raises(ReplicaDivergenceError, match=r"Mirrored value at \['b'\]\[1\]"):
            check_replicas_identical({"b": [good, bad]})
        with pytest.raises(ReplicaDivergenceError, match="replica 0 holds float64.2. but"):
            check_replicas_identical(pd.Mirrored([np.ones(2), np.ones(3)]))


def test_deepcopy_keeps_strategy_and_devices() -> None:
    strategy = pd.MirroredStrategy(2)
    v = mirrored_var(strategy, np.ones(2, np.float32), name="w", aggregation=VA.SUM)
    w = copy.deepcopy(v)
    assert type(w) is pd.MirroredVariable and w is not v
    assert w.distribute_strategy is strategy and w.aggregation is VA.SUM
    assert [c.name for c in w.values] == [c.name for c in v.values]
    assert strategy.extended.value_container(w.values[1]) is w
    w.assign([3.0, 4.0])
    assert copies(v) == [[1.0, 1.0]] * 2 and copies(w) == [[3.0, 4.0]] * 2
    plain = pd.Variable(1.0)
    assert float(copy.deepcopy(plain)) == 1.0
    with pd.MirroredStrategy(2).scope(), pytest.raises(RuntimeError, match="Mixing different"):
        copy.deepcopy(v)


# -- functionalization hook -------------------------------------------------------------------


def test_storage_interface() -> None:
    strategy = pd.MirroredStrategy(2)
    v = mirrored_var(strategy, 1.0)
    arrays = _variables.storage_arrays(v)
    assert [float(a) for a in arrays] == [1.0, 1.0]
    old = _variables.swap_storage(v, [np.float32(7.0), np.float32(8.0)])
    assert [float(a) for a in old] == [1.0, 1.0] and copies(v) == [7.0, 8.0]
    with pytest.raises(ValueError, match="has 2 component"):
        _variables.swap_storage(v, [np.float32(1.0)])
    assert v in _variables.tracked_variables(strategy.extended)


# -- the example -------------------------------------------------------------------------------


def test_train_sim_example_runs(tmp_path: Path) -> None:
    script = REPO / "examples" / "train_sim.py"
    proc = subprocess.run(
        [
            sys.executable,
            "-W",
            "error",
            str(script),
            "--steps",
            "25",
            "--checkpoint-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    losses = [float(line.split()[-1]) for line in lines if line.startswith("step ")]
    assert len(losses) == 25 and losses[-1] < losses[0] / 100
    assert "weights equal: True" in proc.stdout
    assert (tmp_path / "ckpt-25" / "manifest.json").is_file()


def test_sync_on_read_sum_splits_by_every_replica_in_sync_not_local_copies() -> None:
    # With one process per worker a variable holds only this worker's copies,
    # but TF stores value / N over all N replicas in sync.
    from types import SimpleNamespace

    from polydist._valuetypes.variables import _global_copies

    local_view = SimpleNamespace(
        _distribute_strategy=SimpleNamespace(num_replicas_in_sync=4), _values=(0, 1)
    )
    assert _global_copies(local_view) == 4
    assert _global_copies(SimpleNamespace(_distribute_strategy=None, _values=(0, 1, 2))) == 3


def test_multi_worker_example_runs_on_the_sim(tmp_path: Path) -> None:
    """examples/multi_worker_train.py's reference run (the engines' runs: their tests)."""
    script = REPO / "examples" / "multi_worker_train.py"
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(script), "--ckpt", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "worker 0: 4 replicas in sync, engine sim\n" in proc.stdout
    assert "worker 0: w = [0.9929, -1.9339, 0.4747, 2.9233]" in proc.stdout
    assert "largest difference from the sim: 0.00e+00" in proc.stdout
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-13", "ckpt-14", "ckpt-15"]


class _PlacingOnce(SimBackend):
    """The sim with `polydist.backend.SupportsPlaceVariable`, recording its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.variable_placements: list[str] = []

    def place_variable(self, value: Any, device: str) -> Any:
        self.variable_placements.append(device)
        return self.place(value, device)


@pytest.mark.parametrize("kind", ["mirrored", "one_device"])
def test_a_backend_places_variable_values_its_own_way(kind: str) -> None:
    backend = _PlacingOnce()
    strategy = (
        pd.MirroredStrategy(2, backend=backend)
        if kind == "mirrored"
        else pd.OneDeviceStrategy("/cpu:0", backend=backend)
    )
    devices = list(strategy.extended.worker_devices)
    with strategy.scope():
        v = pd.Variable(np.arange(3, dtype=np.float32))
    assert backend.variable_placements == devices
    v.assign(np.full(3, 5, np.float32))
    assert backend.variable_placements == devices * 2
    strategy.run(lambda: np.float32(1.0))  # a step places no variable value
    assert backend.variable_placements == devices * 2
    copies = v.values if kind == "mirrored" else (v,)
    assert [np.asarray(c.value()).tolist() for c in copies] == [[5.0, 5.0, 5.0]] * len(devices)
