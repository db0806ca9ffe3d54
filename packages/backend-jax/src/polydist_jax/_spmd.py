"""Compiled ``strategy.run``: one trace for all replicas, ``jax.jit`` over ``jax.shard_map``.

``run_replicas`` receives core's per-replica ``(args, kwargs)``. Leaf by leaf
it tells apart

* **per-replica** arrays (a different object on each replica): assembled,
  without copying, into one global ``jax.Array`` sharded along axis 0 over the
  one-axis ``"replica"`` mesh (``in_specs=P("replica")``), so each replica's
  block is exactly its component (rank-0 components travel as shape ``[1]``);
* **shared** arrays (the same object on every replica): replicated inputs
  (``P()``), made "varying" inside so that ``jax.grad`` gives each replica its
  own gradient, as in TF (see ``docs/backends/jax.md``);
* **static** Python objects (the same non-array object on every replica):
  closed over, part of the cache key, like TF's ``tf.function`` does.

Variables are functionalized (``_functional``): every distributed variable
of the strategy is one more sharded input (its copies), and the copies that
``fn`` wrote come back as outputs that replace them after the call.

The function is traced once per signature (fn, nest structure, shapes,
dtypes, static values) and the compiled program is cached per strategy.
Outputs are split back into per-device arrays (``addressable_shards``, no
host round trip); an output that is an input, or a Python object, comes back
as that very object, so ``regroup`` unwraps it like TF does.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import inspect
import itertools
import operator
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from polydist import ReduceOp, ReplicaContext, Variable
from polydist.backend import NOT_HANDLED, pack_by_dtype
from polydist.backend import collectives as _communication
from polydist.backend import context as _context
from polydist.backend import nest as _nest
from polydist.backend import tracing as _trace
from polydist.backend.arrays import convert_to_array, describe, dtype_name
from polydist.backend.tracing import defer_storage, storage_arrays, swap_storage, tracking_state
from polydist.backend.values import (
    DistributedValues,
    DistributedVariable,
    PerReplica,
    component_source,
    deferred,
    regroup,
    value_container,
)
from polydist_jax import _functional, _input
from polydist_jax._devices import jax_device
from polydist_jax._functional import TracedVariables, pick_local
from polydist_jax._lazy import (
    AXIS,
    WORKERS,
    LazyPerReplica,
    axes_scope,
    find_lazy,
    is_tracer,
    is_varying,
    lazy_scope,
    replica_axes,
    replica_axis,
    vary,
)
from polydist_jax._typed import pspec, psum, x64_enabled

if TYPE_CHECKING:
    from polydist import Strategy, StrategyExtended
    from polydist.backend import ReplicaGroup

__all__ = ["CompiledRunner", "Uneven"]

#: Compiled programs kept per strategy (least recently used ones are dropped).
CACHE_SIZE = 256

#: The divergence warning's check (`_DivergenceChecks`) of the NONE variables a program
#: writes in replica context: its first calls hash their copies and read the hashes at
#: once (waiting for the step); later, one call in `CHECK_EVERY` hashes them, read
#: once that step has finished. (Hashing reads every written copy: on XLA:CPU about
#: half an MLP step of `benchmarks/bench_jax.py`, so one call in 16 cost ~3%.)
CHECK_AT_ONCE = 4
CHECK_EVERY = 128

#: On XLA:CPU, a step whose written variables hold less than this per device keeps
#: its inputs (it is not donated): there, donating cost about 3% of the 8-device MLP
#: step of ``benchmarks/bench_jax.py`` (1 MiB weights; paired runs with and without),
#: and the copy it would save is at most this much. On other platforms, and from
#: this size on, the written variables are donated.
DONATE_CPU_MIN_BYTES = 16 * 2**20

#: One device, one process: a replayed call whose arguments are all arrays runs through
#: a jitted function of fn's own arguments (`_Dispatch.lane`), so that JAX's C++
#: dispatch flattens and checks them. That program is compiled again for it, so only
#: for programs whose first compile took less than this: a step that compiles longer
#: runs long enough for the host's per-call work not to matter.
LANE_COMPILE_SECONDS = 2.0
#: On a GPU or TPU, that many times as long: there a first compile autotunes (XLA's
#: GEMM and fusion autotuning, 2-3 s for a 512-wide MLP on an H200, where the process's
#: first compile was the one without a lane), and the lane's compile of the same
#: computation finds those results in XLA's cache.
LANE_ACCELERATOR_FACTOR = 5.0
_LANE_BUILDS = 2  # per program: a lane dropped (arguments it does not take) is made again once

_REPLICA, _SHARED, _STATIC, _VARIABLE = "replica", "shared", "static", "variable"
# A zero-size array input: made inside the program (it holds no data). As a program
# input beside a collective it crashes XLA:CPU's compiler (jax 0.11.2).
_EMPTY = "empty"


class Uneven(Exception):
    """Per-replica inputs that cannot share one global array (internal)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# --------------------------------------------------------------------------- the mesh

_dce_jaxpr: Any = None
try:  # JAX's dead-code elimination of a jaxpr (`_unread_variables`)
    from jax._src.interpreters.partial_eval import dce_jaxpr as _dce_jaxpr
except ImportError:  # another JAX: every variable stays an input
    _dce_jaxpr = None

_ArrayImpl: Any = None
try:  # what jax.make_array_from_single_device_arrays builds, for `_global_array`
    from jax._src.array import ArrayImpl as _ArrayImpl
    from jax._src.core import ShapedArray as _ShapedArray
    from jax._src.core import update_aval_with_sharding as _with_sharding
except ImportError:  # another JAX: the public function each time
    _ArrayImpl = None

# (shape, dtype, sharding) -> the abstract value of such a global array, and the one
# device sharding and block shape of a sharding with one addressable device (None: a
# dtype that JAX's own function handles its own way).
_AVALS: dict[tuple[Any, ...], Any] = {}
_AVALS_LIMIT = 1024


def _global_array(shape: tuple[int, ...], sharding: Any, arrays: list[Any]) -> Any:
    """``jax.make_array_from_single_device_arrays(shape, sharding, arrays)``, checked as
    it checks them, with the abstract value made once per shape, dtype and sharding:
    that made up four fifths of its time (about 25 us of 30 on CPU), paid per input
    per step across processes."""
    if _ArrayImpl is None:
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
    dtype = arrays[0].dtype
    key = (shape, dtype, sharding)
    entry = _AVALS.get(key)
    if entry is None:
        if len(_AVALS) >= _AVALS_LIMIT:
            _AVALS.clear()
        extended = jnp.issubdtype(dtype, jax.dtypes.extended)
        aval = (
            None
            if extended
            else _with_sharding(_ShapedArray(shape, dtype, weak_type=False), sharding)
        )
        devices = list(sharding.addressable_devices) if aval is not None else []
        single = SingleDeviceSharding(devices[0]) if len(devices) == 1 else None
        entry = _AVALS[key] = (aval, single, sharding.shard_shape(shape) if single else None)
    aval, single, block = entry
    if aval is None:
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
    if single is not None and len(arrays) == 1:
        # One addressable device (a worker with one replica): JAX's checks would
        # only confirm the block's device and shape, checked here in two comparisons.
        array = arrays[0]
        if array.shape == block and array.sharding == single:
            return _ArrayImpl(aval, sharding, arrays, committed=True, _skip_checks=True)
    return _ArrayImpl(aval, sharding, arrays, committed=True)


@dataclass(frozen=True)
class _Mesh:
    """The replica mesh of one strategy and its shardings.

    Mesh order is worker_devices order (for TPUStrategy: the device
    assignment's order), so psum adds in replica order.
    """

    devices: tuple[jax.Device, ...]  # this process's replicas' devices
    mesh: Mesh
    split: NamedSharding  # P("replica"): axis 0 split across replicas
    replicated: NamedSharding  # P(): a full copy on each replica's device
    single: tuple[SingleDeviceSharding, ...]
    index: dict[jax.Device, int]
    # The mesh axes that together index every replica; across processes
    # (WORKERS, AXIS), worker-major, so the linear index is the global replica id.
    axes: tuple[str, ...] = (AXIS,)
    size: int = 0  # every process's replicas; 0: this process's are all
    # Per output sharding: where each replica's array is among an array's addressable
    # ones (None: fully replicated), so `_shards` reads them without Shard objects.
    orders: dict[Any, tuple[int, ...] | None] = field(
        default_factory=dict, compare=False, hash=False
    )

    # Cached: read several times per step.
    @functools.cached_property
    def replicas(self) -> int:
        return self.size or len(self.devices)

    @functools.cached_property
    def axis(self) -> str | tuple[str, ...]:
        """The name for ``P(...)`` and collectives over every replica."""
        return self.axes[0] if len(self.axes) == 1 else self.axes

    @functools.cached_property
    def spans_processes(self) -> bool:
        return self.replicas != len(self.devices)

    @functools.cached_property
    def throttled(self) -> bool:
        return _throttled(self)

    @functools.cached_property
    def single_device(self) -> bool:
        """One replica in one process: programs take and give single-device arrays."""
        return len(self.devices) == 1 and not self.spans_processes

    @staticmethod
    def build(device_strings: Sequence[str]) -> _Mesh:
        return _Mesh.of(tuple(jax_device(d) for d in device_strings))

    @staticmethod
    def of(devices: tuple[jax.Device, ...]) -> _Mesh:
        """The mesh of one process's replicas, on ``devices`` in this order."""
        # Mesh(...) rather than jax.make_mesh: make_mesh's Explicit axes make shard_map
        # refuse inputs that are not already sharded that way.
        mesh = Mesh(np.array(devices, dtype=object), (AXIS,))
        return _Mesh(
            devices=devices,
            mesh=mesh,
            split=NamedSharding(mesh, pspec(AXIS)),
            replicated=NamedSharding(mesh, pspec()),
            single=tuple(SingleDeviceSharding(d) for d in devices),
            index={d: i for i, d in enumerate(devices)},
        )

    @staticmethod
    def across_processes(
        devices: tuple[jax.Device, ...], grid: Sequence[Sequence[jax.Device]]
    ) -> _Mesh:
        """The mesh of every process's replicas: ``grid[w]`` are worker ``w``'s devices
        (the same on every process), ``devices`` this process's row."""
        axes = (WORKERS, AXIS)
        mesh = Mesh(np.array([list(row) for row in grid], dtype=object), axes)
        return _Mesh(
            devices=devices,
            mesh=mesh,
            split=NamedSharding(mesh, pspec(axes)),
            replicated=NamedSharding(mesh, pspec()),
            single=tuple(SingleDeviceSharding(d) for d in devices),
            index={d: i for i, d in enumerate(devices)},
            axes=axes,
            size=sum(len(row) for row in grid),
        )

    def parts(self, array: Any) -> list[Any]:
        """Each of this process's replicas' array of a global ``array`` on this mesh (split
        or replicated), in replica order: JAX's own per-device objects."""
        sharding = array.sharding
        orders = self.orders
        try:
            order = orders[sharding]
        except KeyError:
            order = None
            if len(orders) < 64:
                devices = [shard.device for shard in array.addressable_shards]
                if sorted(self.index[d] for d in devices) == list(range(len(self.devices))):
                    position = {d: p for p, d in enumerate(devices)}
                    order = tuple(position[d] for d in self.devices)
                orders[sharding] = order
        if order is not None:
            # JAX's own per-device objects, no Shard built: ``_arrays`` is the list
            # `addressable_data(p)` indexes (read once, not through 4 calls per array,
            # which a step with several devices and outputs notices).
            arrays = None if array.is_deleted() else getattr(array, "_arrays", None)
            if type(arrays) is list and len(arrays) == len(order):
                return [arrays[p] for p in order]
            if not sharding.is_fully_replicated:  # (else addressable_data gives the first)
                data = array.addressable_data
                return [data(p) for p in order]
        parts: list[Any] = [None] * len(self.devices)
        for shard in array.addressable_shards:
            parts[self.index[shard.device]] = shard.data
        return parts

    def assemble(self, blocks: Sequence[Any]) -> Any:
        """The global array split along axis 0 whose blocks here are ``blocks`` (this
        process's replicas' blocks, in order; no copy)."""
        block = blocks[0].shape
        shape = (block[0] * self.replicas, *block[1:])
        return _global_array(shape, self.split, list(blocks))

    def replicate(self, value: Any) -> Any:
        """``value`` as a replicated input: a copy on each replica's device (across
        processes each process's own value: nothing assumes they are equal)."""
        if self.single_device:
            # One device: an array on it is already replicated (a device_put, about 0.1
            # ms, would copy it each step). Single-device arrays, as the program's
            # outputs are: a later step passing them back needs no other compile.
            if (
                isinstance(value, jax.Array)
                and value.committed
                and value.sharding == self.single[0]
            ):
                return value
            return jax.device_put(value, self.single[0])
        if not self.spans_processes:
            return jax.device_put(value, self.replicated)
        copies = [
            value  # already there: a device_put would cost a dispatch per step
            if isinstance(value, jax.Array) and value.committed and value.sharding == single
            else jax.device_put(value, d)
            for d, single in zip(self.devices, self.single, strict=True)
        ]
        shape = value.shape if isinstance(value, jax.Array) else np.shape(value)
        return _global_array(tuple(shape), self.replicated, copies)


# --------------------------------------------------------------------------- signatures


class _Identity:
    """A cache-key part for an unhashable static object: equal only to itself."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj


def _static_key(obj: object) -> object:
    # The type is part of the key: 1, 1.0 and True are equal in Python but trace differently.
    if isinstance(obj, float):
        return (float, obj.hex())
    if isinstance(obj, complex):
        return (complex, obj.real.hex(), obj.imag.hex())
    try:
        hash(obj)
    except TypeError:
        return _Identity(obj)
    return (type(obj), obj)


def _is_array(x: object) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def _is_variable(x: object) -> bool:
    # A distributed value handed over whole, or any polydist.Variable (a plain one
    # would otherwise be baked into the program as a constant).
    return isinstance(x, DistributedValues) or hasattr(type(x), "_is_distributed_variable")


@dataclass
class _Leaf:
    """How one input leaf reaches the replica function."""

    kind: str  # _REPLICA | _SHARED | _STATIC | _VARIABLE | _EMPTY
    obj: Any = None  # the static object; for _VARIABLE the position among the variables
    shape: tuple[int, ...] = ()
    dtype: Any = None

    def key(self) -> object:
        if self.kind == _STATIC:
            return (_STATIC, _static_key(self.obj))
        if self.kind == _VARIABLE:
            return (_VARIABLE, self.obj)
        return (self.kind, self.shape, self.dtype)


def _aval(x: Any) -> tuple[tuple[int, ...], Any]:
    dtype = x.dtype
    # A typed PRNG key array (jax.random.key) has an extended dtype, not a NumPy one.
    if not isinstance(dtype, np.dtype) and not jnp.issubdtype(dtype, jax.dtypes.extended):
        dtype = np.dtype(dtype)
    return tuple(x.shape), (dtype, bool(getattr(x, "weak_type", False)))


def _portable(obj: object) -> object:
    """A static input as another process can compare it: no ids or addresses."""
    if obj is None or isinstance(obj, bool | int | float | complex | str | bytes):
        return (type(obj).__name__, repr(obj))
    if isinstance(obj, tuple | list):
        return (type(obj).__name__, tuple(_portable(x) for x in obj))
    if isinstance(obj, frozenset):
        return ("frozenset", tuple(sorted(repr(_portable(x)) for x in obj)))
    kind = type(obj)
    name = getattr(obj, "__qualname__", None) if callable(obj) else None
    return (kind.__module__, kind.__qualname__, name)


def _signature(
    fn: Callable[..., Any],
    spec: Any,
    leaves: list[_Leaf],
    var_keys: tuple[Any, ...],
    x64: bool,
    jaxpr: Any,
    events: Sequence[_trace.CollectiveEvent],
) -> bytes:
    """A digest of the program a process runs, the same in every process that runs the
    same step: the function by name, the inputs by kind, shape and dtype (static ones by
    value), and what the trace holds, which closures and globals decide: polydist's
    collectives in order (op, reduce op, dtype, shape) and every collective of the
    traced program (`_collectives`)."""
    target = inspect.unwrap(fn)  # a strategy's wrapper (InReplicaContext) differs by worker
    name = getattr(target, "__qualname__", type(target).__qualname__)
    parts: list[object] = [getattr(target, "__module__", ""), name, repr(spec), x64]
    for leaf in leaves:
        if leaf.kind == _STATIC:
            parts.append((_STATIC, _portable(leaf.obj)))
        elif leaf.kind == _VARIABLE:
            parts.append((_VARIABLE, leaf.obj))
        else:
            parts.append((leaf.kind, leaf.shape, leaf.dtype))
    parts.extend(key[1:] for key in var_keys)  # without id(variable)
    # Without participants (device names differ by worker) or source lines (paths may).
    parts.extend((e.op, e.reduce_op, e.dtype, tuple(e.shape)) for e in events)
    parts.extend(_collectives(jaxpr))
    return hashlib.sha256(repr(parts).encode()).digest()


# The primitives of jax.lax's collectives that communicate (not axis_index, pvary).
_COLLECTIVE_PREFIXES = (
    "psum",
    "pmax",
    "pmin",
    "ppermute",
    "pbroadcast",
    "psend",
    "precv",
    "all_gather",
    "all_to_all",
    "ragged_all_to_all",
    "reduce_scatter",
    "unreduced_",
)


def _collectives(jaxpr: Any) -> list[tuple[object, ...]]:
    """Every collective of ``jaxpr`` and the jaxprs inside it (shard_map's body, jit,
    cond, scan, ...), in program order: its primitive, its parameters and its operands'
    shapes and dtypes."""
    found: list[tuple[object, ...]] = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name.startswith(_COLLECTIVE_PREFIXES):
            params = tuple(
                (k, _plain(v)) for k, v in sorted(eqn.params.items()) if not _holds_jaxpr(v)
            )
            operands = tuple(
                (tuple(v.aval.shape), str(v.aval.dtype)) for v in eqn.invars if hasattr(v, "aval")
            )
            found.append((name, params, operands))
        for value in eqn.params.values():
            for sub in _jaxprs_in(value):
                found.extend(_collectives(sub))
    return found


def _jaxprs_in(value: Any) -> list[Any]:
    if isinstance(value, tuple | list):
        return [j for v in value for j in _jaxprs_in(v)]
    if hasattr(value, "eqns"):  # a Jaxpr
        return [value]
    inner = getattr(value, "jaxpr", None)  # a ClosedJaxpr
    if inner is not None and hasattr(inner, "eqns"):
        return [inner]
    return []


def _holds_jaxpr(value: Any) -> bool:
    return bool(_jaxprs_in(value)) or callable(value)


def _plain(value: Any) -> object:
    """A parameter as another process can compare it: no ids or addresses."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple | list | frozenset):
        items = [_plain(v) for v in value]
        return tuple(sorted(items, key=repr)) if isinstance(value, frozenset) else tuple(items)
    return type(value).__qualname__


# --------------------------------------------------------------------------- programs


@dataclass
class _Output:
    # "split" | "replicated" | "input" | "static" | "variable" | "component" | "empty"
    kind: str
    index: int = 0  # into the split / replicated outputs, the input leaf, or the variables
    scalar: bool = False
    obj: Any = None
    common: bool = False  # every replica gets replica 0's part (the very same object)


@dataclass
class _Program:
    """One compiled signature of one replica function."""

    jitted: Any  # the jax.jit-wrapped shard_map
    leaves: list[_Leaf]
    outputs: list[_Output] = field(default_factory=list)
    out_spec: Any = None
    events: list[_trace.CollectiveEvent] = field(default_factory=list)
    traces: int = 0
    # The variables fn wrote: (position among the call's variables, rank 0?), in the
    # order of the program's variable outputs.
    updates: list[tuple[int, bool]] = field(default_factory=list)
    # NONE-aggregated MirroredVariables fn writes in replica context. Core checks such
    # variables for divergence after a call (ReplicaDivergenceWarning); a call that
    # checks hashes their new copies (`_Fingerprints`) and marks for core's check those
    # whose copies' fingerprints differ.
    dirty: list[int] = field(default_factory=list)
    # Variables fn created while traced (positions after the call's variables). Such a
    # program is dropped from the cache after its call: every call traces again.
    created: list[Variable] = field(default_factory=list)
    evict: Callable[[], None] | None = None
    # Across processes: what every process must agree on before running it (see
    # ProcessGroup; None until traced), and the program compiled ahead of its first
    # call, behind that agreement (`ProcessGroup.compile`).
    signature: bytes | None = None
    executable: Any = None
    # What the signature needs besides the trace: (fn, spec, leaves, var_keys, x64).
    signs: tuple[Any, ...] = ()
    # One device, one process: rank-0 results come out of the program rank 0.
    squeezed: bool = False
    single: SingleDeviceSharding | None = None  # ... and its device's sharding
    single_split: NamedSharding | None = None  # ... and its mesh's split sharding
    # The program as run in one process outside JAX transformations (`_local_call`):
    # built once from the first trace, donating the written variables' input arrays.
    local: Any = None
    donated: tuple[int, ...] = ()  # input positions donated (written variables)
    counts: tuple[int, int, int, int] = (0, 0, 0, 0)  # split, replicated, updated, checks
    calls: int = 0  # calls so far (which ones check divergence: `CompiledRunner._checks`)
    scalars: list[int] | None = None  # the split outputs of rank 0 (`_parts`)
    wait: int | None = None  # the output `CompiledRunner._throttle` waits on
    blocks: list[Any] | None = None  # per split output, its block's aval (`_Result`)
    # Whether the updated variables' copies are stored deferred (`CompiledRunner._store`),
    # and then each one's copy aval (`_Stored`).
    store_whole: bool | None = None
    stored_avals: list[Any] | None = None
    # The inputs ``local`` takes (None: all): a variable the program neither reads nor
    # writes is no input of it (`_unread_variables`); per variable, whether it is one.
    kept: list[int] | None = None
    variable_kept: list[bool] | None = None
    # Across processes, a worker with one replica (`_worker_outputs`): per split output,
    # the aval of the worker's part (read once: a fresh output's attributes cost more
    # than the rest of the lookup of one passed back in, `_Plan.parted`).
    part_avals: list[Any] | None = None
    # One device: the function ``local`` compiles (the traced jaxpr's), how long its
    # first call took (trace and compile), and how many lanes were made of it.
    local_fun: Any = None
    compile_seconds: float | None = None
    lanes: int = 0


class _Strong:
    """A strong reference with a weak reference's call (for objects without weakrefs)."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __call__(self) -> object:
        return self.obj


def _ref(obj: object) -> Callable[[], object]:
    try:
        return weakref.ref(obj)
    except TypeError:  # ints, strings, tuples, None: immutable, cheap to hold
        return _Strong(obj)


@dataclass(eq=False)
class _Plan:
    """What `CompiledRunner._prepare` worked out for one replica function and nest
    structure, reused by the next call while its inputs are the same objects
    (`CompiledRunner._reuse`): which program, each leaf's kind, the program inputs
    made from them (placed, assembled), the variables functionalized."""

    spec: Any
    mesh: _Mesh
    x64: bool
    program: _Program
    leaves: list[_Leaf]
    refs: list[list[Callable[[], object]]]  # per input column, what it held (weakly)
    volatile: list[bool]  # columns holding NumPy arrays (mutable): placed every call
    slots: list[int | None]  # per column, its index among the program inputs
    inputs: list[Any]  # the program inputs made from the columns
    variables: list[weakref.ref[Variable]]
    positions: dict[int, int]  # id(variable) -> its position
    var_keys: tuple[Any, ...]
    state: Any  # core's `tracking_state` of the strategy's variables
    version: int  # its version then
    closure: tuple[Any, ...]  # fn's closure cells and what they held
    contents: tuple[Any, ...]
    # `CompiledRunner.run_direct`'s replay of this plan; ``direct`` False: the plan's
    # calls cannot be replayed (core's usual path each time).
    dispatch: _Dispatch | None = None
    direct: bool = True
    # The last direct call's split outputs, by id of their first part: a distributed
    # value of exactly those parts (parameters passed back in) is that array again.
    recent: dict[int, tuple[Any, list[Any]]] = field(default_factory=dict)
    # Across processes, a worker with one replica: the last call's split outputs, each
    # held whole on the device (`_worker_outputs`), by id of the worker's part; that
    # part passed back in as a shared input (parameters returned) is that array again.
    parted: dict[int, tuple[Any, Any, Any]] = field(default_factory=dict)  # (output, part, aval)


# How `CompiledRunner.run_direct` hands over each of core's leaves of ``(args, kwargs)``:
# the same object as before (static values, whole variables, NumPy scalars); a
# ``jax.Array`` given to every replica (placed again only when it is another array);
# a distributed value (its components, reassembled only when they are other arrays).
_D_SAME, _D_ARRAY, _D_REPLICA = 0, 1, 2
# A distributed value of one component (one replica) that core passed on as that
# component, a shared input: handed over as a `_D_ARRAY` of that component.
_D_ONE = 3
# How it regroups each output leaf, as core's `regroup` did on the call checked.
_R_PARTS, _R_FIRST, _R_OBJECT, _R_VARIABLE, _R_INPUT = 0, 1, 2, 3, 4


@dataclass(eq=False)
class _Dispatch:
    """A `_Plan` as `CompiledRunner.run_direct` replays it: from core's own leaves of
    ``(args, kwargs)`` (which, here, are the leaves the plan classified: the plan's nest
    structure is core's) straight to the program's inputs, and from its outputs
    straight to the regrouped result."""

    spec: Any  # core's structure of (args, kwargs)
    types: tuple[type, ...] | None  # each argument's type, when every one is a leaf
    # Per argument, its type if a leaf, else (list or tuple, its items' types) when
    # every argument is a leaf or a list or tuple of leaves (`_flat_args`).
    template: tuple[Any, ...] | None
    devices: tuple[str, ...]
    kinds: list[int]  # per leaf: _D_SAME | _D_ARRAY | _D_REPLICA | _D_ONE
    avals: list[Any]  # per leaf: (shape, dtype) of its per-replica block / shared array
    held: list[Any]  # per _D_REPLICA leaf: the components tuple its input was made from
    outputs: list[tuple[int, int, Any]]  # per output leaf: (_R_*, index, object)
    leaf: bool = False  # the result is one leaf, not a nest
    checked: bool = False  # its result was compared with core's regroup once
    # One device: weak references to the last direct call's split outputs, and per
    # leaf the output found passed back in at it (parameters returned and passed in
    # again): such a leaf is that output, in place, of the aval checked when found.
    last: list[weakref.ref[Any]] | None = None
    passed_back: list[int | None] | None = None  # (_NOT_BACK: no output found there)
    # One device, every result leaf a program output: each one's index among the
    # program's flat outputs (the result is those outputs, unflattened).
    picks: list[int] | None = None
    # One device, every leaf an array: ``jax.jit`` of a function of fn's arguments that
    # runs the program (`_make_lane`); ``lane_off`` once it declined a call.
    lane: Any = None
    lane_off: bool = False
    # The lane returns fn's result itself (jit unflattens it, in C++), whose first leaf
    # is at this path of indices and keys; None: it returns the leaves (`_lane_path`).
    lane_path: tuple[Any, ...] | None = None


class _LaneMiss(Exception):
    """Arguments a lane does not take (another structure, kind, shape, dtype or weak
    type than the plan's): the call takes the replay path instead."""


_NOT_BACK = -1  # `_Dispatch.passed_back`: the leaf's first new array was no output

# A plan column's references when only the direct path knows its components (`_reuse`
# then classifies it again): they refer to nothing a caller can pass.
_UNKNOWN = _Strong(object())


def _closure(fn: Callable[..., Any]) -> tuple[Any, ...]:
    # unwrap: a strategy's wrapper (TPUStrategy's InReplicaContext) has no closure itself.
    return getattr(inspect.unwrap(fn), "__closure__", None) or ()


#: Whether the variables' copies come before the other inputs of a program (`_build`).
_VARIABLES_FIRST = True


def _ordered(var_inputs: list[Any], inputs: list[Any]) -> list[Any]:
    return [*var_inputs, *inputs] if _VARIABLES_FIRST else [*inputs, *var_inputs]


def _variables_offset(n_inputs: int, n_variables: int) -> int:
    return 0 if _VARIABLES_FIRST else n_inputs - n_variables


class _Call(threading.local):
    """The variables of the call being prepared on this thread (read by a trace)."""

    def __init__(self) -> None:
        self.variables: list[Variable] = []
        self.check = True  # whether the call hashes its NONE variables (`_checks`)
        # (fn, why): a direct call across processes whose agreement found the processes
        # at other programs; core's usual path then runs it (`run` raises `Uneven` at
        # once: the agreement of this call is done, the others run it eagerly now).
        self.uneven: tuple[Callable[..., Any], str] | None = None


_call = _Call()


# --------------------------------------------------------------------------- tracing helpers


@contextmanager
def _capture_collectives() -> Iterator[_trace.Trace]:
    """Records the collectives issued while tracing, to replay them on every call.

    While a program is traced, this thread's recordings go into a private
    Trace instead of the user's (a trace is global; other threads recording
    during a compile would land here too, which only costs them those events).
    """
    with _trace.capture_collectives() as capture:
        yield capture


def _replay(events: Sequence[_trace.CollectiveEvent]) -> None:
    for e in events:
        _trace.record_collective(
            e.op,
            reduce_op=e.reduce_op,
            dtype=e.dtype,
            nbytes=e.nbytes,
            shape=e.shape,
            participants=e.participants,
            backend=e.backend,
            source=e.source,
        )


def _record(op: str, reduce_op: str | None, value: Any, devices: Sequence[str]) -> None:
    if not _trace.is_tracing():
        return
    shape = tuple(int(d) for d in value.shape)
    dtype = dtype_name(value.dtype)
    _trace.record_collective(
        op,
        reduce_op=reduce_op,
        dtype=dtype,
        nbytes=int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize,
        shape=shape,
        participants=tuple(devices),
        backend="jax",
    )


_SPMD_NOTE = (
    "polydist (jax backend): strategy.run traces the replica function once for all "
    "replicas and compiles it (SPMD), so replica_id_in_sync_group and per-replica inputs "
    "are traced values: Python if/int()/bool()/np.asarray on them cannot work. Use "
    "jnp.where or lax.cond, return arrays and convert them after run, or run eagerly with "
    "JaxBackend(jit=False)."
)


_TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
)


def _add_note(e: BaseException) -> None:
    if sys.version_info >= (3, 11):
        e.add_note(_SPMD_NOTE)


@contextmanager
def _spmd_note() -> Iterator[None]:
    """Python control flow on traced values in fn: the error says why (`_SPMD_NOTE`)."""
    try:
        yield
    except _TRACER_ERRORS as e:
        _add_note(e)
        raise


# --------------------------------------------------------------------------- the channel


#: Across processes, an array of at least this many bytes is its own all-reduce operand
#: (never concatenated into a pack): see `_packed_psum`.
OWN_OPERAND_BYTES = 1 << 20
#: ... and a pack of smaller ones closes once it holds more than this (`pack_by_size`).
MAX_PACK_BYTES = 4 << 20


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _replica_psum(arrays: list[Any], axis: str | tuple[str, ...]) -> list[Any]:
    """``lax.psum`` of inexact ``arrays`` over ``axis``, differentiated by TF's rule.

    JAX takes a psum's result to be one value shared by the replicas, so ``jax.grad``
    of a loss made from it alone counts that loss once: the gradient of
    ``all_reduce(SUM, x)`` was 1 where TF's is N (each replica's copy is its own loss,
    and the gradient is the all-reduce of the upstream gradients). Differentiated, the
    result is therefore each replica's own (varying), and its tangent the psum of the
    tangents: reverse mode then sums every replica's upstream gradient, as TF does.
    Not differentiated, it stays JAX's shared value (merge_call and reductions of it
    need no gather)."""
    return list(psum(arrays, axis))


@_replica_psum.defjvp
def _replica_psum_jvp(
    axis: str | tuple[str, ...], primals: tuple[list[Any]], tangents: tuple[list[Any]]
) -> tuple[list[Any], list[Any]]:
    (arrays,), (dots,) = primals, tangents
    return [vary(s) for s in psum(arrays, axis)], [vary(s) for s in psum(dots, axis)]


def _tf_psum(arrays: list[Any]) -> list[Any]:
    """The psum over every replica of each array, with TF's gradient for the inexact ones
    (`_replica_psum`; integers have no gradient)."""
    axis = replica_axis()
    inexact = [jnp.issubdtype(a.dtype, jnp.inexact) for a in arrays]
    if all(inexact):  # the common case: one all-reduce of the whole nest
        return _replica_psum(list(arrays), axis)
    out: list[Any] = list(arrays)
    for wanted, sums in (
        (True, _replica_psum([a for a, f in zip(arrays, inexact, strict=True) if f], axis)),
        (False, list(psum([a for a, f in zip(arrays, inexact, strict=True) if not f], axis))),
    ):
        it = iter(sums)
        for i, f in enumerate(inexact):
            if f is wanted:
                out[i] = next(it)
    return out


def _packed_psum(arrays: list[Any], bytes_per_pack: int) -> list[Any]:
    """The psum of each array over the replicas of several processes, packed as TF packs
    a nest: the arrays of each dtype are concatenated into flat packs (`pack_by_size`),
    so that the program holds one all-reduce operand per pack. (XLA's CPU runtime runs
    each operand of an all-reduce as its own cross-process collective: 64 arrays took 6x
    longer than one pack.) Weakly typed arrays keep their own operand, and their type.

    Large arrays are not packed: an array of `OWN_OPERAND_BYTES` or more is an operand
    of its own, and a pack closes past `MAX_PACK_BYTES` (or ``bytes_per_pack``, if
    smaller). XLA:CPU all-reduces a large concatenation several times slower than its
    parts: an MLP step with two 8 MiB gradients took 4x as long as with the gradients
    as operands (``benchmarks/bench_multiworker_step.py``), while above a MiB an
    operand's own cost is small beside its transfer."""
    out: list[Any] = [None] * len(arrays)
    # An empty array's sum is itself: it has nothing to send, so no pack holds it.
    nonempty = [i for i, a in enumerate(arrays) if a.size]
    for i, a in enumerate(arrays):
        if not a.size:
            out[i] = a
    kept = [arrays[i] for i in nonempty]
    weak = [bool(getattr(getattr(a, "aval", None), "weak_type", False)) for a in kept]
    sizes = [a.size * a.dtype.itemsize for a in kept]
    dtypes = [
        None if w or size >= OWN_OPERAND_BYTES else a.dtype
        for a, w, size in zip(kept, weak, sizes, strict=True)
    ]
    limit = MAX_PACK_BYTES if bytes_per_pack == 0 else min(bytes_per_pack, MAX_PACK_BYTES)
    packs = pack_by_dtype(dtypes, sizes, limit)
    operands = [
        kept[p[0]] if len(p) == 1 else jnp.concatenate([kept[i].reshape(-1) for i in p])
        for p in packs
    ]
    sums = _tf_psum(operands) if operands else []
    for pack, total in zip(packs, sums, strict=True):
        if len(pack) == 1:
            out[nonempty[pack[0]]] = total
            continue
        ends = list(itertools.accumulate(kept[i].size for i in pack))
        for i, piece in zip(pack, jnp.split(total, ends[:-1]), strict=True):
            out[nonempty[i]] = piece.reshape(kept[i].shape)
    return out


class SpmdChannel:
    """The ``ReplicaChannel`` inside a compiled run: collectives become XLA collectives."""

    def __init__(
        self,
        group: ReplicaGroup,
        shared_inputs: set[int],
        variables: TracedVariables | None = None,
    ) -> None:
        assert group.strategy is not None, "core passes the group of a run"
        self._strategy: Strategy = group.strategy
        self._devices = group.devices
        self._options = group.communication_options
        self._shared_inputs = shared_inputs
        self._variables = variables
        # Traced values merge_fn handed to every replica as one object (id -> value,
        # kept alive so ids stay unique). Returned from fn unchanged, such a value
        # comes back as one object, as the eager runner's regroup would unwrap it.
        self.common: dict[int, Any] = {}

    def all_reduce(self, reduce_op: ReduceOp, values: Sequence[Any]) -> list[Any]:
        if not values:
            return []
        # jnp.asarray: lax.psum of a NumPy constant would be folded to a NumPy result.
        arrays = [jnp.asarray(v) for v in values]
        for a in arrays:
            _record("all_reduce", reduce_op.value, a, self._devices)
        if WORKERS not in replica_axes():
            # One process: XLA's own all-reduce of the nest (packing would only add the
            # copies in and out: 10% on the CPU MLP benchmark's step).
            return _tf_psum(arrays)
        call = _communication.current_call_options()
        return _packed_psum(arrays, _communication.bytes_per_pack(self._options, call))

    def all_gather(self, values: Sequence[Any], axis: int) -> list[Any]:
        out = []
        for v in values:
            a = jnp.asarray(v)
            _record("all_gather", None, a, self._devices)
            out.append(lax.all_gather(a, replica_axis(), axis=axis % a.ndim, tiled=True))
        return out

    def merge_call(
        self, merge_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if _trace.is_tracing():
            _trace.record_collective(
                "merge_call",
                reduce_op=None,
                dtype="",
                nbytes=0,
                shape=(),
                participants=self._devices,
                backend="jax",
            )
        n = len(self._devices)

        def wrap(x: Any) -> Any:
            # A traced value differs between replicas unless it is a shared input or an
            # earlier merge_fn result (the eager runner's regroup sees one object there).
            if is_tracer(x) and id(x) not in self._shared_inputs and id(x) not in self.common:
                return LazyPerReplica(x, n)
            return x

        strategy = self._strategy
        merge_args = _nest.map_structure(wrap, args)
        merge_kwargs = _nest.map_structure(wrap, kwargs)
        # polydist.Variable(...) in fn: created now, from concrete values (not staged
        # into the program), as on eager backends.
        creating = (
            jax.ensure_compile_time_eval()
            if _trace.is_variable_creation(merge_fn)
            else contextlib.nullcontext()
        )
        views = (
            self._variables.merge_view()
            if self._variables is not None
            else contextlib.nullcontext()
        )
        with _context.cross_replica_scope(strategy), views, creating:
            result = merge_fn(strategy, *merge_args, **merge_kwargs)

        def select(x: Any) -> Any:
            local, same_on_all = _select_local(x, n)
            if same_on_all and is_tracer(local):
                self.common[id(local)] = local
            return local

        return _nest.map_structure(select, result)


def _select_local(x: Any, n: int) -> tuple[Any, bool]:
    """This replica's part of a merge_fn result (core's select_replica, traced), and
    whether every replica gets that very object."""
    if isinstance(x, LazyPerReplica):
        return x.local, False
    if not isinstance(x, DistributedValues) or x._select_whole:
        return x, True  # a variable goes back whole (core's select_replica)
    components = x.values
    first = components[0]
    if all(c is first for c in components[1:]):
        # In a trace the backend's collectives repeat one tracer where eager runs
        # return copies, so this is still one value per replica.
        return first, False
    lazy = find_lazy(components)
    if lazy is not None:
        return lazy.local, False
    if len(components) != n:
        raise ValueError(
            f"merge_fn returned a {type(x).__name__} with {len(components)} components, but "
            f"the strategy has {n} replicas: return one component per replica."
        )
    return pick_local([jnp.asarray(convert_to_array(c)) for c in components]), False


# --------------------------------------------------------------------------- the runner


@jax.jit
def _to_unit(*xs: Any) -> tuple[Any, ...]:
    return tuple(jnp.reshape(x, (1,)) for x in xs)


@jax.jit
def _to_scalar(*xs: Any) -> tuple[Any, ...]:
    return tuple(jnp.reshape(x, ()) for x in xs)


def _per_device(fn: Callable[..., tuple[Any, ...]], columns: list[list[Any]]) -> list[list[Any]]:
    """Applies a jitted ``fn`` to each replica's values at once (one dispatch per device)."""
    if not columns:
        return []
    rows = [fn(*row) for row in zip(*columns, strict=True)]
    return [[row[c] for row in rows] for c in range(len(columns))]


class ProcessGroup(Protocol):
    """The processes a compiled run spans (``polydist_jax._multi_worker``'s cluster).

    Every process agrees on the program before its collectives run: a compiled step
    takes that agreement's result as an input (`compile`), and the host waits for the
    agreement only, not for the step (`execute`)."""

    def agree(self, signature: bytes | None, mesh: _Mesh) -> str | None:
        """The agreement of a step, alone (a collective of every process): None if all
        passed this ``signature``, else why not. ``None``: this process's inputs cannot
        be compiled (the others' steps then run nothing)."""
        ...

    def compile(self, jitted: Any, mesh: _Mesh, inputs: Sequence[Any]) -> Any:
        """``jitted`` compiled for ``inputs``, behind the agreement: an executable whose
        call, given the agreement's input, runs ``jitted``'s collectives only if every
        process runs the same program."""
        ...

    def execute(
        self,
        signature: bytes,
        mesh: _Mesh,
        executable: Any,
        inputs: Sequence[Any],
        then: Callable[[Any], Any] | None = None,
    ) -> tuple[str | None, Any]:
        """Runs `compile`'s ``executable`` (whose digest is ``signature``) on
        ``inputs`` behind the agreement, which is waited for within the cluster's bounds
        (its failures become the cluster's errors; the step is not waited for: a stuck
        step holds up the next call's agreement, which the bounds then end): (None, its
        outputs) if every process ran the same program, else (why not, None). ``then``:
        applied to the outputs once dispatched, before the wait (host work that
        overlaps the step); the pair then holds its value."""
        ...


#: Compiled steps that may run at once on XLA:CPU (see `CompiledRunner._throttle`).
_CPU_STEPS_IN_FLIGHT = 2


def _throttled(mesh: _Mesh) -> bool:
    return len(mesh.devices) >= 2 and mesh.devices[0].platform == "cpu"


class CompiledRunner:
    """``run_replicas`` for the jax backend: caches and runs compiled programs.

    ``mesh_of(devices)`` builds the mesh of a strategy's replica devices (default:
    `_Mesh.build`); ``group()`` is the `ProcessGroup` a mesh across processes
    spans, or None (one process).
    """

    def __init__(
        self,
        mesh_of: Callable[[tuple[str, ...]], _Mesh] | None = None,
        group: Callable[[], ProcessGroup | None] | None = None,
    ) -> None:
        self._mesh_of = mesh_of or _Mesh.build
        self._group = group
        self.compile_count = 0
        self.lane_count = 0  # lanes made (`_make_lane`): each compiles a program again
        self._lock = threading.Lock()
        self._meshes: dict[tuple[str, ...], _Mesh] = {}
        self._programs: weakref.WeakKeyDictionary[
            StrategyExtended, collections.OrderedDict[Any, _Program]
        ] = weakref.WeakKeyDictionary()
        self._variable_inputs = _functional.InputCache()
        self._in_flight: collections.deque[Any] = collections.deque()
        self._divergence = _DivergenceChecks()
        self._fingerprints = _Fingerprints()
        # Per strategy, per replica function: the last call's `_Plan`.
        self._plans: weakref.WeakKeyDictionary[
            StrategyExtended, collections.OrderedDict[Any, _Plan]
        ] = weakref.WeakKeyDictionary()
        # The last strategy `run_direct` looked up, and its plans (a weak-key lookup
        # costs a weak reference each call).
        self._last_plans: tuple[weakref.ref[Any], collections.OrderedDict[Any, _Plan]] | None = None
        # id(shared input) -> (its weak reference, mesh, its replicated copy or None: itself)
        self._placed: dict[int, tuple[weakref.ref[Any], _Mesh, Any]] = {}

    def cache_size(self, extended: StrategyExtended | None = None) -> int:
        with self._lock:
            if extended is not None:
                return len(self._programs.get(extended, ()))
            return sum(len(c) for c in self._programs.values())

    def clear_cache(self) -> None:
        with self._lock:
            self._programs.clear()
            self._plans.clear()
            self._last_plans = None
        self._variable_inputs.clear()

    def _mesh(self, devices: tuple[str, ...]) -> _Mesh:
        mesh = self._meshes.get(devices)
        if mesh is None:
            mesh = self._meshes[devices] = self._mesh_of(devices)
        return mesh

    # -- one call -------------------------------------------------------------------
    def run(
        self,
        replicas: ReplicaGroup,
        fn: Callable[..., Any],
        per_replica_args: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
    ) -> list[Any]:
        """Raises :class:`Uneven` (before running anything) if the inputs need eager mode."""
        uneven = _call.uneven
        if uneven is not None:
            _call.uneven = None
            if uneven[0] == fn:  # `run_direct` agreed on this call already: eager now
                raise Uneven(uneven[1])
        group = self._group() if self._group is not None else None
        if group is None:
            prepared = self._prepare(replicas, fn, per_replica_args)
        else:
            prepared = self._prepare_across(group, replicas, fn, per_replica_args)
        program, inputs, columns, mesh, traced = prepared
        call_variables = _call.variables
        checked = _call.check
        first_calls = program.calls < CHECK_AT_ONCE
        program.calls += 1
        self._divergence.poll()  # earlier steps' checks that have finished (no wait)
        try:
            if group is None:
                if traced or program.created or any(is_tracer(x) for x in inputs):
                    outputs = program.jitted(*inputs)
                else:
                    outputs = self._local_call(program, inputs, len(call_variables), mesh)
                self._throttle(mesh, program, outputs)
            else:
                # Compiled ahead (outside the cluster's bound: a compile is no hang),
                # then run with every cross-process wait bounded; the program's first
                # collective is the processes' agreement on it (`ProcessGroup`).
                if program.executable is None:
                    program.executable = group.compile(
                        _worker_outputs(program.jitted, program, mesh), mesh, inputs
                    )
                assert program.signature is not None, "set by _prepare_across"
                why, outputs = group.execute(program.signature, mesh, program.executable, inputs)
                if why is not None:
                    raise Uneven(why)
        except _TRACER_ERRORS as e:
            _add_note(e)
            raise
        finally:
            _call.variables = []  # held no longer than the call (variables may be freed)
        split, replicated, updated, _ = outputs
        variables = [*call_variables, *program.created]
        if program.created and program.evict is not None:
            program.evict()
        if _trace.is_tracing():
            _replay(program.events)
        self._write_back(program, variables, updated, mesh, traced)
        if checked and program.dirty and not traced:
            dirty = [variables[p] for p in program.dirty]
            if not all(getattr(v, "_divergence_warned", False) for v in dirty):
                # A program's first calls are checked at once; later ones without
                # waiting for the step (`_DivergenceChecks`).
                arrays = [self._variable_inputs.lookup(v)[0] for v in dirty]
                found = self._fingerprints(mesh, arrays)
                self._divergence.add(dirty, found, mesh, wait=first_calls)
        return self._results(program, columns, split, replicated, mesh, traced, variables)

    # -- the direct path ----------------------------------------------------------------
    def prepare_direct(
        self, replicas: ReplicaGroup, fn: Callable[..., Any], owner: Any
    ) -> Callable[[tuple[Any, ...]], Any] | None:
        """Core's prepared call of ``fn`` (``polydist.backend.SupportsPreparedRun``): when
        its plan has a lane (`_make_lane`), a callable of the arguments that checks what
        `run_direct` checks of that plan and calls the lane; None otherwise. It runs no
        Python code of the user's (the lane is the compiled program, or, traced again
        for other shapes, its jaxpr), so core calls it before entering any mode.
        ``owner`` is the backend: its ``jit`` switched off declines."""
        strategy = replicas.strategy
        if self._group is not None or strategy is None:
            return None
        plans = self._plans.get(strategy.extended)
        plan = plans.get(fn) if plans is not None else None
        dispatch = plan.dispatch if plan is not None else None
        if plans is None or plan is None or dispatch is None or dispatch.lane is None:
            return None
        if not plan.direct:
            return None
        if replicas.devices is not dispatch.devices and replicas.devices != dispatch.devices:
            return None
        lane, devices, divergence = dispatch.lane, dispatch.devices, self._divergence

        def call(args: tuple[Any, ...]) -> Any:
            if (
                dispatch.lane is not lane
                or plan.dispatch is not dispatch
                or plans.get(fn) is not plan
                or not owner.jit
                or not _plan_holds(plan)
            ):
                return NOT_HANDLED
            if divergence._queue:  # other programs' checks (`poll`), as `run_direct`
                divergence.poll()
            result = _call_lane(plan, dispatch, devices, args)
            return NOT_HANDLED if result is _MISSED else result

        return call

    def run_direct(
        self,
        replicas: ReplicaGroup,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Core's fast path (`SupportsDirectRun`): the call of ``fn`` replayed from its
        last call's `_Plan`, with no more host work than looking the program up and
        handing over what changed; `NOT_HANDLED` when the plan does not hold (core's
        usual path then runs `run`, which prepares the call again).

        Core's leaves of ``(args, kwargs)`` are the plan's: a leaf that is the same
        object as last time is the same input; a new ``jax.Array`` of the same shape
        and dtype is placed (`_replicated`: not at all when already in place); a new
        distributed value whose components are arrays of the same shape and dtype on
        their replicas' devices is assembled (found by identity when it is one global
        array's, `_input.joined`). Anything else, and every check `_reuse` makes (the
        variables, fn's closure, x64 mode, variables tracked since), declines.

        Across processes the call runs the program compiled behind its agreement
        (`ProcessGroup.execute`), which every call carries, direct or not. Where the
        processes disagree, it declines after all, and `run` raises `Uneven` at once
        (without agreeing again): every process then runs that call eagerly.
        """
        _call.uneven = None
        group = self._group() if self._group is not None else None
        last = self._last_plans
        if last is not None and last[0]() is replicas:
            plans: collections.OrderedDict[Any, _Plan] | None = last[1]
        else:  # (core builds a strategy's run group once: it stands for the strategy)
            strategy = replicas.strategy
            if strategy is None:
                return NOT_HANDLED
            plans = self._plans.get(strategy.extended)
            if plans is not None:
                self._last_plans = (weakref.ref(replicas), plans)
        plan = plans.get(fn) if plans is not None else None
        if plan is None or not plan.direct:
            return NOT_HANDLED
        program = plan.program
        if (program.local is None if group is None else program.executable is None) or not (
            _plan_holds(plan)
        ):
            return NOT_HANDLED
        dispatch = plan.dispatch
        if dispatch is not None and dispatch.lane is not None and not kwargs:
            if self._divergence._queue:  # other programs' checks (`poll`), as below
                self._divergence.poll()
            result = _call_lane(plan, dispatch, replicas.devices, args)
            if result is not _MISSED:
                return result
        flat: Sequence[Any]
        if dispatch is not None and not kwargs and _leaf_types(args, dispatch.types):
            flat = args  # each argument a leaf, of the types it had: core's flat leaves
        elif (
            dispatch is not None
            and not kwargs
            and dispatch.template is not None
            and (shallow := _flat_args(args, dispatch.template)) is not None
        ):
            flat = shallow  # lists or tuples of leaves, as they were: core's flat leaves
        else:
            flat, spec = _nest.flatten((args, kwargs))
            if dispatch is None:
                dispatch = self._dispatch(plan, flat, spec, args, kwargs, replicas.devices)
                if dispatch is None:
                    return NOT_HANDLED
            elif spec != dispatch.spec:
                return NOT_HANDLED
        if replicas.devices is not dispatch.devices and replicas.devices != dispatch.devices:
            return NOT_HANDLED
        mesh = plan.mesh
        whole = self._direct_inputs(plan, dispatch, flat, mesh)
        if whole is None:
            # Core's path runs the call (and updates the plan); the replay is made again
            # from the plan at the next call, so that leaves of another kind than this
            # one's (a one-replica PerReplica after plain arrays) do not keep every
            # later call off this path.
            plan.dispatch = None
            return NOT_HANDLED
        variables: list[Variable] = []
        cache = self._variable_inputs
        if plan.variables:
            var_inputs: list[Any] = []
            alone: list[bool] = []
            # Variables the local program does not take are not looked up (`kept`).
            used = program.variable_kept if group is None else None
            for p, ref in enumerate(plan.variables):
                var = ref()
                if var is None:
                    return NOT_HANDLED
                variables.append(var)
                if used is not None and not used[p]:
                    var_inputs.append(None)
                    alone.append(True)
                    continue
                cached, only_ours = cache.lookup(var)
                if cached is None:
                    return NOT_HANDLED  # written from outside: `run` assembles it again
                var_inputs.append(cached)
                alone.append(only_ours)
            inputs = _ordered(var_inputs, plan.inputs)
            offset = _variables_offset(len(inputs), len(variables))
            for i in program.donated:
                if not alone[i - offset]:
                    inputs[i] = _copy(inputs[i])
        else:
            inputs = _ordered([], plan.inputs)
        for slot in whole:
            # An earlier call's result, passed in whole: held by this call's inputs
            # only, so that it is freed when the caller drops it (as the arrays of a
            # hand-written loop are), not when a later call replaces it here.
            plan.inputs[slot] = None
        checked = bool(program.dirty) and self._checks(program, mesh)
        first_calls = program.calls < CHECK_AT_ONCE
        program.calls += 1
        if self._divergence._queue:  # earlier steps' checks (`poll`)
            self._divergence.poll()
        early = False
        if group is None:
            kept = program.kept
            flat_out = program.local(*(inputs if kept is None else [inputs[k] for k in kept]))
            a, b, c, _ = program.counts
            split = flat_out[:a]
            replicated, updated = flat_out[a : a + b], flat_out[a + b : a + b + c]
            tracing = bool(flat_out) and is_tracer(flat_out[0])  # inside an outer trace
            if not tracing and mesh.throttled:
                self._throttle(mesh, program, (split, replicated, updated, flat_out[a + b + c :]))
            if program.single is not None and not tracing:
                dispatch.last = list(map(weakref.ref, split))  # (`_Dispatch.last`)
        else:
            # Across processes: the compiled step with its agreement (`ProcessGroup`),
            # as `run` runs it.
            assert program.signature is not None, "set with the executable"
            # One device here (a worker with one replica, the common case): its parts of
            # the outputs are taken while the step runs, not after it.
            early = dispatch.checked and program.single is None and len(mesh.devices) == 1
            why, outputs = group.execute(
                program.signature,
                mesh,
                program.executable,
                inputs,
                functools.partial(self._early_parts, program, mesh) if early else None,
            )
            if why is not None:
                _call.uneven = (fn, why)
                return NOT_HANDLED
            if early:
                outputs, (split_parts, replicated_parts) = outputs
            split, replicated, updated, _ = outputs
            tracing = False
        if updated:
            self._write_back(program, variables, updated, mesh, tracing, concrete=True)
        if checked:
            dirty = [variables[p] for p in program.dirty]
            if not all(getattr(v, "_divergence_warned", False) for v in dirty):
                arrays = [cache.lookup(v)[0] for v in dirty]
                found = self._fingerprints(mesh, arrays)
                self._divergence.add(dirty, found, mesh, wait=first_calls)
        if tracing or not dispatch.checked:
            columns = [
                list(x.values) if kind in (_D_REPLICA, _D_ONE) else [x] * len(mesh.devices)
                for x, kind in zip(flat, dispatch.kinds, strict=True)
            ]
            if tracing:
                per_replica = self._results(
                    program, columns, split, replicated, mesh, True, variables
                )
                return regroup(per_replica)
            split_parts, replicated_parts = _parts(program, split, replicated, mesh)
            per_replica = self._per_replica(
                program, columns, split_parts, replicated_parts, mesh, False, variables
            )
            expected = regroup(per_replica)
            got = _direct_result(program, dispatch, split_parts, replicated_parts, variables, flat)
            if not _same_result(expected, got):
                plan.direct, plan.dispatch = False, None  # core's regroup differs: not replayed
            dispatch.checked = True
            self._remember_outputs(plan, program, split, split_parts)
            return expected
        if program.single is not None:
            # One device: the outputs are single-device arrays, rank 0 as returned.
            picks = dispatch.picks
            if picks is not None:
                leaves = [flat_out[j] for j in picks]
                if dispatch.lane is None and not dispatch.lane_off and not kwargs:
                    _make_lane(plan, dispatch)
                    self.lane_count += dispatch.lane is not None
                return leaves[0] if dispatch.leaf else _nest.unflatten(program.out_spec, leaves)
            split_parts = [[g] for g in split]
            replicated_parts = [[g] for g in replicated]
            return _direct_result(program, dispatch, split_parts, replicated_parts, variables, flat)
        if len(mesh.devices) == 1:  # one device of a run across processes: its part
            if not early:
                split_parts, replicated_parts = _parts(program, split, replicated, mesh)
            self._remember_outputs(plan, program, split, split_parts)
            return _direct_result(program, dispatch, split_parts, replicated_parts, variables, flat)
        plan.recent = {}  # results are whole (`_Result`): found by their source
        return _deferred_result(program, dispatch, split, replicated, mesh, variables, flat)

    @staticmethod
    def _remember_outputs(
        plan: _Plan, program: _Program, split: Sequence[Any], split_parts: list[list[Any]]
    ) -> None:
        """Keeps this call's split outputs (several parts, not rank 0) for the next
        call (`_Plan.recent`); held until then, as the caller usually holds them."""
        recent: dict[int, tuple[Any, list[Any]]] = {}
        parted: dict[int, tuple[Any, Any, Any]] = {}
        scalars = program.scalars or ()
        if plan.mesh.spans_processes and len(plan.mesh.devices) == 1:
            # A worker's one part of each output, the output's own buffer
            # (`_worker_outputs`): the same aval, the same every call.
            avals = program.part_avals
            if avals is None:
                avals = program.part_avals = [_aval(g) for g in split]
            for i, parts in enumerate(split_parts):
                if i not in scalars:
                    parted[id(parts[0])] = (split[i], parts[0], avals[i])
        else:
            for i, parts in enumerate(split_parts):
                if i not in scalars and len(parts) > 1:
                    recent[id(parts[0])] = (split[i], parts)
        plan.recent = recent
        plan.parted = parted

    def _early_parts(
        self, program: _Program, mesh: _Mesh, outputs: Any
    ) -> tuple[Any, tuple[list[list[Any]], list[list[Any]]]]:
        """``outputs`` and their `_parts`, taken before the step completes (see
        `ProcessGroup.execute`'s ``then``): each is the output's one buffer
        (`_worker_outputs`), read while the step runs."""
        split, replicated, _, _ = outputs
        return outputs, _parts(program, split, replicated, mesh)

    def _dispatch(
        self,
        plan: _Plan,
        flat: list[Any],
        spec: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        devices: tuple[str, ...],
    ) -> _Dispatch | None:
        """The plan's `_Dispatch`, if its calls can be replayed (else ``plan.direct`` is
        cleared); None also while ``flat`` is not what the plan was made from."""
        if spec != plan.spec or len(flat) != len(plan.leaves) or any(plan.volatile):
            plan.direct = False
            return None
        kinds: list[int] = []
        avals: list[Any] = []
        for i, (x, leaf) in enumerate(zip(flat, plan.leaves, strict=True)):
            distributed = isinstance(x, DistributedValues) and not x._select_whole
            if (
                distributed
                and leaf.kind == _SHARED
                and len(x._values) == 1
                and isinstance(x._values[0], jax.Array)
            ):
                kinds.append(_D_ONE)  # one replica's PerReplica (core passed its component)
                avals.append((leaf.shape, leaf.dtype))
                continue
            if distributed != (leaf.kind == _REPLICA) or leaf.kind == _EMPTY:
                # e.g. a PerReplica of one object on every replica (a shared input)
                plan.direct = False
                return None
            if leaf.kind == _SHARED and isinstance(x, jax.Array):
                kinds.append(_D_ARRAY)
            elif distributed:
                kinds.append(_D_REPLICA)
            elif plan.refs[i][0]() is x:
                kinds.append(_D_SAME)
            else:
                return None  # another call's static input: `run` first
            avals.append((leaf.shape, leaf.dtype))
        outputs: list[tuple[int, int, Any]] = []
        for out in plan.program.outputs:
            if out.kind in ("split", "replicated"):
                outputs.append((_R_FIRST if out.common else _R_PARTS, out.index, out.kind))
            elif out.kind == "static":
                outputs.append((_R_OBJECT, 0, out.obj))
            elif out.kind == "variable":
                outputs.append((_R_VARIABLE, out.index, None))
            elif out.kind == "input" and kinds[out.index] not in (_D_REPLICA, _D_ONE):
                outputs.append((_R_INPUT, out.index, None))
            else:  # a replica's own input or copy, an empty array: core's regroup each time
                plan.direct = False
                return None
        picks = None
        program = plan.program
        if program.single is not None and all(o[0] in (_R_PARTS, _R_FIRST) for o in outputs):
            a = program.counts[0]
            picks = [index if obj == "split" else a + index for _, index, obj in outputs]
        # Arguments that are all leaves (types decide what a leaf is): a later call whose
        # arguments have the same types needs no flattening.
        simple = not kwargs and len(flat) == len(args) and all(map(operator.is_, flat, args))
        plan.dispatch = _Dispatch(
            spec=spec,
            types=tuple(type(a) for a in args) if simple else None,
            template=None if simple or kwargs else _template(args, flat),
            devices=devices,
            kinds=kinds,
            avals=avals,
            held=[None] * len(flat),
            outputs=outputs,
            leaf=plan.program.out_spec.is_leaf(),
            picks=picks,
        )
        return plan.dispatch

    def _direct_inputs(
        self, plan: _Plan, dispatch: _Dispatch, flat: Sequence[Any], mesh: _Mesh
    ) -> list[int] | None:
        """Brings ``plan.inputs`` up to date with core's leaves ``flat``, and returns
        the input slots that hold an earlier call's result whole (`_Result`), which the
        plan keeps no longer than this call; None: a leaf the direct path does not hand
        over (``plan`` is then still consistent)."""
        refs = plan.refs
        slots = plan.slots
        parted = plan.parted
        n = len(mesh.devices)
        whole: list[int] = []
        last = dispatch.last or []
        back = dispatch.passed_back
        if last and back is None:
            back = dispatch.passed_back = [None] * len(flat)
        for i, x in enumerate(flat):
            kind = dispatch.kinds[i]
            if kind == _D_SAME:
                if refs[i][0]() is not x:
                    return None
                continue
            if kind == _D_ONE:
                if not isinstance(x, DistributedValues) or x._select_whole or len(x._values) != 1:
                    return None
                x, kind = x._values[0], _D_ARRAY
            if kind == _D_ARRAY:
                if refs[i][0]() is x:
                    continue
                if back is not None and (j := back[i]) is not None and j >= 0 and last[j]() is x:
                    refs[i] = [last[j]]  # an output of the last call: on its device
                    slot = slots[i]
                    assert slot is not None, "an array leaf is a program input"
                    plan.inputs[slot] = x
                    continue
                output = parted.get(id(x)) if parted else None
                if output is not None and output[1] is x and output[2] == dispatch.avals[i]:
                    placed = output[0]  # an output of the last call, passed back in
                else:
                    if not isinstance(x, jax.Array) or is_tracer(x):
                        return None
                    if _aval(x) != dispatch.avals[i]:
                        return None
                    placed = self._replicated(x, mesh)
                ref = _ref(x)
                refs[i] = [ref] * n
                if back is not None and placed is x and back[i] != _NOT_BACK:
                    # (a leaf whose first new array was no output, a batch, is not
                    # looked for among the outputs again)
                    found = next((j for j, r in enumerate(last) if r() is x), None)
                    back[i] = _NOT_BACK if found is None else found
            else:
                if not isinstance(x, DistributedValues) or x._select_whole:
                    return None
                source = component_source(x)
                if type(source) is _Result:
                    placed = source.input_for(mesh, dispatch.avals[i])
                    if placed is not None:  # a result of an earlier call, whole
                        if refs[i][0] is not _UNKNOWN:
                            refs[i] = [_UNKNOWN] * n
                        dispatch.held[i] = None
                        slot = slots[i]
                        assert slot is not None, "an array leaf is a program input"
                        plan.inputs[slot] = placed
                        whole.append(slot)
                        continue
                values = x._values
                if values is dispatch.held[i]:
                    continue
                if len(values) != n:
                    return None
                if all(r() is v for r, v in zip(refs[i], values, strict=True)):
                    dispatch.held[i] = values  # the components the plan's input holds
                    continue
                recent = plan.recent.get(id(values[0]))
                if (
                    recent is not None
                    and all(map(operator.is_, recent[1], values))
                    and _aval(values[0]) == dispatch.avals[i]
                ):
                    placed = recent[0]  # an output of the last call, passed back in
                else:
                    placed = _direct_replica(values, dispatch.avals[i], mesh)
                if placed is None:
                    return None
                # `run` (`_reuse`) classifies such a column again; here ``held`` finds it.
                refs[i] = [_UNKNOWN] * n
                dispatch.held[i] = values
            slot = slots[i]
            assert slot is not None, "an array leaf is a program input"
            plan.inputs[slot] = placed
        return whole

    def _local_call(
        self, program: _Program, inputs: list[Any], n_variables: int, mesh: _Mesh
    ) -> Any:
        """Runs ``program`` in this process outside JAX transformations, donating the
        input arrays of the variables it writes.

        The first call traces the program (once, as ``jitted`` would) and builds, from
        its jaxpr, the same program with those inputs donated: XLA writes the new
        copies over the old ones, so a step holds one copy of its variables, not two.
        A variable's input array shares its buffers with the variable's stored copies;
        where any other Python reference to them exists (an array a user still holds
        from ``v.value()``, or another variable storing the same array), that input is
        copied first and the copy donated, so nothing a user holds is invalidated.
        (NumPy views of the buffers, ``np.asarray(v.value())`` on CPU, make XLA skip
        the donation itself.)
        """
        if program.local is None:
            with _spmd_note():
                stage = program.jitted.trace(*inputs)
            offset = _variables_offset(len(inputs), n_variables)
            donated = tuple(
                offset + p
                for p, _ in program.updates
                if p < n_variables and isinstance(_call.variables[p], DistributedVariable)
            )
            written = sum(inputs[i].nbytes for i in donated)
            small = written < DONATE_CPU_MIN_BYTES * len(mesh.devices)
            program.donated = () if small and mesh.devices[0].platform == "cpu" else donated
            program.counts = tuple(  # type: ignore[assignment]
                len(part) for part in stage.out_info
            )
            closed = stage.jaxpr
            pruned = _unread_variables(closed, offset, n_variables, donated)
            donate = program.donated
            if pruned is not None:
                closed, kept = pruned
                program.kept = kept
                program.variable_kept = [offset + p in kept for p in range(n_variables)]
                donate = tuple(kept.index(i) for i in donate)
            run = jaxpr_as_fun(closed)
            if program.single is None:
                run = _rank0_outputs(run, program, mesh)
                program.local = jax.jit(run, donate_argnums=donate, keep_unused=True)
            else:
                # One device: results on it as single-device arrays, as users' arrays
                # are (no conversion per step, `_shards`). Not the variables' new copies:
                # they stay the global arrays the next step donates (a single-device
                # array's buffer, also held by the variable's own array object, is
                # not donated: XLA copied a 400 MB variable each step).
                a, b, c, d = program.counts
                mesh_split = program.single_split
                program.local_fun = run
                program.local = jax.jit(
                    run,
                    donate_argnums=donate,
                    keep_unused=True,
                    out_shardings=([program.single] * (a + b) + [mesh_split] * (c + d)),
                )
        offset = _variables_offset(len(inputs), n_variables)
        for i in program.donated:
            if not self._variable_inputs.exclusive(_call.variables[i - offset]):
                inputs[i] = _copy(inputs[i])
        take = program.kept
        start = time.perf_counter() if program.compile_seconds is None else 0.0
        flat = program.local(*(inputs if take is None else [inputs[k] for k in take]))
        if program.compile_seconds is None:
            program.compile_seconds = time.perf_counter() - start  # (the first: traced, compiled)
        a, b, c, _ = program.counts
        return flat[:a], flat[a : a + b], flat[a + b : a + b + c], flat[a + b + c :]

    def _throttle(self, mesh: _Mesh, program: _Program, outputs: Any) -> None:
        """On XLA:CPU, waits for the step before last before returning.

        Its in-process all-reduce runs one thread per device on a shared pool: with
        many collective programs queued by async dispatch (a loop that never reads
        its results), a device's thread may never reach the rendezvous and XLA aborts
        the process after 40 s ("only 7 of them arrived"; plain jit(shard_map(psum))
        does the same). Two steps in flight keep dispatch ahead of compute.
        """
        if not mesh.throttled:
            return
        split, replicated, updated, checks = outputs
        # Not an updated variable's array (the next step may donate it), and the
        # smallest output: what it holds lives two steps longer (a parameter passed
        # back in would be freed that much later).
        leaves = [*split, *replicated, *checks]
        if leaves:
            index = program.wait
            if index is None or index >= len(leaves):
                sizes = [x.size for x in leaves]
                index = program.wait = sizes.index(min(sizes))
            leaf = leaves[index]
        elif updated:
            leaf = updated[0]
        else:
            return
        with self._lock:
            self._in_flight.append(leaf)
            oldest = (
                self._in_flight.popleft() if len(self._in_flight) > _CPU_STEPS_IN_FLIGHT else None
            )
        if oldest is not None:
            oldest.block_until_ready()

    def lower(
        self,
        replicas: ReplicaGroup,
        fn: Callable[..., Any],
        per_replica_args: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
    ) -> Any:
        """The ``jax.stages.Lowered`` program that ``run`` would call."""
        program, inputs, *_ = self._prepare(replicas, fn, per_replica_args)
        lowered = program.jitted.lower(*inputs)
        if program.created and program.evict is not None:
            program.evict()
        return lowered

    def _prepare_across(
        self,
        group: ProcessGroup,
        replicas: ReplicaGroup,
        fn: Callable[..., Any],
        per_replica_args: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
    ) -> tuple[_Program, list[Any], list[list[Any]], _Mesh, bool]:
        """`_prepare`, and the digest of the program on which every process must agree
        (in `run`, as the step's first collective): each one builds its global arrays
        from its own replicas' shapes, so a process whose inputs differ (a partial last
        batch) would run another program, and traces fn with its own closures and
        globals. The digest (`_signature`) describes the traced program, computed once,
        when it is first traced. Where they differ every process raises
        :class:`Uneven` (and runs this call eagerly)."""
        try:
            prepared = self._prepare(replicas, fn, per_replica_args)
        except Uneven:
            # The others' steps run nothing; they fall back to eager mode with this one.
            group.agree(None, self._mesh(replicas.devices))
            raise
        program, traced = prepared[0], prepared[4]
        if traced:
            raise NotImplementedError(
                "strategy.run of a strategy whose replicas span several processes "
                "(MultiWorkerMirroredStrategy) was called inside a JAX transformation "
                "(jax.jit, jax.grad, ...) with traced inputs; it cannot join that trace. Call "
                "strategy.run outside JAX transformations: it compiles the step itself."
            )
        if program.signature is None:
            # Traced once, before agreeing: the digest describes the program
            # this process would run, whatever its closures and globals hold.
            with _spmd_note():
                trace = program.jitted.trace(*prepared[1])
            fn_, spec, leaves, var_keys, x64 = program.signs
            program.signature = _signature(
                fn_, spec, leaves, var_keys, x64, trace.jaxpr, program.events
            )
        return prepared

    def _prepare(
        self,
        replicas: ReplicaGroup,
        fn: Callable[..., Any],
        per_replica_args: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
    ) -> tuple[_Program, list[Any], list[list[Any]], _Mesh, bool]:
        devices = replicas.devices
        mesh = self._mesh(devices)
        first = per_replica_args[0]
        flat, spec = _nest.flatten(first)
        if all(pr is first for pr in per_replica_args[1:]):
            # Core passes one (args, kwargs) to all replicas when nothing is distributed.
            columns = [[leaf] * len(per_replica_args) for leaf in flat]
        else:
            flats = [flat, *(_nest.flatten(pr)[0] for pr in per_replica_args[1:])]
            columns = [list(col) for col in zip(*flats, strict=True)]
        assert replicas.strategy is not None, "core passes the group of a run"
        extended = replicas.strategy.extended
        reused = self._reuse(extended, fn, spec, columns, mesh)
        if reused is not None:
            program, variables, inputs, var_inputs = reused
            _call.variables = variables
            _call.check = self._checks(program, mesh)
            return program, _ordered(var_inputs, inputs), columns, mesh, False
        state = tracking_state(_functional.owner(extended))
        version = state.version
        variables = _functional.collect(extended, len(devices), fn, flat)
        positions = {id(v): i for i, v in enumerate(variables)}
        leaves, inputs, traced = self._classify(columns, mesh, positions)
        var_inputs, var_keys = self._variable_input_arrays(variables, mesh)
        x64 = x64_enabled()
        key = (fn, spec, tuple(leaf.key() for leaf in leaves), var_keys, x64)
        program = self._program(replicas, key, fn, leaves, mesh, spec, variables)
        _call.variables = variables  # what a trace of this call functionalizes
        _call.check = self._checks(program, mesh)
        if not traced:
            found = (variables, positions, var_keys, state, version)
            self._remember(extended, fn, spec, columns, mesh, x64, program, leaves, inputs, found)
        return program, _ordered(var_inputs, inputs), columns, mesh, traced

    def _remember(
        self,
        extended: StrategyExtended,
        fn: Callable[..., Any],
        spec: Any,
        columns: list[list[Any]],
        mesh: _Mesh,
        x64: bool,
        program: _Program,
        leaves: list[_Leaf],
        inputs: list[Any],
        found: tuple[list[Variable], dict[int, int], tuple[Any, ...], Any, int],
    ) -> None:
        """Keeps this call's `_Plan` for the next call of ``fn``; ``found``: the
        variables, their positions and cache-key part, core's tracking state and its
        version."""
        slots: list[int | None] = []
        count = 0
        for leaf in leaves:
            if leaf.kind in (_REPLICA, _SHARED):
                slots.append(count)
                count += 1
            else:
                slots.append(None)
        closure = _closure(fn)
        try:
            contents = tuple(cell.cell_contents for cell in closure)
        except ValueError:  # an empty cell: not worth a plan
            return
        variables, positions, var_keys, state, version = found
        plan = _Plan(
            spec=spec,
            mesh=mesh,
            x64=x64,
            program=program,
            leaves=leaves,
            refs=[[_ref(v) for v in column] for column in columns],
            volatile=[any(isinstance(v, np.ndarray) for v in column) for column in columns],
            slots=slots,
            inputs=list(inputs),
            variables=[weakref.ref(v) for v in variables],
            positions=positions,
            var_keys=var_keys,
            state=state,
            version=version,
            closure=closure,
            contents=contents,
        )
        with self._lock:
            plans = self._plans.get(extended)
            if plans is None:
                plans = self._plans[extended] = collections.OrderedDict()
            plans[fn] = plan
            plans.move_to_end(fn)
            while len(plans) > CACHE_SIZE:
                plans.popitem(last=False)

    def _reuse(
        self,
        extended: StrategyExtended,
        fn: Callable[..., Any],
        spec: Any,
        columns: list[list[Any]],
        mesh: _Mesh,
    ) -> tuple[_Program, list[Variable], list[Any], list[Any]] | None:
        """The last call's plan for ``fn``, if it still holds: the same nest structure,
        mesh and x64 mode, no variable tracked or gone since, fn's closure holding the
        same objects, and each input the same object as then (a column that changed is
        classified again alone, and must give the same kind, shape and dtype). Returns
        the program, the variables, the inputs and the variables' inputs; None: prepare
        this call from scratch."""
        plans = self._plans.get(extended)
        plan = plans.get(fn) if plans is not None else None
        if (
            plan is None
            or plan.spec != spec
            or plan.mesh is not mesh
            or plan.x64 != x64_enabled()
            or plan.state.version != plan.version
            or plan.program.created
        ):
            return None
        variables = [ref() for ref in plan.variables]
        if any(v is None for v in variables):
            return None
        if not _closure_unchanged(plan):
            return None
        inputs = plan.inputs
        changed: list[int] = []
        for i, column in enumerate(columns):
            if not plan.volatile[i]:
                for r, v in zip(plan.refs[i], column):
                    if r() is not v:
                        break
                else:
                    continue
            leaves, fresh, traced = self._classify([column], mesh, plan.positions)
            if traced or leaves[0].key() != plan.leaves[i].key():
                return None
            slot = plan.slots[i]
            if slot is not None:
                if not changed:
                    inputs = list(inputs)
                inputs[slot] = fresh[0]
            changed.append(i)
        var_inputs, var_keys = self._variable_input_arrays(variables, mesh)  # type: ignore[arg-type]
        if var_keys != plan.var_keys:
            return None
        if changed:  # the next call with these same objects finds them
            for i in changed:
                plan.refs[i] = [_ref(v) for v in columns[i]]
                if plan.dispatch is not None:
                    plan.dispatch.held[i] = None  # no longer the components of its input
            plan.inputs = inputs
        return plan.program, variables, inputs, var_inputs  # type: ignore[return-value]

    def _checks(self, program: _Program, mesh: _Mesh) -> bool:
        """Whether this call of ``program`` hashes its NONE variables' copies: its first
        `CHECK_AT_ONCE` calls, then one in `CHECK_EVERY` (every call across processes)."""
        calls = program.calls
        return mesh.spans_processes or calls < CHECK_AT_ONCE or calls % CHECK_EVERY == 0

    def _variable_input_arrays(
        self, variables: list[Variable], mesh: _Mesh
    ) -> tuple[list[Any], tuple[Any, ...]]:
        """Each variable's copies as one global array (sharded; plain: replicated), and the
        cache-key part: which variables, their shapes and dtypes (never their values)."""
        if not variables:
            return [], ()
        # Inside an outer jax.jit the reshapes below must still run now, on concrete arrays.
        with jax.ensure_compile_time_eval():
            return self._assemble_variable_inputs(variables, mesh)

    def _assemble_variable_inputs(
        self, variables: list[Variable], mesh: _Mesh
    ) -> tuple[list[Any], tuple[Any, ...]]:
        inputs: list[Any] = []
        keys: list[Any] = []
        units: list[tuple[int, Variable, list[Any]]] = []
        for var in variables:
            whole = self._variable_inputs.deferred(var)
            if whole is not None:  # a direct call's copies, still whole
                keys.append((id(var), True, *whole[1]))
                inputs.append(whole[0])
                continue
            arrays = storage_arrays(var)
            distributed = isinstance(var, DistributedVariable)
            shape, dtype = _aval(arrays[0])
            keys.append((id(var), distributed, shape, dtype))
            cached = self._variable_inputs.get(var, arrays)
            if cached is not None:
                inputs.append(cached)
                continue
            if not distributed:
                value = mesh.replicate(arrays[0])
                self._variable_inputs.put(var, arrays, value)
                inputs.append(value)
                continue
            components = [self._component(a, r, mesh) for r, a in enumerate(arrays)]
            if not shape:
                units.append((len(inputs), var, components))
            inputs.append((var, arrays, components))
        if units:
            reshaped = _per_device(_to_unit, [c for _, _, c in units])
            for (i, _, _), comps in zip(units, reshaped, strict=True):
                var, arrays, _ = inputs[i]
                inputs[i] = (var, arrays, comps)
        for i, item in enumerate(inputs):
            if isinstance(item, tuple):
                var, arrays, parts = item
                value = mesh.assemble(parts)
                self._variable_inputs.put(var, arrays, value)
                inputs[i] = value
        return inputs, tuple(keys)

    def _write_back(
        self,
        program: _Program,
        variables: list[Variable],
        updated: list[Any],
        mesh: _Mesh,
        traced: bool,
        *,
        concrete: bool = False,
    ) -> None:
        """Replaces the copies of every variable the call wrote by the program's outputs
        (``concrete``: the caller knows they are no tracers)."""
        if not updated:
            return
        if traced or (not concrete and any(is_tracer(u) for u in updated)):
            raise NotImplementedError(
                "strategy.run was called inside a JAX transformation (jax.jit, jax.grad, ...) "
                f"and updated {variables[program.updates[0][0]].name!r}: its new value would be "
                "a traced value of the outer transformation, which cannot be stored. Update "
                "variables in runs called outside JAX transformations, or return the new "
                "values from fn instead."
            )
        if self._store(program, variables, updated, mesh):
            return  # deferred copies: nothing to count (`InputCache.seal`)
        # Counted once this call's own references to the new copies are gone (`_store`
        # returned): references beyond these are someone else's (`_local_call`).
        for position, _ in program.updates:
            self._variable_inputs.seal(variables[position])

    def _store(
        self, program: _Program, variables: list[Variable], updated: list[Any], mesh: _Mesh
    ) -> bool:
        """Stores the new copies; True: deferred (`_Stored`), else split per replica."""
        n = len(mesh.devices)
        whole = program.store_whole  # the same variables (kinds, copies) every call
        if whole is None:
            whole = program.store_whole = all(
                isinstance(variables[p], DistributedVariable) and len(variables[p].values) == n
                for p, _ in program.updates
            )
        if whole:
            # Each variable's new copies stay the program's output array (the next
            # call's input as it is), a copy split out only when read; one device too
            # (storing its copy per step cost ~25 us of host time for six variables).
            avals = program.stored_avals
            if avals is None:
                avals = program.stored_avals = [
                    _Stored.aval_of(g, mesh, scalar)
                    for (_, scalar), g in zip(program.updates, updated, strict=True)
                ]
            put = self._variable_inputs.put_deferred
            renew = self._variable_inputs.renew_deferred
            for (position, scalar), global_array, aval in zip(
                program.updates, updated, avals, strict=True
            ):
                var = variables[position]
                # Last call's source, no copy read from it: this call's output in its place.
                if renew(var, global_array, aval, mesh, scalar):
                    continue
                source = _Stored(global_array, mesh, scalar, aval)
                defer_storage(var, source)
                put(var, source, global_array)
            return True
        if mesh.single_device:
            # (Variables stored otherwise than whole, e.g. plain ones.) The variable's
            # own array object, not the program's output (the next input):
            # `InputCache.exclusive` counts who else holds the stored copy.
            parts = [[g.addressable_data(0)] for g in updated]
        else:
            parts = [_shards(g, mesh) for g in updated]
        scalars = [i for i, (_, scalar) in enumerate(program.updates) if scalar]
        if scalars:
            squeezed = _per_device(_to_scalar, [parts[i] for i in scalars])
            for i, p in zip(scalars, squeezed, strict=True):
                parts[i] = p
        for (position, _), global_array, new in zip(program.updates, updated, parts, strict=True):
            var = variables[position]
            swap_storage(var, new)
            self._variable_inputs.put(var, new, global_array)
        return False

    # -- inputs ---------------------------------------------------------------------
    def _classify(
        self, columns: list[list[Any]], mesh: _Mesh, variables: dict[int, int]
    ) -> tuple[list[_Leaf], list[Any], bool]:
        leaves: list[_Leaf] = []
        inputs: list[Any] = []
        traced = False
        units: list[tuple[int, list[Any]]] = []  # rank-0 jax components to reshape to [1]
        in_place: set[int] = set()  # inputs whose components are the caller's own arrays
        for column in columns:
            first = column[0]
            if all(
                getattr(v, "size", 1) == 0 and _is_array(v) and not is_tracer(v) for v in column
            ):
                avals = {_aval(v) for v in column}
                if len(avals) == 1:  # else: uneven, reported below
                    shape, dtype = avals.pop()
                    leaves.append(_Leaf(_EMPTY, shape=shape, dtype=dtype))
                    continue
            if all(v is first for v in column[1:]):
                if _is_variable(first):
                    # A variable reaches the replicas whole: fn gets the variable object,
                    # whose copies are the functionalized inputs at that position.
                    position = variables.get(id(first))
                    if position is not None:
                        leaves.append(_Leaf(_VARIABLE, obj=position))
                        continue
                    if isinstance(first, DistributedVariable):
                        # Another strategy's variable: fn gets it as it is (using it
                        # raises, as on every backend).
                        leaves.append(_Leaf(_STATIC, obj=first))
                        continue
                    what = (
                        "a plain variable of another backend"
                        if isinstance(first, Variable)
                        else "a distributed value handed to replicas whole, which is not a "
                        "polydist variable"
                    )
                    raise NotImplementedError(
                        f"The jax backend cannot pass {first!r} into a compiled strategy.run: "
                        f"it is {what}. Create variables under the strategy's scope, or pass "
                        "values as arrays."
                    )
                if not _is_array(first):
                    leaves.append(_Leaf(_STATIC, obj=first))
                    continue
                shape, dtype = _aval(first)
                if is_tracer(first):
                    traced = True
                    inputs.append(first)
                else:
                    value = self._replicated(first, mesh)
                    shape, dtype = _aval(value)
                    inputs.append(value)
                leaves.append(_Leaf(_SHARED, shape=shape, dtype=dtype))
                continue
            sharded = _input.run_input(column, mesh)
            if sharded is not None:  # a distributed dataset's global array, or NumPy batches
                leaves.append(_Leaf(_REPLICA, shape=sharded[1][0], dtype=sharded[1][1]))
                inputs.append(sharded[0])
                continue
            components = [self._component(v, r, mesh) for r, v in enumerate(column)]
            shape, dtype = _aval(components[0])
            for r, c in enumerate(components[1:], start=1):
                if _aval(c) != (shape, dtype):
                    raise Uneven(
                        f"replica 0 has {describe(components[0])} but replica {r} has {describe(c)}"
                    )
            leaves.append(_Leaf(_REPLICA, shape=shape, dtype=dtype))
            if any(is_tracer(c) for c in components):
                traced = True
                joined = (
                    jnp.stack(components)
                    if not shape
                    else jnp.concatenate([jnp.asarray(c) for c in components])
                )
                inputs.append(joined)
            else:
                if not shape:
                    units.append((len(inputs), components))
                elif all(c is v for c, v in zip(components, column, strict=True)):
                    in_place.add(len(inputs))
                inputs.append(components)
        if units:
            reshaped = _per_device(_to_unit, [c for _, c in units])
            for (i, _), comps in zip(units, reshaped, strict=True):
                inputs[i] = comps
        for i, value in enumerate(inputs):
            if isinstance(value, list):
                inputs[i] = mesh.assemble(value)
                if i in in_place:
                    # The caller's own arrays, already in place: the same components
                    # next step (a PerReplica reused) find this array by identity.
                    _input.register(value, inputs[i], mesh.split)
        return leaves, inputs, traced

    def _replicated(self, value: Any, mesh: _Mesh) -> Any:
        """A shared input as the program takes it (a copy on each replica's device),
        remembered by identity for a ``jax.Array`` (immutable) while it lives: a
        value passed again each step is placed once."""
        if not isinstance(value, jax.Array):
            return mesh.replicate(value)
        if mesh.single_device and value.committed and value.sharding == mesh.single[0]:
            return value  # already the input (a new batch each step): nothing to remember
        key = id(value)
        hit = self._placed.get(key)
        if hit is not None and hit[0]() is value and hit[1] is mesh:
            return value if hit[2] is None else hit[2]
        sharding = value.sharding
        if mesh.spans_processes and type(sharding) is SingleDeviceSharding:
            placed = mesh.replicate(value)  # never the cross-process sharding: not compared
        else:
            placed = value if sharding == mesh.replicated else mesh.replicate(value)
        placed_self = placed is value

        def drop(ref: weakref.ref[Any], key: int = key) -> None:
            entry = self._placed.get(key)
            if entry is not None and entry[0] is ref:
                del self._placed[key]

        self._placed[key] = (weakref.ref(value, drop), mesh, None if placed_self else placed)
        return placed

    @staticmethod
    def _component(value: Any, r: int, mesh: _Mesh) -> Any:
        if is_tracer(value):
            return value
        if isinstance(value, jax.Array):
            # Uncommitted arrays (made under jax.default_device) would follow jit to device 0.
            if value.committed and value.sharding == mesh.single[r]:
                return value
            return jax.device_put(value, mesh.devices[r])
        if _is_variable(value):
            raise NotImplementedError(
                f"The jax backend cannot pass a {type(value).__name__} inside a per-replica "
                "value into strategy.run (variables are not supported by the jax backend)."
            )
        try:
            array = convert_to_array(value)
        except TypeError as e:
            raise Uneven(f"{type(value).__name__} values differ between replicas") from e
        return jax.device_put(np.asarray(array), mesh.devices[r])

    # -- programs -------------------------------------------------------------------
    def _program(
        self,
        replicas: ReplicaGroup,
        key: Any,
        fn: Callable[..., Any],
        leaves: list[_Leaf],
        mesh: _Mesh,
        spec: Any,
        variables: list[Variable],
    ) -> _Program:
        assert replicas.strategy is not None, "core passes the group of a run"
        extended = replicas.strategy.extended  # the programs are cached per strategy
        with self._lock:
            cache = self._programs.get(extended)
            if cache is None:
                cache = self._programs[extended] = collections.OrderedDict()
            program = cache.get(key)
            if program is not None:
                cache.move_to_end(key)
                return program
        kinds = [isinstance(v, DistributedVariable) for v in variables]
        program = self._build(replicas, fn, leaves, mesh, spec, kinds)
        program.signs = (fn, spec, leaves, key[3], key[4])  # for a group's digest

        def evict() -> None:
            with self._lock:
                if cache.get(key) is program:
                    del cache[key]

        program.evict = evict
        with self._lock:
            cache[key] = program
            while len(cache) > CACHE_SIZE:
                cache.popitem(last=False)
        return program

    def _build(
        self,
        replicas: ReplicaGroup,
        fn: Callable[..., Any],
        leaves: list[_Leaf],
        mesh: _Mesh,
        spec: Any,
        distributed: list[bool],
    ) -> _Program:
        strategy = replicas.strategy
        assert strategy is not None, "core passes the group of a run"
        n = len(replicas.devices)
        dynamic = [leaf for leaf in leaves if leaf.kind not in (_STATIC, _VARIABLE, _EMPTY)]
        split_spec = pspec(mesh.axis)
        # The variables' copies: split (one copy per replica), or replicated for a plain
        # variable (one copy, read-only). First, as hand-written steps take their
        # parameters (a hand-written MLP step on 8 XLA:CPU devices ran 10-25% longer in
        # wall time with the batch first; its CPU time was the same).
        var_specs = tuple(split_spec if d else pspec() for d in distributed)
        dyn_specs = tuple(split_spec if leaf.kind == _REPLICA else pspec() for leaf in dynamic)
        in_specs = var_specs + dyn_specs if _VARIABLES_FIRST else dyn_specs + var_specs
        n_vars, n_dyn = len(distributed), len(dynamic)
        var_part = slice(0, n_vars) if _VARIABLES_FIRST else slice(n_dyn, None)
        dyn_part = slice(n_vars, None) if _VARIABLES_FIRST else slice(0, n_dyn)

        def body(*blocks: Any) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
            self.compile_count += 1
            program.traces += 1
            variables = _call.variables
            var_blocks = []
            for var, block in zip(variables, blocks[var_part], strict=True):
                if isinstance(var, DistributedVariable) and not var.shape:
                    block = jnp.reshape(block, ())  # rank-0 copies travel as shape [1]
                block = vary(block)  # as shared inputs
                var_blocks.append(block)
            traced_vars = TracedVariables(variables, var_blocks, n)
            values: list[Any] = []
            entries: dict[int, int] = {}  # id(traced input) -> leaf index
            shared: set[int] = set()
            it = iter(blocks[dyn_part])
            for i, leaf in enumerate(leaves):
                if leaf.kind == _STATIC:
                    values.append(leaf.obj)
                    continue
                if leaf.kind == _VARIABLE:
                    values.append(variables[leaf.obj])
                    continue
                if leaf.kind == _EMPTY:
                    block = jnp.zeros(leaf.shape, leaf.dtype[0])
                    entries[id(block)] = i
                    values.append(block)
                    continue
                block = next(it)
                if leaf.kind == _REPLICA and not leaf.shape:
                    block = jnp.reshape(block, ())
                if leaf.kind == _SHARED and not is_varying(block):
                    # TF's replicas each own their inputs: make the copy "varying", so
                    # jax.grad with respect to it is this replica's gradient alone.
                    block = vary(block)
                    shared.add(id(block))
                entries[id(block)] = i
                values.append(block)
            args, kwargs = _nest.unflatten(spec, values)
            channel = SpmdChannel(replicas, shared, traced_vars)
            ctx = ReplicaContext(
                strategy, lax.axis_index(mesh.axis), channel=channel, replica_index=None
            )
            with traced_vars.tracing(strategy.extended):
                with _capture_collectives() as capture, lazy_scope():
                    with ctx:
                        result = fn(*args, **kwargs)
                    program.events = capture.events
                updates = traced_vars.outputs()
            program.created = traced_vars.created
            variables = traced_vars.variables()
            program.updates = [(i, not variables[i].shape) for i, _ in updates]
            # One replica in all: its one copy cannot diverge (nothing to hash).
            program.dirty = traced_vars.dirty if mesh.replicas > 1 else []
            new_values = [jnp.reshape(v, (1,)) if not variables[i].shape else v for i, v in updates]
            positions = {id(v): i for i, v in enumerate(variables)}
            flat, program.out_spec = _nest.flatten(result)
            outputs: list[_Output] = []
            split: list[Any] = []
            replicated: list[Any] = []
            for leaf_value in flat:
                if isinstance(leaf_value, Variable):
                    # The variable itself (regrouping gives it back), or one of its copies:
                    # each replica gets its own, which regroups to the variable (as on
                    # eager backends).
                    container = value_container(leaf_value)
                    if id(leaf_value) in positions:
                        outputs.append(_Output("variable", positions[id(leaf_value)]))
                    elif container is not leaf_value and id(container) in positions:
                        outputs.append(_Output("component", positions[id(container)]))
                    else:
                        outputs.append(_Output("static", obj=leaf_value))
                    continue
                if isinstance(leaf_value, DistributedValues):
                    raise TypeError(
                        f"The replica function returned a {type(leaf_value).__name__}; return "
                        "arrays (strategy.run regroups them into PerReplica values itself)."
                    )
                if not is_tracer(leaf_value):
                    outputs.append(_Output("static", obj=leaf_value))
                elif id(leaf_value) in entries:
                    outputs.append(_Output("input", index=entries[id(leaf_value)]))
                elif not leaf_value.size:
                    # No data: made outside the program. A zero-size output beside a
                    # collective crashes XLA:CPU's compiler (jax 0.11.2).
                    outputs.append(_Output("empty", obj=(leaf_value.shape, leaf_value.dtype)))
                else:
                    # A merge_fn result handed to all replicas as one object comes back
                    # as one object (replica 0's copy).
                    common = id(leaf_value) in channel.common
                    if is_varying(leaf_value):
                        scalar = not leaf_value.shape
                        outputs.append(_Output("split", len(split), scalar, common=common))
                        split.append(jnp.reshape(leaf_value, (1,)) if scalar else leaf_value)
                    else:
                        outputs.append(_Output("replicated", len(replicated), common=common))
                        replicated.append(leaf_value)
            program.outputs = outputs
            # The divergence check hashes the written copies in a program of its own
            # (`_Fingerprints`), in the calls that check: one more output here, even a
            # skipped branch's, made XLA:CPU run the MLP step 15% slower.
            checks = []
            if not (split or replicated) and new_values and _throttled(mesh):
                # Something for `_throttle` to wait on that is not donated next step.
                checks = [jnp.zeros((1, 1), jnp.uint32)]
            return split, replicated, new_values, checks

        def scoped(*blocks: Any) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
            with axes_scope(mesh.axes):
                return body(*blocks)

        mapped = jax.shard_map(
            scoped,
            mesh=mesh.mesh,
            in_specs=in_specs,
            out_specs=(split_spec, pspec(), split_spec, split_spec),
        )
        program = _Program(jitted=jax.jit(mapped), leaves=leaves)
        if len(mesh.devices) == 1 and not mesh.spans_processes:
            # One device: the global outputs are the replica's values; rank-0 results
            # lose their replica axis inside the program (a dispatch per step saved).
            def single(*blocks: Any) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
                split, replicated, new_values, checks = mapped(*blocks)
                scalar = {o.index for o in program.outputs if o.kind == "split" and o.scalar}
                split = [jnp.reshape(g, ()) if i in scalar else g for i, g in enumerate(split)]
                return split, replicated, new_values, checks

            program.jitted = jax.jit(single)
            program.squeezed = True
            program.single = mesh.single[0]
            program.single_split = mesh.split
        return program

    # -- outputs ----------------------------------------------------------------------
    def _results(
        self,
        program: _Program,
        columns: list[list[Any]],
        split: list[Any],
        replicated: list[Any],
        mesh: _Mesh,
        traced: bool,
        variables: list[Variable],
    ) -> list[Any]:
        n = len(mesh.devices)
        tracing = traced or any(is_tracer(x) for x in (*split, *replicated))
        if tracing:
            scalar = {o.index for o in program.outputs if o.kind == "split" and o.scalar}
            split_parts = [
                [g] if program.squeezed else _slices(g, n, i in scalar) for i, g in enumerate(split)
            ]
            replicated_parts = [[jnp.array(g, copy=True) for _ in range(n)] for g in replicated]
        else:
            split_parts, replicated_parts = _parts(program, split, replicated, mesh)
        return self._per_replica(
            program, columns, split_parts, replicated_parts, mesh, tracing, variables
        )

    def _per_replica(
        self,
        program: _Program,
        columns: list[list[Any]],
        split_parts: list[list[Any]],
        replicated_parts: list[list[Any]],
        mesh: _Mesh,
        tracing: bool,
        variables: list[Variable],
    ) -> list[Any]:
        n = len(mesh.devices)
        results = []
        for r in range(n):
            leaves = []
            for out in program.outputs:
                part = 0 if out.common else r
                if out.kind == "split":
                    leaves.append(split_parts[out.index][part])
                elif out.kind == "replicated":
                    leaves.append(replicated_parts[out.index][part])
                elif out.kind == "input":
                    leaves.append(columns[out.index][r])
                elif out.kind == "variable":
                    leaves.append(variables[out.index])
                elif out.kind == "component":
                    leaves.append(_trace.components(variables[out.index])[r])
                elif out.kind == "empty":
                    shape, dtype = out.obj
                    empty = np.zeros(shape, dtype)
                    leaves.append(
                        jnp.asarray(empty) if tracing else jax.device_put(empty, mesh.devices[r])
                    )
                else:
                    leaves.append(out.obj)
            results.append(_nest.unflatten(program.out_spec, leaves))
        return results


class _DivergenceChecks:
    """The NONE-aggregation divergence check (core's ``ReplicaDivergenceWarning``)
    without a host round trip per step.

    After a call that wrote NONE variables in replica context, a program of its own
    (`_Fingerprints`) hashes each one's copies on the device (`_functional.fingerprint`),
    one row per replica, in the calls that check (`CompiledRunner._checks`). A program's first
    `CHECK_AT_ONCE` calls read them at once (waiting for the step), so a step that
    diverges the copies early warns in that very call. Later checks are queued: each
    ``run`` reads the queued fingerprints whose step has finished (``is_ready``, no
    wait) and waits only when more than ``limit`` are unread. A divergence is reported
    by the run that reads it (core then compares the copies as they are by then).
    """

    def __init__(self, limit: int = 8) -> None:
        self.limit = limit
        self._queue: collections.deque[tuple[list[Variable], Any, _Mesh]] = collections.deque()
        self._lock = threading.Lock()

    def add(self, dirty: list[Variable], found: Any, mesh: _Mesh, *, wait: bool) -> None:
        if wait:
            _mark_diverged(dirty, found, mesh)
            return
        with self._lock:
            self._queue.append((dirty, found, mesh))
        self.poll()

    def poll(self, *, wait: bool = False) -> None:
        """Reads every queued fingerprint whose step has finished (all of them, waiting,
        with ``wait``; the oldest ones, waiting, past ``limit``)."""
        if not self._queue:
            return
        while True:
            with self._lock:
                if not self._queue:
                    return
                dirty, found, mesh = self._queue[0]
                if not (wait or len(self._queue) > self.limit or found.is_ready()):
                    return
                self._queue.popleft()
            _mark_diverged(dirty, found, mesh)


class _Fingerprints:
    """The divergence check's hashes: a program of its own over the written variables'
    global arrays (each replica hashes its own copy, `_functional.fingerprint`; no
    collective), one row of fingerprints per replica. Dispatched after the step, in the
    calls that check only, so the step's program is the same with or without it."""

    def __init__(self) -> None:
        self._programs: dict[tuple[str, ...], tuple[_Mesh, Any]] = {}

    def __call__(self, mesh: _Mesh, arrays: Sequence[Any]) -> Any:
        key = mesh.axes + tuple(str(d) for d in mesh.mesh.devices.flat)
        hit = self._programs.get(key)
        if hit is None or hit[0] is not mesh:
            split = pspec(mesh.axis)

            def rows(*copies: Any) -> Any:
                return jnp.reshape(jnp.stack([_functional.fingerprint(c) for c in copies]), (1, -1))

            program = jax.jit(jax.shard_map(rows, mesh=mesh.mesh, in_specs=split, out_specs=split))
            hit = self._programs[key] = (mesh, program)
        return hit[1](*arrays)


def _mark_diverged(dirty: list[Variable], found: Any, mesh: _Mesh) -> None:
    """Hands core's divergence check (after the call) the NONE variables a call wrote
    whose copies' fingerprints differ; one small transfer, none once all have warned."""
    if all(getattr(v, "_divergence_warned", False) for v in dirty):
        return
    # One row of fingerprints per replica (this process's: its copies are the variable's).
    rows = (
        np.concatenate([np.asarray(part) for part in _shards(found, mesh)])
        if mesh.spans_processes
        else np.asarray(found)
    )
    columns = rows.reshape(rows.shape[0], len(dirty), -1)
    for j, var in enumerate(dirty):
        if not (columns[:, j] == columns[0, j]).all():
            _trace.note_replica_write(var)  # type: ignore[arg-type]


def _parts(
    program: _Program, split: list[Any], replicated: list[Any], mesh: _Mesh
) -> tuple[list[list[Any]], list[list[Any]]]:
    """Each replica's part of the program's split and replicated outputs."""
    if mesh.spans_processes and len(mesh.devices) == 1:
        # A worker's one device: each output's one buffer (`_worker_outputs`), read as
        # `_Mesh.parts` would, without its checks (the outputs are this call's).
        try:
            return [[g._arrays[0]] for g in split], [[g._arrays[0]] for g in replicated]
        except (AttributeError, TypeError, IndexError):
            pass  # JAX without ``_arrays`` as a list: `_Mesh.parts`
    split_parts = [_shards(g, mesh) for g in split]
    replicated_parts = [_shards(g, mesh) for g in replicated]
    # Rank-0 results as ``[1]`` blocks (`program.jitted`'s; `program.local`'s are rank 0
    # already, `_rank0_outputs`): reshaped on each device.
    scalars = [i for i in _scalars(program) if split[i].ndim]
    if scalars and not program.squeezed:
        squeezed = _per_device(_to_scalar, [split_parts[i] for i in scalars])
        for i, parts in zip(scalars, squeezed, strict=True):
            split_parts[i] = parts
    return split_parts, replicated_parts


def _scalars(program: _Program) -> list[int]:
    """The indices of ``program``'s split outputs that are rank 0 per replica."""
    scalars = program.scalars
    if scalars is None:
        scalars = program.scalars = [
            o.index for o in program.outputs if o.kind == "split" and o.scalar
        ]
    return scalars


def _plain_leaf(
    how: int, index: int, obj: Any, variables: list[Variable], flat: Sequence[Any]
) -> Any:
    """A result leaf that is no program output (`_Dispatch.outputs`: _R_OBJECT,
    _R_VARIABLE or _R_INPUT)."""
    if how == _R_OBJECT:
        return obj
    if how == _R_VARIABLE:
        return variables[index]
    return flat[index]


def _same_result(expected: Any, got: Any) -> bool:
    """Whether ``got`` is ``expected``: the same structure, the same leaves (distributed
    values: of the same type, with the very same components)."""
    flat_e, spec_e = _nest.flatten(expected)
    flat_g, spec_g = _nest.flatten(got)
    if spec_e != spec_g:
        return False
    for e, g in zip(flat_e, flat_g, strict=True):
        if e is g:
            continue
        if not (
            type(e) is type(g)
            and isinstance(e, DistributedValues)
            and len(e.values) == len(g.values)
            and all(a is b for a, b in zip(e.values, g.values, strict=True))
        ):
            return False
    return True


def _plan_holds(plan: _Plan) -> bool:
    """Whether what ``plan`` was made under still holds: its program made no variable,
    none was tracked or gone since, the same x64 mode, fn's closure holding the same
    objects (the direct path's and the prepared call's checks)."""
    return (
        not plan.program.created
        and plan.state.version == plan.version
        and plan.x64 == x64_enabled()
        and (not plan.closure or _closure_unchanged(plan))
    )


def _closure_unchanged(plan: _Plan) -> bool:
    """Whether each cell of fn's closure still holds what the plan was traced with."""
    for cell, held in zip(plan.closure, plan.contents, strict=True):
        try:
            if cell.cell_contents is not held:
                return False
        except ValueError:  # the cell was emptied
            return False
    return True


def _leaf_types(args: tuple[Any, ...], types: tuple[type, ...] | None) -> bool:
    return types is not None and tuple(map(type, args)) == types


def _template(args: tuple[Any, ...], flat: list[Any]) -> tuple[Any, ...] | None:
    """`_Dispatch.template` of core's leaves ``flat`` of ``(args, {})``, if each argument
    is a leaf or a list or tuple (exactly) of leaves; else None."""
    template: list[Any] = []
    position = 0
    for a in args:
        if position < len(flat) and flat[position] is a:
            template.append(type(a))
            position += 1
            continue
        if type(a) not in (list, tuple):
            return None
        items = flat[position : position + len(a)]
        if len(items) != len(a) or not all(map(operator.is_, items, a)):
            return None
        template.append((type(a), tuple(map(type, a))))
        position += len(a)
    return tuple(template) if position == len(flat) else None


def _flat_args(args: tuple[Any, ...], template: tuple[Any, ...]) -> list[Any] | None:
    """Core's leaves of ``(args, {})``, without flattening, when ``args`` fit
    ``template`` (the same leaf types, the same lists and tuples of them): the types
    decide what a leaf is, so the structure is the one the template was made from."""
    if len(args) != len(template):
        return None
    flat: list[Any] = []
    for a, kind in zip(args, template):
        if type(kind) is tuple:
            cls, types = kind
            if type(a) is not cls or tuple(map(type, a)) != types:
                return None
            flat.extend(a)
        elif type(a) is kind:
            flat.append(a)
        else:
            return None
    return flat


_MISSED = object()  # `_call_lane`: the lane declined the call


def _make_lane(plan: _Plan, dispatch: _Dispatch) -> None:
    """Gives ``dispatch`` its lane, where the plan allows one: one device, one process,
    no variables, every leaf of ``(args, {})`` an array or a one-replica ``PerReplica``
    of one (in any nest: lists, dicts, a framework's pytrees of parameters), a result
    made of program outputs only, and a program that compiled fast
    (`LANE_COMPILE_SECONDS`). The caller makes it for calls without ``kwargs``.

    The lane is ``jax.jit`` of a function of fn's arguments: traced, it takes core's
    leaves of them as the replay does (the same structure, kinds, shapes, dtypes and
    weak types, else `_LaneMiss`) and runs the program's jaxpr on them, placed on the
    device (``in_shardings``). Each call then is JAX's C++ dispatch of fn's arguments,
    with no per-leaf work in Python."""
    program = plan.program
    run, seconds = program.local_fun, program.compile_seconds
    if (
        run is None
        or seconds is None
        or seconds >= LANE_COMPILE_SECONDS * _lane_factor(program)
        or program.lanes >= _LANE_BUILDS
        or plan.variables
        or program.kept is not None
        or not dispatch.picks
        or any(kind not in (_D_ARRAY, _D_ONE) for kind in dispatch.kinds)
        or sorted(slot for slot in plan.slots if slot is not None) != list(range(len(plan.inputs)))
    ):
        dispatch.lane_off = True
        return
    spec, kinds, avals = dispatch.spec, list(dispatch.kinds), list(dispatch.avals)
    slots = [slot for slot in plan.slots if slot is not None]
    picks, n_inputs = list(dispatch.picks), len(plan.inputs)
    out_spec, one = program.out_spec, dispatch.leaf
    path = None if one else _lane_path(out_spec, len(picks))

    def lane(*args: Any) -> Any:
        leaves, got = _nest.flatten((args, {}))
        if got != spec:
            raise _LaneMiss("another structure")
        inputs: list[Any] = [None] * n_inputs
        for i, x in enumerate(leaves):
            if kinds[i] == _D_ONE:
                if not isinstance(x, DistributedValues) or len(x._values) != 1:
                    raise _LaneMiss("not a one-replica distributed value")
                x = x._values[0]
            if not is_tracer(x) or _aval(x) != avals[i]:
                raise _LaneMiss("another kind, shape, dtype or weak type")
            inputs[slots[i]] = x
        outputs = run(*inputs)
        leaves = [outputs[j] for j in picks]
        if one:
            return leaves[0]
        return leaves if path is None else _nest.unflatten(out_spec, leaves)

    program.lanes += 1
    dispatch.lane_path = path
    dispatch.lane = jax.jit(lane, in_shardings=program.single, out_shardings=program.single)
    # The lane's calls leave the plan's inputs alone: it holds none of the arrays (a
    # replay later finds its leaves again, `_direct_inputs`; `run`, `_reuse`).
    for i, slot in enumerate(plan.slots):
        if slot is not None:
            plan.inputs[slot] = None
            plan.refs[i] = [_UNKNOWN] * len(plan.refs[i])
            dispatch.held[i] = None
    dispatch.last = None
    dispatch.passed_back = None


def _call_lane(
    plan: _Plan, dispatch: _Dispatch, devices: tuple[str, ...], args: tuple[Any, ...]
) -> Any:
    """A call through ``dispatch.lane`` (see `_make_lane`): fn's result, or `_MISSED`
    (the lane is then dropped and the call replayed as before)."""
    if devices is not dispatch.devices and devices != dispatch.devices:
        return _MISSED
    try:
        out = dispatch.lane(*args)
    except Exception:  # arguments it does not take (a structure, an array on another device)
        dispatch.lane, dispatch.lane_off = None, True
        return _MISSED
    # Its first leaf says whether an outer transformation made tracers of the result
    # (the replay's own trace path then).
    path = dispatch.lane_path
    if dispatch.leaf:
        first = out
    elif path is None:
        first = out[0]
    else:
        first = out
        for key in path:
            first = first[key]
    if is_tracer(first):
        dispatch.lane, dispatch.lane_off = None, True
        return _MISSED
    program = plan.program
    program.calls += 1
    if dispatch.leaf or path is not None:
        return out
    return _nest.unflatten(program.out_spec, out)


def _lane_factor(program: _Program) -> float:
    """`LANE_ACCELERATOR_FACTOR` for a program on a GPU or TPU, else 1."""
    single = program.single
    if single is None:
        return 1.0
    platforms = {getattr(d, "platform", None) for d in single.device_set}
    return 1.0 if platforms == {"cpu"} else LANE_ACCELERATOR_FACTOR


def _lane_path(out_spec: Any, count: int) -> tuple[Any, ...] | None:
    """Where the first leaf of fn's result is (indices, keys), when JAX's pytrees hold
    the result as core's nest does: the same leaves in the same order, and unflattened
    by JAX the same types in the same order (dict keys included). The lane then returns
    the result itself, and jit's C++ builds it. None: the lane returns the leaves."""
    marks = list(range(count))
    try:
        ours = _nest.unflatten(out_spec, marks)
        leaves, treedef = jax.tree_util.tree_flatten(ours)
        if leaves != marks or repr(jax.tree_util.tree_unflatten(treedef, marks)) != repr(ours):
            return None
    except Exception:  # a node JAX does not take as core does
        return None
    path: list[Any] = []
    node: Any = ours
    while type(node) is not int:
        if isinstance(node, dict):
            items: list[tuple[Any, Any]] = list(node.items())
        elif isinstance(node, (list, tuple)):
            items = list(enumerate(node))
        else:
            return None  # (a registered node: no indexing to reach its leaves)
        for key, child in items:
            if jax.tree_util.tree_leaves(child)[:1] == [0]:
                path.append(key)
                node = child
                break
        else:
            return None
    return tuple(path)


def _direct_replica(values: tuple[Any, ...], aval: Any, mesh: _Mesh) -> Any:
    """The program input of a distributed value's components, if each is an array of
    the plan's shape and dtype on its replica's device (else None)."""
    found = _input.joined(values, mesh.split)
    if found is not None:
        return found[0] if found[1] == aval else None
    if not aval[0]:
        return None  # rank 0: `run` reshapes the components
    single = mesh.single
    for r, v in enumerate(values):
        if (
            not isinstance(v, jax.Array)
            or is_tracer(v)
            or not v.committed
            or v.sharding != single[r]
            or _aval(v) != aval
        ):
            return None
    return mesh.assemble(values)


def _direct_result(
    program: _Program,
    dispatch: _Dispatch,
    split_parts: list[list[Any]],
    replicated_parts: list[list[Any]],
    variables: list[Variable],
    flat: Sequence[Any],
) -> Any:
    """The regrouped result of a direct call (`_Dispatch.outputs`)."""
    leaves: list[Any] = []
    if dispatch.leaf:  # fn returned one array (the common trivial case)
        how, index, obj = dispatch.outputs[0]
        if how in (_R_PARTS, _R_FIRST):
            parts = (split_parts if obj == "split" else replicated_parts)[index]
            return parts[0] if how == _R_FIRST or len(parts) == 1 else PerReplica(parts)
    for how, index, obj in dispatch.outputs:
        if how in (_R_PARTS, _R_FIRST):
            parts = (split_parts if obj == "split" else replicated_parts)[index]
            leaves.append(parts[0] if how == _R_FIRST or len(parts) == 1 else PerReplica(parts))
        else:
            leaves.append(_plain_leaf(how, index, obj, variables, flat))
    return _nest.unflatten(program.out_spec, leaves)


def _deferred_result(
    program: _Program,
    dispatch: _Dispatch,
    split: Sequence[Any],
    replicated: Sequence[Any],
    mesh: _Mesh,
    variables: list[Variable],
    flat: Sequence[Any],
) -> Any:
    """`_direct_result` with each per-replica result a `deferred` ``PerReplica`` of its
    global array (`_Result`): not split per replica unless read."""
    scalars = _scalars(program)
    blocks = program.blocks
    if blocks is None:  # each split output's per-replica block, as an input leaf's aval
        blocks = program.blocks = [
            None if i in scalars else _block_aval(g, mesh) for i, g in enumerate(split)
        ]
    leaves: list[Any] = []
    for how, index, obj in dispatch.outputs:
        is_split = obj == "split"
        if how == _R_PARTS:
            array = (split if is_split else replicated)[index]
            if is_split and not array.ndim:
                # Rank 0 per replica, each device's part its replica's value already
                # (`_rank0_outputs`): handed out now (the array itself is no true
                # replicated value, so it never leaves here).
                leaves.append(PerReplica(mesh.parts(array)))
            elif is_split:
                source = _Result(array, mesh, index in scalars, True, blocks[index])
                leaves.append(deferred(PerReplica, source))
            else:
                leaves.append(deferred(PerReplica, _Result(array, mesh, False, False)))
        elif how == _R_FIRST:
            array = (split if is_split else replicated)[index]
            part = _shards(array, mesh)[0]
            scalar = is_split and array.ndim and index in scalars  # a [1] block
            leaves.append(_scalar_copy(part) if scalar else part)
        else:
            leaves.append(_plain_leaf(how, index, obj, variables, flat))
    if dispatch.leaf:
        return leaves[0]
    return _nest.unflatten(program.out_spec, leaves)


def _unread_variables(
    closed: Any, offset: int, n_variables: int, written: tuple[int, ...]
) -> tuple[Any, list[int]] | None:
    """``closed`` (a program's jaxpr) without the inputs of the variables it neither
    reads nor writes, and the inputs it keeps; None when it reads them all.

    Every variable the strategy tracks is an input of its programs (fn may read any of
    them); one fn does not read costs a lookup and an input per step, for every
    variable of a model that an evaluation step, say, leaves alone. Only variables'
    inputs go: the others, and the written variables' (donated), stay in place."""
    jaxpr = closed.jaxpr
    keep = [
        not offset <= i < offset + n_variables or i in written for i in range(len(jaxpr.invars))
    ]
    if all(keep) or _dce_jaxpr is None:
        return None
    try:
        pruned, used = _dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=keep)
    except TypeError:  # (a private function: another JAX's signature) every input stays
        return None
    if all(used):
        return None
    return ClosedJaxpr(pruned, closed.consts), [i for i, u in enumerate(used) if u]


def _as_parts(mesh: _Mesh, scalar: bool) -> Callable[[Any], Any]:
    """A split output's per-replica blocks (rank 0 for ``scalar``) as an array JAX takes
    to be replicated (``out_specs=P()``, unchecked) while each device holds its own
    replica's block. That global array is no true replicated value: only its parts
    (`_Mesh.parts`) are handed out, or it is passed in again as a shared input, which
    holds each replica's own value the same way (`_Mesh.replicate`)."""
    return jax.shard_map(
        (lambda block: jnp.reshape(block, ())) if scalar else (lambda block: block),
        mesh=mesh.mesh,
        in_specs=pspec(mesh.axis),
        out_specs=pspec(),
        check_vma=False,
    )


def _rank0_outputs(run: Callable[..., Any], program: _Program, mesh: _Mesh) -> Callable[..., Any]:
    """``run`` (a program's flat function) with its rank-0 per-replica results rank 0 on
    each device (`_as_parts`). Each device's part then is that replica's rank-0 array
    as it is, where the ``[1]`` block would need a reshape dispatched per device after
    the step (XLA:CPU ran the MLP step of ``benchmarks/bench_jax.py`` ~3% longer with
    its loss read so). One process only (across processes: `_worker_outputs`)."""
    scalars = _scalars(program)
    if not scalars or mesh.spans_processes:
        return run
    to_rank0 = _as_parts(mesh, True)

    def with_rank0(*args: Any) -> list[Any]:
        flat = list(run(*args))
        for i in scalars:  # the split outputs come first
            flat[i] = to_rank0(flat[i])
        return flat

    return with_rank0


def _worker_outputs(jitted: Callable[..., Any], program: _Program, mesh: _Mesh) -> Any:
    """``program.jitted`` across processes, where each worker has one replica: every
    split output as its replica's block on each device (`_as_parts`), so a worker's
    part of it is the output's one buffer, no reshape dispatched for rank-0 results,
    and a part passed in again as a shared input (parameters returned and passed back)
    takes the output array itself (`_Plan.parted`), not one built per step."""
    if len(mesh.devices) != 1 or not mesh.spans_processes:
        return jitted
    scalars = set(_scalars(program))
    whole, rank0 = _as_parts(mesh, False), _as_parts(mesh, True)

    def per_worker(*args: Any) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
        split, replicated, updated, checks = jitted(*args)
        split = [(rank0 if i in scalars else whole)(g) for i, g in enumerate(split)]
        return split, replicated, updated, checks

    return jax.jit(per_worker)


def _block_aval(array: Any, mesh: _Mesh) -> Any:
    """``_aval`` of each replica's block of ``array``, split over ``mesh``'s replicas
    (every process's: the array is global); None for a rank-0 array."""
    shape, dtype = _aval(array)
    if not shape or shape[0] % mesh.replicas:
        return None
    return ((shape[0] // mesh.replicas, *shape[1:]), dtype)


def _copy(x: Any) -> Any:
    """A copy of ``x`` with its sharding (a new buffer, safe to donate)."""
    return jnp.array(x, copy=True)


def _shards(global_array: Any, mesh: _Mesh) -> list[Any]:
    if mesh.single_device:
        # The one replica's value, as it would come back in: replicated as is (the
        # program's own input sharding), else its buffer on the device.
        sharding = global_array.sharding
        if sharding is mesh.single[0] or sharding == mesh.replicated:
            return [global_array]
        return [global_array.addressable_data(0)]
    return mesh.parts(global_array)


def _scalar_copy(part: Any) -> Any:
    """A replica's rank-0 value from its ``[1]`` block of a program output; concrete even
    when first read inside another function's trace."""
    with jax.ensure_compile_time_eval():
        return _to_scalar(part)[0]


class _Result:
    """A direct call's per-replica result, kept whole (a `deferred` ``PerReplica``'s
    source): split into each replica's array only when something reads its
    components, and passed back into a later call as the global array it is."""

    __slots__ = ("array", "block", "mesh", "scalar", "split")

    def __init__(
        self, array: Any, mesh: _Mesh, scalar: bool, split: bool, block: Any = None
    ) -> None:
        self.array = array
        self.mesh = mesh
        self.scalar = scalar  # each replica's value is rank 0 (the array is [n])
        self.split = split  # split over the replicas (else replicated on each)
        # A replica's block as `_aval` gives it, when split and not rank 0 (None: found
        # from ``array`` when asked).
        self.block = block

    def components(self) -> list[Any]:
        parts = _shards(self.array, self.mesh)
        return [_scalar_copy(p) for p in parts] if self.scalar else parts

    def input_for(self, mesh: _Mesh, aval: Any) -> Any:
        """The program input this result is for a per-replica leaf of block ``aval`` on
        ``mesh`` (itself, when split the same way), else None."""
        if not self.split or self.scalar or mesh is not self.mesh or not aval[0]:
            return None
        block = self.block
        if block is None:
            block = self.block = _block_aval(self.array, mesh)
        return self.array if block == aval else None

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as its components (a mesh is this process's).
        return (_Components, (tuple(self.components()),))

    def __repr__(self) -> str:
        return f"_Result({describe(self.array)}, {len(self.mesh.devices)} replicas)"


class _Stored:
    """A variable's new copies, kept whole (`polydist.backend.tracing.defer_storage`):
    the program's output array, which the next call takes as it is; replica ``r``'s
    copy is split out (rank 0 for a rank-0 variable) when something reads it."""

    __slots__ = ("array", "aval", "copies", "expected", "mesh", "parts", "read", "scalar")

    def __init__(self, array: Any, mesh: _Mesh, scalar: bool, aval: Any = None) -> None:
        self.array = array
        self.mesh = mesh
        self.scalar = scalar
        self.parts: list[Any] | None = None
        n = len(mesh.devices)
        self.aval = self.aval_of(array, mesh, scalar) if aval is None else aval
        self.expected = [0] * n
        self.copies: list[Any] = [None] * n
        self.read = False

    @staticmethod
    def aval_of(array: Any, mesh: _Mesh, scalar: bool) -> Any:
        """A copy's ``(shape, (dtype, weak_type))``, the copies being ``array``'s blocks."""
        shape, dtype = _aval(array)
        block = (shape[0] // mesh.replicas, *shape[1:])  # the array spans every process
        return ((), dtype) if scalar else (block, dtype)

    def component(self, index: int) -> Any:
        self.read = True
        parts = self.parts
        if parts is None:
            parts = self.parts = _shards(self.array, self.mesh)
        value = _scalar_copy(parts[index]) if self.scalar else parts[index]
        self.copies[index] = value
        # Its references now, counted as `InputCache.lookup` counts them later: then the
        # component holds it where ``value`` does now; any more is someone else's.
        self.expected[index] = _functional._refcounts([value])[0]
        return value

    def __repr__(self) -> str:
        return f"_Stored({describe(self.array)}, {len(self.mesh.devices)} replicas)"


class _Components:
    """A `deferred` value's components, made already (an unpickled `_Result`)."""

    __slots__ = ("parts",)

    def __init__(self, parts: tuple[Any, ...]) -> None:
        self.parts = parts

    def components(self) -> tuple[Any, ...]:
        return self.parts


def _slices(global_array: Any, n: int, scalar: bool) -> list[Any]:
    if scalar:
        return [global_array[r] for r in range(n)]
    block = global_array.shape[0] // n
    return [global_array[r * block : (r + 1) * block] for r in range(n)]
