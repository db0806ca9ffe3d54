"""The same programs on the sim ("sequential") and on torch (4 virtual CPU replicas), bitwise."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

import polydist as pd
from polydist_sim import SimBackend
from polydist_torch import TorchBackend

N = 4


def sim_strategy(n: int = N) -> pd.MirroredStrategy:
    return pd.MirroredStrategy(n, backend=SimBackend("sequential"))


def torch_strategy(n: int = N) -> pd.MirroredStrategy:
    # Named CPU devices: virtual CPU replicas even on a machine with CUDA.
    return pd.MirroredStrategy([f"/cpu:{i}" for i in range(n)], backend=TorchBackend("sequential"))


def both(n: int = N) -> list[pd.MirroredStrategy]:
    return [sim_strategy(n), torch_strategy(n)]


def per_replica(strategy: pd.Strategy, arrays: Sequence[np.ndarray]) -> pd.PerReplica:
    """One NumPy array per replica, placed on each replica's device by the strategy's backend."""
    backend = strategy.extended.backend
    devices = strategy.extended.worker_devices
    return pd.PerReplica([backend.place(a, d) for a, d in zip(arrays, devices)])


def xp() -> Any:
    return pd.get_strategy().extended.array_namespace()


def rid() -> Any:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return ctx.replica_id_in_sync_group


def to_numpy(strategy: pd.Strategy, tree: Any) -> Any:
    """Every array in ``tree`` (distributed values unpacked to tuples) as NumPy."""
    backend = strategy.extended.backend
    if isinstance(tree, pd.DistributedValues):
        return (type(tree).__name__, tuple(to_numpy(strategy, v) for v in tree.values))
    if isinstance(tree, dict):
        return {k: to_numpy(strategy, v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        items = [to_numpy(strategy, v) for v in tree]
        if hasattr(tree, "_fields"):
            return (type(tree).__name__, tuple(items))
        return type(tree)(items)
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        return backend.to_numpy(tree)
    return tree


def assert_bitwise_equal(a: Any, b: Any, path: str = "result") -> None:
    """Same structure, and every array has the same dtype, shape and bytes."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        assert a.tobytes() == b.tobytes(), f"{path}: values differ:\n{a!r}\n{b!r}"
        return
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def wide_floats(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Values over many orders of magnitude, so that the order of a sum shows in the bits."""
    mags = 10.0 ** rng.uniform(-4, 4, size=shape)
    return (rng.standard_normal(shape) * mags).astype(dtype)


def run_both(program: Any, n: int = N) -> None:
    """Runs ``program(strategy)`` on the sim and on torch; the NumPy results must match bitwise."""
    results = [to_numpy(s, program(s)) for s in both(n)]
    assert_bitwise_equal(results[0], results[1])


# -- run, replica ids, regrouping -----------------------------------------------------


def test_replica_ids_are_int32_per_replica() -> None:
    def program(s: pd.Strategy) -> Any:
        return s.run(rid)

    run_both(program)
    ids = torch_strategy().run(rid)
    assert [int(v) for v in ids.values] == [0, 1, 2, 3]
    assert all(v.dtype == torch.int32 for v in ids.values)


def test_run_args_kwargs_and_regrouping() -> None:
    Pair = collections.namedtuple("Pair", ["first", "second"])
    shared = np.arange(3, dtype=np.float32)

    def program(s: pd.Strategy) -> Any:
        x = per_replica(s, [np.full(2, r + 1, np.float32) for r in range(N)])
        constant = s.extended.backend.place(shared, "/cpu:0")

        def fn(a: Any, *, scale: Any) -> Any:
            return {
                "nest": [a * scale, (a + 1, Pair(a, xp().astype(rid(), xp().float64)))],
                "same": constant,  # the very same object on every replica: not wrapped
                "none": None,
            }

        out = s.run(fn, args=(x,), kwargs={"scale": 2.0})
        assert out["same"] is constant and out["none"] is None
        assert isinstance(out["nest"][1][1], Pair)
        return out

    run_both(program)


def test_experimental_local_results_and_values_from_function() -> None:
    def program(s: pd.Strategy) -> Any:
        ns = s.extended.array_namespace()
        values = s.experimental_distribute_values_from_function(
            lambda ctx: ns.asarray([ctx.replica_id_in_sync_group] * 3, dtype=ns.int64)
        )
        return s.experimental_local_results(values), s.experimental_local_results(1.5)

    run_both(program)


# -- all_reduce ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32, np.int64])
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_all_reduce_matches_sequential_sim_bitwise(dtype: Any, op: str) -> None:
    rng = np.random.default_rng(7)
    if np.dtype(dtype).kind == "f":
        data = [wide_floats(rng, (5, 7), dtype) for _ in range(N)]
    else:
        data = [rng.integers(-1000, 1000, size=(5, 7)).astype(dtype) for _ in range(N)]

    def program(s: pd.Strategy) -> Any:
        x = per_replica(s, data)
        return s.run(lambda v: pd.get_replica_context().all_reduce(op, v), args=(x,))

    run_both(program)
    if op == "MEAN" and np.dtype(dtype).kind == "i":
        out = torch_strategy().run(
            lambda v: pd.get_replica_context().all_reduce(op, v),
            args=(per_replica(torch_strategy(), data),),
        )
        assert out.values[0].dtype == torch.float64  # TF: integer MEAN is float64


def test_float_sums_really_depend_on_the_order() -> None:
    # Guards the test above: with these values "exact" and "sequential" differ.
    rng = np.random.default_rng(7)
    data = [wide_floats(rng, (5, 7), np.float32) for _ in range(N)]
    exact = pd.MirroredStrategy(N, backend=SimBackend("exact"))
    got = [
        s.extended.backend.to_numpy(s.reduce("SUM", per_replica(s, data), axis=None))
        for s in (exact, torch_strategy())
    ]
    assert got[0].tobytes() != got[1].tobytes()


def test_all_reduce_nests_and_python_scalars() -> None:
    rng = np.random.default_rng(3)
    a = [wide_floats(rng, (4,), np.float32) for _ in range(N)]
    b = [rng.integers(0, 9, size=(2, 2)).astype(np.int32) for _ in range(N)]

    def program(s: pd.Strategy) -> Any:
        pa, pb = per_replica(s, a), per_replica(s, b)

        def fn(x: Any, y: Any) -> Any:
            ctx = pd.get_replica_context()
            nest = {"x": x, "pair": (y, 1.5), "list": [x * 2.0]}
            return (
                ctx.all_reduce("SUM", nest),
                ctx.all_reduce("MEAN", nest),
                ctx.all_reduce(pd.ReduceOp.SUM, 3),
            )

        return s.run(fn, args=(pa, pb))

    run_both(program)


def test_tf_two_device_all_reduce_example() -> None:
    # TwoDeviceDistributionTestBase: inputs [1, 3] and [[39, 2], [3, 41]].
    def program(s: pd.Strategy) -> Any:
        x = per_replica(s, [np.float32(1.0), np.float32(3.0)])
        y = per_replica(s, [np.array([39.0, 2.0], np.float32), np.array([3.0, 41.0], np.float32)])

        def fn(u: Any, v: Any) -> Any:
            ctx = pd.get_replica_context()
            return ctx.all_reduce("SUM", (u, v)), ctx.all_reduce("MEAN", (u, v))

        return s.run(fn, args=(x, y))

    run_both(program, n=2)
    out = program(torch_strategy(2))
    assert [float(t) for t in out[0][0].values] == [4.0, 4.0]
    assert out[0][1].values[0].tolist() == [42.0, 43.0]
    assert out[1][1].values[1].tolist() == [21.0, 21.5]


# -- all_gather ---------------------------------------------------------------------------


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_all_gather_uneven(axis: int) -> None:
    rng = np.random.default_rng(5)
    shapes = [(2, 3, 2), (2, 1, 2), (2, 4, 2), (2, 2, 2)] if axis == 1 else None

    def shape_for(r: int) -> tuple[int, ...]:
        if shapes is not None:
            return shapes[r]
        return (r + 1, 2, 3) if axis == 0 else (2, 3, r + 1)

    data = [wide_floats(rng, shape_for(r), np.float32) for r in range(N)]
    ints = [np.arange(r + 1, dtype=np.int64).reshape(1, -1) for r in range(N)]

    def program(s: pd.Strategy) -> Any:
        x, i = per_replica(s, data), per_replica(s, ints)

        def fn(v: Any, w: Any) -> Any:
            ctx = pd.get_replica_context()
            return ctx.all_gather({"v": v}, axis), ctx.all_gather(w, 1)

        return s.run(fn, args=(x, i)), s.gather(x, axis)

    run_both(program)


# -- merge_call, reduce, gather -------------------------------------------------------------


def test_merge_call_with_strategy_reduce_inside() -> None:
    rng = np.random.default_rng(11)
    data = [wide_floats(rng, (3,), np.float32) for _ in range(N)]

    def program(s: pd.Strategy) -> Any:
        x = per_replica(s, data)

        def merge_fn(strategy: pd.Strategy, value: Any) -> Any:
            assert pd.in_cross_replica_context()
            return strategy.reduce("SUM", value, axis=None), strategy.reduce(
                "MEAN", value, axis=None
            )

        def fn(v: Any) -> Any:
            total, mean = pd.get_replica_context().merge_call(merge_fn, args=(v,))
            return total + mean * 0.0, v

        return s.run(fn, args=(x,))

    run_both(program)


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_strategy_reduce_and_gather(op: str) -> None:
    rng = np.random.default_rng(13)
    floats = [wide_floats(rng, (3, 2), np.float32) for _ in range(N)]
    ints = [rng.integers(-50, 50, size=(3,)).astype(np.int32) for _ in range(N)]
    # Per-replica sums over an axis use each library's own xp.sum, whose internal
    # order differs; small integers in float32 keep those sums exact.
    batch = [np.arange(r + 1, dtype=np.float32) for r in range(N)]

    def program(s: pd.Strategy) -> Any:
        f, i, b = per_replica(s, floats), per_replica(s, ints), per_replica(s, batch)
        return (
            s.reduce(op, f, axis=None),
            s.reduce(op, i, axis=None),
            s.reduce(op, {"f": f, "i": i}, axis=None),
            s.reduce(op, b, axis=0),
            s.reduce(op, i, axis=0),
            s.gather(b, axis=0),
            s.gather(f, axis=1),
        )

    run_both(program)


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_reduce_with_axis_of_numpy_values(op: str) -> None:
    """NumPy components (never placed by the caller) reduce over an axis as the sim's.

    Issue 22 item 5: torch's xp.sum got the NumPy arrays and raised TypeError.
    """
    ones = np.ones((2, 3), np.float32)
    ints = [np.arange(6, dtype=np.int32).reshape(2, 3) * (r + 1) for r in range(N)]

    def program(s: pd.Strategy) -> Any:
        from_run = s.run(lambda: np.full((3, 2), 1.5, np.float32) * (1 + int(rid())))
        return (
            s.reduce(op, pd.PerReplica([ones] * N), axis=0),
            s.reduce(op, pd.PerReplica(ints), axis=[0, 1]),
            s.reduce(op, ones, axis=1),  # a plain value counts once per replica
            s.reduce(op, from_run, axis=0),
        )

    run_both(program)
    run_both(program, 2)


def test_reduce_of_mirrored_and_plain_values() -> None:
    def program(s: pd.Strategy) -> Any:
        mirrored = s.run(lambda: pd.get_replica_context().all_reduce("SUM", 2.0))
        return s.reduce("MEAN", mirrored, axis=None), s.reduce("MEAN", 5.0, axis=None)

    run_both(program)


def test_one_device_strategy() -> None:
    def program(s: pd.Strategy) -> Any:
        def fn(v: Any) -> Any:
            ctx = pd.get_replica_context()
            return ctx.all_reduce("SUM", v), ctx.all_gather(v, 0), ctx.num_replicas_in_sync

        value = s.extended.backend.place(np.arange(3, dtype=np.float32), "/cpu:0")
        out = s.run(fn, args=(value,))
        return out, s.reduce("SUM", out[0], axis=None), s.reduce("MEAN", out[1], axis=0)

    results = [
        to_numpy(s, program(s))
        for s in (
            pd.OneDeviceStrategy("/cpu:0", backend=SimBackend("sequential")),
            pd.OneDeviceStrategy("/cpu:0", backend=TorchBackend("sequential")),
        )
    ]
    assert_bitwise_equal(results[0], results[1])


# -- mismatches are the core runner's, with torch frames skipped -----------------------------


def test_collective_mismatch_raises() -> None:
    def fn() -> Any:
        if int(rid()) == 2:
            return None
        return pd.get_replica_context().all_reduce("SUM", torch.ones(3))

    for s in both():
        with pytest.raises(pd.CollectiveMismatchError) as info:
            s.run(fn)
        message = str(info.value)
        assert "replica 2 (/job:localhost/replica:0/task:0/device:" in message
        assert "returned from fn" in message
        assert "all_reduce(SUM) of float32[3] at test_against_sim.py:" in message


def test_shape_mismatch_raises() -> None:
    def fn() -> Any:
        n = int(rid()) % 2 + 1
        return pd.get_replica_context().all_reduce("SUM", torch.ones(n))

    with pytest.raises(pd.CollectiveMismatchError, match=r"float32\[1\].*\n.*float32\[2\]"):
        torch_strategy().run(fn)


def test_replica_exception_propagates() -> None:
    def fn() -> Any:
        if int(rid()) == 1:
            raise ValueError("boom on replica 1")
        return pd.get_replica_context().all_reduce("SUM", torch.ones(1))

    with pytest.raises(ValueError, match="boom on replica 1"):
        torch_strategy().run(fn)
