"""Distributed input through the Strategy API (issue 3).

Every expected value is what TF 2.x produces: the reference's "Partial-batch
rule" worked examples, section B items 18-21, and "Consequences for loss and
metrics". The split rules themselves are tested in test_data_rebatch.py; here
they go through experimental_distribute_dataset / distribute_datasets_from_function,
the iterator, placement, reduce and the loss helpers.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import polydist as pd
from polydist._input.input_lib import PerReplicaSpec, make_numpy_dataset
from polydist.data import (
    AutoShardPolicy,
    AutoShardWarning,
    Dataset,
    InputContext,
    InputOptions,
    InputReplicationMode,
    Options,
    TensorSpec,
)
from polydist.data._rebatch import per_replica_batches
from polydist.errors import InvalidArgumentError, OutOfRangeError
from polydist_sim import SimBackend

# ---------------------------------------------------------------- helpers


def lists(nest: Any) -> Any:
    """Arrays -> (nested) Python lists, keeping dicts and tuples."""
    if isinstance(nest, dict):
        return {key: lists(value) for key, value in nest.items()}
    if isinstance(nest, tuple):
        return tuple(lists(value) for value in nest)
    return np.asarray(nest).tolist()


def replicas(value: Any) -> list[Any]:
    """One step's value as a list with each replica's batch (as lists)."""
    if isinstance(value, pd.PerReplica):
        return [lists(v) for v in value.values]
    return [lists(value)]


def steps(dataset: Any) -> list[list[Any]]:
    return [replicas(value) for value in dataset]


def with_policy(dataset: Dataset, policy: AutoShardPolicy) -> Dataset:
    options = Options()
    options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


def data(dataset: Dataset) -> Dataset:
    """DATA sharding: what AUTO falls back to for these sources, without the warning."""
    return with_policy(dataset, AutoShardPolicy.DATA)


def write_numbers(path: Path, numbers: range) -> str:
    path.write_text("".join(f"{n}\n" for n in numbers))
    return str(path)


def read_ints(path: str) -> Iterator[int]:
    with open(path) as handle:
        for line in handle:
            yield int(line)


def distribute(replica_count: int, dataset: Any) -> pd.DistributedDataset:
    return pd.MirroredStrategy(replica_count).experimental_distribute_dataset(dataset)


def as_float(x: Any) -> Any:
    return np.asarray(x, dtype=np.float32)


class RecordingSim(SimBackend):
    """The sim, recording the device of every ``place``."""

    def __init__(self) -> None:
        super().__init__()
        self.placed: list[str] = []

    def place(self, value: Any, device: str) -> Any:
        self.placed.append(device)
        return super().place(value, device)


def gpu(i: int) -> str:
    return f"/job:localhost/replica:0/task:0/device:GPU:{i}"


CPU = "/job:localhost/replica:0/task:0/device:CPU:0"


# ------------------------------------------ worked examples (reference, [run])


def test_default_auto_uses_legacy_rule_and_warns_only_with_several_workers() -> None:
    # One worker: DATA sharding keeps every element, so no AutoShardWarning (it used to
    # warn on every single-worker dataset; filterwarnings=error fails on one here).
    strategy = pd.MirroredStrategy(3)
    dist = strategy.experimental_distribute_dataset(Dataset.range(10).batch(4))
    assert steps(dist) == [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []], [[8], [9], []]]
    # Several workers: once, at the caller's line, when distributing; iterating is silent.
    with pytest.warns(AutoShardWarning, match="unshardable source dataset: RangeDataset") as rec:
        dist = mwms(2).experimental_distribute_dataset(Dataset.range(10).batch(4))
    assert len(rec) == 1
    assert rec[0].filename == __file__
    assert steps(dist) == steps(dist)


def test_off_uses_balanced_v2_rule() -> None:
    dist = distribute(3, with_policy(Dataset.range(10).batch(4), AutoShardPolicy.OFF))
    assert steps(dist) == [[[0, 1], [2], [3]], [[4, 5], [6], [7]], [[8, 9], [], []]]


def test_file_source_uses_balanced_v2_rule_without_warning(tmp_path: Path) -> None:
    path = write_numbers(tmp_path / "numbers.txt", range(10))
    dist = distribute(3, Dataset.from_files([path], read_ints).batch(4))  # AUTO -> FILE
    assert steps(dist) == [[[0, 1], [2], [3]], [[4, 5], [6], [7]], [[8, 9], [], []]]


def test_drop_remainder_keeps_the_first_two_steps() -> None:
    dist = distribute(3, data(Dataset.range(10).batch(4, drop_remainder=True)))
    assert steps(dist) == [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []]]


def test_ten_elements_batch_four_over_two_replicas() -> None:
    dist = distribute(2, data(Dataset.range(10).batch(4)))
    assert steps(dist) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], [9]]]


def test_ten_elements_batch_four_over_four_replicas() -> None:
    dist = distribute(4, data(Dataset.range(10).batch(4)))
    assert steps(dist) == [[[0], [1], [2], [3]], [[4], [5], [6], [7]], [[8], [9], [], []]]


def test_one_batch_of_five_over_three() -> None:
    assert steps(distribute(3, data(Dataset.range(5).batch(5)))) == [[[0, 1], [2, 3], [4]]]


def test_one_batch_of_ten_over_four() -> None:
    got = steps(distribute(4, data(Dataset.range(10).batch(10))))
    assert got == [[[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]]


def test_thirteen_elements_batch_five_over_four_replicas() -> None:
    got = steps(distribute(4, data(Dataset.range(13).batch(5))))
    assert got == [
        [[0, 1], [2, 3], [4], []],
        [[5, 6], [7, 8], [9], []],
        [[10], [11], [12], []],
    ]


def test_uneven_dataset_batches_two_replicas() -> None:
    # input_lib_test.testUnevenDatasetBatches (section B item 18).
    got = steps(distribute(2, data(Dataset.range(9).batch(2))))
    assert got == [[[0], [1]], [[2], [3]], [[4], [5]], [[6], [7]], [[8], []]]
    dropped = steps(distribute(2, data(Dataset.range(9).batch(2, drop_remainder=True))))
    assert dropped == got[:-1]


def test_from_function_round_robin_three_replicas() -> None:
    strategy = pd.MirroredStrategy(3)
    dist = strategy.distribute_datasets_from_function(lambda ctx: Dataset.range(10).batch(2))
    assert steps(dist) == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9], []]]


def test_from_function_static_spec_keeps_every_batch() -> None:
    # TF ends iteration at replica 2's end of data here (a static spec on one worker:
    # no partial-batch handling) and never yields [6,7] [8,9]. polydist keeps them;
    # its spec's batch dimension is None, so the empty batch does not contradict it.
    strategy = pd.MirroredStrategy(3)
    dist = strategy.distribute_datasets_from_function(
        lambda ctx: Dataset.range(10).batch(2, drop_remainder=True)
    )
    assert steps(dist) == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9], []]]
    assert dist.element_spec == PerReplicaSpec(*[TensorSpec((None,), np.int64)] * 3)
    for step in dist:
        for spec, value in zip(dist.element_spec.value_specs, step.values, strict=True):
            assert spec.is_compatible_with(TensorSpec(value.shape, value.dtype))
    # One replica never pads: the pipeline's own static spec.
    one = pd.MirroredStrategy(1).distribute_datasets_from_function(
        lambda ctx: Dataset.range(10).batch(2, drop_remainder=True)
    )
    assert one.element_spec == TensorSpec((2,), np.int64)


def test_empty_batches_keep_dtype_and_inner_dims() -> None:
    pairs = (np.arange(10, dtype=np.int32), np.ones((10, 3), dtype=np.float32))
    dist = distribute(3, data(Dataset.from_tensor_slices(pairs).batch(4)))
    last = list(dist)[-1]
    ints, floats = last
    assert ints.values[2].shape == (0,) and ints.values[2].dtype == np.int32
    assert floats.values[2].shape == (0, 3) and floats.values[2].dtype == np.float32


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 13), min_size=0, max_size=5),
    replica_count=st.integers(2, 6),
    policy=st.sampled_from([AutoShardPolicy.DATA, AutoShardPolicy.OFF]),
)
def test_strategy_values_match_the_data_layer_rule(
    sizes: list[int], replica_count: int, policy: AutoShardPolicy
) -> None:
    # experimental_distribute_dataset slices one worker's legacy split directly
    # (a fast path); it must give exactly per_replica_batches' steps.
    start = np.cumsum([0, *sizes])
    batches = [
        {"a": np.arange(s0, s0 + n), "b": np.ones((n, 2), np.float32) * s0}
        for s0, n in zip(start, sizes)
    ]
    dataset = with_policy(Dataset.from_generator(lambda: iter(batches)), policy)
    expected = list(per_replica_batches(dataset, 1, replica_count, 0))
    got = list(distribute(replica_count, dataset))
    assert len(got) == len(expected)
    for value, step in zip(got, expected):
        for key in ("a", "b"):
            for mine, theirs in zip(value[key].values, step):
                assert mine.dtype == theirs[key].dtype and mine.shape == theirs[key].shape
                assert np.array_equal(mine, theirs[key])


# --------------------------------------------------------------- nesting


def test_nested_dict_elements_give_dicts_of_per_replica() -> None:
    features = {"x": np.arange(10), "y": np.arange(20).reshape(10, 2)}
    (first, *_rest) = list(distribute(3, data(Dataset.from_tensor_slices(features).batch(4))))
    assert set(first) == {"x", "y"}
    assert isinstance(first["x"], pd.PerReplica) and isinstance(first["y"], pd.PerReplica)
    assert replicas(first["x"]) == [[0, 1], [2, 3], []]
    assert replicas(first["y"]) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], []]
    assert first["y"].values[2].shape == (0, 2)


def test_tuples_and_namedtuples_keep_their_types() -> None:
    Point = collections.namedtuple("Point", ["x", "y"])
    dataset = Dataset.from_tensor_slices(Point(np.arange(4), np.arange(4) * 10)).batch(4)
    (step,) = list(distribute(2, data(dataset)))
    assert isinstance(step, Point)
    assert replicas(step.y) == [[0, 10], [20, 30]]
    (pair,) = list(distribute(2, data(Dataset.from_tensor_slices((np.arange(2),)).batch(2))))
    assert type(pair) is tuple and replicas(pair[0]) == [[0], [1]]


def test_values_run_through_strategy_run() -> None:
    strategy = pd.MirroredStrategy(2)
    dist = strategy.experimental_distribute_dataset(data(Dataset.range(8).batch(4)))
    sums = [strategy.run(lambda x: x.sum(), args=(x,)) for x in dist]
    assert [[int(v) for v in s.values] for s in sums] == [[1, 5], [9, 13]]


# ---------------------------------------------------------- element_spec


def test_element_spec_batch_dim_is_none_when_partial_batches_are_possible() -> None:
    spec = distribute(3, data(Dataset.range(10).batch(4))).element_spec
    assert isinstance(spec, PerReplicaSpec)
    assert spec == PerReplicaSpec(*[TensorSpec((None,), np.int64)] * 3)


@pytest.mark.parametrize("policy", [AutoShardPolicy.DATA, AutoShardPolicy.OFF])
def test_element_spec_stays_static_with_drop_remainder_and_divisible_batches(
    policy: AutoShardPolicy,
) -> None:
    # input_lib_test.testInputSignatureForPerReplicaValues: (2,) per replica.
    dataset = with_policy(Dataset.range(8).batch(4, drop_remainder=True), policy)
    dist = distribute(2, dataset)
    assert dist.element_spec == PerReplicaSpec(*[TensorSpec((2,), np.int64)] * 2)
    for value in dist:
        assert dist.element_spec.is_compatible_with(value)
    # Not divisible: 4 over 3 replicas may give 2, 1 or 0 rows.
    uneven = distribute(3, with_policy(Dataset.range(8).batch(4, drop_remainder=True), policy))
    assert uneven.element_spec.value_specs[0].shape == (None,)


def test_element_spec_of_nests_and_single_replicas() -> None:
    features = {"x": np.zeros((8, 3), np.float32)}
    dist = distribute(2, data(Dataset.from_tensor_slices(features).batch(4)))
    assert dist.element_spec == {"x": PerReplicaSpec(*[TensorSpec((None, 3), np.float32)] * 2)}
    assert iter(dist).element_spec == dist.element_spec
    single = pd.OneDeviceStrategy("/gpu:0").experimental_distribute_dataset(
        data(Dataset.range(8).batch(4, drop_remainder=True))
    )
    assert single.element_spec == TensorSpec((4,), np.int64)  # TF: not wrapped for one replica


# ------------------------------------------------------ iterator semantics


def test_each_iter_restarts_and_iterators_are_independent() -> None:
    dist = distribute(2, data(Dataset.range(6).batch(2)))
    first, second = iter(dist), iter(dist)
    assert replicas(next(first)) == [[0], [1]]
    assert replicas(next(first)) == [[2], [3]]
    assert replicas(next(second)) == [[0], [1]]
    assert replicas(next(first)) == [[4], [5]]
    assert replicas(second.get_next()) == [[2], [3]]
    assert steps(dist) == [[[0], [1]], [[2], [3]], [[4], [5]]]
    assert iter(first) is first


def test_end_of_data_raises_again_on_every_call() -> None:
    iterator = iter(distribute(2, data(Dataset.range(4).batch(4))))
    next(iterator)
    for _ in range(3):
        with pytest.raises(StopIteration):
            next(iterator)
        with pytest.raises(OutOfRangeError, match="End of sequence"):
            iterator.get_next()


def test_get_next_as_optional() -> None:
    dist = distribute(2, data(Dataset.range(4).batch(4)))
    iterator = iter(dist)
    optional = iterator.get_next_as_optional()
    assert optional.has_value()
    assert replicas(optional.get_value()) == [[0, 1], [2, 3]]
    for _ in range(2):
        empty = iterator.get_next_as_optional()
        assert not empty.has_value()
        assert empty.element_spec == dist.element_spec
        with pytest.raises(InvalidArgumentError, match="does not have a value"):
            empty.get_value()


def test_next_inside_run_raises_value_error() -> None:
    strategy = pd.MirroredStrategy(2)
    iterator = iter(strategy.experimental_distribute_dataset(data(Dataset.range(4).batch(2))))
    message = r"next\(iterator\) should be called from outside of replica_fn"
    with pytest.raises(ValueError, match=message):
        strategy.run(lambda: next(iterator))
    with pytest.raises(ValueError, match=message):
        strategy.run(lambda: iterator.get_next_as_optional())
    # Outside run, in scope or not, it works.
    with strategy.scope():
        assert replicas(next(iterator)) == [[0], [1]]


def test_no_further_transformations() -> None:
    dist = distribute(2, data(Dataset.range(4).batch(2)))
    with pytest.raises(AttributeError, match="cannot be transformed further.*before distributing"):
        dist.map(lambda x: x)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        dist.nope  # noqa: B018
    assert dist.cardinality == 2  # a property (TF), not Dataset.cardinality()


# ------------------------------------------------------------- cardinality


@pytest.mark.parametrize(
    ("dataset", "cardinality", "step_count"),
    [
        # A short last batch is still a step: [0,1] [2,3] [] . [4,5] [6,7] [] . [8] [9] [].
        (Dataset.range(10).batch(4), 3, 3),
        (Dataset.range(10).batch(4, drop_remainder=True), 2, 2),
        # One batch of 5 over 3 replicas: [0,1] [2,3] [4], one step.
        (Dataset.range(5).batch(5), 1, 1),
        (Dataset.range(0).batch(4), 0, 0),
        # filter: the count is only known by reading (TF's UNKNOWN_CARDINALITY).
        (Dataset.range(10).filter(lambda x: x % 3 == 0).batch(2), -2, 2),
    ],
)
def test_cardinality_counts_the_global_batches(
    dataset: Dataset, cardinality: int, step_count: int
) -> None:
    dist = distribute(3, data(dataset))
    assert dist.cardinality == cardinality
    assert len(steps(dist)) == step_count


def test_cardinality_constants() -> None:
    assert (pd.data.INFINITE_CARDINALITY, pd.data.UNKNOWN_CARDINALITY) == (-1, -2)
    endless = distribute(2, data(Dataset.range(4).batch(2).repeat()))
    assert endless.cardinality == pd.data.INFINITE_CARDINALITY
    assert distribute(2, data(Dataset.range(4).batch(2).repeat(3))).cardinality == 6
    # Plain Python iterables and generators have no static length.
    batches = [{"x": np.arange(4)}, {"x": np.arange(4, 8)}]
    assert distribute(2, batches).cardinality == pd.data.UNKNOWN_CARDINALITY
    # A single replica does not split, and the default strategy takes the dataset as is.
    assert distribute(1, data(Dataset.range(7).batch(2))).cardinality == 4
    default = pd.get_strategy().experimental_distribute_dataset(Dataset.range(7).batch(3))
    assert default.cardinality == 3


def test_cardinality_from_function_is_the_pipelines() -> None:
    # TF: the cardinality of the (first) dataset dataset_fn returned, i.e. its
    # per-replica batches; 3 replicas take its 5 batches round-robin in 2 steps.
    strategy = pd.MirroredStrategy(3)
    dist = strategy.distribute_datasets_from_function(lambda _: Dataset.range(10).batch(2))
    assert dist.cardinality == 5
    assert steps(dist) == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9], []]]
    per_replica = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)
    each = strategy.distribute_datasets_from_function(
        lambda ctx: Dataset.range(ctx.input_pipeline_id * 2 + 2).batch(2), per_replica
    )
    assert each.cardinality == 1  # replica 0's pipeline: range(2).batch(2)
    endless = strategy.distribute_datasets_from_function(lambda _: Dataset.range(2).repeat())
    assert endless.cardinality == pd.data.INFINITE_CARDINALITY


def test_reduce_over_the_distributed_dataset() -> None:
    strategy = pd.MirroredStrategy(3)
    dist = strategy.experimental_distribute_dataset(data(Dataset.range(10).batch(4)))
    total = dist.reduce(0, lambda state, x: state + int(strategy.reduce("SUM", x, axis=0)))
    assert total == 45


def test_buffer_size_reads_ahead_and_errors_surface_at_their_step() -> None:
    read: list[int] = []

    def generator() -> Iterator[np.ndarray]:
        for i in range(4):
            read.append(i)
            if i == 2:
                raise RuntimeError("bad record 2")
            yield np.array([i])

    strategy = pd.MirroredStrategy(1)
    for depth, expected in [(0, [0]), (1, [0, 1]), (2, [0, 1, 2])]:
        read.clear()
        options = InputOptions(experimental_per_replica_buffer_size=depth)
        dist = strategy.distribute_datasets_from_function(
            lambda _: Dataset.from_generator(generator), options
        )
        iterator = iter(dist)
        assert lists(next(iterator)) == [0]
        assert read == expected
        assert lists(next(iterator)) == [1]
        with pytest.raises(RuntimeError, match="bad record 2"):
            next(iterator)
        with pytest.raises(StopIteration):
            next(iterator)
    with pytest.raises(ValueError, match="buffer_size must be an int >= 0"):
        strategy.experimental_distribute_dataset(
            Dataset.range(2), InputOptions(experimental_per_replica_buffer_size=-1)
        )


class Passes:
    """A re-iterable (as a torch DataLoader) that logs each iter() and each batch read."""

    def __init__(self, batches: list[np.ndarray]) -> None:
        self.batches = batches
        self.log: list[str] = []

    def __iter__(self) -> Iterator[np.ndarray]:
        self.log.append("iter")
        return self._read(len([e for e in self.log if e == "iter"]))

    def _read(self, number: int) -> Iterator[np.ndarray]:
        for i, batch in enumerate(self.batches):
            self.log.append(f"read {number}.{i}")
            yield batch


@pytest.mark.parametrize("replica_count", [1, 2])
def test_a_plain_iterable_is_begun_by_iter_and_read_only_in_the_passes_asked_for(
    replica_count: int,
) -> None:
    # Distributing reads nothing (no spec peek: a DataLoader would draw a shuffle);
    # iter() of the distributed dataset calls iter() of the source right away, as
    # iter(loader) does; read-ahead stays inside that pass.
    source = Passes([np.arange(4), np.arange(4, 8), np.arange(8, 10)])
    dist = distribute(replica_count, source)
    assert source.log == []
    for epoch in (1, 2):
        iterator = iter(dist)
        assert source.log[-1] == "iter"
        got = [[x for r in step for x in r] for step in steps(iterator)]
        assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        assert source.log[-4:] == ["iter"] + [f"read {epoch}.{i}" for i in range(3)]
        assert source.log.count("iter") == epoch
    # The spec is read from the first batch of the pass the next iteration continues.
    source = Passes([np.arange(4), np.arange(4, 8), np.arange(8, 10)])
    dist = distribute(replica_count, source)
    assert dist.element_spec is not None
    assert source.log == ["iter", "read 1.0"]
    assert [x for r in steps(dist)[0] for x in r] == [0, 1, 2, 3]
    assert source.log == ["iter", "read 1.0", "read 1.1", "read 1.2"]
    # A generator function is called once per iteration, when the iteration is made.
    source = Passes([np.arange(4), np.arange(4, 8), np.arange(8, 10)])
    dist = distribute(replica_count, lambda: iter(source))
    assert source.log == []
    iterator = iter(dist)
    assert source.log == ["iter"]
    assert len(list(iterator)) == 3
    assert source.log == ["iter", "read 1.0", "read 1.1", "read 1.2"]
    # Unbatched batches are still an error, raised as they are read.
    with pytest.raises(ValueError, match="not batched"):
        list(distribute(2, Passes([np.float32(1.0)])))  # type: ignore[list-item]


def test_batches_of_different_structures_are_an_error() -> None:
    batches = [{"x": np.arange(4)}, {"y": np.arange(4)}]
    dist = pd.MirroredStrategy(2).distribute_datasets_from_function(lambda _: batches)
    with pytest.raises(ValueError, match="different structures"):
        list(dist)


# ---------------------------------------------------- unbatched and bad input


def test_unbatched_dataset_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"not batched.*dataset\.batch\(global_batch_size\)"):
        distribute(2, Dataset.range(10))
    with pytest.raises(ValueError, match="not batched"):
        distribute(2, [np.float32(1.0), np.float32(2.0)])
    # One replica needs no splitting, so an unbatched dataset is fine (as in TF).
    assert steps(distribute(1, data(Dataset.range(2)))) == [[0], [1]]


def test_inputs_that_are_not_batch_iterables_are_rejected() -> None:
    strategy = pd.MirroredStrategy(2)
    with pytest.raises(TypeError, match="from_tensor_slices"):
        strategy.experimental_distribute_dataset({"x": np.arange(4)})
    with pytest.raises(TypeError, match="from_tensor_slices"):
        strategy.experimental_distribute_dataset(np.arange(4))
    with pytest.raises(TypeError, match="distribute_datasets_from_function"):
        strategy.experimental_distribute_dataset(lambda ctx: Dataset.range(4))
    with pytest.raises(TypeError, match="InputOptions"):
        strategy.experimental_distribute_dataset([np.arange(4)], options={"x": 1})  # type: ignore[arg-type]
    dist = strategy.experimental_distribute_dataset(data(Dataset.range(4).batch(2)))
    with pytest.raises(TypeError, match="DistributedDataset"):
        strategy.experimental_distribute_dataset(dist)
    with pytest.raises(TypeError, match="dataset_fn must return"):
        strategy.distribute_datasets_from_function(lambda ctx: 3)
    with pytest.raises(TypeError, match="dataset_fn must be a function"):
        strategy.distribute_datasets_from_function(Dataset.range(3))  # type: ignore[arg-type]


# -------------------------------------------------------- plain iterables


def test_plain_generator_of_dicts_is_split_by_the_legacy_rule() -> None:
    # Like a torch DataLoader: an iterable of global batches; unknown batch size.
    batches = ({"x": np.arange(4 * i, 4 * i + 4, dtype=np.float32)} for i in range(3))
    got = [replicas(step["x"]) for step in distribute(3, batches)]  # no AutoShardWarning
    assert got == [
        [[0.0, 1.0], [2.0, 3.0], []],
        [[4.0, 5.0], [6.0, 7.0], []],
        [[8.0, 9.0], [10.0, 11.0], []],
    ]


class LoaderLike:
    """Duck-types a torch DataLoader: re-iterable, yields dicts of arrays."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.iterations = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.iterations += 1
        for i in range(self.n):
            yield {"image": np.full((2, 3), i, dtype=np.float32), "label": np.array([i, -i])}


def test_reiterable_loader_restarts_and_lists_work() -> None:
    loader = LoaderLike(3)
    dist = distribute(2, loader)
    first = [replicas(step["label"]) for step in dist]
    assert first == [[[0], [0]], [[1], [-1]], [[2], [-2]]]
    assert [replicas(step["label"]) for step in dist] == first
    assert next(iter(dist))["image"].values[1].shape == (1, 3)
    batches = [(np.arange(3), np.arange(3) * 2), (np.arange(3, 5), np.arange(3, 5) * 2)]
    assert [replicas(step[1]) for step in distribute(2, batches)] == [[[0, 2], [4]], [[6], [8]]]


def test_lists_of_arrays_in_plain_iterables_are_structure() -> None:
    # torch's default_collate gives a dataset of (x, y) tuples as [x, y] batches: a list
    # that holds arrays is read as a tuple, even when x and y could stack into one array.
    batches = [[np.arange(4), np.arange(4) * 10], [np.arange(4, 6), np.arange(4, 6) * 10]]
    got = [(replicas(x), replicas(y)) for x, y in distribute(2, batches)]
    assert got == [([[0, 1], [2, 3]], [[0, 10], [20, 30]]), ([[4], [5]], [[40], [50]])]
    nested = [{"pair": [np.zeros((2, 3)), (np.ones(2), [np.arange(2)])]}]
    (step,) = list(distribute(2, lambda: iter(nested)))
    first, (second, (third,)) = step["pair"]
    assert [v.shape for v in first.values] == [(1, 3), (1, 3)]
    assert replicas(second) == [[1.0], [1.0]] and replicas(third) == [[0], [1]]
    # A list of Python numbers is still one array (tf.data), also in a one-shot iterator.
    (numbers,) = list(distribute(2, iter([([1, 2, 3, 4],)])))
    assert replicas(numbers[0]) == [[1, 2], [3, 4]]
    assert numbers[0].values[0].dtype == np.int32


def test_generator_function_is_called_for_each_iteration() -> None:
    calls: list[int] = []

    def batches() -> Iterator[np.ndarray]:
        calls.append(1)
        yield np.arange(4)

    dist = distribute(2, batches)
    assert steps(dist) == [[[0, 1], [2, 3]]]
    assert steps(dist) == [[[0, 1], [2, 3]]]
    assert len(calls) >= 2


# ----------------------------------------------------- reduce and loss helpers


def mean_of_batch(x: Any) -> Any:
    x = as_float(x)
    with np.errstate(invalid="ignore"):
        return x.sum() / np.float32(x.shape[0])  # NaN for an empty batch, as TF


def test_reduce_mean_axis_zero_is_exact_under_partial_batches() -> None:
    strategy = pd.MirroredStrategy(3)
    dist = strategy.experimental_distribute_dataset(data(Dataset.range(10).batch(4)))
    means = [float(strategy.reduce("MEAN", strategy.run(as_float, (x,)), axis=0)) for x in dist]
    assert means == [1.5, 5.5, 8.5]


def test_reduce_mean_axis_none_gives_nan_and_warns() -> None:
    strategy = pd.MirroredStrategy(3)
    dist = strategy.experimental_distribute_dataset(data(Dataset.range(10).batch(4)))
    for x in dist:
        per_replica_means = strategy.run(mean_of_batch, (x,))
        with pytest.warns(pd.PartialBatchWarning, match=r"axis=0") as rec:
            result = strategy.reduce(pd.ReduceOp.MEAN, per_replica_means, axis=None)
        assert np.isnan(result)
        assert rec[0].filename == __file__
        # SUM and axis=0 do not warn (filterwarnings=error would fail the test).
        strategy.reduce(pd.ReduceOp.SUM, per_replica_means, axis=None)


def test_no_warning_without_empty_batches_or_without_nan() -> None:
    strategy = pd.MirroredStrategy(3)
    dist = strategy.experimental_distribute_dataset(data(Dataset.range(9).batch(3)))
    for x in dist:  # every replica gets one element: no empty batch
        nan_here = strategy.run(lambda x: np.float32(np.nan if int(x[0]) == 0 else x[0]), (x,))
        strategy.reduce("MEAN", nan_here, axis=None)
    uneven = strategy.experimental_distribute_dataset(data(Dataset.range(10).batch(4)))
    for x in uneven:  # empty batches, but the values are finite
        strategy.reduce("MEAN", strategy.run(lambda x: np.float32(x.shape[0]), (x,)), axis=None)


def test_tf_compute_average_loss_mis_scales_partial_batches() -> None:
    strategy = pd.MirroredStrategy(3)
    dist = strategy.experimental_distribute_dataset(data(Dataset.range(10).batch(4)))
    losses = [
        float(strategy.reduce("SUM", strategy.run(pd.nn.compute_average_loss, (x,)), None))
        for x in (strategy.run(as_float, (x,)) for x in dist)
    ]
    assert losses == pytest.approx([1.0, 11 / 3, 17 / 3])


def test_compute_average_loss_exact_gives_the_true_means() -> None:
    strategy = pd.MirroredStrategy(3)
    dist = strategy.experimental_distribute_dataset(data(Dataset.range(10).batch(4)))

    def step(x: Any) -> Any:
        return pd.nn.compute_average_loss_exact(as_float(x))

    losses = [float(strategy.reduce("SUM", strategy.run(step, (x,)), None)) for x in dist]
    assert losses == [1.5, 5.5, 8.5]


def test_compute_average_loss_arguments() -> None:
    losses = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    result = pd.nn.compute_average_loss(losses)  # default context: 1 replica
    assert result.dtype == np.float32 and float(result) == 2.5
    assert float(pd.nn.compute_average_loss(losses, global_batch_size=8)) == 1.25
    assert float(pd.nn.compute_average_loss(losses, global_batch_size=0)) == 0.0
    weights = np.array([[1.0], [0.0], [1.0], [0.0]])  # squeezed, as TF
    assert float(pd.nn.compute_average_loss(losses, sample_weight=weights)) == 1.0
    assert float(pd.nn.compute_average_loss(losses, sample_weight=2.0)) == 5.0
    assert float(pd.nn.compute_average_loss_exact(losses)) == 2.5
    with pytest.raises(ValueError, match="at least rank 1"):
        pd.nn.compute_average_loss(np.float32(1.0))
    with pytest.raises(TypeError, match="floating-point"):
        pd.nn.compute_average_loss(np.arange(3))
    with pytest.raises(ValueError, match="non-negative"):
        pd.nn.compute_average_loss(losses, global_batch_size=-1)
    with pytest.raises(TypeError, match="integer"):
        pd.nn.compute_average_loss(losses, global_batch_size=2.0)
    strategy = pd.MirroredStrategy(2)
    with strategy.scope(), pytest.raises(RuntimeError, match="cross replica context"):
        pd.nn.compute_average_loss(losses)
    with strategy.scope(), pytest.raises(RuntimeError, match="cross replica context"):
        pd.nn.compute_average_loss_exact(losses)
    halves = strategy.run(pd.nn.compute_average_loss, (losses,))
    assert [float(v) for v in halves.values] == [1.25, 1.25]
    reg = strategy.run(pd.nn.scale_regularization_loss, (np.float32(3.0),))
    assert float(strategy.reduce("SUM", reg, None)) == 3.0


# ------------------------------------------------------------- from function


def test_from_function_context_and_call_count() -> None:
    contexts: list[InputContext] = []

    def dataset_fn(context: InputContext) -> Dataset:
        contexts.append(context)
        return Dataset.range(4).batch(context.get_per_replica_batch_size(4))

    strategy = pd.MirroredStrategy(2)
    dist = strategy.distribute_datasets_from_function(dataset_fn)
    assert [repr(c) for c in contexts] == [
        "InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=2)"
    ]
    assert steps(dist) == [[[0, 1], [2, 3]]]
    assert steps(dist) == [[[0, 1], [2, 3]]]
    assert len(contexts) == 1  # called once per pipeline, when distributing
    assert dist.element_spec == PerReplicaSpec(*[TensorSpec((None,), np.int64)] * 2)
    # The deprecated alias is a plain alias (no warning: filterwarnings=error).
    alias = strategy.experimental_distribute_datasets_from_function(dataset_fn)
    assert steps(alias) == steps(dist)


def test_from_function_accepts_plain_iterables_and_gives_empty_batches() -> None:
    batches = [np.array([[1.0, 2.0]]), np.array([[3.0, 4.0]]), np.array([[5.0, 6.0]])]
    dist = pd.MirroredStrategy(2).distribute_datasets_from_function(lambda _: batches)
    got = list(dist)
    assert replicas(got[1]) == [[[5.0, 6.0]], []]
    assert got[1].values[1].shape == (0, 2)


def test_per_replica_mode_builds_one_pipeline_per_replica() -> None:
    contexts: list[InputContext] = []

    def dataset_fn(context: InputContext) -> Dataset:
        contexts.append(context)
        start = 10 * context.input_pipeline_id
        return Dataset.range(start, start + 2 + context.input_pipeline_id).batch(2)

    backend = RecordingSim()
    strategy = pd.MirroredStrategy(3, backend=backend)
    options = InputOptions(
        experimental_replication_mode=InputReplicationMode.PER_REPLICA,
        experimental_fetch_to_device=False,
    )
    dist = strategy.distribute_datasets_from_function(dataset_fn, options)
    assert [(c.num_input_pipelines, c.input_pipeline_id) for c in contexts] == [
        (3, 0),
        (3, 1),
        (3, 2),
    ]
    assert all(c.num_replicas_in_sync == 3 for c in contexts)
    backend.placed.clear()
    assert steps(dist) == [[[0, 1], [10, 11], [20, 21]], [[], [12], [22, 23]]]
    assert set(backend.placed) == {CPU}  # experimental_fetch_to_device=False: the host
    on_device = InputOptions(
        experimental_replication_mode=InputReplicationMode.PER_REPLICA,
        experimental_fetch_to_device=False,
        experimental_place_dataset_on_device=True,
    )
    backend.placed.clear()
    list(strategy.distribute_datasets_from_function(dataset_fn, on_device))
    assert backend.placed[:3] == [gpu(0), gpu(1), gpu(2)]


def test_per_replica_mode_is_mirrored_strategys_only() -> None:
    # TF: OneDevice, TPU and CollectiveAllReduce (MWMS, one worker too) raise
    # NotImplementedError; the default strategy ignores the options.
    from polydist.cluster_resolver import TPUClusterResolver

    per_replica = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)
    for strategy in (
        pd.OneDeviceStrategy("/cpu:0"),
        pd.TPUStrategy(TPUClusterResolver(tpu="v4-8")),
        mwms(1, 2),
    ):
        with pytest.raises(NotImplementedError, match="MirroredStrategy"):
            strategy.distribute_datasets_from_function(lambda _: Dataset.range(4), per_replica)
    default = pd.get_strategy().distribute_datasets_from_function(
        lambda _: Dataset.range(4).batch(2), per_replica
    )
    assert steps(default) == [[[0, 1]], [[2, 3]]]


def test_input_options_are_validated() -> None:
    strategy = pd.MirroredStrategy(2)
    per_replica = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)
    with pytest.raises(NotImplementedError, match="only supported in"):
        strategy.experimental_distribute_dataset(Dataset.range(4).batch(2), per_replica)
    with pytest.raises(ValueError, match="must also specify `PER_REPLICA`"):
        strategy.distribute_datasets_from_function(
            lambda _: Dataset.range(2), InputOptions(experimental_place_dataset_on_device=True)
        )


# ------------------------------------------------------------------ placement


def test_components_are_placed_on_each_replicas_device() -> None:
    backend = RecordingSim()
    strategy = pd.MirroredStrategy(2, backend=backend)
    dist = strategy.experimental_distribute_dataset(
        data(Dataset.from_tensor_slices({"a": np.arange(4), "b": np.arange(4)}).batch(4))
    )
    backend.placed.clear()
    list(dist)
    assert sorted(backend.placed) == sorted([gpu(0), gpu(0), gpu(1), gpu(1)])
    host = strategy.experimental_distribute_dataset(
        data(Dataset.range(4).batch(4)), InputOptions(experimental_fetch_to_device=False)
    )
    backend.placed.clear()
    list(host)
    assert backend.placed == [CPU, CPU]


def test_a_refilled_source_buffer_does_not_corrupt_read_ahead_steps() -> None:
    # A generator refilling one buffer before each yield: the iterator reads a
    # step ahead, and the sim's place does not copy, so elements must not alias it.
    buffer = np.zeros(4, np.float32)

    def generate() -> Iterator[np.ndarray[Any, Any]]:
        for k in range(3):
            buffer[:] = np.arange(4) + 10 * k
            yield buffer

    strategy = pd.MirroredStrategy(2)
    expected = [
        [[0.0, 1.0], [2.0, 3.0]],
        [[10.0, 11.0], [12.0, 13.0]],
        [[20.0, 21.0], [22.0, 23.0]],
    ]
    assert steps(strategy.experimental_distribute_dataset(generate)) == expected
    assert steps(strategy.experimental_distribute_dataset(generate())) == expected
    signature = TensorSpec((4,), np.float32)
    generated = Dataset.from_generator(generate, output_signature=signature)
    assert steps(strategy.experimental_distribute_dataset(generated)) == expected
    from_fn = strategy.distribute_datasets_from_function(lambda _: generate())
    assert steps(from_fn) == [
        [[0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0]],
        [[20.0, 21.0, 22.0, 23.0], []],
    ]


def test_a_list_of_batches_is_not_copied_on_the_sim() -> None:
    # Its batches exist before the pass (nothing refills them): the split gives
    # views and the sim's place keeps them, so the input path copies nothing.
    batches = [np.arange(4.0, dtype=np.float32), np.arange(4.0, 8.0, dtype=np.float32)]
    first = next(iter(pd.MirroredStrategy(2).experimental_distribute_dataset(batches)))
    assert replicas(first) == [[0.0, 1.0], [2.0, 3.0]]
    assert all(np.shares_memory(v, batches[0]) for v in first.values)


class NarrowingSim(SimBackend):
    """The sim, placing int64 as int32 like JAX without x64, and saying so."""

    def place(self, value: Any, device: str) -> Any:
        placed = super().place(value, device)
        return placed.astype(np.int32) if placed.dtype == np.int64 else placed

    def placed_dtype(self, dtype: np.dtype[Any]) -> np.dtype[Any]:
        return np.dtype(np.int32) if dtype == np.int64 else dtype


def test_element_spec_has_the_dtypes_a_backend_places() -> None:
    assert pd.backend.features(NarrowingSim()).placed_dtype
    strategy = pd.MirroredStrategy(2, backend=NarrowingSim())
    data = {"i": np.arange(4), "f": np.arange(4, dtype=np.float32)}
    dist = strategy.experimental_distribute_dataset(Dataset.from_tensor_slices(data).batch(4))
    assert dist.element_spec == {
        "i": PerReplicaSpec(*[TensorSpec((None,), np.int32)] * 2),
        "f": PerReplicaSpec(*[TensorSpec((None,), np.float32)] * 2),
    }
    value = next(iter(dist))
    assert value["i"].values[1].dtype == np.int32 and value["i"].values[1].tolist() == [2, 3]
    assert dist.element_spec["i"].is_compatible_with(value["i"])


def test_place_dataset_on_device_is_ignored_per_worker_with_a_warning() -> None:
    # TF's MirroredExtended._input_workers_with_options: PER_WORKER without
    # fetch_to_device uses host input workers; place_dataset_on_device is PER_REPLICA's.
    backend = RecordingSim()
    strategy = pd.MirroredStrategy(2, backend=backend)
    options = InputOptions(
        experimental_fetch_to_device=False, experimental_place_dataset_on_device=True
    )
    with pytest.warns(UserWarning, match="has no effect in experimental_distribute_dataset"):
        dist = strategy.experimental_distribute_dataset(data(Dataset.range(4).batch(4)), options)
    backend.placed.clear()
    assert steps(dist) == [[[0, 1], [2, 3]]]
    assert backend.placed == [CPU, CPU]
    fetched = InputOptions(experimental_place_dataset_on_device=True)  # on the devices, no warning
    backend.placed.clear()
    assert steps(
        strategy.experimental_distribute_dataset(data(Dataset.range(4).batch(4)), fetched)
    ) == [[[0, 1], [2, 3]]]
    assert backend.placed == [gpu(0), gpu(1)]


def test_single_replica_strategies_give_plain_values() -> None:
    # TF logs the AUTO fallback for one worker too; polydist does not (nothing to shard).
    one = pd.OneDeviceStrategy("/gpu:0").experimental_distribute_dataset(Dataset.range(4).batch(2))
    assert [lists(x) for x in one] == [[0, 1], [2, 3]]
    default = pd.get_strategy().experimental_distribute_dataset(Dataset.range(3))
    assert isinstance(default, pd.DistributedDataset)
    assert [lists(x) for x in default] == [0, 1, 2]
    assert iter(default).get_next().shape == ()
    from_fn = pd.get_strategy().distribute_datasets_from_function(lambda ctx: [np.arange(2)])
    assert [lists(x) for x in from_fn] == [[0, 1]]


def test_make_numpy_dataset_is_from_tensor_slices() -> None:
    dataset = make_numpy_dataset({"x": np.arange(3)})
    assert [lists(e) for e in dataset] == [{"x": 0}, {"x": 1}, {"x": 2}]
    assert not hasattr(pd.MirroredStrategy(2), "experimental_make_numpy_dataset")  # V1 only


# ------------------------------------------------------------ multi-worker


def mwms(num_workers: int, devices_per_worker: int = 1, task_id: int = 0) -> pd.Strategy:
    """The sim's MultiWorkerMirroredStrategy: every worker runs in this process."""
    multi_worker = pytest.importorskip("polydist._distributed.multi_worker")
    from polydist.cluster_resolver import ClusterSpec, SimpleClusterResolver

    resolver = SimpleClusterResolver(
        ClusterSpec({"worker": [f"host{i}:2222" for i in range(num_workers)]}),
        task_type="worker",
        task_id=task_id,
        num_accelerators={"GPU": devices_per_worker},
    )
    strategy: pd.Strategy = multi_worker.MultiWorkerMirroredStrategy(resolver)
    return strategy


def one_worker_of(num_workers: int, worker_index: int) -> pd.Strategy:
    """Worker ``worker_index`` on an engine with one process per worker (local view).

    Duck-types what _input_lib reads: ``_num_workers`` and ``_worker_index``; without
    ``_simulated_workers`` only this worker's replicas run here.
    """
    strategy = pd.MirroredStrategy(1)
    strategy.extended._num_workers = num_workers  # type: ignore[attr-defined]
    strategy.extended._worker_index = worker_index  # type: ignore[attr-defined]
    return strategy


def test_mwms_last_partial_batch_global_and_local_views() -> None:
    # strategy_common_test.testSimpleInputFromDatasetLastPartialBatch (item 19).
    dataset = data(Dataset.range(14).batch(8))
    dist = mwms(2).experimental_distribute_dataset(dataset)
    assert steps(dist) == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[8, 9, 10], [11, 12, 13]]]
    assert dist.element_spec == PerReplicaSpec(*[TensorSpec((None,), np.int64)] * 2)
    chief = one_worker_of(2, 0).experimental_distribute_dataset(dataset)
    worker = one_worker_of(2, 1).experimental_distribute_dataset(dataset)
    assert steps(chief) == [[[0, 1, 2, 3]], [[8, 9, 10]]]
    assert steps(worker) == [[[4, 5, 6, 7]], [[11, 12, 13]]]
    assert chief.element_spec == PerReplicaSpec(TensorSpec((None,), np.int64))  # wrapped
    with pytest.warns(AutoShardWarning):  # AUTO on `range` falls back to DATA
        auto = mwms(2).experimental_distribute_dataset(Dataset.range(14).batch(8))
    assert steps(auto) == steps(dist)


def test_mwms_values_feed_run_and_reduce() -> None:
    strategy = mwms(2, 2, task_id=1)
    dist = strategy.experimental_distribute_dataset(data(Dataset.range(10).batch(4)))
    got = steps(dist)
    # Legacy rule over R = 4, then worker w keeps slices w, w + 2: worker-major.
    assert got == [[[0], [2], [1], [3]], [[4], [6], [5], [7]], [[8], [], [9], []]]
    means = [float(strategy.reduce("MEAN", strategy.run(as_float, (x,)), axis=0)) for x in dist]
    assert means == [1.5, 5.5, 8.5]


def test_mwms_from_function_last_partial_batch_and_contexts() -> None:
    # strategy_common_test.testSimpleInputFromFnLastPartialBatch / testDatasetFromFunction.
    contexts: list[InputContext] = []

    def dataset_fn(context: InputContext) -> Dataset:
        contexts.append(context)
        batch_size = context.get_per_replica_batch_size(8)
        dataset = Dataset.range(14).batch(batch_size)
        return dataset.shard(context.num_input_pipelines, context.input_pipeline_id)

    dist = mwms(2).distribute_datasets_from_function(dataset_fn)
    got_contexts = [
        (c.num_input_pipelines, c.input_pipeline_id, c.num_replicas_in_sync) for c in contexts
    ]
    assert got_contexts == [(2, 0, 2), (2, 1, 2)]  # once per worker
    assert steps(dist) == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[8, 9, 10, 11], [12, 13]]]
    worker = one_worker_of(2, 1).distribute_datasets_from_function(dataset_fn)
    assert steps(worker) == [[[4, 5, 6, 7]], [[12, 13]]]
    per_replica = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)
    with pytest.raises(NotImplementedError, match="single-worker"):
        mwms(2).distribute_datasets_from_function(dataset_fn, per_replica)


def test_mwms_cardinality() -> None:
    # DATA sharding: each step is every worker's slices of one global batch.
    dist = mwms(2, 2).experimental_distribute_dataset(data(Dataset.range(14).batch(8)))
    assert dist.cardinality == 2 and len(steps(dist)) == 2
    chief = one_worker_of(2, 0).experimental_distribute_dataset(data(Dataset.range(14).batch(8)))
    assert chief.cardinality == 2 and len(steps(chief)) == 2
    # OFF: each worker reads everything (4 steps of 4), the input still has 2 batches (TF).
    whole = with_policy(Dataset.range(14).batch(8), AutoShardPolicy.OFF)
    off = mwms(2).experimental_distribute_dataset(whole)
    assert off.cardinality == 2
    assert steps(off) == [
        [[0, 1, 2, 3], [0, 1, 2, 3]],
        [[4, 5, 6, 7], [4, 5, 6, 7]],
        [[8, 9, 10, 11], [8, 9, 10, 11]],
        [[12, 13], [12, 13]],
    ]

    def dataset_fn(context: InputContext) -> Dataset:
        # Worker 0 gets 3 batches of 2, worker 1 gets 2.
        shard = Dataset.range(9).shard(context.num_input_pipelines, context.input_pipeline_id)
        return shard.batch(2)

    assert mwms(2, task_id=0).distribute_datasets_from_function(dataset_fn).cardinality == 3
    assert mwms(2, task_id=1).distribute_datasets_from_function(dataset_fn).cardinality == 2


def test_mwms_element_spec_is_dynamic_even_with_drop_remainder() -> None:
    dataset = data(Dataset.range(16).batch(8, drop_remainder=True))
    dist = mwms(2, 2).experimental_distribute_dataset(dataset)
    assert dist.element_spec == PerReplicaSpec(*[TensorSpec((None,), np.int64)] * 4)
    infinite = data(Dataset.range(16).batch(8, drop_remainder=True).repeat())
    static = mwms(2, 2).experimental_distribute_dataset(infinite)
    assert static.element_spec.value_specs[0].shape == (2,)


def test_mwms_one_shot_iterator_is_rejected() -> None:
    with pytest.raises(ValueError, match="one-shot iterator"):
        mwms(2).experimental_distribute_dataset(iter([np.arange(4)]))


def test_mwms_workers_shard_one_order_of_a_seeded_shuffle() -> None:
    # TF: each worker builds its own pipeline, so with a seed their k-th passes
    # shuffle alike and the DATA shards split one order. A shuffle shared by the
    # workers' copies reshuffled once per worker: elements doubled and lost.
    dataset = data(Dataset.range(8).shuffle(8, seed=1).batch(4))
    dist = mwms(2).experimental_distribute_dataset(dataset)
    orders = []
    for _ in range(2):  # two epochs of one distributed dataset
        got = steps(dist)
        assert sorted(v for step in got for x in step for v in x) == list(range(8))
        orders.append(got)
    assert orders[0] != orders[1]  # reshuffled between epochs, as TF
    first = [int(x) for x in dataset.unbatch()]  # the dataset's own first pass
    assert [x for step in orders[0] for r in (0, 1) for x in step[r]] == first

    shuffled = Dataset.range(8).shuffle(8, seed=1)  # one object for every worker

    def dataset_fn(context: InputContext) -> Dataset:
        return shuffled.shard(context.num_input_pipelines, context.input_pipeline_id).batch(2)

    got = steps(mwms(2).distribute_datasets_from_function(dataset_fn))
    assert sorted(v for step in got for x in step for v in x) == list(range(8))


def test_mwms_warns_when_workers_shard_an_unseeded_shuffle() -> None:
    # TF's trap: with one process per worker each draws its own seed and the
    # shards overlap; the result is kept, with a warning.
    unseeded = data(Dataset.range(8).shuffle(8).batch(4))
    with pytest.warns(UserWarning, match="shuffle without a seed"):
        dist = mwms(2).experimental_distribute_dataset(unseeded)
    assert sorted(v for step in steps(dist) for x in step for v in x) == list(range(8))

    def sharded_after(context: InputContext) -> Dataset:
        shuffled = Dataset.range(8).shuffle(8)
        return shuffled.shard(context.num_input_pipelines, context.input_pipeline_id).batch(2)

    with pytest.warns(UserWarning, match="shuffle without a seed"):
        mwms(2).distribute_datasets_from_function(sharded_after)

    # No warning (filterwarnings=error): a seed, a shuffle after the shard, one worker.
    mwms(2).experimental_distribute_dataset(data(Dataset.range(8).shuffle(8, seed=3).batch(4)))

    def shuffled_after(context: InputContext) -> Dataset:
        shard = Dataset.range(8).shard(context.num_input_pipelines, context.input_pipeline_id)
        return shard.shuffle(8).batch(2)

    mwms(2).distribute_datasets_from_function(shuffled_after)
    distribute(2, data(Dataset.range(8).shuffle(8).batch(4)))


class _Sampler:
    """What a torch ``DistributedSampler`` holds (core's tests do not import torch)."""

    def __init__(self, num_replicas: int, rank: int) -> None:
        self.num_replicas, self.rank = num_replicas, rank


class _Loader:
    """A torch ``DataLoader`` look-alike: re-iterable, batches of 4, a sampler."""

    def __init__(self, sampler: _Sampler | None, in_batch_sampler: bool = False) -> None:
        self.sampler = None if in_batch_sampler else sampler
        self.batch_sampler = type("BatchSampler", (), {"sampler": sampler})()

    def __iter__(self) -> Any:
        return iter([np.arange(4, dtype=np.float32) + 4 * i for i in range(4)])


@pytest.mark.parametrize("in_batch_sampler", [False, True])
def test_a_loader_already_split_between_processes_is_not_sharded_again(
    in_batch_sampler: bool,
) -> None:
    """DATA sharding of a loader whose DistributedSampler gave this process its share
    would keep 1/W of that share on each worker, silently: it raises, naming both ways."""
    loader = _Loader(_Sampler(num_replicas=2, rank=1), in_batch_sampler)
    with pytest.raises(
        ValueError, match=r"_Sampler\(num_replicas=2, rank=1\), already splits"
    ) as e:
        mwms(2).experimental_distribute_dataset(loader)
    assert "distribute_datasets_from_function(lambda ctx: DataLoader" in str(e.value)
    # Not sharded: one worker, a sampler of one replica, or distribute_datasets_from_function.
    assert len(steps(pd.MirroredStrategy(2).experimental_distribute_dataset(loader))) == 4
    alone = _Loader(_Sampler(num_replicas=1, rank=0), in_batch_sampler)
    # DATA sharding keeps one step per global batch: worker w takes its half of each.
    assert steps(mwms(2).experimental_distribute_dataset(alone))[0] == [[0.0, 1.0], [2.0, 3.0]]
    dist = mwms(2).distribute_datasets_from_function(lambda ctx: loader)
    assert len(steps(dist)) == 4
