"""Distributed iterators of the torch backend in a polydist.train.Checkpoint: a restored
iterator gives the uninterrupted run's steps, as torch tensors, over polydist datasets and
torch DataLoaders."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import polydist as pd
from polydist.checkpoint import CheckpointMismatchError
from polydist.data import Dataset, InputContext
from polydist.train import Checkpoint
from polydist_torch import TorchBackend

N = 3


@pytest.fixture
def strategy(cpu_only: None) -> pd.MirroredStrategy:
    return pd.MirroredStrategy([f"/cpu:{i}" for i in range(N)], backend=TorchBackend("sequential"))


def host(value: Any) -> Any:
    """A step's value as nested lists, every replica's component in replica order."""
    if isinstance(value, pd.DistributedValues):
        return [host(v) for v in value.values]
    if isinstance(value, tuple | list):
        return [host(v) for v in value]
    if isinstance(value, dict):
        return {k: host(v) for k, v in sorted(value.items())}
    assert isinstance(value, torch.Tensor)  # placed by the backend
    return value.tolist()


def resumes(
    make: Callable[[], Iterator[Any]], tmp_path: Path, skip: int, *, advance: bool = True
) -> list[Any]:
    it = make()
    for _ in range(skip):
        next(it)
    path = Checkpoint(iterator=it).save(tmp_path / "ckpt")
    expected = [host(v) for v in it]
    fresh = make()
    if advance:
        next(fresh, None)  # a fresh iterator that already moved: restore resets it
    Checkpoint(iterator=fresh).restore(path).assert_consumed()
    assert [host(v) for v in fresh] == expected
    return expected


@pytest.mark.parametrize("skip", [0, 2])
def test_distributed_dataset_resumes(
    strategy: pd.MirroredStrategy, tmp_path: Path, skip: int
) -> None:
    def make() -> Iterator[Any]:
        x = np.arange(40, dtype=np.float32).reshape(20, 2)
        ds = Dataset.from_tensor_slices((x, np.arange(20))).shuffle(20, seed=3).batch(6)
        return iter(strategy.experimental_distribute_dataset(ds))

    expected = resumes(make, tmp_path, skip)
    assert len(expected) == 4 - skip
    assert [len(c) for c in expected[-1][1]] == [1, 1, 0]  # 20 = 3 * 6 + 2: a partial step


def test_datasets_from_function_resume(strategy: pd.MirroredStrategy, tmp_path: Path) -> None:
    def dataset_fn(ctx: InputContext) -> Dataset:
        return Dataset.range(40).shuffle(16).repeat(2).batch(ctx.get_per_replica_batch_size(6))

    def make() -> Iterator[Any]:
        return iter(strategy.distribute_datasets_from_function(dataset_fn))

    assert resumes(make, tmp_path, 5)


def test_a_dataloader_resumes(strategy: pd.MirroredStrategy, tmp_path: Path) -> None:
    data = TensorDataset(torch.arange(30, dtype=torch.float32).reshape(15, 2), torch.arange(15))

    def in_order() -> Iterator[Any]:
        return iter(strategy.experimental_distribute_dataset(DataLoader(data, batch_size=6)))

    assert resumes(in_order, tmp_path / "in_order", 1)[0][1] == [[6, 7], [8, 9], [10, 11]]

    # A shuffling loader draws its permutation at iter(): with a seeded generator, a fresh
    # iterator restored before it is read replays the saved run's permutation.
    def shuffled() -> Iterator[Any]:
        seeded = torch.Generator().manual_seed(5)
        loader = DataLoader(data, batch_size=6, shuffle=True, generator=seeded)
        return iter(strategy.experimental_distribute_dataset(loader))

    expected = resumes(shuffled, tmp_path / "shuffled", 1, advance=False)
    firsts = host(next(shuffled()))[1]
    seen = [i for rows in [firsts] + [step[1] for step in expected] for r in rows for i in r]
    assert sorted(seen) == list(range(15))  # one permutation, split into the steps
    assert seen != list(range(15))  # shuffled (or the test would show nothing)


def test_restore_into_another_strategy_is_refused(
    strategy: pd.MirroredStrategy, tmp_path: Path
) -> None:
    it = iter(strategy.experimental_distribute_dataset(Dataset.range(30).batch(6)))
    next(it)
    path = Checkpoint(iterator=it).save(tmp_path / "ckpt")
    two = pd.MirroredStrategy(["/cpu:0", "/cpu:1"], backend=TorchBackend("sequential"))
    other = iter(two.experimental_distribute_dataset(Dataset.range(30).batch(6)))
    with pytest.raises(CheckpointMismatchError, match=r"x 3 replica.*x 2 replica"):
        Checkpoint(iterator=other).restore(path)
