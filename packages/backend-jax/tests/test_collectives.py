"""Collectives, in replica context (compiled) and cross-replica, bit for bit against the sim."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax_testutil import assert_results_match, assert_same_bits, distribute, mixed_floats

import polydist as pd
from polydist.errors import InvalidArgumentError
from polydist_jax import JaxBackend
from polydist_sim import SimBackend

N = 8


@pytest.fixture
def strategies(jax_backend: JaxBackend, sim_backend: SimBackend) -> tuple[pd.Strategy, pd.Strategy]:
    return pd.MirroredStrategy(N, backend=jax_backend), pd.MirroredStrategy(N, backend=sim_backend)


def ctx() -> pd.ReplicaContext:
    c = pd.get_replica_context()
    assert c is not None
    return c


def both(strategies: tuple[pd.Strategy, pd.Strategy], program: Any) -> None:
    assert_results_match(program(strategies[0]), program(strategies[1]))


# --------------------------------------------------------------------------- replica context


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_all_reduce_nest_is_bitwise_sequential(
    strategies: tuple[pd.Strategy, pd.Strategy], op: str
) -> None:
    rng = np.random.default_rng(1)
    floats = [mixed_floats(rng, (5, 7)) for _ in range(N)]
    ints = [rng.integers(-(2**30), 2**30, size=(3,), dtype=np.int32) for _ in range(N)]
    scalars = [mixed_floats(rng, ()) for _ in range(N)]

    def program(strategy: pd.Strategy) -> Any:
        f, i, s = (distribute(strategy, v) for v in (floats, ints, scalars))

        def step(f: Any, i: Any, s: Any) -> Any:
            nest = {"f": f, "pair": (s, [f[0]])}
            if op == "SUM":
                nest["i"] = i  # int MEAN needs float64: see test_int_mean_*
            return ctx().all_reduce(op, nest)

        return strategy.run(step, args=(f, i, s))

    both(strategies, program)


def test_all_reduce_of_python_numbers_and_constants(
    strategies: tuple[pd.Strategy, pd.Strategy],
) -> None:
    # TF: every replica contributes its own copy, so SUM of 1.0 is N.
    both(
        strategies,
        lambda s: s.run(lambda: ctx().all_reduce("SUM", [1.0, 2, np.ones(2, np.float32)])),
    )


def test_all_reduce_sums_with_int_wraparound(strategies: tuple[pd.Strategy, pd.Strategy]) -> None:
    big = [np.full(2, 2**30, np.int32) for _ in range(N)]
    both(strategies, lambda s: s.run(lambda x: ctx().all_reduce("SUM", x), (distribute(s, big),)))


def test_int_mean_is_float64_with_x64(sim_backend: SimBackend) -> None:
    with jax.enable_x64(True):
        jax_strategy = pd.MirroredStrategy(N, backend=JaxBackend())
        assert jax_strategy.extended.backend.capabilities.float64
        sim_strategy = pd.MirroredStrategy(N, backend=sim_backend)
        ints = [np.arange(3, dtype=np.int32) + r for r in range(N)]

        def program(strategy: pd.Strategy) -> Any:
            x = distribute(strategy, ints)
            in_run = strategy.run(lambda x: ctx().all_reduce("MEAN", x), (x,))
            return in_run, strategy.reduce("MEAN", x, axis=None)

        got, want = program(jax_strategy), program(sim_strategy)
        assert_results_match(got, want)
        assert got[1].dtype == np.float64


def test_int_mean_without_x64_is_float32_without_a_warning(jax_backend: JaxBackend) -> None:
    strategy = pd.MirroredStrategy(N, backend=jax_backend)
    x = distribute(strategy, [np.full(2, r, np.int32) for r in range(N)])
    out = strategy.run(lambda x: ctx().all_reduce("MEAN", x), (x,))  # filterwarnings=error
    assert out.values[0].dtype == np.float32
    np.testing.assert_array_equal(out.values[0], [3.5, 3.5])


def test_bool_sum_is_refused_like_the_sim(strategies: tuple[pd.Strategy, pd.Strategy]) -> None:
    for strategy in strategies:
        flags = distribute(strategy, [np.array([True, False])] * N)
        with pytest.raises(TypeError, match="cannot SUM bool"):
            strategy.reduce("SUM", flags, axis=None)
    with pytest.raises(TypeError, match="cannot SUM bool"):
        strategies[0].run(lambda: ctx().all_reduce("SUM", jnp.array([True])))


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_all_gather(strategies: tuple[pd.Strategy, pd.Strategy], axis: int) -> None:
    rng = np.random.default_rng(2)
    rows = [mixed_floats(rng, (2, 3)) for _ in range(N)]

    def program(strategy: pd.Strategy) -> Any:
        x = distribute(strategy, rows)
        return strategy.run(lambda x: ctx().all_gather({"x": x, "l": [x + 1]}, axis), (x,))

    both(strategies, program)


def test_all_gather_of_a_scalar_is_refused(jax_backend: JaxBackend) -> None:
    strategy = pd.MirroredStrategy(2, backend=jax_backend)
    with pytest.raises(InvalidArgumentError, match="rank >= 1"):
        strategy.run(lambda: ctx().all_gather(jnp.float32(1.0), 0))


def test_uneven_all_gather_runs_eagerly_and_matches(
    strategies: tuple[pd.Strategy, pd.Strategy],
) -> None:
    # A partial last batch: replicas hold 3, 3, ..., 1, 0 rows. No single compiled
    # program fits every replica, so the jax backend runs this call eagerly.
    sizes = [3, 3, 3, 3, 3, 2, 1, 0]
    rows = [np.arange(s * 2, dtype=np.float32).reshape(s, 2) + 10 * r for r, s in enumerate(sizes)]

    def program(strategy: pd.Strategy) -> Any:
        x = distribute(strategy, rows)
        return strategy.run(
            lambda x: (ctx().all_gather(x, 0), ctx().all_reduce("SUM", x.sum())), (x,)
        )

    backend = strategies[0].extended.backend
    assert isinstance(backend, JaxBackend)
    both(strategies, program)
    assert backend.eager_fallback_count == 1
    assert backend.compile_count == 0


def test_uneven_inputs_can_be_refused() -> None:
    strategy = pd.MirroredStrategy(2, backend=JaxBackend(eager_fallback=False))
    x = pd.PerReplica([np.zeros(3, np.float32), np.zeros(2, np.float32)])
    with pytest.raises(
        ValueError, match=r"replica 0 has float32\[3\] but replica 1 has float32\[2\].*Pad"
    ):
        strategy.run(lambda x: x, (x,))


@settings(max_examples=25, deadline=None)
@given(
    n=st.sampled_from([1, 2, 3, 8]),
    seed=st.integers(0, 2**32 - 1),
)
def test_all_reduce_property_bitwise(n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = [mixed_floats(rng, (16,)) for _ in range(n)]
    jax_strategy = pd.MirroredStrategy(n, backend=_SHARED_BACKEND)
    sim_strategy = pd.MirroredStrategy(n, backend=SimBackend("sequential"))

    def program(strategy: pd.Strategy) -> Any:
        x = distribute(strategy, rows)
        in_run = strategy.run(lambda x: ctx().all_reduce("SUM", x), (x,))
        return in_run, strategy.reduce("SUM", x, axis=None)

    assert_results_match(program(jax_strategy), program(sim_strategy))


# One backend for all hypothesis examples, so each replica count compiles once.
_SHARED_BACKEND = JaxBackend()


# --------------------------------------------------------------------------- cross-replica


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_strategy_reduce_axis_none_is_bitwise_sequential(
    strategies: tuple[pd.Strategy, pd.Strategy], op: str
) -> None:
    rng = np.random.default_rng(3)
    rows = [mixed_floats(rng, (64,)) for _ in range(N)]
    both(strategies, lambda s: s.reduce(op, distribute(s, rows), axis=None))


UNEVEN_SIZES = [4, 4, 3, 0, 2, 4, 1, 4]
UNEVEN_INTS = [np.arange(s, dtype=np.int32) * (r + 1) for r, s in enumerate(UNEVEN_SIZES)]


def test_strategy_reduce_mean_with_axis_uneven(sim_backend: SimBackend) -> None:
    # MEAN divides by the true element count (19), exact for partial and empty batches.
    with jax.enable_x64(True):
        jax_strategy = pd.MirroredStrategy(N, backend=JaxBackend())
        got = jax_strategy.reduce("MEAN", distribute(jax_strategy, UNEVEN_INTS), axis=0)
    sim_strategy = pd.MirroredStrategy(N, backend=sim_backend)
    want = sim_strategy.reduce("MEAN", distribute(sim_strategy, UNEVEN_INTS), axis=0)
    assert_same_bits(got, want)


def test_strategy_reduce_sum_with_axis_uneven(strategies: tuple[pd.Strategy, pd.Strategy]) -> None:
    both(strategies, lambda s: s.reduce("SUM", distribute(s, UNEVEN_INTS), axis=0))
    got = strategies[0].reduce("SUM", distribute(strategies[0], UNEVEN_INTS), axis=0)
    assert int(got) == 116
    assert got.dtype == np.int32  # TF's reduce_sum keeps int32


def test_strategy_reduce_of_run_outputs(strategies: tuple[pd.Strategy, pd.Strategy]) -> None:
    rng = np.random.default_rng(4)
    rows = [mixed_floats(rng, (3, 4)) for _ in range(N)]

    def program(strategy: pd.Strategy) -> Any:
        out = strategy.run(lambda x: (x * 3, x.max()), (distribute(strategy, rows),))
        return strategy.reduce("SUM", out, axis=None)

    both(strategies, program)


@pytest.mark.parametrize("axis", [0, 1])
def test_strategy_gather_uneven(strategies: tuple[pd.Strategy, pd.Strategy], axis: int) -> None:
    shapes = [(r % 3, 2) if axis == 0 else (2, r % 3) for r in range(N)]
    rows = [np.full(shape, r, np.float32) for r, shape in enumerate(shapes)]
    both(strategies, lambda s: s.gather(distribute(s, rows), axis))


def test_gather_and_local_results_nested(strategies: tuple[pd.Strategy, pd.Strategy]) -> None:
    def program(strategy: pd.Strategy) -> Any:
        xp = strategy.extended.array_namespace()
        out = strategy.run(
            lambda: {"a": xp.reshape(ctx().replica_id_in_sync_group, (1,)), "b": "t"}
        )
        return strategy.gather(out, 0), strategy.experimental_local_results(out)

    both(strategies, program)


def test_reduce_to_mirrored_destinations(strategies: tuple[pd.Strategy, pd.Strategy]) -> None:
    rng = np.random.default_rng(5)
    rows = [mixed_floats(rng, (6,)) for _ in range(N)]

    def program(strategy: pd.Strategy) -> Any:
        x = distribute(strategy, rows)
        return strategy.extended.reduce_to("MEAN", x, destinations=x)

    got, want = program(strategies[0]), program(strategies[1])
    assert isinstance(got, pd.Mirrored)
    assert_results_match(got, want)
    assert [v.devices() for v in got.values] == [{d} for d in jax.devices()]


def test_batch_reduce_to(strategies: tuple[pd.Strategy, pd.Strategy]) -> None:
    def program(strategy: pd.Strategy) -> Any:
        a = distribute(strategy, [np.full(2, r, np.float32) for r in range(N)])
        b = distribute(strategy, [np.full(3, -r, np.int32) for r in range(N)])
        return strategy.extended.batch_reduce_to("SUM", [(a, "/cpu:0"), (b, a)])

    both(strategies, program)


def test_sum_order_follows_replica_order_not_device_ids(sim_backend: SimBackend) -> None:
    # Mesh order is worker_devices order, so psum adds replica 0, then 1, ... whatever
    # devices they are on, like the sim's "sequential" order.
    jax_strategy = pd.MirroredStrategy(["/cpu:7", "/cpu:3", "/cpu:0"], backend=JaxBackend())
    sim_strategy = pd.MirroredStrategy(3, backend=sim_backend)
    rng = np.random.default_rng(9)
    rows = [mixed_floats(rng, (257,)) for _ in range(3)]

    def program(strategy: pd.Strategy) -> Any:
        x = distribute(strategy, rows)
        return strategy.run(lambda x: ctx().all_reduce("SUM", x), (x,)), strategy.reduce(
            "SUM", x, axis=None
        )

    assert_results_match(program(jax_strategy), program(sim_strategy))
    reversed_order = SimBackend("reverse")
    assert not np.array_equal(
        np.asarray(program(jax_strategy)[1]),
        np.asarray(program(pd.MirroredStrategy(3, backend=reversed_order))[1]),
    )


def test_across_processes_a_nest_is_packed_into_one_all_reduce_per_dtype() -> None:
    # XLA's CPU runtime runs each operand of an all-reduce as its own collective across
    # processes, so a program whose replicas span processes packs a nest as TF does:
    # one operand per dtype. Here a (workers, replicas) mesh of local devices stands in.
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from polydist_jax._lazy import AXIS, WORKERS, axes_scope
    from polydist_jax._spmd import _packed_psum

    shapes = [(3, 4), (5,), (), (2, 0), (7,), (1, 1)]
    floats = [np.arange(int(np.prod(s)), dtype=np.float32).reshape(s) for s in shapes]
    ints = [np.arange(4, dtype=np.int32), np.full((2, 2), 3, np.int32)]
    args = [jnp.asarray(a) for a in floats + ints]
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), (WORKERS, AXIS))

    empty = next(i for i, s in enumerate(shapes) if 0 in s)

    def program(bytes_per_pack: int) -> Any:
        def each(*xs: Any) -> Any:  # every replica holds the same arrays
            with axes_scope((WORKERS, AXIS)):
                sums = _packed_psum(list(xs), bytes_per_pack)
            # An empty array needs no sum: it is handed back, and left out of the
            # program's outputs (beside a collective one crashes XLA:CPU, jax 0.11.2).
            assert sums[empty] is xs[empty]
            return tuple(v for i, v in enumerate(sums) if i != empty)

        return jax.jit(jax.shard_map(each, mesh=mesh, in_specs=P(), out_specs=P()))

    assert program(0).lower(*args).as_text().count("stablehlo.all_reduce") == 2
    nonempty = [a for i, a in enumerate(floats + ints) if i != empty]
    for got, a in zip(program(0)(*args), nonempty, strict=True):
        assert got.shape == a.shape and got.dtype == a.dtype
        assert np.array_equal(np.asarray(got), 4 * a)
    # Packs of about 16 bytes (TF's group_by_size): float32's 5 non-empty arrays in 4
    # (an empty array needs no sum), int32's in 1.
    assert program(16).lower(*args).as_text().count("stablehlo.all_reduce") == 5
    for got, a in zip(program(16)(*args), nonempty, strict=True):
        assert np.array_equal(np.asarray(got), 4 * a)


def test_across_processes_large_arrays_are_all_reduce_operands_of_their_own() -> None:
    # XLA:CPU all-reduces a large concatenation several times slower than its parts (an
    # MLP step with two 8 MiB gradients took 4x as long), so arrays of a MiB or more are
    # never packed, and a pack of small ones closes past MAX_PACK_BYTES.
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from polydist_jax._lazy import AXIS, WORKERS, axes_scope
    from polydist_jax._spmd import MAX_PACK_BYTES, OWN_OPERAND_BYTES, _packed_psum

    big = OWN_OPERAND_BYTES // 4  # float32 elements
    small = MAX_PACK_BYTES // 4 // 5  # five of these fill a pack
    shapes = [(big,), (3,), (big + 1,), (4,), *[(small,)] * 6]
    args = [jnp.full(s, i + 1, jnp.float32) for i, s in enumerate(shapes)]
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), (WORKERS, AXIS))

    def each(*xs: Any) -> Any:
        with axes_scope((WORKERS, AXIS)):
            return tuple(_packed_psum(list(xs), 0))

    program = jax.jit(jax.shard_map(each, mesh=mesh, in_specs=P(), out_specs=P()))
    # The two big ones alone, the small ones in two packs (closed past MAX_PACK_BYTES).
    assert program.lower(*args).as_text().count("stablehlo.all_reduce") == 4
    for got, a in zip(program(*args), args, strict=True):
        assert got.shape == a.shape
        assert np.array_equal(np.asarray(got), 4 * np.asarray(a))


@pytest.mark.parametrize("bytes_per_pack", [0, 64, 1 << 20])
def test_across_processes_packed_sums_equal_unpacked_ones_bit_for_bit(bytes_per_pack: int) -> None:
    # Packing concatenates a nest's arrays per dtype; each element is still the sum of the
    # same replicas' values in the same order: the result must be the very bits of one
    # all-reduce per array, for mixed dtypes, shapes and weak types, with values that
    # differ on every replica (so a misplaced element or another order shows).
    from jax._src.lax.lax import _convert_element_type
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from polydist_jax._lazy import AXIS, WORKERS, axes_scope
    from polydist_jax._spmd import OWN_OPERAND_BYTES, _packed_psum

    rng = np.random.default_rng(7)
    replicas = 4
    specs = [
        ((3, 5), np.float32),
        ((7,), jnp.bfloat16),
        ((), np.float32),
        ((2, 3, 2), np.float16),
        ((OWN_OPERAND_BYTES // 4 + 3,), np.float32),  # an operand of its own
        ((4,), np.int32),
        ((1, 1), jnp.bfloat16),
        ((11,), np.float32),
        ((2, 2), np.int8),
    ]

    def value(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        if np.issubdtype(dtype, np.integer):
            return rng.integers(-20, 20, size=(replicas, *shape)).astype(dtype)
        # Wide exponent range: sums round, so the order of the additions shows.
        scale = np.exp2(rng.integers(-12, 12, size=(replicas, *shape)))
        return (rng.standard_normal((replicas, *shape)) * scale).astype(dtype)

    stacked = [jnp.asarray(value(shape, dtype)) for shape, dtype in specs]
    mesh = Mesh(np.array(jax.devices()[:replicas]).reshape(2, 2), (WORKERS, AXIS))
    axes = (WORKERS, AXIS)

    def program(packed: bool) -> Any:
        def each(*blocks: Any) -> Any:
            xs = [b[0] for b in blocks]  # this replica's own values
            # A weakly typed float32 array keeps an operand (and its type) of its own.
            weak = _convert_element_type(xs[7] * 3, np.dtype(np.float32), weak_type=True)
            assert weak.aval.weak_type
            xs.append(weak)
            with axes_scope(axes):
                if packed:
                    return tuple(_packed_psum(xs, bytes_per_pack))
                return tuple(jax.lax.psum(x, axes) for x in xs)

        specs_in = tuple(P(axes) for _ in stacked)
        return jax.jit(
            jax.shard_map(each, mesh=mesh, in_specs=specs_in, out_specs=P(), check_vma=False)
        )

    want = program(False)(*stacked)
    got = program(True)(*stacked)
    assert len(got) == len(want) == len(specs) + 1
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype and g.weak_type == w.weak_type
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes()
    # Packed indeed: fewer all-reduces than arrays.
    packed_ops = program(True).lower(*stacked).as_text().count("stablehlo.all_reduce")
    assert packed_ops < program(False).lower(*stacked).as_text().count("stablehlo.all_reduce")


@pytest.mark.parametrize("shape", [(), (3,)], ids=["rank0", "vector"])
def test_reduce_of_run_results_moves_them_in_one_transfer(
    strategies: tuple[pd.Strategy, pd.Strategy], shape: tuple[int, ...], monkeypatch: Any
) -> None:
    # A training loop's strategy.reduce of its loss each step: the components on other
    # devices reach the destination in one batched device_put, and the sum is the sim's
    # bit for bit (replica order).
    rng = np.random.default_rng(3)
    values = [rng.normal(size=shape).astype(np.float32) * 10.0**r for r in range(N)]

    calls: list[Any] = []
    put = jax.device_put

    def program(strategy: pd.Strategy) -> Any:
        per_replica = distribute(strategy, values)
        for _ in range(3):  # a direct call's results too
            out = strategy.run(lambda x: x * 3, (per_replica,))
        monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(a) or put(*a, **k))
        reduced = [strategy.reduce(op, out, axis=None) for op in ("SUM", "MEAN")]
        monkeypatch.undo()
        return reduced

    got = program(strategies[0])
    assert len(calls) == 2  # one per reduce (SUM, MEAN), not one per replica
    assert_results_match(got, program(strategies[1]))
