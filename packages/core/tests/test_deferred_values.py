"""Deferred distributed values (``polydist.backend.values.deferred``): a backend's
per-replica result whose components are made on first read. It is a ``PerReplica``
like any other to everything that reads it. And deferred variable storage
(``polydist.backend.tracing.defer_storage``): a variable's copies made when read."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist.backend.tracing import defer_storage, deferred_storage, storage_arrays, swap_storage
from polydist.backend.values import component_source, deferred, select_replica


class Counting:
    """A component source that counts how often it is asked."""

    def __init__(self, parts: Sequence[Any]) -> None:
        self.parts = list(parts)
        self.calls = 0

    def components(self) -> list[Any]:
        self.calls += 1
        return self.parts


def test_components_are_made_once_on_first_read() -> None:
    source = Counting([np.float32(1), np.float32(2), np.float32(3)])
    value = deferred(pd.PerReplica, source)
    assert type(value) is pd.PerReplica and component_source(value) is source
    assert source.calls == 0  # made, not read: nothing asked yet
    assert value.values == (1.0, 2.0, 3.0)
    assert value.values == (1.0, 2.0, 3.0)
    assert source.calls == 1
    assert component_source(value) is source  # still known whole after the read


@pytest.mark.parametrize(
    "read",
    [
        lambda v, s: s.experimental_local_results(v),
        lambda v, s: select_replica(2, {"x": v})["x"],
        lambda v, s: repr(v),
        lambda v, s: s.reduce("SUM", v, axis=None),
        lambda v, s: s.run(lambda x: x + 1, (v,)).values,
        lambda v, s: copy.deepcopy(v).values,
    ],
    ids=["local_results", "select_replica", "repr", "reduce", "run", "deepcopy"],
)
def test_every_reader_sees_the_components(read: Any) -> None:
    strategy = pd.MirroredStrategy(3, backend="sim")
    source = Counting([np.float32(r + 1) for r in range(3)])
    plain = pd.PerReplica(source.parts)
    value = deferred(pd.PerReplica, source)
    got, want = read(value, strategy), read(plain, strategy)
    if isinstance(got, str):
        assert got == want
    else:
        np.testing.assert_array_equal(
            np.asarray(got, dtype=object).astype(np.float64),
            np.asarray(want, dtype=object).astype(np.float64),
        )
    assert source.calls == 1


def test_pickles_as_its_components() -> None:
    value = deferred(pd.PerReplica, Counting([1, 2]))
    restored = pickle.loads(pickle.dumps(value))
    assert type(restored) is pd.PerReplica and restored.values == (1, 2)


def test_a_plain_value_has_no_source_and_missing_attributes_still_raise() -> None:
    plain = pd.PerReplica([1, 2])
    assert component_source(plain) is None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        plain.nope  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        deferred(pd.PerReplica, Counting([1])).nope  # noqa: B018


def test_a_source_with_no_components_is_an_error() -> None:
    value = deferred(pd.PerReplica, Counting([]))
    with pytest.raises(ValueError, match="made no components"):
        value.values  # noqa: B018


def test_only_per_replica_and_mirrored_values_are_deferred() -> None:
    assert deferred(pd.Mirrored, Counting([5, 5])).values == (5, 5)
    with pytest.raises(TypeError, match="PerReplica or Mirrored values, got MirroredVariable"):
        deferred(pd.MirroredVariable, Counting([1]))


# -- deferred variable storage (polydist.backend.tracing.defer_storage) --------------------


class Copies:
    """A variable's deferred copies, counting which were asked for."""

    def __init__(self, arrays: Sequence[Any]) -> None:
        self.arrays = list(arrays)
        self.asked: list[int] = []

    def component(self, index: int) -> Any:
        self.asked.append(index)
        return self.arrays[index]


def mirrored(n: int = 3) -> Any:
    strategy = pd.MirroredStrategy(n, backend="sim")
    with strategy.scope():
        return pd.Variable(np.zeros(2, np.float32))


def test_a_deferred_copy_is_made_when_read_and_only_that_one() -> None:
    v = mirrored()
    source = Copies([np.full(2, float(r), np.float32) for r in range(3)])
    defer_storage(v, source)
    assert deferred_storage(v, source) == [None, None, None]
    assert v.numpy().tolist() == [0.0, 0.0]  # cross-replica read: replica 0's copy
    assert source.asked == [0]
    assert v.values[2].numpy().tolist() == [2.0, 2.0]
    assert source.asked == [0, 2]
    got = deferred_storage(v, source)
    assert got is not None and got[1] is None and got[2] is source.arrays[2]
    assert [a.tolist() for a in storage_arrays(v)] == [[float(r)] * 2 for r in range(3)]
    assert source.asked == [0, 2, 1]  # each copy asked for once
    assert not storage_arrays(v)[0].flags.writeable  # stored as any sim array is


def test_a_write_ends_the_deferral_of_that_copy() -> None:
    v = mirrored()
    source = Copies([np.full(2, float(r), np.float32) for r in range(3)])
    defer_storage(v, source)
    v.values[1].assign(np.full(2, 7.0, np.float32))
    assert deferred_storage(v, source) is None
    assert [c.numpy().tolist() for c in v.values] == [[0.0] * 2, [7.0] * 2, [2.0] * 2]
    # (The write reads the copy it replaces: a backend's store hook gets the old array.)
    assert sorted(source.asked) == [0, 1, 2]
    assert storage_arrays(v)[1] is not source.arrays[1]
    swap_storage(v, [np.ones(2, np.float32)] * 3)
    assert deferred_storage(v, source) is None


def test_deferred_copies_are_copied_deeply_and_missing_attributes_still_raise() -> None:
    v = mirrored()
    defer_storage(v, Copies([np.full(2, float(r), np.float32) for r in range(3)]))
    clone = copy.deepcopy(v)
    assert [c.numpy().tolist() for c in clone.values] == [[float(r)] * 2 for r in range(3)]
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        v.values[0].nope  # noqa: B018


def test_components_out_of_replica_order_are_refused() -> None:
    v = mirrored(2)
    v.values[1]._replica_index = 0
    with pytest.raises(ValueError, match="component 1 of .* has replica index 0, not 1"):
        defer_storage(v, Copies([np.zeros(2, np.float32)] * 2))
