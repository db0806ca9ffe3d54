"""Input iterators in a polydist.train.Checkpoint (TF's iterator checkpoints): save records
the position, restore puts a fresh iterator of the same pipeline there, so the batches
after it are exactly those of the uninterrupted run."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist.checkpoint import CheckpointMismatchError
from polydist.cluster_resolver import set_accelerator_device_lister
from polydist.data import Dataset, InputContext, InputOptions, InputReplicationMode
from polydist.data._sources import as_dataset  # a one-shot source outside a strategy
from polydist.train import Checkpoint, CheckpointManager
from polydist_sim import SimBackend


def plain(value: Any) -> Any:
    """A step's value as nested lists (every replica's component, in replica order)."""
    if isinstance(value, pd.DistributedValues):
        return [plain(v) for v in value.values]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in sorted(value.items())}
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    return np.asarray(value).tolist()


def resumes(
    make_iterator: Callable[[], Iterator[Any]], tmp_path: Path, skip: int, more: int = 1000
) -> list[Any]:
    """Runs ``skip`` steps, saves, records up to ``more`` further steps; restores into a fresh
    iterator and checks it gives the recorded steps. Returns them."""
    it = make_iterator()
    for _ in range(skip):
        next(it)
    path = Checkpoint(iterator=it).save(tmp_path / "ckpt")
    expected = [plain(v) for _, v in zip(range(more), it)]
    fresh = make_iterator()
    next(fresh, None)  # a fresh iterator that already moved: restore resets it
    Checkpoint(iterator=fresh).restore(path).assert_consumed()
    got = [plain(v) for _, v in zip(range(more), fresh)]
    assert got == expected
    return expected


# -- iter(polydist.data.Dataset) --------------------------------------------------------------

PIPELINES: dict[str, Callable[[], Dataset]] = {
    "batch": lambda: Dataset.range(23).batch(4),
    "seeded_shuffle_repeat": lambda: Dataset.range(20).shuffle(7, seed=3).repeat(3).batch(4),
    "shuffle_no_reshuffle": lambda: (
        Dataset.range(12).shuffle(12, seed=5, reshuffle_each_iteration=False).repeat(2)
    ),
    "transformations": lambda: (
        Dataset.from_tensor_slices({"x": np.arange(40.0).reshape(20, 2), "y": np.arange(20)})
        .map(lambda e: {"x": e["x"] * 2, "y": e["y"]})
        .filter(lambda e: e["y"] % 3 != 0)
        .skip(1)
        .take(11)
        .batch(3)
        .unbatch()
        .batch(2)
        .prefetch(2)
    ),
    "generator_function": lambda: Dataset.from_generator(
        lambda: (np.full(2, i) for i in range(9))
    ).batch(2),
}


@pytest.mark.parametrize("name", sorted(PIPELINES))
@pytest.mark.parametrize("skip", [0, 3])
def test_dataset_iterator_resumes(name: str, skip: int, tmp_path: Path) -> None:
    make = PIPELINES[name]
    expected = resumes(lambda: iter(make()), tmp_path, skip)
    assert expected  # there was something left to compare
    # The restored batches are the uninterrupted run's, not merely self-consistent.
    assert expected == [plain(v) for v in list(make())[skip:]]


def test_dataset_iterator_of_one_dataset_object(tmp_path: Path) -> None:
    # Several iter() of one dataset: each new pass of a reshuffling shuffle draws anew;
    # the restored iterator replays the pass its original began with.
    ds = Dataset.range(10).shuffle(10, seed=1)
    first_pass = [int(x) for x in ds]
    it = iter(ds)
    second = [int(next(it)) for _ in range(4)]
    path = Checkpoint(iterator=it).save(tmp_path / "c")
    rest = [int(x) for x in it]
    assert sorted(second + rest) == list(range(10))
    assert second + rest != first_pass  # a different pass (the test would be weak otherwise)
    _ = [int(x) for x in ds]  # a third pass moves the shuffle's count on
    again = iter(ds)
    Checkpoint(iterator=again).restore(path).assert_consumed()
    assert [int(x) for x in again] == rest


def test_unseeded_shuffle_restores_the_saved_order(tmp_path: Path) -> None:
    # A rebuilt unseeded shuffle draws a new seed (as a new process would); restore takes
    # the saved run's seed, so the order after the position is the saved run's (TF saves
    # the shuffle's RNG state likewise).
    def make() -> Dataset:
        return Dataset.range(50).shuffle(50).batch(5)

    assert [plain(b) for b in make()] != [plain(b) for b in make()]  # seeds differ
    resumes(lambda: iter(make()), tmp_path, 3)


def test_text_files_resume(tmp_path: Path) -> None:
    files = []
    for f in range(3):
        path = tmp_path / f"part{f}.txt"
        path.write_text("".join(f"f{f} line {i}\n" for i in range(5)))
        files.append(str(path))
    expected = resumes(lambda: iter(pd.data.TextLineDataset(files).batch(4)), tmp_path, 2)
    assert expected[0] == ["f1 line 3", "f1 line 4", "f2 line 0", "f2 line 1"]


def test_as_numpy_iterator_and_end_positions(tmp_path: Path) -> None:
    expected = resumes(lambda: Dataset.range(6).as_numpy_iterator(), tmp_path, 2)
    assert expected == [2, 3, 4, 5]
    # Saved at the end: the restored iterator is at the end too.
    assert resumes(lambda: iter(Dataset.range(3)), tmp_path / "end", 3) == []


def test_iterator_beside_variables_in_a_manager(tmp_path: Path) -> None:
    step = pd.Variable(np.int64(0), name="step")
    it = iter(Dataset.range(100).shuffle(30, seed=9).batch(8))
    manager = CheckpointManager(Checkpoint(step=step, data={"train": it}), tmp_path, 2)
    for _ in range(5):
        next(it)
        step.assign_add(1)
    manager.save()
    expected = [plain(b) for b in it]
    step2 = pd.Variable(np.int64(0), name="step")
    it2 = iter(Dataset.range(100).shuffle(30, seed=9).batch(8))
    manager2 = CheckpointManager(Checkpoint(step=step2, data={"train": it2}), tmp_path, 2)
    manager2.restore_or_initialize()
    assert int(np.asarray(step2.numpy())) == 5
    assert [plain(b) for b in it2] == expected
    # The position is JSON in the manifest, beside the other objects' metadata.
    manifest = json.loads((Path(manager.latest_checkpoint) / "manifest.json").read_text())
    state = manifest["metadata"]["polydist_checkpoint"]["json_states"]["data/train"]
    assert state["position"] == 5


# -- distributed iterators (sim) --------------------------------------------------------------


def test_distributed_dataset_resumes_with_partial_batches(tmp_path: Path) -> None:
    strategy = pd.MirroredStrategy(3)

    def make() -> Iterator[Any]:
        ds = Dataset.from_tensor_slices(np.arange(26.0)).shuffle(26, seed=2).batch(6)
        return iter(strategy.experimental_distribute_dataset(ds))

    expected = resumes(make, tmp_path, 2)
    assert len(expected) == 3
    assert [len(c) for c in expected[-1]] == [1, 1, 0]  # the partial batch: 2 of 3 replicas


def test_distributed_iterator_counts_steps_handed_out_not_read_ahead(tmp_path: Path) -> None:
    strategy = pd.MirroredStrategy(2)
    options = InputOptions(experimental_per_replica_buffer_size=3)

    def make() -> Iterator[Any]:
        ds = Dataset.range(40).batch(4)
        return iter(strategy.experimental_distribute_dataset(ds, options))

    expected = resumes(make, tmp_path, 4)
    assert expected[0] == [[16, 17], [18, 19]]


@pytest.mark.parametrize("source", ["list", "generator_function"])
def test_plain_python_inputs_resume(source: str, tmp_path: Path) -> None:
    strategy = pd.MirroredStrategy(2)
    batches = [{"x": np.full((4, 2), i, np.float32)} for i in range(7)]

    def make() -> Iterator[Any]:
        given: Any = batches if source == "list" else (lambda: iter(batches))
        return iter(strategy.experimental_distribute_dataset(given))

    assert resumes(make, tmp_path, 5)[0]["x"][0] == [[5.0, 5.0], [5.0, 5.0]]


def test_datasets_from_function_resume(tmp_path: Path) -> None:
    strategy = pd.MirroredStrategy(2)

    def dataset_fn(ctx: InputContext) -> Dataset:
        size = ctx.get_per_replica_batch_size(8)
        return Dataset.range(30).shuffle(10, seed=4).repeat(2).batch(size)

    def make() -> Iterator[Any]:
        return iter(strategy.distribute_datasets_from_function(dataset_fn))

    resumes(make, tmp_path, 6)


def test_per_replica_pipelines_resume(tmp_path: Path) -> None:
    strategy = pd.MirroredStrategy(2)
    options = InputOptions(
        experimental_replication_mode=InputReplicationMode.PER_REPLICA,
        experimental_fetch_to_device=False,
        experimental_place_dataset_on_device=True,
    )

    def dataset_fn(ctx: InputContext) -> Dataset:
        return Dataset.range(ctx.input_pipeline_id * 100, ctx.input_pipeline_id * 100 + 9).batch(2)

    def make() -> Iterator[Any]:
        return iter(strategy.distribute_datasets_from_function(dataset_fn, options))

    expected = resumes(make, tmp_path, 2)
    assert expected[0] == [[4, 5], [104, 105]]


def test_default_strategy_resumes(tmp_path: Path) -> None:
    strategy = pd.get_strategy()
    resumes(lambda: iter(strategy.experimental_distribute_dataset(Dataset.range(9))), tmp_path, 4)


@pytest.fixture
def two_workers(monkeypatch: pytest.MonkeyPatch) -> Iterator[pd.MultiWorkerMirroredStrategy]:
    cluster = {"cluster": {"worker": ["localhost:1", "localhost:2"]}}
    monkeypatch.setenv("TF_CONFIG", json.dumps({**cluster, "task": {"type": "worker", "index": 0}}))
    previous = set_accelerator_device_lister(None)
    set_accelerator_device_lister(previous)
    yield pd.MultiWorkerMirroredStrategy(backend=SimBackend(num_gpus=2))
    set_accelerator_device_lister(previous)


def test_multi_worker_sharded_input_resumes(
    two_workers: pd.MultiWorkerMirroredStrategy, tmp_path: Path
) -> None:
    strategy = two_workers  # 2 workers x 2 replicas, simulated in this process

    def make() -> Iterator[Any]:
        ds = Dataset.range(44).shuffle(44, seed=8).batch(8)  # DATA-sharded, ragged end
        options = pd.data.Options()
        options.experimental_distribute.auto_shard_policy = pd.data.AutoShardPolicy.DATA
        return iter(strategy.experimental_distribute_dataset(ds.with_options(options)))

    expected = resumes(make, tmp_path, 3)
    assert len(expected) == 3 and len(expected[0]) == 4  # four replicas' components a step

    def dataset_fn(ctx: InputContext) -> Dataset:
        ds = Dataset.range(50).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.shuffle(25).batch(ctx.get_per_replica_batch_size(8))  # unseeded

    from_fn = strategy.distribute_datasets_from_function
    resumes(lambda: iter(from_fn(dataset_fn)), tmp_path / "from_fn", 2)


# -- errors -----------------------------------------------------------------------------------


def saved_at(it: Iterator[Any], steps: int, tmp_path: Path) -> str:
    for _ in range(steps):
        next(it)
    return Checkpoint(iterator=it).save(tmp_path / "ckpt")


def test_restore_into_another_pipeline_is_refused(tmp_path: Path) -> None:
    path = saved_at(iter(Dataset.range(40).batch(4)), 2, tmp_path)
    other = iter(Dataset.range(40).batch(8))
    first = plain(next(other))
    with pytest.raises(CheckpointMismatchError) as info:
        Checkpoint(iterator=other).restore(path)
    message = str(info.value)
    assert "'iterator'" in message
    assert "BatchDataset(batch_size=4, drop_remainder=False)" in message  # what was saved
    assert "BatchDataset(batch_size=8, drop_remainder=False)" in message  # what it got
    assert "same pipeline" in message  # what to do
    assert first == list(range(8)) and plain(next(other)) == list(range(8, 16))  # unchanged

    float_input = Dataset.from_tensor_slices(np.arange(40.0)).batch(4)
    floats = saved_at(iter(float_input), 1, tmp_path / "f")
    with pytest.raises(CheckpointMismatchError, match=r"element_spec was .*float64.* is .*int64"):
        Checkpoint(iterator=iter(Dataset.range(40).batch(4))).restore(floats)
    seeded = saved_at(iter(Dataset.range(9).shuffle(9, seed=3)), 1, tmp_path / "s")
    with pytest.raises(CheckpointMismatchError, match=r"seed=3.*seed=4"):
        Checkpoint(iterator=iter(Dataset.range(9).shuffle(9, seed=4))).restore(seeded)


def test_restore_into_another_distribution_is_refused(tmp_path: Path) -> None:
    def over(n: int) -> Iterator[Any]:
        return iter(
            pd.MirroredStrategy(n).experimental_distribute_dataset(Dataset.range(40).batch(8))
        )

    path = saved_at(over(2), 1, tmp_path)
    with pytest.raises(CheckpointMismatchError, match=r"1 worker\(s\) x 2 replica.*x 4 replica"):
        Checkpoint(iterator=over(4)).restore(path)
    with pytest.raises(CheckpointMismatchError, match=r"iter\(polydist.data.Dataset\)"):
        Checkpoint(iterator=iter(Dataset.range(40).batch(8))).restore(path)
    from_fn = pd.MirroredStrategy(2).distribute_datasets_from_function(
        lambda ctx: Dataset.range(40).batch(4)
    )
    with pytest.raises(CheckpointMismatchError, match="distribute_datasets_from_function"):
        Checkpoint(iterator=iter(from_fn)).restore(path)


def test_one_shot_generator_fails_at_save(tmp_path: Path) -> None:
    def gen() -> Iterator[np.ndarray]:
        yield from (np.full(4, i) for i in range(5))

    strategy = pd.MirroredStrategy(2)
    for it in (iter(strategy.experimental_distribute_dataset(gen())), iter(as_dataset(gen()))):
        next(it)
        with pytest.raises(ValueError, match="one-shot Python iterator") as info:
            Checkpoint(iterator=it).save(tmp_path / "ckpt")
        assert "generator function itself" in str(info.value)  # what to do
        assert not list(tmp_path.glob("ckpt-*"))  # nothing written


def test_input_that_changed_fails_at_restore_and_changes_nothing(tmp_path: Path) -> None:
    data = list(range(10))
    ds = Dataset.from_generator(lambda: iter(list(data))).batch(2)
    path = saved_at(iter(ds), 4, tmp_path)
    del data[3:]  # now shorter than the saved position
    it = iter(ds)
    assert plain(next(it)) == [0, 1]
    with pytest.raises(ValueError, match=r"4 element\(s\), but the input ended after 2"):
        Checkpoint(iterator=it).restore(path)
    assert plain(next(it)) == [2]  # where it was


def test_checkpoint_with_and_without_an_iterator(tmp_path: Path) -> None:
    v = pd.Variable(np.float32(1.0))
    without = Checkpoint(v=v).save(tmp_path / "a")
    it = iter(Dataset.range(5))
    status = Checkpoint(v=v, iterator=it).restore(without)
    with pytest.raises(AssertionError, match="iterator"):
        status.assert_existing_objects_matched()
    status.expect_partial()
    with_it = Checkpoint(v=v, iterator=it).save(tmp_path / "b")
    status = Checkpoint(v=v).restore(with_it)
    with pytest.raises(AssertionError, match="iterator"):
        status.assert_consumed()
    status.expect_partial()
    # An iterator alone is a nontrivial match.
    Checkpoint(iterator=iter(Dataset.range(5))).restore(
        with_it
    ).expect_partial().assert_nontrivial_match()
