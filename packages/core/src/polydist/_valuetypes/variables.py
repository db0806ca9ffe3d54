"""Variables: ``polydist.Variable`` and the distributed variables strategies create.

``polydist.Variable(...)`` outside any strategy scope is a plain, single-copy
variable on the host. Inside ``strategy.scope()`` (or ``strategy.run``) the
strategy creates it through ``StrategyExtended._create_variable``:
``MirroredStrategy`` makes a ``MirroredVariable`` (synchronization ``AUTO`` or
``ON_WRITE``) or a ``SyncOnReadVariable`` (``ON_READ``) with one component per
replica device; ``OneDeviceStrategy`` makes a plain variable on its device
(as TF does). The update and read rules are TF's (``values.py`` and
``values_util.py``); ``docs/concepts/variables.md`` has the tables.

Storage (the functionalization hook)
------------------------------------
Every value a variable holds lives in exactly one place: the ``_array``
attribute of a single-copy ``Variable`` (a plain variable, or one component of
a distributed variable). A distributed variable holds its components, in
replica order, in ``values`` (a tuple that never changes). Core code reads
storage only through ``Variable._read_storage()`` and writes it only through
``Variable._write_storage(new_array)``, and never mutates a stored array in
place: every update stores a new array. On the simulator stored arrays are
made read-only to enforce that.

A backend that traces the replica function (JAX) can therefore functionalize
variables without knowing their classes: before tracing, swap each
component's array for a traced input with :func:`swap_storage`; after
tracing, read the updated (traced) arrays back with :func:`storage_arrays`
and swap the concrete results in. :func:`tracked_variables` lists every live
variable a strategy created, in creation order. Such a backend's replica
context has no Python replica index; while it traces it enters
:func:`traced_replica_scope`, and a distributed variable in replica context
then acts as the component it names (and ``StrategyExtended.update`` hands
its per-component results to the backend before regrouping them).

A backend may also decide what a value write stores, with an optional method
``store_variable(stored, new) -> array`` (``stored``: what the component holds
now, ``None`` when it is created; ``new``: the new value, a fresh array). Core
calls it on creation and in ``_write_storage`` (``assign``, ``assign_add``,
``assign_sub``, the ``scatter_*`` methods, ``checkpoint.restore``) and stores
what it returns; without it, ``new`` is stored. The torch backend uses it to
detach values from autograd and to copy a new value *into* a stored
``torch.nn.Parameter`` in place, so that a torch optimizer holding that
parameter keeps seeing the variable's storage (``polydist_torch.parameters``).
:func:`swap_storage` never calls it: it always swaps the arrays themselves.

Sparse writes (``scatter_*``, ``scatter_nd_*``, ``batch_scatter_update``) are
computed on the host with NumPy (``polydist._base.scatter``: TF's CPU kernels, one
index after the other) and stored like an ``assign``. Where the storage holds
traced values (a compiled run) they raise ``NotImplementedError``.
"""

from __future__ import annotations

import contextvars
import enum
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn, cast

import numpy as np

from polydist._base import scatter as _scatter
from polydist._base.arrays import (
    convert_to_array,
    describe,
    dtype_name,
    is_array,
    is_floating,
    mean_from_sum,
)
from polydist._base.devices import HOST_DEVICE
from polydist._base.reduce_op import ReduceOp
from polydist._strategies import context as _context
from polydist._valuetypes import nest as _nest
from polydist._valuetypes.indexed_slices import IndexedSlices
from polydist._valuetypes.values import (
    DistributedValues,
    Mirrored,
    PerReplica,
    regroup,
    select_replica,
)
from polydist.backend._contract import (
    Backend,
    SupportsStoreVariable,
    backends_owning,
    features,
    get_backend_for_value,
)
from polydist.errors import InvalidArgumentError

if TYPE_CHECKING:
    from polydist._strategies.replica_context import ReplicaContext
    from polydist._strategies.strategy import Strategy, StrategyExtended

__all__ = [
    "DistributedVariable",
    "MirroredVariable",
    "ReplicaDivergenceWarning",
    "SyncOnReadVariable",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "storage_arrays",
    "swap_storage",
    "tracked_variables",
]


class VariableSynchronization(enum.Enum):
    """When a distributed variable's copies are synchronized (TF's values).

    * ``AUTO``: the strategy decides (``ON_WRITE`` for all polydist strategies).
    * ``NONE``: a single copy; not allowed under a distribution strategy.
    * ``ON_WRITE``: copies are updated together on every write (``MirroredVariable``).
    * ``ON_READ``: each replica writes its own copy; reading in cross-replica
      context aggregates them (``SyncOnReadVariable``), e.g. for metrics.
    """

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3


class VariableAggregation(enum.Enum):
    """How updates from several replicas are combined (TF's values).

    * ``NONE``: no aggregation; in replica context each replica writes its own copy.
    * ``SUM``: add the replicas' updates.
    * ``MEAN``: average the replicas' updates (float variables only).
    * ``ONLY_FIRST_REPLICA``: take replica 0's update and apply it everywhere.
    * ``ONLY_FIRST_TOWER``: deprecated alias of ``ONLY_FIRST_REPLICA``.
    """

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3
    ONLY_FIRST_TOWER = 3  # deprecated alias, as in TF's v1 enum


class ReplicaDivergenceWarning(UserWarning):
    """A ``MirroredVariable``'s copies stopped being identical (a polydist diagnostic).

    TF lets a ``MirroredVariable`` with ``aggregation=NONE`` diverge silently
    when replicas update it in replica context; polydist keeps TF's values but
    warns once per variable.
    """


# -- contexts -----------------------------------------------------------------------

# The replica being updated inside StrategyExtended.update / update_non_slot (TF's
# UpdateContext): a distributed variable used there acts as that replica's copy.
_UPDATE_REPLICA: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "polydist_update_replica", default=None
)
# Set by a backend that traces the replica function once for all replicas (jax): its
# replica context has no Python replica index, so while it traces, a distributed variable
# in replica context acts as this component, which the backend has made hold the
# replica's own (traced) copy. See the module docstring and polydist_jax._functional.
_TRACED_REPLICA: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "polydist_traced_replica", default=None
)
# Set by the same backend while it traces: update_components passes the results of the
# per-component calls through it (a traced replica computes copy i's update from its own
# copy; the backend makes such results readable by every replica).
_TRACED_UPDATE_RESULTS: contextvars.ContextVar[Callable[[list[Any]], list[Any]] | None] = (
    contextvars.ContextVar("polydist_traced_update_results", default=None)
)
# The variable given to StrategyExtended.colocate_vars_with.
_COLOCATE_WITH: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "polydist_colocate_with", default=None
)


@contextmanager
def update_context(replica: int) -> Iterator[None]:
    token = _UPDATE_REPLICA.set(replica)
    try:
        yield
    finally:
        _UPDATE_REPLICA.reset(token)


@contextmanager
def traced_replica_scope(
    component: int, update_results: Callable[[list[Any]], list[Any]] | None = None
) -> Iterator[None]:
    """While a backend traces the replica function for all replicas at once (SPMD), a
    distributed variable in replica context acts as its component ``component``, and
    ``StrategyExtended.update`` passes its per-component results through ``update_results``."""
    token = _TRACED_REPLICA.set(component)
    results_token = _TRACED_UPDATE_RESULTS.set(update_results)
    try:
        yield
    finally:
        _TRACED_UPDATE_RESULTS.reset(results_token)
        _TRACED_REPLICA.reset(token)


@contextmanager
def colocate_scope(variable: Any) -> Iterator[None]:
    token = _COLOCATE_WITH.set(variable)
    try:
        yield
    finally:
        _COLOCATE_WITH.reset(token)


def _enter_strategy(strategy: Strategy) -> AbstractContextManager[Any]:
    """TF's ``enter_or_assert_strategy``: enter the variable's strategy if none is
    active, accept it if it is the current one, refuse any other."""
    if not _context.has_strategy():
        return strategy.scope()  # type: ignore[no-any-return]
    m = _context.current_mode()
    if m.strategy is not strategy:
        _context.wrong_strategy_scope(strategy, m)
    return nullcontext()


# -- per-strategy state ----------------------------------------------------------------


class _ExtendedState:
    """What polydist remembers about one strategy's variables."""

    __slots__ = ("dirty", "variables")

    def __init__(self) -> None:
        self.variables: list[weakref.ref[Variable]] = []
        # NONE-aggregated MirroredVariables written in replica context during the
        # current run: checked for divergence when the run ends.
        self.dirty: dict[int, weakref.ref[MirroredVariable]] = {}


# Keyed weakly by the StrategyExtended, so a deep-copied strategy starts empty and
# variables never keep their strategy's bookkeeping alive.
_STATES: weakref.WeakKeyDictionary[Any, _ExtendedState] = weakref.WeakKeyDictionary()


def _state(extended: StrategyExtended) -> _ExtendedState:
    state = _STATES.get(extended)
    if state is None:
        state = _STATES[extended] = _ExtendedState()
    return state


def tracked_variables(extended: StrategyExtended) -> list[Variable]:
    """Every live variable ``extended``'s strategy created, in creation order."""
    state = _STATES.get(extended)
    if state is None:
        return []
    alive = [v for ref in state.variables if (v := ref()) is not None]
    if len(alive) != len(state.variables):
        state.variables = [weakref.ref(v) for v in alive]
    return alive


def storage_arrays(variable: Variable) -> list[Any]:
    """The stored arrays of ``variable``: one per component, in replica order."""
    return [c._read_storage() for c in _components(variable)]


def swap_storage(variable: Variable, arrays: Sequence[Any]) -> list[Any]:
    """Replaces the stored arrays of ``variable`` (one per component) as they are,
    without copying or checking them (NumPy arrays are made read-only); returns the
    arrays it held before."""
    components = _components(variable)
    if len(arrays) != len(components):
        raise ValueError(
            f"swap_storage: {variable.name!r} has {len(components)} component(s), got "
            f"{len(arrays)} array(s)."
        )
    old = [c._read_storage() for c in components]
    for c, a in zip(components, arrays):
        c._replace_storage(a)
    return old


def components(variable: Variable) -> tuple[Variable, ...]:
    """The per-replica components of ``variable`` in replica order (itself, if plain)."""
    return _components(variable)


def current_update_replica() -> int | None:
    """The replica whose copies ``StrategyExtended.update``/``update_non_slot`` is
    updating now (TF's ``UpdateContext``); ``None`` outside such an update."""
    return _UPDATE_REPLICA.get()


def replica_writes(extended: StrategyExtended) -> tuple[int, ...]:
    """The ``id`` of each NONE-aggregated ``MirroredVariable`` of ``extended``'s strategy
    written in replica context during the current run, in the order of their first
    write (checked for divergence when the run ends)."""
    return tuple(_state(extended).dirty)


def note_replica_write(variable: MirroredVariable) -> None:
    """Records that ``variable`` was written in replica context (see `replica_writes`)."""
    _note_replica_write(variable)


def is_variable_creation(merge_fn: Callable[..., Any]) -> bool:
    """Whether ``merge_fn`` is the ``merge_call`` function with which a ``Variable``
    created inside ``strategy.run`` is made (once, in cross-replica context)."""
    return merge_fn is _merge_create


def _components(variable: Variable) -> tuple[Variable, ...]:
    if isinstance(variable, DistributedVariable):
        return variable._values
    return (variable,)


# -- validation and conversion -------------------------------------------------------------


def _validate_options(
    synchronization: Any, aggregation: Any, trainable: Any, name: Any
) -> tuple[VariableSynchronization, VariableAggregation, bool]:
    """TF's ``validate_synchronization_aggregation_trainable``."""
    if aggregation is None:
        aggregation = VariableAggregation.NONE
    elif not isinstance(aggregation, VariableAggregation):
        try:
            if isinstance(aggregation, bool):
                raise ValueError
            aggregation = VariableAggregation(aggregation)
        except (ValueError, TypeError):
            raise ValueError(
                f"Invalid variable aggregation mode: {aggregation!r} for variable: {name}. "
                "Expected a polydist.VariableAggregation: NONE, SUM, MEAN or "
                "ONLY_FIRST_REPLICA."
            ) from None
    if synchronization is None:
        synchronization = VariableSynchronization.AUTO
    elif not isinstance(synchronization, VariableSynchronization):
        try:
            if isinstance(synchronization, bool):
                raise ValueError
            synchronization = VariableSynchronization(synchronization)
        except (ValueError, TypeError):
            raise ValueError(
                f"Invalid variable synchronization mode: {synchronization!r} for variable: "
                f"{name}. Expected a polydist.VariableSynchronization: AUTO, NONE, ON_WRITE "
                "or ON_READ."
            ) from None
    if trainable is None:
        trainable = synchronization is not VariableSynchronization.ON_READ
    if name is not None and not isinstance(name, str):
        raise TypeError(f"Variable name must be a str or None, got {type(name).__name__} {name!r}.")
    return synchronization, aggregation, bool(trainable)


def _kind(dtype: Any, xp: Any) -> str:
    """'b', 'i', 'u', 'f', 'c', or '?' for ``dtype`` of any backend."""
    if isinstance(dtype, type) and issubclass(dtype, np.generic):
        dtype = np.dtype(dtype)
    if isinstance(dtype, np.dtype):
        if dtype.kind in "biufc":
            return dtype.kind
        # ml_dtypes' bfloat16 and float8_* (JAX's, and torch's to_numpy) are kind 'V'.
        return "f" if is_floating(np, dtype) else "?"
    for kind, name in (
        ("b", "bool"),
        ("i", "signed integer"),
        ("u", "unsigned integer"),
        ("f", "real floating"),
        ("c", "complex floating"),
    ):
        try:
            if xp.isdtype(dtype, name):
                return kind
        except (TypeError, ValueError):
            return "?"
    return "?"


# src kind -> the variable dtype kinds it may be cast to (no kind is narrowed:
# float never becomes int, as TF's convert_to_tensor refuses it).
_CASTS = {
    "b": "biufc",
    "i": "iufc",
    "u": "iufc",
    "f": "fc",
    "c": "c",
}


def _is_float(dtype: Any, xp: Any) -> bool:
    return _kind(dtype, xp) == "f"


def _resolve_dtype(dtype: Any, xp: Any) -> Any:
    """A dtype argument (string, NumPy dtype or type, or the backend's dtype) as the
    backend's dtype."""
    try:
        if isinstance(dtype, str):
            return getattr(xp, np.dtype(dtype).name)
        if isinstance(dtype, np.dtype) or (
            isinstance(dtype, type) and issubclass(dtype, np.generic)
        ):
            return getattr(xp, np.dtype(dtype).name)
    except (TypeError, AttributeError):
        raise TypeError(
            f"dtype {dtype!r} is not a dtype this backend supports: pass e.g. 'float32', "
            "np.float32, or the backend's own dtype object."
        ) from None
    return dtype


def _read_operand(value: Any) -> Any:
    """Replaces a variable or Mirrored value by its current array (context-aware)."""
    if isinstance(value, Variable):
        return value._operand()
    if isinstance(value, DistributedValues):
        return _read_operand(value._get())
    return value


def _sparse_delta(method: str, sparse_delta: Any) -> IndexedSlices:
    if not isinstance(sparse_delta, IndexedSlices):
        raise TypeError(
            f"{method}: sparse_delta must be a polydist.IndexedSlices (TF's tf.IndexedSlices), "
            f"got {type(sparse_delta).__name__}. Wrap the rows: "
            "polydist.IndexedSlices(values, indices)."
        )
    return sparse_delta


def _refuse_traced(method: str, name: str) -> None:
    if _TRACED_REPLICA.get() is not None:
        raise NotImplementedError(
            f"{method} is not supported inside a compiled strategy.run, where variable {name!r} "
            "holds traced values: polydist computes sparse updates on the host. Call it "
            "outside strategy.run, write a dense value with assign (e.g. "
            "x.at[indices].add(values) on JAX), or run eagerly (JaxBackend(jit=False))."
        )


def _host(backend: Backend, value: Any) -> Any:
    """``value`` (an array of ``backend``, NumPy, or Python numbers) as a host NumPy array."""
    value = _read_operand(value)
    return np.asarray(backend.to_numpy(value) if is_array(value) else convert_to_array(value))


def _copy(array: Any, xp: Any) -> Any:
    if isinstance(array, np.ndarray | np.generic):
        return np.array(array, copy=True)
    return xp.asarray(array, copy=True)


def _stored(backend: Backend, stored: Any, new: Any) -> Any:
    """What a component stores when its value becomes ``new``: a backend with
    `SupportsStoreVariable` decides (see the module docstring), else ``new``."""
    if not features(backend).store_variable:
        return new
    return cast(SupportsStoreVariable, backend).store_variable(stored, new)


def _freeze(array: Any) -> Any:
    # Stored NumPy arrays are read-only: storage is replaced, never mutated in place,
    # and a caller that writes into value()'s result must not change the variable.
    if isinstance(array, np.ndarray) and array.flags.writeable:
        array.flags.writeable = False
    return array


def _initial_array(initial_value: Any, dtype: Any, backend: Backend, name: str | None) -> Any:
    """The variable's first value as a fresh array (a backend array, or NumPy on the host)."""
    if initial_value is None:
        raise ValueError(f"initial_value must be specified (variable: {name}).")
    if callable(initial_value) and not isinstance(initial_value, Variable | DistributedValues):
        initial_value = initial_value()
    value = _read_operand(initial_value)
    xp = backend.array_namespace()
    if not is_array(value) and not isinstance(value, list | tuple) and _nest.is_nested(value):
        # A dict or a framework pytree (an nnx.State, an optax state): no one array.
        count = len(_nest.flatten(value)[0])
        raise TypeError(
            f"Variable {name!r}: initial_value is a {type(value).__name__}, a nest of "
            f"{count} {'leaf' if count == 1 else 'leaves'}, but a variable holds one array. "
            "Make one variable per leaf with your framework's tree map, e.g. "
            "jax.tree.map(polydist.Variable, tree) or "
            "torch.utils._pytree.tree_map(polydist.Variable, tree)."
        )
    source = value if is_array(value) else convert_to_array(value)
    src_kind = _kind(source.dtype, xp)
    if src_kind not in "biufc":
        raise TypeError(
            _foreign_value(f"Variable {name!r}: initial_value", source, backend)
            or f"Variable {name!r}: initial_value has dtype {dtype_name(source.dtype)}, which a "
            "variable cannot hold; use bool, integer, floating or complex values."
        )
    if dtype is None:
        return _copy(source, xp)
    target = _resolve_dtype(dtype, xp)
    dst_kind = _kind(target, xp)
    if dst_kind not in _CASTS[src_kind]:
        raise TypeError(
            f"Variable {name!r}: cannot convert initial_value of dtype "
            f"{dtype_name(source.dtype)} to dtype={dtype_name(target)} without losing "
            "information. Pass an initial value of that kind, or cast it explicitly first."
        )
    return xp.asarray(value if not is_array(value) else source, dtype=target, copy=True)


def _foreign_value(what: str, source: Any, backend: Backend) -> str | None:
    """Why ``backend`` cannot take ``source`` when it is another library's array (a
    ``torch.Tensor`` on the sim), else ``None``."""
    if isinstance(source, np.ndarray | np.generic):
        return None
    cls = type(source)
    type_name = f"{cls.__module__}.{cls.__qualname__}"
    dtype = dtype_name(source.dtype)
    owners = backends_owning(source)
    if owners and backend.name not in owners:
        return (
            f"{what} is a {type_name} (dtype {dtype}), an array of backend {owners[0]!r}, but "
            f"this variable is on backend {backend.name!r}. Use a strategy on that backend "
            f"(e.g. MirroredStrategy(backend={owners[0]!r})), or pass a NumPy array. Outside "
            "any strategy scope a variable takes the backend of its value's type."
        )
    try:
        numeric = np.dtype(dtype).kind in "biufc"
    except TypeError:  # a name NumPy does not define (bfloat16 without ml_dtypes)
        numeric = dtype.startswith(("bfloat", "float"))
    if numeric:
        return (
            f"{what} is a {type_name} (dtype {dtype}), which backend {backend.name!r} does not "
            "take: it takes its own arrays, NumPy arrays and Python numbers. Convert the value "
            "to NumPy first (np.asarray(value)), or install and use the backend that owns "
            f"{type_name}."
        )
    return None


def _common_name(name: str) -> str:
    return name[: -len(":0")] if name.endswith(":0") else name


# -- the single-copy variable ------------------------------------------------------------


class _VariableMeta(type):
    """Routes ``Variable(...)`` to the current strategy's variable creator."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is Variable:
            return _create_variable(*args, **kwargs)
        return super().__call__(*args, **kwargs)


class _VariableMethod:
    """The ``update_fn`` a distributed variable's write hands to ``_update`` (and so to
    ``StrategyExtended.update``): calls ``copy.<name>(value, **kwargs)`` on the copy
    being updated (TF's ``values_util`` lambdas), and says which method it is."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, var: Variable, value: Any, **kwargs: Any) -> Any:
        method: Callable[..., Any] = getattr(var, self.name)
        return method(value, **kwargs)

    def __repr__(self) -> str:
        return f"<update_fn {self.name}>"


# The scatter methods TF's distributed variables implement (through _update); the
# others (batch_scatter_update, scatter_nd_*) exist on single-copy variables only.
_SCATTER_METHODS = (
    "scatter_add",
    "scatter_sub",
    "scatter_mul",
    "scatter_div",
    "scatter_min",
    "scatter_max",
    "scatter_update",
)
# One per method a distributed variable routes through _update (one object each, so
# that ``update_fn is _assign_fn`` identifies an assign).
_UPDATE_FNS = {
    name: _VariableMethod(name)
    for name in ("assign", "assign_add", "assign_sub", *_SCATTER_METHODS)
}
_assign_fn = _UPDATE_FNS["assign"]

# assign_add / assign_sub: the array API function that combines value and delta.
_DELTA_OPS = {"assign_add": "add", "assign_sub": "subtract"}


class Variable(metaclass=_VariableMeta):
    """A mutable array: TF's ``tf.Variable`` for polydist.

    ``polydist.Variable(initial_value, trainable=None, name=None, dtype=None,
    synchronization=VariableSynchronization.AUTO,
    aggregation=VariableAggregation.NONE)``. Outside a strategy scope this is a
    plain variable on the host (an array of the default backend). Inside
    ``strategy.scope()`` or ``strategy.run`` the strategy creates it: a
    ``MirroredVariable`` or ``SyncOnReadVariable`` under ``MirroredStrategy``.

    ``trainable`` defaults to True, except for ``ON_READ`` variables (False).
    ``initial_value`` may be a callable, called once. Python numbers follow
    TF's dtypes (``1.0`` is float32, ``1`` int32). ``==`` and ``!=`` compare
    identity (so variables can be dict keys); the other operators act on the
    current value.
    """

    _distributed_container: Callable[[], Any] | None = None
    _is_distributed_variable = False

    def __init__(
        self,
        initial_value: Any = None,
        trainable: bool | None = None,
        name: str | None = None,
        dtype: Any = None,
        synchronization: VariableSynchronization = VariableSynchronization.AUTO,
        aggregation: VariableAggregation = VariableAggregation.NONE,
    ) -> None:
        sync, agg, trainable = _validate_options(synchronization, aggregation, trainable, name)
        if callable(initial_value) and not isinstance(initial_value, Variable | DistributedValues):
            initial_value = initial_value()
        # No strategy: the backend that owns the value's type (a torch.Tensor makes a
        # torch variable), else $POLYDIST_BACKEND or the sim.
        backend = get_backend_for_value(_read_operand(initial_value))
        array = _initial_array(initial_value, dtype, backend, name)
        self._setup(
            backend.place(array, HOST_DEVICE),
            backend=backend,
            device=HOST_DEVICE,
            name=f"{name or 'Variable'}:0",
            trainable=trainable,
            synchronization=sync,
            aggregation=agg,
            strategy=None,
        )

    def _setup(
        self,
        array: Any,
        *,
        backend: Backend,
        device: str,
        name: str,
        trainable: bool,
        synchronization: VariableSynchronization,
        aggregation: VariableAggregation,
        strategy: Strategy | None,
        replica_index: int | None = None,
    ) -> None:
        self._backend = backend
        self._device = device
        self._name = name
        self._trainable = trainable
        self._synchronization = synchronization
        self._aggregation = aggregation
        self._distribute_strategy = strategy
        self._replica_index = replica_index
        self._array = _freeze(_stored(backend, None, array))

    def __deepcopy__(self, memo: dict[int, Any]) -> Variable:
        # A copy of the value on the same device, bound to the same strategy (the
        # strategy and backend are shared, never copied).
        new = Variable._from_array(
            _copy(self._array, self._backend.array_namespace()),
            backend=self._backend,
            device=self._device,
            name=self._name,
            trainable=self._trainable,
            synchronization=self._synchronization,
            aggregation=self._aggregation,
            strategy=self._distribute_strategy,
            replica_index=self._replica_index,
        )
        memo[id(self)] = new
        return new

    @classmethod
    def _from_array(cls, array: Any, **kwargs: Any) -> Variable:
        """A single-copy variable around ``array`` (already placed), bypassing creators."""
        var = Variable.__new__(Variable)
        var._setup(array, **kwargs)
        return var

    # -- storage (see the module docstring) ------------------------------------------------
    def _read_storage(self) -> Any:
        return self._array

    def _write_storage(self, array: Any) -> None:
        """Stores a new value (through the backend's ``store_variable``, if any)."""
        self._array = _freeze(_stored(self._backend, self._array, array))

    def _replace_storage(self, array: Any) -> None:
        """Puts ``array`` in as the storage, as it is (:func:`swap_storage`)."""
        self._array = _freeze(array)

    def _operand(self) -> Any:
        """The array operators and reads use (context-dependent for distributed variables)."""
        return self._array

    # -- properties ------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The variable's name, e.g. ``'Variable:0'`` (TF's eager names are not uniquified)."""
        return self._name

    @property
    def dtype(self) -> Any:
        """The dtype of the value (the backend's dtype object)."""
        return self._array.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the value, as a tuple of ints."""
        return tuple(int(d) for d in self._array.shape)

    @property
    def device(self) -> str:
        """The device holding this copy (canonical TF device string)."""
        return self._device

    @property
    def trainable(self) -> bool:
        return self._trainable

    @property
    def synchronization(self) -> VariableSynchronization:
        return self._synchronization

    @property
    def aggregation(self) -> VariableAggregation:
        return self._aggregation

    @property
    def distribute_strategy(self) -> Strategy | None:
        """The strategy that created this variable; ``None`` outside any strategy."""
        return self._distribute_strategy

    # -- reads -----------------------------------------------------------------------------
    def value(self) -> Any:
        """The current value (on the simulator a read-only array: do not write into it)."""
        return self._operand()

    def read_value(self) -> Any:
        """A copy of the current value."""
        return _copy(self._operand(), self._backend.array_namespace())

    def numpy(self) -> np.ndarray:
        """The current value as a new (writable) NumPy array."""
        return np.array(self._backend.to_numpy(self._operand()), copy=True)

    # -- writes ----------------------------------------------------------------------------
    def assign(
        self,
        value: Any,
        use_locking: bool = False,
        name: str | None = None,
        read_value: bool = True,
    ) -> Any:
        """Sets the value. Shape must match; the value is converted to the variable's dtype
        (never narrowing its kind: a float cannot be assigned to an int variable).

        Returns the variable (a component returns its new value, as TF's
        ``_UnreadVariable``), or ``None`` with ``read_value=False``.
        """
        return self._write("assign", value, read_value)

    def assign_add(
        self,
        delta: Any,
        use_locking: bool = False,
        name: str | None = None,
        read_value: bool = True,
    ) -> Any:
        """Adds ``delta`` to the value (same shape; converted to the variable's dtype)."""
        return self._write("assign_add", delta, read_value)

    def assign_sub(
        self,
        delta: Any,
        use_locking: bool = False,
        name: str | None = None,
        read_value: bool = True,
    ) -> Any:
        """Subtracts ``delta`` from the value (same shape; converted to the variable's dtype)."""
        return self._write("assign_sub", delta, read_value)

    def _write(self, method: str, value: Any, read_value: bool) -> Any:
        """``assign``, ``assign_add`` or ``assign_sub`` of this single copy (a distributed
        variable overrides it to apply TF's context and aggregation rules)."""
        new = self._coerce(value, method)
        if method in _DELTA_OPS:
            xp = self._backend.array_namespace()
            new = self._place(getattr(xp, _DELTA_OPS[method])(self._array, new))
        self._write_storage(new)
        return self._result(read_value)

    # -- sparse writes (TF's scatter_* methods) ---------------------------------------------
    def scatter_add(
        self, sparse_delta: IndexedSlices, use_locking: bool = False, name: str | None = None
    ) -> Any:
        """Adds ``sparse_delta`` (an ``IndexedSlices``) to the rows it names.

        Row ``sparse_delta.indices[i]`` gets ``sparse_delta.values[i]`` added; a
        repeated index gets each of its values. The values are converted to the
        variable's dtype (never narrowing its kind) and have shape
        ``indices.shape + variable.shape[1:]``, or are a scalar. An index outside
        ``[0, variable.shape[0])`` is an ``InvalidArgumentError``. Returns the
        variable, as ``assign`` does.
        """
        return self._scatter("scatter_add", sparse_delta)

    def scatter_sub(
        self, sparse_delta: IndexedSlices, use_locking: bool = False, name: str | None = None
    ) -> Any:
        """Subtracts ``sparse_delta`` from the rows it names (see ``scatter_add``)."""
        return self._scatter("scatter_sub", sparse_delta)

    def scatter_mul(
        self, sparse_delta: IndexedSlices, use_locking: bool = False, name: str | None = None
    ) -> Any:
        """Multiplies the rows ``sparse_delta`` names by its values (see ``scatter_add``)."""
        return self._scatter("scatter_mul", sparse_delta)

    def scatter_div(
        self, sparse_delta: IndexedSlices, use_locking: bool = False, name: str | None = None
    ) -> Any:
        """Divides the rows ``sparse_delta`` names by its values (see ``scatter_add``;
        integer variables divide as C does, truncating toward zero)."""
        return self._scatter("scatter_div", sparse_delta)

    def scatter_min(
        self, sparse_delta: IndexedSlices, use_locking: bool = False, name: str | None = None
    ) -> Any:
        """Sets the rows ``sparse_delta`` names to the minimum of them and its values."""
        return self._scatter("scatter_min", sparse_delta)

    def scatter_max(
        self, sparse_delta: IndexedSlices, use_locking: bool = False, name: str | None = None
    ) -> Any:
        """Sets the rows ``sparse_delta`` names to the maximum of them and its values."""
        return self._scatter("scatter_max", sparse_delta)

    def scatter_update(
        self, sparse_delta: IndexedSlices, use_locking: bool = False, name: str | None = None
    ) -> Any:
        """Sets the rows ``sparse_delta`` names to its values (a repeated index keeps
        its last value)."""
        return self._scatter("scatter_update", sparse_delta)

    def batch_scatter_update(
        self, sparse_delta: IndexedSlices, use_locking: bool = False, name: str | None = None
    ) -> Any:
        """``scatter_update`` per batch entry (TF's ``batch_scatter_update``).

        With ``sparse_delta.indices`` of shape ``[b_1, ..., b_n, J]``, element
        ``variable[b_1, ..., b_n, indices[b_1, ..., b_n, j]]`` gets
        ``values[b_1, ..., b_n, j]`` (values of shape ``indices.shape +
        variable.shape[n + 1:]``). 1-D indices make it ``scatter_update``.
        """
        return self._scatter("batch_scatter_update", sparse_delta)

    def scatter_nd_add(self, indices: Any, updates: Any, name: str | None = None) -> Any:
        """Adds ``updates`` at ``indices`` (``tf.scatter_nd``'s layout).

        ``indices`` has shape ``[..., K]``: its last dimension indexes the first
        ``K`` dimensions of the variable (elements if ``K`` is its rank, else
        slices), and ``updates`` has shape ``indices.shape[:-1] +
        variable.shape[K:]``. A repeated index gets each of its updates.
        Returns the variable.
        """
        return self._scatter_nd("scatter_nd_add", indices, updates)

    def scatter_nd_sub(self, indices: Any, updates: Any, name: str | None = None) -> Any:
        """Subtracts ``updates`` at ``indices`` (see ``scatter_nd_add``)."""
        return self._scatter_nd("scatter_nd_sub", indices, updates)

    def scatter_nd_update(self, indices: Any, updates: Any, name: str | None = None) -> Any:
        """Sets the elements or slices at ``indices`` to ``updates`` (see
        ``scatter_nd_add``; a repeated index keeps its last update)."""
        return self._scatter_nd("scatter_nd_update", indices, updates)

    def _scatter(self, method: str, sparse_delta: Any) -> Any:
        """A ``scatter_*`` method of this single copy (distributed variables override it)."""
        delta = _sparse_delta(method, sparse_delta)
        return self._sparse_write(method, delta.indices, delta.values)

    def _scatter_nd(self, method: str, indices: Any, updates: Any) -> Any:
        """A ``scatter_nd_*`` method of this single copy (distributed variables override it)."""
        return self._sparse_write(method, indices, updates)

    def _sparse_write(self, method: str, indices: Any, updates: Any) -> Any:
        # Computed on the host with NumPy (polydist._base.scatter), then stored like an assign.
        _refuse_traced(method, self._name)
        backend = self._backend
        base = np.array(backend.to_numpy(self._array), copy=True, order="C")
        op = _scatter.OPS[method]
        _scatter.check_dtype(op, method, base.dtype, self._name)
        index_array = _host(backend, indices)
        update_array = self._host_updates(method, updates, base.dtype)
        if method == "batch_scatter_update":
            index_array = _scatter.batch_to_nd_indices(
                index_array, update_array, tuple(base.shape), method, self._name
            )
        nd = method == "batch_scatter_update" or method.startswith("scatter_nd")
        apply = _scatter.scatter_nd_rows if nd else _scatter.scatter_rows
        new = self._place(apply(base, index_array, update_array, op, method, self._name))
        if dtype_name(new.dtype) != dtype_name(self.dtype):  # bfloat16 via float32 (no ml_dtypes)
            new = backend.array_namespace().astype(new, self.dtype)
        self._write_storage(new)
        return self._result(True)

    def _host_updates(self, method: str, updates: Any, host_dtype: np.dtype[Any]) -> Any:
        """``updates`` as a host array of the variable's dtype (kinds never narrow)."""
        xp = self._backend.array_namespace()
        value = _read_operand(updates)
        source = value if is_array(value) else convert_to_array(value)
        if _kind(self.dtype, xp) not in _CASTS.get(_kind(source.dtype, xp), ""):
            raise TypeError(
                f"Cannot {method} values of dtype {dtype_name(source.dtype)} into variable "
                f"{self._name!r} of dtype {dtype_name(self.dtype)}: that would lose "
                "information. Cast the values first (e.g. with .astype), or create the "
                "variable with a dtype of that kind."
            )
        return _host(self._backend, source).astype(host_dtype, copy=False)

    def _result(self, read_value: bool) -> Any:
        if not read_value:
            return None
        if self._distributed_container is not None:
            # A component returns a snapshot, so that StrategyExtended.update gives a
            # Mirrored of values (TF) rather than the container.
            return self.read_value()
        return self

    def _place(self, array: Any) -> Any:
        placed = self._backend.place(array, self._device)
        if isinstance(placed, np.generic):
            placed = np.asarray(placed)
        return placed

    def _coerce(self, value: Any, op: str) -> Any:
        """``value`` as a new array of this variable's dtype and shape, on its device."""
        xp = self._backend.array_namespace()
        value = _read_operand(value)
        target = self._array.dtype
        python_value = not is_array(value)
        source = convert_to_array(value) if python_value else value
        src_kind, dst_kind = _kind(source.dtype, xp), _kind(target, xp)
        if src_kind == "?":
            foreign = _foreign_value(f"The value to {op}", source, self._backend)
            if foreign is not None:
                raise TypeError(foreign)
        if dst_kind not in _CASTS.get(src_kind, ""):
            raise TypeError(
                f"Cannot {op} a {describe(source)} value to variable {self._name!r} of dtype "
                f"{dtype_name(target)}: that would lose information. Cast the value first "
                f"(e.g. with .astype), or create the variable with a dtype of that kind."
            )
        if tuple(source.shape) != self.shape:
            error = ValueError if op == "assign" else InvalidArgumentError
            raise error(
                f"Cannot {op} a value of shape {tuple(source.shape)} to variable "
                f"{self._name!r} of shape {self.shape}: shapes must be equal (variables do not "
                "broadcast). Reshape the value, e.g. to the variable's shape."
            )
        array = xp.asarray(value if python_value else source, dtype=target, copy=True)
        return self._place(array)

    # -- Python protocols --------------------------------------------------------------------
    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        array = np.asarray(self._backend.to_numpy(self._operand()), dtype=dtype)
        return np.array(array, copy=True) if copy else array

    def __bool__(self) -> bool:
        return bool(self._operand())

    def __float__(self) -> float:
        return float(self._operand())

    def __int__(self) -> int:
        return int(self._operand())

    def __format__(self, spec: str) -> str:
        return format(self.numpy(), spec)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._operand())

    def __getitem__(self, index: Any) -> Any:
        return self._operand()[index]

    def __repr__(self) -> str:
        value = self.numpy()
        text = repr(value.item()) if value.ndim == 0 else repr(value)
        return (
            f"<polydist.Variable {self._name!r} shape={self.shape} "
            f"dtype={dtype_name(self.dtype)}, numpy={text}>"
        )

    # Arithmetic and ordering act on the current value; == and != stay identity.
    def __add__(self, o: Any) -> Any:
        return self._operand() + _read_operand(o)

    def __radd__(self, o: Any) -> Any:
        return _read_operand(o) + self._operand()

    def __sub__(self, o: Any) -> Any:
        return self._operand() - _read_operand(o)

    def __rsub__(self, o: Any) -> Any:
        return _read_operand(o) - self._operand()

    def __mul__(self, o: Any) -> Any:
        return self._operand() * _read_operand(o)

    def __rmul__(self, o: Any) -> Any:
        return _read_operand(o) * self._operand()

    def __truediv__(self, o: Any) -> Any:
        return self._operand() / _read_operand(o)

    def __rtruediv__(self, o: Any) -> Any:
        return _read_operand(o) / self._operand()

    def __floordiv__(self, o: Any) -> Any:
        return self._operand() // _read_operand(o)

    def __rfloordiv__(self, o: Any) -> Any:
        return _read_operand(o) // self._operand()

    def __mod__(self, o: Any) -> Any:
        return self._operand() % _read_operand(o)

    def __rmod__(self, o: Any) -> Any:
        return _read_operand(o) % self._operand()

    def __pow__(self, o: Any) -> Any:
        return self._operand() ** _read_operand(o)

    def __rpow__(self, o: Any) -> Any:
        return _read_operand(o) ** self._operand()

    def __matmul__(self, o: Any) -> Any:
        return self._operand() @ _read_operand(o)

    def __rmatmul__(self, o: Any) -> Any:
        return _read_operand(o) @ self._operand()

    def __and__(self, o: Any) -> Any:
        return self._operand() & _read_operand(o)

    def __rand__(self, o: Any) -> Any:
        return _read_operand(o) & self._operand()

    def __or__(self, o: Any) -> Any:
        return self._operand() | _read_operand(o)

    def __ror__(self, o: Any) -> Any:
        return _read_operand(o) | self._operand()

    def __xor__(self, o: Any) -> Any:
        return self._operand() ^ _read_operand(o)

    def __rxor__(self, o: Any) -> Any:
        return _read_operand(o) ^ self._operand()

    def __lt__(self, o: Any) -> Any:
        return self._operand() < _read_operand(o)

    def __le__(self, o: Any) -> Any:
        return self._operand() <= _read_operand(o)

    def __gt__(self, o: Any) -> Any:
        return self._operand() > _read_operand(o)

    def __ge__(self, o: Any) -> Any:
        return self._operand() >= _read_operand(o)

    def __neg__(self) -> Any:
        return -self._operand()

    def __pos__(self) -> Any:
        return +self._operand()

    def __abs__(self) -> Any:
        return abs(self._operand())

    def __invert__(self) -> Any:
        return ~self._operand()

    __hash__ = object.__hash__


# -- distributed variables ------------------------------------------------------------------

_MEAN_NON_FLOAT_CREATE = (
    "creating distributed tf.Variable with aggregation=MEAN and a non-floating dtype is not "
    "supported, please use a different aggregation or dtype"
)
_MEAN_NON_FLOAT_UPDATE = (
    "Cannot update non-float variables with tf.VariableAggregation.MEAN aggregation in "
    "replica context. Either change the variable dtype to float or update it in "
    "cross-replica context."
)


class DistributedVariable(DistributedValues, Variable):
    """A variable with one component (a single-copy ``Variable``) per replica.

    ``values`` holds the components in replica order. In replica context the
    variable acts as the current replica's component; in cross-replica
    context the subclass decides (``MirroredVariable``: replica 0's copy;
    ``SyncOnReadVariable``: the aggregate).
    """

    _select_whole = True  # passed to replicas whole by strategy.run and merge_call
    _is_distributed_variable = True

    def __init__(
        self,
        strategy: Strategy,
        values: Sequence[Variable],
        aggregation: VariableAggregation,
    ) -> None:
        DistributedValues.__init__(self, values)
        xp = self._primary._backend.array_namespace()
        if aggregation is VariableAggregation.MEAN and not _is_float(self._primary.dtype, xp):
            raise ValueError(
                f"{_MEAN_NON_FLOAT_CREATE} (variable {self._primary.name!r} has dtype "
                f"{dtype_name(self._primary.dtype)}: pass dtype='float32', or use "
                "aggregation=SUM)."
            )
        self._distribute_strategy = strategy
        self._aggregation = aggregation
        self._backend = self._primary._backend
        self._divergence_warned = False
        for v in self._values:
            # A weakref maps a component back to its container without a cycle.
            v._distributed_container = weakref.ref(self)

    # -- which copy ------------------------------------------------------------------------
    def _replica_in_context(self) -> int | None:
        """The replica whose copy this code sees, or ``None`` in cross-replica context."""
        strategy = self._distribute_strategy
        assert strategy is not None
        if not _context.has_strategy():
            return _UPDATE_REPLICA.get()
        m = _context.current_mode()
        if m.strategy is not strategy:
            _context.wrong_strategy_scope(strategy, m)
        if m.replica_context is not None:
            index = m.replica_context._replica_index
            if index is None:
                index = _TRACED_REPLICA.get()
            if index is None:
                raise NotImplementedError(
                    f"{type(self).__name__} {self.name!r} is used in a compiled (SPMD) replica "
                    "context, which this backend does not support for variables yet. Pass the "
                    "variable's value (v.value()) into strategy.run instead."
                )
            return index
        return _UPDATE_REPLICA.get()

    def _get(self) -> Any:
        index = self._replica_in_context()
        if index is None:
            return self._get_cross_replica()
        return self._values[index]

    def _get_on_device_or_primary(self) -> Variable:
        index = self._replica_in_context()
        component: Variable = self._values[0 if index is None else index]
        return component

    @property
    def _primary_variable(self) -> Variable:
        primary: Variable = self._values[0]
        return primary

    def _operand(self) -> Any:
        index = self._replica_in_context()
        if index is None:
            return self._cross_replica_value()
        return self._values[index]._array

    def _cross_replica_value(self) -> Any:
        raise NotImplementedError

    def _get_cross_replica(self) -> Any:
        return self._cross_replica_value()

    # -- properties (the primary's) ------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._primary_variable.name

    @property
    def dtype(self) -> Any:
        return self._primary.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self._primary_variable.shape

    @property
    def device(self) -> str:
        return self._get_on_device_or_primary().device

    @property
    def trainable(self) -> bool:
        return self._primary_variable.trainable

    @property
    def synchronization(self) -> VariableSynchronization:
        return self._primary_variable.synchronization

    @property
    def aggregation(self) -> VariableAggregation:
        return self._aggregation

    def _read_storage(self) -> Any:
        raise TypeError(
            f"{type(self).__name__} has one storage per component: use storage_arrays()."
        )

    def _write_storage(self, array: Any) -> None:
        raise TypeError(f"{type(self).__name__} has one storage per component: use swap_storage().")

    def _replace_storage(self, array: Any) -> None:
        self._write_storage(array)  # refused, as above

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return Variable.__array__(self, dtype, copy)

    def __deepcopy__(self, memo: dict[int, Any]) -> Variable:
        # TF: a deep copy keeps the strategy and devices, so it is only allowed in
        # the variable's own strategy (or with no strategy active).
        strategy = self._distribute_strategy
        assert strategy is not None
        with _enter_strategy(strategy):
            components = [c.__deepcopy__(memo) for c in self._values]
        new = type(self)(strategy, components, self._aggregation)
        _state(strategy.extended).variables.append(weakref.ref(new))
        memo[id(self)] = new
        return new

    def __repr__(self) -> str:
        return DistributedValues.__repr__(self)

    __iter__ = Variable.__iter__
    __hash__ = object.__hash__

    # -- updates (TF's DistributedVariable._update) ---------------------------------------------
    def _write(self, method: str, value: Any, read_value: bool) -> Any:
        # assign / assign_add / assign_sub (Variable's public methods land here).
        return self._update(_UPDATE_FNS[method], value, read_value=read_value)

    def _scatter(self, method: str, sparse_delta: Any) -> Any:
        delta = _sparse_delta(method, sparse_delta)
        if method not in _UPDATE_FNS:  # batch_scatter_update
            self._sparse_not_implemented(method)
        _refuse_traced(method, self.name)  # before any merge_call
        return self._update(_UPDATE_FNS[method], delta)

    def _scatter_nd(self, method: str, indices: Any, updates: Any) -> Any:
        self._sparse_not_implemented(method)

    def _sparse_not_implemented(self, method: str) -> NoReturn:
        # TF's distributed variables inherit these from tf.Variable, which raises.
        raise NotImplementedError(
            f"{type(self).__name__} {self.name!r} does not support `{method}` (TF's distributed "
            "variables do not implement it). Update each copy instead, in cross-replica "
            "context: strategy.extended.update(v, lambda copy, *args: "
            f"copy.{method}(*args), args=(...)); or use the scatter_* methods, which take "
            "an IndexedSlices."
        )

    def _update(self, update_fn: Callable[..., Any], value: Any, **kwargs: Any) -> Any:
        strategy = self._distribute_strategy
        assert strategy is not None
        with _enter_strategy(strategy):
            update_replica = _UPDATE_REPLICA.get()
            ctx = _context.get_replica_context()
            if ctx is None:
                if update_replica is not None:
                    return update_fn(self._values[update_replica], value, **kwargs)
                return self._update_cross_replica(update_fn, value, **kwargs)
            return self._update_replica(ctx, update_fn, value, **kwargs)

    def _update_cross_replica(
        self, update_fn: Callable[..., Any], value: Any, **kwargs: Any
    ) -> Any:
        raise NotImplementedError

    def _update_replica(
        self, ctx: ReplicaContext, update_fn: Callable[..., Any], value: Any, **kwargs: Any
    ) -> Any:
        raise NotImplementedError


class MirroredVariable(DistributedVariable, Mirrored):
    """A variable whose copies are kept identical: every write updates all of them.

    In replica context an update with aggregation ``SUM``, ``MEAN`` or
    ``ONLY_FIRST_REPLICA`` is combined across replicas (``merge_call`` +
    ``reduce_to``) and applied to every copy; with ``NONE`` each replica
    updates only its own copy (TF), which makes the copies diverge: polydist
    warns with ``ReplicaDivergenceWarning``. In cross-replica context a write
    updates every copy and a read gives replica 0's copy.
    """

    def _cross_replica_value(self) -> Any:
        return self._values[0]._array

    def _scatter(self, method: str, sparse_delta: Any) -> Any:
        # TF: an aggregated min, max or update of several replicas' rows has no meaning.
        aggregated = self._aggregation not in (
            VariableAggregation.NONE,
            VariableAggregation.ONLY_FIRST_REPLICA,
        )
        if aggregated and method in ("scatter_min", "scatter_max", "scatter_update"):
            raise NotImplementedError(
                f"{method} is only supported for mirrored variable (variable created within "
                "certain `tf.distribute.Strategy` scope) with NONE or `ONLY_FIRST_REPLICA` "
                f"aggregation, got: {self._aggregation} (variable {self.name!r}). Create it "
                "with one of those, or update its copies with strategy.extended.update."
            )
        return super()._scatter(method, sparse_delta)

    def _update_cross_replica(
        self, update_fn: Callable[..., Any], value: Any, **kwargs: Any
    ) -> Any:
        strategy = self._distribute_strategy
        assert strategy is not None
        return strategy.extended.update(self, update_fn, args=(value,), kwargs=kwargs, group=True)

    def _update_replica(
        self, ctx: ReplicaContext, update_fn: Callable[..., Any], value: Any, **kwargs: Any
    ) -> Any:
        if self._aggregation is VariableAggregation.NONE:
            index = self._replica_in_context()
            assert index is not None
            result = update_fn(self._values[index], value, **kwargs)
            _note_replica_write(self)
            return result
        var = self

        def merge_fn(strategy: Strategy, value: Any, **kwargs: Any) -> Any:
            xp = var._backend.array_namespace()
            if (
                var._aggregation is VariableAggregation.MEAN
                and not _is_float(var.dtype, xp)
                and isinstance(value, PerReplica)
            ):
                raise ValueError(_MEAN_NON_FLOAT_UPDATE)
            aggregated = _apply_aggregation(strategy, value, var._aggregation, var)
            return var._update_cross_replica(update_fn, aggregated, **kwargs)

        return ctx.merge_call(merge_fn, args=(value,), kwargs=kwargs)


class SyncOnReadVariable(DistributedVariable):
    """A variable each replica writes on its own; reads in cross-replica context aggregate.

    For metrics: in replica context reads and writes use the replica's copy.
    In cross-replica context a read gives the SUM or MEAN of the copies (or
    replica 0's with ``ONLY_FIRST_REPLICA``); ``assign(x)`` stores ``x / N``
    in each copy for ``SUM`` (so the read gives ``x``) and ``x`` otherwise;
    ``assign_add``/``assign_sub`` raise ``ValueError`` for ``SUM``.
    """

    def _cross_replica_value(self) -> Any:
        agg = self._aggregation
        if agg is VariableAggregation.ONLY_FIRST_REPLICA:
            return self._values[0]._array
        if agg is VariableAggregation.NONE:
            raise ValueError(
                f"SyncOnReadVariable {self.name!r} has aggregation NONE, so it has no single "
                "value in cross-replica context (TF: cannot convert VariableAggregation.NONE to "
                "a ReduceOp). Read it inside strategy.run, look at its copies with "
                "strategy.experimental_local_results(v), or create it with aggregation SUM, "
                "MEAN or ONLY_FIRST_REPLICA."
            )
        strategy = self._distribute_strategy
        assert strategy is not None
        with _enter_strategy(strategy):
            _context.require_cross_replica_or_default_context(strategy)
            return strategy.extended._reduce_to(
                ReduceOp.from_variable_aggregation(agg), self, HOST_DEVICE
            )

    def _update_replica(
        self, ctx: ReplicaContext, update_fn: Callable[..., Any], value: Any, **kwargs: Any
    ) -> Any:
        index = self._replica_in_context()
        assert index is not None
        return update_fn(self._values[index], value, **kwargs)

    def _scatter(self, method: str, sparse_delta: Any) -> Any:
        self._sparse_not_implemented(method)

    def _sparse_not_implemented(self, method: str) -> NoReturn:
        # TF's SyncOnReadVariable refuses every sparse write, in every context.
        raise NotImplementedError(
            f"Variables with `synchronization=ON_READ` doesn't support `{method}` (variable "
            f"{self.name!r}). Write the rows densely with assign / assign_add (inside "
            "strategy.run each replica writes its own copy), or use a MirroredVariable."
        )

    def _update_cross_replica(
        self, update_fn: Callable[..., Any], value: Any, **kwargs: Any
    ) -> Any:
        read_value = kwargs.get("read_value", True)
        agg = self._aggregation
        if update_fn is _assign_fn:
            value = _read_operand(value)
            if agg is VariableAggregation.SUM:
                # Keep the sum across save/restore: each copy holds value / N (TF casts).
                xp = self._backend.array_namespace()
                total = self._values[0]._coerce(value, "assign")
                value = xp.astype(mean_from_sum(xp, total, _global_copies(self)), self.dtype)
        elif agg is VariableAggregation.SUM:
            raise ValueError(
                f"SyncOnReadVariable does not support `{_method_name(update_fn)}` in "
                "cross-replica context when "
                f"aggregation is set to `tf.VariableAggregation.SUM` (variable {self.name!r}). "
                "Update it inside strategy.run (each replica adds to its own copy), or assign "
                "the new total with v.assign(total)."
            )
        for c in self._values:
            update_fn(c, value, read_value=False)
        return self.read_value() if read_value else None


def _method_name(update_fn: Callable[..., Any]) -> str:
    return update_fn.name if isinstance(update_fn, _VariableMethod) else repr(update_fn)


def _apply_aggregation(
    strategy: Strategy, value: Any, aggregation: VariableAggregation, destinations: Any
) -> Any:
    """TF's ``values_util.apply_aggregation``."""
    if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
        first = strategy.experimental_local_results(value)[0]
        return strategy.extended.broadcast_to(first, destinations=destinations)
    reduce_op = ReduceOp.from_variable_aggregation(aggregation)
    return strategy.extended.reduce_to(reduce_op, value, destinations)


def read_for_reduce(value: Any) -> Any:
    """A variable as the values to reduce: its components' arrays (or its own array)."""
    if isinstance(value, DistributedVariable):
        arrays = [c._array for c in value._values]
        return Mirrored(arrays) if isinstance(value, MirroredVariable) else PerReplica(arrays)
    if isinstance(value, Variable):
        return value._array
    return value


def snapshot(value: Any) -> Any:
    """Replaces the variables in a nest by their current (context-aware) arrays."""
    if isinstance(value, Variable):
        return value._operand()
    if not _nest.is_nested(value):
        return value
    return _nest.map_structure(lambda x: x._operand() if isinstance(x, Variable) else x, value)


# -- creation ------------------------------------------------------------------------------


def _create_variable(
    initial_value: Any = None,
    trainable: bool | None = None,
    name: str | None = None,
    dtype: Any = None,
    synchronization: VariableSynchronization = VariableSynchronization.AUTO,
    aggregation: VariableAggregation = VariableAggregation.NONE,
) -> Variable:
    """``polydist.Variable(...)``: a plain variable, or the current strategy's."""
    sync, agg, trainable_ = _validate_options(synchronization, aggregation, trainable, name)
    if not _context.has_strategy():
        plain: Variable = type.__call__(
            Variable,
            initial_value,
            trainable=trainable_,
            name=name,
            dtype=dtype,
            synchronization=sync,
            aggregation=agg,
        )
        return plain
    strategy = _context.get_strategy()
    kwargs = {
        "initial_value": initial_value,
        "trainable": trainable_,
        "name": name,
        "dtype": dtype,
        "synchronization": sync,
        "aggregation": agg,
    }
    ctx = _context.get_replica_context()
    if ctx is None:
        return strategy.extended._create_variable(**kwargs)  # type: ignore[no-any-return]
    # In replica context every replica asks for the variable; it is created once, in
    # cross-replica context, from replica 0's arguments, and all replicas share it
    # (TF's shared_variable_creator).
    return ctx.merge_call(_merge_create, kwargs=kwargs)  # type: ignore[no-any-return]


def _merge_create(strategy: Strategy, **kwargs: Any) -> Variable:
    name = kwargs.get("name")
    if isinstance(name, PerReplica):
        names = name.values
        for r, n in enumerate(names[1:], start=1):
            if n != names[0]:
                raise RuntimeError(
                    f"Tried to create variable {n} with mismatching name on device {r}: replica "
                    f"0 created {names[0]!r}. Every replica must create the same variables, with "
                    "the same names, in the same order."
                )
    first = {k: (v.values[0] if isinstance(v, PerReplica) else v) for k, v in kwargs.items()}
    return strategy.extended._create_variable(**first)  # type: ignore[no-any-return]


def create_variable(
    extended: StrategyExtended,
    *,
    initial_value: Any,
    trainable: bool,
    name: str | None,
    dtype: Any,
    synchronization: VariableSynchronization,
    aggregation: VariableAggregation,
) -> Variable:
    """The default ``StrategyExtended._create_variable``: see the module docstring."""
    strategy = extended._container_strategy()
    backend = extended._backend
    colocate = _COLOCATE_WITH.get()
    if not getattr(extended, "_distributed_variables", True):
        # OneDeviceStrategy: a plain variable on the strategy's device (TF).
        device = colocate.device if colocate is not None else extended._devices[0]
        array = _initial_array(initial_value, dtype, backend, name)
        var = Variable._from_array(
            backend.place(array, device),
            backend=backend,
            device=device,
            name=f"{name or 'Variable'}:0",
            trainable=trainable,
            synchronization=synchronization,
            aggregation=aggregation,
            strategy=strategy,
        )
        _state(extended).variables.append(weakref.ref(var))
        return var
    if synchronization is VariableSynchronization.NONE:
        raise ValueError(
            "`NONE` variable synchronization mode is not supported with tf.distribute strategy. "
            f"Please change the `synchronization` for variable: {name}"
        )
    if synchronization is VariableSynchronization.AUTO:
        synchronization = VariableSynchronization.ON_WRITE
    devices = colocate._devices if isinstance(colocate, DistributedValues) else extended._devices
    if colocate is not None and not isinstance(colocate, DistributedValues):
        devices = (colocate.device,)
    array = _initial_array(initial_value, dtype, backend, name)
    host = backend.to_numpy(array) if len(devices) > 1 else array
    xp = backend.array_namespace()
    base = name or "Variable"
    components: list[Variable] = []
    for i, device in enumerate(devices):
        placed = backend.place(array if i == 0 else _copy(host, xp), device)
        if i and placed.dtype != components[0].dtype:
            # to_numpy may widen dtypes NumPy lacks (torch's bfloat16 -> float32 where
            # ml_dtypes is not installed).
            placed = xp.astype(placed, components[0].dtype)
        components.append(
            Variable._from_array(
                placed,
                backend=backend,
                device=device,
                # TF: the primary is 'v:0', the others 'v/replica_<i>:0'.
                name=f"{base}:0" if i == 0 else f"{base}/replica_{i}:0",
                trainable=trainable,
                synchronization=synchronization,
                aggregation=aggregation,
                strategy=strategy,
                replica_index=i,
            )
        )
    cls = (
        SyncOnReadVariable
        if synchronization is VariableSynchronization.ON_READ
        else MirroredVariable
    )
    var = cls(strategy, components, aggregation)
    _state(extended).variables.append(weakref.ref(var))
    return var


# -- StrategyExtended.update ----------------------------------------------------------------


def update_components(
    extended: StrategyExtended,
    var: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    group: bool,
) -> Any:
    """Calls ``fn(component, *args_i, **kwargs_i)`` for each component of ``var``."""
    backend = extended._backend
    if isinstance(var, DistributedVariable):
        results = []
        for i, component in enumerate(var._values):
            with update_context(i), backend.device_scope(component.device):
                results.append(fn(component, *select_replica(i, args), **select_replica(i, kwargs)))
        traced = _TRACED_UPDATE_RESULTS.get()
        if traced is not None:
            results = traced(results)
        return update_regroup(extended, results, group)
    with update_context(0):
        result = fn(var, *args, **kwargs)
    return result if group else _nest.map_structure(extended._local_results, result)


def update_regroup(extended: StrategyExtended, updates: list[Any], group: bool) -> Any:
    """TF's ``distribute_utils.update_regroup``."""
    regrouped = regroup(updates, Mirrored)
    if group:
        return regrouped
    return _nest.map_structure(extended._local_results, regrouped)


# -- divergence diagnostics ------------------------------------------------------------------


def _note_replica_write(var: MirroredVariable) -> None:
    strategy = var._distribute_strategy
    assert strategy is not None
    _state(strategy.extended).dirty[id(var)] = weakref.ref(var)


def identical(backend: Backend, a: Any, b: Any) -> bool:
    """Bitwise equality of two arrays (shape, dtype and every byte)."""
    na, nb = np.asarray(backend.to_numpy(a)), np.asarray(backend.to_numpy(b))
    return na.shape == nb.shape and na.dtype == nb.dtype and na.tobytes() == nb.tobytes()


def differing_replicas(var: DistributedVariable) -> list[int]:
    """Replicas whose copy is not bitwise identical to replica 0's."""
    first = var._values[0]._array
    return [
        r
        for r, c in enumerate(var._values[1:], start=1)
        if not identical(var._backend, first, c._array)
    ]


def after_run(extended: StrategyExtended) -> None:
    """Called when ``strategy.run`` returns: warns about NONE-aggregated copies that diverged."""
    state = _STATES.get(extended)
    if state is None or not state.dirty:
        return
    dirty, state.dirty = state.dirty, {}
    for ref in dirty.values():
        var = ref()
        if var is None or var._divergence_warned:
            continue
        diverged = differing_replicas(var)
        if diverged:
            var._divergence_warned = True
            shown = ", ".join(str(r) for r in diverged[:8]) + (", ..." if len(diverged) > 8 else "")
            warnings.warn(
                f"MirroredVariable {var.name!r} (aggregation=NONE) now holds different values on "
                f"different replicas: replica(s) {shown} differ from replica 0 after updates in "
                "replica context. TF keeps such copies diverged silently (each replica wrote "
                "its own copy); polydist keeps TF's values and warns once per variable. Give "
                "the variable aggregation=SUM, MEAN or ONLY_FIRST_REPLICA, or update it in "
                "cross-replica context (merge_call + strategy.extended.update).",
                ReplicaDivergenceWarning,
                stacklevel=_user_stacklevel(),
            )


_LIBRARY_MODULES = ("polydist", "greenlet", "contextlib", "optree")


def _user_stacklevel() -> int:
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module.split(".")[0] not in _LIBRARY_MODULES:
            return level
        frame = frame.f_back
        level += 1
    return 1


def _global_copies(var: Any) -> int:
    """N in TF's "each copy holds value / N": every replica in sync, not only this
    process's copies (they differ when each worker is its own process)."""
    strategy = getattr(var, "_distribute_strategy", None)
    if strategy is not None:
        return int(strategy.num_replicas_in_sync)
    return len(var._values)
