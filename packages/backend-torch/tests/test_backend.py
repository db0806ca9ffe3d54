"""TorchBackend itself: the protocol, devices, placement and the list collectives."""

from __future__ import annotations

from typing import Any

import array_api_compat.torch
import numpy as np
import pytest
import torch

import polydist as pd
from polydist.backend import Backend, Capabilities, get_backend
from polydist_torch import TorchBackend, torch_device

CPU = "/job:localhost/replica:0/task:0/device:CPU:{}"
GPU = "/job:localhost/replica:0/task:0/device:GPU:{}"


def test_satisfies_the_backend_protocol_statically_and_at_runtime() -> None:
    backend: Backend = TorchBackend()  # mypy checks the protocol here
    assert isinstance(backend, Backend)
    assert backend.name == "torch"


def test_entry_point_resolves_by_name() -> None:
    backend = get_backend("torch")
    assert isinstance(backend, TorchBackend)
    assert "torch" in pd.available_backends()
    cpus = ["/cpu:0", "/cpu:1"]  # explicit: a count means GPUs where CUDA is present
    assert isinstance(pd.MirroredStrategy(cpus, backend="torch").extended.backend, TorchBackend)


def test_capabilities_are_declared_per_reduction() -> None:
    sequential = TorchBackend("sequential").capabilities
    assert sequential == Capabilities(
        execution_model="eager", reduction_orders=("sequential",), autodiff=True
    )
    assert TorchBackend("nccl").capabilities.reduction_orders == ()
    expected = "nccl" if torch.cuda.device_count() > 1 else "sequential"
    assert TorchBackend().reduction == expected


def test_unknown_reduction_is_refused() -> None:
    with pytest.raises(ValueError, match="Unknown reduction 'ring': expected 'auto'"):
        TorchBackend("ring")  # type: ignore[arg-type]


def test_runs_replicas_on_threads_not_greenlets() -> None:
    # torch keeps grad mode and autograd state per thread; greenlets would share them.
    assert TorchBackend().replica_runner.mode == "thread"


def test_array_namespace_is_array_api_compat_torch() -> None:
    xp = TorchBackend().array_namespace()
    # array_api_compat.torch itself, except asarray, which is explicit about autograd.
    assert xp.add is array_api_compat.torch.add and xp.float32 is torch.float32
    assert xp.__array_api_version__ == array_api_compat.torch.__array_api_version__
    p = torch.nn.Parameter(torch.ones(2))
    copy = xp.asarray(p, copy=True)  # no "unspecified requires_grad" warning (torch 2.13)
    assert copy is not p and copy.requires_grad and copy.grad_fn is not None
    assert xp.asarray(p) is p
    assert not xp.asarray(p, copy=True, requires_grad=False).requires_grad
    assert xp.asarray(np.arange(3)).dtype == torch.int64


@pytest.mark.skipif(torch.cuda.is_available(), reason="describes a machine without CUDA")
def test_without_cuda_n_replicas_are_virtual_cpus() -> None:
    backend = TorchBackend()
    assert backend.list_devices() == (CPU.format(0),)
    assert backend.replica_devices(None) == (CPU.format(0),)
    strategy = pd.MirroredStrategy(4, backend=backend)
    assert strategy.extended.worker_devices == tuple(CPU.format(i) for i in range(4))
    assert pd.MirroredStrategy(backend=backend).num_replicas_in_sync == 1
    with pytest.raises(ValueError, match=r"GPU:0' is not available: torch sees 0 CUDA"):
        pd.MirroredStrategy(["/gpu:0"], backend=backend)


def test_device_strings_map_to_torch_devices() -> None:
    assert torch_device("/cpu:3") == torch.device("cpu")
    assert torch_device(CPU.format(1)) == torch.device("cpu")
    assert torch_device("/gpu:1") == torch.device("cuda", 1)
    assert torch_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="cannot place values on '/tpu:0'.*XlaSpmdBackend"):
        torch_device("/tpu:0")


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        (["/tpu:0"], "runs replicas on CPU and CUDA devices"),
        (["/job:worker/task:1/device:CPU:0"], "another worker"),
        (["/cpu:1024"], "out of range"),
        (["/gpu:64"], "not available"),
    ],
)
def test_bad_devices_get_clear_errors(devices: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pd.MirroredStrategy(devices, backend=TorchBackend())


def test_too_many_virtual_replicas() -> None:
    backend = TorchBackend()
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA device"):
            backend.replica_devices(torch.cuda.device_count() + 1)
    else:
        with pytest.raises(ValueError, match="at most 1024"):
            backend.replica_devices(1025)


@pytest.mark.parametrize(
    "dtype", [np.float16, np.float32, np.float64, np.int8, np.int32, np.int64, np.bool_]
)
def test_place_keeps_dtype_and_copies(dtype: Any) -> None:
    backend = TorchBackend()
    array = np.arange(6).reshape(2, 3).astype(dtype)
    placed = backend.place(array, "/cpu:2")
    assert isinstance(placed, torch.Tensor) and placed.device == torch.device("cpu")
    back = backend.to_numpy(placed)
    assert back.dtype == array.dtype and back.tobytes() == array.tobytes()
    placed.zero_()  # a copy, as TF's convert_to_tensor makes
    assert back.tobytes() == array.tobytes() and np.any(array != 0)


def test_place_follows_tf_rules_for_python_values() -> None:
    backend = TorchBackend()
    assert backend.place(1, "/cpu:0").dtype == torch.int32
    assert backend.place(2**40, "/cpu:0").dtype == torch.int64
    assert backend.place(1.5, "/cpu:0").dtype == torch.float32
    assert backend.place([1.0, 2.0], "/cpu:0").dtype == torch.float32
    assert backend.place(np.float64(1.5), "/cpu:0").dtype == torch.float64
    readonly = np.arange(3.0)
    readonly.flags.writeable = False
    assert backend.place(readonly[::-1], "/cpu:0").tolist() == [2.0, 1.0, 0.0]


def test_place_keeps_a_tensor_already_there() -> None:
    backend = TorchBackend()
    param = torch.nn.Parameter(torch.ones(2))
    assert backend.place(param, "/cpu:1") is param  # a Parameter stays itself


def test_place_refuses_what_torch_cannot_hold() -> None:
    with pytest.raises(TypeError, match="cannot convert ndarray of dtype <U1"):
        TorchBackend().place(np.array(["a"]), "/cpu:0")


def test_to_numpy_copies_and_detaches() -> None:
    # bfloat16 and float8: tests/test_low_precision.py.
    backend = TorchBackend()
    t = torch.ones(3, requires_grad=True)
    a = backend.to_numpy(t)
    a[0] = 5
    assert t[0].item() == 1.0


def test_collectives_return_distinct_new_tensors() -> None:
    backend = TorchBackend()
    devices = [CPU.format(i) for i in range(3)]
    values = [torch.full((2,), float(i)) for i in range(3)]
    for out in (
        backend.all_reduce(values, devices),
        backend.all_gather(values, 0, devices),
        backend.broadcast(values[0], devices),
    ):
        ids = {id(t) for t in out} | {id(v) for v in values}
        assert len(ids) == len(out) + len(values)
    assert backend.reduce_to(values, CPU.format(0)).tolist() == [3.0, 3.0]


def test_bool_sum_is_refused_like_the_sim() -> None:
    # Core refuses before the collective (torch itself would OR the flags).
    strategy = pd.MirroredStrategy(["/cpu:0", "/cpu:1"], backend=TorchBackend())
    flags = pd.PerReplica([torch.tensor([True, False]), torch.tensor([True, True])])
    for op in ("SUM", "MEAN"):
        with pytest.raises(TypeError, match="cannot SUM bool replica values"):
            strategy.reduce(op, flags, axis=None)
    with pytest.raises(TypeError, match="cannot SUM bool replica values"):
        strategy.run(lambda: pd.get_replica_context().all_reduce("SUM", torch.tensor([True])))


def test_collectives_take_tensors() -> None:
    with pytest.raises(TypeError, match="value 1 is a ndarray"):
        TorchBackend().all_reduce([torch.ones(1), np.ones(1)], [CPU.format(0)] * 2)


def test_destinations_may_be_torch_device_strings() -> None:
    # Core passes str(tensor.device) ("cpu") when reducing onto a distributed value.
    out = TorchBackend().all_reduce([torch.ones(1), torch.ones(1)], ["cpu", "cpu"])
    assert [t.tolist() for t in out] == [[2.0], [2.0]]


def test_device_scope_places_new_tensors_and_keeps_backward_on_the_thread() -> None:
    import threading

    backend = TorchBackend()
    hooked: list[int] = []
    replica: list[int] = []

    def run() -> None:
        replica.append(threading.get_ident())
        with backend.device_scope("/cpu:1"):
            assert torch.zeros(1).device == torch.device("cpu")
            # CPU work runs on the calling thread anyway: the setting is left alone
            # (turning it off costs about 20 µs per backward pass).
            assert torch._C._is_multithreading_enabled()
            x = torch.ones(3, requires_grad=True)
            y = x * 2
            y.register_hook(lambda g: hooked.append(threading.get_ident()))
            y.sum().backward()
            assert x.grad is not None and x.grad.tolist() == [2.0, 2.0, 2.0]

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert hooked == replica and replica[0] != threading.get_ident()


def test_an_accelerator_scope_keeps_backward_off_autograds_device_threads() -> None:
    from polydist_torch._backend import _DeviceScope

    # A CUDA backward would run on autograd's device threads, away from the replica's
    # collectives: a non-CPU scope turns the engine's multithreading off, and restores it.
    scope = _DeviceScope(torch.device("meta"), default_device=False)
    with scope:
        assert not torch._C._is_multithreading_enabled()
    assert torch._C._is_multithreading_enabled()


def test_device_scope_overrides_a_different_default_device() -> None:
    backend = TorchBackend()
    with torch.device("meta"), backend.device_scope("/cpu:0"):
        assert torch.zeros(1).device == torch.device("cpu")


def test_replicas_see_their_device_scope() -> None:
    strategy = pd.MirroredStrategy(["/cpu:0", "/cpu:1"], backend=TorchBackend())
    devices = strategy.run(lambda: str(torch.empty(0).device))
    assert devices.values == ("cpu", "cpu")


def test_trace_records_torch_collectives() -> None:
    strategy = pd.MirroredStrategy(["/cpu:0", "/cpu:1"], backend=TorchBackend())
    with pd.trace() as t:
        strategy.run(lambda: pd.get_replica_context().all_reduce("SUM", torch.ones(4)))
    (event,) = t.events
    assert (event.op, event.dtype, event.nbytes, event.backend) == (
        "all_reduce",
        "float32",
        16,
        "torch",
    )


def test_replicas_inherit_the_callers_grad_inference_and_autocast_modes() -> None:
    strategy = pd.MirroredStrategy(["/cpu:0", "/cpu:1"], backend=TorchBackend())

    def fn() -> Any:
        x = torch.ones(2, 2, requires_grad=True)
        y = x @ x
        return y.requires_grad, y.dtype, torch.is_inference_mode_enabled()

    assert strategy.run(fn) == (True, torch.float32, False)
    with torch.no_grad():
        assert strategy.run(fn) == (False, torch.float32, False)
    with torch.inference_mode():
        assert strategy.run(fn) == (False, torch.float32, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert strategy.run(fn) == (True, torch.bfloat16, False)


def test_torch_xla_entry_point_says_how_to_install_it() -> None:
    import importlib.util

    from polydist.backend import available_backends

    if importlib.util.find_spec("torch_xla") is not None:
        pytest.skip("torch-xla is installed here")
    assert "torch_xla" in available_backends()
    with pytest.raises(ModuleNotFoundError) as caught:
        get_backend("torch_xla")
    message = str(caught.value)
    assert "pip install 'polydist-torch[xla]'" in message
    assert "torch-xla==2.9.0 needs torch==2.9.0 exactly" in message


@pytest.mark.parametrize("replica_default_device", [True, False])
def test_replica_default_device_decides_where_factories_land(
    replica_default_device: bool,
) -> None:
    # "meta" stands in for a default device that is not the replica's, as "cpu" is for
    # a GPU replica. torch's default device is per thread: one replica runs on this one.
    backend = TorchBackend(replica_default_device=replica_default_device)
    strategy = pd.MirroredStrategy(["/cpu:0"], backend=backend)
    torch.set_default_device("meta")
    try:
        made = strategy.run(lambda: torch.zeros(3))
    finally:
        torch.set_default_device(None)
    assert made.device.type == ("cpu" if replica_default_device else "meta")
    assert ("replica_default_device=False" in repr(backend)) is not replica_default_device


@pytest.mark.parametrize("value", ["abc", "-5", "0", "nan"])
def test_a_bad_timeout_variable_is_refused_with_cores_message(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """Issue 22 item 9: ``POLYDIST_TIMEOUT_SECONDS=-5`` was accepted silently on torch (a
    lone replica runs inline and never waits) and ``abc`` failed without naming it. torch
    reads it through core's one parser: when a backend is made (before a worker joins its
    cluster), and at each run of a strategy made before."""
    from polydist.backend import timeout_seconds_from_env as parse
    from polydist_torch import TorchProcessGroupBackend

    strategy = pd.MirroredStrategy(["/cpu:0"], backend=TorchBackend())
    monkeypatch.setenv("POLYDIST_TIMEOUT_SECONDS", value)
    with pytest.raises(ValueError) as expected:
        parse()
    message = str(expected.value)
    assert "POLYDIST_TIMEOUT_SECONDS" in message and repr(value) in message
    for make in (TorchBackend, TorchProcessGroupBackend):
        with pytest.raises(ValueError) as made:
            make()
        assert str(made.value) == message
    with pytest.raises(ValueError) as ran:
        strategy.run(lambda: pd.get_replica_context().all_reduce("SUM", 1.0))
    assert str(ran.value) == message
    # A backend given its timeout does not read the variable.
    assert TorchBackend(timeout_seconds=5.0).reduction == "sequential"


def test_device_scope_sees_torch_set_default_device() -> None:
    # The scope's cheap default-device test must agree with torch.get_default_device().
    from polydist_torch._backend import _default_device_is

    backend = TorchBackend()
    cpu = torch.device("cpu")
    assert _default_device_is(cpu) and not _default_device_is(torch.device("meta"))
    torch.set_default_device("meta")
    try:
        assert not _default_device_is(cpu) and _default_device_is(torch.device("meta"))
        with backend.device_scope("/cpu:0"):
            assert torch.zeros(1).device == cpu
        assert torch.zeros(1).device == torch.device("meta")
    finally:
        torch.set_default_device(None)
    with torch.device("meta"):
        assert not _default_device_is(cpu)
    assert _default_device_is(cpu)


def test_a_replicas_collectives_run_outside_its_default_device_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Under the replica's default-device mode every torch call of a collective's
    # bookkeeping passes through Python: all_reduce and all_gather leave the mode while
    # they run (TorchBackend.library_scope) and put it back, an error included. "meta"
    # as torch's default makes the CPU replica push its mode, as a GPU replica does.
    from torch.overrides import TorchFunctionMode

    backend = TorchBackend()
    strategy = pd.MirroredStrategy(["/cpu:0"], backend=backend)
    seen: list[int] = []
    all_reduce, all_gather = backend.all_reduce, backend.all_gather

    def counted_all_reduce(values: Any, destinations: Any) -> Any:
        seen.append(torch._C._len_torch_function_stack())
        return all_reduce(values, destinations)

    def counted_all_gather(values: Any, axis: int, destinations: Any) -> Any:
        seen.append(torch._C._len_torch_function_stack())
        return all_gather(values, axis, destinations)

    monkeypatch.setattr(backend, "all_reduce", counted_all_reduce)
    monkeypatch.setattr(backend, "all_gather", counted_all_gather)

    class Other(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            return func(*args, **(kwargs or {}))

    def fn() -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        depths = [torch._C._len_torch_function_stack()]
        total = ctx.all_reduce("SUM", [torch.ones(2), torch.full((3,), 2.0)])
        gathered = ctx.all_gather(torch.arange(2.0), axis=0)
        with pytest.raises(TypeError):
            ctx.all_reduce("SUM", object())
        depths.append(torch._C._len_torch_function_stack())
        with Other():  # a mode of the user's above it: the stack is left as it is
            ctx.all_reduce("SUM", torch.ones(1))
        return depths, total, gathered, torch.zeros(1).device

    torch.set_default_device("meta")
    try:
        depths, total, gathered, made = strategy.run(fn)
    finally:
        torch.set_default_device(None)
    assert depths == [1, 1]
    assert seen == [0, 0, 0, 2]
    assert made == torch.device("cpu")
    assert [t.tolist() for t in total] == [[1.0, 1.0], [2.0, 2.0, 2.0]]
    assert gathered.tolist() == [0.0, 1.0]
    assert "SupportsLibraryScope" in pd.backend.__all__
    assert pd.backend.features(backend).library_scope


def test_torch_optimizers_step_outside_a_replicas_default_device_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A plain torch.optim optimizer stepped in a replica (the TF idiom): torch's own step
    # runs without the replica's default-device mode (so state torch makes without
    # device=, Adamax's step counter, stays on the CPU on a GPU replica), a user's
    # override keeps it, and the mode is back after the step, also after one that raised.
    import polydist_torch._backend as backend_module

    # CPU replicas push the mode, as GPU replicas do (their device is torch's default).
    monkeypatch.setattr(backend_module, "_default_device_is", lambda device: False)

    class UsersSGD(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            return super().step(closure)

    strategy = pd.MirroredStrategy(["/cpu:0", "/cpu:1"], backend=TorchBackend())
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(3)]
    adamax, users = torch.optim.Adamax(params[:2]), UsersSGD(params[2:], lr=0.5)
    depths: dict[str, list[int]] = {"adamax": [], "users": []}
    for name, opt in (("adamax", adamax), ("users", users)):
        opt.register_step_pre_hook(
            lambda *_, name=name: depths[name].append(torch._C._len_torch_function_stack())
        )
    after: list[tuple[int, ...]] = []

    def fn() -> None:
        r = int(pd.get_replica_context().replica_id_in_sync_group)  # type: ignore[union-attr]
        if r == 0:
            for p in params:
                p.grad = torch.ones(3)
            adamax.step()
            users.step()
            after.append((torch._C._len_torch_function_stack(),))
            params[0].grad = torch.ones(3).to_sparse()
            with pytest.raises(RuntimeError, match="sparse"):
                adamax.step()
            raised = torch._C._len_torch_function_stack()  # the failed step kept it off
            params[0].grad = torch.ones(3)
            adamax.step()  # the next step's post hook puts it back
            after.append((raised, torch._C._len_torch_function_stack()))

    strategy.run(fn)
    assert depths["adamax"] == [0, 0, 0]
    assert set(depths["users"]) == {1}
    assert after == [(1,), (0, 1)]
    assert torch._C._len_torch_function_stack() == 0
    assert {str(v.device) for s in adamax.state.values() for v in s.values()} == {"cpu"}
    assert params[2].tolist() == [0.5, 0.5, 0.5]

    def failing() -> None:  # a step that raised and was not caught: the scope ends clean
        params[0].grad = torch.ones(3).to_sparse()
        adamax.step()

    with pytest.raises(RuntimeError, match="sparse"):
        strategy.run(failing)
    assert torch._C._len_torch_function_stack() == 0
    params[0].grad = torch.ones(3)
    strategy.run(lambda: adamax.step())
    assert torch._C._len_torch_function_stack() == 0
