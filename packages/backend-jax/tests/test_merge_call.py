"""merge_call inside a compiled run: lazy per-replica values, one collective, results back."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_testutil import assert_results_match, distribute, mixed_floats

import polydist as pd
from polydist_jax import JaxBackend, LazyPerReplica
from polydist_sim import SimBackend

N = 8


@pytest.fixture
def strategies(jax_backend: JaxBackend, sim_backend: SimBackend) -> tuple[pd.Strategy, pd.Strategy]:
    return pd.MirroredStrategy(N, backend=jax_backend), pd.MirroredStrategy(N, backend=sim_backend)


def ctx() -> pd.ReplicaContext:
    c = pd.get_replica_context()
    assert c is not None
    return c


ROWS = [mixed_floats(np.random.default_rng(7), (4,)) for _ in range(N)]


def reduce_in_merge(x: Any) -> Any:
    def merge_fn(strategy: pd.Strategy, value: Any) -> Any:
        assert pd.in_cross_replica_context()
        assert pd.get_replica_context() is None
        assert isinstance(value, pd.PerReplica)
        return strategy.reduce("SUM", value, axis=None)

    return ctx().merge_call(merge_fn, args=(x,))


def test_strategy_reduce_inside_merge_fn_matches_sim(
    strategies: tuple[pd.Strategy, pd.Strategy],
) -> None:
    got, want = (s.run(reduce_in_merge, (distribute(s, ROWS),)) for s in strategies)
    assert_results_match(got, want)


def test_strategy_reduce_inside_merge_fn_compiles_to_one_psum(jax_backend: JaxBackend) -> None:
    strategy = pd.MirroredStrategy(N, backend=jax_backend)
    lowered = jax_backend.lower(strategy, reduce_in_merge, (distribute(strategy, ROWS),))
    stablehlo = str(lowered.as_text())
    assert len(re.findall(r"stablehlo\.all_reduce", stablehlo)) == 1
    assert "all_gather" not in stablehlo
    hlo = str(lowered.compile().as_text())
    assert len(re.findall(r"= \S+ all-reduce\(", hlo)) == 1
    assert "all-gather" not in hlo


def test_merge_fn_sees_lazy_per_replica_and_shared_inputs_unwrapped(
    jax_backend: JaxBackend,
) -> None:
    strategy = pd.MirroredStrategy(N, backend=jax_backend)
    seen: dict[str, Any] = {}

    def merge_fn(strategy: pd.Strategy, x: Any, w: Any, tag: str) -> Any:
        seen.update(x=x, w=w, tag=tag)
        return tag

    def step(x: Any, w: Any) -> Any:
        return ctx().merge_call(merge_fn, args=(x, w), kwargs={"tag": "t"})

    w = jnp.ones(4)
    assert strategy.run(step, (distribute(strategy, ROWS), w)) == "t"
    assert isinstance(seen["x"], LazyPerReplica)
    assert "float32[4]" in repr(seen["x"])
    assert not isinstance(seen["w"], pd.DistributedValues)  # same object on every replica
    assert seen["tag"] == "t"


def test_local_results_inside_merge_fn(strategies: tuple[pd.Strategy, pd.Strategy]) -> None:
    # Indexing the components materializes them (one all_gather).
    def step(x: Any) -> Any:
        def merge_fn(strategy: pd.Strategy, v: Any) -> Any:
            parts = strategy.experimental_local_results(v)
            return parts[0] * 0 + parts[N - 1] + parts[2]

        return ctx().merge_call(merge_fn, args=(x,))

    got, want = (s.run(step, (distribute(s, ROWS),)) for s in strategies)
    assert_results_match(got, want)


def test_per_replica_merge_results_go_back_to_their_replica(
    strategies: tuple[pd.Strategy, pd.Strategy],
) -> None:
    def step(x: Any) -> Any:
        def merge_fn(strategy: pd.Strategy, v: Any) -> Any:
            total = strategy.reduce("MEAN", v, axis=None)
            return {"same": v, "mean": total, "doubled": pd.PerReplica([c * 2 for c in v.values])}

        out = ctx().merge_call(merge_fn, args=(x,))
        return out["same"] + 1, out["mean"], out["doubled"]

    got, want = (s.run(step, (distribute(s, ROWS),)) for s in strategies)
    assert_results_match(got, want)


def test_gather_and_reduce_with_axis_inside_merge_fn(
    strategies: tuple[pd.Strategy, pd.Strategy],
) -> None:
    ints = [np.arange(3, dtype=np.int32) + 3 * r for r in range(N)]

    def step(x: Any) -> Any:
        def merge_fn(strategy: pd.Strategy, v: Any) -> Any:
            return strategy.gather(v, 0), strategy.reduce("SUM", v, axis=None)

        return ctx().merge_call(merge_fn, args=(x,))

    got, want = (s.run(step, (distribute(s, ints),)) for s in strategies)
    assert_results_match(got, want)


def test_reduce_to_mirrored_inside_merge_fn(strategies: tuple[pd.Strategy, pd.Strategy]) -> None:
    def step(x: Any) -> Any:
        def merge_fn(strategy: pd.Strategy, v: Any) -> Any:
            return strategy.extended.reduce_to("SUM", v, destinations=v)

        return ctx().merge_call(merge_fn, args=(x,))

    got, want = (s.run(step, (distribute(s, ROWS),)) for s in strategies)
    assert_results_match(got, want)


def test_exceptions_in_merge_fn_propagate(jax_backend: JaxBackend) -> None:
    strategy = pd.MirroredStrategy(2, backend=jax_backend)

    def merge_fn(strategy: pd.Strategy) -> None:
        raise KeyError("from merge_fn")

    with pytest.raises(KeyError, match="from merge_fn"):
        strategy.run(lambda: ctx().merge_call(merge_fn))
    # The failed trace left no context behind.
    assert not pd.has_strategy()
    assert pd.get_replica_context() is not None


def test_merge_results_stay_one_value_in_later_merge_calls(
    strategies: tuple[pd.Strategy, pd.Strategy],
) -> None:
    def step(x: Any) -> Any:
        total = ctx().merge_call(lambda s, v: s.reduce("SUM", v, axis=None), args=(x,))
        return ctx().merge_call(lambda s, t: (isinstance(t, pd.PerReplica), t * 2), args=(total,))

    got, want = (s.run(step, (distribute(s, ROWS),)) for s in strategies)
    assert_results_match(got, want)
    assert got[0] is False
    assert not isinstance(got[1], pd.DistributedValues)


def test_lower_refuses_uneven_inputs(jax_backend: JaxBackend) -> None:
    strategy = pd.MirroredStrategy(2, backend=jax_backend)
    x = pd.PerReplica([jnp.ones(3), jnp.ones(2)])
    with pytest.raises(ValueError, match=r"no single compiled program .*float32\[2\]"):
        jax_backend.lower(strategy, lambda x: x, (x,))


# --------------------------------------------------------------------------- eager runs
# merge_fn's strategy.reduce puts its result on the host device; each replica must get
# it on its own device (TF copies across devices), or jnp ops with the replica's own
# arrays fail ("incompatible devices"). Eager: JaxBackend(jit=False), or a compiled
# run's fallback for uneven inputs.

TOTALS = [np.arange(1.0, 4.0, dtype=np.float32) * (r + 1) for r in range(3)]


@pytest.mark.parametrize("devices", [[0, 1, 2], [1, 3, 5]], ids=["host-is-replica-0", "off-host"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "uneven-fallback"])
def test_reduce_in_merge_fn_reaches_each_replica_on_its_device(
    devices: list[int], jit: bool
) -> None:
    backend = JaxBackend(jit=jit)
    strategy = pd.MirroredStrategy([f"/cpu:{d}" for d in devices], backend=backend)
    sim = pd.MirroredStrategy(3, backend=SimBackend("sequential"))
    # With jit=True the last replica's extra row makes the inputs uneven: eager fallback.
    rows = [t if r < 2 or not jit else np.concatenate([t, t[:1]]) for r, t in enumerate(TOTALS)]

    def step(x: Any) -> Any:
        total = ctx().merge_call(lambda s, v: s.reduce("SUM", v, axis=None), args=(x[:3],))
        return total + x[:3]

    x = pd.PerReplica([jax.device_put(r, jax.devices()[d]) for r, d in zip(rows, devices)])
    got = strategy.run(step, (x,))
    want = sim.run(step, (pd.PerReplica(rows),))
    assert backend.eager_fallback_count == (1 if jit else 0)
    for r, d in enumerate(devices):
        value = got.values[r]
        assert value.devices() == {jax.devices()[d]}
        np.testing.assert_array_equal(np.asarray(value), want.values[r])
    np.testing.assert_array_equal(np.asarray(got.values[2]), sum(TOTALS) + TOTALS[2])


def test_eager_merge_fn_result_returned_whole_stays_one_value() -> None:
    """Every replica returning merge_fn's one array regroups to that array (as on the sim),
    though each replica got its own copy on its device."""
    strategy = pd.MirroredStrategy(["/cpu:1", "/cpu:2"], backend=JaxBackend(jit=False))
    seen: list[Any] = []

    def step(x: Any) -> Any:
        total = ctx().merge_call(lambda s, v: s.reduce("SUM", v, axis=None), args=(x,))
        seen.append(total.devices())
        return total

    x = pd.PerReplica([jax.device_put(TOTALS[r], jax.devices()[r + 1]) for r in range(2)])
    got = strategy.run(step, (x,))
    assert not isinstance(got, pd.DistributedValues)
    np.testing.assert_array_equal(np.asarray(got), TOTALS[0] + TOTALS[1])
    assert sorted(seen, key=str) == [{jax.devices()[1]}, {jax.devices()[2]}]
