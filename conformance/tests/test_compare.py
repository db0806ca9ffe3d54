"""Observing a program's result and comparing two of them."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import polydist as pd
from polydist_conformance import Distributed, Reduction, reduced
from polydist_conformance._compare import EXPECTED, Policy, bitwise_equal, compare, observe, plain

BITWISE = Policy(bitwise_sums=True, reference_exact=True)
BOUNDED = Policy(bitwise_sums=False, reference_exact=True)
Pair = namedtuple("Pair", ["a", "b"])


def _obs(value: Any) -> Any:
    return observe(value, np.asarray)


def test_observe_keeps_types_that_matter() -> None:
    value = {
        "pr": pd.PerReplica([np.float32(1), np.float32(2)]),
        "m": pd.Mirrored([np.ones(2, np.int32)] * 2),
        "pair": Pair(np.int8(3), [None, "s", 1, 2.5, True]),
    }
    out = plain(_obs(value))
    assert out["pr"] == Distributed("PerReplica", (np.float32(1), np.float32(2)))
    assert out["m"].kind == "Mirrored"
    assert type(out["pair"]) is Pair
    assert out["pair"].a.dtype == np.int8
    assert out["pair"].b == [None, "s", 1, 2.5, True]


def test_numpy_scalars_are_0d_arrays_and_not_python_floats() -> None:
    assert compare(_obs(np.float64(2.0)), _obs(np.asarray(2.0)), BITWISE) == []
    [error] = compare(_obs(np.float64(2.0)), _obs(2.0), BITWISE)
    assert "array float64[]" in error
    assert "float" in error


def test_unsupported_results_are_rejected_with_advice() -> None:
    with pytest.raises(TypeError, match="Programs must return arrays"):
        _obs(object())


@pytest.mark.parametrize(
    ("actual", "reference", "fragment"),
    [
        (np.float32(1), np.float64(1), "float32[]"),
        (np.ones(2, np.float32), np.ones(3, np.float32), "float32[2]"),
        (pd.PerReplica([1, 2]), pd.Mirrored([1, 2]), "PerReplica of 2"),
        (pd.PerReplica([1, 2]), 1, "PerReplica of 2"),
        ([1], (1,), "list"),
        ({"a": 1}, {"b": 1}, "keys"),
        (Pair(1, 2), (1, 2), "Pair"),
        (1, True, "int"),
        (np.float32(0.0), np.float32(-0.0), "bit for bit"),
        (np.int32(1), np.int32(2), "exactly"),
    ],
)
def test_differences_are_reported(actual: Any, reference: Any, fragment: str) -> None:
    errors = compare(_obs(actual), _obs(reference), BITWISE)
    assert len(errors) == 1
    assert fragment in errors[0]


def test_nan_matches_nan() -> None:
    assert bitwise_equal(np.asarray([np.nan, 1.0]), np.asarray([-np.nan, 1.0]))
    assert not bitwise_equal(np.asarray([np.nan]), np.asarray([1.0]))
    assert bitwise_equal(np.asarray([1 + 2j]), np.asarray([1 + 2j]))


def test_marked_sums_use_the_bound_unless_the_order_is_reproduced() -> None:
    reduction = Reduction.across_replicas([np.float32(1.0)] * 4)
    close = np.nextafter(np.float32(4.0), np.float32(5.0))
    actual = _obs(reduced(pd.PerReplica([close, close]), reduction))
    reference = _obs(pd.PerReplica([np.float32(4.0)] * 2))
    assert compare(actual, reference, BOUNDED) == []
    assert len(compare(actual, reference, BITWISE)) == 2
    far = _obs(reduced(np.float32(4.01), reduction))
    [error] = compare(far, _obs(np.float32(4.0)), BOUNDED)
    assert "exceeds the error bound" in error
    assert "4 terms" in error


@pytest.mark.parametrize(
    ("name", "tiny", "count", "wide"),
    # 1 + count * tiny: rounded after each addition it stays 1.0 (each tiny is at
    # most half an ulp); rounded once it is `wide`.
    [
        ("bfloat16", 2.0**-8, 7, 1.03125),
        ("float8_e4m3fn", 2.0**-4, 3, 1.25),
        ("float8_e5m2", 2.0**-4, 3, 1.25),
    ],
)
def test_extension_float_sums_use_the_bound_even_in_bitwise_mode(
    name: str, tiny: float, count: int, wide: float
) -> None:
    # XLA:CPU adds bfloat16 in a wider type: a declared "sequential" order is no
    # claim about its bits, so marked sums of extension floats get the bound.
    dtype = np.dtype(getattr(ml_dtypes, name))
    sequential = Policy(bitwise_sums=True, reference_exact=False)
    terms = [np.array(1.0, dtype)] + [np.array(tiny, dtype)] * count
    reduction = Reduction.across_replicas(terms)
    reference = _obs(np.array(1.0, dtype))
    assert compare(_obs(reduced(np.array(wide, dtype), reduction)), reference, sequential) == []
    assert sequential.bound_for(reduction, dtype) is False  # the oracle is not exact
    assert sequential.bound_for(reduction, np.dtype(np.float32)) is None
    [error] = compare(_obs(reduced(np.array(4.0, dtype), reduction)), reference, sequential)
    assert "exceeds the error bound" in error
    # Unmarked values still match bit for bit.
    [error] = compare(_obs(np.array(wide, dtype)), reference, sequential)
    assert "bit for bit" in error


def test_local_sums_use_the_bound_even_in_bitwise_mode() -> None:
    reduction = Reduction.along_axis([np.ones(4, np.float32)], 0)
    close = np.nextafter(np.float32(4.0), np.float32(5.0))
    assert compare(_obs(reduced(close, reduction)), _obs(np.float32(4.0)), BITWISE) == []


def test_integers_are_exact_even_when_marked() -> None:
    reduction = Reduction.across_replicas([np.ones(2)] * 3)
    errors = compare(_obs(reduced(np.int32(3), reduction)), _obs(np.int32(4)), BOUNDED)
    assert len(errors) == 1


def test_expected_policy_names_the_documented_result() -> None:
    [error] = compare(_obs(np.float32(1)), _obs(np.float32(2)), EXPECTED)
    assert "documented result gave" in error


def test_variables_are_observed_as_their_class_and_copies() -> None:
    strategy = pd.MirroredStrategy(2)
    with strategy.scope():
        mirrored = pd.Variable(np.float32(1.0))
        on_read = pd.Variable(
            0.0,
            synchronization=pd.VariableSynchronization.ON_READ,
            aggregation=pd.VariableAggregation.SUM,
        )
    on_read.values[1].assign(np.float32(2.0))
    plain_variable = pd.Variable(3)
    out = plain(_obs({"m": mirrored, "s": on_read, "p": plain_variable}))
    assert out["m"] == Distributed("MirroredVariable", (np.float32(1.0),) * 2)
    assert out["s"] == Distributed("SyncOnReadVariable", (np.float32(0.0), np.float32(2.0)))
    assert out["p"] == Distributed("Variable", (np.int32(3),))
    # An expected result spells a variable as a Distributed record.
    expected = _obs({"m": Distributed("MirroredVariable", (np.float32(1.0),) * 2)})
    assert compare(_obs({"m": mirrored}), expected, EXPECTED) == []
    [error] = compare(_obs({"m": on_read}), expected, EXPECTED)
    assert "SyncOnReadVariable of 2" in error and "MirroredVariable of 2" in error
