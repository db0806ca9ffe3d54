"""Framework pytrees are nests: a registered tree system (here a fake one, as a backend
registers JAX's or torch's) makes its nodes flow through run, collectives, reduce,
gather, experimental_distribute_values_from_function and checkpoints, keeping their type."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist import checkpoint
from polydist._valuetypes import nest as _nest
from polydist.backend import register_tree_system


class Box:
    """A framework node: two children, a label that is part of its structure."""

    def __init__(self, a: Any, b: Any, label: str = "box") -> None:
        self.a, self.b, self.label = a, b, label

    def __repr__(self) -> str:
        return f"Box({self.a!r}, {self.b!r}, {self.label!r})"


class Leafy:
    """A type the fake framework treats as a leaf."""


def _flatten(x: Any) -> tuple[list[Any], str] | None:
    if type(x) is Box:
        return [x.a, x.b], x.label
    return None


def _keys(x: Box) -> tuple[str, str]:
    return ("a", "b")


def _unflatten(label: str, children: Sequence[Any]) -> Box:
    a, b = children
    return Box(a, b, label)


@pytest.fixture
def fake_system() -> Iterator[None]:
    register_tree_system("fake", _flatten, _unflatten, _keys)
    yield
    _nest._unregister_tree_system("fake")


def rid() -> int:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return int(ctx.replica_id_in_sync_group)


def values(x: Any) -> list[Any]:
    return [np.asarray(v).tolist() for v in x.values]


class TestNest:
    def test_flatten_unflatten_and_paths(self, fake_system: None) -> None:
        tree = {"x": Box(1, [2, Box(3, None, "inner")]), "y": 4}
        leaves, spec = _nest.flatten(tree)
        assert leaves == [1, 2, 3, None, 4]  # None stays a leaf
        back = _nest.unflatten(spec, [10, 20, 30, 40, 50])
        assert isinstance(back["x"], Box) and back["x"].label == "box"
        assert back["x"].a == 10 and back["x"].b[1].a == 30 and back["x"].b[1].b == 40
        assert back["x"].b[1].label == "inner"
        paths, _, _ = _nest.flatten_with_path(tree)
        assert paths == [("x", "a"), ("x", "b", 0), ("x", "b", 1, "a"), ("x", "b", 1, "b"), ("y",)]
        assert _nest.is_nested(Box(1, 2)) and not _nest.is_nested(Leafy())
        hash(spec)  # specs key compiled programs

    def test_flatten_one_level_gives_keys_and_rebuilds(self, fake_system: None) -> None:
        node = _nest.flatten_one_level(Box(1, [2], "b"))
        assert node is not None
        assert list(node.children) == [1, [2]] and tuple(node.entries) == ("a", "b")
        rebuilt = node.unflatten_func(node.metadata, ["x", "y"])
        assert (type(rebuilt), rebuilt.a, rebuilt.b, rebuilt.label) == (Box, "x", "y", "b")
        assert _nest.flatten_one_level({"k": 1}).entries == ("k",)
        assert _nest.flatten_one_level(None) is None and _nest.flatten_one_level(1.0) is None
        assert _nest.flatten_one_level(pd.PerReplica([1.0, 2.0])) is None

    def test_map_structure_over_two_trees_checks_structure(self, fake_system: None) -> None:
        out = _nest.map_structure(lambda p, q: p + q, Box(1, 2), Box(10, 20))
        assert (type(out), out.a, out.b) == (Box, 11, 22)
        with pytest.raises(ValueError):
            _nest.map_structure(lambda p, q: p + q, Box(1, 2), Box(10, 20, "other"))

    def test_without_a_system_a_box_is_a_leaf(self) -> None:
        box = Box(1, 2)
        assert _nest.flatten(box)[0] == [box] and not _nest.is_nested(box)

    def test_registering_later_reclassifies_a_type_seen_as_a_leaf(self) -> None:
        box = Box(1, 2)
        assert not _nest.is_nested(box)
        register_tree_system("fake", _flatten, _unflatten, _keys)
        try:
            assert _nest.flatten(box)[0] == [1, 2]
        finally:
            _nest._unregister_tree_system("fake")
        assert not _nest.is_nested(box)

    def test_distributed_values_and_none_stay_leaves(self) -> None:
        def greedy(x: Any) -> tuple[list[Any], None] | None:
            if x is None or isinstance(x, pd.DistributedValues | pd.Variable):
                return [], None  # claims them: core must not ask
            return None

        register_tree_system("greedy", greedy, lambda aux, children: None)
        try:
            per_replica = pd.PerReplica([np.float32(1), np.float32(2)])
            variable = pd.Variable(1.0)
            leaves, _ = _nest.flatten([per_replica, None, variable])
            assert leaves[0] is per_replica and leaves[1] is None and leaves[2] is variable
        finally:
            _nest._unregister_tree_system("greedy")

    def test_bad_registrations_and_inconsistent_systems(self) -> None:
        with pytest.raises(TypeError, match="flatten_one_level must be callable"):
            register_tree_system("bad", None, _unflatten)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="name must be a non-empty str"):
            register_tree_system("", _flatten, _unflatten)

        def fickle(x: Any) -> tuple[list[Any], None] | None:
            return ([x.a], None) if type(x) is Box and x.a != "no" else None

        register_tree_system("fickle", fickle, lambda aux, children: Box(children[0], 0))
        try:
            assert _nest.flatten(Box(1, 2))[0] == [1]
            with pytest.raises(TypeError, match="must be a node for every instance"):
                _nest.flatten(Box("no", 2))
        finally:
            _nest._unregister_tree_system("fickle")

    def test_unhashable_aux_still_gives_hashable_specs(self) -> None:
        def listy(x: Any) -> tuple[list[Any], list[str]] | None:
            return ([x.a, x.b], [x.label]) if type(x) is Box else None

        register_tree_system("listy", listy, lambda aux, ch: Box(ch[0], ch[1], aux[0]))
        try:
            _, spec = _nest.flatten(Box(1, 2, "l"))
            _, same = _nest.flatten(Box(3, 4, "l"))
            assert spec == same and hash(spec) == hash(same)
            assert _nest.flatten(Box(1, 2, "m"))[1] != spec
        finally:
            _nest._unregister_tree_system("listy")


class TestStrategy:
    def test_run_arguments_and_results_keep_the_type(self, fake_system: None) -> None:
        strategy = pd.MirroredStrategy(2)
        arg = strategy.experimental_distribute_values_from_function(
            lambda ctx: Box(np.float32(ctx.replica_id_in_sync_group), {"k": np.float32(5)})
        )
        assert isinstance(arg, Box) and isinstance(arg.a, pd.PerReplica)
        assert values(arg.a) == [0.0, 1.0] and values(arg.b["k"]) == [5.0, 5.0]

        def step(box: Box) -> Box:
            assert isinstance(box, Box)  # each replica gets its own component
            return Box(box.a * 2, box.b["k"] + rid(), "out")

        out = strategy.run(step, args=(arg,))
        assert isinstance(out, Box) and out.label == "out"
        assert values(out.a) == [0.0, 2.0] and values(out.b) == [5.0, 6.0]

    @pytest.mark.parametrize(("op", "expected"), [("SUM", [1.0, 12.0]), ("MEAN", [0.5, 6.0])])
    def test_all_reduce(self, fake_system: None, op: str, expected: list[float]) -> None:
        strategy = pd.MirroredStrategy(2)

        def step() -> Any:
            ctx = pd.get_replica_context()
            assert ctx is not None
            box = Box(np.float32(rid()), [np.float32(6)], "grads")
            return ctx.all_reduce(op, box)

        out = strategy.run(step)
        assert isinstance(out, Box) and out.label == "grads" and isinstance(out.b, list)
        assert values(out.a) == [expected[0]] * 2 and values(out.b[0]) == [expected[1]] * 2

    def test_all_gather(self, fake_system: None) -> None:
        strategy = pd.MirroredStrategy(2)

        def step() -> Any:
            ctx = pd.get_replica_context()
            assert ctx is not None
            return ctx.all_gather(Box(np.full((1,), rid(), np.float32), np.zeros((2,))), axis=0)

        out = strategy.run(step)
        assert isinstance(out, Box)
        assert values(out.a) == [[0.0, 1.0]] * 2 and values(out.b) == [[0.0] * 4] * 2

    def test_reduce_and_gather_in_cross_replica_context(self, fake_system: None) -> None:
        strategy = pd.MirroredStrategy(2)
        value = strategy.experimental_distribute_values_from_function(
            lambda ctx: Box(
                np.arange(2, dtype=np.float32) + 2 * ctx.replica_id_in_sync_group,
                np.full((1,), ctx.replica_id_in_sync_group, np.float32),
            )
        )
        total = strategy.reduce("SUM", value, axis=None)
        assert isinstance(total, Box) and np.asarray(total.a).tolist() == [2.0, 4.0]
        mean = strategy.reduce("MEAN", value, axis=0)
        assert isinstance(mean, Box) and float(mean.a) == 1.5  # (0+1+2+3) / 4
        assert float(mean.b) == 0.5
        gathered = strategy.gather(value, axis=0)
        assert isinstance(gathered, Box) and np.asarray(gathered.a).tolist() == [0, 1, 2, 3]
        local = strategy.experimental_local_results(value)
        assert [type(x) for x in local] == [Box, Box] and local[1].b.tolist() == [1.0]

    def test_replicas_returning_different_structures_is_an_error(self, fake_system: None) -> None:
        strategy = pd.MirroredStrategy(2)
        with pytest.raises(ValueError, match="different structures"):
            strategy.run(lambda: Box(1.0, 2.0, f"replica{rid()}"))


class TestVariables:
    def test_a_nest_as_initial_value_says_to_map_over_it(self, fake_system: None) -> None:
        for nest in (Box(1.0, 2.0), {"w": 1.0, "b": [2.0]}):
            with pytest.raises(TypeError, match=r"a nest of 2 leaves, but a variable holds one"):
                pd.Variable(nest)
        assert pd.Variable([1.0, 2.0]).numpy().tolist() == [1.0, 2.0]  # a list is one array


class TestCheckpoint:
    def test_save_and_restore_a_box_of_variables(self, fake_system: None, tmp_path: Path) -> None:
        strategy = pd.MirroredStrategy(2)
        with strategy.scope():
            tree = Box(pd.Variable(np.ones(3, np.float32)), {"w": pd.Variable(2.0)})
        checkpoint.save(tmp_path, tree)
        tree.a.assign(np.zeros(3, np.float32))
        tree.b["w"].assign(0.0)
        checkpoint.restore(tmp_path, tree)
        assert tree.a.numpy().tolist() == [1.0, 1.0, 1.0] and float(tree.b["w"].numpy()) == 2.0
        fresh = Box(pd.Variable(np.zeros(3, np.float32)), {"w": pd.Variable(0.0)})
        checkpoint.restore(tmp_path, fresh)  # found by path ("a", "b/w"), without a strategy
        assert fresh.a.numpy().tolist() == [1.0, 1.0, 1.0] and float(fresh.b["w"].numpy()) == 2.0
