"""Memory and aliasing on torch: ``assign_add`` / ``assign_sub`` write into the
variable's own tensor when nothing else can see it (as ``p.add_(d)`` does), a
variable is made from a NumPy array without a host copy first, and nothing a user
holds ever changes behind their back. Values, never memory figures."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.dlpack

import polydist as pd
import polydist_torch
from polydist.backend.tracing import storage_arrays
from polydist_torch import TorchBackend

N = 4


def make(n: int) -> pd.Strategy:
    return pd.MirroredStrategy([f"/cpu:{i}" for i in range(n)], backend=TorchBackend())


def pointers(v: Any) -> list[int]:
    return [int(a.data_ptr()) for a in storage_arrays(v)]


@pytest.mark.parametrize("n", [1, N])
def test_assign_add_in_a_step_writes_into_the_variables_own_tensor(n: int) -> None:
    strategy = make(n)
    with strategy.scope():
        v = pd.Variable(np.zeros(4, np.float32))
    before = pointers(v)
    delta = torch.ones(4)
    for _ in range(3):
        strategy.run(lambda: v.assign_add(delta, read_value=False))
    strategy.run(lambda: v.assign_sub(delta * 0.5, read_value=False))
    assert pointers(v) == before  # the same memory: no second copy of the state
    assert [c.numpy().tolist() for c in v.values] == [[2.5] * 4] * n
    assert delta.tolist() == [1.0] * 4  # the input is never modified


def test_in_place_updates_give_the_bits_of_the_out_of_place_ones() -> None:
    rng = np.random.default_rng(0)
    start = rng.standard_normal(64).astype(np.float32) * 1e3
    deltas = [
        (rng.standard_normal(64) * 10.0 ** rng.integers(-8, 8)).astype(np.float32) for _ in range(6)
    ]
    strategy = make(1)
    with strategy.scope():
        v = pd.Variable(start)
    expected = torch.from_numpy(start.copy())
    for i, d in enumerate(deltas):
        t = torch.from_numpy(d)
        if i % 2:
            strategy.run(lambda t=t: v.assign_sub(t, read_value=False))
            expected = torch.sub(expected, t)
        else:
            strategy.run(lambda t=t: v.assign_add(t, read_value=False))
            expected = torch.add(expected, t)
    assert v.numpy().tobytes() == expected.numpy().tobytes()


def test_integer_variables_update_in_place_with_wraparound() -> None:
    strategy = make(1)
    with strategy.scope():
        v = pd.Variable(np.array([2**31 - 1, 0, -5], np.int32))
    before = pointers(v)
    v.assign_add(torch.tensor([1, 2, 3], dtype=torch.int32), read_value=False)
    assert pointers(v) == before
    assert v.numpy().tolist() == [-(2**31), 2, -2]


def test_a_tensor_read_before_an_update_keeps_its_value() -> None:
    strategy = make(N)
    with strategy.scope():
        v = pd.Variable(np.zeros(4, np.float32))
    one = torch.ones(4)
    held = v.values[0].value()  # the stored tensor itself
    view = v.values[1].value()[:2]  # a view of a stored tensor
    as_numpy = v.values[2].value().numpy()  # NumPy on the same memory
    exported = torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(v.values[3].value()))
    snapshot = strategy.run(lambda: v.assign_add(one))  # read_value=True: the new values
    for _ in range(2):
        strategy.run(lambda: v.assign_add(one, read_value=False))
    assert held.tolist() == [0.0] * 4
    assert view.tolist() == [0.0] * 2
    assert as_numpy.tolist() == [0.0] * 4
    assert exported.tolist() == [0.0] * 4
    assert [s.tolist() for s in strategy.experimental_local_results(snapshot)] == [[1.0] * 4] * N
    assert [c.numpy().tolist() for c in v.values] == [[3.0] * 4] * N


def test_a_graph_that_saved_the_value_still_differentiates_after_an_update() -> None:
    strategy = make(1)
    with strategy.scope():
        v = pd.Variable(np.full(3, 2.0, np.float32))
    w = torch.ones(3, requires_grad=True)
    loss = (w * v.value()).sum()  # autograd saved v's tensor for the backward pass
    v.assign_add(torch.ones(3), read_value=False)
    loss.backward()  # no "modified by an inplace operation" error: v was not
    assert w.grad is not None
    assert w.grad.tolist() == [2.0] * 3
    assert v.numpy().tolist() == [3.0] * 3


def test_a_variable_storing_the_same_tensor_keeps_its_value() -> None:
    strategy = make(1)
    with strategy.scope():
        v = pd.Variable(np.zeros(2, np.float32))
    w = pd.Variable(torch.zeros(2))
    w._array = storage_arrays(v)[0]  # the same tensor object, as an assign may keep it
    v.assign_add(torch.ones(2), read_value=False)
    assert w.numpy().tolist() == [0.0, 0.0]
    assert v.numpy().tolist() == [1.0, 1.0]


def test_adding_a_variable_to_itself() -> None:
    strategy = make(1)
    with strategy.scope():
        v = pd.Variable(np.arange(3, dtype=np.float32))
    v.assign_add(v, read_value=False)
    v.assign_add(v.value(), read_value=False)
    assert v.numpy().tolist() == [0.0, 4.0, 8.0]


def test_parameters_are_updated_in_place_and_stay_the_optimizers() -> None:
    strategy = make(1)
    with strategy.scope():
        v = pd.Variable(np.ones(3, np.float32))
    (params,) = polydist_torch.parameters(v)
    p = params[0]
    optimizer = torch.optim.SGD([p], lr=0.5)
    strategy.run(lambda: v.assign_add(torch.ones(3), read_value=False))
    assert storage_arrays(v)[0] is p
    assert p.tolist() == [2.0] * 3
    p.grad = torch.ones(3)
    optimizer.step()
    assert v.numpy().tolist() == [1.5] * 3
    v.assign_sub(p.detach(), read_value=False)  # a delta on the parameter's own memory
    assert v.numpy().tolist() == [0.0] * 3
    assert storage_arrays(v)[0] is p


def test_an_inference_tensor_is_updated_out_of_place_outside_inference_mode() -> None:
    strategy = make(1)
    with torch.inference_mode(), strategy.scope():
        v = pd.Variable(np.zeros(2, np.float32))
    v.assign_add(torch.ones(2), read_value=False)  # torch refuses add_ on it: no error
    assert v.numpy().tolist() == [1.0, 1.0]


@pytest.mark.parametrize("n", [1, N])
def test_a_variable_is_placed_from_the_callers_numpy_array_without_a_host_copy(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    received: list[Any] = []
    place = TorchBackend.place

    def recording(self: TorchBackend, value: Any, device: str) -> Any:
        received.append(value)
        return place(self, value, device)

    monkeypatch.setattr(TorchBackend, "place", recording)
    strategy = make(n)
    init = np.arange(4, dtype=np.float32)
    with strategy.scope():
        v = pd.Variable(init)
    assert len(received) == n
    assert all(r is init for r in received)
    init[:] = -1.0  # the variable still never shares memory with its initial value
    assert [c.numpy().tolist() for c in v.values] == [[0.0, 1.0, 2.0, 3.0]] * n
