"""CUDA devices: skipped without CUDA ("needs CUDA") or with one GPU ("needs 2 CUDA devices")."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

import polydist as pd
from polydist_sim import SimBackend
from polydist_torch import TorchBackend

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

GPU = "/job:localhost/replica:0/task:0/device:GPU:{}"


def ctx() -> pd.ReplicaContext:
    c = pd.get_replica_context()
    assert c is not None
    return c


def data(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        (rng.standard_normal((64, 33)) * 10.0 ** rng.uniform(-4, 4, (64, 33))).astype(np.float32)
        for _ in range(n)
    ]


def all_reduce_on(devices: list[str], backend: Any, arrays: list[np.ndarray]) -> list[Any]:
    s = pd.MirroredStrategy(devices, backend=backend)
    x = pd.PerReplica([s.extended.backend.place(a, d) for a, d in zip(arrays, devices)])
    out = s.run(lambda v: ctx().all_reduce("SUM", v), args=(x,))
    return list(s.experimental_local_results(out))


@needs_cuda
def test_default_devices_are_every_gpu() -> None:
    backend = TorchBackend()
    n = torch.cuda.device_count()
    assert backend.replica_devices(None) == tuple(GPU.format(i) for i in range(n))
    assert pd.MirroredStrategy(backend=backend).num_replicas_in_sync == n
    assert pd.MirroredStrategy(1, backend=backend).extended.worker_devices == (GPU.format(0),)


@needs_cuda
def test_results_land_on_each_replicas_device_and_scope_sets_cuda_device() -> None:
    s = pd.MirroredStrategy(["/gpu:0", "/cpu:0"], backend=TorchBackend())

    def fn() -> Any:
        made = torch.zeros(1)  # the device scope puts it on the replica's device
        return made.device, ctx().all_reduce("SUM", made + 1).device

    made, reduced = s.run(fn)
    expected = (torch.device("cuda", 0), torch.device("cpu"))
    assert s.experimental_local_results(made) == expected
    assert s.experimental_local_results(reduced) == expected


@needs_cuda
@pytest.mark.parametrize("replica_default_device", [True, False])
def test_host_values_placed_inside_a_gpu_replica(replica_default_device: bool) -> None:
    # A NumPy input is staged in pinned CPU memory from inside the replica, where
    # torch's default device may be the GPU (found on an H200).
    backend = TorchBackend(replica_default_device=replica_default_device)
    s = pd.MirroredStrategy(["/gpu:0", "/cpu:0"], backend=backend)

    def fn() -> Any:
        total = ctx().all_reduce("SUM", np.arange(3, dtype=np.float32))
        return ctx().replica_id_in_sync_group, total

    ids, totals = s.run(fn)
    ids, totals = s.experimental_local_results(ids), s.experimental_local_results(totals)
    assert [t.device.type for t in ids] == ["cuda", "cpu"]
    assert [t.item() for t in ids] == [0, 1]
    assert [t.device.type for t in totals] == ["cuda", "cpu"]
    assert [t.tolist() for t in totals] == [[0.0, 2.0, 4.0]] * 2


@needs_cuda
def test_sequential_sum_on_gpu_matches_the_sim_bitwise() -> None:
    # Elementwise CUDA addition is correctly rounded, so summing in replica order on
    # the GPU gives the sim's "sequential" bits.
    arrays = data(3)
    devices = ["/gpu:0", "/cpu:1", "/cpu:2"]
    got = all_reduce_on(devices, TorchBackend("sequential"), arrays)
    want = all_reduce_on(["/cpu:0", "/cpu:1", "/cpu:2"], SimBackend("sequential"), arrays)
    assert got[0].device.type == "cuda"
    for g in got:
        assert g.cpu().numpy().tobytes() == want[0].tobytes()


@needs_cuda
def test_backward_on_cuda_stays_on_the_replicas_thread() -> None:
    s = pd.MirroredStrategy(["/gpu:0", "/cpu:0"], backend=TorchBackend())

    def step(c: Any) -> Any:
        here = threading.get_ident()
        seen: list[int] = []
        x = torch.tensor(42.0, requires_grad=True)  # on the replica's device (scope)
        y = ctx().all_reduce("SUM", x)
        y.register_hook(lambda g: seen.append(threading.get_ident()))
        (y * c).backward()
        return x.grad, seen == [here]

    grads, same_thread = s.run(step, args=(pd.PerReplica([1.0, 3.0]),))
    assert [g.item() for g in s.experimental_local_results(grads)] == [4.0, 4.0]
    assert same_thread is True


@needs_cuda
def test_optimizer_step_on_gpu() -> None:
    s = pd.MirroredStrategy(["/gpu:0"], backend=TorchBackend())
    model = torch.nn.Linear(4, 1).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4, device="cuda")

    def step() -> Any:
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        params = list(model.parameters())
        for p, g in zip(params, ctx().all_reduce("SUM", [p.grad for p in params])):
            p.grad = g
        opt.step()
        return loss.detach()

    first = s.run(step)
    for _ in range(5):
        last = s.run(step)
    assert last.item() < first.item()


@needs_two_gpus
def test_nccl_reduction_on_two_gpus() -> None:
    backend = TorchBackend()
    assert backend.reduction == "nccl" and backend.capabilities.reduction_orders == ()
    arrays = data(2)
    got = all_reduce_on(["/gpu:0", "/gpu:1"], backend, arrays)
    exact = all_reduce_on(["/cpu:0", "/cpu:1"], SimBackend("exact"), arrays)
    assert [g.device for g in got] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    for g in got:
        np.testing.assert_allclose(g.cpu().numpy(), exact[0], rtol=1e-6)


@needs_two_gpus
def test_nccl_gather_broadcast_and_reduce_to_host() -> None:
    s = pd.MirroredStrategy(["/gpu:0", "/gpu:1"], backend=TorchBackend())

    def fn() -> Any:
        r = int(ctx().replica_id_in_sync_group)
        x = torch.full((r + 1, 2), float(r + 1))
        return ctx().all_gather(x, 0), x

    gathered, x = s.run(fn)
    for r, g in enumerate(s.experimental_local_results(gathered)):
        assert g.device == torch.device("cuda", r)
        assert g.tolist() == [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]]
    assert s.gather(x, 0).device == torch.device("cpu")
    total = s.reduce("SUM", s.run(lambda: torch.ones(3)), axis=None)
    assert total.device == torch.device("cpu") and total.tolist() == [2.0, 2.0, 2.0]


@needs_cuda
def test_a_variables_initial_value_leaves_no_pinned_buffer_behind() -> None:
    # A batch placed on the GPU goes through a page-locked buffer torch keeps for the
    # next one; a variable's initial value is copied from pageable memory instead, so
    # no host memory of the state's size stays held (TorchBackend.place_variable).
    torch.cuda.synchronize()
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    strategy = pd.MirroredStrategy(1, backend=TorchBackend())
    with strategy.scope():
        v = pd.Variable(np.arange(1 << 20, dtype=np.float32))
    torch.cuda.synchronize()
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    assert v.values[0].value().device.type == "cuda"
    assert float(v.values[0].value()[-1]) == float((1 << 20) - 1)


@needs_cuda
def test_torch_optimizer_state_stays_where_torch_puts_it() -> None:
    """Adamax makes its step counter without device= (the CPU, in torch's design): in a
    GPU replica a distributed optimizer steps it outside the replica's default-device
    mode, so the counter stays on the CPU and reading it does not wait for the GPU; the
    rest of the state is on the parameters' GPU. A collective runs outside the mode too."""
    import polydist_torch

    strategy = pd.MirroredStrategy([GPU.format(0)], backend="torch")
    with strategy.scope():
        model = polydist_torch.distribute_module(torch.nn.Linear(4, 1))
        opt = polydist_torch.distribute_optimizer(torch.optim.Adamax(model.parameters()))
    x = torch.ones(2, 4, device="cuda")
    depths: list[int] = []

    def step() -> torch.Tensor:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        depths.append(torch._C._len_torch_function_stack())  # the mode, in the user's code
        return ctx().all_reduce("SUM", torch.zeros(1))  # made under the mode: on the GPU

    summed = strategy.run(step)
    assert depths == [1]
    assert summed.device.type == "cuda"
    (inner,) = opt.replicas
    devices = {k: str(v.device) for s in inner.state.values() for k, v in s.items()}
    assert devices == {"step": "cpu", "exp_avg": "cuda:0", "exp_inf": "cuda:0"}
