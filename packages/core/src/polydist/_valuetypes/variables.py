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
place: every update stores a new array (a backend's ``update_in_place`` hook,
below, may write into one). On the simulator stored arrays are made read-only
to enforce that.

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

A backend whose ``place(value, device)`` always returns a new array for a NumPy
``value`` (never a view of it) says so with a class attribute
``place_copies_host_arrays = True`` (``polydist.backend.SupportsHostArrayCopies``):
a variable made from a NumPy array is then placed from that array directly (the
variable still never shares memory with its initial value), not from a host copy of
it, so making it holds its value once.

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

A backend may apply ``assign_add`` and ``assign_sub`` to the stored array
itself, with an optional method ``update_in_place(stored, op, delta, *,
exclusive) -> bool`` (``polydist.backend.SupportsUpdateInPlace``; ``op``:
``"add"`` or ``"subtract"``; ``delta``: of the variable's dtype, shape and device,
never to be modified; ``exclusive``: no Python reference to ``stored`` exists but
the variable's). It returns True when it has updated ``stored``, bit for bit as
storing ``op(stored, delta)`` would, and False to let core store a new array. TF's
rule for a resource variable's buffer is the backend's: update in place only where
nothing else can observe the old value (``exclusive``, and no view, export or
autograd record of the memory that the backend can see), else copy; an array a user
read before the update keeps its value. (Storage documented to alias, the torch
backend's ``torch.nn.Parameter``, is updated in place regardless, as it already is
by ``store_variable``.) Without the hook, or when it returns False, the update
stores ``op(stored, delta)``, a new array.

Sparse writes (``scatter_*``, ``scatter_nd_*``, ``batch_scatter_update``) are
computed on the host with NumPy (``polydist._base.scatter``: TF's CPU kernels, one
index after the other) and stored like an ``assign``. Where the storage holds
traced values (a compiled run) they raise ``NotImplementedError``.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from polydist._base import context as _context
from polydist._base.arrays import (
    dtype_name,
    is_integral,
    mean_from_sum,
)
from polydist._base.devices import HOST_DEVICE
from polydist._base.reduce_op import ReduceOp
from polydist._valuetypes import nest as _nest
from polydist._valuetypes.values import (
    DistributedValues,
    Mirrored,
    PerReplica,
    regroup,
    select_replica,
)
from polydist.backend._contract import (
    Backend,
    is_symbolic,
)

if TYPE_CHECKING:
    from polydist._base.context import ReplicaContext, Strategy, StrategyExtended
from polydist._valuetypes.base_variable import (
    _UPDATE_FNS,
    _initial_array,
    _merge_create,
    _state,
    _track,
    _VariableMethod,
    existing_state,
)
from polydist._valuetypes.base_variable import StorageSource as StorageSource
from polydist._valuetypes.base_variable import Variable as Variable
from polydist._valuetypes.base_variable import _assign_fn as _assign_fn
from polydist._valuetypes.base_variable import _components as _components
from polydist._valuetypes.base_variable import _read_operand as _read_operand
from polydist._valuetypes.base_variable import defer_storage as defer_storage
from polydist._valuetypes.base_variable import deferred_storage as deferred_storage
from polydist._valuetypes.base_variable import storage_arrays as storage_arrays
from polydist._valuetypes.base_variable import swap_storage as swap_storage
from polydist._valuetypes.base_variable import tracked_variables as tracked_variables
from polydist._valuetypes.base_variable import tracking_state as tracking_state
from polydist._valuetypes.variable_basics import (
    _COLOCATE_WITH,
    _TRACED_REPLICA,
    _TRACED_UPDATE_RESULTS,
    _UPDATE_REPLICA,
    _is_float,
    _place_variable,
    _places_copies,
    _refuse_traced,
    _sparse_delta,
)

# Moved below; imported from here by the rest of polydist, backends and mutants.
from polydist._valuetypes.variable_basics import (
    ReplicaDivergenceWarning as ReplicaDivergenceWarning,
)
from polydist._valuetypes.variable_basics import VariableAggregation as VariableAggregation
from polydist._valuetypes.variable_basics import VariableSynchronization as VariableSynchronization
from polydist._valuetypes.variable_basics import _common_name as _common_name
from polydist._valuetypes.variable_basics import _copy as _copy
from polydist._valuetypes.variable_basics import _enter_strategy as _enter_strategy
from polydist._valuetypes.variable_basics import colocate_scope as colocate_scope
from polydist._valuetypes.variable_basics import traced_replica_scope as traced_replica_scope
from polydist._valuetypes.variable_basics import update_context as update_context

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


# -- contexts -----------------------------------------------------------------------


# -- per-strategy state ----------------------------------------------------------------


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


# -- validation and conversion -------------------------------------------------------------


# -- the single-copy variable ------------------------------------------------------------


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
        _track(strategy.extended, new)
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
        result = strategy.extended.update(self, update_fn, args=(value,), kwargs=kwargs, group=True)
        if isinstance(value, DistributedValues) and not isinstance(value, Mirrored):
            # Each copy took its own replica's component (TF): a trap when they differ.
            _warn_if_assigned_apart(self, value)
        return result

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
    in each copy for a float ``SUM`` (an integer one is split exactly), so the
    read gives ``x``, and ``x`` otherwise;
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
                n = _global_copies(self)
                if _is_integer(xp, self.dtype):
                    self._assign_integer_split(total, n)
                    return self.read_value() if read_value else None
                value = xp.astype(mean_from_sum(xp, total, n), self.dtype)
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

    def _assign_integer_split(self, total: Any, n: int) -> None:
        """Not TF's ``cast(total / N)`` in each copy, which drops the remainder (10 on 3
        copies reads 9): ``total // N`` in each copy but the first, which holds the rest
        (the copies TF writes wherever N divides ``total``), so the read is ``total``."""
        strategy = self._distribute_strategy
        offset = int(getattr(getattr(strategy, "extended", None), "_replica_offset", 0))
        share = self._backend.array_namespace().floor_divide(total, n)
        first = total - share * (n - 1)
        for i, c in enumerate(self._values):
            _assign_fn(c, first if offset + i == 0 else share, read_value=False)


def _is_integer(xp: Any, dtype: Any) -> bool:
    """Integer, not bool (a bool SUM variable keeps TF's cast)."""
    return is_integral(xp, dtype) and dtype_name(dtype) != "bool"


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


def read_copies(value: Any) -> Any:
    """Replaces the variables in a nest by copies of their current arrays (``read_value``).

    What a collective hands back without communicating (one replica, no channel) must
    not be a variable's storage: a later write may update that storage in place (torch
    parameters, optimizers), and TF's result is a value read at the call."""
    if isinstance(value, Variable):
        return value.read_value()
    if not _nest.is_nested(value):
        return value
    return _nest.map_structure(lambda x: x.read_value() if isinstance(x, Variable) else x, value)


def snapshot(value: Any) -> Any:
    """Replaces the variables in a nest by their current (context-aware) arrays."""
    if isinstance(value, Variable):
        return value._operand()
    if not _nest.is_nested(value):
        return value
    return _nest.map_structure(lambda x: x._operand() if isinstance(x, Variable) else x, value)


# -- creation ------------------------------------------------------------------------------


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
            _place_variable(backend, array, device),
            backend=backend,
            device=device,
            name=f"{name or 'Variable'}:0",
            trainable=trainable,
            synchronization=synchronization,
            aggregation=aggregation,
            strategy=strategy,
        )
        _track(extended, var)
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
        if i == 0:
            source = array
        elif isinstance(host, np.ndarray) and _places_copies(backend):
            source = host  # place() copies it
        else:
            source = _copy(host, xp)
        placed = _place_variable(backend, source, device)
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
    _track(extended, var)
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


def _warn_if_assigned_apart(var: MirroredVariable, value: DistributedValues) -> None:
    """Warns once per variable when a cross-replica write of a per-replica ``value`` left
    the copies different (TF writes each replica's component to its copy, silently). Not
    checked while a program is compiled (the copies have no values yet)."""
    if var._divergence_warned or any(is_symbolic(var._backend, c._array) for c in var._values):
        return
    _warn_if_diverged(
        var,
        f"after a write of a {type(value).__name__} in cross-replica context, which gives "
        "each copy its own replica's value. TF does the same silently",
        "Reduce the value first (strategy.reduce(..., axis=None), or read a "
        "SyncOnReadVariable's aggregate with v.read_value()) to give every copy the same "
        "value.",
    )


def after_run(extended: StrategyExtended) -> None:
    """Called when ``strategy.run`` returns: warns about NONE-aggregated copies that diverged."""
    state = existing_state(extended)
    if state is None or not state.dirty:
        return
    dirty, state.dirty = state.dirty, {}
    for ref in dirty.values():
        var = ref()
        if var is None or var._divergence_warned:
            continue
        _warn_if_diverged(
            var,
            "after updates in replica context. TF keeps such copies diverged silently (each "
            "replica wrote its own copy)",
            "Give the variable aggregation=SUM, MEAN or ONLY_FIRST_REPLICA, or update it in "
            "cross-replica context (merge_call + strategy.extended.update).",
            aggregation=" (aggregation=NONE)",
        )


def _warn_if_diverged(var: MirroredVariable, how: str, advice: str, aggregation: str = "") -> None:
    """`ReplicaDivergenceWarning`, once per variable, if ``var``'s copies now differ."""
    diverged = differing_replicas(var)
    if not diverged:
        return
    var._divergence_warned = True
    shown = ", ".join(str(r) for r in diverged[:8]) + (", ..." if len(diverged) > 8 else "")
    warnings.warn(
        f"MirroredVariable {var.name!r}{aggregation} now holds different values on different "
        f"replicas: replica(s) {shown} differ from replica 0 {how}; polydist keeps TF's "
        f"values and warns once per variable. {advice}",
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
