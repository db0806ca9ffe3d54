"""torch-xla SPMD: the same programs as on the sim, on 4 XLA:CPU devices.

Needs torch-xla (a separate venv: torch-xla 2.9 needs torch 2.9.0); skipped
without it. torch-xla reads PJRT_DEVICE and CPU_NUM_DEVICES once, when it starts.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")
pytest.importorskip("torch_xla", reason="needs torch-xla")

import torch

import polydist as pd
from polydist.backend import Backend
from polydist_sim import SimBackend
from polydist_torch import XLA_UNSUPPORTED, XlaSpmdBackend

N = 4


@pytest.fixture(scope="module")
def backend() -> XlaSpmdBackend:
    b = XlaSpmdBackend()
    if b.num_devices != N:
        pytest.skip(f"needs {N} XLA devices (CPU_NUM_DEVICES={N}), got {b.num_devices}")
    return b


def ctx() -> pd.ReplicaContext:
    c = pd.get_replica_context()
    assert c is not None
    return c


def wide(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return (rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, 4, shape)).astype(np.float32)


def both(backend: XlaSpmdBackend) -> list[pd.Strategy]:
    return [
        pd.MirroredStrategy(N, backend=SimBackend("sequential")),
        pd.MirroredStrategy(backend=backend),
    ]


def per_replica(s: pd.Strategy, arrays: list[np.ndarray]) -> pd.PerReplica:
    b, devices = s.extended.backend, s.extended.worker_devices
    return pd.PerReplica([b.place(a, d) for a, d in zip(arrays, devices)])


def local(s: pd.Strategy, value: Any) -> list[np.ndarray]:
    return [s.extended.backend.to_numpy(v) for v in s.experimental_local_results(value)]


def assert_same_bits(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes(), f"\n{x!r}\n{y!r}"


def test_backend_and_capabilities(backend: XlaSpmdBackend) -> None:
    typed: Backend = backend
    assert isinstance(typed, Backend)
    caps = backend.capabilities
    assert caps.execution_model == "spmd" and caps.autodiff
    assert caps.reduction_orders == ("sequential",)  # XLA:CPU
    assert not caps.uneven_gather and not caps.multi_worker
    assert "pytorch/xla#9496" in XLA_UNSUPPORTED["multi_worker"]
    assert "pytorch/xla#9089" in XLA_UNSUPPORTED["eager_collectives"]
    assert "pytorch/xla#8063" in XLA_UNSUPPORTED["replica_count"]
    assert backend.list_devices()[0] == "/job:localhost/replica:0/task:0/device:XLA:0"
    with pytest.raises(ValueError, match="mesh has 4 devices"):
        pd.MirroredStrategy(2, backend=backend)


def test_replica_ids(backend: XlaSpmdBackend) -> None:
    s = pd.MirroredStrategy(backend=backend)
    ids = s.run(lambda: ctx().replica_id_in_sync_group)
    assert [int(v) for v in local(s, ids)] == [0, 1, 2, 3]


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_all_reduce_matches_sequential_sim_bitwise(backend: XlaSpmdBackend, op: str) -> None:
    rng = np.random.default_rng(7)
    floats = [wide(rng, (5, 7)) for _ in range(N)]
    ints = [rng.integers(-9, 9, (3,)).astype(np.int32) for _ in range(N)]
    results = []
    for s in both(backend):
        x, i = per_replica(s, floats), per_replica(s, ints)
        out = s.run(lambda a, b: ctx().all_reduce(op, {"a": a, "b": b, "c": 1.5}), args=(x, i))
        results.append([*local(s, out["a"]), *local(s, out["b"]), *local(s, out["c"])])
    assert_same_bits(results[0], results[1])


def test_all_gather_and_cross_replica_reduce_gather(backend: XlaSpmdBackend) -> None:
    rng = np.random.default_rng(5)
    data = [wide(rng, (2, 3)) for _ in range(N)]
    results = []
    for s in both(backend):
        x = per_replica(s, data)
        gathered = s.run(lambda v: (ctx().all_gather(v, 0), ctx().all_gather(v, 1)), args=(x,))
        results.append(
            [
                *local(s, gathered[0]),
                *local(s, gathered[1]),
                s.extended.backend.to_numpy(s.reduce("SUM", x, axis=None)),
                s.extended.backend.to_numpy(s.reduce("MEAN", x, axis=None)),
                s.extended.backend.to_numpy(s.gather(x, 1)),
            ]
        )
    assert_same_bits(results[0], results[1])


@pytest.mark.parametrize(("op", "expected"), [("SUM", 16.0), ("MEAN", 4.0)])
def test_all_reduce_gradient_tf_rule(backend: XlaSpmdBackend, op: str, expected: float) -> None:
    s = pd.MirroredStrategy(backend=backend)

    def step(c: Any) -> Any:
        x = torch.tensor(42.0, requires_grad=True)
        (g,) = torch.autograd.grad(ctx().all_reduce(op, x) * c, x)
        return g

    c = per_replica(s, [np.float32(v) for v in (1.0, 3.0, 5.0, 7.0)])
    assert [float(g) for g in local(s, s.run(step, args=(c,)))] == [expected] * N


def test_all_gather_gradient_keeps_each_replicas_segment(backend: XlaSpmdBackend) -> None:
    s = pd.MirroredStrategy(backend=backend)

    def step(c: Any) -> Any:
        x = torch.ones(2, requires_grad=True)
        g = ctx().all_gather(x, 0)
        weights = torch.arange(8, dtype=torch.float32, device=g.device)
        (grad,) = torch.autograd.grad((g * weights * c).sum(), x)
        return grad

    c = per_replica(s, [np.float32(v) for v in (1.0, 1.0, 1.0, 1.0)])
    grads = local(s, s.run(step, args=(c,)))
    assert [g.tolist() for g in grads] == [[4.0 * (2 * r), 4.0 * (2 * r + 1)] for r in range(N)]


def test_merge_call_is_refused_with_the_reason(backend: XlaSpmdBackend) -> None:
    s = pd.MirroredStrategy(backend=backend)
    with pytest.raises(NotImplementedError, match="merge_call is not supported"):
        s.run(lambda: ctx().merge_call(lambda strategy: 1))


def test_per_replica_non_arrays_are_refused(backend: XlaSpmdBackend) -> None:
    s = pd.MirroredStrategy(backend=backend)
    with pytest.raises(TypeError, match="differs between replicas but is not an array"):
        s.run(lambda v: v, args=(pd.PerReplica(["a", "b", "c", "d"]),))


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_bool_sum_is_refused_by_core(backend: XlaSpmdBackend, op: str) -> None:
    # The backend has no bool check of its own: core refuses before the collective.
    s = pd.MirroredStrategy(backend=backend)
    flags = s.run(lambda: ctx().replica_id_in_sync_group > 1)
    message = rf"cannot SUM bool replica values: got bool\[\] for ReduceOp\.{op}"
    with pytest.raises(TypeError, match=message):
        s.reduce(op, flags, axis=None)
    with pytest.raises(TypeError, match=rf"got bool\[1\] for ReduceOp\.{op}"):
        s.run(lambda: ctx().all_reduce(op, torch.tensor([True])))


def test_training_with_gradients_of_a_shared_tensor(backend: XlaSpmdBackend) -> None:
    # Gradients of a tensor passed to every replica are computed and all-reduced
    # inside run; the update happens outside. The tensor stays usable afterwards
    # (torch-xla would mark it manual for good if it entered the program directly).
    s = pd.MirroredStrategy(backend=backend)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 3.0, 0.5])
    devices = s.extended.worker_devices
    xs = pd.PerReplica([backend.place(c, d) for c, d in zip(x.chunk(N), devices)])
    ys = pd.PerReplica([backend.place(c, d) for c, d in zip(y.chunk(N), devices)])

    def step(w: Any, xb: Any, yb: Any) -> Any:
        loss = ((xb @ w - yb) ** 2).sum() / 32
        (grad,) = torch.autograd.grad(loss, w)
        return ctx().all_reduce("SUM", grad), loss.detach()

    w = torch.zeros(4, device=backend.device, requires_grad=True)
    w_cpu = torch.zeros(4, requires_grad=True)
    for _ in range(5):
        grads, losses = s.run(step, args=(w, xs, ys))
        with torch.no_grad():
            w = (w - 0.1 * s.experimental_local_results(grads)[0]).requires_grad_()
        (grad_cpu,) = torch.autograd.grad(((x @ w_cpu - y) ** 2).sum() / 32, w_cpu)
        with torch.no_grad():
            w_cpu = (w_cpu - 0.1 * grad_cpu).requires_grad_()
    np.testing.assert_allclose(w.detach().cpu().numpy(), w_cpu.detach().numpy(), rtol=1e-5)
    assert float(s.reduce("SUM", losses, axis=None)) > 0


def test_registered_as_the_torch_xla_backend(backend: XlaSpmdBackend) -> None:
    from polydist.backend import available_backends, get_backend

    assert "torch_xla" in available_backends()
    registered = get_backend("torch_xla")
    assert isinstance(registered, XlaSpmdBackend) and registered.name == "torch_xla"
    assert not registered.capabilities.merge_call
    assert "merge_call" in XLA_UNSUPPORTED


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn"])
def test_low_precision_floats_round_trip_bit_for_bit(backend: XlaSpmdBackend, name: str) -> None:
    # As ml_dtypes' NumPy dtypes (what JAX and TF's .numpy() hand out), through an XLA device.
    ml_dtypes = pytest.importorskip("ml_dtypes")
    dtype = np.dtype(getattr(ml_dtypes, name))
    unsigned = np.uint16 if dtype.itemsize == 2 else np.uint8
    bits = np.array(
        [0x3F81, 0x8000, 0x7FC0, 0x0001] if dtype.itemsize == 2 else [0x39, 0x80, 0x7F, 0x01],
        unsigned,
    )
    placed = backend.place(bits.view(dtype), "/device:XLA:1")
    assert placed.device == backend.device and placed.dtype == getattr(torch, name)
    array = backend.to_numpy(placed)
    assert array.dtype == dtype and array.view(unsigned).tolist() == bits.tolist()
    assert backend.to_numpy(placed.cpu()).view(unsigned).tolist() == bits.tolist()


def test_one_replica_runs_without_spmd(backend: XlaSpmdBackend) -> None:
    # OneDeviceStrategy and MirroredStrategy(1): fn runs as ordinary torch-xla code; its
    # collectives are the identity and merge_call calls merge_fn.
    for s in (
        pd.OneDeviceStrategy("/device:XLA:0", backend=backend),
        pd.MirroredStrategy(1, backend=backend),
    ):
        assert s.num_replicas_in_sync == 1

        def fn(x: Any) -> Any:
            total = ctx().all_reduce("SUM", x * 2)
            return ctx().merge_call(lambda strategy, t: t + 1, args=(total,))

        out = s.run(fn, args=(backend.place(torch.arange(3.0), s.extended.worker_devices[0]),))
        assert out.device == backend.device and out.cpu().tolist() == [1.0, 3.0, 5.0]
        assert float(s.reduce("SUM", out, axis=0)) == 9.0
    with pytest.raises(ValueError, match="or a single replica"):
        pd.MirroredStrategy(["/device:XLA:0", "/device:XLA:1"], backend=backend)


def test_variables_in_cross_replica_context_match_the_sim(backend: XlaSpmdBackend) -> None:
    rng = np.random.default_rng(3)
    init, delta = wide(rng, (2, 3)), wide(rng, (2, 3))
    results = []
    for s in both(backend):
        with s.scope():
            v = pd.Variable(init, aggregation=pd.VariableAggregation.MEAN)
            seen = pd.Variable(
                np.ones(3, np.float32),
                synchronization=pd.VariableSynchronization.ON_READ,
                aggregation=pd.VariableAggregation.SUM,
            )
            v.assign_add(delta)
            v.assign_sub(v.read_value() * 0.5)
            seen.assign(np.full(3, 8.0, np.float32))  # every copy gets 8 / 4
        b = s.extended.backend
        results.append(
            [b.to_numpy(c.value()) for c in v.values]
            + [b.to_numpy(c.value()) for c in seen.values]
            + [b.to_numpy(seen.read_value())]
        )
    assert_same_bits(results[0], results[1])
    assert results[1][-1].tolist() == [8.0, 8.0, 8.0]


# -- TPUStrategy: the 4 XLA:CPU devices stand in for TPU cores ------------------------------

TPU = "/job:localhost/replica:0/task:0/device:TPU:{}"


def tpu_pair(
    backend: XlaSpmdBackend, order: list[int] | None = None
) -> tuple[pd.TPUStrategy, pd.TPUStrategy]:
    """(torch-xla, the sim's v4-8: 4 cores, XLA:CPU's summation order)."""
    from polydist.cluster_resolver import TPUClusterResolver
    from polydist.tpu import DeviceAssignment

    resolver = TPUClusterResolver("local", backend=backend)
    da = None
    if order is not None:
        topology = resolver.get_tpu_system_metadata().topology
        assert topology is not None
        da = DeviceAssignment(topology, [[[k, 0, 0, 0]] for k in order])
    return (
        pd.TPUStrategy(resolver, experimental_device_assignment=da, backend=backend),
        pd.TPUStrategy(TPUClusterResolver("v4-8"), backend=SimBackend("sequential")),
    )


def test_tpu_cores_are_the_xla_devices(backend: XlaSpmdBackend) -> None:
    from polydist.cluster_resolver import TPUClusterResolver
    from polydist.tpu import LocalTPUSystem

    assert backend.capabilities.tpu
    assert backend.local_tpu_system() == LocalTPUSystem(
        mesh_shape=(N, 1, 1, 1),
        device_coordinates=tuple((k, 0, 0, 0) for k in range(N)),
        stand_ins=backend.list_devices(),
    )
    resolver = TPUClusterResolver("local", backend=backend)
    metadata = resolver.get_tpu_system_metadata()
    assert (metadata.num_cores, metadata.num_hosts) == (N, 1)
    assert resolver.num_accelerators() == {"TPU": N}
    strategy = pd.TPUStrategy(resolver, backend=backend)
    assert strategy.extended.worker_devices == tuple(TPU.format(k) for k in range(N))
    assert strategy.extended.experimental_require_static_shapes


def test_tpu_strategy_matches_the_sim_bitwise(backend: XlaSpmdBackend) -> None:
    rng = np.random.default_rng(11)
    data = [wide(rng, (3, 5)) for _ in range(N)]
    results = []
    for s in tpu_pair(backend):
        x = per_replica(s, data)

        def step(v: Any) -> Any:
            c = ctx()
            return (
                type(c).__name__,
                c.all_reduce("SUM", v),
                c.all_gather(v, 0),
                c.replica_id_in_sync_group,
            )

        kind, total, gathered, ids = s.run(step, args=(x,))
        assert kind == "TPUReplicaContext"
        results.append(
            [
                *local(s, total),
                *local(s, gathered),
                *local(s, ids),
                s.extended.backend.to_numpy(s.reduce("MEAN", x, axis=None)),
                s.extended.backend.to_numpy(s.gather(x, 0)),
            ]
        )
    assert_same_bits(results[0], results[1])
    assert [int(i) for i in results[0][2 * N : 3 * N]] == list(range(N))


def test_device_assignment_orders_the_spmd_mesh(backend: XlaSpmdBackend) -> None:
    import torch_xla

    order = [3, 1, 0, 2]
    xla, sim = tpu_pair(backend, order)
    assert xla.extended.worker_devices == tuple(TPU.format(k) for k in order)
    rng = np.random.default_rng(12)
    data = [wide(rng, (64,)) for _ in range(N)]
    out = xla.run(lambda v: (v * 2, ctx().all_reduce("SUM", v)), args=(per_replica(xla, data),))
    # Replica r's shard is on XLA device order[r]: the mesh's device ids, in replica order.
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([xla.experimental_local_results(out[0])[0]])
    assert "devices=[4,1]3,1,0,2" in hlo
    # The all-reduce adds in replica order (its group lists the devices that way), as the
    # sim does; device order 0, 1, 2, 3 would round differently for these values.
    want = sim.run(lambda v: ctx().all_reduce("SUM", v), args=(per_replica(sim, data),))
    assert_same_bits(local(xla, out[1]), local(sim, want))


def test_tpu_gather_needs_the_same_shape(backend: XlaSpmdBackend) -> None:
    from polydist.errors import InvalidArgumentError

    s = tpu_pair(backend)[0]
    uneven = per_replica(s, [np.ones((r + 1,), np.float32) for r in range(N)])
    with pytest.raises(InvalidArgumentError, match="same shape on every replica"):
        s.gather(uneven, axis=0)


def test_tpu_variables_in_cross_replica_context(backend: XlaSpmdBackend) -> None:
    results = []
    for s in tpu_pair(backend):
        with s.scope():
            v = pd.Variable(np.arange(3, dtype=np.float32), aggregation=pd.VariableAggregation.MEAN)
        assert [c.device for c in v.values] == list(s.extended.worker_devices)
        v.assign_add(np.full(3, 0.5, np.float32))
        results.append([s.extended.backend.to_numpy(c.value()) for c in v.values])
    assert_same_bits(results[0], results[1])
    assert results[0][0].tolist() == [0.5, 1.5, 2.5]


def test_tpu_model_parallelism_is_refused_with_the_reason(backend: XlaSpmdBackend) -> None:
    from polydist.cluster_resolver import TPUClusterResolver
    from polydist.tpu import DeviceAssignment

    resolver = TPUClusterResolver("local", backend=backend)
    topology = resolver.get_tpu_system_metadata().topology
    assert topology is not None
    da = DeviceAssignment.build(topology, computation_shape=[2, 1, 1, 1], num_replicas=2)
    assert "tpu_model_parallelism" in XLA_UNSUPPORTED
    with pytest.raises(ValueError, match="needs one replica on every XLA device"):
        pd.TPUStrategy(resolver, experimental_device_assignment=da, backend=backend)
    one = DeviceAssignment(topology, [[[2, 0, 0, 0]]])
    s = pd.TPUStrategy(resolver, experimental_device_assignment=one, backend=backend)
    out = s.run(lambda: ctx().all_reduce("SUM", torch.ones(2)))
    assert s.extended.worker_devices == (TPU.format(2),)
    assert out.cpu().tolist() == [1.0, 1.0]
