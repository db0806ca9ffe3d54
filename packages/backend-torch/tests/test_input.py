"""torch DataLoaders as distributed input: the sim's per-replica batches, as torch tensors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import polydist as pd
import polydist_torch
from polydist_sim import SimBackend
from polydist_torch import TorchBackend

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def sim_strategy(n: int) -> pd.MirroredStrategy:
    return pd.MirroredStrategy(n, backend=SimBackend("sequential"))


def torch_strategy(n: int) -> pd.MirroredStrategy:
    return pd.MirroredStrategy([f"/cpu:{i}" for i in range(n)], backend=TorchBackend("sequential"))


def loader(examples: int, batch: int, *, drop_last: bool = False) -> DataLoader[Any]:
    x = torch.arange(examples, dtype=torch.float32).reshape(examples, 1) / 4
    y = torch.arange(examples)  # int64
    return DataLoader(TensorDataset(x, y), batch_size=batch, drop_last=drop_last)


def host(strategy: pd.Strategy, value: Any) -> Any:
    """One step's value on the host: per-replica lists of NumPy arrays, nests kept."""
    backend = strategy.extended.backend
    if isinstance(value, pd.DistributedValues):
        return [host(strategy, v) for v in value.values]
    if isinstance(value, tuple):
        return tuple(host(strategy, v) for v in value)
    if isinstance(value, dict):
        return {k: host(strategy, v) for k, v in value.items()}
    return np.asarray(backend.to_numpy(value))


def assert_same(a: Any, b: Any, path: str = "step") -> None:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), path
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), f"{path}"
        return
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    else:
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")


def steps_of(strategy: pd.Strategy, source: Any) -> list[Any]:
    return [host(strategy, step) for step in strategy.experimental_distribute_dataset(source)]


def labels(steps: list[Any]) -> list[list[list[int]]]:
    return [[r.tolist() for r in step[1]] for step in steps]


def test_partial_batches_of_a_tensor_dataset_loader() -> None:
    # The reference's example: 10 examples, global batch 4, 3 replicas.
    s = torch_strategy(3)
    dist = s.experimental_distribute_dataset(loader(10, 4))
    steps = list(dist)
    assert labels([host(s, step) for step in steps]) == [
        [[0, 1], [2, 3], []],
        [[4, 5], [6, 7], []],
        [[8], [9], []],
    ]
    x, y = steps[0]  # a DataLoader's [x, y] batch becomes the tuple (x, y)
    for r, (xr, yr) in enumerate(zip(x.values, y.values)):
        assert type(xr) is torch.Tensor and xr.dtype == torch.float32 and yr.dtype == torch.int64
        assert xr.device == torch.device("cpu")
        assert xr.shape == ((2, 1) if r < 2 else (0, 1))
    # The same loader on the sim gives the same bits.
    want = steps_of(sim_strategy(3), loader(10, 4))
    for got_step, want_step in zip([host(s, step) for step in steps], want, strict=True):
        assert_same(got_step, want_step)


@pytest.mark.parametrize(
    ("examples", "batch", "replicas", "drop_last"),
    [(10, 4, 3, False), (10, 4, 3, True), (7, 7, 2, False), (5, 2, 4, False), (8, 8, 4, False)],
)
def test_loaders_split_like_on_the_sim(
    examples: int, batch: int, replicas: int, drop_last: bool
) -> None:
    got = steps_of(torch_strategy(replicas), loader(examples, batch, drop_last=drop_last))
    want = steps_of(sim_strategy(replicas), loader(examples, batch, drop_last=drop_last))
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert_same(g, w)
    seen = sorted(i for step in labels(got) for replica in step for i in replica)
    kept = examples - (examples % batch if drop_last else 0)
    assert seen == list(range(kept))


class DictDataset(Dataset[dict[str, Any]]):
    """Examples as dicts, one of them a nested tuple."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> dict[str, Any]:
        image = torch.full((2, 2), float(i))
        return {"image": image, "label": i, "pair": (torch.tensor([i, -i]), np.float32(i) / 2)}


def test_dict_examples_and_nested_structure() -> None:
    s = torch_strategy(2)
    data = DataLoader(DictDataset(), batch_size=3)
    got = steps_of(s, data)
    want = steps_of(sim_strategy(2), DataLoader(DictDataset(), batch_size=3))
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    first = next(iter(s.experimental_distribute_dataset(data)))
    assert set(first) == {"image", "label", "pair"}
    assert isinstance(first["pair"], tuple)  # default_collate's list, read as a tuple
    assert [v.tolist() for v in first["label"].values] == [[0, 1], [2]]
    assert first["image"].values[1].shape == (1, 2, 2)


def test_numpy_batches_and_lists_of_numbers() -> None:
    def numpy_collate(examples: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        xs = np.stack([x.numpy() for x, _ in examples])
        return [xs, [int(y) for _, y in examples]]  # a list of Python ints is one array

    s = torch_strategy(2)
    data = DataLoader(TensorDataset(torch.ones(4, 3), torch.arange(4)), 4, collate_fn=numpy_collate)
    (step,) = list(s.experimental_distribute_dataset(data))
    x, y = step
    assert [v.shape for v in x.values] == [(2, 3), (2, 3)]
    assert [v.tolist() for v in y.values] == [[0, 1], [2, 3]] and y.values[0].dtype == torch.int32


def test_iterating_again_reads_the_loader_again() -> None:
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.arange(12)), batch_size=4, shuffle=True, generator=g)
    dist = torch_strategy(2).experimental_distribute_dataset(data)
    epochs = [[v.tolist() for (step,) in dist for v in step.values] for _ in range(2)]
    for epoch in epochs:
        assert sorted(i for part in epoch for i in part) == list(range(12))
    assert epochs[0] != epochs[1]  # reshuffled


def test_one_replica_gets_plain_tensors() -> None:
    s = pd.OneDeviceStrategy("/cpu:0", backend=TorchBackend())
    steps = list(s.experimental_distribute_dataset(loader(5, 2)))
    assert [type(x).__name__ for x, _ in steps] == ["Tensor"] * 3
    assert [y.tolist() for _, y in steps] == [[0, 1], [2, 3], [4]]


def test_distribute_datasets_from_function_with_loaders() -> None:
    # Per-replica batches, nothing rebatched: replica r reads its own loader.
    def dataset_fn(context: pd.InputContext) -> Any:
        assert context.get_per_replica_batch_size(4) == 2
        rows = torch.arange(6) + 10 * context.input_pipeline_id
        return DataLoader(TensorDataset(rows), batch_size=2)

    options = pd.InputOptions(experimental_replication_mode=pd.InputReplicationMode.PER_REPLICA)
    for make in (torch_strategy, sim_strategy):
        s = make(2)
        got = [host(s, step) for step in s.distribute_datasets_from_function(dataset_fn, options)]
        assert [[r.tolist() for r in step[0]] for step in got] == [
            [[0, 1], [10, 11]],
            [[2, 3], [12, 13]],
            [[4, 5], [14, 15]],
        ]


def test_a_training_loop_over_a_loader_matches_single_device_training() -> None:
    torch.manual_seed(0)
    features = torch.randn(20, 3)
    targets = features @ torch.tensor([[1.0], [-2.0], [0.5]])
    data = DataLoader(TensorDataset(features, targets), batch_size=8)  # 8, 8, 4
    s = torch_strategy(4)
    with s.scope():
        w = pd.Variable(np.zeros((3, 1), np.float32), name="w")
    params = polydist_torch.parameters(s)
    optimizers = [torch.optim.SGD(p, lr=0.1) for p in params]

    def step(x: Any, y: Any) -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        r = int(ctx.replica_id_in_sync_group)
        optimizers[r].zero_grad()
        loss = ((x @ w - y) ** 2).sum() / 8
        loss.backward()
        (g,) = ctx.all_reduce("SUM", [params[r][0].grad])
        params[r][0].grad = g
        optimizers[r].step()
        return loss.detach()

    for x, y in s.experimental_distribute_dataset(data):
        s.run(step, args=(x, y))

    ref = torch.zeros(3, 1)
    for x, y in data:
        per_replica = -(-x.shape[0] // 4)  # the legacy split: ceil(batch / replicas) rows
        grads = []
        for xs, ys in zip(x.split(per_replica), y.split(per_replica)):
            wl = ref.clone().requires_grad_()
            (((xs @ wl - ys) ** 2).sum() / 8).backward()
            grads.append(wl.grad)
        total = grads[0].clone()  # type: ignore[union-attr]
        for g in grads[1:]:
            total = total + g
        ref = ref.add(total, alpha=-0.1)
    assert w.numpy().tobytes() == ref.numpy().tobytes()


@needs_cuda
def test_batches_go_to_the_gpu_through_pinned_memory() -> None:
    s = pd.MirroredStrategy(["/gpu:0", "/cpu:1"], backend=TorchBackend("sequential"))
    data = DataLoader(TensorDataset(torch.arange(8.0).reshape(8, 1)), batch_size=4, pin_memory=True)
    steps = list(s.experimental_distribute_dataset(data))
    (x,) = steps[0]
    assert x.values[0].device == torch.device("cuda", 0)
    assert x.values[1].device == torch.device("cpu")
    torch.cuda.synchronize()
    assert [v.cpu().reshape(-1).tolist() for v in x.values] == [[0.0, 1.0], [2.0, 3.0]]


@needs_cuda
def test_place_on_cuda_pins_numpy_and_copies_pinned_tensors_asynchronously() -> None:
    backend = TorchBackend()
    array = np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::-1]  # not C-contiguous
    placed = backend.place(array, "/gpu:0")
    assert placed.device == torch.device("cuda", 0) and placed.dtype == torch.float32
    assert placed.cpu().numpy().tolist() == array.tolist()
    pinned = torch.ones(3).pin_memory()
    assert backend.place(pinned, "/gpu:0").cpu().tolist() == [1.0, 1.0, 1.0]
    assert backend.place(np.zeros((0, 2), np.int64), "/gpu:0").shape == (0, 2)


def test_place_on_cpu_copies_numpy_without_pinning() -> None:
    backend = TorchBackend()
    array = np.arange(4, dtype=np.float32)
    placed = backend.place(array, "/cpu:0")
    assert not placed.is_pinned() and placed.tolist() == [0.0, 1.0, 2.0, 3.0]
    array[0] = 9.0
    assert placed[0].item() == 0.0  # a private copy


def test_generator_of_loader_style_batches() -> None:
    def batches() -> Iterator[list[torch.Tensor]]:
        for i in range(2):
            yield [torch.arange(4) + 4 * i, torch.ones(4, 2)]

    s = torch_strategy(2)
    for source in (batches, batches()):
        got = [
            [v.tolist() for v in step[0].values]
            for step in s.experimental_distribute_dataset(source)
        ]
        assert got == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


# ------------------------------------------- shuffling loaders and torch's global RNG


class Augmented(Dataset[torch.Tensor]):
    """Examples with a random shift from torch's global RNG, as a num_workers=0 augmentation."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)]) + torch.rand(1)


def rows_of(value: Any) -> list[float]:
    """A step's global batch: the replicas' rows in order (a plain tensor at one replica)."""
    if isinstance(value, list | tuple):  # a TensorDataset's [x]
        value = value[0]
    if isinstance(value, pd.DistributedValues):
        return [r for v in value.values for r in rows_of(v)]
    return [float(r) for r in value.reshape(-1)]


def rng_trace(data: Any, *, manual: bool, spec: bool = False, epochs: int = 3) -> list[Any]:
    """The batches a program reads and the torch.randn draws between them, in order."""
    trace: list[Any] = [("made", torch.randn(3).tolist())]
    if spec:
        trace.append(("spec", str(data.element_spec)))
    for _ in range(epochs):
        iterator = iter(data)
        if manual:  # a draw between iter() and the first next(), as a model's init would
            trace.append(("iter", torch.randn(1).tolist()))
        for batch in iterator:
            trace.append(("batch", rows_of(batch)))
            trace.append(("dropout", torch.randn(1).tolist()))
        trace.append(("epoch", torch.randn(3).tolist()))
    return trace


def shuffled(augmented: bool) -> DataLoader[Any]:
    data: Any = Augmented() if augmented else TensorDataset(torch.arange(10.0))
    return DataLoader(data, batch_size=4, shuffle=True)


def make_strategy(kind: str) -> pd.Strategy:
    if kind == "one_device":
        return pd.OneDeviceStrategy("/cpu:0", backend=TorchBackend("sequential"))
    return torch_strategy(int(kind[-1]))


@pytest.mark.parametrize("kind", ["one_device", "mirrored1", "mirrored2", "mirrored3"])
@pytest.mark.parametrize("manual", [False, True])
def test_a_shuffling_loader_reads_and_draws_as_plain_torch(kind: str, manual: bool) -> None:
    # Batch order and every torch.randn after distributing, per step and per epoch,
    # are plain torch's: iter(dist) calls iter(loader) (its seed draw) and nothing
    # reads the loader ahead of the user (no spec peek, no pass of its own).
    torch.manual_seed(0)
    expected = rng_trace(shuffled(False), manual=manual)
    torch.manual_seed(0)
    dist = make_strategy(kind).experimental_distribute_dataset(shuffled(False))
    assert rng_trace(dist, manual=manual) == expected


@pytest.mark.parametrize("kind", ["one_device", "mirrored2"])
def test_element_spec_of_a_shuffling_loader_begins_the_first_epoch(kind: str) -> None:
    # The spec is read from the first batch of the pass the next iteration
    # continues: no extra permutation, so with no draw in between all is the same.
    torch.manual_seed(0)
    expected = rng_trace(shuffled(False), manual=False)
    torch.manual_seed(0)
    dist = make_strategy(kind).experimental_distribute_dataset(shuffled(False))
    got = rng_trace(dist, manual=False, spec=True)
    assert got[1][0] == "spec" and "None" in got[1][1]
    assert [got[0], *got[2:]] == expected


@pytest.mark.parametrize("kind", ["one_device", "mirrored2"])
def test_an_augmenting_loader_without_read_ahead_draws_as_plain_torch(kind: str) -> None:
    # A dataset drawing from the global RNG as it is read: with buffer size 0 the
    # reads interleave with the user's draws exactly as in plain torch.
    torch.manual_seed(0)
    expected = rng_trace(shuffled(True), manual=True)
    torch.manual_seed(0)
    options = pd.data.InputOptions(experimental_per_replica_buffer_size=0)
    dist = make_strategy(kind).experimental_distribute_dataset(shuffled(True), options)
    assert rng_trace(dist, manual=True) == expected


def test_read_ahead_stays_inside_the_epoch_the_user_began() -> None:
    # The default read-ahead (one step) reads the next batch of the same pass,
    # never iter() of a new one: after the last step of an epoch no pass is begun.
    passes: list[int] = []

    class Counting(DataLoader[Any]):
        def __iter__(self) -> Any:
            passes.append(len(passes))
            return super().__iter__()

    counting = Counting(TensorDataset(torch.arange(10.0)), batch_size=4, shuffle=True)
    dist = torch_strategy(2).experimental_distribute_dataset(counting)
    assert passes == []
    for epoch in range(3):
        iterator = iter(dist)
        assert len(passes) == epoch + 1
        assert len(list(iterator)) == 3
        assert len(passes) == epoch + 1


def test_a_loader_with_a_distributed_sampler_is_not_sharded_again() -> None:
    """DDP's input, `DataLoader(ds, sampler=DistributedSampler(ds))`, already gives each
    process its share; polydist's DATA sharding across workers would keep half of it on
    each of 2 workers, silently. It raises; the loader in distribute_datasets_from_function
    (the way the error names) reads every example once across the workers."""
    from torch.utils.data.distributed import DistributedSampler

    from polydist.cluster_resolver import ClusterSpec, SimpleClusterResolver

    def two_workers(task_id: int = 0) -> pd.Strategy:  # both simulated here, on the sim
        resolver = SimpleClusterResolver(
            ClusterSpec({"worker": ["host0:2222", "host1:2222"]}),
            task_type="worker",
            task_id=task_id,
        )
        return pd.MultiWorkerMirroredStrategy(resolver, backend=SimBackend())

    data = TensorDataset(torch.arange(16, dtype=torch.float32))

    def sharded(rank: int, batch: int) -> DataLoader[Any]:
        return DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, 2, rank, False))

    with pytest.raises(ValueError, match=r"DistributedSampler\(num_replicas=2, rank=0\)"):
        two_workers().experimental_distribute_dataset(sharded(0, 4))
    for rank in range(2):  # each worker reads its whole share: every example once in all
        strategy = two_workers(rank)
        dist = strategy.distribute_datasets_from_function(
            lambda ctx: sharded(ctx.input_pipeline_id, ctx.get_per_replica_batch_size(8))
        )
        seen = sorted(
            float(v)
            for (step,) in dist
            for part in strategy.experimental_local_results(step)
            for v in np.asarray(part)
        )
        assert seen == list(range(rank, 16, 2))
