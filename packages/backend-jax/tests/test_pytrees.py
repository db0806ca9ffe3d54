"""JAX pytrees are polydist nests: flax nnx.State, FrozenDict, optax states and registered
classes flow through run, all_reduce, reduce, all_gather, gather,
experimental_distribute_values_from_function and checkpoints, compiled and eager,
keeping their types and structures."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.core import FrozenDict

import polydist as pd
from polydist import checkpoint
from polydist_jax import JaxBackend

N = 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    w: Any
    b: Any
    name: str = dataclasses.field(default="dense", metadata={"static": True})


class Pair:
    """A class registered with jax.tree_util.register_pytree_node."""

    def __init__(self, first: Any, second: Any) -> None:
        self.first, self.second = first, second


jax.tree_util.register_pytree_node(
    Pair, lambda p: ((p.first, p.second), None), lambda _, c: Pair(*c)
)


def _nnx_state() -> Any:
    return nnx.split(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))[1]


TEMPLATES: dict[str, Callable[[], Any]] = {
    "nnx_state": _nnx_state,
    "frozendict": lambda: FrozenDict({"w": jnp.zeros((2, 3)), "inner": {"b": jnp.zeros(3)}}),
    "optax_adam": lambda: optax.adam(1e-3).init(_nnx_state()),
    "dataclass": lambda: Layer(jnp.zeros((2, 2)), jnp.zeros(2), "head"),
    "registered": lambda: Pair(jnp.zeros(3), [jnp.zeros((1, 2), jnp.int32)]),
}
KINDS = sorted(TEMPLATES)


def build(kind: str, replica: int) -> Any:
    """The template with leaf i on ``replica`` filled with (replica + 1) * (i + 1)."""
    leaves, treedef = jax.tree.flatten(TEMPLATES[kind]())
    filled = [
        jnp.full(jnp.shape(x), (replica + 1) * (i + 1), jnp.asarray(x).dtype)
        for i, x in enumerate(leaves)
    ]
    return jax.tree.unflatten(treedef, filled)


def expected_sum(kind: str) -> list[np.ndarray]:
    parts = [jax.tree.leaves(build(kind, r)) for r in range(N)]
    return [sum(np.asarray(p[i]) for p in parts) for i in range(len(parts[0]))]


def assert_tree(got: Any, kind: str, want: list[Any]) -> None:
    """``got`` has the template's exact JAX structure (types, keys, static fields)."""
    assert jax.tree.structure(got) == jax.tree.structure(TEMPLATES[kind]())
    leaves = jax.tree.leaves(got)
    assert len(leaves) == len(want)
    for g, w in zip(leaves, want, strict=True):
        assert np.asarray(g).dtype == np.asarray(w).dtype
        np.testing.assert_array_equal(np.asarray(g), w)


def ctx() -> pd.ReplicaContext:
    c = pd.get_replica_context()
    assert c is not None
    return c


@pytest.fixture(params=[True, False], ids=["compiled", "eager"])
def strategy(request: pytest.FixtureRequest) -> pd.Strategy:
    return pd.MirroredStrategy(N, backend=JaxBackend(jit=request.param))


def distributed(strategy: pd.Strategy, kind: str) -> Any:
    return strategy.experimental_distribute_values_from_function(
        lambda c: build(kind, c.replica_id_in_sync_group)
    )


@pytest.mark.parametrize("kind", KINDS)
def test_values_from_function_gives_the_tree_of_per_replica(
    strategy: pd.Strategy, kind: str
) -> None:
    value = distributed(strategy, kind)
    assert type(value) is type(TEMPLATES[kind]())
    local = strategy.experimental_local_results(value)
    assert len(local) == N
    for r in range(N):
        assert_tree(local[r], kind, jax.tree.leaves(build(kind, r)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_all_reduce_in_run(strategy: pd.Strategy, kind: str, op: str) -> None:
    def step(tree: Any) -> Any:
        assert type(tree) is type(TEMPLATES[kind]())  # each replica gets its own tree
        return ctx().all_reduce(op, tree)

    out = strategy.run(step, args=(distributed(strategy, kind),))
    assert type(out) is type(TEMPLATES[kind]())
    want = expected_sum(kind)
    if op == "MEAN":  # MEAN of integers is float64 (x64 off: float32), as in TF
        want = [w / N if w.dtype.kind == "f" else (w / N).astype(np.float32) for w in want]
    for local in strategy.experimental_local_results(out):
        assert_tree(local, kind, want)


@pytest.mark.parametrize("kind", KINDS)
def test_run_results_keep_the_type(strategy: pd.Strategy, kind: str) -> None:
    def step() -> Any:
        replica = ctx().replica_id_in_sync_group
        return jax.tree.map(lambda x: jnp.zeros_like(x) + replica, TEMPLATES[kind]())

    out = strategy.run(step)
    assert type(out) is type(TEMPLATES[kind]())
    for r, local in enumerate(strategy.experimental_local_results(out)):
        leaves = jax.tree.leaves(TEMPLATES[kind]())
        assert_tree(local, kind, [np.zeros_like(np.asarray(x)) + r for x in leaves])


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "optax_adam"])  # adam's count: rank 0
def test_all_gather_and_gather(strategy: pd.Strategy, kind: str) -> None:
    value = distributed(strategy, kind)
    out = strategy.run(lambda tree: ctx().all_gather(tree, axis=0), args=(value,))
    want = [
        np.concatenate([np.asarray(jax.tree.leaves(build(kind, r))[i]) for r in range(N)])
        for i in range(len(jax.tree.leaves(TEMPLATES[kind]())))
    ]
    for local in strategy.experimental_local_results(out):
        assert_tree(local, kind, want)
    assert_tree(strategy.gather(value, axis=0), kind, want)


@pytest.mark.parametrize("kind", KINDS)
def test_reduce(strategy: pd.Strategy, kind: str) -> None:
    value = distributed(strategy, kind)
    assert_tree(strategy.reduce("SUM", value, axis=None), kind, expected_sum(kind))
    if kind == "optax_adam":
        return  # its step count has rank 0: no axis 0
    total = strategy.reduce("SUM", value, axis=0)
    assert type(total) is type(TEMPLATES[kind]())
    rows = [jax.tree.leaves(build(kind, r)) for r in range(N)]
    for i, got in enumerate(jax.tree.leaves(total)):
        stacked = np.concatenate([np.asarray(row[i]) for row in rows])
        np.testing.assert_array_equal(np.asarray(got), stacked.sum(axis=0))


@pytest.mark.parametrize("kind", ["nnx_state", "frozendict", "dataclass", "registered"])
def test_checkpoint_a_tree_of_variables(tmp_path: Path, kind: str) -> None:
    strategy = pd.MirroredStrategy(N, backend=JaxBackend())
    with strategy.scope():
        tree = jax.tree.map(pd.Variable, build(kind, 1))
    checkpoint.save(tmp_path, tree)
    saved = jax.tree.leaves(build(kind, 1))
    for v in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, pd.Variable)):
        v.assign(jnp.zeros_like(v.read_value()))
    checkpoint.restore(tmp_path, tree)
    restored = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, pd.Variable))
    assert [v.numpy().tolist() for v in restored] == [np.asarray(s).tolist() for s in saved]
    # Without a strategy, into a fresh tree of the same structure, found by path.
    fresh = jax.tree.map(lambda x: pd.Variable(jnp.zeros_like(x)), build(kind, 0))
    checkpoint.restore(tmp_path, fresh)
    got = jax.tree.leaves(fresh, is_leaf=lambda x: isinstance(x, pd.Variable))
    assert [v.numpy().tolist() for v in got] == [np.asarray(s).tolist() for s in saved]


def test_checkpoint_names_entries_by_tree_path(tmp_path: Path) -> None:
    state = jax.tree.map(pd.Variable, _nnx_state())
    layer = Layer(pd.Variable(jnp.ones(2)), pd.Variable(jnp.full(2, 2.0)))
    checkpoint.save(tmp_path, {"model": state, "head": layer})
    # Plain dicts keyed by the paths JAX gives (dict keys, attribute and field names).
    plain = {
        "model": {
            "bias": {"value": pd.Variable(jnp.full(3, 7.0))},
            "kernel": {"value": pd.Variable(jnp.zeros((2, 3)))},
        },
        "head": {"w": pd.Variable(jnp.zeros(2)), "b": pd.Variable(jnp.zeros(2))},
    }
    checkpoint.restore(tmp_path, plain)
    assert plain["model"]["bias"]["value"].numpy().tolist() == [0.0, 0.0, 0.0]
    np.testing.assert_array_equal(
        plain["model"]["kernel"]["value"].numpy(), state["kernel"].get_value().numpy()
    )
    assert plain["head"]["w"].numpy().tolist() == [1.0, 1.0]
    assert plain["head"]["b"].numpy().tolist() == [2.0, 2.0]


def test_distributed_values_stay_leaves_although_jax_sees_inside() -> None:
    strategy = pd.MirroredStrategy(2, backend=JaxBackend())
    value = strategy.experimental_distribute_values_from_function(
        lambda c: {"x": jnp.float32(c.replica_id_in_sync_group)}
    )
    assert isinstance(value["x"], pd.PerReplica)
    assert len(jax.tree.leaves(value)) == 2  # JAX opens PerReplica ...
    from polydist.backend import nest as _nest

    leaves, _ = _nest.flatten(value)
    assert leaves == [value["x"]]  # ... polydist does not


def test_mismatched_trees_from_replicas_name_the_difference() -> None:
    strategy = pd.MirroredStrategy(2, backend=JaxBackend(jit=False))

    def step() -> Any:
        name = "a" if ctx().replica_id_in_sync_group == 0 else "b"
        return Layer(jnp.zeros(2), jnp.zeros(2), name)

    with pytest.raises(ValueError, match="different structures"):
        strategy.run(step)


class Tagged:
    """Registered with node data JAX cannot hash (a list)."""

    def __init__(self, value: Any, tags: list[str]) -> None:
        self.value, self.tags = value, tags


jax.tree_util.register_pytree_node(
    Tagged, lambda t: ((t.value,), list(t.tags)), lambda tags, c: Tagged(c[0], tags)
)


def test_unhashable_node_data_still_compiles_and_caches(strategy: pd.Strategy) -> None:
    def step(tree: Any) -> Any:
        return ctx().all_reduce("SUM", tree)

    for _ in range(2):  # the second call finds the compiled program by structure
        value = strategy.experimental_distribute_values_from_function(
            lambda c: Tagged(jnp.full(2, c.replica_id_in_sync_group, jnp.float32), ["a"])
        )
        out = strategy.run(step, args=(value,))
        for local in strategy.experimental_local_results(out):
            assert type(local) is Tagged and local.tags == ["a"]
            assert np.asarray(local.value).tolist() == [6.0, 6.0]  # 0 + 1 + 2 + 3
