"""Distributed iterators of the jax backend in a polydist.train.Checkpoint: a restored
iterator gives the uninterrupted run's steps, as sharded jax arrays, and training resumed
from the checkpoint ends where the uninterrupted run ends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import polydist as pd
from polydist.checkpoint import CheckpointMismatchError
from polydist.data import Dataset, InputContext
from polydist.train import Checkpoint
from polydist_jax import JaxBackend

N = 8


def host(value: Any) -> Any:
    """A step's value as nested lists, every replica's component in replica order."""
    if isinstance(value, pd.DistributedValues):
        return [host(v) for v in value.values]
    if isinstance(value, dict):
        return {k: host(v) for k, v in sorted(value.items())}
    return np.asarray(value).tolist()


def examples() -> Dataset:
    x = np.arange(75, dtype=np.float32).reshape(25, 3)
    return Dataset.from_tensor_slices({"x": x, "y": np.arange(25, dtype=np.int32)})


def resumes(make: Callable[[], Iterator[Any]], tmp_path: Path, skip: int) -> list[Any]:
    it = make()
    for _ in range(skip):
        next(it)
    path = Checkpoint(iterator=it).save(tmp_path / "ckpt")
    expected = [host(v) for v in it]
    fresh = make()
    Checkpoint(iterator=fresh).restore(path).assert_consumed()
    restored = list(fresh)
    for value in restored:
        for component in value["x"].values:
            assert isinstance(component, jax.Array)  # placed by the backend, as before
    assert [host(v) for v in restored] == expected
    return expected


@pytest.mark.parametrize("skip", [0, 2])
def test_distributed_dataset_resumes(jax_backend: JaxBackend, tmp_path: Path, skip: int) -> None:
    strategy = pd.MirroredStrategy(N, backend=jax_backend)

    def make() -> Iterator[Any]:
        ds = examples().shuffle(25, seed=7).repeat(2).batch(16)  # 50 examples: a partial step
        return iter(strategy.experimental_distribute_dataset(ds))

    expected = resumes(make, tmp_path, skip)
    assert len(expected) == 4 - skip
    assert [len(c) for c in expected[-1]["y"]] == [1, 1, 0, 0, 0, 0, 0, 0]


def test_datasets_from_function_resume(jax_backend: JaxBackend, tmp_path: Path) -> None:
    strategy = pd.MirroredStrategy(N, backend=jax_backend)

    def dataset_fn(ctx: InputContext) -> Dataset:
        return examples().shuffle(10).batch(ctx.get_per_replica_batch_size(16))  # unseeded

    def make() -> Iterator[Any]:
        return iter(strategy.distribute_datasets_from_function(dataset_fn))

    assert resumes(make, tmp_path, 1)


def train(
    strategy: pd.MirroredStrategy, w: pd.Variable, it: Iterator[Any], steps: int
) -> list[float]:
    """``steps`` SGD steps of a linear model on the iterator's batches; the losses."""

    def step(batch: dict[str, Any]) -> Any:
        x, y = batch["x"], batch["y"].astype(np.float32)
        pred = x @ w.value()
        grad = x.T @ (pred - y) / 16.0
        ctx = pd.get_replica_context()
        assert ctx is not None
        w.assign_sub(0.001 * ctx.all_reduce("SUM", grad))
        return ((pred - y) ** 2).sum()

    losses = []
    for _ in range(steps):
        loss = strategy.run(step, args=(next(it),))
        losses.append(float(np.asarray(strategy.reduce("SUM", loss, axis=None))))
    return losses


def test_training_resumes_from_a_checkpoint(jax_backend: JaxBackend, tmp_path: Path) -> None:
    strategy = pd.MirroredStrategy(N, backend=jax_backend)

    def setup() -> tuple[pd.Variable, Iterator[Any], Checkpoint]:
        with strategy.scope():
            w = pd.Variable(np.zeros(3, np.float32), name="w")
        ds = examples().shuffle(25, seed=1).repeat().batch(16, drop_remainder=True)
        it = iter(strategy.experimental_distribute_dataset(ds))
        return w, it, Checkpoint(w=w, iterator=it)

    w, it, ckpt = setup()
    train(strategy, w, it, 3)
    path = ckpt.save(tmp_path / "ckpt")
    later = train(strategy, w, it, 4)
    final = np.asarray(w.numpy())

    w2, it2, ckpt2 = setup()
    ckpt2.restore(path).assert_consumed()
    assert train(strategy, w2, it2, 4) == later
    np.testing.assert_array_equal(np.asarray(w2.numpy()), final)


def test_restore_into_another_batch_size_is_refused(
    jax_backend: JaxBackend, tmp_path: Path
) -> None:
    strategy = pd.MirroredStrategy(N, backend=jax_backend)
    it = iter(strategy.experimental_distribute_dataset(examples().batch(16)))
    next(it)
    path = Checkpoint(iterator=it).save(tmp_path / "ckpt")
    other = iter(strategy.experimental_distribute_dataset(examples().batch(8)))
    with pytest.raises(CheckpointMismatchError, match=r"batch_size=16.*batch_size=8"):
        Checkpoint(iterator=other).restore(path)
