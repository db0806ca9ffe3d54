"""The per-step shortcuts of ``strategy.run`` (issue 20): a lone thread-mode replica runs
with no scheduler, the replica id is placed only when asked for, plain arguments and
one replica's plain result skip the flatten. Each gives what the general path gives."""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist._valuetypes import nest as _nest
from polydist._valuetypes.values import regroup
from polydist_sim import SimBackend


def _ctx() -> pd.ReplicaContext:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return ctx


class CountingSim(SimBackend):
    """The sim, counting its placements of replica ids (0-d int32 arrays)."""

    def __init__(self, replica_mode: str = "greenlet") -> None:
        super().__init__(replica_mode=replica_mode)  # type: ignore[arg-type]
        self.id_placements = 0

    def place(self, value: Any, device: str) -> Any:
        if isinstance(value, np.ndarray) and value.dtype == np.int32 and value.ndim == 0:
            self.id_placements += 1
        return super().place(value, device)


def _strategies(backend: SimBackend, replicas: int) -> Iterator[pd.Strategy]:
    yield pd.MirroredStrategy(replicas, backend=backend)
    if replicas == 1:
        yield pd.OneDeviceStrategy("/cpu:0", backend=backend)


@pytest.mark.parametrize("mode", ["greenlet", "thread"])
@pytest.mark.parametrize("replicas", [1, 3])
def test_the_replica_id_is_placed_only_when_asked_for(mode: str, replicas: int) -> None:
    backend = CountingSim(mode)
    for strategy in _strategies(backend, replicas):
        backend.id_placements = 0
        out = strategy.run(lambda: np.float32(1.0))
        assert backend.id_placements == 0  # placed once per replica per run before
        ids = strategy.run(lambda: (_ctx().replica_id_in_sync_group, _ctx()))
        assert backend.id_placements == replicas
        locals_ = strategy.experimental_local_results(ids)
        for r, (rid, ctx) in enumerate(locals_):
            assert np.asarray(rid).dtype == np.int32 and int(rid) == r
            assert ctx.replica_id_in_sync_group is rid  # placed once, then the same value
        assert float(np.sum(strategy.experimental_local_results(out))) == replicas


def test_each_run_places_its_own_replica_id() -> None:
    # Never shared between runs: a replica that changes its id in place changes no other
    # run's (on torch, ``rid += 1`` is in place).
    strategy = pd.MirroredStrategy(1, backend=SimBackend(replica_mode="thread"))

    def bump() -> Any:
        rid = _ctx().replica_id_in_sync_group
        rid += 1  # NumPy: in place
        return rid

    first = strategy.run(bump)
    second = strategy.run(lambda: _ctx().replica_id_in_sync_group)
    assert int(first) == 1 and int(second) == 0 and first is not second


def test_a_lone_thread_replica_keeps_its_context_merge_call_and_collectives() -> None:
    strategy = pd.MirroredStrategy(1, backend=SimBackend(replica_mode="thread"))
    seen: dict[str, Any] = {}

    def merge_fn(s: pd.Strategy, value: Any) -> Any:
        seen["cross"] = pd.in_cross_replica_context()
        return s.reduce("SUM", value, axis=None) * 10

    def fn(x: Any) -> Any:
        ctx = _ctx()
        seen["thread"] = threading.get_ident()
        seen["strategy"] = ctx.strategy
        seen["index"] = ctx.devices
        total = ctx.all_reduce("MEAN", {"a": x, "b": [x * 2]})
        gathered = ctx.all_gather(x, axis=0)
        return ctx.merge_call(merge_fn, args=(total["b"][0],)), gathered

    merged, gathered = strategy.run(fn, args=(np.arange(3, dtype=np.float32),))
    assert seen["thread"] == threading.get_ident()
    assert seen["strategy"] is strategy and seen["index"] == strategy.extended.worker_devices
    assert seen["cross"] is True
    np.testing.assert_array_equal(merged, [0.0, 20.0, 40.0])
    np.testing.assert_array_equal(gathered, [0.0, 1.0, 2.0])


def test_a_lone_thread_replica_raises_its_own_error_and_leaves_no_context() -> None:
    strategy = pd.MirroredStrategy(1, backend=SimBackend(replica_mode="thread"))

    class Boom(Exception):
        pass

    def fn() -> Any:
        assert int(_ctx().replica_id_in_sync_group) == 0
        raise Boom("replica says no")

    with pytest.raises(Boom, match="replica says no"):
        strategy.run(fn)
    assert not pd.has_strategy() and not pd.in_cross_replica_context()
    assert float(strategy.run(lambda: _ctx().all_reduce("SUM", np.float32(2.5)))) == 2.5


def test_a_lone_thread_replica_still_checks_a_bad_all_reduce() -> None:
    # The one-replica path performs each collective at once, through the same checks.
    strategy = pd.MirroredStrategy(1, backend=SimBackend(replica_mode="thread"))
    with pytest.raises(ValueError, match="ReduceOp"):
        strategy.run(lambda: _ctx().all_reduce("MAX", np.float32(1.0)))


class Pairs(Mapping[str, Any]):
    """A Mapping optree does not know (a leaf to optree, a mapping to regroup)."""

    def __init__(self, items: dict[str, Any]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Any:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def test_plain_leaves_are_known_by_type_once_classified() -> None:
    x = np.ones(2, np.float32)
    _nest.flatten([x, None])  # classifies ndarray and NoneType
    assert _nest.is_plain_leaf(x) and _nest.is_plain_leaf(None)
    assert not _nest.is_plain_leaf([x]) and not _nest.is_plain_leaf((x,))
    assert not _nest.is_plain_leaf({"a": x})
    per_replica = pd.PerReplica([x, x])
    _nest.flatten(per_replica)
    assert not _nest.is_plain_leaf(per_replica)  # distributed: never plain

    class Fresh:
        pass

    assert not _nest.is_plain_leaf(Fresh())  # not classified yet: the general path decides
    _nest.flatten(Pairs({"k": x}))
    assert not _nest.is_plain_leaf(Pairs({"k": x}))  # a leaf to optree, rebuilt by regroup


class Box:
    def __init__(self, v: Any) -> None:
        self.v = v


def test_a_tree_system_registered_later_makes_a_plain_type_a_node_again() -> None:
    strategy = pd.MirroredStrategy(2)
    box = Box(np.float32(1))
    _nest.flatten(box)
    assert _nest.is_plain_leaf(box)  # an unknown class: a leaf
    _nest.register_tree_system(
        "test-box",
        lambda x: ([x.v], None) if isinstance(x, Box) else None,
        lambda aux, children: Box(children[0]),
    )
    try:
        assert not _nest.is_plain_leaf(box)  # asked again, not the cached answer
        per_replica = strategy.experimental_distribute_values_from_function(
            lambda ctx: np.float32(ctx.replica_id_in_sync_group)
        )
        out = strategy.run(lambda b: b.v * 10, args=(Box(per_replica),))
        assert [float(v) for v in strategy.experimental_local_results(out)] == [0.0, 10.0]
        assert not _nest.is_plain_leaf(box)
    finally:
        _nest._unregister_tree_system("test-box")


def test_plain_args_then_distributed_args_are_split() -> None:
    strategy = pd.MirroredStrategy(2)
    x = np.arange(2, dtype=np.float32)
    shared = strategy.run(lambda a: a * 1, args=(x,))
    assert [v.tolist() for v in strategy.experimental_local_results(shared)] == [[0, 1], [0, 1]]
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group + 5)
    )
    out = strategy.run(lambda a, b: a + b, args=(x, per_replica))
    assert [v.tolist() for v in strategy.experimental_local_results(out)] == [[5, 6], [6, 7]]
    out = strategy.run(lambda b: b * 2, args=(per_replica,))
    assert [float(v) for v in strategy.experimental_local_results(out)] == [10.0, 12.0]


def test_one_replicas_results_regroup_as_before() -> None:
    x = np.ones(2)
    assert regroup([x]) is x
    assert regroup([None]) is None
    wrapped = regroup([x], always_wrap=True)
    assert isinstance(wrapped, pd.PerReplica) and wrapped.values[0] is x
    point = collections.namedtuple("point", "a b")(x, [x])
    got = regroup([point])
    assert type(got) is type(point) and got.a is x and got.b == [x] and got.b is not point.b
    original = Pairs({"k": x})
    _nest.flatten(original)  # classified: a plain leaf to optree
    pairs = regroup([original])
    assert type(pairs) is Pairs and pairs is not original and pairs["k"] is x


def test_run_calls_an_overridden_call_for_each_replica() -> None:
    strategy = pd.MirroredStrategy(2)
    calls: list[Any] = []
    extended_class = type(strategy.extended)

    class Extended(extended_class):  # type: ignore[misc,valid-type]
        def call_for_each_replica(self, fn: Any, args: Any = (), kwargs: Any = None) -> Any:
            calls.append(args)
            return super().call_for_each_replica(fn, args, kwargs)

    strategy.extended.__class__ = Extended
    out = strategy.run(lambda a: a + 1, args=[np.float32(1)])
    assert calls == [[np.float32(1)]]
    assert [float(v) for v in out.values] == [2.0, 2.0]
    with pytest.raises(TypeError, match="must be a callable"):
        strategy.run(42)  # type: ignore[arg-type]


def test_the_timeout_variable_is_read_at_each_run_however_the_environment_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    from polydist.backend import timeout_seconds_from_env

    monkeypatch.setenv("POLYDIST_TIMEOUT_SECONDS", "4.5")
    assert timeout_seconds_from_env() == 4.5
    monkeypatch.setitem(os.environb, b"POLYDIST_TIMEOUT_SECONDS", b"6")  # os.environ too
    assert timeout_seconds_from_env() == 6.0
    monkeypatch.delenv("POLYDIST_TIMEOUT_SECONDS")
    assert timeout_seconds_from_env() == 300.0
    # os.environ replaced by a plain dict (as some test helpers do): still read.
    monkeypatch.setattr(os, "environ", {"POLYDIST_TIMEOUT_SECONDS": "-1"})
    strategy = pd.MirroredStrategy(1, backend=SimBackend(replica_mode="thread"))
    with pytest.raises(ValueError, match="must be a positive number"):
        strategy.run(lambda: 1.0)


@pytest.mark.parametrize("replicas", [1, 3])
def test_a_runner_not_asked_for_lazy_ids_places_them_before_the_run(replicas: int) -> None:
    # The default: a placement inside the replica could be made under an engine's
    # transformation (a jax.jit there would leak a tracer), so ids are placed up front.
    from polydist.backend import EagerReplicaRunner

    backend = CountingSim("thread")
    backend.replica_runner = EagerReplicaRunner("thread")
    assert not backend.replica_runner.lazy_replica_id
    for strategy in _strategies(backend, replicas):
        backend.id_placements = 0
        strategy.run(lambda: np.float32(1.0))
        assert backend.id_placements == replicas
        ids = strategy.run(lambda: _ctx().replica_id_in_sync_group)
        assert [int(v) for v in strategy.experimental_local_results(ids)] == list(range(replicas))


@pytest.mark.parametrize("replicas", [1, 3])
def test_local_results_of_a_nest_are_each_replicas_nest(replicas: int) -> None:
    strategy = pd.MirroredStrategy(replicas, backend=SimBackend())
    out = strategy.run(lambda: ([_ctx().replica_id_in_sync_group, np.float32(5.0)], {"k": None}))
    local = strategy.experimental_local_results(out)
    assert len(local) == replicas
    for r, (pair, extra) in enumerate(local):
        assert int(pair[0]) == r and float(pair[1]) == 5.0 and extra == {"k": None}
    plain = [np.float32(1.0), (np.float32(2.0),)]
    nests = strategy.experimental_local_results(plain)
    assert len(nests) == replicas
    if replicas == 1:
        assert nests[0] is plain  # nothing distributed: the nest itself, not rebuilt
    else:  # each replica its own nest, equal to the value
        assert all(n is not plain and n == plain for n in nests)
        assert nests[0] is not nests[1]
    leaf = np.float32(3.0)
    assert strategy.experimental_local_results(leaf) == (leaf,)  # one value, not per replica
    assert strategy.experimental_local_results(None) == (None,)
    # A distributed value inside the nest is each replica's component.
    value = pd.PerReplica(tuple(np.float32(10 + r) for r in range(replicas)))
    picked = strategy.experimental_local_results({"v": [value, leaf]})
    assert [float(p["v"][0]) for p in picked] == [10.0 + r for r in range(replicas)]
    assert all(p["v"][1] is leaf for p in picked)


def test_a_plain_array_sum_of_one_replica_is_the_array_itself_as_the_general_path_gives() -> None:
    """``reduce(SUM, array, axis=None)`` with one replica in sync, and ``MEAN`` with any
    number, return the array (TF's ``reduce_non_distributed_value``) without
    `_reduce_to`'s calls, where the strategy reduces as `StrategyExtended` does; anything
    else takes the general path."""
    from polydist._strategies.strategy import StrategyExtended

    strategy = pd.OneDeviceStrategy("/cpu:0", backend=SimBackend())
    loss = np.array([1.5, 2.5], np.float32)
    for _ in range(2):  # the second call finds the types classified
        assert strategy.reduce("SUM", loss, axis=None) is loss
        assert strategy.reduce(pd.ReduceOp.SUM, loss, axis=None) is loss
    assert strategy.reduce("MEAN", loss, axis=None) is loss
    # An axis, a variable: the general path.
    assert float(strategy.reduce("SUM", loss, axis=0)) == 4.0
    with strategy.scope():
        v = pd.Variable(np.float32(3.0))
    got = strategy.reduce("SUM", v, axis=None)
    assert not isinstance(got, pd.Variable) and float(got) == 3.0

    calls: list[Any] = []

    class Counting(type(strategy.extended)):  # type: ignore[misc]
        def _reduce_to(self, reduce_op: Any, value: Any, destinations: Any) -> Any:
            calls.append(value)
            return super()._reduce_to(reduce_op, value, destinations)

    assert Counting._reduce_to is not StrategyExtended._reduce_to
    strategy.extended.__class__ = Counting
    try:
        assert strategy.reduce("SUM", loss, axis=None) is loss
    finally:
        strategy.extended.__class__ = Counting.__mro__[1]
    assert calls == [loss]  # an override of _reduce_to is still called

    mirrored = pd.MirroredStrategy(2, backend=SimBackend())
    assert mirrored.reduce("MEAN", loss, axis=None) is loss  # the same on every replica
    with pytest.raises(ValueError, match="cannot be reduced"):
        mirrored.reduce("SUM", loss, axis=None)  # two replicas: TF's error, not the array


def test_current_replica_reads_strategy_context_and_index_in_one_call() -> None:
    from polydist.backend.context import current_replica

    strategy = pd.MirroredStrategy(3, backend=SimBackend())
    with strategy.scope():
        assert current_replica() is None  # cross-replica context
    seen = strategy.experimental_local_results(
        strategy.run(lambda: current_replica())  # type: ignore[no-untyped-call]
    )
    assert [(s is strategy, ctx is not None, i) for s, ctx, i in seen] == [
        (True, True, 0),
        (True, True, 1),
        (True, True, 2),
    ]
    default = current_replica()  # the default strategy's replica context
    assert default is not None and default[0] is pd.get_strategy() and default[2] == 0
