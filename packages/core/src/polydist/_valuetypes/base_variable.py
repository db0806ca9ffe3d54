"""``polydist.Variable``: the single-copy variable every variable is built from.

A plain variable, or one component of a distributed one; ``Variable(...)`` routes to
the current strategy's variable creator (:func:`_create_variable`). Also what polydist
remembers per strategy (its variables, the replica writes of a run) and the access to
a variable's stored arrays. The module docstring of
:mod:`polydist._valuetypes.variables` describes the storage rules.
"""

from __future__ import annotations

import collections
import operator
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from polydist._base import context as _context
from polydist._base import scatter as _scatter
from polydist._base.arrays import (
    convert_to_array,
    describe,
    dtype_name,
    is_array,
)
from polydist._base.devices import HOST_DEVICE
from polydist._valuetypes import nest as _nest
from polydist._valuetypes.indexed_slices import IndexedSlices
from polydist._valuetypes.values import (
    DistributedValues,
    PerReplica,
)
from polydist.backend._contract import (
    Backend,
    SupportsUpdateInPlace,
    features,
    get_backend_for_value,
)
from polydist.errors import InvalidArgumentError

if TYPE_CHECKING:
    from polydist._base.context import Strategy, StrategyExtended
from polydist._valuetypes.variable_basics import (
    _CASTS,
    VariableAggregation,
    VariableSynchronization,
    _copy,
    _foreign_value,
    _freeze,
    _kind,
    _place_variable,
    _places_copies,
    _refuse_traced,
    _resolve_dtype,
    _sparse_delta,
    _stored,
    _validate_options,
)


class _ExtendedState:
    """What polydist remembers about one strategy's variables."""

    __slots__ = ("dirty", "variables", "version")

    def __init__(self) -> None:
        self.variables: list[weakref.ref[Variable]] = []
        self.version = 0  # bumped by each variable tracked (`tracking_state`)
        # NONE-aggregated MirroredVariables written in replica context during the
        # current run: checked for divergence when the run ends.
        # (MirroredVariables: their class is defined above this module.)
        self.dirty: dict[int, weakref.ref[Any]] = {}


# Keyed weakly by the StrategyExtended, so a deep-copied strategy starts empty and
# variables never keep their strategy's bookkeeping alive.
_STATES: weakref.WeakKeyDictionary[Any, _ExtendedState] = weakref.WeakKeyDictionary()


# The last strategy `existing_state` found, and its state: each `strategy.run` asks, and
# a weak-key lookup costs a weak reference per call.
_LAST: tuple[weakref.ref[Any], _ExtendedState] | None = None


def _state(extended: StrategyExtended) -> _ExtendedState:
    state = _STATES.get(extended)
    if state is None:
        state = _STATES[extended] = _ExtendedState()
    return state


def existing_state(extended: StrategyExtended) -> _ExtendedState | None:
    """``extended``'s bookkeeping if it has any yet (nothing is created)."""
    global _LAST
    last = _LAST
    if last is not None and last[0]() is extended:
        return last[1]
    state = _STATES.get(extended)
    if state is not None:
        _LAST = (weakref.ref(extended), state)
    return state


def _track(extended: StrategyExtended, variable: Variable) -> None:
    state = _state(extended)
    state.variables.append(weakref.ref(variable))
    state.version += 1


def tracking_state(extended: StrategyExtended) -> _ExtendedState:
    """``extended``'s bookkeeping, whose ``version`` changes whenever its strategy tracks
    a new variable (a backend's cache of `tracked_variables` checks it; deaths it sees
    itself). The same object for the strategy's lifetime."""
    return _state(extended)


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


class StorageSource(Protocol):
    """Where the stored arrays of a variable's components come from until first read
    (:func:`defer_storage`)."""

    def component(self, index: int) -> Any:
        """Component ``index``'s stored array (asked at most once per component)."""
        ...


def defer_storage(variable: Variable, source: StorageSource) -> None:
    """Makes ``source`` the storage of each of ``variable``'s components: component
    ``r`` stores ``source.component(r)`` the first time its array is read, and keeps it
    until a write replaces it. A compiled backend's new copies, when one program
    output holds them all: none is split out per replica unless read."""
    components = _components(variable)
    if len(components) == 1 and components[0]._replica_index == 0:
        # One replica (a one-device step defers every variable it writes, each step).
        state = components[0].__dict__
        state.pop("_array", None)
        state["_pending"] = source
        return
    indices = [c._replica_index for c in components]
    if indices != list(range(len(components))):
        r = next(r for r, i in enumerate(indices) if i != r)
        raise ValueError(
            f"defer_storage: component {r} of {variable.name!r} has replica index "
            f"{indices[r]}, not {r}: source.component(i) is asked for by that "
            "index, so deferral needs components in replica order. Store such a "
            "variable's copies with swap_storage instead."
        )
    # A compiled step defers every variable it writes, each step: no interpreted
    # call per component.
    states = [c.__dict__ for c in components]
    collections.deque(map(_DROP_ARRAY, states), maxlen=0)
    for state in states:
        state["_pending"] = source


def deferred_storage(variable: Variable, source: StorageSource) -> list[Any] | None:
    """None unless every component's storage still comes from ``source`` (no write since
    :func:`defer_storage`); else each component's array if it was read since, None if
    not (nothing outside the source holds it yet)."""
    # map over the components' dicts: a compiled step asks this of every variable it
    # takes, each step (no interpreted loop per component).
    components = _components(variable)
    if len(components) == 1:
        state = components[0].__dict__
        return [state.get("_array")] if state.get("_pending") is source else None
    states = [c.__dict__ for c in components]
    if not all(map(operator.is_, map(_PENDING, states), repeat(source))):
        return None
    return list(map(_ARRAY, states))


_PENDING = operator.methodcaller("get", "_pending")
_DROP_ARRAY = operator.methodcaller("pop", "_array", None)
_ARRAY = operator.methodcaller("get", "_array")


def _components(variable: Variable) -> tuple[Variable, ...]:
    if isinstance(variable, DistributedValues):  # a DistributedVariable
        return variable._values
    return (variable,)


def _read_operand(value: Any) -> Any:
    """Replaces a variable or Mirrored value by its current array (context-aware)."""
    if isinstance(value, Variable):
        return value._operand()
    if isinstance(value, DistributedValues):
        return _read_operand(value._get())
    return value


def _host(backend: Backend, value: Any) -> Any:
    """``value`` (an array of ``backend``, NumPy, or Python numbers) as a host NumPy array."""
    value = _read_operand(value)
    return np.asarray(backend.to_numpy(value) if is_array(value) else convert_to_array(value))


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
        if isinstance(source, np.ndarray) and _places_copies(backend):
            # The backend's place() makes the variable's own copy: a host copy first
            # would hold the state twice while the variable is made.
            return source
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


class _RefProbe:
    """`Variable._holds_alone`'s count for an array held by its variable only: the same
    attribute read in the same kind of method, so the interpreter's own references
    (the call's argument) count alike."""

    def __init__(self) -> None:
        self._array = object()

    def count(self) -> int:
        return sys.getrefcount(self._array)


_ALONE = _RefProbe().count()


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
        self.__dict__.pop("_pending", None)

    def _replace_storage(self, array: Any) -> None:
        """Puts ``array`` in as the storage, as it is (:func:`swap_storage`)."""
        self._array = _freeze(array)
        self.__dict__.pop("_pending", None)

    def __getattr__(self, name: str) -> Any:
        # Reached only for an attribute not found: the array of a component whose
        # storage a backend deferred (`defer_storage`), made now and kept.
        if name == "_array":
            state = self.__dict__
            source = state.get("_pending")
            if source is not None:
                array = state["_array"] = _freeze(source.component(state["_replica_index"]))
                return array
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

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
        if method not in _DELTA_OPS:
            self._write_storage(self._coerce(value, method))
            return self._result(read_value)
        # A delta is only read (TF: the input to an update is never modified): no copy.
        delta = self._coerce(value, method, copy=False)
        op = _DELTA_OPS[method]
        if not self._update_in_place(op, delta):
            xp = self._backend.array_namespace()
            self._write_storage(self._place(getattr(xp, op)(self._array, delta)))
        return self._result(read_value)

    def _update_in_place(self, op: str, delta: Any) -> bool:
        """Whether the backend's optional ``update_in_place`` hook
        (`SupportsUpdateInPlace`) applied ``op`` to the stored array itself."""
        backend = self._backend
        if not features(backend).update_in_place:
            return False
        assert isinstance(backend, SupportsUpdateInPlace)
        # Counted before the stored array is passed on (an argument is one more reference).
        exclusive = self._holds_alone()
        return bool(backend.update_in_place(self._array, op, delta, exclusive=exclusive))

    def _holds_alone(self) -> bool:
        """Whether no Python reference to the stored array exists but this variable's
        own (no array a user kept from ``value()``, no other variable storing it)."""
        return sys.getrefcount(self._array) <= _ALONE

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
        placed = _place_variable(self._backend, array, self._device)
        if isinstance(placed, np.generic):
            placed = np.asarray(placed)
        return placed

    def _coerce(self, value: Any, op: str, copy: bool = True) -> Any:
        """``value`` as an array of this variable's dtype and shape, on its device: a new
        one, or with ``copy=False`` possibly ``value`` itself (to be read, never stored)."""
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
        array = xp.asarray(
            value if python_value else source, dtype=target, copy=True if copy else None
        )
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
