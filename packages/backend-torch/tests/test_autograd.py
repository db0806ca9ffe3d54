"""Gradients through the collectives follow TF's rules (strategy_test_lib)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import polydist as pd
from polydist_torch import TorchBackend


def strategy(n: int) -> pd.MirroredStrategy:
    return pd.MirroredStrategy([f"/cpu:{i}" for i in range(n)], backend=TorchBackend())


def ctx() -> pd.ReplicaContext:
    c = pd.get_replica_context()
    assert c is not None
    return c


def per_replica(values: list[float]) -> pd.PerReplica:
    return pd.PerReplica([torch.tensor(v) for v in values])


def grads(result: Any, s: pd.Strategy) -> list[Any]:
    return [t.tolist() for t in s.experimental_local_results(result)]


# -- TF's cases: x = 42 on every replica, y = all_reduce(x) * c, c per replica -----------


@pytest.mark.parametrize(
    ("op", "inputs", "expected"),
    [
        ("SUM", [1.0, 3.0], [4.0, 4.0]),
        ("MEAN", [1.0, 3.0], [2.0, 2.0]),
        ("SUM", [1.0, 3.0, 5.0, 7.0], [16.0] * 4),
        ("MEAN", [1.0, 3.0, 5.0, 7.0], [4.0] * 4),
        ("SUM", [4.0], [4.0]),
        ("MEAN", [5.0], [5.0]),
    ],
)
def test_all_reduce_gradient_is_all_reduce_of_upstream(
    op: str, inputs: list[float], expected: list[float]
) -> None:
    s = strategy(len(inputs))

    def with_backward(c: Any) -> Any:
        x = torch.tensor(42.0, requires_grad=True)
        y = ctx().all_reduce(op, x) * c
        y.backward()
        return x.grad

    def with_autograd_grad(c: Any) -> Any:
        x = torch.tensor(42.0, requires_grad=True)
        (g,) = torch.autograd.grad(ctx().all_reduce(op, x) * c, x)
        return g

    for step in (with_backward, with_autograd_grad):
        assert grads(s.run(step, args=(per_replica(inputs),)), s) == expected


def test_one_device_strategy_gradient_is_the_identity() -> None:
    s = pd.OneDeviceStrategy("/cpu:0", backend=TorchBackend())

    def step(c: Any) -> Any:
        x = torch.tensor(42.0, requires_grad=True)
        (ctx().all_reduce("SUM", x) * c + ctx().all_gather(x[None], 0).sum()).backward()
        return x.grad

    assert s.run(step, args=(torch.tensor(4.0),)).item() == 5.0


def test_gradient_through_a_nest_with_ints_and_python_scalars() -> None:
    s = strategy(3)

    def step() -> Any:
        r = ctx().replica_id_in_sync_group
        w = (r.to(torch.float32) + 1.0).reshape(1).requires_grad_()
        v = torch.arange(4, dtype=torch.float64, requires_grad=True)
        out = ctx().all_reduce("SUM", {"w": w * 2.0, "v": v, "i": r, "s": 1.5})
        assert out["i"].dtype == torch.int32 and not out["i"].requires_grad
        loss = (out["w"] * (r + 1)).sum() + (out["v"] ** 2).sum() + out["s"]
        loss.backward()
        return w.grad, v.grad

    w_grads, v_grads = s.run(step)
    # d/dw_r of sum_r' (2 * S_w * (r'+1)) = 2 * (1+2+3) = 12 on every replica.
    assert [g.tolist() for g in w_grads.values] == [[12.0]] * 3
    # v: S_v = 3 * arange(4); each replica's upstream 2 * S_v, summed over 3 replicas.
    expected = (3 * 2 * 3 * np.arange(4.0)).tolist()
    assert [g.tolist() for g in v_grads.values] == [expected] * 3
    assert v_grads.values[0].dtype == torch.float64


def test_all_gather_gradient_slices_each_replicas_segment_uneven() -> None:
    s = strategy(4)

    def step() -> Any:
        r = int(ctx().replica_id_in_sync_group)
        x = torch.ones(r + 1, 2, requires_grad=True)
        z = torch.ones(2, r + 2, requires_grad=True)
        gathered = ctx().all_gather({"x": x}, 0)["x"]
        gz = ctx().all_gather(z, 1)
        weights = torch.arange(gathered.numel(), dtype=torch.float32).reshape(gathered.shape)
        loss = (gathered * weights * (r + 1)).sum() + (gz * (r + 1)).sum()
        loss.backward()
        return x.grad, z.grad

    x_grads, z_grads = s.run(step)
    rows = np.arange(20, dtype=np.float32).reshape(10, 2) * 10  # sum over r of (r+1) = 10
    starts = [0, 1, 3, 6]
    for r in range(4):
        assert x_grads.values[r].tolist() == rows[starts[r] : starts[r] + r + 1].tolist()
        assert z_grads.values[r].tolist() == np.full((2, r + 2), 10.0).tolist()


def test_second_order_gradients_go_through_the_backward_collectives() -> None:
    # S = all_reduce(x), y_r = S^2 * c_r. First order: g = all_reduce(2 S c) = 2 S C.
    # Second order: dg/dx = 2 * N * C (the backward all_reduce is differentiated too).
    s = strategy(4)
    cs = [1.0, 3.0, 5.0, 7.0]

    def step(c: Any) -> Any:
        x = torch.tensor(2.0, requires_grad=True)
        y = ctx().all_reduce("SUM", x) ** 2 * c
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        (h,) = torch.autograd.grad(g, x)
        return g.detach(), h

    g, h = s.run(step, args=(per_replica(cs),))
    assert [v.item() for v in g.values] == [2 * 8.0 * 16.0] * 4
    assert [v.item() for v in h.values] == [2 * 4 * 16.0] * 4


def test_gradients_stay_on_each_replicas_thread() -> None:
    import threading

    s = strategy(3)

    def step() -> Any:
        here = threading.get_ident()
        seen: list[int] = []
        x = torch.ones(2, requires_grad=True)
        y = ctx().all_reduce("SUM", x)
        y.register_hook(lambda g: seen.append(threading.get_ident()))
        y.sum().backward()
        return here, seen

    here, seen = s.run(step)
    threads = s.experimental_local_results(here)
    assert len(set(threads)) == 3  # each replica on its own thread,
    # and its backward (the hook on the all-reduce's output) ran on that thread.
    assert list(s.experimental_local_results(seen)) == [[t] for t in threads]


def test_backward_outside_the_run_is_a_clear_error() -> None:
    s = strategy(2)
    losses = s.run(
        lambda: ctx().all_reduce("SUM", torch.ones(1, requires_grad=True)).sum(),
    )
    with pytest.raises(RuntimeError, match="requested outside strategy.run. Call loss.backward"):
        losses.values[0].backward()


def test_backward_on_some_replicas_only_is_a_mismatch() -> None:
    s = strategy(3)

    def step() -> Any:
        x = torch.ones(2, requires_grad=True)
        y = ctx().all_reduce("SUM", x).sum()
        if int(ctx().replica_id_in_sync_group) == 1:
            return None
        y.backward()  # the line the message names
        return x.grad

    with pytest.raises(pd.CollectiveMismatchError) as info:
        s.run(step)
    message = str(info.value)
    assert "replica 1 (/job:localhost/replica:0/task:0/device:CPU:1): returned from fn" in message
    assert "all_reduce(SUM) of float32[2] at test_autograd.py:" in message
    assert "in step" in message


def test_no_grad_skips_the_autograd_wrapper() -> None:
    s = strategy(2)

    def step() -> Any:
        x = torch.ones(2, requires_grad=True)
        with torch.no_grad():
            y = ctx().all_reduce("SUM", x)
        return y.requires_grad, y.grad_fn is None

    assert s.run(step) == (False, True)


def test_error_on_one_replica_unwinds_the_others_paused_in_backward() -> None:
    s = strategy(3)
    unwound: list[str] = []

    def step() -> Any:
        x = torch.ones(2, requires_grad=True)
        y = ctx().all_reduce("SUM", x).sum()
        if int(ctx().replica_id_in_sync_group) == 2:
            raise ValueError("replica 2 failed before its backward")
        try:
            y.backward()
        except BaseException as e:
            unwound.append(type(e).__name__)
            raise
        return x.grad

    with pytest.raises(ValueError, match="replica 2 failed"):
        s.run(step)
    # Replicas 0 and 1 were paused inside autograd's engine; they unwound through it.
    assert len(unwound) == 2


def test_the_replica_id_read_first_under_inference_mode_still_works_with_autograd() -> None:
    # The id is made before fn runs, outside fn's inference_mode: a later use in a
    # differentiable computation may save it for backward.
    strategy = pd.MirroredStrategy(["/cpu:0", "/cpu:1"], backend=TorchBackend())

    def fn() -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        with torch.inference_mode():
            ctx.replica_id_in_sync_group.item()
        w = torch.ones(2, requires_grad=True)
        (w * (ctx.replica_id_in_sync_group + 1)).sum().backward()
        return w.grad

    grads = strategy.experimental_local_results(strategy.run(fn))
    assert [g.tolist() for g in grads] == [[1.0, 1.0], [2.0, 2.0]]
