"""distribute_module / distribute_optimizer: one nn.Module and one torch.optim optimizer in run."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import polydist as pd
import polydist_torch
from polydist_torch import DistributedModule, DistributedOptimizer

# N-replica training sums per-replica gradients where one device computes the whole
# batch at once: only the float32 rounding differs (docs/frameworks/torch.md states it).
RTOL, ATOL = 1e-5, 1e-6

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def cpu_strategy(n: int) -> pd.Strategy:
    return pd.MirroredStrategy([f"/cpu:{i}" for i in range(n)], backend="torch")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def make_loader(examples: int = 33, batch: int = 8) -> DataLoader[Any]:
    # 33 examples in batches of 8: the last batch has one example, so with 3 or 4
    # replicas some replicas get none.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(examples, 6, generator=g)
    y = torch.randint(0, 3, (examples,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def per_example_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y, reduction="none")


def distributed_step(model: Any, opt: Any) -> Callable[..., Any]:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # The true global count, so a partial last batch is scaled right.
        loss = pd.nn.compute_average_loss_exact(per_example_loss(model, x, y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def optimizer_states_identical(opt: DistributedOptimizer) -> None:
    first = opt.replicas[0].state_dict()
    for other in opt.replicas[1:]:
        state = other.state_dict()
        assert state["param_groups"] == first["param_groups"]
        for k, per_param in first["state"].items():
            for name, value in per_param.items():
                assert torch.equal(state["state"][k][name], value), (k, name)


def reference_training(opt_name: str, epochs: int = 1) -> list[torch.Tensor]:
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    for _ in range(epochs):
        for x, y in make_loader():
            loss = per_example_loss(model, x, y).sum() / x.shape[0]
            loss.backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("replicas", [1, 3, 4])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_training_matches_single_device(replicas: int, opt_name: str) -> None:
    strategy = cpu_strategy(replicas)
    with strategy.scope():
        model = polydist_torch.distribute_module(make_model())
        opt = polydist_torch.distribute_optimizer(OPTIMIZERS[opt_name](model.parameters()))
    step = distributed_step(model, opt)
    losses = []
    for x, y in strategy.experimental_distribute_dataset(make_loader()):
        losses.append(strategy.reduce("SUM", strategy.run(step, args=(x, y)), axis=None))
        # After every step: every replica's weights and optimizer state bit for bit equal.
        assert pd.debugging.check_replicas_identical(strategy) == 4
        optimizer_states_identical(opt)
    assert len(losses) == 5
    expected = reference_training(opt_name)
    got = [p.detach() for p in model.parameters()]
    assert any(not torch.equal(p, q) for p, q in zip(got, make_model().parameters()))  # trained
    for p, q in zip(got, expected):
        if replicas == 1:
            assert torch.equal(p, q)  # one replica: the same arithmetic
        else:
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    for r, copy_r in enumerate(model.replicas):
        for p, q in zip(copy_r.parameters(), got):
            assert torch.equal(p, q), r


def test_variables_are_mirrored_and_named_by_state_dict_keys() -> None:
    strategy = cpu_strategy(2)
    with strategy.scope():
        model = polydist_torch.distribute_module(
            nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), name="net"
        )
    names = [v.name for v in model.variables]
    assert names == [
        "net/0.weight:0",
        "net/0.bias:0",
        "net/1.weight:0",
        "net/1.bias:0",
        "net/1.running_mean:0",
        "net/1.running_var:0",
        "net/1.num_batches_tracked:0",
    ]
    assert [v.name for v in model.trainable_variables] == names[:4]
    assert all(isinstance(v, pd.MirroredVariable) for v in model.variables[:4])
    assert all(isinstance(v, pd.SyncOnReadVariable) for v in model.variables[4:])
    assert [v.aggregation for v in model.variables[4:]] == [
        pd.VariableAggregation.MEAN,
        pd.VariableAggregation.MEAN,
        pd.VariableAggregation.ONLY_FIRST_REPLICA,
    ]
    # The copies are the variables' storage: a polydist write reaches every replica.
    w = model.variables[0]
    w.assign(torch.ones(4, 3))
    for m in model.replicas:
        assert torch.equal(m[0].weight.detach(), torch.ones(4, 3))
    assert model.replicas[0] is model.module


def test_batchnorm_buffers_are_sync_on_read_means() -> None:
    strategy = cpu_strategy(2)
    with strategy.scope():
        model = polydist_torch.distribute_module(nn.BatchNorm1d(2, momentum=1.0))
    x = pd.PerReplica(
        [torch.tensor([[0.0, 1.0], [2.0, 3.0]]), torch.tensor([[4.0, 5.0], [6.0, 9.0]])]
    )
    strategy.run(lambda x: model(x), args=(x,))
    # momentum=1: each replica's running mean is its own batch's mean.
    assert model.replicas[0].running_mean.tolist() == [1.0, 2.0]
    assert model.replicas[1].running_mean.tolist() == [5.0, 7.0]
    state = model.state_dict()
    assert state["running_mean"].tolist() == [3.0, 4.5]  # TF: the mean across replicas
    assert state["num_batches_tracked"].item() == 1
    assert set(state) == {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}
    # Outside run, evaluation uses the cross-replica statistics.
    model.eval()
    out = model(torch.tensor([[3.0, 4.5]]))
    assert torch.allclose(out, torch.zeros(1, 2), atol=1e-6)
    assert model.replicas[0].running_mean.tolist() == [1.0, 2.0]  # left as it was
    model.train()
    model(torch.tensor([[30.0, 40.0], [50.0, 60.0]]))  # outside run: updates nothing
    assert model.replicas[0].running_mean.tolist() == [1.0, 2.0]
    assert [int(m.num_batches_tracked) for m in model.replicas] == [1, 1]
    # Loading writes every replica.
    state["running_mean"] = torch.tensor([7.0, 8.0])
    model.load_state_dict(state)
    for m in model.replicas:
        assert m.running_mean.tolist() == [7.0, 8.0]
    assert model.variables[2].read_value().tolist() == [7.0, 8.0]
    # A polydist write replaces the stored tensor; the module follows it.
    model.variables[2].assign(torch.tensor([1.0, 1.0]))
    outs = strategy.run(lambda: model.running_mean.clone())
    assert [o.tolist() for o in outs.values] == [[1.0, 1.0], [1.0, 1.0]]


def test_state_dicts_restore_into_fresh_objects_bitwise() -> None:
    strategy = cpu_strategy(3)
    loader = list(make_loader())

    def build() -> tuple[DistributedModule, DistributedOptimizer]:
        with strategy.scope():
            m = polydist_torch.distribute_module(make_model())
            o = polydist_torch.distribute_optimizer(torch.optim.Adam(m.parameters(), lr=0.01))
        return m, o

    model, opt = build()
    step = distributed_step(model, opt)
    batches = list(strategy.experimental_distribute_dataset(loader))
    for x, y in batches[:2]:
        strategy.run(step, args=(x, y))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    strategy.run(step, args=batches[2])
    continued = [p.detach().clone() for p in model.parameters()]

    fresh_model, fresh_opt = build()
    buffer.seek(0)
    saved = torch.load(buffer)
    fresh_model.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["opt"])
    optimizer_states_identical(fresh_opt)
    strategy.run(distributed_step(fresh_model, fresh_opt), args=batches[2])
    for p, q in zip(fresh_model.parameters(), continued):
        assert torch.equal(p.detach(), q)
    pd.debugging.check_replicas_identical(strategy)
    optimizer_states_identical(fresh_opt)
    # torch's own format: the state loads into a plain module and optimizer too.
    plain = make_model()
    plain.load_state_dict(saved["model"])
    torch.optim.Adam(plain.parameters(), lr=0.01).load_state_dict(saved["opt"])


def test_polydist_checkpoint_restores_parameters_in_place(tmp_path: Any) -> None:
    strategy = cpu_strategy(2)
    with strategy.scope():
        model = polydist_torch.distribute_module(make_model())
    saved = [p.detach().clone() for p in model.parameters()]
    pd.checkpoint.save(tmp_path / "ckpt", strategy)
    with torch.no_grad():
        for m in model.replicas:
            for p in m.parameters():
                p.add_(1.0)
    pd.checkpoint.restore(tmp_path / "ckpt", strategy)
    for m in model.replicas:
        for p, q in zip(m.parameters(), saved):
            assert torch.equal(p.detach(), q)


def test_scheduler_and_clipping_reach_every_replica() -> None:
    def reference() -> list[torch.Tensor]:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for x, y in make_loader():
            (per_example_loss(model, x, y).sum() / x.shape[0]).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            opt.zero_grad()
            sched.step()
        return [p.detach() for p in model.parameters()]

    strategy = cpu_strategy(4)
    with strategy.scope():
        model = polydist_torch.distribute_module(make_model())
    opt = polydist_torch.distribute_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        pd.nn.compute_average_loss_exact(per_example_loss(model, x, y)).backward()
        opt.all_reduce_gradients()  # the global gradients, before clipping them
        nn.utils.clip_grad_norm_(model.parameters(), 0.1)  # this replica's copy
        opt.step()  # does not sum again
        opt.zero_grad()

    for x, y in strategy.experimental_distribute_dataset(make_loader()):
        strategy.run(step, args=(x, y))
        sched.step()
    # Copies take the hyperparameters at each step: the 5 steps used lr 0.5 ... 0.5 / 16.
    assert opt.param_groups[0]["lr"] == 0.5 / 32
    assert [r.param_groups[0]["lr"] for r in opt.replicas[1:]] == [0.5 / 16] * 3
    pd.debugging.check_replicas_identical(strategy)
    for p, q in zip(model.parameters(), reference()):
        torch.testing.assert_close(p.detach(), q, rtol=RTOL, atol=ATOL)


def test_clipping_before_the_sum_warns_once_and_keeps_tf_s_result() -> None:
    """DDP users clip after backward(), where DDP's gradients are already summed; here
    (and in TF) the clip then sees one replica's gradients: a LocalGradientWarning, once,
    and the step is TF's (each replica's clipped gradients summed)."""
    strategy = cpu_strategy(2)
    with strategy.scope():
        model = polydist_torch.distribute_module(nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        for m in model.replicas:
            m.weight.copy_(torch.tensor([[1.0, 1.0]]))
    opt = polydist_torch.distribute_optimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    # Replica 0's gradient is (3, 4) (norm 5), replica 1's (0, 0.5) (norm 0.5).
    inputs = strategy.experimental_distribute_values_from_function(
        lambda c: (
            torch.tensor([[3.0, 4.0]])
            if c.replica_id_in_sync_group == 0
            else torch.tensor([[0.0, 0.5]])
        )
    )

    def step(x: torch.Tensor) -> None:
        model(x).sum().backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # clips (3, 4) to (0.6, 0.8)
        opt.step()
        opt.zero_grad()

    with pytest.warns(polydist_torch.LocalGradientWarning, match="clip_grad_norm_") as caught:
        strategy.run(step, args=(inputs,))
    assert len(caught) == 1 and caught[0].filename == __file__
    # TF's result: the clipped (0.6, 0.8) plus the unclipped (0, 0.5), not the global
    # sum (3, 4.5) clipped to norm 1.
    for m in model.replicas:
        torch.testing.assert_close(m.weight.detach(), torch.tensor([[0.4, -0.3]]))
    strategy.run(step, args=(inputs,))  # once per optimizer: no second warning

    def fixed(x: torch.Tensor) -> None:
        model(x).sum().backward()
        opt.all_reduce_gradients()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    fresh = polydist_torch.distribute_optimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    opt = fresh
    strategy.run(fixed, args=(inputs,))  # no warning (filterwarnings = error)


def test_layers_frozen_through_replica_zero_stay_frozen_on_every_replica() -> None:
    """`for p in model.module[0].parameters(): p.requires_grad = False` outside run
    freezes replica 0's copy: the other replicas used to train the layer, and their
    summed gradients (3 of 4 parts) moved it on every replica."""

    def reference() -> list[torch.Tensor]:
        model = make_model()
        for p in model[0].parameters():
            p.requires_grad = False
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        for x, y in make_loader():
            (per_example_loss(model, x, y).sum() / x.shape[0]).backward()
            opt.step()
            opt.zero_grad()
        return [p.detach() for p in model.parameters()]

    strategy = cpu_strategy(4)
    with strategy.scope():
        model = polydist_torch.distribute_module(make_model())
    assert model[0] is model.module[0] and len(list(model)) == 3  # nn.Sequential's layers
    first = [p.detach().clone() for p in model[0].parameters()]
    for p in model[0].parameters():  # replica 0's copy: the usual idiom
        p.requires_grad = False
    assert [v.name for v in model.trainable_variables] == ["2.weight:0", "2.bias:0"]
    opt = polydist_torch.distribute_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    for x, y in strategy.experimental_distribute_dataset(make_loader()):
        strategy.run(distributed_step(model, opt), args=(x, y))
    for replica in model.replicas:
        for p, q in zip(replica[0].parameters(), first):
            assert not p.requires_grad and p.grad is None
            assert torch.equal(p.detach(), q)
    pd.debugging.check_replicas_identical(strategy)
    for p, q in zip(model.parameters(), reference()):
        torch.testing.assert_close(p.detach(), q, rtol=RTOL, atol=ATOL)

    # Unfrozen again through replica 0: every replica's gradient counts.
    for p in model.module[0].parameters():
        p.requires_grad = True
    strategy.run(
        distributed_step(model, opt),
        args=next(iter(strategy.experimental_distribute_dataset(make_loader()))),
    )
    assert not torch.equal(model.module[0].weight.detach(), first[0])
    pd.debugging.check_replicas_identical(strategy)


def test_layers_put_in_eval_mode_through_replica_zero_are_in_eval_mode_everywhere() -> None:
    """Fine-tuning idioms: BatchNorm frozen through `model.modules()` and a Dropout
    turned off through `model[2].eval()`, outside run, reach replica 0's copy; the other
    replicas kept training mode (batch statistics, random masks, running statistics
    updated), so the summed gradients and every buffer but replica 0's were wrong."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 3)
        )
        with torch.no_grad():  # running statistics of an earlier training
            model[1].running_mean.uniform_(-1.0, 1.0)
            model[1].running_var.uniform_(0.5, 2.0)
        return model

    def freeze(model: nn.Module) -> None:
        for m in model.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.eval()
        model[2].eval()

    reference = build()
    freeze(reference)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for x, y in make_loader():
        (per_example_loss(reference, x, y).sum() / x.shape[0]).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    strategy = cpu_strategy(4)
    with strategy.scope():
        model = polydist_torch.distribute_module(build())
    freeze(model)  # model.modules() and model[2] outside run: replica 0's copy
    opt = polydist_torch.distribute_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    for x, y in strategy.experimental_distribute_dataset(make_loader()):
        strategy.run(distributed_step(model, opt), args=(x, y))
    for replica in model.replicas:
        assert [m.training for m in replica] == [True, False, False, True]
        assert int(replica[1].num_batches_tracked) == 0  # no statistics updated
    pd.debugging.check_replicas_identical(strategy)
    got, want = model.state_dict(), reference.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=RTOL, atol=ATOL)
    model.train()  # every copy, every layer
    assert all(m.training for replica in model.replicas for m in replica.modules())


def test_ddp_s_model_module_and_modules_inside_run_are_the_replica_s_own_copy() -> None:
    """Code ported from DDP calls `model.module(x)` (or a method of it) in the step and
    walks `model.modules()`: inside run both reached replica 0's copy, so every replica
    computed with replica 0's weights and updated its BatchNorm statistics (4 updates
    per step there, none elsewhere; on GPUs, tensors on two devices)."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 3))

    def train(forward: Callable[[Any, torch.Tensor], torch.Tensor]) -> DistributedModule:
        strategy = cpu_strategy(4)
        with strategy.scope():
            model = polydist_torch.distribute_module(build())
        opt = polydist_torch.distribute_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            logits = forward(model, x)
            pd.nn.compute_average_loss_exact(
                F.cross_entropy(logits, y, reduction="none")
            ).backward()
            opt.step()
            opt.zero_grad()

        for x, y in strategy.experimental_distribute_dataset(make_loader(examples=32)):
            strategy.run(step, args=(x, y))
        return model

    plain = train(lambda model, x: model(x))
    ported = train(lambda model, x: model.module(x))
    for mine, theirs in zip(ported.replicas, plain.replicas):
        assert int(mine[1].num_batches_tracked) == 4  # its own 4 steps, on every replica
        for (key, a), b in zip(mine.state_dict().items(), theirs.state_dict().values()):
            assert torch.equal(a, b), key
    assert ported.module is ported.replicas[0]  # outside run: replica 0's copy

    strategy = ported.strategy
    seen = strategy.run(lambda: [m for m in ported.modules() if isinstance(m, nn.Linear)])
    for r, layers in enumerate(strategy.experimental_local_results(seen)):
        assert layers == [ported.replicas[r][0], ported.replicas[r][2]]
    children = strategy.run(lambda: list(ported.children()))
    assert strategy.experimental_local_results(children)[2] == [ported.replicas[2]]
    assert [name for name, _ in ported.named_modules()][:3] == ["", "module", "module.0"]

    def accumulate(x: torch.Tensor) -> None:
        with ported.no_sync():  # DDP's; nothing to skip here
            ported(x).sum().backward()

    with pytest.raises(AttributeError, match=r"no no_sync\(\).*drop the `with model.no_sync"):
        strategy.run(accumulate, args=(torch.randn(2, 6),))


@pytest.mark.parametrize("distributed", [False, True], ids=["list", "distribute_grad_scaler"])
@pytest.mark.parametrize("clip", [False, True], ids=["step", "unscale_clip_step"])
def test_grad_scalers_see_the_summed_gradients_and_skip_the_same_steps(
    clip: bool, distributed: bool
) -> None:
    """torch.amp's loop with one GradScaler per replica: a scaler unscales and checks the
    gradients summed across replicas (TF's LossScaleOptimizer aggregates first), so an
    inf on one replica's part of the batch skips the step on every replica, and a clip
    after unscale_ sees the global gradients, as on one device. Before, each replica
    checked its own gradients: the replica with the inf skipped the step (and its
    all_reduce) alone."""

    def batch(t: int, x: torch.Tensor) -> torch.Tensor:
        if t == 2:
            x = x.clone()
            x[-1, 0] = float("inf")  # the last example: the last replica's part
        return x

    def loop_step(
        model: Any, opt: Any, scaler: torch.amp.GradScaler, x: torch.Tensor, y: torch.Tensor
    ) -> None:
        loss = per_example_loss(model, x, y).sum() / 8
        scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    def make_scaler() -> torch.amp.GradScaler:
        return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)

    batches = list(make_loader(examples=32))
    reference = make_model()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    ref_scaler = make_scaler()
    for t, (x, y) in enumerate(batches):
        loop_step(reference, ref_opt, ref_scaler, batch(t, x), y)
    assert ref_scaler.get_scale() == 2.0**12  # 4 steps: grew 3 times, halved once

    strategy = cpu_strategy(4)
    with strategy.scope():
        model = polydist_torch.distribute_module(make_model())
    opt = polydist_torch.distribute_optimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    # One scaler per replica: by hand, or behind one object (torch.amp's loop unchanged).
    one = polydist_torch.distribute_grad_scaler(make_scaler(), strategy)
    scalers = list(one.replicas) if distributed else [make_scaler() for _ in range(4)]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        replica = int(pd.get_replica_context().replica_id_in_sync_group)
        loop_step(model, opt, one if distributed else scalers[replica], x, y)

    for t, (x, y) in enumerate(batches):
        dist = strategy.experimental_distribute_dataset([(batch(t, x), y)])
        strategy.run(step, args=next(iter(dist)))
    assert [s.get_scale() for s in scalers] == [ref_scaler.get_scale()] * 4
    assert one.get_scale() == (ref_scaler.get_scale() if distributed else 2.0**10)
    pd.debugging.check_replicas_identical(strategy)
    optimizer_states_identical(opt)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)

    shared = make_scaler()

    def shared_step(x: torch.Tensor, y: torch.Tensor) -> None:
        loop_step(model, opt, shared, x, y)

    x, y = batches[0]
    with pytest.raises(RuntimeError, match=r"used by replicas 0 and 1.*distribute_grad_scaler"):
        strategy.run(
            shared_step, args=next(iter(strategy.experimental_distribute_dataset([(x, y)])))
        )


def test_a_distributed_grad_scaler_is_one_object_outside_run(tmp_path: Path) -> None:
    """Outside run: reads are replica 0's, update/set_*/load_state_dict reach every copy,
    and a train.Checkpoint saves it and restores every copy (into another replica count)."""
    strategy = cpu_strategy(3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    with strategy.scope():
        one = polydist_torch.distribute_grad_scaler(scaler)
    assert one.replicas[0] is scaler and len(one.replicas) == 3
    assert repr(one).startswith("DistributedGradScaler(") and one.is_enabled()
    one.set_growth_factor(4.0)
    assert [s.get_growth_factor() for s in one.replicas] == [4.0] * 3
    assert one.get_growth_interval() == 1  # any other attribute: the scaler's own
    scaled = strategy.run(lambda: one.scale(torch.ones(())))  # each replica's scale made
    assert [float(v) for v in strategy.experimental_local_results(scaled)] == [2.0**8] * 3
    one.update(2.0**5)
    assert [s.get_scale() for s in one.replicas] == [2.0**5] * 3
    saved = one.state_dict()
    assert saved["scale"] == 2.0**5 and saved["growth_factor"] == 4.0
    one.load_state_dict({**saved, "scale": 2.0**3})
    assert [s.get_scale() for s in one.replicas] == [2.0**3] * 3

    inside = strategy.run(lambda: torch.tensor(one.get_scale()))
    assert [float(v) for v in strategy.experimental_local_results(inside)] == [2.0**3] * 3

    path = pd.train.Checkpoint(scaler=one).save(str(tmp_path / "ckpt"))
    other = polydist_torch.distribute_grad_scaler(torch.amp.GradScaler("cpu"), cpu_strategy(2))
    pd.train.Checkpoint(scaler=other).restore(path).assert_consumed()
    assert [s.get_scale() for s in other.replicas] == [2.0**3] * 2
    assert [s.get_growth_factor() for s in other.replicas] == [4.0] * 2

    with pytest.raises(TypeError, match="takes a torch.amp.GradScaler, got SGD"):
        polydist_torch.distribute_grad_scaler(torch.optim.SGD([torch.zeros(1)]), strategy)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="is already distributed"):
        polydist_torch.distribute_grad_scaler(one, strategy)  # type: ignore[arg-type]
    with pytest.raises(AttributeError, match="set it through the scaler's methods"):
        one._scale = None
    with pytest.raises(RuntimeError, match="needs a strategy"):
        polydist_torch.distribute_grad_scaler(torch.amp.GradScaler("cpu"))


@pytest.mark.parametrize(
    "make_scheduler",
    [
        lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch)),
        lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0),
    ],
    ids=["StepLR", "LambdaLR", "ReduceLROnPlateau"],
)
def test_a_scheduler_stepped_inside_run_raises(make_scheduler: Any) -> None:
    """Stepped in each replica, a scheduler advanced N times per training step (StepLR's
    last_epoch 8 after 2 steps on 4 replicas): a wrong learning rate, silently."""
    strategy = cpu_strategy(4)
    with strategy.scope():
        model = polydist_torch.distribute_module(make_model())
    opt = polydist_torch.distribute_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    sched = make_scheduler(opt)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        pd.nn.compute_average_loss_exact(per_example_loss(model, x, y)).backward()
        assert len(opt.param_groups[0]["params"]) == 4  # reading the groups is fine
        opt.step()
        opt.zero_grad()
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step(1.0)
        else:
            sched.step()

    x, y = next(iter(strategy.experimental_distribute_dataset(make_loader())))
    with pytest.raises(RuntimeError, match="scheduler .* ran inside strategy.run"):
        strategy.run(step, args=(x, y))
    assert [r.param_groups[0]["lr"] for r in opt.replicas] == [0.5] * 4  # none set


def test_one_replica_steps_without_a_collective() -> None:
    """At one replica in sync the gradients' sum is the gradients themselves: step() issues
    no all_reduce (issue 20: it copied every gradient in and out, about 5% of an MLP step)."""
    strategy = cpu_strategy(1)
    with strategy.scope():
        model = polydist_torch.distribute_module(make_model())
        opt = polydist_torch.distribute_optimizer(OPTIMIZERS["adam"](model.parameters()))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = per_example_loss(model, x, y).sum() / x.shape[0]  # one replica: the whole batch
        loss.backward()
        opt.step()
        opt.zero_grad()

    with pd.trace() as t:
        for x, y in strategy.experimental_distribute_dataset(make_loader()):
            strategy.run(step, args=(x, y))
    assert [e.op for e in t.events] == []
    expected = reference_training("adam")
    for p, q in zip(model.parameters(), expected):
        assert torch.equal(p.detach(), q)  # the same arithmetic as plain torch


def test_step_sums_flags_and_gradients_in_one_pack() -> None:
    """The has-gradient flags travel in the float gradients' pack: one collective (and,
    across workers, one check) per step, not a second one for int32 flags (issue 20)."""
    strategy = cpu_strategy(2)
    with strategy.scope():
        model = polydist_torch.distribute_module(make_model())
        opt = polydist_torch.distribute_optimizer(OPTIMIZERS["sgd"](model.parameters()))

    step = distributed_step(model, opt)
    with pd.trace() as t:
        for x, y in strategy.experimental_distribute_dataset(make_loader()):
            strategy.run(step, args=(x, y))
    reduced = [e for e in t.events if e.op == "all_reduce"]
    flags = (len(list(model.parameters())),)  # one per parameter
    assert [e for e in reduced if e.shape == flags and e.dtype == "float32"]
    assert not [e for e in reduced if e.shape == flags and e.dtype == "int32"]
    expected = reference_training("sgd")
    for p, q in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), q, rtol=RTOL, atol=ATOL)


def test_missing_gradients_count_as_zero_and_none_everywhere_is_skipped() -> None:
    strategy = cpu_strategy(2)
    with strategy.scope():
        model = polydist_torch.distribute_module(nn.ModuleList([nn.Linear(2, 1), nn.Linear(2, 1)]))
    opt = polydist_torch.distribute_optimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    before = [p.detach().clone() for p in model.parameters()]

    def step() -> None:
        ctx = pd.get_replica_context()
        assert ctx is not None
        first = model.replicas[ctx._replica_index][0]
        # Only replica 0 uses layer 0's weight; nobody uses layer 1.
        scale = 1.0 if ctx._replica_index == 0 else 0.0
        out = first(torch.ones(1, 2)).sum() * scale if scale else first.bias.sum()
        out.backward()
        opt.step()

    strategy.run(step)
    w0, b0, w1, b1 = model.parameters()
    assert torch.equal(w0.detach(), before[0] - 1.0)  # replica 0's gradient, replica 1's zero
    assert torch.equal(b0.detach(), before[1] - 2.0)  # both replicas: 1 + 1
    assert torch.equal(w1.detach(), before[2]) and torch.equal(b1.detach(), before[3])
    assert w1.grad is None
    pd.debugging.check_replicas_identical(strategy)


def test_bad_uses_raise_clear_errors() -> None:
    with pytest.raises(RuntimeError, match=r"strategy\.scope\(\)"):
        polydist_torch.distribute_module(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="torch backend"):
        polydist_torch.distribute_module(nn.Linear(2, 2), pd.MirroredStrategy(2, backend="sim"))
    strategy = cpu_strategy(2)
    with strategy.scope():
        model = polydist_torch.distribute_module(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="already distributed"):
        polydist_torch.distribute_module(model, strategy)
    with pytest.raises(ValueError, match="must be those of distributed modules"):
        polydist_torch.distribute_optimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1))
    with pytest.raises(ValueError, match="replica other than replica 0"):
        polydist_torch.distribute_optimizer(torch.optim.SGD(model.replicas[1].parameters(), lr=1.0))
    with pytest.raises(RuntimeError, match="before\npolydist_torch|before polydist_torch"):
        model.double()
    with pytest.raises(RuntimeError, match="initialize the module before"):
        model.apply(lambda m: None)
    opt = polydist_torch.distribute_optimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    with pytest.raises(RuntimeError, match="inside strategy.run"):
        opt.step()
    with pytest.raises(RuntimeError, match="outside strategy.run"):
        strategy.run(lambda: model.load_state_dict(model.replicas[0].state_dict()))
    with pytest.raises(RuntimeError, match="outside strategy.run"):
        strategy.run(lambda: polydist_torch.distribute_module(nn.Linear(2, 2)))
    other = cpu_strategy(2)
    with pytest.raises(RuntimeError, match="belongs to"):
        other.run(lambda: model(torch.ones(1, 2)))


def test_inside_run_parameters_and_zero_grad_are_the_replicas_own() -> None:
    strategy = cpu_strategy(2)
    with strategy.scope():
        model = polydist_torch.distribute_module(nn.Linear(2, 1))

    def fn() -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        mine = list(model.parameters())
        names = [n for n, _ in model.named_parameters()]
        own = list(model.replicas[ctx._replica_index].parameters())
        return torch.tensor(all(p is q for p, q in zip(mine, own))), names

    same, names = strategy.run(fn)
    assert [bool(s) for s in strategy.experimental_local_results(same)] == [True, True]
    assert [strategy.experimental_local_results(n) for n in names] == [
        ("module.weight",) * 2,
        ("module.bias",) * 2,
    ]
    for m in model.replicas:
        m.weight.grad = torch.ones(1, 2)
    strategy.run(lambda: model.zero_grad() if pd.get_replica_context()._replica_index else None)  # type: ignore[union-attr]
    assert model.replicas[0].weight.grad is not None and model.replicas[1].weight.grad is None
    model.zero_grad()
    assert model.replicas[0].weight.grad is None
    model.requires_grad_(False)
    assert not any(p.requires_grad for m in model.replicas for p in m.parameters())


def test_numpy_view_of_variables_matches_parameters() -> None:
    strategy = cpu_strategy(2)
    with strategy.scope():
        model = polydist_torch.distribute_module(nn.Linear(2, 2))
    for v, p in zip(model.variables, model.parameters()):
        np.testing.assert_array_equal(v.numpy(), p.detach().numpy())


@pytest.mark.skipif(sys.platform == "win32", reason="torchrun on POSIX")
@pytest.mark.parametrize("norm", ["", "sync_batch_norm"])
def test_multi_worker_training_matches_single_device(tmp_path: Path, norm: str) -> None:
    """2 worker processes x 2 replicas (torchrun, gloo): the workers' weights are
    bitwise equal, and equal single-device training up to float32 rounding. With an
    nn.SyncBatchNorm, its statistics span both workers' replicas (as one nn.BatchNorm1d
    of the whole batch; torch's own refuses CPU tensors under gloo)."""
    program = Path(__file__).resolve().parent / "mw_modules.py"
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "RANK", "WORLD_SIZE")}
    env.update(CUDA_VISIBLE_DEVICES="", TORCH_CPP_LOG_LEVEL="ERROR")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    done = subprocess.run(
        [*torchrun, "--nproc-per-node=2", str(program), str(tmp_path), *([norm] if norm else [])],
        env=env,
        timeout=300,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    workers = [torch.load(tmp_path / f"worker{w}.pt") for w in range(2)]
    linears = {"0.weight", "0.bias", "2.weight", "2.bias"}
    if norm:
        stats = {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}
        linears = {"0.weight", "3.weight", "3.bias"} | {f"1.{k}" for k in stats}
    assert workers[0].keys() == workers[1].keys() == linears
    for k, v in workers[0].items():
        assert torch.equal(v, workers[1][k]), k

    sys.path.insert(0, str(program.parent))
    try:
        import mw_modules
    finally:
        sys.path.remove(str(program.parent))
    model = mw_modules.make_model(nn.BatchNorm1d if norm else None)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for x, y in mw_modules.batches():
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(workers[0][k], v, rtol=RTOL, atol=ATOL)


def test_inside_run_param_groups_are_the_replicas_own() -> None:
    strategy = cpu_strategy(2)
    with strategy.scope():
        model = polydist_torch.distribute_module(nn.Linear(2, 1))
    opt = polydist_torch.distribute_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))

    def fn() -> torch.Tensor:
        ctx = pd.get_replica_context()
        assert ctx is not None
        mine = opt.param_groups[0]["params"]
        own = list(model.replicas[ctx._replica_index].parameters())
        return torch.tensor(all(p is q for p, q in zip(mine, own, strict=True)))

    assert [bool(v) for v in strategy.experimental_local_results(strategy.run(fn))] == [True] * 2
    assert opt.param_groups is opt.optimizer.param_groups  # outside run: replica 0's


def test_train_checkpoint_restores_model_and_optimizer_into_fresh_ones(tmp_path: Path) -> None:
    """polydist.train.Checkpoint(model=..., optimizer=...) with a CheckpointManager: restored
    into a fresh distributed model and optimizer, the next step is bitwise the original's."""
    from polydist.train import Checkpoint, CheckpointManager

    strategy = cpu_strategy(3)
    batches = list(strategy.experimental_distribute_dataset(list(make_loader())))

    def build() -> tuple[DistributedModule, DistributedOptimizer, Any]:
        with strategy.scope():
            m = polydist_torch.distribute_module(nn.Sequential(make_model(), nn.BatchNorm1d(3)))
            o = polydist_torch.distribute_optimizer(torch.optim.Adam(m.parameters(), lr=0.01))
        return m, o, Checkpoint(model=m, optimizer=o)

    model, opt, ckpt = build()
    manager = CheckpointManager(ckpt, tmp_path, max_to_keep=2)
    step = distributed_step(model, opt)
    for x, y in batches[:2]:
        strategy.run(step, args=(x, y))
    saved_at = manager.save()
    strategy.run(step, args=batches[2])
    continued = model.state_dict()

    fresh_model, fresh_opt, fresh_ckpt = build()
    assert manager.latest_checkpoint == saved_at
    fresh_ckpt.restore(manager.latest_checkpoint).assert_consumed()
    optimizer_states_identical(fresh_opt)
    assert int(fresh_opt.state_dict()["state"][0]["step"]) == 2
    strategy.run(distributed_step(fresh_model, fresh_opt), args=batches[2])
    restored = fresh_model.state_dict()
    assert continued.keys() == restored.keys()
    for k, v in continued.items():
        if "running" in k:
            # A sync-on-read buffer is saved as its mean over the replicas (TF's rule) and
            # restored into every replica: the mean after the next update is the same
            # arithmetic in another order.
            torch.testing.assert_close(restored[k], v, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(restored[k], v), k
    pd.debugging.check_replicas_identical(strategy)
    optimizer_states_identical(fresh_opt)
    # Into another replica count, and into a plain module and optimizer (no strategy).
    other = cpu_strategy(2)
    with other.scope():
        two = polydist_torch.distribute_module(nn.Sequential(make_model(), nn.BatchNorm1d(3)))
        two_opt = polydist_torch.distribute_optimizer(torch.optim.Adam(two.parameters()))
    Checkpoint(model=two, optimizer=two_opt).restore(saved_at).assert_consumed()
    plain = nn.Sequential(make_model(), nn.BatchNorm1d(3))
    plain_opt = torch.optim.Adam(plain.parameters())
    Checkpoint(model=plain, optimizer=plain_opt).restore(saved_at).assert_consumed()
    for k, v in plain.state_dict().items():
        for r in two.replicas:
            assert torch.equal(r.state_dict()[k], v), k
    assert two_opt.replicas[1].state_dict()["param_groups"][0]["lr"] == 0.01
    assert torch.equal(
        plain_opt.state_dict()["state"][0]["exp_avg"],
        two_opt.replicas[1].state_dict()["state"][0]["exp_avg"],
    )


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
        lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
        lambda ps: torch.optim.Adagrad(ps, lr=0.1),
        lambda ps: torch.optim.Adamax(ps, lr=0.01),
        lambda ps: torch.optim.NAdam(ps, lr=0.01),
        lambda ps: torch.optim.RAdam(ps, lr=0.01),
        lambda ps: torch.optim.Adadelta(ps),
        lambda ps: torch.optim.ASGD(ps, lr=0.01),
        lambda ps: torch.optim.Rprop(ps, lr=0.01),
        lambda ps: torch.optim.SGD(ps, lr=0.1, nesterov=True, momentum=0.9, foreach=False),
        lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True, foreach=True),
    ],
    ids=lambda f: "opt",
)
def test_every_torch_optimizer_keeps_replicas_identical(make_opt: Any) -> None:
    strategy = cpu_strategy(3)
    with strategy.scope():
        model = polydist_torch.distribute_module(make_model())
    opt = polydist_torch.distribute_optimizer(make_opt(model.parameters()))
    assert all(type(r) is type(opt.optimizer) for r in opt.replicas)
    assert all(r.defaults == opt.defaults for r in opt.replicas)
    step = distributed_step(model, opt)
    for x, y in list(strategy.experimental_distribute_dataset(make_loader()))[:3]:
        strategy.run(step, args=(x, y))
    pd.debugging.check_replicas_identical(strategy)
    optimizer_states_identical(opt)
    reference = make_model()
    ref_opt = make_opt(reference.parameters())
    for x, y in list(make_loader())[:3]:
        (per_example_loss(reference, x, y).sum() / x.shape[0]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)


class _UsersSGD(torch.optim.SGD):
    """A user's optimizer class: its own step runs in the replica's device scope."""

    def step(self, closure: Any = None) -> Any:
        return super().step(closure)


@pytest.mark.parametrize("replicas", [1, 2])
def test_torch_optimizers_step_outside_the_default_device_mode(
    monkeypatch: pytest.MonkeyPatch, replicas: int
) -> None:
    """Under the replica's default-device mode torch.optim would put the step counters it
    makes without device= (Adamax, NAdam, RAdam, ...) on a GPU replica's device, and read
    them with .item() at every step. A distributed optimizer steps torch's own optimizer
    classes outside the mode; a user's override keeps the replica's device scope."""
    import polydist_torch._backend as backend_module

    # CPU replicas push the mode, as GPU replicas do (their device is torch's default).
    monkeypatch.setattr(backend_module, "_default_device_is", lambda device: False)
    strategy = cpu_strategy(replicas)
    with strategy.scope():
        model = polydist_torch.distribute_module(make_model())
        opt = polydist_torch.distribute_optimizer(torch.optim.Adamax(model.parameters()))
        users_model = polydist_torch.distribute_module(make_model())
        users_opt = polydist_torch.distribute_optimizer(_UsersSGD(users_model.parameters(), 0.1))
    depths: dict[str, list[int]] = {"torch": [], "users": []}
    for name, wrapped in (("torch", opt), ("users", users_opt)):
        for inner in wrapped.replicas:
            inner.register_step_pre_hook(
                lambda *_, name=name: depths[name].append(torch._C._len_torch_function_stack())
            )

    in_fn: list[int] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        for m, o in ((model, opt), (users_model, users_opt)):
            pd.nn.compute_average_loss_exact(per_example_loss(m, x, y)).backward()
            o.step()
            o.zero_grad()
        in_fn.append(torch._C._len_torch_function_stack())

    x, y = next(iter(make_loader(examples=8)))
    strategy.run(step, args=(x, y))
    assert in_fn == [1] * replicas
    assert depths["torch"] == [0] * replicas
    # Once per step, or twice where torch has wrapped SGD.step too (an SGD made before in
    # this process): the override's super().step() runs the hooks again, in the scope.
    assert set(depths["users"]) == {1} and len(depths["users"]) in (replicas, 2 * replicas)
    for inner in opt.replicas:
        assert {str(v.device) for s in inner.state.values() for v in s.values()} == {"cpu"}


def test_gradients_added_to_a_sum_raise_and_zeroed_ones_are_summed_again() -> None:
    """After the gradients were summed and neither stepped nor zeroed through the optimizer
    (all_reduce_gradients() to look at them, or a step a GradScaler skipped): zeroed by
    model.zero_grad(), the next backward's gradients are summed again (they were left
    unsummed, each replica stepping its own); added to the sum, the next sum raises."""
    x, y = next(iter(make_loader(examples=16, batch=16)))
    first, second = (x[:8], y[:8]), (x[8:], y[8:])
    reference = make_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    per_example_loss(reference, *second).mean().backward()
    ref_opt.step()

    strategy = cpu_strategy(2)
    with strategy.scope():
        model = polydist_torch.distribute_module(make_model())
    opt = polydist_torch.distribute_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))

    def look_then_train(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> None:
        pd.nn.compute_average_loss(per_example_loss(model, a, b)).backward()
        opt.all_reduce_gradients()  # e.g. to log the global gradient norm
        model.zero_grad()
        pd.nn.compute_average_loss(per_example_loss(model, c, d)).backward()
        opt.step()
        opt.zero_grad()

    def split(t: torch.Tensor) -> Any:
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: t.chunk(2)[ctx.replica_id_in_sync_group]
        )

    strategy.run(look_then_train, args=tuple(split(t) for t in (*first, *second)))
    assert pd.debugging.check_replicas_identical(strategy) == 4
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)

    def accumulate_onto_the_sum(a: torch.Tensor, b: torch.Tensor) -> None:
        pd.nn.compute_average_loss(per_example_loss(model, a, b)).backward()
        opt.all_reduce_gradients()
        pd.nn.compute_average_loss(per_example_loss(model, a, b)).backward()
        opt.step()

    with pytest.raises(RuntimeError, match=r"backward\(\) added to gradients that were already"):
        strategy.run(accumulate_onto_the_sum, args=(split(x), split(y)))
    opt.zero_grad()  # clears it: the next step is an ordinary one
    strategy.run(distributed_step(model, opt), args=(split(x), split(y)))
    assert pd.debugging.check_replicas_identical(strategy) == 4
