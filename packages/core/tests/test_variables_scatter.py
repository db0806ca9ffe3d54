"""Sparse variable updates: IndexedSlices and the scatter_* methods, with TF's values.

The scatter_nd expected arrays are the examples of TF's ``tf.Variable.scatter_nd_*``
docstrings; the distributed rules are TF's ``values.py`` (MirroredVariable routes
scatter_* through ``_update`` like assign, and refuses an aggregated
scatter_min/max/update; SyncOnReadVariable refuses every scatter).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist._valuetypes import variables as _variables
from polydist.errors import InvalidArgumentError

VA = pd.VariableAggregation
IS = pd.IndexedSlices
SCATTERS = [
    "scatter_add",
    "scatter_sub",
    "scatter_mul",
    "scatter_div",
    "scatter_min",
    "scatter_max",
    "scatter_update",
]


def rid() -> int:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return int(ctx.replica_id_in_sync_group)


def copies(v: Any) -> list[Any]:
    return [c.numpy().tolist() for c in v.values]


def f32(*values: float) -> np.ndarray:
    return np.array(values, np.float32)


# -- IndexedSlices ------------------------------------------------------------------------------


def test_indexed_slices_holds_values_indices_and_dense_shape() -> None:
    s = IS([[1.0, 2.0]], [3], dense_shape=[5, 2])
    assert s.values.dtype == np.float32 and s.values.tolist() == [[1.0, 2.0]]  # TF's dtypes
    assert s.indices.dtype == np.int32 and s.indices.tolist() == [3]
    assert s.dense_shape == (5, 2) and s.dtype == np.float32
    assert IS(f32(1.0), np.array([0], np.int64)).dense_shape is None
    assert repr(IS(f32(1.0), [0])).startswith("IndexedSlices(indices=array([0]")
    with pytest.raises(TypeError, match=r"indices must be integers, got float32\[1\]"):
        IS(f32(1.0), f32(0.0))
    with pytest.raises(TypeError, match="dense_shape must be a sequence of ints"):
        IS(f32(1.0), [0], dense_shape=3)


# -- single-copy variables -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        ("scatter_add", [1, 12, 3, 9]),
        ("scatter_sub", [1, -8, 3, -1]),
        ("scatter_mul", [1, 20, 3, 20]),
        ("scatter_div", [1, 0.2, 3, 0.8]),
        ("scatter_min", [1, 2, 3, 4]),
        ("scatter_max", [1, 10, 3, 5]),
        ("scatter_update", [1, 10, 3, 5]),
    ],
)
def test_scatter_methods(method: str, expected: list[float]) -> None:
    v = pd.Variable(f32(1, 2, 3, 4))
    assert getattr(v, method)(IS(f32(10, 5), [1, 3])) is v  # returns the variable, as assign
    np.testing.assert_array_equal(v.numpy(), f32(*expected))


def test_repeated_indices_apply_every_update_in_order() -> None:
    v = pd.Variable(f32(1, 1, 1))
    v.scatter_add(IS(f32(1, 2, 4), [0, 0, 2]))
    assert v.numpy().tolist() == [4, 1, 5]
    v.scatter_mul(IS(f32(2, 3), [0, 0]))
    assert v.numpy().tolist() == [24, 1, 5]
    v.scatter_update(IS(f32(7, 8), [1, 1]))  # the last update wins, as TF's CPU kernel
    assert v.numpy().tolist() == [24, 8, 5]
    v.scatter_min(IS(f32(6, 30), [0, 0]))
    assert v.numpy().tolist() == [6, 8, 5]


def test_rows_of_a_matrix_scalar_updates_and_nd_indices() -> None:
    v = pd.Variable(np.arange(6, dtype=np.float32).reshape(3, 2))
    v.scatter_add(IS(f32(10, 20).reshape(1, 2), [2]))
    assert v.numpy().tolist() == [[0, 1], [2, 3], [14, 25]]
    v.scatter_update(IS(np.float32(-1), [0, 1]))  # a scalar goes to every named row (TF)
    assert v.numpy().tolist() == [[-1, -1], [-1, -1], [14, 25]]
    # Indices of shape (2, 1): values of shape (2, 1, 2).
    v.scatter_sub(IS(np.ones((2, 1, 2), np.float32), np.array([[0], [2]])))
    assert v.numpy().tolist() == [[-2, -2], [-1, -1], [13, 24]]


def test_values_are_converted_to_the_variables_dtype_without_narrowing() -> None:
    v = pd.Variable(np.zeros(3, np.float64))
    v.scatter_add(IS(np.array([1, 2], np.int32), [0, 2]))
    assert v.dtype == np.float64 and v.numpy().tolist() == [1, 0, 2]
    ints = pd.Variable(np.zeros(3, np.int32))
    with pytest.raises(TypeError, match=r"Cannot scatter_add values of dtype float32 into .*int32"):
        ints.scatter_add(IS(f32(1.5), [0]))
    ints.scatter_add(IS([4], [1]))  # Python ints are int32
    assert ints.dtype == np.int32 and ints.numpy().tolist() == [0, 4, 0]


def test_integer_scatter_div_truncates_toward_zero() -> None:
    v = pd.Variable(np.array([7, -7, 7, 9], np.int32))
    v.scatter_div(IS(np.array([2, 2, -2, 2], np.int32), [0, 1, 2, 3]))
    assert v.numpy().tolist() == [3, -3, -3, 4]
    v.scatter_div(IS(np.array([2, 2], np.int32), [3, 3]))  # (4 / 2) / 2
    assert v.numpy().tolist() == [3, -3, -3, 1]
    with pytest.raises(InvalidArgumentError, match="integer division by zero"):
        v.scatter_div(IS(np.array([0], np.int32), [0]))
    assert v.numpy().tolist() == [3, -3, -3, 1]  # unchanged


def test_bad_sparse_deltas_are_clear_errors_and_change_nothing() -> None:
    v = pd.Variable(f32(1, 2, 3, 4), name="v")
    with pytest.raises(InvalidArgumentError, match=r"'v:0': indices\[1\] = 4 is not in \[0, 4\)"):
        v.scatter_add(IS(f32(1, 1), [0, 4]))
    with pytest.raises(InvalidArgumentError, match=r"indices\[0\] = -1 is not in \[0, 4\)"):
        v.scatter_update(IS(f32(1), [-1]))
    with pytest.raises(InvalidArgumentError, match=r"shape indices.shape \+ variable.shape\[1:\]"):
        v.scatter_add(IS(f32(1, 2, 3), [0, 1]))
    with pytest.raises(TypeError, match=r"sparse_delta must be a polydist.IndexedSlices.*ndarray"):
        v.scatter_add(f32(1, 2, 3, 4))  # type: ignore[arg-type]
    assert v.numpy().tolist() == [1, 2, 3, 4]
    scalar = pd.Variable(1.0)
    with pytest.raises(InvalidArgumentError, match="is a scalar, which has no rows"):
        scalar.scatter_add(IS(f32(1), [0]))


def test_dtypes_the_scatter_kernels_refuse() -> None:
    flags = pd.Variable(np.array([True, False]))
    with pytest.raises(TypeError, match="scatter_add cannot update variable .* of dtype bool"):
        flags.scatter_add(IS(np.array([True]), [1]))
    flags.scatter_update(IS(np.array([True]), [1]))
    assert flags.numpy().tolist() == [True, True]
    z = pd.Variable(np.array([1 + 1j, 2], np.complex64))
    with pytest.raises(TypeError, match="scatter_max cannot update .*complex64.*real numbers"):
        z.scatter_max(IS(np.array([3 + 0j], np.complex64), [0]))
    z.scatter_mul(IS(np.array([1j], np.complex64), [0]))
    assert z.numpy().tolist() == [-1 + 1j, 2]


def test_batch_scatter_update() -> None:
    v = pd.Variable(np.zeros((2, 3), np.float32))
    # variable[b, indices[b, j]] = values[b, j]
    v.batch_scatter_update(IS(f32(1, 2, 3, 4).reshape(2, 2), np.array([[0, 2], [1, 1]])))
    assert v.numpy().tolist() == [[1, 0, 2], [0, 4, 0]]
    # 1-D indices: scatter_update.
    w = pd.Variable(np.zeros((3, 2), np.float32))
    w.batch_scatter_update(IS(np.ones((1, 2), np.float32), [2]))
    assert w.numpy().tolist() == [[0, 0], [0, 0], [1, 1]]
    with pytest.raises(InvalidArgumentError, match=r"indices\[1\] = \[1, 3\] does not index"):
        v.batch_scatter_update(IS(f32(1, 1).reshape(2, 1), np.array([[0], [3]])))
    with pytest.raises(InvalidArgumentError, match=r"got indices of shape \(2, 1\) and values"):
        v.batch_scatter_update(IS(f32(1, 1), np.array([[0], [1]])))
    assert v.numpy().tolist() == [[1, 0, 2], [0, 4, 0]]


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        ("scatter_nd_add", [1, 13, 3, 14, 14, 6, 7, 20]),
        ("scatter_nd_sub", [1, -9, 3, -6, -4, 6, 7, -4]),
        ("scatter_nd_update", [1, 11, 3, 10, 9, 6, 7, 12]),
    ],
)
def test_scatter_nd_docstring_examples(method: str, expected: list[int]) -> None:
    # TF: ref = [1, 2, 3, 4, 5, 6, 7, 8], indices [[4], [3], [1], [7]], updates [9, 10, 11, 12].
    ref = pd.Variable(np.arange(1, 9, dtype=np.int32))
    assert getattr(ref, method)(np.array([[4], [3], [1], [7]]), [9, 10, 11, 12]) is ref
    assert ref.numpy().tolist() == expected


def test_scatter_nd_elements_slices_and_errors() -> None:
    v = pd.Variable(np.zeros((3, 2), np.float32), name="m")
    v.scatter_nd_update(np.array([[0, 1], [2, 0]]), f32(5, 6))  # K = 2: elements
    assert v.numpy().tolist() == [[0, 5], [0, 0], [6, 0]]
    v.scatter_nd_add(np.array([[1], [1]]), np.ones((2, 2), np.float32))  # K = 1: rows, twice
    assert v.numpy().tolist() == [[0, 5], [2, 2], [6, 0]]
    with pytest.raises(InvalidArgumentError, match=r"indices must have shape \[..., K\]"):
        v.scatter_nd_add(np.array([[0, 0, 0]]), f32(1))
    with pytest.raises(InvalidArgumentError, match=r"updates must have shape .* = \(1,\), got"):
        v.scatter_nd_add(np.array([[0, 0]]), f32(1, 2))
    with pytest.raises(InvalidArgumentError, match=r"indices\[0\] = \[3, 1\] does not index"):
        v.scatter_nd_update(np.array([[3, 1]]), f32(1))
    with pytest.raises(TypeError, match="indices must be integers, got dtype float64"):
        v.scatter_nd_update(np.array([[0.0, 1.0]]), f32(1))
    assert v.numpy().tolist() == [[0, 5], [2, 2], [6, 0]]


def test_one_device_strategy_variables_are_plain() -> None:
    strategy = pd.OneDeviceStrategy("/gpu:0")
    with strategy.scope():
        v = pd.Variable(f32(0, 0), aggregation=VA.SUM)
    strategy.run(lambda: v.scatter_add(IS(f32(2), [1])))
    assert v.numpy().tolist() == [0, 2]


# -- MirroredVariable ------------------------------------------------------------------------------


def mirrored(strategy: pd.Strategy, value: Any, **kwargs: Any) -> Any:
    with strategy.scope():
        return pd.Variable(value, **kwargs)


def test_cross_replica_scatter_updates_every_copy() -> None:
    strategy = pd.MirroredStrategy(3)
    v = mirrored(strategy, f32(0, 0, 0), aggregation=VA.SUM)
    result = v.scatter_add(IS(f32(1, 2), [0, 2]))
    assert copies(v) == [[1, 0, 2]] * 3
    assert isinstance(result, pd.Mirrored) and result.values[2].tolist() == [1, 0, 2]
    outside = v.scatter_sub(IS(f32(1), [2]))  # outside the scope too (TF's testAssignOutOfScope)
    assert copies(v) == [[1, 0, 1]] * 3 and isinstance(outside, pd.Mirrored)


@pytest.mark.parametrize(
    ("aggregation", "row0"),
    [
        # Replica r adds 3 (r + 1) to row 0. SUM: every replica's rows (3 + 6 + 9);
        # MEAN: their values divided by 3 (1 + 2 + 3); ONLY_FIRST_REPLICA: replica 0's.
        (VA.SUM, 18.0),
        (VA.MEAN, 6.0),
        (VA.ONLY_FIRST_REPLICA, 3.0),
    ],
)
def test_replica_context_scatter_aggregates_like_assign(aggregation: Any, row0: float) -> None:
    strategy = pd.MirroredStrategy(3)
    v = mirrored(strategy, f32(0, 0), aggregation=aggregation)

    def step() -> Any:
        return v.scatter_add(IS(f32(3 * (rid() + 1)), [0]))

    out = strategy.run(step)
    assert copies(v) == [[row0, 0]] * 3
    assert [np.asarray(x).tolist() for x in out.values] == [[row0, 0]] * 3


def test_replica_context_scatter_without_aggregation_writes_own_copy() -> None:
    strategy = pd.MirroredStrategy(3)
    v = mirrored(strategy, f32(0, 0, 0), name="w")
    with pytest.warns(pd.ReplicaDivergenceWarning, match=r"'w:0'.*replica\(s\) 1, 2 differ"):
        strategy.run(lambda: v.scatter_update(IS(f32(rid() + 1), [rid()])))
    assert copies(v) == [[1, 0, 0], [0, 2, 0], [0, 0, 3]]


def test_only_first_replica_scatter_update_uses_replica_0s_rows() -> None:
    strategy = pd.MirroredStrategy(3, cross_device_ops=pd.NcclAllReduce())
    v = mirrored(strategy, f32(0, 0, 0), aggregation=VA.ONLY_FIRST_REPLICA)
    strategy.run(lambda: v.scatter_update(IS(f32(rid() + 1), [rid()])))
    assert copies(v) == [[1, 0, 0]] * 3


def test_sum_scatter_with_cross_device_ops_gathers_the_rows() -> None:
    strategy = pd.MirroredStrategy(2, cross_device_ops=pd.HierarchicalCopyAllReduce())
    v = mirrored(strategy, f32(0, 0), aggregation=VA.SUM)
    strategy.run(lambda: v.scatter_add(IS(f32(rid() + 1, 10), [rid(), 1])))
    assert copies(v) == [[1, 22]] * 2  # row 1: 10 + 2 + 10


def test_same_delta_on_every_replica_follows_the_assign_rule() -> None:
    strategy = pd.MirroredStrategy(2)
    delta = IS(f32(4), [1])  # one object, captured from outside: not per-replica
    summed = mirrored(strategy, f32(0, 0), aggregation=VA.SUM)
    with pytest.raises(ValueError, match="cannot be reduced with the given reduce op"):
        strategy.run(lambda: summed.scatter_add(delta))
    averaged = mirrored(strategy, f32(0, 0), aggregation=VA.MEAN)
    strategy.run(lambda: averaged.scatter_add(delta))
    assert copies(averaged) == [[0, 4]] * 2


@pytest.mark.parametrize("method", ["scatter_min", "scatter_max", "scatter_update"])
@pytest.mark.parametrize("aggregation", [VA.SUM, VA.MEAN])
def test_aggregated_min_max_update_are_refused_like_tf(method: str, aggregation: Any) -> None:
    strategy = pd.MirroredStrategy(2)
    v = mirrored(strategy, f32(0, 0), aggregation=aggregation)
    message = (
        f"{method} is only supported for mirrored variable .* with NONE or "
        f"`ONLY_FIRST_REPLICA` aggregation, got: {aggregation}"
    )
    with pytest.raises(NotImplementedError, match=message):
        getattr(v, method)(IS(f32(1), [0]))
    with pytest.raises(NotImplementedError, match=message):
        strategy.run(lambda: getattr(v, method)(IS(f32(1), [0])))
    assert copies(v) == [[0, 0]] * 2


@pytest.mark.parametrize(
    ("method", "args"),
    [
        ("batch_scatter_update", (IS(f32(1), [0]),)),
        ("scatter_nd_add", (np.array([[0]]), f32(1))),
        ("scatter_nd_sub", (np.array([[0]]), f32(1))),
        ("scatter_nd_update", (np.array([[0]]), f32(1))),
    ],
)
def test_distributed_variables_do_not_implement_the_other_sparse_writes(
    method: str, args: tuple[Any, ...]
) -> None:
    # TF's distributed variables inherit these from tf.Variable, which raises.
    strategy = pd.MirroredStrategy(2)
    v = mirrored(strategy, f32(0, 0), name="v")
    with pytest.raises(
        NotImplementedError, match=f"MirroredVariable 'v:0' does not support `{method}`"
    ):
        getattr(v, method)(*args)
    # The way the message gives: each copy is a plain variable.
    strategy.extended.update(v, lambda copy, *a: getattr(copy, method)(*a), args=args)
    assert copies(v) == [[1 if method != "scatter_nd_sub" else -1, 0]] * 2


def test_scatter_inside_update_acts_on_the_copy() -> None:
    strategy = pd.MirroredStrategy(2)
    v = mirrored(strategy, f32(0, 0), aggregation=VA.SUM)
    deltas = pd.PerReplica([IS(f32(1), [0]), IS(f32(2), [1])])
    strategy.extended.update(v, lambda copy, d: v.scatter_add(d), args=(deltas,))
    assert copies(v) == [[1, 0], [0, 2]]  # copy i got delta i (the container acts as copy i)


# -- SyncOnReadVariable ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", [*SCATTERS, "batch_scatter_update"])
def test_sync_on_read_refuses_every_scatter(method: str) -> None:
    strategy = pd.MirroredStrategy(2)
    v = mirrored(
        strategy,
        f32(0, 0),
        name="m",
        synchronization=pd.VariableSynchronization.ON_READ,
        aggregation=VA.SUM,
    )
    message = f"Variables with `synchronization=ON_READ` doesn't support `{method}`.*'m:0'"
    with pytest.raises(NotImplementedError, match=message):
        getattr(v, method)(IS(f32(1), [0]))
    with pytest.raises(NotImplementedError, match=message):
        strategy.run(lambda: getattr(v, method)(IS(f32(1), [0])))
    with pytest.raises(NotImplementedError, match="`scatter_nd_add`"):
        v.scatter_nd_add(np.array([[0]]), f32(1))
    assert copies(v) == [[0, 0]] * 2


# -- reducing IndexedSlices ------------------------------------------------------------------------


def test_reduce_to_concatenates_the_replicas_rows() -> None:
    strategy = pd.MirroredStrategy(2)
    value = pd.PerReplica([IS(f32(1, 2), [0, 3], dense_shape=[4]), IS(f32(3), [3])])
    total = strategy.extended.reduce_to("SUM", value, "/cpu:0")
    assert isinstance(total, IS)
    assert total.values.tolist() == [1, 2, 3] and total.indices.tolist() == [0, 3, 3]
    assert total.dense_shape == (4,)
    mean = strategy.extended.reduce_to("MEAN", value, destinations=value)
    assert isinstance(mean, pd.Mirrored) and len(mean.values) == 2
    assert mean.values[1].values.tolist() == [0.5, 1.0, 1.5]
    assert mean.values[1].indices.tolist() == [0, 3, 3]


def test_reduce_to_of_bad_indexed_slices() -> None:
    strategy = pd.MirroredStrategy(2)
    mixed = pd.PerReplica([IS(f32(1), [0]), f32(1)])
    with pytest.raises(TypeError, match="mix of IndexedSlices and other values"):
        strategy.extended.reduce_to("SUM", mixed, "/cpu:0")
    rows = pd.PerReplica([IS(np.ones((1, 2), np.float32), [0]), IS(f32(1), [0])])
    with pytest.raises(InvalidArgumentError, match="rows must have the same shape and dtype"):
        strategy.extended.reduce_to("SUM", rows, "/cpu:0")


def test_a_bad_index_in_replica_context_raises_and_changes_nothing() -> None:
    strategy = pd.MirroredStrategy(2)
    v = mirrored(strategy, f32(0, 0), aggregation=VA.SUM)
    # The rows were gathered first: the message names their position in the SUM.
    with pytest.raises(InvalidArgumentError, match=r"indices\[0\] = 5 is not in \[0, 2\)"):
        strategy.run(lambda: v.scatter_add(IS(f32(1), [5])))
    assert copies(v) == [[0, 0]] * 2


def test_sparse_writes_refuse_traced_storage() -> None:
    # What a compiled (SPMD) backend sets while it traces: the values are not on the host.
    strategy = pd.MirroredStrategy(2)
    v = mirrored(strategy, f32(0, 0), aggregation=VA.SUM)
    plain = pd.Variable(f32(0, 0))
    with _variables.traced_replica_scope(0):
        with pytest.raises(NotImplementedError, match="scatter_add is not supported inside a comp"):
            v.scatter_add(IS(f32(1), [0]))
        with pytest.raises(NotImplementedError, match="scatter_nd_add is not supported inside"):
            plain.scatter_nd_add(np.array([[0]]), f32(1))
    assert copies(v) == [[0, 0]] * 2 and plain.numpy().tolist() == [0, 0]
