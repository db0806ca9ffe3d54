"""Error classes: what each misuse raises, on the backend as on the oracle.

TF's classes and messages (reference A and B.31): reduce/gather in replica
context and mixing strategies raise ``RuntimeError``; bad ``run`` arguments
raise ``ValueError``; replicas that disagree on a collective raise
``CollectiveMismatchError`` on eager backends, where real hardware would hang.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist.errors import CollectiveMismatchError, InvalidArgumentError
from polydist_conformance import Conformance
from polydist_conformance.cases._helpers import distribute, replica_context, replica_id


def _sibling(strategy: pd.Strategy) -> pd.Strategy:
    """Another strategy on the same backend and devices."""
    return pd.MirroredStrategy(
        list(strategy.extended.worker_devices), backend=strategy.extended.backend
    )


def test_reduce_in_replica_context(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return strategy.run(
            lambda: strategy.reduce("SUM", xp.ones((), dtype=xp.float32), axis=None)
        )

    conformance.check_raises(program, RuntimeError, match=r"cross-replica context.*merge_call")


def test_gather_in_replica_context(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return strategy.run(lambda: strategy.gather(xp.ones((2,), dtype=xp.float32), axis=0))

    conformance.check_raises(program, RuntimeError, match=r"all_gather\(\)")


def test_mixing_strategy_scopes(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope(), _sibling(strategy).scope():
            pass

    conformance.check_raises(program, RuntimeError, match="Mixing different tf.distribute.Strategy")


def test_reduce_under_another_strategys_scope(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with _sibling(strategy).scope():
            return strategy.reduce("MEAN", xp.ones((), dtype=xp.float32), axis=None)

    conformance.check_raises(program, RuntimeError, match="Mixing different tf.distribute.Strategy")


@pytest.mark.parametrize(
    "kwargs",
    [{"args": 5}, {"args": "ab"}, {"args": {"x": 1}}, {"kwargs": [1]}],
    ids=["int-args", "str-args", "dict-args", "list-kwargs"],
)
def test_run_rejects_bad_arguments(conformance: Conformance, kwargs: dict[str, Any]) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return strategy.run(lambda *a, **k: 0, **kwargs)

    conformance.check_raises(program, ValueError)


def test_exception_in_replica_fn_propagates(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        def fn() -> None:
            raise LookupError("raised in the replica function")

        return strategy.run(fn)

    conformance.check_raises(program, LookupError, match="raised in the replica function")


@pytest.mark.requires("eager")
@pytest.mark.min_replicas(2)
def test_collective_on_some_replicas_only(conformance: Conformance) -> None:
    """Replica 0 all-reduces, the others return: a hang on hardware, an error here."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        def fn() -> Any:
            if int(replica_id()) == 0:
                return replica_context().all_reduce("SUM", xp.ones((), dtype=xp.float32))
            return xp.ones((), dtype=xp.float32)

        return strategy.run(fn)

    conformance.check_raises(program, CollectiveMismatchError)


@pytest.mark.requires("eager")
@pytest.mark.min_replicas(2)
def test_collective_shape_mismatch(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        def fn() -> Any:
            length = int(replica_id()) + 1
            return replica_context().all_reduce("SUM", xp.ones((length,), dtype=xp.float32))

        return strategy.run(fn)

    conformance.check_raises(program, CollectiveMismatchError)


@pytest.mark.requires("eager")
@pytest.mark.min_replicas(2)
def test_different_collectives(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        def fn() -> Any:
            ctx, value = replica_context(), xp.ones((2,), dtype=xp.float32)
            if int(replica_id()) == 0:
                return ctx.all_gather(value, axis=0)
            return ctx.all_reduce("SUM", value)

        return strategy.run(fn)

    conformance.check_raises(program, CollectiveMismatchError)


def test_reduce_axis_none_needs_equal_shapes(conformance: Conformance) -> None:
    n = conformance.replicas
    inputs = [np.ones(r + 1, np.float32) for r in range(max(n, 2))][:n]

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return strategy.reduce("SUM", distribute(strategy, xp, inputs), axis=None)

    if n < 2:
        pytest.skip("needs 2 replicas with different shapes")
    conformance.check_raises(program, InvalidArgumentError, match="same shape")


@pytest.mark.parametrize("op", ["MAX", 3])
def test_invalid_reduce_op(conformance: Conformance, op: Any) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return strategy.reduce(op, xp.ones((), dtype=xp.float32), axis=None)

    conformance.check_raises(program, ValueError)


@pytest.mark.parametrize(("axis", "error"), [(3, ValueError), (True, TypeError), (1.5, TypeError)])
def test_invalid_reduce_axis(conformance: Conformance, axis: Any, error: type[Exception]) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        values = strategy.run(lambda: xp.ones((2, 2), dtype=xp.float32) + 0)
        return strategy.reduce("SUM", values, axis=axis)

    conformance.check_raises(program, error)


def test_gather_needs_rank_1(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        values = strategy.run(lambda: xp.astype(replica_id(), xp.float32))
        return strategy.gather(values, axis=0)

    if conformance.replicas < 2:
        pytest.skip("one replica's value is not distributed: gather returns it")
    conformance.check_raises(program, InvalidArgumentError, match="rank")


@pytest.mark.min_replicas(2)
def test_gather_needs_matching_other_dimensions(conformance: Conformance) -> None:
    n = conformance.replicas
    inputs = [np.ones((2, r + 1), np.float32) for r in range(n)]

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return strategy.gather(distribute(strategy, xp, inputs), axis=0)

    conformance.check_raises(program, InvalidArgumentError)


def test_all_gather_axis_out_of_range(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return strategy.run(
            lambda: replica_context().all_gather(xp.ones((2,), dtype=xp.float32), axis=1)
        )

    conformance.check_raises(program, InvalidArgumentError, match="out of range")


def test_replica_context_outside_its_run(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        contexts = []
        strategy.run(lambda: contexts.append(replica_context()))
        with strategy.scope():
            return contexts[0].all_reduce("SUM", xp.ones((), dtype=xp.float32))

    conformance.check_raises(program, RuntimeError, match="call_for_each_replica")


@pytest.mark.min_replicas(2)
def test_sum_of_a_non_distributed_value(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return strategy.reduce("SUM", xp.ones((2,), dtype=xp.float32), axis=None)

    conformance.check_raises(program, ValueError, match="non-DistributedValues")


@pytest.mark.min_replicas(2)
def test_sum_of_a_mirrored_value(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        per_replica = strategy.run(lambda: xp.astype(replica_id(), xp.float32))
        mirrored = strategy.extended.reduce_to("SUM", per_replica, destinations=per_replica)
        return strategy.reduce("SUM", mirrored, axis=None)

    conformance.check_raises(program, ValueError, match="Mirrored")


def test_shallow_copy_of_a_strategy(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return copy.copy(strategy)

    conformance.check_raises(program, RuntimeError, match="deepcopy")


@pytest.mark.parametrize("devices", [0, "/gpu:0", []], ids=["zero", "string", "empty"])
def test_invalid_mirrored_devices(conformance: Conformance, devices: Any) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return pd.MirroredStrategy(devices, backend=strategy.extended.backend)

    conformance.check_raises(program, ValueError)


@pytest.mark.parametrize("devices", [2.0, True, object()], ids=["float", "bool", "object"])
def test_mirrored_devices_of_the_wrong_type(conformance: Conformance, devices: Any) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return pd.MirroredStrategy(devices, backend=strategy.extended.backend)

    conformance.check_raises(program, TypeError, match=r"devices must be .*got (float|bool|object)")


def test_run_of_a_non_callable(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return strategy.run(42)  # type: ignore[arg-type]

    conformance.check_raises(program, TypeError, match=r"fn must be a callable.*got int 42")


def test_merge_call_of_a_non_callable(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return strategy.run(lambda: replica_context().merge_call(42))  # type: ignore[arg-type]

    conformance.check_raises(program, TypeError, match=r"merge_fn must be a callable.*got int 42")


_WRONG_COUNT_CALLS = {
    "reduce": lambda s, v: s.reduce("SUM", v, axis=None),
    "reduce-axis": lambda s, v: s.reduce("MEAN", v, axis=0),
    "reduce_to": lambda s, v: s.extended.reduce_to("SUM", v, destinations="/cpu:0"),
    "batch_reduce_to": lambda s, v: s.extended.batch_reduce_to("SUM", [(v, v), (v, v)]),
    "run": lambda s, v: s.run(lambda x: x, args=(v,)),
    "gather": lambda s, v: s.gather(v, axis=0),
}


@pytest.mark.parametrize("call", sorted(_WRONG_COUNT_CALLS))
@pytest.mark.parametrize("extra", [-1, 1], ids=["one-too-few", "one-too-many"])
def test_per_replica_with_the_wrong_number_of_values(
    conformance: Conformance, call: str, extra: int
) -> None:
    # A hand-made PerReplica of 2 values on 4 replicas was reduced silently (issue 22).
    n = conformance.replicas
    if n + extra < 1:
        pytest.skip("one value fewer than one replica is no PerReplica")

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        value = pd.PerReplica([xp.ones((2, 3), dtype=xp.float32)] * (n + extra))
        return _WRONG_COUNT_CALLS[call](strategy, value)

    conformance.check_raises(
        program, ValueError, match=rf"PerReplica with {n + extra} value\(s\).* {n} replica\(s\)"
    )
