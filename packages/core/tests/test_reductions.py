"""reduce, gather, all_reduce, all_gather and merge_call, with TF's exact values."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist.errors import InvalidArgumentError
from polydist_sim import SimBackend


def rid() -> int:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return int(ctx.replica_id_in_sync_group)


def per_replica(*values: Any) -> pd.PerReplica:
    return pd.PerReplica([np.asarray(v) for v in values])


class TestStrategyReduce:
    def test_docstring_sum_of_replica_ids(self) -> None:
        strategy = pd.MirroredStrategy(["GPU:0", "GPU:1"])
        ids = strategy.run(lambda: pd.get_replica_context().replica_id_in_sync_group)
        total = strategy.reduce("SUM", ids, axis=None)
        assert total.dtype == np.int32 and int(total) == 1

    def test_docstring_axis_none_vs_axis_zero(self) -> None:
        # Global batch 8 on 2 replicas: [0,1,2,3] and [4,5,6,7].
        strategy = pd.MirroredStrategy(2)
        value = per_replica(np.arange(4, dtype=np.float32), np.arange(4, 8, dtype=np.float32))
        np.testing.assert_array_equal(strategy.reduce("sum", value, axis=None), [4, 6, 8, 10])
        assert float(strategy.reduce("sum", value, axis=0)) == 28.0

    def test_docstring_partial_batch_mean_uses_true_denominator(self) -> None:
        strategy = pd.MirroredStrategy(2)
        value = per_replica(np.arange(4, dtype=np.float32), np.arange(4, 6, dtype=np.float32))
        mean = strategy.reduce(pd.ReduceOp.MEAN, value, axis=0)
        assert mean.dtype == np.float32 and float(mean) == 2.5  # 15 / 6, not (1.5 + 4.5) / 2
        with pytest.raises(InvalidArgumentError, match="same shape"):
            strategy.reduce("MEAN", value, axis=None)

    def test_reduce_sum_ones_is_n(self) -> None:
        # ReduceTest.testBasic, inside and outside scope.
        strategy = pd.MirroredStrategy(3)
        ones = strategy.experimental_distribute_values_from_function(
            lambda _: np.ones((), np.float32)
        )
        assert float(strategy.reduce("SUM", ones, axis=None)) == 3.0
        with strategy.scope():
            assert float(strategy.reduce("SUM", ones, axis=None)) == 3.0

    def test_reduce_axis_example(self) -> None:
        # ReduceTest.testAxis: [1, 2] per replica; MEAN axis 0 = 1.5, SUM = 3N.
        strategy = pd.MirroredStrategy(4)
        value = strategy.experimental_distribute_values_from_function(
            lambda _: np.array([1.0, 2.0], np.float32)
        )
        assert float(strategy.reduce("MEAN", value, axis=0)) == 1.5
        assert float(strategy.reduce("SUM", value, axis=0)) == 12.0

    def test_int_mean_is_float64_and_int_sum_stays_int32(self) -> None:
        strategy = pd.MirroredStrategy(3)
        value = per_replica(np.int32(1), np.int32(2), np.int32(3))
        mean = strategy.reduce("MEAN", value, axis=None)
        assert mean.dtype == np.float64 and float(mean) == 2.0
        total = strategy.reduce("SUM", value, axis=None)
        assert total.dtype == np.int32 and int(total) == 6

    def test_mean_with_axis_of_ints_is_float64(self) -> None:
        strategy = pd.MirroredStrategy(2)
        value = per_replica(np.array([1, 2, 3], np.int32), np.array([4], np.int32))
        got = strategy.reduce("MEAN", value, axis=0)
        assert got.dtype == np.float64 and float(got) == 2.5

    def test_empty_replica_batch_mean_with_axis(self) -> None:
        # range(10).batch(4) over 3 replicas: [8] [9] [] -> 8.5 exactly.
        strategy = pd.MirroredStrategy(3)
        value = per_replica(
            np.array([8.0], np.float32), np.array([9.0], np.float32), np.zeros(0, np.float32)
        )
        assert float(strategy.reduce("MEAN", value, axis=0)) == 8.5

    def test_tuple_axis_and_negative_axis(self) -> None:
        strategy = pd.MirroredStrategy(2)
        a = np.arange(6, dtype=np.float64).reshape(2, 3)
        value = per_replica(a, a + 1)
        assert float(strategy.reduce("SUM", value, axis=(0, 1))) == 15 + 21
        np.testing.assert_array_equal(strategy.reduce("SUM", value, axis=-1), [3 + 6, 12 + 15])
        assert float(strategy.reduce("MEAN", value, axis=(0, -1))) == 36 / 12

    def test_bad_axis(self) -> None:
        strategy = pd.MirroredStrategy(2)
        value = per_replica(np.ones(3), np.ones(3))
        with pytest.raises(ValueError, match=r"`axis` = 1 out of range for `value` with rank 1"):
            strategy.reduce("MEAN", value, axis=1)
        with pytest.raises(TypeError, match="Expected `axis` to be an integer"):
            strategy.reduce("SUM", value, axis=1.0)  # type: ignore[arg-type]

    def test_reduce_op_strings_are_case_insensitive(self) -> None:
        strategy = pd.MirroredStrategy(2)
        value = per_replica(np.float32(1), np.float32(3))
        for op in ("sum", "Sum", "SUM", pd.ReduceOp.SUM):
            assert float(strategy.reduce(op, value, axis=None)) == 4.0
        with pytest.raises(ValueError, match="not a valid ReduceOp"):
            strategy.reduce("MAX", value, axis=None)

    def test_reduce_in_replica_context_raises_runtime_error(self) -> None:
        strategy = pd.MirroredStrategy(2)
        message = (
            "Method requires being in cross-replica context, "
            r"use get_replica_context\(\).merge_call\(\)"
        )
        with pytest.raises(RuntimeError, match=message):
            strategy.run(lambda: strategy.reduce("SUM", 1.0, axis=None))
        # The strategy stays usable.
        assert strategy.run(rid).values == (0, 1)

    def test_reduce_of_non_distributed_value(self) -> None:
        strategy = pd.MirroredStrategy(2)
        assert float(strategy.reduce("MEAN", np.float32(5), axis=None)) == 5.0
        with pytest.raises(ValueError, match="cannot be reduced"):
            strategy.reduce("SUM", np.float32(5), axis=None)
        assert strategy.reduce("SUM", 0, axis=None) == 0
        # With an axis, TF runs the local sum on every replica: a plain value counts N times.
        assert float(strategy.reduce("SUM", np.ones(3, np.float32), axis=0)) == 6.0

    def test_reduce_mirrored_mean_returns_primary(self) -> None:
        strategy = pd.MirroredStrategy(2)
        m = pd.Mirrored([np.float32(2), np.float32(2)])
        assert float(strategy.reduce("MEAN", m, axis=None)) == 2.0
        with pytest.raises(ValueError, match="Cannot SUM a Mirrored"):
            strategy.reduce("SUM", m, axis=None)

    def test_reduce_nest(self) -> None:
        strategy = pd.MirroredStrategy(2)
        out = strategy.reduce(
            "SUM", {"a": per_replica(1.0, 2.0), "b": [per_replica(3, 4)]}, axis=None
        )
        assert float(out["a"]) == 3.0 and int(out["b"][0]) == 7


class TestExactReduction:
    def test_sum_is_correctly_rounded_and_independent_of_replica_count(self) -> None:
        big, one = np.float32(1e8), np.float32(1.0)
        for n in (3, 5, 8):
            strategy = pd.MirroredStrategy(n)
            values = [big, one, -big] + [np.float32(0.0)] * (n - 3)
            total = strategy.reduce("SUM", pd.PerReplica(values), axis=None)
            assert float(total) == 1.0  # a float32 left-to-right sum gives 0.0

    def test_sequential_order_reproduces_left_to_right_float32(self) -> None:
        from polydist_sim import SimBackend

        strategy = pd.MirroredStrategy(3, backend=SimBackend("sequential"))
        values = [np.float32(1e8), np.float32(1.0), np.float32(-1e8)]
        total = strategy.reduce("SUM", pd.PerReplica(values), axis=None)
        assert float(total) == 0.0

    def test_deterministic_bitwise(self) -> None:
        rng = np.random.default_rng(1)
        data = [rng.normal(size=1000).astype(np.float32) * 10.0**k for k in range(-3, 5)]
        strategy = pd.MirroredStrategy(8)
        first = strategy.reduce("SUM", pd.PerReplica(data), axis=None)
        for _ in range(3):
            again = strategy.reduce("SUM", pd.PerReplica(data), axis=None)
            assert again.tobytes() == first.tobytes()
        reordered = strategy.reduce("SUM", pd.PerReplica(data[::-1]), axis=None)
        assert reordered.tobytes() == first.tobytes()


class TestAllReduce:
    def test_two_device_scalar_and_matrix(self) -> None:
        # TwoDeviceDistributionTestBase: inputs [1,3] and [[39,2],[3,41]].
        strategy = pd.MirroredStrategy(2)
        scalars = per_replica(np.float32(1), np.float32(3))
        matrices = per_replica(np.array([39.0, 2.0], np.float32), np.array([3.0, 41.0], np.float32))

        def fn(s: Any, m: Any) -> Any:
            ctx = pd.get_replica_context()
            return ctx.all_reduce("SUM", (s, m)), ctx.all_reduce("MEAN", (s, m))

        (s_sum, m_sum), (s_mean, m_mean) = strategy.run(fn, args=(scalars, matrices))
        for r in range(2):
            assert float(s_sum.values[r]) == 4.0
            np.testing.assert_array_equal(m_sum.values[r], [42.0, 43.0])
            assert float(s_mean.values[r]) == 2.0
            np.testing.assert_array_equal(m_mean.values[r], [21.0, 21.5])

    def test_docstring_nest_with_python_ints(self) -> None:
        strategy = pd.MirroredStrategy(2)
        values = [{"a": 1, "b": [40, 1]}, {"a": 3, "b": [2, 98]}]
        total = strategy.run(lambda: pd.get_replica_context().all_reduce("SUM", values[rid()]))
        mean = strategy.run(lambda: pd.get_replica_context().all_reduce("MEAN", values[rid()]))
        for r in range(2):
            assert int(total["a"].values[r]) == 4 and total["a"].values[r].dtype == np.int32
            assert [int(v.values[r]) for v in total["b"]] == [42, 99]
            assert mean["a"].values[r].dtype == np.float64 and float(mean["a"].values[r]) == 2.0
            assert [float(v.values[r]) for v in mean["b"]] == [21.0, 49.5]

    def test_every_replica_gets_its_own_copy(self) -> None:
        strategy = pd.MirroredStrategy(3)
        out = strategy.run(lambda: pd.get_replica_context().all_reduce("SUM", np.ones(2)))
        assert isinstance(out, pd.PerReplica)
        assert len({id(v) for v in out.values}) == 3

    def test_single_replica_mean_of_int_is_identity_like_tf(self) -> None:
        strategy = pd.MirroredStrategy(1)
        out = strategy.run(lambda: pd.get_replica_context().all_reduce("MEAN", np.int32(3)))
        assert out.dtype == np.int32 and int(out) == 3


class TestGather:
    def test_docstring_gather_axis0(self) -> None:
        strategy = pd.MirroredStrategy(["GPU:0", "GPU:1"])
        values = strategy.experimental_distribute_values_from_function(
            lambda _: np.array([[1], [2]], np.int32)
        )
        got = strategy.gather(values, axis=0)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, [[1], [2], [1], [2]])

    @pytest.mark.parametrize(("axis", "shape"), [(0, (4, 2, 3)), (1, (1, 8, 3)), (2, (1, 2, 12))])
    def test_docstring_gather_axes(self, axis: int, shape: tuple[int, ...]) -> None:
        strategy = pd.MirroredStrategy(4)
        single = np.arange(6, dtype=np.int32).reshape(1, 2, 3)
        values = strategy.experimental_distribute_values_from_function(lambda _: single.copy())
        got = strategy.gather(values, axis=axis)
        assert got.shape == shape
        np.testing.assert_array_equal(got, np.concatenate([single] * 4, axis=axis))

    def test_gather_allows_uneven_sizes_and_nests(self) -> None:
        strategy = pd.MirroredStrategy(2)
        value = {"a": per_replica([1], [2, 3]), "b": per_replica([[0, 1]], [[2, 3], [4, 5]])}
        got = strategy.gather(value, axis=0)
        np.testing.assert_array_equal(got["a"], [1, 2, 3])
        np.testing.assert_array_equal(got["b"], [[0, 1], [2, 3], [4, 5]])

    def test_gather_in_replica_context_raises(self) -> None:
        strategy = pd.MirroredStrategy(2)
        with pytest.raises(RuntimeError, match=r"use get_replica_context\(\).all_gather\(\)"):
            strategy.run(lambda: strategy.gather(np.ones(1), axis=0))

    def test_gather_scalar_and_mismatch_errors(self) -> None:
        strategy = pd.MirroredStrategy(2)
        with pytest.raises(InvalidArgumentError, match="rank >= 1"):
            strategy.gather(per_replica(1.0, 2.0), axis=0)
        with pytest.raises(InvalidArgumentError, match="all dimensions except axis 0"):
            strategy.gather(per_replica(np.ones((1, 2)), np.ones((1, 3))), axis=0)

    def test_gather_plain_value_is_returned(self) -> None:
        strategy = pd.MirroredStrategy(2)
        value = np.ones(2)
        assert strategy.gather(value, axis=0) is value

    def test_gather_and_all_gather_refuse_indexed_slices(self) -> None:
        # TF: "gather does not support IndexedSlices" / "all_gather does not support
        # IndexedSlices", NotImplementedError, for a plain or a per-replica one.
        def slices() -> pd.IndexedSlices:
            return pd.IndexedSlices(np.ones((1, 2)), np.array([0]), (3, 2))

        for strategy in (pd.MirroredStrategy(2), pd.OneDeviceStrategy("/cpu:0")):
            for value in (slices(), strategy.run(slices), {"a": [np.ones(1), slices()]}):
                with pytest.raises(NotImplementedError, match="^gather does not support Indexed"):
                    strategy.gather(value, axis=0)
            with pytest.raises(NotImplementedError, match="^all_gather does not support Indexed"):
                strategy.run(lambda: pd.get_replica_context().all_gather([slices()], axis=0))
        mirrored = pd.MirroredStrategy(2)
        per_replica = mirrored.run(slices)
        with pytest.raises(NotImplementedError, match="got a PerReplica of them"):
            mirrored.gather(per_replica, axis=0)
        with pytest.raises(NotImplementedError, match="gather does not support Indexed"):
            pd.get_strategy().gather(slices(), axis=0)

    def test_all_gather_docstring(self) -> None:
        strategy = pd.MirroredStrategy(["GPU:0", "GPU:1"])

        def fn() -> Any:
            ctx = pd.get_replica_context()
            return ctx.all_gather([np.array([1, 2, 3]), np.array([[1, 2], [3, 4]])], axis=0)

        first, second = strategy.run(fn)
        for r in range(2):
            np.testing.assert_array_equal(first.values[r], [1, 2, 3, 1, 2, 3])
            np.testing.assert_array_equal(second.values[r], [[1, 2], [3, 4], [1, 2], [3, 4]])

    def test_all_gather_uneven_along_axis(self) -> None:
        strategy = pd.MirroredStrategy(3)

        def fn() -> Any:
            r = rid()
            return pd.get_replica_context().all_gather(np.full((r + 1, 2), r), axis=0)

        out = strategy.run(fn)
        expected = [[0, 0], [1, 1], [1, 1], [2, 2], [2, 2], [2, 2]]
        for v in out.values:
            np.testing.assert_array_equal(v, expected)


class TestVariablesWithAxisAndGather:
    """reduce(axis=...) and gather read a variable as TF's per-replica ``reduce_sum(v, axis)``
    does: each replica's own copy (a plain variable: the same value on every replica)."""

    @staticmethod
    def variables(strategy: pd.Strategy) -> tuple[Any, Any, Any]:
        f32 = np.float32
        with strategy.scope():
            mv = pd.Variable(np.array([1.0, 2.0], f32), aggregation=pd.VariableAggregation.MEAN)
            sv = pd.Variable(
                np.array([1.0, 2.0], f32),
                synchronization=pd.VariableSynchronization.ON_READ,
                aggregation=pd.VariableAggregation.SUM,
            )
        pv = pd.Variable(np.array([1.0, 2.0], f32))
        # The sync-on-read copies differ: [1, 2], [2, 4], [3, 6].
        strategy.run(lambda: sv.assign(sv * np.float32(rid() + 1)))
        return mv, sv, pv

    def test_reduce_with_axis(self) -> None:
        strategy = pd.MirroredStrategy(3)
        mv, sv, pv = self.variables(strategy)
        for op, var, expected in [
            ("SUM", mv, 9.0),
            ("MEAN", mv, 1.5),
            ("SUM", sv, 18.0),
            ("MEAN", sv, 3.0),
            ("SUM", pv, 9.0),  # counted once on each replica
            ("MEAN", pv, 1.5),
        ]:
            got = strategy.reduce(op, var, axis=0)
            assert got.dtype == np.float32 and float(got) == expected, (op, var.name)
        np.testing.assert_array_equal(strategy.reduce("SUM", sv, axis=None), [6.0, 12.0])

    def test_gather(self) -> None:
        strategy = pd.MirroredStrategy(3)
        mv, sv, pv = self.variables(strategy)
        np.testing.assert_array_equal(strategy.gather(mv, axis=0), [1, 2, 1, 2, 1, 2])
        np.testing.assert_array_equal(strategy.gather(sv, axis=0), [1, 2, 2, 4, 3, 6])
        assert strategy.gather(pv, axis=0) is pv  # not distributed: returned as it is (TF)

    def test_one_replica_gather_is_a_read_not_the_storage(self) -> None:
        strategy = pd.MirroredStrategy(1)
        with strategy.scope():
            mv = pd.Variable(np.array([1.0, 2.0], np.float32))
        got = strategy.gather(mv, axis=0)
        np.testing.assert_array_equal(got, [1.0, 2.0])
        assert not np.shares_memory(got, mv.values[0].value())


class TestMergeCall:
    def test_merge_fn_runs_once_in_cross_replica_context(self) -> None:
        strategy = pd.MirroredStrategy(3)
        calls: list[Any] = []

        def merge_fn(s: pd.Strategy, value: Any) -> Any:
            calls.append((s is strategy, pd.in_cross_replica_context(), pd.get_replica_context()))
            return s.reduce("SUM", value, axis=None)

        def fn() -> Any:
            return pd.get_replica_context().merge_call(merge_fn, args=(np.float32(rid() + 1),))

        out = strategy.run(fn)
        assert calls == [(True, True, None)]
        assert float(out) == 6.0

    def test_merge_call_hands_back_per_replica_components(self) -> None:
        strategy = pd.MirroredStrategy(2)

        def fn() -> Any:
            value = pd.get_replica_context().merge_call(
                lambda s, v: pd.PerReplica([v.values[1], v.values[0]]), args=(rid(),)
            )
            return value

        assert strategy.run(fn).values == (1, 0)

    def test_merge_call_kwargs_and_identical_args(self) -> None:
        strategy = pd.MirroredStrategy(2)
        shared = object()

        def fn() -> Any:
            return pd.get_replica_context().merge_call(
                lambda s, *, a, b: (a is shared, isinstance(b, pd.PerReplica)),
                kwargs={"a": shared, "b": rid()},
            )

        assert strategy.run(fn) == (True, True)

    def test_merge_call_outside_replica_context_raises(self) -> None:
        strategy = pd.MirroredStrategy(2)
        ctx = strategy.run(lambda: pd.get_replica_context()).values[0]
        with pytest.raises(RuntimeError, match="call_for_each_replica"), strategy.scope():
            ctx.merge_call(lambda s: None)


class TestExceptions:
    @pytest.mark.parametrize("where", ["fn", "fn-after-collective", "merge_fn"])
    def test_exceptions_propagate_with_their_class(self, where: str) -> None:
        strategy = pd.MirroredStrategy(4)

        class Boom(Exception):
            pass

        def merge_fn(s: Any) -> None:
            raise Boom("in merge_fn")

        def fn() -> Any:
            r = rid()
            if where == "fn" and r == 2:
                raise Boom("in fn")
            if where == "fn-after-collective":
                pd.get_replica_context().all_reduce("SUM", 1.0)
                if r == 3:
                    raise Boom("after")
            if where == "merge_fn":
                pd.get_replica_context().merge_call(merge_fn)
            return r

        with pytest.raises(Boom):
            strategy.run(fn)
        assert strategy.run(rid).values == (0, 1, 2, 3)

    def test_user_except_exception_does_not_swallow_the_abort(self) -> None:
        strategy = pd.MirroredStrategy(2)

        class Boom(Exception):
            pass

        def fn() -> Any:
            if rid() == 1:
                raise Boom()
            try:
                return pd.get_replica_context().all_reduce("SUM", 1.0)
            except Exception:  # user code that catches broadly
                return "swallowed"

        with pytest.raises(Boom):
            strategy.run(fn)


def test_int32_sum_with_axis_stays_int32() -> None:
    strategy = pd.MirroredStrategy(2)
    value = per_replica(np.array([1, 2], np.int32), np.array([3], np.int32))
    total = strategy.reduce("SUM", value, axis=0)
    assert total.dtype == np.int32 and int(total) == 6


def test_mean_with_axis_over_all_empty_batches_is_nan_like_tf() -> None:
    strategy = pd.MirroredStrategy(2)
    value = per_replica(np.zeros(0, np.float32), np.zeros(0, np.float32))
    assert np.isnan(strategy.reduce("MEAN", value, axis=0))


class _CountingSim(SimBackend):
    """The sim, counting the calls of its summing collectives."""

    def __init__(self) -> None:
        super().__init__()
        self.sums = 0

    def all_reduce(self, values: Any, destinations: Any) -> list[Any]:
        self.sums += 1
        return super().all_reduce(values, destinations)

    def reduce_to(self, values: Any, destination: str) -> Any:
        self.sums += 1
        return super().reduce_to(values, destination)


BOOL_MESSAGE = r"cannot SUM bool replica values: got bool\[2\] for ReduceOp\.{op}"


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_non_numeric_dtypes_are_refused_by_core(op: str) -> None:
    """Not numbers to TF's add_n: refused before any backend sums (bfloat16 and float8,
    ml_dtypes' floats, are summed: see the sim's ml_dtypes tests)."""
    backend = _CountingSim()
    strategy = pd.MirroredStrategy(2, backend=backend)
    for values, name in (
        (per_replica(np.array(["a", "b"]), np.array(["c", "d"])), "<U1"),
        (per_replica(*[np.array(["2026-01-01"], "datetime64[D]")] * 2), "datetime64\\[D\\]"),
    ):
        with pytest.raises(TypeError, match=f"cannot SUM replica values of dtype {name}: got"):
            strategy.reduce(op, values, axis=None)
        with pytest.raises(TypeError, match="SUM and MEAN take integer, floating"):
            strategy.run(lambda v: pd.get_replica_context().all_reduce(op, v), args=(values,))
    assert backend.sums == 0


class TestBoolIsNotSummable:
    """TF's add_n refuses bool, and MEAN sums first: core refuses before any backend sums."""

    @pytest.mark.parametrize("op", ["SUM", "MEAN"])
    def test_strategy_reduce(self, op: str) -> None:
        backend = _CountingSim()
        strategy = pd.MirroredStrategy(2, backend=backend)
        flags = per_replica(np.array([True, False]), np.array([True, True]))
        with pytest.raises(TypeError, match=BOOL_MESSAGE.format(op=op)):
            strategy.reduce(op, flags, axis=None)
        with pytest.raises(TypeError, match=BOOL_MESSAGE.format(op=op)):
            strategy.extended.reduce_to(op, flags, destinations=flags)
        with pytest.raises(TypeError, match=BOOL_MESSAGE.format(op=op)):
            strategy.extended.batch_reduce_to(op, [(flags, "/cpu:0")])
        assert backend.sums == 0
        # The fix the message gives: an int32 SUM counts, its MEAN is float64.
        counts = pd.PerReplica([np.asarray(f).astype("int32") for f in flags.values])
        np.testing.assert_array_equal(strategy.reduce("SUM", counts, axis=None), [2, 1])
        mean = strategy.reduce("MEAN", counts, axis=None)
        assert mean.dtype == np.float64
        np.testing.assert_array_equal(mean, [1.0, 0.5])

    @pytest.mark.parametrize("replicas", [1, 2])
    def test_reduce_with_axis(self, replicas: int) -> None:
        # The local reduce_sum over the axis is a SUM of bools too (TF refuses it).
        strategy = pd.MirroredStrategy(replicas)
        flags = pd.PerReplica([np.array([True, False])] * replicas)
        for op in ("SUM", "MEAN"):
            with pytest.raises(TypeError, match=BOOL_MESSAGE.format(op=op)):
                strategy.reduce(op, flags, axis=0)

    @pytest.mark.parametrize("op", ["SUM", "MEAN"])
    def test_all_reduce_in_replica_context(self, op: str) -> None:
        backend = _CountingSim()
        strategy = pd.MirroredStrategy(3, backend=backend)

        def fn() -> Any:
            ctx = pd.get_replica_context()
            assert ctx is not None
            return ctx.all_reduce(op, {"n": 1.0, "flag": np.array([True, False])})

        with pytest.raises(TypeError, match=BOOL_MESSAGE.format(op=op)):
            strategy.run(fn)
        assert backend.sums == 0

    def test_cross_device_ops(self) -> None:
        strategy = pd.MirroredStrategy(2)
        flags = per_replica(np.array([True, False]), np.array([False, False]))
        for ops in (pd.NcclAllReduce(), pd.HierarchicalCopyAllReduce(), pd.ReductionToOneDevice()):
            with strategy.scope():
                with pytest.raises(TypeError, match=BOOL_MESSAGE.format(op="SUM")):
                    ops.reduce("SUM", flags, destinations=flags)
                with pytest.raises(TypeError, match=BOOL_MESSAGE.format(op="MEAN")):
                    ops.reduce("MEAN", flags, destinations="/cpu:0")
        with_ops = pd.MirroredStrategy(2, cross_device_ops=pd.NcclAllReduce())
        with pytest.raises(TypeError, match=BOOL_MESSAGE.format(op="SUM")):
            with_ops.reduce("SUM", flags, axis=None)
        # A user's accumulation_fn replaces add_n and decides what it accepts (TF).
        any_of = pd.ReductionToOneDevice(accumulation_fn=lambda xs: np.logical_or.reduce(xs))
        with strategy.scope():
            np.testing.assert_array_equal(any_of.reduce("SUM", flags, "/cpu:0"), [True, False])
