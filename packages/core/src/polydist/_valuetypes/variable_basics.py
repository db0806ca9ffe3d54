"""What every variable is made of: the synchronization and aggregation options, the
update contexts (which replica an update writes, traced replicas, colocation), the
checks of a variable's options and the conversions of the arrays it stores.

The variable classes are above: ``polydist.Variable`` in
:mod:`polydist._valuetypes.base_variable`, the distributed ones in
:mod:`polydist._valuetypes.variables`.
"""

from __future__ import annotations

import contextvars
import enum
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from polydist._base import context as _context
from polydist._base.arrays import (
    dtype_name,
    is_floating,
)
from polydist._valuetypes.indexed_slices import IndexedSlices
from polydist.backend._contract import (
    Backend,
    SupportsPlaceVariable,
    SupportsStoreVariable,
    backends_owning,
    features,
)

if TYPE_CHECKING:
    from polydist._base.context import Strategy


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
        return strategy.scope()
    m = _context.current_mode()
    if m.strategy is not strategy:
        _context.wrong_strategy_scope(strategy, m)
    return nullcontext()


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


def _copy(array: Any, xp: Any) -> Any:
    if isinstance(array, np.ndarray | np.generic):
        return np.array(array, copy=True)
    return xp.asarray(array, copy=True)


def _places_copies(backend: Backend) -> bool:
    """Whether ``backend.place`` always makes a new array of a NumPy array
    (`SupportsHostArrayCopies`; see the variables module's docstring)."""
    return features(backend).places_copies_of_host_arrays


def _place_variable(backend: Backend, value: Any, device: str) -> Any:
    """``value`` placed on ``device`` as a variable's own array: the backend's
    `SupportsPlaceVariable` where it has one (a one-off placement), else ``place``."""
    if features(backend).place_variable:
        return cast(SupportsPlaceVariable, backend).place_variable(value, device)
    return backend.place(value, device)


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
