"""``DistributedOptimizer``'s gradient bucket (DDP's ``gradient_as_bucket_view``) in one
process, on a stand-in for the engine's in-place all-reduce: two workers that hold the same
gradients, so the sum doubles them and every has-gradient flag sums to 2.

The real engine (two gloo worker processes) runs the same code in
``test_multi_worker_fast_path.py``; here each rule of the bucket's bookkeeping is checked
against plain torch: ``zero_grad()`` zeroes the buffer in one call and the hooks hand its
tensors out as they are, so a tensor the program still holds, a gradient cleared by hand
between two ``backward()`` calls, a parameter without a gradient and a parameter that
changed dtype must each still get torch's values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

import polydist as pd
import polydist_torch
from polydist_torch import TorchBackend
from polydist_torch import _modules as modules
from polydist_torch._modules import _GradientBucket


class _TwoSameWorkers:
    """``TorchProcessGroupBackend.all_reduce_bucket_`` of two workers holding the same
    bucket: the sum is twice this one (flags and presence flag included)."""

    def __init__(self) -> None:
        self.calls = 0

    def all_reduce_bucket_(
        self, flat: torch.Tensor, parts: Sequence[tuple[int, ...]], marks: torch.Tensor
    ) -> list[float]:
        assert not torch.is_grad_enabled()  # the bucket is summed outside autograd
        assert marks.tolist() == [1.0] * marks.numel() or 0.0 in marks.tolist()
        self.calls += 1
        flat.mul_(2)
        summed: list[float] = marks.tolist()
        return summed


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(3, 4)
        self.out = nn.Linear(4, 1)
        self.unused = nn.Linear(2, 2)  # never in the forward: no gradient anywhere

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))  # type: ignore[no-any-return]


def _nets() -> tuple[Net, Net]:
    torch.manual_seed(0)
    net = Net()
    plain = Net()
    plain.load_state_dict(net.state_dict())
    return net, plain


def _bucket(net: nn.Module) -> tuple[_GradientBucket, list[torch.Tensor]]:
    params = list(net.parameters())
    parts = [tuple(p.shape) for p in params] + [(len(params),)]
    return _GradientBucket(_TwoSameWorkers(), params, parts, 2), params


def _sum(bucket: _GradientBucket, params: list[torch.Tensor]) -> None:
    """What ``DistributedOptimizer.step()`` does before the wrapped optimizer's step."""
    with torch.no_grad():
        bucket.sum(params)


def _zero_grad(bucket: _GradientBucket, params: list[torch.Tensor]) -> None:
    """What ``DistributedOptimizer.zero_grad()`` does with a bucket."""
    for p in params:
        p.grad = None
    bucket.clear()


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 3, generator=g), torch.randn(5, 1, generator=g)


def _backward(net: nn.Module, seed: int) -> None:
    x, y = _data(seed)
    ((net(x) - y) ** 2).sum().backward()


def _doubled(plain: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else 2 * p.grad for p in plain.parameters()]


def _assert_grads(params: list[torch.Tensor], expected: list[torch.Tensor | None]) -> None:
    for i, (p, e) in enumerate(zip(params, expected, strict=True)):
        if e is None:
            assert p.grad is None, i
        else:
            assert p.grad is not None, i
            assert torch.equal(p.grad, e), (i, p.grad, e)


def test_each_step_sums_its_own_gradients_in_the_same_memory() -> None:
    """zero_grad() zeroes the buffer in one call; the next backward() accumulates into its
    tensors as handed out, and step() sums them in place: p.grad is the bucket's tensor,
    the memory is the same at every step (nothing else holds it), and the sums are this
    step's alone."""
    net, plain = _nets()
    bucket, params = _bucket(net)
    memory = bucket.flat.data_ptr()
    for step in range(4):
        _zero_grad(bucket, params)
        assert bucket.zeroed == [True] * len(params)
        plain.zero_grad()
        _backward(net, step)
        _backward(plain, step)
        if step:
            assert all(p.grad is g for p, g in zip(params[:4], bucket.grads))
        _sum(bucket, params)
        _assert_grads(params, _doubled(plain))
        assert all(p.grad is g for p, g in zip(params[:4], bucket.grads))
        assert bucket.flat.data_ptr() == memory, step
    assert bucket.backend.calls == 4


def test_two_backward_passes_accumulate_before_the_step() -> None:
    net, plain = _nets()
    bucket, params = _bucket(net)
    for step in range(2):
        _zero_grad(bucket, params)
        plain.zero_grad()
        for seed in (10 * step, 10 * step + 1):
            _backward(net, seed)
            _backward(plain, seed)
        _sum(bucket, params)
        _assert_grads(params, _doubled(plain))


def test_a_gradient_cleared_by_hand_between_backward_passes_starts_from_zero() -> None:
    """The buffer was zeroed at zero_grad(), but parameter 0's tensor took the first
    backward's gradient: handed out again after ``p.grad = None``, it is zeroed first."""
    net, plain = _nets()
    bucket, params = _bucket(net)
    for step in range(2):
        _zero_grad(bucket, params)
        plain.zero_grad()
        _backward(net, 2 * step)
        _backward(plain, 2 * step)
        params[0].grad = None
        next(plain.parameters()).grad = None
        _backward(net, 2 * step + 1)
        _backward(plain, 2 * step + 1)
        _sum(bucket, params)
        _assert_grads(params, _doubled(plain))


def test_a_gradient_the_program_keeps_keeps_its_values() -> None:
    """A summed gradient kept past zero_grad() is not zeroed by it, nor overwritten by the
    next steps: the buffer takes fresh memory instead."""
    net, plain = _nets()
    bucket, params = _bucket(net)
    _zero_grad(bucket, params)
    _backward(net, 0)
    _sum(bucket, params)
    kept = params[0].grad
    assert kept is not None
    value = kept.clone()
    memory = bucket.flat.data_ptr()
    for step in (1, 2):
        _zero_grad(bucket, params)
        plain.zero_grad()
        _backward(net, step)
        _backward(plain, step)
        _sum(bucket, params)
        _assert_grads(params, _doubled(plain))
        assert torch.equal(kept, value), step
    assert bucket.flat.data_ptr() != memory


def test_autograd_grad_leaves_no_gradient_behind() -> None:
    """torch.autograd.grad runs the hooks but accumulates nothing: step() finds the
    handed-out tensors untouched and gives those parameters no gradient."""
    net, _ = _nets()
    bucket, params = _bucket(net)
    _zero_grad(bucket, params)
    x, y = _data(0)
    torch.autograd.grad(((net(x) - y) ** 2).sum(), params[:4])
    _sum(bucket, params)
    _assert_grads(params, [None] * len(params))


def test_a_parameter_that_changed_dtype_gets_autogradss_gradient() -> None:
    """After ``p.data = p.data.double()`` the bucket's float32 tensor cannot be that
    parameter's gradient (torch refuses it): the hook leaves autograd's float64 gradient,
    and the bucket no longer fits the parameters (the optimizer rebuilds it)."""
    net, plain = _nets()
    bucket, params = _bucket(net)
    for module in (net, plain):
        for p in module.parameters():
            p.data = p.data.double()
    _zero_grad(bucket, params)
    x, y = _data(0)
    ((net(x.double()) - y.double()) ** 2).sum().backward()
    ((plain(x.double()) - y.double()) ** 2).sum().backward()
    _assert_grads(params, [p.grad for p in plain.parameters()])
    assert all(p.grad is None or p.grad.dtype == torch.float64 for p in params)
    assert not bucket.fits(params)


# -- the optimizer's own zero_grad() and step() on the bucket ----------------------------


@pytest.fixture
def bucketed(monkeypatch: pytest.MonkeyPatch) -> Callable[[], tuple[pd.Strategy, Any, Any]]:
    """A one-replica strategy's distributed model and optimizer whose optimizer sums in a
    bucket on `_TwoSameWorkers`, as with one replica per worker process."""

    def build(strategy: pd.Strategy, params: list[torch.Tensor]) -> _GradientBucket:
        parts = [tuple(p.shape) for p in params] + [(len(params),)]
        return _GradientBucket(_TwoSameWorkers(), list(params), parts, 2)

    monkeypatch.setattr(_GradientBucket, "build", staticmethod(build))

    def make() -> tuple[pd.Strategy, Any, Any]:
        strategy = pd.MirroredStrategy(["/cpu:0"], backend=TorchBackend())
        torch.manual_seed(0)
        with strategy.scope():
            model = polydist_torch.distribute_module(Net())
        opt = polydist_torch.distribute_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
        opt._alone = False  # sum as a worker process's one replica does
        return strategy, model, opt

    return make


def test_the_optimizers_steps_match_plain_torch(
    bucketed: Callable[[], tuple[pd.Strategy, Any, Any]],
) -> None:
    """``backward()``, ``step()``, ``zero_grad()`` in strategy.run: each step is plain
    SGD on twice the gradients, the unused parameter keeps no gradient, and the
    bucket's memory is reused (p.grad is its tensor)."""
    strategy, model, opt = bucketed()
    plain = Net()
    plain.load_state_dict(model.state_dict())
    reference = torch.optim.SGD(plain.parameters(), lr=0.5)
    seen: list[tuple[bool, bool, int]] = []

    def step(seed: int) -> None:
        _backward(model, seed)
        used = list(model.parameters())[:4]  # the unused layer's stay None
        bucket = opt._bucket
        before = bucket is not None and all(p.grad is g for p, g in zip(used, bucket.grads))
        opt.step()
        after = all(p.grad is g for p, g in zip(used, opt._bucket.grads))
        seen.append((before, after, opt._bucket.flat.data_ptr()))
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())

    for seed in range(3):
        strategy.run(step, args=(seed,))
        _backward(plain, seed)
        for p in plain.parameters():
            if p.grad is not None:
                p.grad.mul_(2)
        reference.step()
        reference.zero_grad()
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.detach(), q.detach()), seed
    # The first step built the bucket after backward() (autograd's gradients copied in);
    # then backward() accumulated into the bucket's tensors, in the same memory.
    memory = seen[0][2]
    assert seen == [(False, True, memory), (True, True, memory), (True, True, memory)]
    assert model.unused.weight.grad is None
    assert opt._bucket.zeroed == [True] * 6


def test_zero_grad_runs_torchs_own_under_the_profiler(
    bucketed: Callable[[], tuple[pd.Strategy, Any, Any]],
) -> None:
    """Without a profiler zero_grad() sets every p.grad to None itself (torch's
    ``zero_grad(set_to_none=True)`` without its profiler range); under one, torch's own
    runs (its range is recorded); an optimizer that overrides zero_grad gets its own."""
    strategy, model, opt = bucketed()

    def step() -> None:
        _backward(model, 0)
        opt.step()

    strategy.run(step)
    # acc_events: where CUDA is profiled too, torch warns about clearing events otherwise.
    with torch.profiler.profile(acc_events=True) as prof:
        opt.zero_grad()
    names = [e.name for e in prof.events()]
    assert any(name.startswith("Optimizer.zero_grad#SGD.zero_grad") for name in names), names
    assert all(p.grad is None for p in model.parameters())
    assert opt._bucket.zeroed == [True] * 6

    calls: list[bool] = []

    class Counting(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            calls.append(set_to_none)
            super().zero_grad(set_to_none)

    strategy, model, opt = bucketed()
    counting = Counting(model.parameters(), lr=0.5)
    opt = polydist_torch.distribute_optimizer(counting)
    opt._alone = False
    strategy.run(step)
    opt.zero_grad()
    assert calls == [True]
    assert all(p.grad is None for p in model.parameters())


def test_zero_grad_set_to_none_false_keeps_the_buckets_tensors(
    bucketed: Callable[[], tuple[pd.Strategy, Any, Any]],
) -> None:
    """``zero_grad(set_to_none=False)`` is torch's: the bucket's tensors stay p.grad,
    zeroed in place, and the next step accumulates into them."""
    strategy, model, opt = bucketed()
    plain = Net()
    plain.load_state_dict(model.state_dict())

    def step(seed: int) -> list[torch.Tensor | None]:
        opt.zero_grad(set_to_none=False)
        before = [p.grad for p in model.parameters()]
        _backward(model, seed)
        opt.all_reduce_gradients()
        assert all(p.grad is b for p, b in zip(model.parameters(), before) if b is not None)
        return [None if p.grad is None else p.grad.clone() for p in model.parameters()]

    for seed in range(3):
        got = strategy.experimental_local_results(strategy.run(step, args=(seed,)))[0]
        plain.zero_grad(set_to_none=False)
        _backward(plain, seed)
        for g, p in zip(got, plain.parameters(), strict=True):
            if p.grad is None:
                assert g is None
            else:
                assert torch.equal(g, 2 * p.grad), seed
    assert isinstance(opt._bucket, _GradientBucket)
    assert modules._TORCH_ZERO_GRAD is torch.optim.Optimizer.zero_grad


class Mixed(nn.Module):
    """float32 and float64 parameters: no one bucket holds them."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(3, 4)
        self.out = nn.Linear(4, 1).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)).double()).float()  # type: ignore[no-any-return]


def test_mixed_dtypes_sum_through_the_general_path() -> None:
    """The step's one-replica path falls back to ``ctx.all_reduce`` of the gradients where
    no bucket can hold them (mixed dtypes): here a strategy of one replica, made to sum
    as a worker's one replica does, so the sums are the gradients themselves."""
    strategy = pd.MirroredStrategy(["/cpu:0"], backend=TorchBackend())
    torch.manual_seed(0)
    with strategy.scope():
        model = polydist_torch.distribute_module(Mixed())
    opt = polydist_torch.distribute_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    opt._alone = False
    plain = Mixed()
    plain.load_state_dict(model.state_dict())
    reference = torch.optim.SGD(plain.parameters(), lr=0.5)

    def step(seed: int) -> None:
        _backward(model, seed)
        opt.step()
        opt.zero_grad()

    for seed in range(2):
        strategy.run(step, args=(seed,))
        _backward(plain, seed)
        reference.step()
        reference.zero_grad()
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            assert p.dtype == q.dtype and torch.equal(p.detach(), q.detach()), seed
    assert opt._bucket is None
    assert all(p.grad is None for p in model.parameters())
