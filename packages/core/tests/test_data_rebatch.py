"""TF's split rules (polydist.data._rebatch) against TF's worked examples.

Every expected value below is what TF 2.x produces (reference file
"Partial-batch rule (exact, as implemented)", TF's tests and docstrings).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from polydist.data import (
    SHARD_HINT,
    AutoShardPolicy,
    AutoShardWarning,
    Dataset,
    InputContext,
    Options,
    TensorSpec,
    TextLineDataset,
)
from polydist.data._rebatch import (
    auto_shard_dataset,
    batch_sizes_for_worker,
    compute_batch_size,
    global_per_replica_batches,
    legacy_rebatch,
    legacy_rebatch_slices,
    per_replica_batches,
    per_replica_batches_from_datasets,
    rebatch_and_shard,
    rebatch_v2,
)


def lists(nest: Any) -> Any:
    """Arrays -> (nested) Python lists, keeping dicts and tuples."""
    if isinstance(nest, dict):
        return {key: lists(value) for key, value in nest.items()}
    if isinstance(nest, tuple):
        return tuple(lists(value) for value in nest)
    return np.asarray(nest).tolist()


def steps(batches: Iterator[list[Any]]) -> list[list[Any]]:
    return [[lists(replica) for replica in step] for step in batches]


def with_policy(dataset: Dataset, policy: AutoShardPolicy) -> Dataset:
    options = Options()
    options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


def write_numbers(path: Path, numbers: range) -> str:
    path.write_text("".join(f"{n}\n" for n in numbers))
    return str(path)


def read_ints(path: str) -> Iterator[int]:
    with open(path) as handle:
        for line in handle:
            yield int(line)


# ------------------------------------------------ worked examples, 3 replicas


def test_default_auto_uses_legacy_rule_and_warns_only_with_several_workers() -> None:
    # range is unshardable: AUTO falls back to DATA, which forces the legacy rule. One
    # worker keeps every element, so there is nothing to warn about (filterwarnings=error
    # fails this line on any warning); several workers are told why DATA was chosen.
    got = steps(per_replica_batches(Dataset.range(10).batch(4), 1, 3))
    assert got == [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []], [[8], [9], []]]
    with pytest.warns(AutoShardWarning, match="Found an unshardable source dataset: RangeDataset"):
        chief = steps(per_replica_batches(Dataset.range(10).batch(4), 2, 1, 0))
    assert chief == [[[0, 1]], [[4, 5]], [[8]]]


def test_off_uses_balanced_v2_rule() -> None:
    dataset = with_policy(Dataset.range(10).batch(4), AutoShardPolicy.OFF)
    got = steps(per_replica_batches(dataset, 1, 3))
    assert got == [[[0, 1], [2], [3]], [[4, 5], [6], [7]], [[8, 9], [], []]]


def test_file_source_uses_balanced_v2_rule(tmp_path: Path) -> None:
    path = write_numbers(tmp_path / "numbers.txt", range(10))
    dataset = Dataset.from_files([path], read_ints).batch(4)
    got = steps(per_replica_batches(dataset, 1, 3))  # AUTO -> FILE: no warning
    assert got == [[[0, 1], [2], [3]], [[4, 5], [6], [7]], [[8, 9], [], []]]


def test_text_line_source_uses_balanced_v2_rule(tmp_path: Path) -> None:
    path = write_numbers(tmp_path / "numbers.txt", range(10))
    dataset = TextLineDataset(path).map(lambda line: np.int64(line)).batch(4)
    assert dataset._file_sources() == (path,)
    assert rebatch_and_shard(dataset, 1, 3).policy == AutoShardPolicy.FILE
    got = steps(per_replica_batches(dataset, 1, 3))
    assert got == [[[0, 1], [2], [3]], [[4, 5], [6], [7]], [[8, 9], [], []]]


def test_drop_remainder_keeps_first_two_steps() -> None:
    got = steps(per_replica_batches(Dataset.range(10).batch(4, drop_remainder=True), 1, 3))
    assert got == [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []]]


def test_one_batch_of_five_over_three() -> None:
    got = steps(per_replica_batches(Dataset.range(5).batch(5), 1, 3))
    assert got == [[[0, 1], [2, 3], [4]]]


def test_one_batch_of_ten_over_four() -> None:
    got = steps(per_replica_batches(Dataset.range(10).batch(10), 1, 4))
    assert got == [[[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]]


def test_ten_elements_batch_four_over_two_replicas() -> None:
    # Legacy rule: c = ceil(b/2) per batch of b = 4, 4, 2.
    got = steps(per_replica_batches(Dataset.range(10).batch(4), 1, 2))
    assert got == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], [9]]]


def test_ten_elements_batch_four_over_four_replicas() -> None:
    # c = 1 for every batch; the last batch of 2 leaves replicas 2 and 3 empty.
    got = steps(per_replica_batches(Dataset.range(10).batch(4), 1, 4))
    assert got == [
        [[0], [1], [2], [3]],
        [[4], [5], [6], [7]],
        [[8], [9], [], []],
    ]


def test_thirteen_elements_batch_five_over_four_replicas() -> None:
    # b = 5: c = 2 -> 2, 2, 1, 0; b = 3: c = 1 -> 1, 1, 1, 0.
    got = steps(per_replica_batches(Dataset.range(13).batch(5), 1, 4))
    assert got == [
        [[0, 1], [2, 3], [4], []],
        [[5, 6], [7, 8], [9], []],
        [[10], [11], [12], []],
    ]


def test_uneven_dataset_batches_two_replicas() -> None:
    # input_lib_test.testUnevenDatasetBatches
    got = steps(per_replica_batches(Dataset.range(9).batch(2), 1, 2))
    assert got == [[[0], [1]], [[2], [3]], [[4], [5]], [[6], [7]], [[8], []]]
    dropped = steps(per_replica_batches(Dataset.range(9).batch(2, drop_remainder=True), 1, 2))
    assert dropped == got[:-1]


# ----------------------------------------------------------- multi-worker


def test_mwms_two_workers_last_partial_batch() -> None:
    # strategy_common_test.testSimpleInputFromDatasetLastPartialBatch (MWMS 2x1).
    # These numbers need DATA sharding, which is what the default AUTO policy
    # applies to `range`: legacy rebatch into 2 slices per batch, then each
    # worker keeps every 2nd slice: [0..3] [4..7] [8,9,10] [11,12,13].
    dataset = Dataset.range(14).batch(8)
    with pytest.warns(AutoShardWarning):
        chief = steps(per_replica_batches(dataset, 2, 1, 0))
    with pytest.warns(AutoShardWarning):
        worker = steps(per_replica_batches(dataset, 2, 1, 1))
    assert chief == [[[0, 1, 2, 3]], [[8, 9, 10]]]
    assert worker == [[[4, 5, 6, 7]], [[11, 12, 13]]]


def test_mwms_same_case_with_explicit_data_policy_does_not_warn() -> None:
    dataset = with_policy(Dataset.range(14).batch(8), AutoShardPolicy.DATA)
    assert steps(per_replica_batches(dataset, 2, 1, 1)) == [[[4, 5, 6, 7]], [[11, 12, 13]]]


def test_mwms_off_gives_every_worker_all_data() -> None:
    # With OFF each worker rebatches the whole dataset with its V2 sizes [4, 4].
    dataset = with_policy(Dataset.range(14).batch(8), AutoShardPolicy.OFF)
    expected = [[[0, 1, 2, 3]], [[4, 5, 6, 7]], [[8, 9, 10, 11]], [[12, 13]]]
    assert steps(per_replica_batches(dataset, 2, 1, 0)) == expected
    assert steps(per_replica_batches(dataset, 2, 1, 1)) == expected


def test_file_sharding_two_workers_two_replicas(tmp_path: Path) -> None:
    # batch_sizes_for_worker's docstring: G = 7, W = 2, R = 2, two files of 7.
    file_a = write_numbers(tmp_path / "a.txt", range(0, 7))
    file_b = write_numbers(tmp_path / "b.txt", range(100, 107))
    dataset = Dataset.from_files([file_a, file_b], read_ints).batch(7)
    assert rebatch_and_shard(dataset, 2, 2, 0).policy == AutoShardPolicy.FILE
    assert steps(per_replica_batches(dataset, 2, 2, 0)) == [[[0, 1], [2, 3]], [[4, 5], [6]]]
    assert steps(per_replica_batches(dataset, 2, 2, 1)) == [
        [[100, 101], [102]],
        [[103, 104], [105, 106]],
    ]
    for step in steps(global_per_replica_batches(dataset, 2, 2)):
        assert sum(len(replica) for replica in step) == 7


def test_data_sharding_two_workers_two_replicas() -> None:
    # DATA over 2 workers x 2 replicas: legacy R = 4 cuts every batch into 4
    # slices and worker w keeps slices w, w + 2, ...; [8, 9] gives [8] [9] [] [].
    dataset = with_policy(Dataset.range(10).batch(4), AutoShardPolicy.DATA)
    got = steps(global_per_replica_batches(dataset, 2, 2))
    assert got == [
        [[0], [2], [1], [3]],
        [[4], [6], [5], [7]],
        [[8], [], [9], []],
    ]


def test_worker_out_of_data_gets_dummies_until_all_are_done(tmp_path: Path) -> None:
    long_file = write_numbers(tmp_path / "long.txt", range(4))
    short_file = write_numbers(tmp_path / "short.txt", range(10, 12))
    dataset = Dataset.from_files([long_file, short_file], read_ints).batch(2)
    got = steps(global_per_replica_batches(dataset, 2, 1))
    assert got == [[[0], [10]], [[1], [11]], [[2], []], [[3], []]]


def test_global_step_is_worker_major() -> None:
    dataset = with_policy(Dataset.range(8).batch(8), AutoShardPolicy.DATA)
    (step,) = steps(global_per_replica_batches(dataset, 2, 2))
    assert step == [[0, 1], [4, 5], [2, 3], [6, 7]]


# ------------------------------------------------------- nested elements


def test_nested_dict_elements_split_leaf_wise() -> None:
    features = {"x": np.arange(10), "y": np.arange(20).reshape(10, 2)}
    dataset = Dataset.from_tensor_slices(features).batch(4)
    got = list(per_replica_batches(dataset, 1, 3))
    assert lists(got[0][0]) == {"x": [0, 1], "y": [[0, 1], [2, 3]]}
    assert lists(got[0][1]) == {"x": [2, 3], "y": [[4, 5], [6, 7]]}
    assert got[0][2]["x"].shape == (0,)
    assert got[0][2]["y"].shape == (0, 2)
    assert lists(got[2][1]) == {"x": [9], "y": [[18, 19]]}


def test_nested_tuple_dummies_keep_inner_dims_and_dtype() -> None:
    pairs = (np.arange(10, dtype=np.int32), np.ones((10, 3), dtype=np.float32))
    dataset = with_policy(Dataset.from_tensor_slices(pairs).batch(4), AutoShardPolicy.OFF)
    last = list(per_replica_batches(dataset, 1, 3))[-1]
    assert lists(last[0][0]) == [8, 9]
    for dummy in last[1:]:
        assert isinstance(dummy, tuple)
        assert dummy[0].shape == (0,)
        assert dummy[0].dtype == np.int32
        assert dummy[1].shape == (0, 3)
        assert dummy[1].dtype == np.float32


def test_named_tuple_elements_keep_their_type() -> None:
    Point = collections.namedtuple("Point", ["x", "y"])
    dataset = Dataset.from_tensor_slices(Point(np.arange(4), np.arange(4) * 10)).batch(4)
    (step,) = list(per_replica_batches(dataset, 1, 2))
    assert isinstance(step[1], Point)
    assert lists(tuple(step[1])) == ([2, 3], [20, 30])


# --------------------------------------------- distribute from function


def test_from_function_round_robin_three_replicas() -> None:
    got = steps(per_replica_batches_from_datasets([Dataset.range(10).batch(2)], 3))
    assert got == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9], []]]


def test_from_function_mwms_last_partial_batch() -> None:
    # strategy_common_test.testSimpleInputFromFnLastPartialBatch
    def dataset_fn(context: InputContext) -> Dataset:
        batch_size = context.get_per_replica_batch_size(8)
        dataset = Dataset.range(14).batch(batch_size)
        return dataset.shard(context.num_input_pipelines, context.input_pipeline_id)

    datasets = [dataset_fn(InputContext(2, worker, 2)) for worker in range(2)]
    got = steps(per_replica_batches_from_datasets(datasets, 1))
    assert got == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[8, 9, 10, 11], [12, 13]]]


def test_from_function_mwms_sums() -> None:
    # strategy_common_test.testDatasetFromFunction: chief sums to 10, worker to 35.
    def dataset_fn(context: InputContext) -> Dataset:
        batch_size = context.get_per_replica_batch_size(10)
        dataset = Dataset.range(100).repeat().batch(batch_size)
        return dataset.shard(context.num_input_pipelines, context.input_pipeline_id)

    datasets = [dataset_fn(InputContext(2, worker, 2)) for worker in range(2)]
    chief, worker = next(per_replica_batches_from_datasets(datasets, 1))
    assert int(chief.sum()) == 10
    assert int(worker.sum()) == 35


def test_from_function_accepts_plain_iterables() -> None:
    pipeline = [[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]]]  # batches of one row each
    got = list(per_replica_batches_from_datasets([pipeline], 2))
    assert [lists(x) for x in got[1]] == [[[5.0, 6.0]], []]
    assert got[1][0].dtype == np.float32
    assert got[1][1].shape == (0, 2)


# -------------------------------------------------------- compute_batch_size


def test_compute_batch_size_walks_back_to_batch() -> None:
    assert compute_batch_size(Dataset.range(10).batch(4)) == 4
    walked = Dataset.range(10).batch(4).filter(lambda x: True).shuffle(2).repeat(2).take(3)
    assert compute_batch_size(walked.skip(1).shard(1, 0).prefetch(1)) == 4
    assert compute_batch_size(with_policy(Dataset.range(10).batch(4), AutoShardPolicy.OFF)) == 4


def test_compute_batch_size_unknown_cases() -> None:
    assert compute_batch_size(Dataset.range(10)) == -1  # no batch
    assert compute_batch_size(Dataset.range(10).batch(4).unbatch()) == -1
    assert compute_batch_size(Dataset.range(10).batch(4).map(lambda x: x + 1)) == -1
    assert compute_batch_size(Dataset.from_generator(lambda: iter([[1, 2]]))) == -1
    assert compute_batch_size([np.arange(4)]) == -1  # plain iterable


def test_compute_batch_size_static_leading_dims() -> None:
    assert compute_batch_size(Dataset.range(8).batch(4, drop_remainder=True).map(lambda x: x)) == 4
    assert compute_batch_size(Dataset.from_tensor_slices(np.zeros((10, 3, 2)))) == 3
    mixed = Dataset.from_tensors({"a": np.zeros(2), "b": np.zeros(3)})
    assert compute_batch_size(mixed) == -1  # known but inconsistent


def test_unknown_batch_size_uses_legacy_rule_even_with_off() -> None:
    # map hides the batch op from compute_batch_size, so even OFF gets ceil(b/R).
    dataset = with_policy(Dataset.range(10).batch(4).map(lambda x: x), AutoShardPolicy.OFF)
    got = steps(per_replica_batches(dataset, 1, 3))
    assert got == [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []], [[8], [9], []]]


def test_unbatched_scalars_cannot_be_split() -> None:
    with pytest.raises(ValueError, match="elements are scalars"):
        per_replica_batches(Dataset.range(10), 1, 2)


def test_single_replica_gets_elements_unchanged() -> None:
    got = steps(per_replica_batches(Dataset.range(3), 1, 1))
    assert got == [[0], [1], [2]]


# ---------------------------------------------------------- pure rules


def test_legacy_rebatch_slices_examples() -> None:
    assert legacy_rebatch_slices(4, 3) == [(0, 2), (2, 4), (4, 4)]
    assert legacy_rebatch_slices(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert legacy_rebatch_slices(1, 3) == [(0, 1), (1, 1), (1, 1)]
    assert legacy_rebatch_slices(0, 2) == [(0, 0), (0, 0)]
    with pytest.raises(ValueError, match="num_replicas"):
        legacy_rebatch_slices(4, 0)


@given(st.integers(0, 200), st.integers(1, 16))
def test_legacy_rebatch_slices_partition_the_batch(batch: int, replicas: int) -> None:
    slices = legacy_rebatch_slices(batch, replicas)
    assert len(slices) == replicas
    assert [i for start, stop in slices for i in range(start, stop)] == list(range(batch))
    width = -(-batch // replicas)
    assert all(stop - start in (0, width) or stop == batch for start, stop in slices)


def test_legacy_rebatch_docstring_example() -> None:
    # _LegacyRebatchDataset docstring: range(8).batch(4) over 3.
    got = [lists(x) for x in legacy_rebatch(Dataset.range(8).batch(4), 3)]
    assert got == [[0, 1], [2, 3], [], [4, 5], [6, 7], []]


def test_legacy_rebatch_slices_components_independently() -> None:
    element = {"a": np.arange(4), "b": np.arange(2)}
    got = [lists(x) for x in legacy_rebatch([element], 2)]
    assert got == [{"a": [0, 1], "b": [0]}, {"a": [2, 3], "b": [1]}]


def test_legacy_rebatch_rejects_scalars() -> None:
    with pytest.raises(ValueError, match="Component 0 is scalar"):
        list(legacy_rebatch([np.asarray(1)], 2))


def test_batch_sizes_for_worker_examples() -> None:
    assert batch_sizes_for_worker(7, 2, 2, 0) == [2, 2, 2, 1]
    assert batch_sizes_for_worker(7, 2, 2, 1) == [2, 1, 2, 2]
    assert batch_sizes_for_worker(4, 1, 3, 0) == [2, 1, 1]
    assert batch_sizes_for_worker(8, 2, 1, 1) == [4, 4]
    assert batch_sizes_for_worker(2, 3, 1, 2) == [0, 1, 1]
    with pytest.raises(ValueError, match="worker_index"):
        batch_sizes_for_worker(8, 2, 1, 2)


@given(st.integers(0, 100), st.integers(1, 5), st.integers(1, 5), st.data())
def test_batch_sizes_for_worker_constraints(
    batch: int, workers: int, replicas: int, data: st.DataObject
) -> None:
    per_worker = [batch_sizes_for_worker(batch, workers, replicas, w) for w in range(workers)]
    worker = data.draw(st.integers(0, workers - 1))
    sizes = per_worker[worker]
    assert len(sizes) == workers * replicas  # (A)
    assert sum(sizes) == batch  # (B)
    assert max(sizes) - min(sizes) <= 1  # (D)
    for step in range(workers):  # (C): each global step consumes the global batch
        window = range(step * replicas, (step + 1) * replicas)
        assert sum(per_worker[w][i] for w in range(workers) for i in window) == batch


def test_rebatch_v2_crosses_input_batch_boundaries() -> None:
    batches = [np.arange(4), np.arange(4, 8)]
    assert [lists(x) for x in rebatch_v2(batches, [3])] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [lists(x) for x in rebatch_v2(batches, [3], drop_remainder=True)] == [
        [0, 1, 2],
        [3, 4, 5],
    ]
    assert [lists(x) for x in rebatch_v2(batches, [2, 1])] == [[0, 1], [2], [3, 4], [5], [6, 7]]


def test_rebatch_v2_final_short_batch_goes_to_next_size() -> None:
    got = [lists(x) for x in rebatch_v2(Dataset.range(10).batch(4), [2, 1, 1])]
    assert got == [[0, 1], [2], [3], [4, 5], [6], [7], [8, 9]]


def test_rebatch_v2_zero_sizes_yield_empty_batches() -> None:
    got = [lists(x) for x in rebatch_v2(Dataset.range(4).batch(2), [1, 1, 0])]
    assert got == [[0], [1], [], [2], [3], []]
    # A leading zero-size slot yields an empty batch even before any input is read.
    (empty,) = rebatch_v2(Dataset.range(0).batch(2), [0, 1, 1])
    assert empty.shape == (0,)
    assert empty.dtype == np.int64
    assert list(rebatch_v2([], [0, 1])) == []  # nothing to shape an empty batch after


def test_rebatch_v2_keeps_inner_dims_of_empty_batches() -> None:
    rows = Dataset.from_tensor_slices(np.ones((2, 3), dtype=np.float32)).batch(2)
    got = list(rebatch_v2(rows, [1, 1, 0]))
    assert [x.shape for x in got] == [(1, 3), (1, 3), (0, 3)]


def test_rebatch_v2_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="at least one positive"):
        rebatch_v2([np.arange(2)], [0, 0])
    with pytest.raises(ValueError, match="non-scalar"):
        list(rebatch_v2([np.asarray(3)], [1]))


# ----------------------------------------------------------- auto-sharding


def test_auto_shard_policies() -> None:
    dataset = Dataset.range(10)
    off = auto_shard_dataset(dataset, 2, 1, policy=AutoShardPolicy.OFF)
    assert off.policy == AutoShardPolicy.OFF
    assert off.dataset is dataset
    data = auto_shard_dataset(dataset.prefetch(2), 2, 1, policy=AutoShardPolicy.DATA)
    assert data.policy == AutoShardPolicy.DATA
    assert lists(list(data.dataset)) == [1, 3, 5, 7, 9]
    assert repr(data.dataset) == "<Dataset PrefetchDataset <- ShardDataset <- RangeDataset>"
    with pytest.warns(AutoShardWarning):
        auto = auto_shard_dataset(dataset, 2, 0)
    assert auto.policy == AutoShardPolicy.DATA
    assert lists(list(auto.dataset)) == [0, 2, 4, 6, 8]


def test_policy_comes_from_options() -> None:
    result = auto_shard_dataset(with_policy(Dataset.range(4), AutoShardPolicy.OFF), 2, 0)
    assert result.policy == AutoShardPolicy.OFF


def test_file_policy_shards_files(tmp_path: Path) -> None:
    paths = [write_numbers(tmp_path / f"{i}.txt", range(10 * i, 10 * i + 2)) for i in range(3)]
    dataset = Dataset.from_files(paths, read_ints).map(lambda x: x * 2).batch(2)
    result = auto_shard_dataset(dataset, 2, 1, policy=AutoShardPolicy.FILE)
    assert result.policy == AutoShardPolicy.FILE
    assert result.dataset._file_sources() == (paths[1],)
    assert lists(list(result.dataset)) == [[20, 22]]
    first = auto_shard_dataset(dataset, 2, 0)  # AUTO finds the files too
    assert first.policy == AutoShardPolicy.FILE
    assert first.dataset._file_sources() == (paths[0], paths[2])


def test_file_with_fewer_files_than_workers_falls_back_to_data(tmp_path: Path) -> None:
    path = write_numbers(tmp_path / "only.txt", range(6))
    dataset = Dataset.from_files([path], read_ints).batch(2)
    for policy in (AutoShardPolicy.FILE, AutoShardPolicy.AUTO):
        with pytest.warns(AutoShardWarning, match="only has 1 file"):
            result = rebatch_and_shard(dataset, 2, 1, 1, policy)
        assert result.policy == AutoShardPolicy.DATA
        assert lists(list(result.dataset)) == [[1], [3], [5]]


def test_file_policy_without_files_is_an_error() -> None:
    with pytest.raises(ValueError, match="unshardable source dataset: RangeDataset"):
        auto_shard_dataset(Dataset.range(4), 2, 0, policy=AutoShardPolicy.FILE)


def test_file_policy_with_one_worker_changes_nothing() -> None:
    # TF skips the rewrite for FILE with one worker, so V2 rebatching survives.
    dataset = with_policy(Dataset.range(10).batch(4), AutoShardPolicy.FILE)
    assert rebatch_and_shard(dataset, 1, 3).policy == AutoShardPolicy.FILE
    got = steps(per_replica_batches(dataset, 1, 3))
    assert got == [[[0, 1], [2], [3]], [[4, 5], [6], [7]], [[8, 9], [], []]]


def test_unbatch_passes_file_sharding(tmp_path: Path) -> None:
    # UnbatchDataset is in kPassThroughOps of TF's auto_shard.cc: each worker reads its files.
    paths = [write_numbers(tmp_path / f"{k}.txt", range(10 * k, 10 * k + 4)) for k in range(2)]
    dataset = Dataset.from_files(paths, read_ints).batch(3).unbatch().batch(2)
    assert dataset._file_sources() == tuple(paths)
    for worker, want in enumerate([[[0, 1], [2, 3]], [[10, 11], [12, 13]]]):
        result = auto_shard_dataset(dataset, 2, worker)
        assert result.policy == AutoShardPolicy.FILE
        assert lists(list(result.dataset)) == want


def test_a_source_that_is_no_file_blocks_file_sharding() -> None:
    dataset = Dataset.range(4).batch(2).unbatch()
    assert dataset._file_sources() is None
    with pytest.warns(AutoShardWarning, match="unshardable source dataset: RangeDataset"):
        assert auto_shard_dataset(dataset, 2, 0).policy == AutoShardPolicy.DATA


def test_hint_policy_fills_shard_placeholders() -> None:
    dataset = with_policy(
        Dataset.range(8).shard(SHARD_HINT, SHARD_HINT).batch(2), AutoShardPolicy.HINT
    )
    assert rebatch_and_shard(dataset, 2, 1, 1).policy == AutoShardPolicy.HINT
    assert steps(per_replica_batches(dataset, 2, 1, 1)) == [[[1]], [[3]], [[5]], [[7]]]


def test_auto_shard_validates_worker_arguments() -> None:
    with pytest.raises(ValueError, match="num_workers should be >= 1"):
        auto_shard_dataset(Dataset.range(2), 0, 0)
    with pytest.raises(ValueError, match="index should be >= 0 and < 2"):
        auto_shard_dataset(Dataset.range(2), 2, 2)


def test_plain_iterables_are_unshardable_sources() -> None:
    batches = [np.arange(4), np.arange(4, 6)]
    got = steps(per_replica_batches(batches, 1, 2))
    assert got == [[[0, 1], [2, 3]], [[4], [5]]]
    with pytest.warns(AutoShardWarning, match="GeneratorDataset"):
        per_replica_batches(batches, 2, 1)
    assert steps(per_replica_batches(iter(batches), 1, 2)) == got  # read once, fully
    with pytest.raises(ValueError, match="one-shot iterator"):
        per_replica_batches(iter(batches), 2, 1)


def test_generator_source_with_signature() -> None:
    signature = TensorSpec((None,), np.int64)
    dataset = Dataset.from_generator(lambda: iter([[1, 2, 3], [4]]), output_signature=signature)
    got = steps(per_replica_batches(dataset, 1, 2))
    assert got == [[[1, 2], [3]], [[4], []]]
