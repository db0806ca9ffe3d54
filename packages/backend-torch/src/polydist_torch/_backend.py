"""The PyTorch backend: eager replicas on CPU and CUDA devices."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch.utils._device import DeviceContext

from polydist.backend import Capabilities, EagerReplicaRunner, default_timeout
from polydist.backend.devices import DeviceSpec
from polydist_torch import _collectives, _low_precision
from polydist_torch._autograd import TorchReplicaChannel
from polydist_torch._devices import (
    MAX_VIRTUAL_CPU_REPLICAS,
    canonical_device,
    cuda_device_count,
    torch_device,
)
from polydist_torch._storage import mark_variable_storage

if TYPE_CHECKING:
    from polydist.backend import ReplicaGroup

__all__ = ["Reduction", "TorchBackend", "TorchReplicaRunner"]

Reduction = Literal["auto", "sequential", "nccl"]
_VERSION = "0.1.0"  # keep in step with pyproject.toml


class TorchBackend:
    """Runs polydist strategies on torch tensors, one process, CPU and CUDA devices.

    ``MirroredStrategy(backend="torch")`` uses every CUDA device, or the CPU
    if there is none. ``MirroredStrategy(N, backend="torch")`` takes the first
    N CUDA devices; without CUDA it gives N *virtual* CPU replicas
    (``/cpu:0`` .. ``/cpu:N-1``), all computing on torch's one ``cpu`` device,
    which is how to develop and test multi-replica code on a laptop.

    Replicas run one at a time, each on its own pooled thread (torch keeps
    grad mode and autograd state per thread), and meet at every collective.
    Collectives are differentiable (see ``polydist_torch._autograd``).

    Args:
        reduction: how cross-replica sums are computed. ``"sequential"`` adds
            in replica order, ``((x0 + x1) + x2) + ...``, bit for bit the sim's
            ``"sequential"`` order, on any devices. ``"nccl"`` uses
            ``torch.cuda.comm.reduce_add`` (NCCL) when every replica has its own
            CUDA device, and the sequential sum otherwise. ``"auto"`` (default)
            is ``"nccl"`` with two or more CUDA devices, else ``"sequential"``.
        timeout_seconds: how long one replica may run between two collectives
            before it is reported as stuck (default ``$POLYDIST_TIMEOUT_SECONDS``
            or 300; a variable that is not a positive number of seconds raises
            ``ValueError`` here, through core's parser).
        replica_default_device: whether factory functions called in a replica
            without ``device=`` (``torch.zeros(3)``) make their tensor on the
            replica's device, as TF places a replica's ops (default ``True``). It
            uses ``torch.device`` as a context, a torch function mode that every
            torch call in the replica then passes through: on a GPU that costs a
            few microseconds per call (measured on an H200: 0.35 ms on a 1.6 ms
            MLP step, ``docs/backends/torch.md``). ``False`` keeps torch's default
            device, as ``DataParallel`` does; the current CUDA device is the
            replica's either way.
    """

    name = "torch"
    version = _VERSION
    # place() copies a NumPy array (a private C-ordered copy, or one through pinned
    # memory to a GPU): core makes a variable from one without a host copy first.
    place_copies_host_arrays = True

    def __init__(
        self,
        reduction: Reduction = "auto",
        *,
        timeout_seconds: float | None = None,
        replica_default_device: bool = True,
    ):
        if reduction not in ("auto", "sequential", "nccl"):
            raise ValueError(
                f"Unknown reduction {reduction!r}: expected 'auto', 'sequential' or 'nccl'."
            )
        if timeout_seconds is None:
            # Core's parser of $POLYDIST_TIMEOUT_SECONDS, now rather than at the first run:
            # a bad value fails before a worker joins its cluster (the runner reads it
            # again at each run, so a later change still counts).
            default_timeout()
        if reduction == "auto":
            reduction = "nccl" if cuda_device_count() > 1 else "sequential"
        self.reduction: _collectives.Algorithm = reduction
        self.replica_default_device = replica_default_device
        self.capabilities = Capabilities(
            execution_model="eager",
            # NCCL's summation order is its own; only the sequential sum is reproducible.
            reduction_orders=("sequential",) if reduction == "sequential" else (),
            autodiff=True,
            multi_worker=False,
            tpu=False,
            dynamic_shapes=True,
            float64=True,
            uneven_gather=True,
        )
        # Threads, not greenlets: torch's grad mode, autograd engine state and
        # device guards are per thread, and a greenlet switch would mix them up.
        #: How core runs the replicas (``polydist.backend.SupportsReplicaRunner``).
        # Replica ids placed when asked for (a torch placement is eager, wherever made).
        self.replica_runner: EagerReplicaRunner = TorchReplicaRunner(
            "thread", timeout_seconds, wrap_channel=TorchReplicaChannel, lazy_replica_id=True
        )

    def __repr__(self) -> str:
        extra = "" if self.replica_default_device else ", replica_default_device=False"
        return f"TorchBackend(reduction={self.reduction!r}{extra})"

    # -- devices -------------------------------------------------------------------
    def array_namespace(self) -> Any:
        from polydist_torch import _namespace

        return _namespace

    def list_devices(self) -> tuple[str, ...]:
        gpus = cuda_device_count()
        return (canonical_device("CPU", 0), *(canonical_device("GPU", i) for i in range(gpus)))

    def replica_devices(self, count: int | None) -> tuple[str, ...]:
        gpus = cuda_device_count()
        if count is None:
            if gpus:
                return tuple(canonical_device("GPU", i) for i in range(gpus))
            return (canonical_device("CPU", 0),)
        if gpus:
            if count > gpus:
                raise ValueError(
                    f"MirroredStrategy({count}) asks for {count} replicas, but torch sees "
                    f"{gpus} CUDA device(s). Ask for at most {gpus}, or name virtual CPU "
                    f"replicas explicitly: devices=[f'/cpu:{{i}}' for i in range({count})]."
                )
            return tuple(canonical_device("GPU", i) for i in range(count))
        if count > MAX_VIRTUAL_CPU_REPLICAS:
            raise ValueError(
                f"MirroredStrategy({count}) asks for {count} virtual CPU replicas; the torch "
                f"backend runs at most {MAX_VIRTUAL_CPU_REPLICAS}."
            )
        return tuple(canonical_device("CPU", i) for i in range(count))

    def validate_devices(self, devices: Sequence[str]) -> None:
        gpus = cuda_device_count()
        for d in devices:
            spec = DeviceSpec.parse(d)
            if spec.job != "localhost" or spec.task != 0:
                raise ValueError(
                    f"Device {d!r} is on another worker; single-machine strategies take "
                    "devices of this machine (/job:localhost/task:0)."
                )
            if spec.device_type == "CPU":
                if spec.device_index >= MAX_VIRTUAL_CPU_REPLICAS:
                    raise ValueError(
                        f"Device {d!r} is out of range: the torch backend runs virtual CPU "
                        f"replicas /cpu:0 .. /cpu:{MAX_VIRTUAL_CPU_REPLICAS - 1}."
                    )
            elif spec.device_type == "GPU":
                if spec.device_index >= gpus:
                    available = f"/gpu:0 .. /gpu:{gpus - 1}" if gpus else "none"
                    raise ValueError(
                        f"Device {d!r} is not available: torch sees {gpus} CUDA device(s) "
                        f"(available: {available}). Name an available GPU, or use virtual CPU "
                        "replicas ('/cpu:0', '/cpu:1', ...)."
                    )
            else:
                torch_device(d)  # raises the message for TPU/XLA devices

    def device_scope(self, device: str) -> contextlib.AbstractContextManager[Any]:
        return _DeviceScope(torch_device(device), self.replica_default_device)

    def library_scope(self) -> contextlib.AbstractContextManager[Any]:
        # polydist.backend.SupportsLibraryScope: a replica's all_reduce/all_gather run
        # outside its default-device mode (they name their devices).
        return _OutsideDefaultDevice()

    def place(self, value: Any, device: str) -> Any:
        target = torch_device(device)
        if isinstance(value, torch.Tensor):
            if value.device == target:
                return value  # a .to call would cost a pass through a replica's mode
            # A copy from pinned host memory to a GPU may run asynchronously; torch
            # orders it before any later use of the result on the GPU's stream.
            pinned = target.type == "cuda" and value.device.type == "cpu" and value.is_pinned()
            return value.to(target, non_blocking=pinned)
        if target.type == "cuda":
            return _low_precision.from_host(value, "torch backend", lambda a: _to_cuda(a, target))
        if type(value) is np.ndarray and value.ndim == 0 and value.dtype in _PLAIN_SCALAR_DTYPES:
            # A scalar of a dtype torch shares (the replica id each replica gets at every
            # run): its own copy, without the general conversion's checks.
            return torch.from_numpy(value.copy())
        # A private C-ordered copy, as TF's convert_to_tensor makes (replicas may update
        # it in place); it also takes read-only and negative-stride arrays.
        return _low_precision.from_host(value, "torch backend", _host_copy)

    def place_variable(self, value: Any, device: str) -> Any:
        """A variable's value on ``device`` (core's ``SupportsPlaceVariable``): as
        ``place``, except that a host array for a GPU is copied from pageable memory
        (`_to_cuda_once`), not staged in a page-locked buffer: torch's pinned allocator
        keeps such buffers for reuse, which suits a batch each step, while a variable's
        initial value would leave host memory of its size (rounded up to a power of 2)
        held for good (measured: 515 MB more RSS for a 400 MB variable on one H200)."""
        target = torch_device(device)
        if target.type == "cuda" and not isinstance(value, torch.Tensor):
            return _low_precision.from_host(
                value, "torch backend", lambda a: _to_cuda_once(a, target)
            )
        return self.place(value, device)

    def to_numpy(self, value: Any) -> np.ndarray:
        if not isinstance(value, torch.Tensor):
            return np.asarray(value)
        tensor = value.detach()
        # bfloat16 and float8_* as ml_dtypes' dtypes, bit for bit (float32 without ml_dtypes).
        array = _low_precision.numpy_of(tensor)
        # On the CPU ``numpy()`` shares memory with the tensor; hand out a copy.
        return array.copy() if tensor.device.type == "cpu" else array

    def store_variable(self, stored: Any, new: Any) -> Any:
        """What a variable component stores when its value becomes ``new`` (core's
        ``polydist.backend.SupportsStoreVariable``).

        Stored values never carry autograd history (an assignment is not
        differentiable, as in TF). A component whose storage is a
        ``torch.nn.Parameter`` (see :func:`polydist_torch.parameters`) keeps that
        very object: ``new`` is copied into it in place, without recording the
        copy for autograd, so optimizers holding the parameter see the new value.
        """
        if isinstance(new, torch.Tensor) and new.requires_grad:
            new = new.detach()
        if isinstance(stored, torch.nn.Parameter) and stored is not new:
            with torch.no_grad():
                stored.copy_(new)
            return stored
        # Marked, so that a one-replica all_reduce hands back a copy of it, not the
        # storage itself (which later writes may change in place; see _storage.py).
        mark_variable_storage(new)
        return new

    def update_in_place(self, stored: Any, op: str, delta: Any, *, exclusive: bool) -> bool:
        """``assign_add`` / ``assign_sub`` written into the stored tensor itself
        (core's optional hook, see ``polydist._valuetypes.variables``), as hand-written
        ``p.add_(delta)`` does: a step holds its state once, not twice.

        Only where nothing else can see the old value: no Python reference to the
        tensor but the variable's (``exclusive``), no other tensor on its memory (a
        view, ``t.numpy()``, a DLPack export) and no autograd record of it (a
        graph not yet run backward). Otherwise the update stores a new tensor (TF's
        copy on write), so a tensor read before the update keeps its value. A
        ``torch.nn.Parameter`` (``polydist_torch.parameters``) is updated in place
        regardless: it is the live parameter by design.
        """
        if not (isinstance(stored, torch.Tensor) and isinstance(delta, torch.Tensor)):
            return False
        if (
            stored.device.type not in ("cpu", "cuda")  # torch-xla: functional anyway
            or stored.layout is not torch.strided
            or stored.is_conj()
            or stored.is_neg()
            or (delta.device, delta.dtype) != (stored.device, stored.dtype)
            or delta.shape != stored.shape
            or (stored.is_inference() and not torch.is_inference_mode_enabled())
        ):
            return False
        if isinstance(stored, torch.nn.Parameter):
            if _same_memory(stored, delta):
                return False
        elif stored.requires_grad or not (exclusive and _tensor_alone(stored)):
            return False
        with torch.no_grad():
            if op == "add":
                stored.add_(delta)
            elif op == "subtract":
                stored.sub_(delta)
            else:
                return False
        return True

    # -- collectives -----------------------------------------------------------------
    def all_reduce(self, values: Sequence[Any], destinations: Sequence[str]) -> list[Any]:
        return _collectives.all_reduce(_tensors(values), destinations, self.reduction)

    def reduce_to(self, values: Sequence[Any], destination: str) -> Any:
        return _collectives.reduce_to(_tensors(values), destination, self.reduction)

    def all_gather(
        self, values: Sequence[Any], axis: int, destinations: Sequence[str]
    ) -> list[Any]:
        return _collectives.all_gather(_tensors(values), axis, destinations, self.reduction)

    def broadcast(self, value: Any, destinations: Sequence[str]) -> list[Any]:
        tensor = value if isinstance(value, torch.Tensor) else self.place(value, "/cpu:0")
        return _collectives.broadcast(tensor, destinations, self.reduction)


def _storage_refs(tensor: torch.Tensor) -> int | None:
    """References to ``tensor``'s memory (torch's private counts; None without them)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return int(count(tensor.untyped_storage()._cdata))


def _tensor_alone(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the only holder of its memory: no other tensor (a view), no
    NumPy array or DLPack capsule on it, no autograd node that saved it."""
    use_count = getattr(tensor, "_use_count", None)
    storage = _storage_refs(tensor)
    if use_count is None or storage is None or _STORAGE_ALONE is None:
        return False  # torch's private counts are gone: never in place
    return int(use_count()) == 1 and storage <= _STORAGE_ALONE


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


#: `_storage_refs` of a tensor alone (its own reference, and the call's storage object).
_STORAGE_ALONE = _storage_refs(torch.zeros(1))


class TorchReplicaRunner(EagerReplicaRunner):
    """Core's eager runner, carrying the caller's torch modes into the replica threads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lone_inline = self.runs_inline(1)  # fixed by the mode; asked at every run

    def run(
        self,
        group: ReplicaGroup,
        fn: Callable[..., Any],
        per_replica_args: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
    ) -> list[Any]:
        if len(per_replica_args) == 1 and self._lone_inline:
            return super().run(group, fn, per_replica_args)  # on this thread
        # Replicas run on other threads, and torch's grad, inference and autocast modes
        # are per thread: carry the caller's into every replica, as DataParallel does.
        state = _ThreadState.capture()

        def replica_fn(*args: Any, **kwargs: Any) -> Any:
            with state.apply():
                return fn(*args, **kwargs)

        return super().run(group, replica_fn, per_replica_args)


_PLAIN_SCALAR_DTYPES = frozenset(
    np.dtype(t) for t in (np.bool_, np.int32, np.int64, np.float32, np.float64)
)


def _host_copy(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array, order="C", copy=True))


def _to_cuda(array: np.ndarray, target: torch.device) -> torch.Tensor:
    """A NumPy array on a CUDA device, through pinned (page-locked) host memory.

    One host copy into a pinned buffer, then an asynchronous (``non_blocking``)
    copy to the GPU, as ``DataLoader(pin_memory=True)`` + ``.to(device,
    non_blocking=True)`` does: the host goes on (e.g. to the next replica's
    batch) while the copy runs. torch's pinned-memory allocator keeps the buffer
    until the copy is done, and the GPU's stream runs the copy before any later
    work on the result.
    """
    dtype = torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype
    # device="cpu": inside a GPU replica torch's default device is the GPU.
    host = torch.empty(array.shape, dtype=dtype, pin_memory=True, device="cpu")
    if array.size:
        host.numpy()[...] = array
    return host.to(target, non_blocking=True)


def _to_cuda_once(array: np.ndarray, target: torch.device) -> torch.Tensor:
    """A NumPy array on a CUDA device, copied from pageable host memory (as
    ``torch.tensor(array, device=...)``): the copy completes before the host goes on,
    and no page-locked buffer is left behind (see `TorchBackend.place_variable`)."""
    host = np.require(array, requirements=("C_CONTIGUOUS", "WRITEABLE"))
    return torch.from_numpy(host).to(target)


def _tensors(values: Sequence[Any]) -> list[torch.Tensor]:
    for r, v in enumerate(values):
        if not isinstance(v, torch.Tensor):
            raise TypeError(
                f"The torch backend's collectives take torch tensors; value {r} is a "
                f"{type(v).__name__}. Place values with backend.place(value, device) first."
            )
    return list(values)


class _ThreadState:
    """The calling thread's torch modes that replica threads should share.

    Entered once per replica per run: a plain class, and in the common case (no
    inference mode, no autocast) only the grad mode is set and restored.
    """

    __slots__ = ("autocast", "grad", "inference")

    def __init__(
        self, grad: bool, inference: bool, autocast: tuple[tuple[str, torch.dtype], ...]
    ) -> None:
        self.grad = grad
        self.inference = inference
        self.autocast = autocast

    @staticmethod
    def capture() -> _ThreadState:
        autocast = tuple(
            (kind, torch.get_autocast_dtype(kind))
            for kind in ("cpu", "cuda")
            if torch.is_autocast_enabled(kind)
        )
        return _ThreadState(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast)

    def apply(self) -> contextlib.AbstractContextManager[None]:
        if self.inference or self.autocast:
            return self._apply_all()
        return _GradMode(self.grad)

    @contextlib.contextmanager
    def _apply_all(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for kind, dtype in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype))
            yield


class _GradMode:
    """``torch.set_grad_enabled(mode)`` as a context, without its decorator machinery."""

    __slots__ = ("_mode", "_previous")

    def __init__(self, mode: bool) -> None:
        self._mode = mode
        self._previous = True

    def __enter__(self) -> None:
        self._previous = torch.is_grad_enabled()
        torch._C._set_grad_enabled(self._mode)

    def __exit__(self, *exc: object) -> None:
        torch._C._set_grad_enabled(self._previous)


_CPU = torch.device("cpu")
# Where torch.set_default_device keeps the default, per thread (torch >= 2.3); None on
# older versions, which then take torch.get_default_device's answer every time.
_GLOBAL_DEVICE_CONTEXT: threading.local | None = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)
if not isinstance(_GLOBAL_DEVICE_CONTEXT, threading.local):
    _GLOBAL_DEVICE_CONTEXT = None


def _default_device_is(device: torch.device) -> bool:
    """``torch.get_default_device() == device``, cheaply in the common case.

    ``get_default_device`` makes a tensor to learn the default's index (tens of
    microseconds on a loaded CPU); with no torch function mode on this thread and no
    ``torch.set_default_device`` in force, the default is the CPU, which this says
    without one."""
    if (
        _GLOBAL_DEVICE_CONTEXT is not None
        # This thread's attributes: getattr with a default raises and catches an
        # AttributeError where set_default_device was never called (~1 µs per scope).
        and _GLOBAL_DEVICE_CONTEXT.__dict__.get("device_context") is None
        and torch._C._len_torch_function_stack() == 0
    ):
        return device == _CPU
    return torch.get_default_device() == device


class _OutsideDefaultDevice:
    """polydist's own work in a replica (`TorchBackend.library_scope`), with the thread's
    default-device mode (`_DeviceScope`'s, or the user's ``torch.set_default_device``)
    off the torch function mode stack while it runs: under the mode every torch call
    and tensor attribute read goes through Python (about 2 µs each), and a collective's
    bookkeeping makes several per array. Only where that mode is the stack's one mode;
    any other mode stays (and keeps the default-device mode under it).
    """

    __slots__ = ("_mode",)

    def __init__(self) -> None:
        self._mode: Any = None

    def __enter__(self) -> None:
        if torch._C._len_torch_function_stack() == 1:
            mode = torch._C._get_function_stack_at(0)
            if type(mode) is DeviceContext:
                torch._C._pop_torch_function_stack()
                self._mode = mode

    def __exit__(self, *exc: object) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            torch._C._push_on_torch_function_stack(mode)


_TORCH_MADE: dict[tuple[type, str], bool] = {}


def torch_made(obj: object, method: str) -> bool:
    """Whether ``type(obj).<method>`` is torch's own (``torch.optim.Adam.step``), not a
    user's override."""
    key = (type(obj), method)
    made = _TORCH_MADE.get(key)
    if made is None:
        fn = getattr(type(obj), method, None)
        made = _TORCH_MADE[key] = str(getattr(fn, "__module__", "")).startswith("torch.")
    return made


# Per thread: the default-device mode a replica's `_DeviceScope` pushed ("mode"), and the
# torch.optim optimizer whose step runs with it taken off ("suspended").
_SCOPE = threading.local()
_OPTIMIZER_HOOKS: list[Any] = []


def _step_pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch's own optimizers step outside the replica's default-device mode (a global
    step hook, registered when a replica first pushes that mode).

    torch.optim makes some state without ``device=`` and means the CPU (the step
    counters of Adadelta, Adamax, NAdam, RAdam, RMSprop and ASGD): under the mode
    they would land on the replica's GPU, where Adamax, NAdam, RAdam and ASGD's
    ``.item()`` of them at each step would wait for the GPU. Outside it they are
    where torch puts them, and the step's torch calls skip the mode. A user's
    override of ``step`` keeps the mode."""
    mode = _SCOPE.__dict__.get("mode")
    if (
        mode is not None
        and torch._C._len_torch_function_stack() == 1
        and torch._C._get_function_stack_at(0) is mode
        and torch_made(optimizer, "step")
    ):
        torch._C._pop_torch_function_stack()
        _SCOPE.suspended = optimizer


def _step_post_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _SCOPE.__dict__.get("suspended") is optimizer:
        _resume_mode()


def _resume_mode() -> None:
    """Puts back the mode `_step_pre_hook` took off (a step that raised gets no post
    hook: the scope's exit, or the next step's, puts it back)."""
    _SCOPE.suspended = None
    torch._C._push_on_torch_function_stack(_SCOPE.mode)


def _register_optimizer_hooks() -> None:
    if not _OPTIMIZER_HOOKS:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        _OPTIMIZER_HOOKS.append(register_optimizer_step_pre_hook(_step_pre_hook))
        _OPTIMIZER_HOOKS.append(register_optimizer_step_post_hook(_step_post_hook))


def _push_replica_mode(device: torch.device) -> Any:
    """``torch.device(device)`` as this thread's replica default-device mode."""
    mode: Any = DeviceContext(device)
    mode.__enter__()
    _SCOPE.mode, _SCOPE.suspended = mode, None
    if not _OPTIMIZER_HOOKS:
        _register_optimizer_hooks()
    return mode


def _pop_replica_mode(mode: Any) -> None:
    if _SCOPE.__dict__.get("suspended") is not None:  # a torch.optim step raised
        _resume_mode()
    _SCOPE.mode = None
    mode.__exit__(None, None, None)


class _DeviceScope:
    """A replica's device scope (``TorchBackend.device_scope``): entered at every run by
    every replica, so a plain class rather than a generator and an ``ExitStack``.

    * on an accelerator, the autograd engine's multithreading is off, so that a
      replica's backward pass stays on its own thread (the engine otherwise runs CUDA
      work on device threads) and its collectives can rendezvous; the setting is per
      thread and restored. CPU work always runs on the calling thread, and turning it
      off there costs about 20 µs per backward pass, so CPU replicas leave it alone;
    * on CUDA the current device is the replica's;
    * with ``default_device``, ``torch.device`` as a context (a torch function mode)
      makes factory functions land on the replica's device; skipped when that is
      already torch's default (always so for CPU replicas), which spares every torch
      call in the replica a pass through the mode.
    """

    __slots__ = ("_cpu", "_cuda", "_default", "_device", "_mode", "_multithreading")

    def __init__(self, device: torch.device, default_device: bool) -> None:
        self._device = device
        self._cpu = device.type == "cpu"
        self._default = default_device
        self._cuda: Any = None
        self._mode: Any = None
        self._multithreading = True

    def __enter__(self) -> None:
        if self._cpu:  # entered by every CPU replica at every run: the least work
            if self._default and not _default_device_is(_CPU):
                self._mode = _push_replica_mode(_CPU)
            return
        self._multithreading = torch._C._is_multithreading_enabled()
        torch._C._set_multithreading_enabled(False)
        try:
            if self._device.type == "cuda":
                cuda: Any = torch.cuda.device(self._device)
                cuda.__enter__()
                self._cuda = cuda
            if self._default and not _default_device_is(self._device):
                self._mode = _push_replica_mode(self._device)
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: object) -> None:
        mode, cuda, self._mode, self._cuda = self._mode, self._cuda, None, None
        if self._cpu:
            if mode is not None:
                _pop_replica_mode(mode)
            return
        try:
            if mode is not None:
                _pop_replica_mode(mode)
        finally:
            try:
                if cuda is not None:
                    cuda.__exit__(None, None, None)
            finally:
                torch._C._set_multithreading_enabled(self._multithreading)
