"""nn.SyncBatchNorm in a distributed module syncs over the strategy's replicas."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import polydist as pd
import polydist_torch

# The replicas' statistics are combined from per-replica parts, one device's from the
# whole batch at once: only float32 rounding differs.
RTOL, ATOL = 1e-5, 1e-5


def cpu_strategy(n: int) -> pd.Strategy:
    return pd.MirroredStrategy([f"/cpu:{i}" for i in range(n)], backend="torch")


def dense(norm: Callable[[int], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), norm(8), nn.Tanh(), nn.Linear(8, 3))


def conv(norm: Callable[[int], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), norm(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3)
    )


MODELS: dict[str, tuple[Callable[..., nn.Module], Callable[..., nn.Module], tuple[int, ...]]] = {
    "dense": (dense, nn.BatchNorm1d, (6,)),
    "dense_cumulative": (dense, lambda c: nn.BatchNorm1d(c, momentum=None), (6,)),
    "conv": (conv, nn.BatchNorm2d, (2, 4, 4)),
}


def batches(shape: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # 8, 8 and a last batch of 2: with 4 replicas, two of them get no example.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(18, *shape, generator=g) * 3 + 1
    y = torch.randint(0, 3, (18,), generator=g)
    return [(x[i : i + 8], y[i : i + 8]) for i in range(0, 18, 8)]


def train_one_device(model: nn.Module, data: list[Any]) -> nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


def train_distributed(model: nn.Module, replicas: int, data: list[Any]) -> Any:
    strategy = cpu_strategy(replicas)
    with strategy.scope():
        dist = polydist_torch.distribute_module(model)
    opt = polydist_torch.distribute_optimizer(
        torch.optim.SGD(dist.parameters(), lr=0.1, momentum=0.9)
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = pd.nn.compute_average_loss_exact(F.cross_entropy(dist(x), y, reduction="none"))
        loss.backward()
        opt.step()
        opt.zero_grad()

    for x, y in strategy.experimental_distribute_dataset(data):
        strategy.run(step, args=(x, y))
    return strategy, dist


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_trains_as_one_device_on_the_global_batch(kind: str, replicas: int) -> None:
    """DDP's idiom, `convert_sync_batchnorm`, under a strategy: every replica normalizes
    with the statistics of the whole global batch (a partial last batch and empty replicas
    included), so training equals one device's with nn.BatchNorm on the whole batch:
    parameters, running statistics, and the evaluated model."""
    build, norm, shape = MODELS[kind]
    data = batches(shape)
    reference = train_one_device(build(norm), data)
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(build(norm))
    strategy, model = train_distributed(synced, replicas, data)
    assert pd.debugging.check_replicas_identical(strategy) > 0
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=ATOL, msg=key)
    assert int(got["1.num_batches_tracked"]) == 3
    x = data[0][0]
    reference.eval()
    model.eval()
    torch.testing.assert_close(model(x), reference(x), rtol=RTOL, atol=ATOL)

    # The check can fail: nn.BatchNorm under the strategy keeps per-replica statistics
    # (and refuses the last batch's single examples).
    _, local = train_distributed(build(norm), replicas, data[:2])
    _, synced_two = train_distributed(
        nn.SyncBatchNorm.convert_sync_batchnorm(build(norm)), replicas, data[:2]
    )
    want_two = train_one_device(build(norm), data[:2]).state_dict()["1.running_var"]
    torch.testing.assert_close(synced_two.state_dict()["1.running_var"], want_two)
    assert not torch.allclose(local.state_dict()["1.running_var"], want_two, rtol=1e-3)


def test_gradients_reach_every_replicas_examples() -> None:
    """TF's rule for the gradient of a collective: d(loss)/d(x) on each replica is the
    one-device gradient of the whole batch's loss at that replica's examples."""
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(3)) * 2
    weights = torch.arange(32, dtype=torch.float32).reshape(8, 4) / 10
    whole = x.clone().requires_grad_(True)
    bn = nn.BatchNorm1d(4)
    (bn(whole) * weights).sum().backward()

    strategy = cpu_strategy(4)
    with strategy.scope():
        model = polydist_torch.distribute_module(nn.SyncBatchNorm(4))

    def grad(part: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        part = part.clone().requires_grad_(True)
        (model(part) * w).sum().backward()
        assert part.grad is not None
        return part.grad

    xs = strategy.experimental_distribute_values_from_function(
        lambda ctx: x[2 * ctx.replica_id_in_sync_group : 2 * ctx.replica_id_in_sync_group + 2]
    )
    ws = strategy.experimental_distribute_values_from_function(
        lambda ctx: weights[2 * ctx.replica_id_in_sync_group : 2 * ctx.replica_id_in_sync_group + 2]
    )
    got = torch.cat(strategy.experimental_local_results(strategy.run(grad, args=(xs, ws))))
    assert whole.grad is not None
    torch.testing.assert_close(got, whole.grad, rtol=RTOL, atol=ATOL)


def test_one_replica_and_outside_run_are_plain_batch_norm() -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(4))
    plain = nn.BatchNorm1d(4)
    want = plain(x)
    alone = cpu_strategy(1)
    one = polydist_torch.distribute_module(nn.SyncBatchNorm(4), alone)
    assert isinstance(one.module, nn.SyncBatchNorm)
    torch.testing.assert_close(alone.run(one, args=(x,)), want)
    two = polydist_torch.distribute_module(nn.SyncBatchNorm(4), cpu_strategy(2))
    torch.testing.assert_close(two(x), want)  # outside run: this batch's own statistics
    flat = nn.BatchNorm1d(4)
    flat.load_state_dict(two.state_dict())  # the same keys as nn.BatchNorm1d's


def test_process_groups_and_subclasses_are_refused() -> None:
    grouped = nn.SyncBatchNorm(4, process_group=object())
    with pytest.raises(ValueError, match=r"layers \[''\] name a process_group"):
        polydist_torch.distribute_module(grouped, cpu_strategy(2))

    class Mine(nn.SyncBatchNorm):
        pass

    with pytest.raises(TypeError, match="Mine subclasses nn.SyncBatchNorm"):
        polydist_torch.distribute_module(nn.Sequential(Mine(4)), cpu_strategy(2))


def test_a_saved_module_is_torchs_own_again() -> None:
    """torch.save of the distributed module's layers (and deep copies) give back plain
    nn.SyncBatchNorm, which loads without polydist; the live layer keeps syncing."""
    import io

    model = polydist_torch.distribute_module(
        nn.Sequential(nn.Linear(3, 2), nn.SyncBatchNorm(2)), cpu_strategy(2)
    )
    layer = model.module[1]
    assert type(layer) is not nn.SyncBatchNorm and isinstance(layer, nn.SyncBatchNorm)
    buffer = io.BytesIO()
    torch.save(model.module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded[1]) is nn.SyncBatchNorm
    torch.testing.assert_close(loaded.state_dict(), model.state_dict())
    import copy

    assert type(copy.deepcopy(layer)) is nn.SyncBatchNorm
    assert type(layer) is not nn.SyncBatchNorm  # unchanged
