"""The JAX backend: devices, placement, compiled ``run`` and cross-replica collectives."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from typing import TYPE_CHECKING, Any, Literal

import jax
import numpy as np

from polydist.backend import (
    NOT_HANDLED,
    Capabilities,
    EagerReplicaRunner,
    ReplicaChannel,
    replica_group,
)
from polydist.backend.tracing import current_update_replica
from polydist.backend.values import select_replica
from polydist_jax import _collectives, _devices, _functional, _input, _namespace, _tpu
from polydist_jax._eager_grad import DifferentiableChannel, MovedArrays
from polydist_jax._lazy import is_tracer
from polydist_jax._spmd import CompiledRunner, Uneven
from polydist_jax._typed import x64_enabled

if TYPE_CHECKING:
    from polydist import Strategy
    from polydist.backend import ReplicaGroup
    from polydist.tpu import LocalTPUSystem

__all__ = ["JaxBackend"]

_VERSION = "0.1.0"


class JaxBackend:
    """polydist on JAX: ``strategy.run`` compiles with ``jax.jit`` over ``jax.shard_map``.

    Args:
        jit: compile ``strategy.run`` (default). ``False`` runs each replica eagerly,
            one after the other (like the sim), for debugging with ``print`` and
            Python control flow on replica ids.
        eager_fallback: what to do when per-replica inputs cannot share one compiled
            program (different shapes on different replicas, e.g. a partial last
            batch, or Python objects that differ). ``True`` (default) runs that call
            eagerly, which is correct but slow; ``False`` raises ``ValueError``.
        timeout_seconds: for eager runs, how long one replica may run between two
            collectives (default ``$POLYDIST_TIMEOUT_SECONDS`` or 300).

    JAX's x64 mode is read once, here: with it off (JAX's default) there is no
    float64, so the MEAN of integers comes back as float32 instead
    of TF's float64, and ``capabilities.float64`` is False. Enable it with
    ``jax.config.update("jax_enable_x64", True)`` before creating the backend.
    """

    name = "jax"
    version = _VERSION
    # place() copies a NumPy array (`_collectives.host_copy`): core makes a variable
    # from one without a host copy first (see polydist._valuetypes.variables).
    place_copies_host_arrays = True

    def __init__(
        self,
        *,
        jit: bool = True,
        eager_fallback: bool = True,
        timeout_seconds: float | None = None,
    ) -> None:
        self.jit = jit
        self.eager_fallback = eager_fallback
        self.jax_version: str = jax.__version__
        kind = _devices.default_kind()
        self.capabilities = Capabilities(
            execution_model="spmd" if jit else "eager",
            # XLA's CPU all-reduce adds in mesh order; GPU/TPU all-reduce orders are not fixed.
            reduction_orders=("sequential",) if kind == "CPU" else (),
            autodiff=True,
            multi_worker=False,
            # TPUStrategy on TPUClusterResolver("local"): JAX's TPUs, or where there are
            # none, its CPU/GPU devices standing in for TPU cores (polydist_jax._tpu).
            tpu=True,
            # Only the devices of this process: no simulated slices or clusters.
            simulated_clusters=False,
            # Replicas may hold differently sized values: such calls run eagerly.
            dynamic_shapes=eager_fallback or not jit,
            float64=x64_enabled(),
            uneven_gather=True,
            # Compiled runs functionalize variables (polydist_jax._functional).
            variables_in_replica_context=True,
        )
        self._compiled = CompiledRunner()
        # Threads, not greenlets: JAX keeps its trace state per thread, and a replica
        # switched out in the middle of jax.grad would see another replica's trace.
        # merge_fn's arrays reach each eager replica on its own device (_eager_grad).
        self._moved = MovedArrays()
        #: How core runs the replicas when ``jit=False`` (its execution model is then
        #: eager), and how this backend runs a call it cannot compile.
        self._eager = _EagerRunner(
            self._moved, "thread", timeout_seconds, wrap_channel=self._eager_channel
        )
        self.replica_runner: EagerReplicaRunner = self._eager
        #: Calls of strategy.run that ran eagerly because their inputs were uneven.
        self.eager_fallback_count = 0

    def __repr__(self) -> str:
        return (
            f"JaxBackend(jit={self.jit}, jax={self.jax_version}, platform={jax.default_backend()})"
        )

    # -- compile statistics ------------------------------------------------------------
    @property
    def compile_count(self) -> int:
        """How many times a replica function was traced for compilation (all strategies)."""
        return self._compiled.compile_count

    @property
    def lane_count(self) -> int:
        """How many one-device lanes were made (all strategies): each compiles its
        program once more (docs/backends/jax.md, "The lane")."""
        return self._compiled.lane_count

    def cache_size(self, strategy: Any = None) -> int:
        """Compiled programs cached, for one strategy (or its ``extended``) or in total."""
        extended = getattr(strategy, "extended", strategy)
        return self._compiled.cache_size(extended)

    def clear_cache(self) -> None:
        """Drops every compiled program (the next run of each function recompiles)."""
        self._compiled.clear_cache()

    def lower(
        self,
        strategy: Strategy,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> jax.stages.Lowered:
        """The program ``strategy.run(fn, args, kwargs)`` runs, lowered but not run.

        ``.as_text()`` is its StableHLO, ``.compile().as_text()`` the optimized
        HLO: use it to check which collectives a step compiles to. Like TF's
        ``experimental_get_compiler_ir``. Lowering traces ``fn`` (and caches
        the program, so a later ``run`` with the same signature does not).
        """
        extended = strategy.extended
        if extended.backend is not self:
            raise ValueError(
                f"lower() needs a strategy on this backend, got one on {extended.backend!r}."
            )
        args, kwargs = tuple(args), dict(kwargs or {})
        n = strategy.num_replicas_in_sync
        per_replica = [(select_replica(r, args), select_replica(r, kwargs)) for r in range(n)]
        group = replica_group(strategy)
        try:
            with strategy.scope():
                lowered: jax.stages.Lowered = self._compiled.lower(group, fn, per_replica)
        except Uneven as e:
            raise ValueError(
                f"{_name(fn)} has no single compiled program for these inputs: {e.reason}. "
                "strategy.run would run it eagerly; lower() needs the same shapes and dtypes "
                "on every replica."
            ) from None
        return lowered

    # -- devices -------------------------------------------------------------------------
    def array_namespace(self) -> Any:
        """``jax.numpy``, with core's exact division for MEAN (``polydist_jax._namespace``)."""
        return _namespace

    def list_devices(self) -> tuple[str, ...]:
        kinds = [_devices.default_kind()]
        if "CPU" not in kinds:
            kinds.append("CPU")
        return tuple(_devices.device_string(d) for k in kinds for d in _devices.platform_devices(k))

    def replica_devices(self, count: int | None) -> tuple[str, ...]:
        kind = _devices.default_kind()
        devices = _devices.platform_devices(kind)
        if count is None:
            count = len(devices)
        if count > len(devices):
            raise ValueError(_devices.out_of_range_message(count, kind, len(devices)))
        return tuple(_devices.device_string(d) for d in devices[:count])

    def validate_devices(self, devices: Sequence[str]) -> None:
        _devices.validate(devices)

    def local_tpu_system(self) -> LocalTPUSystem:
        """The TPU cores of ``TPUStrategy``: JAX's TPUs (topology from their
        ``coords``/``core_on_chip``), else its default platform's devices standing in
        for TPU cores, a chain of one-core chips (``polydist_jax._tpu``)."""
        return _tpu.local_tpu_system()

    def device_scope(self, device: str) -> AbstractContextManager[Any]:
        return self._scope_on(_devices.jax_device(device))

    @staticmethod
    def _scope_on(device: jax.Device) -> AbstractContextManager[Any]:
        """`device_scope` once the backend has found the JAX device."""
        scope: AbstractContextManager[Any] = jax.default_device(device)
        traced = _functional.active()
        replica = current_update_replica()
        if traced is None or replica is None:
            return scope
        # Core updates replica `replica`'s copies (StrategyExtended.update, update_non_slot)
        # inside a compiled merge_fn: show them as that replica holds them.
        stack = ExitStack()
        stack.enter_context(scope)
        stack.enter_context(traced.update_scope(replica))
        return stack

    def is_symbolic(self, value: Any) -> bool:
        """Core's optional hook: a tracer of a program being compiled."""
        return is_tracer(value)

    def place(self, value: Any, device: str) -> Any:
        if is_tracer(value):
            return value
        if isinstance(value, np.ndarray):  # a copy, never a view (place_copies_host_arrays)
            return _collectives.host_copy(value, _devices.jax_device(device))
        return _collectives.on_device(value, _devices.jax_device(device))

    def place_per_replica(self, values: Sequence[Any], devices: Sequence[str]) -> list[Any]:
        """Core's optional input hook: one step's components of a leaf, one per replica.

        Equal shapes become one global array sharded over the compiled run's mesh
        (one transfer; ``polydist_jax._input``); the components are its per-device
        arrays, as ``place`` would give them.
        """
        # The compiled run's own mesh (eager runs take per-device arrays).
        mesh_of = self._compiled._mesh if self.jit else None
        return _input.place_per_replica(self.place, mesh_of, values, devices)

    def placed_dtype(self, dtype: np.dtype[Any]) -> np.dtype[Any]:
        """Core's optional input hook: the dtype ``place`` gives a NumPy array of ``dtype``.

        ``device_put`` canonicalizes with the x64 mode in force (off: 64-bit
        types become 32-bit), so a distributed dataset's ``element_spec`` says so.
        """
        if dtype.kind not in "biufcV":  # strings and objects: not jax types, kept
            return dtype
        try:
            return np.dtype(jax.dtypes.canonicalize_dtype(dtype))
        except TypeError:
            return dtype

    def to_numpy(self, value: Any) -> np.ndarray:
        return np.asarray(value)

    # -- running ---------------------------------------------------------------------------
    def run_replicas(
        self,
        group: ReplicaGroup,
        fn: Callable[..., Any],
        per_replica_args: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
    ) -> list[Any]:
        """Core's call for the SPMD execution model (``jit=True``): one compiled program
        for all replicas, else (uneven inputs) the eager runner."""
        if not self.jit:
            return self.replica_runner.run(group, fn, per_replica_args)
        try:
            return self._compiled.run(group, fn, per_replica_args)
        except Uneven as e:
            if not self.eager_fallback:
                raise ValueError(
                    f"strategy.run cannot compile {_name(fn)} for all replicas at once: "
                    f"{e.reason}. Per-replica inputs must have the same shape and dtype on "
                    "every replica. Pad partial batches to the full size and pass a mask, "
                    "or create the backend with JaxBackend(eager_fallback=True) to run such "
                    "calls eagerly."
                ) from None
            reason = e.reason
        self.eager_fallback_count += 1
        return self._eager.run(group, fn, per_replica_args, why=f"it could not compile: {reason}")

    def run_direct(
        self,
        group: ReplicaGroup,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Core's fast path (``polydist.backend.SupportsDirectRun``): a call of a program
        compiled before, its inputs handed straight over (``CompiledRunner.run_direct``);
        ``NOT_HANDLED`` otherwise (core's usual path, ``run_replicas``)."""
        if not self.jit:
            return NOT_HANDLED
        return self._compiled.run_direct(group, fn, args, kwargs)

    def prepare_direct(
        self, group: ReplicaGroup, fn: Callable[..., Any]
    ) -> Callable[[tuple[Any, ...]], Any] | None:
        """Core's prepared call (``polydist.backend.SupportsPreparedRun``): on one device,
        a call of ``fn``'s compiled program through its lane
        (``CompiledRunner.prepare_direct``); None otherwise."""
        if not self.jit:
            return None
        return self._compiled.prepare_direct(group, fn, self)

    def _eager_channel(self, inner: Any, replica_index: int) -> DifferentiableChannel:
        return DifferentiableChannel(inner, replica_index, self._moved)

    # -- collectives -------------------------------------------------------------------------
    def all_reduce(self, values: Sequence[Any], destinations: Sequence[str]) -> list[Any]:
        return _collectives.all_reduce(values, destinations)

    def reduce_to(self, values: Sequence[Any], destination: str) -> Any:
        return _collectives.reduce_to(values, destination)

    def all_gather(
        self, values: Sequence[Any], axis: int, destinations: Sequence[str]
    ) -> list[Any]:
        return _collectives.all_gather(values, axis, destinations)

    def broadcast(self, value: Any, destinations: Sequence[str]) -> list[Any]:
        return _collectives.broadcast(value, destinations)


class _EagerRunner(EagerReplicaRunner):
    """Core's eager runner; replicas that all return their copy of one ``merge_fn`` array
    return that array (`MovedArrays`)."""

    def __init__(
        self,
        moved: MovedArrays,
        mode: Literal["greenlet", "thread"],
        timeout: float | None,
        *,
        wrap_channel: Callable[[ReplicaChannel, int], ReplicaChannel],
    ) -> None:
        super().__init__(mode, timeout, wrap_channel=wrap_channel)
        self._moved = moved

    def run(
        self,
        group: ReplicaGroup,
        fn: Callable[..., Any],
        per_replica_args: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
        why: str = "of JaxBackend(jit=False)",
    ) -> list[Any]:
        try:
            results = super().run(group, fn, per_replica_args)
        except NameError as e:
            self._moved.forget()
            # JAX's own message ("unbound axis name: replica ... call psum under
            # `jax.shard_map`") points at shard_map, which the user never wrote.
            if "unbound axis name" not in str(e):
                raise
            raise NameError(
                f"{_name(fn)} uses a JAX collective over a named mesh axis ({e}), such as "
                "lax.psum(x, 'replica') or nnx.BatchNorm(axis_name=...). Such axes exist "
                "only inside a compiled strategy.run, and this call ran the replicas "
                f"eagerly, one after another, because {why}. Use the replica context's "
                "collectives (pd.get_replica_context().all_reduce), which work in both "
                "(for batch norm: polydist_jax.nnx.SyncBatchNorm, built on them), or "
                "keep every call compiled: pad partial batches to the full size (or batch "
                "with drop_remainder=True) and keep JaxBackend(jit=True)."
            ) from e
        except BaseException:
            self._moved.forget()
            raise
        return self._moved.restore(results)


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
