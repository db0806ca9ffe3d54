"""A one-replica collective copies nothing it does not have to.

TF's rule is that an all_reduce leaves its input unmodified, not that it makes a
copy: one value onto its own device is its own sum, so it comes back as it is.
The exception is a variable's storage, or another tensor on its memory, which
later writes (``assign``, torch optimizers, BatchNorm) update in place: a result
aliasing it would change behind the caller's back, so it is copied (TF's result is a
value read at the call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import polydist as pd
import polydist_torch
from polydist_torch import TorchBackend

CPU0 = "/job:localhost/replica:0/task:0/device:CPU:0"


STRATEGIES = pytest.mark.parametrize(
    "make",
    [
        lambda: pd.MirroredStrategy(["/cpu:0"], backend=TorchBackend()),
        lambda: pd.OneDeviceStrategy("/cpu:0", backend=TorchBackend()),
    ],
    ids=["mirrored-1", "one-device"],
)


def test_backend_hands_one_value_on_its_device_back() -> None:
    backend = TorchBackend()
    x = torch.arange(4.0)
    assert backend.all_reduce([x], [CPU0])[0] is x
    assert backend.all_gather([x], 0, [CPU0])[0] is x
    # Two destinations, or two values: distinct new tensors, as before.
    a, b = backend.all_reduce([x], [CPU0, CPU0])
    assert a is not x and b is not x and a is not b
    assert backend.all_reduce([x, x], [CPU0, CPU0])[0].tolist() == [0.0, 2.0, 4.0, 6.0]


@STRATEGIES
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_all_reduce_returns_the_input_itself(make: Callable[[], pd.Strategy], op: str) -> None:
    strategy = make()
    x = torch.arange(3.0)
    nest = {"a": x, "b": [torch.ones(2, dtype=torch.int32)]}

    def fn() -> Any:
        ctx = pd.get_replica_context()
        return ctx.all_reduce(op, x), ctx.all_reduce(op, nest)

    alone, summed = strategy.run(fn)
    assert alone is x
    assert summed["a"] is x and summed["b"][0] is nest["b"][0]
    assert x.tolist() == [0.0, 1.0, 2.0]  # the input is not modified


@STRATEGIES
def test_all_gather_returns_the_input_itself(make: Callable[[], pd.Strategy]) -> None:
    strategy = make()
    x = torch.arange(3.0)
    assert strategy.run(lambda: pd.get_replica_context().all_gather(x, 0)) is x


def test_differentiable_all_reduce_shares_the_input_and_keeps_its_gradient() -> None:
    strategy = pd.MirroredStrategy(["/cpu:0"], backend=TorchBackend())
    w = torch.tensor([1.0, 2.0], requires_grad=True)

    def fn() -> Any:
        y = w * 3.0
        s = pd.get_replica_context().all_reduce("SUM", y)
        assert s.data_ptr() == y.data_ptr()  # no copy: a view of y for autograd
        (s * torch.tensor([5.0, 7.0])).sum().backward()
        return s.detach()

    assert strategy.run(fn).tolist() == [3.0, 6.0]
    assert w.grad is not None and w.grad.tolist() == [15.0, 21.0]


def _variable(strategy: pd.Strategy, as_parameter: bool) -> Any:
    with strategy.scope():
        v = pd.Variable(np.array([1.0, 2.0], np.float32), name="v")
    if as_parameter:
        polydist_torch.parameters(v)
    return v


@STRATEGIES
@pytest.mark.parametrize("as_parameter", [False, True], ids=["tensor", "parameter"])
def test_a_variable_comes_back_as_a_copy_read_at_the_call(
    make: Callable[[], pd.Strategy], as_parameter: bool
) -> None:
    strategy = make()
    v = _variable(strategy, as_parameter)

    def fn() -> Any:
        ctx = pd.get_replica_context()
        out = ctx.all_reduce("SUM", v), ctx.all_reduce("SUM", [v.value()])[0]
        v.assign_add(np.array([10.0, 10.0], np.float32))
        return out

    by_variable, by_value = strategy.run(fn)
    storage = v.value()
    # OneDeviceStrategy has no collective (TF's identity): only a variable is read as a
    # copy there; value() is the live storage (as documented) and comes back as it is.
    mirrored = isinstance(strategy, pd.MirroredStrategy)
    for out in (by_variable, by_value) if mirrored else (by_variable,):
        assert out.data_ptr() != storage.data_ptr()
        assert out.tolist() == [1.0, 2.0]  # the later assign_add did not reach it
    assert storage.tolist() == [11.0, 12.0]


def test_an_optimizer_step_does_not_reach_an_all_reduced_parameter() -> None:
    # MirroredStrategy's collective knows the tensor is a variable's storage (a
    # OneDeviceStrategy has no collective: there only a variable passed as such is read).
    strategy = pd.MirroredStrategy(["/cpu:0"], backend=TorchBackend())
    v = _variable(strategy, as_parameter=True)
    (params,) = polydist_torch.parameters(v)  # one replica: one list
    opt = torch.optim.SGD(params, lr=1.0)

    def fn() -> Any:
        reduced = pd.get_replica_context().all_reduce("SUM", params[0])
        params[0].grad = torch.ones(2)
        opt.step()  # updates the parameter in place
        return reduced

    assert strategy.run(fn).tolist() == [1.0, 2.0]
    assert v.numpy().tolist() == [0.0, 1.0]


def test_a_distributed_modules_parameters_and_buffers_come_back_as_copies() -> None:
    strategy = pd.MirroredStrategy(["/cpu:0"], backend=TorchBackend())
    torch.manual_seed(0)
    with strategy.scope():
        model = polydist_torch.distribute_module(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    weight = model.module[0].weight
    mean = model.module[1].running_mean

    def fn() -> Any:
        ctx = pd.get_replica_context()
        w, m = ctx.all_reduce("SUM", [weight, mean])
        before = w.detach().clone(), m.clone()
        model(torch.randn(4, 2)).sum().backward()  # BatchNorm updates running_mean
        with torch.no_grad():
            weight.add_(1.0)
        return w.detach(), m, before

    w, m, (w0, m0) = strategy.run(fn)
    assert torch.equal(w, w0) and torch.equal(m, m0)
    assert not torch.equal(mean, m0) and torch.equal(weight.detach(), w0 + 1.0)


def test_several_replicas_still_get_distinct_new_tensors() -> None:
    strategy = pd.MirroredStrategy(["/cpu:0", "/cpu:1"], backend=TorchBackend())
    x = torch.ones(2)
    out = strategy.run(lambda: pd.get_replica_context().all_reduce("SUM", x))
    a, b = out.values
    assert a is not x and b is not x and a is not b
    assert a.tolist() == [2.0, 2.0]


@pytest.mark.parametrize(
    "view",
    [
        lambda t: t.detach(),
        lambda t: t.detach()[1:],
        lambda t: t.detach().view(-1),
        lambda t: t.data,
    ],
    ids=["detach", "slice", "view", "data"],
)
def test_a_tensor_on_a_variables_memory_comes_back_as_a_copy(
    view: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    # w.detach() is another tensor object on the parameter's memory: the optimizer's
    # in-place step would change a result that were that tensor (TF's result is a
    # value read at the call, as with 2 replicas, which always copy).
    strategy = pd.MirroredStrategy(["/cpu:0"], backend=TorchBackend())
    with strategy.scope():
        model = polydist_torch.distribute_module(nn.Linear(2, 2))
        opt = polydist_torch.distribute_optimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    weight = model.module.weight

    def fn() -> Any:
        ctx = pd.get_replica_context()
        seen = view(weight)
        reduced = ctx.all_reduce("SUM", seen)
        before = reduced.clone()
        fresh = weight.detach() * 1.0  # a new tensor: its own sum, handed back as it is
        assert ctx.all_reduce("SUM", fresh) is fresh
        model(torch.ones(3, 2)).sum().backward()
        opt.step()  # writes into the parameter's memory in place
        assert not torch.equal(view(weight), before)  # the view did change
        return reduced, before

    reduced, before = strategy.run(fn)
    assert torch.equal(reduced, before)


def test_memory_a_variable_left_is_no_longer_its_storage() -> None:
    from polydist_torch._storage import is_variable_storage, mark_variable_storage

    marked = torch.zeros(4)
    mark_variable_storage(marked)
    old_view = marked.detach()
    assert is_variable_storage(old_view) and is_variable_storage(marked[2:])
    assert not is_variable_storage(torch.zeros(4)) and not is_variable_storage(torch.zeros(0))
    with torch.no_grad():
        marked.set_(torch.ones(8).untyped_storage())  # the variable's tensor moves elsewhere
    assert is_variable_storage(marked)  # the marked object itself still counts
    assert not is_variable_storage(old_view)  # nothing writes into the old memory now


def _one_replica_model() -> tuple[pd.Strategy, Any, Any]:
    strategy = pd.MirroredStrategy(["/cpu:0"], backend=TorchBackend())
    torch.manual_seed(0)
    with strategy.scope():
        model = polydist_torch.distribute_module(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)))
        opt = polydist_torch.distribute_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    return strategy, model, opt


def test_one_replica_steps_on_the_gradients_backward_made() -> None:
    """At one replica ``step()`` neither copies nor sums: the wrapped optimizer steps on
    the very ``.grad`` tensors ``backward()`` made (same objects, same memory, unchanged
    values), with no gradient bucket built (issue 20: polydist's step against Fabric's)."""
    strategy, model, opt = _one_replica_model()
    x, y = torch.randn(5, 3), torch.randn(5, 1)
    plain = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    plain.load_state_dict(model.state_dict())
    seen: list[tuple[bool, bool, bool]] = []

    def step() -> None:
        ((model(x) - y) ** 2).sum().backward()
        params = list(model.parameters())
        grads = [p.grad for p in params]
        ptrs = [g.data_ptr() for g in grads]
        values = [g.clone() for g in grads]
        opt.all_reduce_gradients()
        opt.step()
        seen.append(
            (
                all(p.grad is g for p, g in zip(params, grads)),
                [p.grad.data_ptr() for p in params] == ptrs,
                all(torch.equal(p.grad, v) for p, v in zip(params, values)),
            )
        )
        opt.zero_grad()

    for _ in range(2):
        strategy.run(step)
    assert seen == [(True, True, True)] * 2
    assert opt._bucket is None
    reference = torch.optim.SGD(plain.parameters(), lr=0.5)
    for _ in range(2):
        ((plain(x) - y) ** 2).sum().backward()
        reference.step()
        reference.zero_grad()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p.detach(), q.detach())


def test_one_replica_step_still_runs_hooks_and_refuses_a_closure() -> None:
    """The one-replica step goes straight to the wrapped optimizer only where nothing else
    is asked of it: step hooks still run, a closure and a call outside run still raise."""
    strategy, model, opt = _one_replica_model()
    calls: list[str] = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))

    def step() -> None:
        model(torch.ones(2, 3)).sum().backward()
        opt.step()

    strategy.run(step)
    assert calls == ["pre", "post"]
    with pytest.raises(NotImplementedError, match="closure"):
        strategy.run(lambda: opt.step(lambda: 0.0))
    with pytest.raises(RuntimeError, match="inside strategy.run"):
        opt.step()


def test_a_lone_replica_reuses_its_channel_across_runs() -> None:
    """A lone replica's collectives object and channel hold no state of a run, so each
    run does not build them again (issue 20: every object of a run costs on a real step,
    whose matrix products leave none of them in the caches)."""
    from polydist.backend.context import replica_channel

    strategy = pd.MirroredStrategy(["/cpu:0"], backend=TorchBackend())

    def channel() -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return replica_channel(ctx)

    first, second = strategy.run(channel), strategy.run(channel)
    assert first is second
    other = pd.MirroredStrategy(["/cpu:0"], backend=TorchBackend())
    assert other.run(channel) is not first  # per strategy: its own group
    # Still a working channel: the collective of a lone replica hands its input back.
    x = torch.arange(3.0)
    assert strategy.run(lambda: pd.get_replica_context().all_reduce("SUM", x)) is x
