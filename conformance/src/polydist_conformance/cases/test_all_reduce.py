"""ReplicaContext.all_reduce: SUM and MEAN of arrays and nests, in replica context.

Every replica gets the result, as its own value. MEAN of integers is
float64 (reference A, ``all_reduce``; B.7, B.9; TF's docstring examples).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist_conformance import Conformance, Reduction, reduced
from polydist_conformance.cases._helpers import distribute, per_replica, replica_context

# TF's nest example: two replicas, SUM {'a': 4, 'b': [42, 99]}, MEAN {'a': 2, 'b': [21, 49.5]}.
NEST: list[dict[str, Any]] = [{"a": 1, "b": [40, 1]}, {"a": 3, "b": [2, 98]}]


def _all_reduce(op: Any) -> Any:
    def fn(value: Any) -> Any:
        return replica_context().all_reduce(op, value)

    return fn


def _distribute_nest(strategy: pd.Strategy, xp: Any, dtype: Any) -> Any:
    return {
        "a": distribute(strategy, xp, [np.asarray(v["a"], dtype) for v in NEST]),
        "b": [
            distribute(strategy, xp, [np.asarray(v["b"][i], dtype) for v in NEST]) for i in range(2)
        ],
    }


def _mirror(values: dict[str, Any]) -> dict[str, Any]:
    return {
        "a": pd.PerReplica([values["a"]] * 2),
        "b": [pd.PerReplica([v] * 2) for v in values["b"]],
    }


def test_docstring_scalar_sum(conformance: Conformance) -> None:
    """``all_reduce(SUM, identity(1.))`` on 2 replicas gives 2.0 on each."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        out = strategy.run(lambda: _all_reduce(pd.ReduceOp.SUM)(xp.asarray(1.0, dtype=xp.float32)))
        return strategy.experimental_local_results(out)

    conformance.check(program, replicas=2, expected=(np.float32(2.0), np.float32(2.0)))


def test_docstring_list_sum(conformance: Conformance) -> None:
    """A list ``[1., 2.]`` is reduced leaf by leaf: ``[2., 4.]`` on each replica."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        def step_fn() -> Any:
            value1 = xp.asarray(1.0, dtype=xp.float32)
            value2 = xp.asarray(2.0, dtype=xp.float32)
            return replica_context().all_reduce(pd.ReduceOp.SUM, [value1, value2])

        return strategy.experimental_local_results(strategy.run(step_fn))

    two, four = np.float32(2.0), np.float32(4.0)
    conformance.check(program, replicas=2, expected=([two, four], [two, four]))


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        ("SUM", {"a": np.float32(4), "b": [np.float32(42), np.float32(99)]}),
        ("MEAN", {"a": np.float32(2), "b": [np.float32(21), np.float32(49.5)]}),
    ],
)
def test_nest_example(conformance: Conformance, op: str, expected: dict[str, Any]) -> None:
    """``{'a': 1, 'b': [40, 1]}`` and ``{'a': 3, 'b': [2, 98]}``, float32."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return strategy.run(_all_reduce(op), args=(_distribute_nest(strategy, xp, np.float32),))

    conformance.check(program, replicas=2, expected=_mirror(expected))


def test_a_calls_options_change_no_result(conformance: Conformance) -> None:
    """``options=CommunicationOptions(bytes_per_pack=4)`` may split the nest into packs;
    the sums are the same."""
    options = pd.experimental.CommunicationOptions(bytes_per_pack=4)

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        def step(value: Any) -> Any:
            return replica_context().all_reduce(pd.ReduceOp.SUM, value, options=options)

        return strategy.run(step, args=(_distribute_nest(strategy, xp, np.float32),))

    expected = {"a": np.float32(4), "b": [np.float32(42), np.float32(99)]}
    conformance.check(program, replicas=2, expected=_mirror(expected))


def test_options_must_be_communication_options(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        def step() -> Any:
            value = xp.asarray(1.0, dtype=xp.float32)
            return replica_context().all_reduce(pd.ReduceOp.SUM, value, options={"a": 1})

        return strategy.run(step)

    conformance.check_raises(
        program, TypeError, match="options must be a polydist.experimental.CommunicationOptions"
    )


def test_nest_example_int32_sum_stays_int32(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return strategy.run(_all_reduce("SUM"), args=(_distribute_nest(strategy, xp, np.int32),))

    expected = {"a": np.int32(4), "b": [np.int32(42), np.int32(99)]}
    conformance.check(program, replicas=2, expected=_mirror(expected))


@pytest.mark.requires("float64")
def test_nest_example_int32_mean_is_float64(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return strategy.run(_all_reduce("MEAN"), args=(_distribute_nest(strategy, xp, np.int32),))

    expected = {"a": np.float64(2), "b": [np.float64(21), np.float64(49.5)]}
    conformance.check(program, replicas=2, expected=_mirror(expected))


@pytest.mark.parametrize(
    ("op", "scalar", "matrix"),
    [("SUM", 4.0, [42.0, 43.0]), ("MEAN", 2.0, [21.0, 21.5])],
)
def test_scalar_and_matrix_rows(
    conformance: Conformance, op: str, scalar: float, matrix: Any
) -> None:
    """B.9: inputs 1 and 3, and rows ``[39, 2]`` and ``[3, 41]``."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        s = distribute(strategy, xp, [np.float32(1), np.float32(3)])
        m = distribute(
            strategy, xp, [np.asarray([39, 2], np.float32), np.asarray([3, 41], np.float32)]
        )
        return strategy.run(_all_reduce(op), args=((s, m),))

    s, m = np.float32(scalar), np.asarray(matrix, np.float32)
    conformance.check(program, replicas=2, expected=(pd.PerReplica([s, s]), pd.PerReplica([m, m])))


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_random_nest(conformance: Conformance, op: str) -> None:
    """Random float32 leaves on every replica: each leaf within the sum's error bound."""
    n = conformance.replicas
    rng = np.random.default_rng(7)
    leaves: dict[str, list[Any]] = {
        "w": [rng.standard_normal((4, 3)).astype(np.float32) for _ in range(n)],
        "b": [(rng.standard_normal(5) * 1e3).astype(np.float32) for _ in range(n)],
        "s": [np.float32(rng.standard_normal()) for _ in range(n)],
    }
    mean = op == "MEAN"
    reductions = {k: Reduction.across_replicas(v, mean=mean) for k, v in leaves.items()}

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        values = {k: distribute(strategy, xp, v) for k, v in leaves.items()}
        out = strategy.run(_all_reduce(op), args=(values,))
        return {k: reduced(out[k], reductions[k]) for k in leaves}

    out = conformance.check(program)
    for k, v in leaves.items():
        exact = np.sum(np.stack(v).astype(np.float64), axis=0) / (n if mean else 1)
        for component in out[k].values if n > 1 else (out[k],):
            assert component.dtype == np.float32
            np.testing.assert_allclose(component, exact, rtol=1e-5, atol=1e-3)


def test_results_are_per_replica_values(conformance: Conformance) -> None:
    """Each replica gets its own copy of the result: a ``PerReplica``, not one shared array."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return strategy.run(lambda: _all_reduce("SUM")(xp.ones((2,), dtype=xp.float32)))

    n = conformance.replicas
    conformance.check(program, expected=per_replica([np.full(2, n, np.float32)] * n))


def test_op_strings_are_case_insensitive(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        def fn() -> Any:
            one = xp.ones((), dtype=xp.float32)
            ctx = replica_context()
            return {"sum": ctx.all_reduce("sum", one), "mean": ctx.all_reduce("Mean", one)}

        return strategy.run(fn)

    n = conformance.replicas
    conformance.check(
        program,
        expected={
            "sum": per_replica([np.float32(n)] * n),
            "mean": per_replica([np.float32(1.0)] * n),
        },
    )


def test_empty_nest(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return strategy.run(lambda: _all_reduce("SUM")({"a": [], "b": ()}))

    conformance.check(program, expected={"a": [], "b": ()})


def test_consecutive_all_reduces(conformance: Conformance) -> None:
    """Several collectives in one replica function run in program order."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        def fn() -> Any:
            ctx = replica_context()
            x = xp.astype(ctx.replica_id_in_sync_group, xp.float32) + 1
            total = ctx.all_reduce("SUM", x)
            return ctx.all_reduce("MEAN", x * total)

        return strategy.run(fn)

    n = conformance.replicas
    total = n * (n + 1) / 2
    conformance.check(program, expected=per_replica([np.float32(total * total / n)] * n))


@pytest.mark.requires("float64")
def test_float64_sum(conformance: Conformance) -> None:
    n = conformance.replicas
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(6) for _ in range(n)]
    reduction = Reduction.across_replicas(inputs)

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        out = strategy.run(_all_reduce("SUM"), args=(distribute(strategy, xp, inputs),))
        return reduced(out, reduction)

    out = conformance.check(program)
    first = out.values[0] if n > 1 else out
    assert first.dtype == np.float64


def test_default_replica_context_returns_the_value(conformance: Conformance) -> None:
    """Outside any strategy, ``all_reduce`` is the identity (one replica)."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        value = xp.asarray([1.0, 2.0], dtype=xp.float32)
        ctx = pd.get_replica_context()
        assert ctx is not None
        return {"sum": ctx.all_reduce("SUM", value), "mean": ctx.all_reduce("MEAN", value)}

    value = np.asarray([1.0, 2.0], np.float32)
    conformance.check(program, strategy="default", expected={"sum": value, "mean": value})


_NO_ML_DTYPES = "NumPy's bfloat16 (the sim oracle's) comes from ml_dtypes, not installed"


def _namespace_bfloat16(xp: Any) -> Any:
    """The array namespace's bfloat16: its own, else ml_dtypes' (NumPy's)."""
    dtype = getattr(xp, "bfloat16", None)
    if dtype is None:
        dtype = pytest.importorskip("ml_dtypes", reason=_NO_ML_DTYPES).bfloat16
    return dtype


def _bfloat16_or_skip(conformance: Conformance) -> None:
    """Skips where bfloat16 results cannot be compared as bfloat16."""
    backend = conformance.backend
    xp = backend.array_namespace()
    dtype = _namespace_bfloat16(xp)
    try:
        zeros = xp.zeros((1,), dtype=dtype)
    except (TypeError, ValueError) as e:
        pytest.skip(f"backend {backend.name!r}: its array namespace has no bfloat16 ({e})")
    got = np.asarray(backend.to_numpy(zeros)).dtype
    if got.name != "bfloat16":
        pytest.skip(
            f"backend {backend.name!r}: to_numpy returns {got} for a bfloat16 array, so its "
            "bfloat16 results cannot be compared as bfloat16"
        )
    _namespace_bfloat16(np)  # the oracle's


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_bfloat16(conformance: Conformance, op: str) -> None:
    """bfloat16 sums, as TF's add_n and JAX's psum give them (mixed precision).

    Runtimes add bfloat16 in a wider type (XLA:CPU's psum does), so these sums
    are compared within the error bound even where the order is bitwise.
    """
    _bfloat16_or_skip(conformance)
    n = conformance.replicas
    # Replica 0 has 1, the others 2**-8: each tie goes to 1.0 when every addition
    # rounds to bfloat16. All inputs and partial sums are exact in float32.
    inputs = [np.asarray([1.0 if r == 0 else 2.0**-8, r * 0.25 - 0.5]) for r in range(n)]
    reduction = Reduction.across_replicas(inputs, mean=op == "MEAN")

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        bf16 = _namespace_bfloat16(xp)
        rows = [xp.astype(xp.asarray(v, dtype=xp.float32), bf16) for v in inputs]
        out = strategy.run(_all_reduce(op), args=(distribute(strategy, xp, rows),))
        return reduced(out, reduction)

    if op == "SUM":
        exact = np.asarray([1 + (n - 1) * 2.0**-8, 0.125 * n * (n - 1) - 0.5 * n])
        # float64 -> float32 is exact here, so the cast rounds once.
        total = exact.astype(np.float32).astype(_namespace_bfloat16(np))
        conformance.check(program, expected=per_replica([total] * n))
    else:
        conformance.check(program)


def test_complex_mean_divides_each_part(conformance: Conformance) -> None:
    """MEAN of complex64 divides each part of the sum by N, correctly rounded: (10+1j)/3
    is (10/3, 1/3) in float32, where NumPy's, torch's and XLA's complex division (a
    multiplication by the reciprocal) are 1 ulp off, and (inf+1j)/3 is (inf, 1/3), where
    they give NaN in the imaginary part."""
    n = 3
    total = np.array([10 + 1j, np.inf + 1j, -7 - 2j], np.complex64)
    inputs = [total] + [np.zeros(3, np.complex64)] * (n - 1)
    mean = np.empty(3, np.complex64)
    mean.real = total.real / np.float32(n)
    mean.imag = total.imag / np.float32(n)
    assert mean[0].real == np.float32(10) / np.float32(3) != (total[:1] / np.float32(n))[0].real

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        out = strategy.run(_all_reduce("MEAN"), args=(distribute(strategy, xp, inputs),))
        return strategy.experimental_local_results(out)

    conformance.check(program, replicas=n, expected=(mean,) * n)
