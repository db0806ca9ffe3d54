"""CrossDeviceOps: TF's classes, and how each changes the bits of a float sum on the sim.

Reference: "Reductions and cross-device ops" and B.29 in
shared/reference/tf-distribute-and-peers.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist.errors import InvalidArgumentError
from polydist_sim import SimBackend, sum_replicas

# Crafted so that every summation order the sim models gives different float32 bits.
VALUES = [1.0, 3e-8, -1.0, 5e-8]
ORDERS = ("exact", "sequential", "tree", "ring")


def bits(x: Any) -> int:
    return int(np.asarray(x, np.float32).reshape(-1).view(np.uint32)[0])


def expected(order: str) -> int:
    arrays = [np.array([v], np.float32) for v in VALUES]
    return bits(sum_replicas(arrays, order))  # type: ignore[arg-type]


def crafted(strategy: pd.Strategy) -> pd.PerReplica:
    values: pd.PerReplica = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array([VALUES[ctx.replica_id_in_sync_group]], np.float32)
    )
    return values


def all_reduce_sum(strategy: pd.Strategy, x: Any) -> Any:
    return strategy.run(lambda v: pd.get_replica_context().all_reduce("SUM", v), args=(x,))


def test_the_case_is_crafted_so_every_order_differs() -> None:
    assert len({expected(order) for order in ORDERS}) == len(ORDERS)


OPS: list[tuple[Callable[[], Any], str, str]] = [
    # (cross_device_ops, all-reduce order, reduce-to-one-device order)
    (lambda: None, "exact", "exact"),
    (pd.NcclAllReduce, "ring", "sequential"),
    (pd.HierarchicalCopyAllReduce, "tree", "sequential"),
    (pd.ReductionToOneDevice, "sequential", "sequential"),
]


@pytest.mark.parametrize(("make_ops", "all_reduce", "one_device"), OPS)
def test_each_algorithm_has_its_bits(
    make_ops: Callable[[], Any], all_reduce: str, one_device: str
) -> None:
    strategy = pd.MirroredStrategy(4, cross_device_ops=make_ops())
    x = crafted(strategy)
    # Replica context all_reduce: the algorithm's all-reduce.
    assert {bits(v) for v in all_reduce_sum(strategy, x).values} == {expected(all_reduce)}
    with strategy.scope():
        v = pd.Variable(np.zeros(1, np.float32), aggregation=pd.VariableAggregation.SUM)
        # reduce_to the variable's devices is an all-reduce too.
        mirrored = strategy.extended.reduce_to("SUM", x, destinations=v)
        assert {bits(m) for m in mirrored.values} == {expected(all_reduce)}
        batch = strategy.extended.batch_reduce_to("SUM", [(x, v), (x, v)])
        assert {bits(m) for out in batch for m in out.values} == {expected(all_reduce)}
        # To one device (the host) TF falls back to ReductionToOneDevice (add_n).
        assert bits(strategy.reduce("SUM", x, axis=None)) == expected(one_device)
        assert bits(strategy.extended.reduce_to("SUM", x, "/cpu:0")) == expected(one_device)
    # An ON_WRITE SUM update in replica context is combined by the all-reduce.
    strategy.run(lambda value: v.assign_add(value), args=(x,))
    assert {bits(c.numpy()) for c in v.values} == {expected(all_reduce)}


def test_backend_is_reconfigured_only_when_it_comes_from_the_registry() -> None:
    nccl = pd.MirroredStrategy(4, cross_device_ops=pd.NcclAllReduce())
    again = pd.MirroredStrategy(2, cross_device_ops=pd.NcclAllReduce(), backend="sim")
    assert nccl.extended.backend.reduction_order == "ring"  # type: ignore[attr-defined]
    assert again.extended.backend is nccl.extended.backend  # one derived backend, shared
    assert pd.get_backend("sim").reduction_order == "exact"  # type: ignore[attr-defined]
    # An explicitly configured backend wins: its order everywhere.
    explicit = pd.MirroredStrategy(
        4, cross_device_ops=pd.NcclAllReduce(), backend=SimBackend("tree")
    )
    x = crafted(explicit)
    assert {bits(v) for v in all_reduce_sum(explicit, x).values} == {expected("tree")}
    assert bits(explicit.reduce("SUM", x, axis=None)) == expected("tree")


def test_mean_and_integer_rules() -> None:
    strategy = pd.MirroredStrategy(3, cross_device_ops=pd.NcclAllReduce())
    ints = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array([ctx.replica_id_in_sync_group + 1], np.int32)
    )
    total = strategy.reduce("SUM", ints, axis=None)
    assert total.dtype == np.int32 and total.tolist() == [6]
    mean = strategy.reduce("MEAN", ints, axis=None)
    assert mean.dtype == np.float64 and mean.tolist() == [2.0]  # TF: int MEAN is float64
    with strategy.scope():
        v = pd.Variable(np.zeros(1, np.float32))
        out = strategy.extended.reduce_to("MEAN", ints, destinations=v)
    assert [m.tolist() for m in out.values] == [[2.0]] * 3


def densify(x: Any) -> list[list[float]]:
    """An IndexedSlices of a (3, 2) array as its dense array (rows of repeated indices add)."""
    assert isinstance(x, pd.IndexedSlices) and x.dense_shape == (3, 2)
    dense = np.zeros((3, 2), np.float64)
    np.add.at(dense, np.asarray(x.indices), np.asarray(x.values))
    return dense.tolist()


@pytest.mark.parametrize("make_ops", [op for op, _, _ in OPS])
def test_batch_reduce_of_indexed_slices(make_ops: Callable[[], Any]) -> None:
    # TF: ReductionToOneDevice aggregates IndexedSlices (concatenates them), and the
    # all-reduce ops split a batch by sparsity, reducing the sparse values that way.
    ops = make_ops()
    strategy = pd.MirroredStrategy(3, cross_device_ops=ops)

    def slices(ctx: Any) -> pd.IndexedSlices:
        r = ctx.replica_id_in_sync_group  # rows r and 0 (multiples of 3: MEAN is exact)
        values = np.array([[3.0 * (r + 1), 3.0 * (r + 1)], [30.0, 60.0]], np.float32)
        return pd.IndexedSlices(values, np.array([r, 0]), (3, 2))

    isl = strategy.experimental_distribute_values_from_function(slices)
    dense = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group + 1)
    )
    total = [[93.0, 183.0], [6.0, 6.0], [9.0, 9.0]]  # rows 0, 1, 2 summed over replicas
    mean = [[31.0, 61.0], [2.0, 2.0], [3.0, 3.0]]
    with strategy.scope():
        v = pd.Variable(np.zeros((3, 2), np.float32))
        one, onto_v, plain = strategy.extended.batch_reduce_to(
            "SUM", [(isl, "/cpu:0"), (isl, v), (dense, "/cpu:0")]
        )
        (averaged,) = strategy.extended.batch_reduce_to("MEAN", [(isl, v)])
    assert densify(one) == total
    assert isinstance(onto_v, pd.Mirrored) and [densify(c) for c in onto_v.values] == [total] * 3
    assert float(plain) == 6.0  # the dense value of the same batch
    assert [densify(c) for c in averaged.values] == [mean] * 3
    # The ops object's own batch_reduce and reduce, with the strategy's scope.
    direct = ops or pd.ReductionToOneDevice()
    with strategy.scope():
        out = direct.batch_reduce("SUM", [(isl, "/cpu:0"), (isl, isl)])
        assert densify(out[0]) == total and [densify(c) for c in out[1].values] == [total] * 3
        assert densify(direct.reduce("SUM", isl, "/cpu:0")) == total
        # One IndexedSlices on its own device: returned as it is (TF's shortcut).
        single = pd.IndexedSlices(np.ones((1, 2), np.float32), np.array([2]), (3, 2))
        assert densify(direct.reduce("SUM", single, "/cpu:0")) == [[0, 0], [0, 0], [1, 1]]
        mixed = pd.PerReplica([isl.values[0], np.ones(2, np.float32), isl.values[2]])
        with pytest.raises(TypeError, match="Cannot reduce a mix of IndexedSlices"):
            direct.batch_reduce("SUM", [(mixed, "/cpu:0")])


class TestConstruction:
    def test_num_packs(self) -> None:
        with pytest.raises(ValueError, match=r"^NCCL all-reduce requires num_packs >= 0, but -1"):
            pd.NcclAllReduce(num_packs=-1)
        with pytest.raises(ValueError, match=r"^HierarchicalCopy requires num_packs >= 0, but -2"):
            pd.HierarchicalCopyAllReduce(num_packs=-2)
        assert repr(pd.NcclAllReduce(num_packs=0)) == "NcclAllReduce(num_packs=0)"
        assert repr(pd.HierarchicalCopyAllReduce()) == "HierarchicalCopyAllReduce(num_packs=1)"
        rod = pd.ReductionToOneDevice(reduce_to_device="/gpu:1")
        assert rod.reduce_to_device == "/gpu:1" and rod.accumulation_fn is None
        for cls in (pd.NcclAllReduce, pd.HierarchicalCopyAllReduce, pd.ReductionToOneDevice):
            assert issubclass(cls, pd.CrossDeviceOps)

    def test_mirrored_strategy_refuses_other_objects(self) -> None:
        with pytest.raises(TypeError, match="cross_device_ops must be a polydist.CrossDeviceOps"):
            pd.MirroredStrategy(2, cross_device_ops="nccl")


class TestDirectUse:
    """The CrossDeviceOps methods called by hand, as in TF's cross_device_ops_test."""

    def test_reduce_batch_reduce_broadcast(self) -> None:
        strategy = pd.MirroredStrategy(4)
        x = crafted(strategy)
        nccl = pd.NcclAllReduce()
        out = nccl.reduce("SUM", x, destinations=x)  # all-reduce: onto the value's devices
        assert isinstance(out, pd.Mirrored) and {bits(m) for m in out.values} == {expected("ring")}
        one = nccl.reduce("MEAN", x, destinations="/cpu:0")
        assert isinstance(one, np.ndarray)
        assert bits(one) == bits(sum_replicas([np.asarray(v) for v in x.values], "sequential") / 4)
        batch = pd.ReductionToOneDevice().batch_reduce("SUM", [(x, x), (x, "/gpu:0")])
        assert len(batch[0].values) == 4 and bits(batch[1]) == expected("sequential")
        copies = nccl.broadcast(np.ones(2), destinations=x)
        assert isinstance(copies, pd.Mirrored) and len(copies.values) == 4
        assert nccl.broadcast(np.ones(2), destinations="/gpu:0").tolist() == [1.0, 1.0]

    def test_batch_reduce_two_workers_example(self) -> None:
        # B.29: batch_reduce keeps each output on its destination: [[2, 2], [2, 2]].
        strategy = pd.MirroredStrategy(2)
        ones = strategy.experimental_distribute_values_from_function(
            lambda _: np.ones(2, np.float32)
        )
        out = pd.ReductionToOneDevice().batch_reduce("SUM", [(ones, ones), (ones, ones)])
        assert [[m.tolist() for m in o.values] for o in out] == [[[2.0, 2.0]] * 2] * 2

    def test_accumulation_fn(self) -> None:
        seen: list[int] = []

        def reverse_sum(arrays: list[Any]) -> Any:
            seen.append(len(arrays))
            return sum_replicas(arrays, "reverse")

        strategy = pd.MirroredStrategy(
            4, cross_device_ops=pd.ReductionToOneDevice(accumulation_fn=reverse_sum)
        )
        x = crafted(strategy)
        assert bits(strategy.reduce("SUM", x, axis=None)) == bits(
            sum_replicas([np.array([v], np.float32) for v in VALUES], "reverse")
        )
        assert seen == [4]

    def test_argument_errors(self) -> None:
        x = pd.PerReplica([np.ones(1, np.float32), np.ones(1, np.float32)])
        ops = pd.ReductionToOneDevice()
        with pytest.raises(ValueError, match="destinations must be one of a `DistributedValues`"):
            ops.reduce("SUM", x, destinations=None)
        with pytest.raises(ValueError, match="^destinations can not be empty$"):
            ops.reduce("SUM", x, destinations="")
        with pytest.raises(ValueError, match="expected a object that is not a tuple or list"):
            ops.reduce("SUM", [1.0, 2.0], destinations="/cpu:0")
        with pytest.raises(ValueError, match="because it doesn't have device set"):
            ops.reduce("SUM", 1.0, destinations="/cpu:0")
        with pytest.raises(ValueError, match="should be a tuple"):
            ops.batch_reduce("SUM", [[x, "/cpu:0"]])  # type: ignore[list-item]
        uneven = pd.PerReplica([np.ones(2), np.ones(3)])
        with pytest.raises(InvalidArgumentError, match="same shape"):
            ops.reduce("SUM", uneven, destinations="/cpu:0")
        # One value on its own device: TF's shortcut returns it.
        assert ops.reduce("SUM", np.ones(2), destinations="/cpu:0").tolist() == [1.0, 1.0]

    def test_base_class_needs_implementations(self) -> None:
        x = crafted(pd.MirroredStrategy(4))
        base = pd.CrossDeviceOps()
        with pytest.raises(NotImplementedError, match="_reduce method must be implemented"):
            base.reduce("SUM", x, destinations="/cpu:0")
        with pytest.raises(NotImplementedError, match="batch_reduce_implementation method"):
            base.batch_reduce("SUM", [(x, "/cpu:0")])
        assert len(base.broadcast(np.ones(1), destinations=x).values) == 4


def test_custom_subclass_hooks_are_used_by_the_strategy() -> None:
    calls: list[str] = []

    class Recording(pd.CrossDeviceOps):
        def reduce_implementation(
            self, reduce_op: Any, per_replica_value: Any, destinations: Any, options: Any
        ) -> Any:
            calls.append(f"reduce {reduce_op.value}")
            return pd.ReductionToOneDevice().reduce(reduce_op, per_replica_value, destinations)

        def broadcast_implementation(self, tensor: Any, destinations: Any) -> Any:
            calls.append("broadcast")
            return super().broadcast_implementation(tensor, destinations)

    strategy = pd.MirroredStrategy(2, cross_device_ops=Recording())
    x = strategy.run(lambda: np.float32(pd.get_replica_context().replica_id_in_sync_group + 1))
    assert float(strategy.reduce("SUM", x, axis=None)) == 3.0
    with strategy.scope():
        v = pd.Variable(0.0)
        strategy.extended.broadcast_to(np.float32(2.0), destinations=v)
        with pytest.raises(NotImplementedError, match="batch_reduce_implementation"):
            strategy.extended.batch_reduce_to("SUM", [(x, v)])  # TF: batch needs its hook
    assert calls == ["reduce SUM", "broadcast"]
    # Replica-context all_reduce uses the backend's collective (the exact order here).
    out = strategy.run(lambda: pd.get_replica_context().all_reduce("SUM", np.float32(1.0)))
    assert [float(o) for o in out.values] == [2.0, 2.0]


def test_reductions_with_cross_device_ops_are_traced() -> None:
    strategy = pd.MirroredStrategy(2, cross_device_ops=pd.NcclAllReduce())
    x = pd.PerReplica([np.ones(3, np.float32), np.ones(3, np.float32)])
    with pd.trace() as t:
        strategy.reduce("SUM", x, axis=None)
    assert [e.op for e in t.events] == ["reduce_to"]
