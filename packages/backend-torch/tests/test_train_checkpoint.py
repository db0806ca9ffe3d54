"""polydist.train.Checkpoint with real torch modules and optimizers (issue 19 item 3):
state_dict()/load_state_dict() objects, duck-typed by core, restored bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from polydist.checkpoint import CheckpointMismatchError
from polydist.train import Checkpoint, CheckpointManager


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.norm = torch.nn.BatchNorm1d(3)
        self.out = torch.nn.Linear(3, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.fc(x))))


def make(seed: int) -> tuple[Net, torch.optim.Adam]:
    torch.manual_seed(seed)
    net = Net()
    return net, torch.optim.Adam(net.parameters(), lr=0.01, betas=(0.8, 0.95))


def step(net: Net, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.step()


def weights(net: Net) -> dict[str, bytes]:
    return {k: v.detach().numpy().tobytes() for k, v in net.state_dict().items()}


def test_module_and_adam_restore_bit_for_bit(tmp_path: Path) -> None:
    net, opt = make(0)
    for s in range(3):
        step(net, opt, s)
    manager = CheckpointManager(Checkpoint(model=net, optimizer=opt), tmp_path, max_to_keep=2)
    path = manager.save()
    assert path is not None
    names = sorted(load_file(Path(path) / "tensors.safetensors"))
    assert "model/fc.weight" in names and "model/norm.running_mean" in names
    assert "optimizer/state/0/exp_avg" in names and "optimizer/state/0/step" in names
    meta = json.loads((Path(path) / "manifest.json").read_text())["metadata"]
    assert "optimizer" in meta["polydist_checkpoint"]["state_dicts"]

    # a fresh module and optimizer (another seed: other weights, an empty Adam state)
    net2, opt2 = make(1)
    restored = CheckpointManager(Checkpoint(model=net2, optimizer=opt2), tmp_path, max_to_keep=2)
    assert restored.restore_or_initialize() == path
    assert weights(net2) == weights(net)
    state, state2 = opt.state_dict(), opt2.state_dict()
    assert state2["param_groups"] == state["param_groups"]  # betas a tuple, lr, ...
    assert isinstance(state2["param_groups"][0]["betas"], tuple)
    for i, s in state["state"].items():
        for k, t in s.items():
            assert torch.equal(state2["state"][i][k], t), (i, k)
            assert state2["state"][i][k].dtype == t.dtype
    # the next step gives bitwise-equal weights
    step(net, opt, 10)
    step(net2, opt2, 10)
    assert weights(net2) == weights(net)


def test_bfloat16_module(tmp_path: Path) -> None:
    pytest.importorskip("ml_dtypes")
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2).to(torch.bfloat16)
    path = Checkpoint(model=net).save(tmp_path / "ckpt")
    stored = load_file(Path(path) / "tensors.safetensors")
    assert str(stored["model/weight"].dtype) == "bfloat16"
    other = torch.nn.Linear(3, 2).to(torch.bfloat16)
    Checkpoint(model=other).restore(path).assert_consumed()
    assert torch.equal(other.weight.view(torch.int16), net.weight.view(torch.int16))


def test_a_mismatched_module_changes_nothing(tmp_path: Path) -> None:
    net, _ = make(0)
    path = Checkpoint(model=net).save(tmp_path / "ckpt")
    wider = torch.nn.Sequential(torch.nn.Linear(4, 5))
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match="not in the checkpoint"):
        Checkpoint(model=wider).restore(path)
    for k, v in wider.state_dict().items():
        assert torch.equal(v, before[k])
    other, _ = make(2)
    other.fc = torch.nn.Linear(4, 3, bias=True)
    with torch.no_grad():
        other.fc.weight.zero_()
    other.out = torch.nn.Linear(3, 7, bias=False)  # another shape
    with pytest.raises(CheckpointMismatchError, match=r"'model/out.weight' is float32\[7, 3\]"):
        Checkpoint(model=other).restore(path)
    assert float(other.fc.weight.detach().abs().sum()) == 0.0  # unchanged
    assert np.isfinite(float(net.fc.weight.detach().sum()))


def test_an_optimizer_of_other_parameter_groups_changes_nothing(tmp_path: Path) -> None:
    import polydist as pd

    net, opt = make(0)
    step(net, opt, 0)
    v = pd.Variable(np.float32(5.0), name="v")
    path = Checkpoint(model=net, optimizer=opt, v=v).save(tmp_path / "ckpt")
    net2, _ = make(1)
    fewer = torch.optim.Adam(list(net2.parameters())[:2])
    v2 = pd.Variable(np.float32(0.0), name="v")
    before = weights(net2)
    with pytest.raises(CheckpointMismatchError, match=r"parameter groups of sizes \[2\].*\[5\]"):
        Checkpoint(model=net2, optimizer=fewer, v=v2).restore(path)
    assert weights(net2) == before and float(v2.numpy()) == 0.0


# An optimizer's saved state replaces its current one, as torch's load_state_dict does
# (per-parameter state on one side only is no mismatch).


def torch_reference(saved_net: dict[str, bytes], net_state: dict, opt_state: dict) -> Net:
    """A fresh Net and Adam loaded with torch's own load_state_dict (the reference)."""
    ref, ref_opt = make(7)
    ref.load_state_dict(net_state)
    ref_opt.load_state_dict(opt_state)
    assert weights(ref) == saved_net
    step(ref, ref_opt, 20)
    return ref


def test_rollback_to_a_checkpoint_saved_before_the_first_step(tmp_path: Path) -> None:
    import copy

    net, opt = make(0)
    checkpoint = Checkpoint(model=net, optimizer=opt)
    p0 = CheckpointManager(checkpoint, tmp_path, max_to_keep=5).save()
    saved = weights(net)
    net_state, opt_state = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
    assert opt_state["state"] == {}
    for s in range(2):
        step(net, opt, s)
    assert opt.state_dict()["state"]
    checkpoint.restore(p0).assert_consumed()
    assert weights(net) == saved and opt.state_dict()["state"] == {}
    step(net, opt, 20)
    assert weights(net) == weights(torch_reference(saved, net_state, opt_state))


@pytest.mark.parametrize("live_has_more", [True, False])
def test_optimizer_state_over_other_parameters_restores(
    tmp_path: Path, live_has_more: bool
) -> None:
    """The saved Adam state covers other parameters than the live one (a parameter that
    had no gradient yet on one side): restored as torch's load_state_dict restores it."""
    import copy

    def partial_step(net: Net, opt: torch.optim.Optimizer) -> None:
        net.out.weight.requires_grad_(False)  # no gradient: no Adam state for it
        step(net, opt, 3)
        net.out.weight.requires_grad_(True)

    net, opt = make(0)
    if live_has_more:
        partial_step(net, opt)  # the saved state lacks out.weight's
    else:
        step(net, opt, 3)
    checkpoint = Checkpoint(model=net, optimizer=opt)
    path = checkpoint.save(tmp_path / "ckpt")
    saved = weights(net)
    net_state, opt_state = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
    if live_has_more:
        step(net, opt, 4)  # now every parameter has state
    else:
        net, opt = make(1)
        partial_step(net, opt)  # the live state lacks out.weight's
        checkpoint = Checkpoint(model=net, optimizer=opt)
    assert len(opt.state_dict()["state"]) != len(opt_state["state"])
    checkpoint.restore(path).assert_consumed()
    assert weights(net) == saved
    assert sorted(opt.state_dict()["state"]) == sorted(opt_state["state"])
    step(net, opt, 20)
    assert weights(net) == weights(torch_reference(saved, net_state, opt_state))


def test_distributed_rollback_to_a_checkpoint_saved_before_the_first_step(
    tmp_path: Path, cpu_only: None
) -> None:
    import copy

    import polydist as pd
    import polydist_torch

    torch.manual_seed(0)
    base = torch.nn.Linear(3, 2)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, 3, generator=g) for _ in range(3)]

    def build() -> tuple[pd.Strategy, torch.nn.Module, torch.optim.Optimizer]:
        strategy = pd.MirroredStrategy(["/cpu:0", "/cpu:1"], backend="torch")
        with strategy.scope():
            model = polydist_torch.distribute_module(copy.deepcopy(base))
            opt = polydist_torch.distribute_optimizer(torch.optim.Adam(model.parameters(), lr=0.1))
        return strategy, model, opt

    def train(
        strategy: pd.Strategy, model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor
    ) -> None:
        def replica_step(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).pow(2).sum() / 8
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        strategy.run(replica_step, args=(pd.PerReplica([x[:4], x[4:]]),))

    strategy, model, opt = build()
    checkpoint = Checkpoint(model=model, optimizer=opt)
    p0 = CheckpointManager(checkpoint, tmp_path, max_to_keep=5).save()
    for x in batches[:2]:
        train(strategy, model, opt, x)
    checkpoint.restore(p0).assert_consumed()
    assert all(not r.state for r in opt.replicas)  # every replica's state replaced
    train(strategy, model, opt, batches[2])
    fresh_strategy, fresh, fresh_opt = build()  # never trained: the step-0 state
    train(fresh_strategy, fresh, fresh_opt, batches[2])
    for k, v in fresh.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    pd.debugging.check_replicas_identical(strategy)


# A DistributedOptimizer checks saved per-parameter state against its parameters before
# loading any copy: torch's own load_state_dict casts it and fails at a later step() (or
# broadcasts silently), fresh optimizer or not.

OTHER_STATE = {
    "adam": (lambda ps: torch.optim.Adam(ps, lr=0.1), "exp_avg"),
    "sgd-momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "momentum_buffer"),
}


def distributed(
    strategy: object, in_features: int, name: str
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import polydist_torch

    torch.manual_seed(in_features)
    with strategy.scope():  # type: ignore[attr-defined]
        model = polydist_torch.distribute_module(torch.nn.Linear(in_features, 3))
        opt = polydist_torch.distribute_optimizer(OTHER_STATE[name][0](model.parameters()))
    return model, opt


def train_once(strategy: object, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    import polydist as pd

    n = model.in_features  # type: ignore[union-attr]

    def replica_step(x: torch.Tensor) -> None:
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()

    x = torch.ones(4, n)
    strategy.run(replica_step, args=(pd.PerReplica([x[:2], x[2:]]),))  # type: ignore[attr-defined]


def states(opt: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    return [
        {f"{i}/{k}": v.clone() for i, s in enumerate(r.state.values()) for k, v in s.items()}
        for r in opt.replicas  # type: ignore[attr-defined]
    ]


@pytest.mark.parametrize("name", sorted(OTHER_STATE))
@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "with-state"])
def test_distributed_optimizer_refuses_state_of_other_parameters(
    cpu_only: None, name: str, stepped: bool
) -> None:
    import polydist as pd

    strategy = pd.MirroredStrategy(["/cpu:0", "/cpu:1"], backend="torch")
    small, small_opt = distributed(strategy, 4, name)
    train_once(strategy, small, small_opt)
    saved = small_opt.state_dict()
    key = OTHER_STATE[name][1]
    assert list(saved["state"][0][key].shape) == [3, 4]

    # torch's own optimizer takes it without a word (the defect being guarded against)
    plain = OTHER_STATE[name][0](torch.nn.Linear(5, 3).parameters())
    plain.load_state_dict(saved)
    assert list(plain.state_dict()["state"][0][key].shape) == [3, 4]

    wide, wide_opt = distributed(strategy, 5, name)
    if stepped:
        train_once(strategy, wide, wide_opt)
    before = states(wide_opt)
    assert len(before[0]) == (6 if name == "adam" else 2) * stepped  # per parameter: 3 or 1
    expected = f"its current '{key}'" if stepped else "the parameter"
    with pytest.raises(CheckpointMismatchError) as raised:
        wide_opt.load_state_dict(saved)
    message = str(raised.value)
    assert (
        f"parameter 0 (group 0, shape [3, 5]): the saved '{key}' has shape [3, 4], "
        f"expected [3, 5] ({expected})"
    ) in message
    assert "parameter 1" not in message  # the biases have the same shape, [3]
    assert "Nothing was loaded" in message
    after = states(wide_opt)
    assert [sorted(s) for s in after] == [sorted(s) for s in before]
    for a, b in zip(after, before, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_restore_of_other_optimizer_state_changes_nothing(
    tmp_path: Path, cpu_only: None
) -> None:
    import polydist as pd

    strategy = pd.MirroredStrategy(["/cpu:0", "/cpu:1"], backend="torch")
    small, small_opt = distributed(strategy, 4, "adam")
    train_once(strategy, small, small_opt)
    wide, _ = distributed(strategy, 5, "adam")
    # The model fits the one restored into; the optimizer state is of the small model.
    path = Checkpoint(model=wide, optimizer=small_opt).save(tmp_path / "ckpt")
    target, target_opt = distributed(strategy, 5, "adam")
    with torch.no_grad():
        target.weight.zero_()  # type: ignore[operator]
    with pytest.raises(CheckpointMismatchError, match=r"saved 'exp_avg' has shape \[3, 4\]"):
        Checkpoint(model=target, optimizer=target_opt).restore(path)
    assert float(target.weight.detach().abs().sum()) == 0.0  # type: ignore[operator]
    assert all(not r.state for r in target_opt.replicas)  # type: ignore[attr-defined]
