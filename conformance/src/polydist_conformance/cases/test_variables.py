"""Variables: MirroredVariable and SyncOnReadVariable creation, reads and writes (TF's tables).

Every row of the reference's variable tables (``Creating variables in
scope``, ``Updating a MirroredVariable in replica context``, the
``SyncOnReadVariable`` rules; B.10, B.11, B.23-B.27) and of
``docs/concepts/variables.md``: which class a strategy creates, names and
devices of the copies, writes in replica and cross-replica context for each
aggregation, aggregated reads, ``ReplicaDivergenceWarning`` and
``polydist.debugging.check_replicas_identical``. TF states these results for
3 replicas each writing ``id + 1``; cases marked ``tf3`` use exactly that,
the others the run's replica count.

Cases that touch a variable inside ``strategy.run`` need
``Capabilities.variables_in_replica_context`` (an SPMD backend must
functionalize variables to have it).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist.debugging import ReplicaDivergenceError, check_replicas_identical
from polydist_conformance import Conformance, Distributed, Reduction, reduced
from polydist_conformance.cases._helpers import (
    components,
    copies,
    per_replica,
    replica_float,
    replica_id,
)

VA = pd.VariableAggregation
VS = pd.VariableSynchronization

IN_RUN = pytest.mark.requires("variables_in_replica_context")
#: TF's examples use 3 replicas; the other id runs with the run's replica count.
REPLICAS = [pytest.param(3, id="tf3"), pytest.param(None, id="run")]


def _count(conformance: Conformance, replicas: int | None) -> int:
    return conformance.replicas if replicas is None else replicas


def _f32(x: float) -> np.float32:
    return np.float32(x)


def _divergence_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, pd.ReplicaDivergenceWarning)]


# -- creation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("synchronization", ["AUTO", "ON_WRITE", "ON_READ"])
@pytest.mark.parametrize("aggregation", ["NONE", "SUM", "MEAN", "ONLY_FIRST_REPLICA"])
def test_creation_table(conformance: Conformance, synchronization: str, aggregation: str) -> None:
    """AUTO/ON_WRITE make a MirroredVariable (reading ON_WRITE), ON_READ a SyncOnReadVariable;
    one copy per replica device, each holding the initial value."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(
                xp.asarray([1.0, 2.0], dtype=xp.float32),
                synchronization=pd.VariableSynchronization[synchronization],
                aggregation=pd.VariableAggregation[aggregation],
            )
        return {
            "variable": v,
            "class": type(v).__name__,
            "synchronization": v.synchronization.name,
            "aggregation": v.aggregation.name,
            "trainable": v.trainable,
            "shape": v.shape,
            "created_in_scope": strategy.extended.variable_created_in_scope(v),
            "strategy_is_its_own": v.distribute_strategy is strategy,
        }

    n = conformance.replicas
    on_read = synchronization == "ON_READ"
    kind = "SyncOnReadVariable" if on_read else "MirroredVariable"
    value = np.asarray([1.0, 2.0], np.float32)
    conformance.check(
        program,
        expected={
            "variable": Distributed(kind, (value,) * n),
            "class": kind,
            "synchronization": "ON_READ" if on_read else "ON_WRITE",
            "aggregation": aggregation,
            "trainable": not on_read,
            "shape": (2,),
            "created_in_scope": True,
            "strategy_is_its_own": True,
        },
    )


def test_synchronization_none_is_refused(conformance: Conformance) -> None:
    """B.25: ``VariableSynchronization.NONE`` under a strategy raises ``ValueError``."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            return pd.Variable(1.0, name="v", synchronization=VS.NONE)

    conformance.check_raises(
        program, ValueError, match="`NONE` variable synchronization mode is not supported"
    )


@pytest.mark.parametrize("synchronization", ["ON_WRITE", "ON_READ"])
def test_mean_of_a_non_float_dtype_is_refused(
    conformance: Conformance, synchronization: str
) -> None:
    """TF 2.21 raises at creation for ``aggregation=MEAN`` with an integer dtype."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            return pd.Variable(
                1,
                synchronization=pd.VariableSynchronization[synchronization],
                aggregation=VA.MEAN,
                dtype="int32",
            )

    conformance.check_raises(
        program, ValueError, match="aggregation=MEAN and a non-floating dtype is not supported"
    )


def test_names_of_the_copies(conformance: Conformance) -> None:
    """B.23: ``foo:0``, then ``foo/replica_1:0``, ...; unnamed variables are ``Variable:0``
    (TF's eager names are not uniquified)."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            foo = pd.Variable(1.0, name="foo")
            common = pd.Variable(1.0, name="common/var1")
            unnamed = pd.Variable(1.0)
            again = pd.Variable(2.0)
        return {
            "foo": [foo.name, [c.name for c in components(foo)]],
            "common": common.name,
            "unnamed": [unnamed.name, again.name],
        }

    n = conformance.replicas
    conformance.check(
        program,
        expected={
            "foo": ["foo:0", ["foo:0", *(f"foo/replica_{i}:0" for i in range(1, n))]],
            "common": "common/var1:0",
            "unnamed": ["Variable:0", "Variable:0"],
        },
    )


def test_copies_live_on_the_worker_devices(conformance: Conformance) -> None:
    """B.23: copy ``i`` is on ``worker_devices[i]``; the variable's ``device`` in
    cross-replica context is the primary's."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            mirrored = pd.Variable(1.0)
            sync_on_read = pd.Variable(1.0, synchronization=VS.ON_READ, aggregation=VA.SUM)
        devices = list(strategy.extended.worker_devices)
        return {
            "mirrored": [c.device for c in components(mirrored)] == devices,
            "sync_on_read": [c.device for c in components(sync_on_read)] == devices,
            "primary": mirrored.device == devices[0],
            "parameter_devices": list(strategy.extended.parameter_devices) == devices,
        }

    conformance.check(
        program,
        expected={
            "mirrored": True,
            "sync_on_read": True,
            "primary": True,
            "parameter_devices": True,
        },
    )


@IN_RUN
@pytest.mark.min_replicas(2)  # with one replica, replica 0's device is every replica's
def test_device_in_replica_context_is_the_replicas(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(1.0)
        devices = strategy.run(lambda: v.device)
        return list(strategy.experimental_local_results(devices)) == list(
            strategy.extended.worker_devices
        )

    conformance.check(program, expected=True)


def test_initial_value_rules(conformance: Conformance) -> None:
    """A callable initial value is called once and every copy gets its value; Python
    numbers take TF's dtypes (``1.0`` float32, ``1`` int32); ``dtype=`` converts."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        calls: list[int] = []

        def initial() -> Any:
            calls.append(1)
            return xp.asarray([3.0, 4.0], dtype=xp.float32)

        with strategy.scope():
            from_callable = pd.Variable(initial)
            a_float = pd.Variable(1.0)
            an_int = pd.Variable(1)
            converted = pd.Variable(2, dtype="float32")
        return {
            "calls": len(calls),
            "from_callable": from_callable,
            "float": a_float,
            "int": an_int,
            "converted": converted,
        }

    n = conformance.replicas
    conformance.check(
        program,
        expected={
            "calls": 1,
            "from_callable": Distributed(
                "MirroredVariable", (np.asarray([3.0, 4.0], np.float32),) * n
            ),
            "float": Distributed("MirroredVariable", (np.float32(1.0),) * n),
            "int": Distributed("MirroredVariable", (np.int32(1),) * n),
            "converted": Distributed("MirroredVariable", (np.float32(2.0),) * n),
        },
    )


@pytest.mark.parametrize(
    ("method", "value", "error"),
    [
        ("assign", [1.0, 2.0, 3.0], ValueError),  # shapes must match: no broadcasting
        ("assign_add", [1.0], pd.errors.InvalidArgumentError),
        ("assign", 1.5, TypeError),  # a float is never assigned to an int variable
    ],
    ids=["assign-shape", "assign_add-shape", "assign-kind"],
)
def test_writes_check_shape_and_kind(
    conformance: Conformance, method: str, value: Any, error: type[Exception]
) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            if isinstance(value, list):
                v = pd.Variable(xp.zeros((2,), dtype=xp.float32))
                getattr(v, method)(xp.asarray(value, dtype=xp.float32))
            else:
                v = pd.Variable(xp.zeros((), dtype=xp.int32))
                getattr(v, method)(value)

    conformance.check_raises(program, error)


def test_one_device_strategy_makes_a_plain_variable(conformance: Conformance) -> None:
    """``OneDeviceStrategy``: a plain ``Variable`` on the strategy's device, as in TF."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(1.0, name="w", synchronization=VS.ON_READ, aggregation=VA.SUM)
        v.assign_add(1.0)
        return {
            "variable": v,
            "name": v.name,
            "device": v.device == strategy.extended.worker_devices[0],
            "created_in_scope": strategy.extended.variable_created_in_scope(v),
        }

    conformance.check(
        program,
        strategy="one_device",
        expected={
            "variable": Distributed("Variable", (np.float32(2.0),)),
            "name": "w:0",
            "device": True,
            "created_in_scope": True,
        },
    )


@IN_RUN
def test_variable_created_in_run_is_created_once_and_shared(conformance: Conformance) -> None:
    """TF's shared variable creator: created once, from replica 0's arguments, in
    cross-replica context; every replica gets the same ``MirroredVariable``."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        calls: list[int] = []

        def initial() -> Any:
            calls.append(1)
            return xp.asarray(5.0, dtype=xp.float32)

        def fn() -> Any:
            return pd.Variable(initial, name="made_in_run")

        v = strategy.run(fn)
        return {"calls": len(calls), "variable": v, "name": v.name}

    n = conformance.replicas
    conformance.check(
        program,
        expected={
            "calls": 1,
            "variable": Distributed("MirroredVariable", (np.float32(5.0),) * n),
            "name": "made_in_run:0",
        },
    )


@IN_RUN
@pytest.mark.min_replicas(2)
def test_variables_created_in_run_with_mismatching_names(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        names = strategy.experimental_distribute_values_from_function(
            lambda ctx: f"v{ctx.replica_id_in_sync_group}"
        )
        return strategy.run(lambda name: pd.Variable(1.0, name=name), args=(names,))

    conformance.check_raises(program, RuntimeError, match="mismatching name on device 1")


# -- MirroredVariable: writes in replica context -------------------------------------------

ON_WRITE_UPDATES = [
    # aggregation, method, the value every copy ends with when replica r writes r + 1
    pytest.param("SUM", "assign_add", lambda n: n * (n + 1) / 2, id="SUM"),
    pytest.param("MEAN", "assign", lambda n: (n + 1) / 2, id="MEAN"),
    pytest.param("ONLY_FIRST_REPLICA", "assign", lambda n: 1.0, id="ONLY_FIRST_REPLICA"),
]


@IN_RUN
@pytest.mark.parametrize("replicas", REPLICAS)
@pytest.mark.parametrize(("aggregation", "method", "result"), ON_WRITE_UPDATES)
def test_mirrored_update_in_replica_context(
    conformance: Conformance, replicas: int | None, aggregation: str, method: str, result: Any
) -> None:
    """3 replicas writing ``id + 1``: SUM (assign_add from 0) gives 6 everywhere, MEAN 2,
    ONLY_FIRST_REPLICA replica 0's 1. Each replica gets the new value back."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(0.0, aggregation=pd.VariableAggregation[aggregation])
        returned = strategy.run(lambda: getattr(v, method)(replica_float(xp, 1.0)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            identical = check_replicas_identical(strategy)
        return {
            "variable": v,
            "returned": returned,
            "identical": identical,
            "warnings": _divergence_warnings(caught),
        }

    n = _count(conformance, replicas)
    value = _f32(result(n))
    conformance.check(
        program,
        replicas=replicas,
        expected={
            "variable": Distributed("MirroredVariable", (value,) * n),
            "returned": per_replica([value] * n),
            "identical": 1,
            "warnings": [],
        },
    )


@IN_RUN
@pytest.mark.parametrize("replicas", REPLICAS)
def test_mirrored_none_update_diverges_and_warns_once(
    conformance: Conformance, replicas: int | None
) -> None:
    """``aggregation=NONE``: each replica writes only its own copy, so the copies diverge
    to 1, 2, 3 (TF keeps them silently); polydist warns once per variable."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(0.0, name="w")
        with warnings.catch_warnings(record=True) as first:
            warnings.simplefilter("always")
            strategy.run(lambda: v.assign(replica_float(xp, 1.0)))
        after_first = copies(v)
        read_in_replicas = strategy.run(lambda: v.read_value())
        with warnings.catch_warnings(record=True) as second:
            warnings.simplefilter("always")
            strategy.run(lambda: v.assign(replica_float(xp, 5.0)))
        messages = _divergence_warnings(first)
        try:
            check_replicas_identical(strategy)
            detected = False
        except ReplicaDivergenceError:
            detected = True
        return {
            "after_first": after_first,
            "read_in_replicas": read_in_replicas,
            "after_second": copies(v),
            "warned": len(messages),
            "names_the_variable": bool(messages) and "'w:0'" in messages[0],
            "warned_again": len(_divergence_warnings(second)),
            "check_replicas_identical_raises": detected,
        }

    n = _count(conformance, replicas)
    if n < 2:
        pytest.skip("copies cannot diverge with one replica")
    conformance.check(
        program,
        replicas=replicas,
        expected={
            "after_first": tuple(_f32(r + 1) for r in range(n)),
            "read_in_replicas": pd.PerReplica([_f32(r + 1) for r in range(n)]),
            "after_second": tuple(_f32(r + 5) for r in range(n)),
            "warned": 1,
            "names_the_variable": True,
            "warned_again": 0,
            "check_replicas_identical_raises": True,
        },
    )


@IN_RUN
def test_mirrored_none_update_with_equal_values_does_not_warn(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(0.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            strategy.run(lambda: v.assign_add(xp.asarray(1.0, dtype=xp.float32)))
        return {"variable": v, "warnings": _divergence_warnings(caught)}

    n = conformance.replicas
    conformance.check(
        program,
        expected={"variable": Distributed("MirroredVariable", (_f32(1.0),) * n), "warnings": []},
    )


@IN_RUN
def test_mirrored_sum_assign_sub(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(100.0, aggregation=VA.SUM)
        strategy.run(lambda: v.assign_sub(replica_float(xp, 1.0)))
        return v

    n = conformance.replicas
    value = _f32(100 - n * (n + 1) / 2)
    conformance.check(program, expected=Distributed("MirroredVariable", (value,) * n))


@IN_RUN
@pytest.mark.min_replicas(2)
def test_mirrored_sum_of_a_value_shared_by_every_replica_raises(conformance: Conformance) -> None:
    """A value that is the same object on every replica is not per-replica: SUM raises."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(0.0, aggregation=VA.SUM)
        one = xp.asarray(1.0, dtype=xp.float32)
        return strategy.run(lambda: v.assign_add(one))

    conformance.check_raises(
        program, ValueError, match="cannot be reduced with the given reduce op"
    )


@IN_RUN
def test_mirrored_mean_of_a_shared_literal_is_that_value(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(0.0, aggregation=VA.MEAN)
        strategy.run(lambda: v.assign(2.0))
        return v

    n = conformance.replicas
    conformance.check(program, expected=Distributed("MirroredVariable", (_f32(2.0),) * n))


@IN_RUN
@pytest.mark.min_replicas(2)
def test_mean_update_of_an_int_variable_in_replica_context(conformance: Conformance) -> None:
    """B.26: a per-replica value into an int MEAN variable raises "Cannot update non-float
    variables"; the same value everywhere is allowed. TF 2.21 refuses int MEAN variables
    at creation, so, like TF's own test, the variable is made SUM and then switched."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(1, aggregation=VA.SUM)
        v._aggregation = VA.MEAN  # what TF's test builds internally
        strategy.run(lambda: v.assign(2))
        try:
            strategy.run(lambda: v.assign(replica_id()))
            message = ""
        except ValueError as e:
            message = str(e)
        return {"variable": v, "refused": "Cannot update non-float variables" in message}

    n = conformance.replicas
    conformance.check(
        program,
        expected={"variable": Distributed("MirroredVariable", (np.int32(2),) * n), "refused": True},
    )


# -- MirroredVariable: cross-replica context and reads ------------------------------------------


def test_mirrored_cross_replica_writes_update_every_copy(conformance: Conformance) -> None:
    """In scope, ``assign`` writes every copy and returns a ``Mirrored``; outside any scope
    too (B.27, testAssignOutOfScope); ``read_value=False`` returns None."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(1.0, aggregation=VA.SUM)
            returned = v.assign(3.0)
        after_assign = copies(v)
        v.assign_add(1.0)
        after_add = copies(v)
        none = v.assign_sub(2.0, read_value=False)
        return {
            "returned": returned,
            "after_assign": after_assign,
            "after_add": after_add,
            "read_value_false": none,
            "variable": v,
            "read": v.read_value(),
        }

    n = conformance.replicas
    conformance.check(
        program,
        expected={
            "returned": pd.Mirrored([_f32(3.0)] * n) if n > 1 else _f32(3.0),
            "after_assign": (_f32(3.0),) * n,
            "after_add": (_f32(4.0),) * n,
            "read_value_false": None,
            "variable": Distributed("MirroredVariable", (_f32(2.0),) * n),
            "read": _f32(2.0),
        },
    )


@pytest.mark.min_replicas(2)
def test_mirrored_cross_replica_read_is_replica_zeros_copy(conformance: Conformance) -> None:
    """Reads and operators in cross-replica context use replica 0's copy."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(xp.asarray([1.0, 2.0], dtype=xp.float32))
        components(v)[1].assign(xp.asarray([5.0, 6.0], dtype=xp.float32))  # diverge by hand
        with strategy.scope():
            in_scope = v.read_value()
        return {"read": v.read_value(), "in_scope": in_scope, "doubled": v * 2}

    one_two = np.asarray([1.0, 2.0], np.float32)
    conformance.check(
        program, expected={"read": one_two, "in_scope": one_two, "doubled": one_two * 2}
    )


@IN_RUN
@pytest.mark.min_replicas(2)
def test_mirrored_read_in_replica_context_is_the_replicas_copy(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(xp.asarray([1.0, 2.0], dtype=xp.float32))
        components(v)[1].assign(xp.asarray([5.0, 6.0], dtype=xp.float32))
        return strategy.run(lambda: v * 2)

    n = conformance.replicas
    one_two = np.asarray([2.0, 4.0], np.float32)
    values = [one_two, np.asarray([10.0, 12.0], np.float32), *([one_two] * (n - 2))]
    conformance.check(program, expected=pd.PerReplica(values))


# -- SyncOnReadVariable -----------------------------------------------------------------------

ON_READ_READS = [
    pytest.param("SUM", lambda n: n * (n + 1) / 2, id="SUM"),
    pytest.param("MEAN", lambda n: (n + 1) / 2, id="MEAN"),
    pytest.param("ONLY_FIRST_REPLICA", lambda n: 1.0, id="ONLY_FIRST_REPLICA"),
]


@IN_RUN
@pytest.mark.parametrize("replicas", REPLICAS)
@pytest.mark.parametrize(("aggregation", "result"), ON_READ_READS)
def test_sync_on_read_local_writes_and_aggregated_reads(
    conformance: Conformance, replicas: int | None, aggregation: str, result: Any
) -> None:
    """Local values 1, 2, 3 read as 6 (SUM), 2 (MEAN) or 1 (ONLY_FIRST_REPLICA) in
    cross-replica context; in replica context each replica reads its own copy."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(
                0.0, synchronization=VS.ON_READ, aggregation=pd.VariableAggregation[aggregation]
            )
        strategy.run(lambda: v.assign(replica_float(xp, 1.0)))
        in_replicas = strategy.run(lambda: v.read_value())
        with strategy.scope():
            in_scope = v.value()
            read_var = strategy.extended.read_var(v)
        return {
            "variable": v,
            "in_replicas": in_replicas,
            "read": v.read_value(),
            "numpy": xp.asarray(v.numpy()),
            "in_scope": in_scope,
            "read_var": read_var,
        }

    n = _count(conformance, replicas)
    local = [_f32(r + 1) for r in range(n)]
    value = _f32(result(n))
    conformance.check(
        program,
        replicas=replicas,
        expected={
            "variable": Distributed("SyncOnReadVariable", tuple(local)),
            "in_replicas": per_replica(local),
            "read": value,
            "numpy": value,
            "in_scope": value,
            "read_var": value,
        },
    )


@IN_RUN
def test_sync_on_read_sum_counts_the_initial_value_once_per_replica(
    conformance: Conformance,
) -> None:
    """Every copy starts with the initial value, so a SUM variable created with 5 reads
    ``5 N`` before any write, and ``6 N`` after each replica adds 1 (MEAN: 5, then 6)."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            total = pd.Variable(5.0, synchronization=VS.ON_READ, aggregation=VA.SUM)
            mean = pd.Variable(5.0, synchronization=VS.ON_READ, aggregation=VA.MEAN)
        before = (total.read_value(), mean.read_value())

        def add_one() -> None:
            total.assign_add(1.0)
            mean.assign_add(1.0)

        strategy.run(add_one)
        return {
            "before": before,
            "after": (total.read_value(), mean.read_value()),
            "copies": copies(total),
        }

    n = conformance.replicas
    conformance.check(
        program,
        expected={
            "before": (_f32(5 * n), _f32(5.0)),
            "after": (_f32(6 * n), _f32(6.0)),
            "copies": (_f32(6.0),) * n,
        },
    )


@pytest.mark.parametrize("replicas", REPLICAS)
def test_sync_on_read_sum_assign_stores_value_over_n(
    conformance: Conformance, replicas: int | None
) -> None:
    """A cross-replica ``assign(9)`` stores ``9 / N`` in each copy, so the read is 9. An
    int32 variable is split exactly, ``10 // N`` in each copy but the first, which holds
    the rest, so it reads 10 (TF casts ``10 / N`` into each copy and reads ``N * (10 //
    N)``: a difference from TF)."""
    n = _count(conformance, replicas)
    first = 10 - (n - 1) * (10 // n)
    share = np.float32(9.0) / np.float32(n)

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(0.0, synchronization=VS.ON_READ, aggregation=VA.SUM)
            counter = pd.Variable(0, synchronization=VS.ON_READ, aggregation=VA.SUM)
            returned = v.assign(9.0)
        counter.assign(10)
        return {
            "variable": v,
            "returned": reduced(returned, Reduction.across_replicas([share] * n)),
            "read": reduced(v.read_value(), Reduction.across_replicas([share] * n)),
            "counter": counter,
            "counter_read": counter.read_value(),
        }

    conformance.check(
        program,
        replicas=replicas,
        expected={
            "variable": Distributed("SyncOnReadVariable", (share,) * n),
            "returned": _f32(9.0),
            "read": _f32(9.0),
            "counter": Distributed(
                "SyncOnReadVariable", (np.int32(first),) + (np.int32(10 // n),) * (n - 1)
            ),
            "counter_read": np.int32(10),
        },
    )


@pytest.mark.parametrize("method", ["assign_add", "assign_sub"])
def test_sync_on_read_sum_cross_replica_add_raises(conformance: Conformance, method: str) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(0.0, synchronization=VS.ON_READ, aggregation=VA.SUM)
            return getattr(v, method)(1.0)

    conformance.check_raises(program, ValueError, match=f"does not support `{method}`")


@pytest.mark.parametrize("aggregation", ["MEAN", "ONLY_FIRST_REPLICA"])
def test_sync_on_read_cross_replica_writes_of_other_aggregations(
    conformance: Conformance, aggregation: str
) -> None:
    """Not SUM: a cross-replica write applies the value to each copy."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(
                0.0, synchronization=VS.ON_READ, aggregation=pd.VariableAggregation[aggregation]
            )
        returned = v.assign(4.0)
        v.assign_add(1.0)
        none = v.assign_sub(0.5, read_value=False)
        return {"returned": returned, "none": none, "variable": v, "read": v.read_value()}

    n = conformance.replicas
    conformance.check(
        program,
        expected={
            "returned": _f32(4.0),
            "none": None,
            "variable": Distributed("SyncOnReadVariable", (_f32(4.5),) * n),
            "read": _f32(4.5),
        },
    )


def test_sync_on_read_none_has_no_cross_replica_value(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(0.0, name="m", synchronization=VS.ON_READ)
        return v.read_value()

    conformance.check_raises(program, ValueError, match="'m:0' has aggregation NONE")


@IN_RUN
def test_sync_on_read_reduce_and_local_results(conformance: Conformance) -> None:
    """A variable given to ``reduce`` reduces as its copies; ``experimental_local_results``
    gives the copies."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(0.0, synchronization=VS.ON_READ, aggregation=VA.SUM)
        strategy.run(lambda: v.assign_add(replica_float(xp)))
        return {
            "sum": strategy.reduce("SUM", v, axis=None),
            "mean": strategy.reduce("MEAN", v, axis=None),
            "local": tuple(c.read_value() for c in strategy.experimental_local_results(v)),
        }

    n = conformance.replicas
    ids = n * (n - 1) / 2
    conformance.check(
        program,
        expected={
            "sum": _f32(ids),
            "mean": _f32(ids / n),
            "local": tuple(_f32(r) for r in range(n)),
        },
    )


@IN_RUN
def test_all_reduce_of_a_sync_on_read_variable(conformance: Conformance) -> None:
    """B.10 (testSyncOnReadVariableInput): each replica assigns ``3 id`` to an
    ON_READ/ONLY_FIRST_REPLICA variable; ``all_reduce(SUM, v)`` is ``sum 3 id``."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(0.0, synchronization=VS.ON_READ, aggregation=VA.ONLY_FIRST_REPLICA)

        def fn() -> Any:
            v.assign(replica_float(xp, scale=3.0))
            ctx = pd.get_replica_context()
            assert ctx is not None
            return ctx.all_reduce("SUM", v)

        return strategy.run(fn)

    n = conformance.replicas
    total = _f32(3 * n * (n - 1) / 2)
    conformance.check(program, expected=per_replica([total] * n))


@IN_RUN
def test_only_first_replica_on_write_and_on_read(conformance: Conformance) -> None:
    """B.24: ON_WRITE keeps replica 0's update everywhere; ON_READ copies diverge and
    ``read_var`` returns replica 0's."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            on_write = pd.Variable(0.0, aggregation=VA.ONLY_FIRST_REPLICA)
            on_read = pd.Variable(
                0.0, synchronization=VS.ON_READ, aggregation=VA.ONLY_FIRST_REPLICA
            )

        def fn() -> None:
            on_write.assign(replica_float(xp, 1.0))
            on_read.assign(replica_float(xp, 1.0))

        strategy.run(fn)
        with strategy.scope():
            reads = (strategy.extended.read_var(on_write), strategy.extended.read_var(on_read))
        return {"on_write": on_write, "on_read": on_read, "read_var": reads}

    n = conformance.replicas
    conformance.check(
        program,
        expected={
            "on_write": Distributed("MirroredVariable", (_f32(1.0),) * n),
            "on_read": Distributed("SyncOnReadVariable", tuple(_f32(r + 1) for r in range(n))),
            "read_var": (_f32(1.0), _f32(1.0)),
        },
    )


@IN_RUN
def test_replica_context_update_leaves_identical_copies(conformance: Conformance) -> None:
    """B.11 (ReplicaCtxUpdateTest): ``ReplicaContext._update`` with assign, assign_add and
    assign_sub, tensor and Python-literal arguments."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            v = pd.Variable(1.0)

        def fn() -> None:
            ctx = pd.get_replica_context()
            assert ctx is not None
            ctx._update(v, lambda c, x: c.assign(x), args=(xp.asarray(5.0, dtype=xp.float32),))
            ctx._update(v, lambda c, x: c.assign_add(x), args=(2.0,))
            ctx._update(
                v, lambda c, x: c.assign_sub(x), kwargs={"x": xp.asarray(1.0, dtype=xp.float32)}
            )

        strategy.run(fn)
        return v

    n = conformance.replicas
    conformance.check(program, expected=Distributed("MirroredVariable", (_f32(6.0),) * n))


# -- the debug check -----------------------------------------------------------------------------


@pytest.mark.min_replicas(2)
def test_check_replicas_identical(conformance: Conformance) -> None:
    """``check_replicas_identical`` counts the values it checked (SyncOnRead copies and
    PerReplica values may differ and are skipped) and raises ``ReplicaDivergenceError``
    naming the variable and the replica that differs."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        n = strategy.num_replicas_in_sync
        with strategy.scope():
            w = pd.Variable(xp.zeros((3,), dtype=xp.float32), name="w")
            pd.Variable(0.0, synchronization=VS.ON_READ, aggregation=VA.SUM)
        result: dict[str, Any] = {"count": check_replicas_identical(strategy)}
        components(w)[n - 1].assign(xp.asarray([0.0, 1.0, 0.0], dtype=xp.float32))
        try:
            check_replicas_identical(strategy)
            result["message"] = ""
        except ReplicaDivergenceError as e:
            result["message"] = str(e)
        result["invalid_argument"] = issubclass(
            ReplicaDivergenceError, pd.errors.InvalidArgumentError
        )
        with strategy.scope():
            w.assign(xp.zeros((3,), dtype=xp.float32))
            result["after_assign"] = check_replicas_identical()
        mirrored = pd.Mirrored([xp.ones((2,), dtype=xp.float32)] * n)
        different = strategy.experimental_distribute_values_from_function(
            lambda ctx: xp.ones((1,), dtype=xp.float32) * ctx.replica_id_in_sync_group
        )
        result["nest"] = check_replicas_identical({"m": mirrored, "p": different, "w": w})
        message = result.pop("message")
        result["names_w"] = "MirroredVariable 'w:0'" in message
        result["names_replica"] = f"replica(s) {n - 1} " in message
        result["first_difference"] = "index (1,)" in message
        return result

    conformance.check(
        program,
        expected={
            "count": 1,
            "invalid_argument": True,
            "after_assign": 1,
            "nest": 2,
            "names_w": True,
            "names_replica": True,
            "first_difference": True,
        },
    )
