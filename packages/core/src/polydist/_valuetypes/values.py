"""Distributed values: ``PerReplica``, ``Mirrored``, and TF's regrouping rules."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from polydist._valuetypes import nest as _nest

__all__ = [
    "ComponentSource",
    "DistributedValues",
    "Mirrored",
    "PerReplica",
    "ValueContext",
    "check_num_components",
    "per_replica_nests",
    "picked_leaves",
    "regroup",
    "select_replica",
    "select_replicas",
    "value_container",
]


class ComponentSource(Protocol):
    """What a deferred distributed value's components come from (``_deferred``)."""

    def components(self) -> Sequence[Any]:
        """The components, one per local replica, in replica order (called once)."""
        ...


class DistributedValues:
    """Base class for values that have one component per replica.

    ``values`` holds the components in replica order (on this worker). Inside
    ``Strategy.run``, a distributed value passed as an argument is replaced by
    the component of the replica that runs.
    """

    # Distributed variables override this: they are handed to replicas whole.
    _select_whole = False

    # ``_source``: where a deferred value's components come from (`deferred`), else None.
    __slots__ = ("_source", "_values")

    def __init__(self, values: Sequence[Any]) -> None:
        values = tuple(values)
        if not values:
            raise ValueError(f"{type(self).__name__} needs at least one component, got none.")
        self._values: tuple[Any, ...] = values
        self._source: ComponentSource | None = None

    @classmethod
    def _deferred(cls, source: ComponentSource) -> Any:
        """A value whose components ``source.components()`` makes on first read (of
        ``values``, or anything that reads them): a backend's per-replica result that
        may never be read per replica (passed back into the next ``run`` whole)."""
        value = cls.__new__(cls)
        value._source = source
        return value

    def __getattr__(self, name: str) -> Any:
        # Reached only for an attribute not found: an unset slot of a deferred value
        # (its components, made now) or of a subclass that skips ``__init__``.
        if name == "_values":
            source = self._source
            if source is not None:
                values = tuple(source.components())
                if not values:
                    raise ValueError(
                        f"The source of a deferred {type(self).__name__}, {source!r}, made no "
                        "components; it must make one per local replica (a backend bug: "
                        "its components() returned an empty sequence)."
                    )
                self._values = values
                return values
        elif name == "_source":
            return None
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def values(self) -> tuple[Any, ...]:
        """The components, one per local replica, in replica order."""
        return self._values

    @property
    def _primary(self) -> Any:
        return self._values[0]

    @property
    def _devices(self) -> tuple[str, ...]:
        return tuple(str(getattr(v, "device", "")) for v in self._values)

    def _get(self) -> Any:
        """The component of the current replica; cross-replica access is subclass-defined."""
        from polydist._base.context import current_replica_index

        index = current_replica_index()
        if index is None:
            return self._get_cross_replica()
        return self._values[index]

    def _get_cross_replica(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} has no single value in cross-replica context: each replica "
            "holds a different one. Use strategy.reduce(), strategy.gather() or "
            "strategy.experimental_local_results() to combine or inspect them."
        )

    def __iter__(self) -> Iterator[Any]:
        raise TypeError(
            f"{type(self).__name__} is not iterable; use "
            "strategy.experimental_local_results(value) to get its components."
        )

    def __repr__(self) -> str:
        body = "\n".join(f"  {i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{\n{body}\n}}"


class PerReplica(DistributedValues):
    """Holds a (possibly different) value for each replica."""

    __slots__ = ()


class Mirrored(DistributedValues):
    """Holds values known to be identical on every replica.

    In cross-replica context it reads as the first replica's copy, so it can
    be used like an array (``np.asarray(mirrored)``).
    """

    __slots__ = ()

    def _get_cross_replica(self) -> Any:
        return self._primary

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return np.asarray(self._get(), dtype=dtype)


class ValueContext:
    """What ``experimental_distribute_values_from_function``'s ``value_fn`` receives."""

    __slots__ = ("_num_replicas_in_sync", "_replica_id_in_sync_group")

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1) -> None:
        self._replica_id_in_sync_group = replica_id_in_sync_group
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        return self._replica_id_in_sync_group

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"ValueContext(replica_id_in_sync_group={self._replica_id_in_sync_group}, "
            f"num_replicas_in_sync={self._num_replicas_in_sync})"
        )


def value_container(value: Any) -> Any:
    """Maps a component of a distributed variable back to its container (else itself)."""
    container = getattr(value, "_distributed_container", None)
    if callable(container):
        result = container()
        if result is not None:
            return result
    return value


def check_num_components(value: DistributedValues, num_replicas: int, what: str) -> None:
    """Raises unless ``value`` has one component per replica (``what`` names the call)."""
    count = len(value.values)
    if count != num_replicas:
        raise ValueError(
            f"{what} got a {type(value).__name__} with {count} value(s), but the strategy has "
            f"{num_replicas} replica(s) on this worker: a distributed value needs exactly one "
            "component per replica. Build it for this strategy (strategy.run's result, "
            "strategy.experimental_distribute_values_from_function, or a distributed dataset) "
            f"rather than by hand with {count} value(s)."
        )


def select_replica(replica_id: int, structured: Any) -> Any:
    """Replaces each distributed value in ``structured`` by its ``replica_id`` component."""

    def pick(x: Any) -> Any:
        if isinstance(x, DistributedValues) and not x._select_whole:
            return x.values[replica_id]
        return x

    return _nest.map_structure(pick, structured)


def select_replicas(replica_ids: range, structured: Any) -> tuple[Any, ...] | None:
    """`select_replica` of a nest for each of ``replica_ids``, with one flatten for all of
    them; None when ``structured`` is no nest (a leaf). A nest with nothing distributed in
    it is itself for one replica (a step's result read each step: no rebuild), and rebuilt
    per replica for several (each replica its own nest)."""
    if len(replica_ids) == 1 and _nest.has_only_plain_leaves(structured):
        return None if _nest.is_plain_leaf(structured) else (structured,)
    flat, spec = _nest.flatten(structured)
    if spec.is_leaf():
        return None
    picked = picked_leaves(flat)
    if not picked and len(replica_ids) == 1:
        return (structured,)
    return tuple(per_replica_nests(flat, spec, picked, replica_ids))


def picked_leaves(flat: Sequence[Any]) -> list[int]:
    """The positions in a nest's leaves ``flat`` of the distributed values a replica
    takes its own component of (`select_replica`)."""
    return [
        i for i, x in enumerate(flat) if isinstance(x, DistributedValues) and not x._select_whole
    ]


def per_replica_nests(
    flat: Sequence[Any], spec: Any, picked: Sequence[int], replica_ids: Iterable[int]
) -> list[Any]:
    """For each of ``replica_ids``, the nest ``spec`` of leaves ``flat`` with each
    ``picked`` leaf replaced by that replica's component (`select_replica`, from one
    flatten for all replicas)."""
    out = []
    for r in replica_ids:
        leaves = list(flat)
        for i in picked:
            leaves[i] = flat[i].values[r]
        out.append(_nest.unflatten(spec, leaves))
    return out


def regroup(
    values: Sequence[Any],
    wrap_class: Callable[[Sequence[Any]], DistributedValues] = PerReplica,
    always_wrap: bool = False,
) -> Any:
    """Combines per-replica structures into one structure of distributed values.

    TF's ``distribute_utils.regroup``: lists, tuples, namedtuples, dicts and a
    registered framework's pytrees keep their types and are regrouped element-wise;
    a leaf that is the very same object on every replica comes back unwrapped
    (unless ``always_wrap``); components of one distributed variable come back as
    that variable.
    """
    v0 = values[0]
    if len(values) == 1 and not always_wrap and _nest.is_plain_leaf(v0):
        return v0  # one replica's plain leaf: itself, as the general rule below gives
    if isinstance(v0, list | tuple):
        _check_same_structure(values, type(v0), len(v0))
        items = [
            regroup(tuple(v[i] for v in values), wrap_class, always_wrap) for i in range(len(v0))
        ]
        if isinstance(v0, list):
            return items
        if hasattr(v0, "_fields"):  # namedtuple
            return type(v0)(*items)
        return tuple(items)
    node = _nest.framework_node(v0)
    if node is not None:  # a framework's pytree (a JAX nnx.State, a torch-registered class)
        children, aux, rebuild = node
        columns: list[list[Any]] = [children]
        for r, v in enumerate(values[1:], start=1):
            other = _nest.framework_node(v) if type(v) is type(v0) else None
            if other is None or other[1] != aux or len(other[0]) != len(children):
                raise ValueError(_structure_message(values, r))
            columns.append(other[0])
        return rebuild(
            [
                regroup(tuple(col[i] for col in columns), wrap_class, always_wrap)
                for i in range(len(children))
            ]
        )

    if isinstance(v0, Mapping):
        keys = set(v0.keys())
        for r, v in enumerate(values[1:], start=1):
            if not isinstance(v, Mapping) or set(v.keys()) != keys:
                raise ValueError(_structure_message(values, r))
        regrouped = {k: regroup(tuple(v[k] for v in values), wrap_class, always_wrap) for k in v0}
        return _rebuild_mapping(v0, regrouped)
    same_id = all(v is v0 for v in values[1:])
    if same_id and getattr(v0, "_is_distributed_variable", False):
        return v0
    if same_id and not always_wrap:
        return v0
    container = value_container(v0)
    if container is not v0 and all(value_container(v) is container for v in values[1:]):
        return container
    return wrap_class(values)


def _rebuild_mapping(template: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    if type(template) is dict:
        return items
    try:
        rebuilt = type(template)()
        for k, v in items.items():
            rebuilt[k] = v  # type: ignore[index]
        return rebuilt
    except TypeError:
        return type(template)(items)  # type: ignore[call-arg]


def _check_same_structure(values: Sequence[Any], kind: type, length: int) -> None:
    for r, v in enumerate(values[1:], start=1):
        if type(v) is not kind or len(v) != length:  # type: ignore[arg-type]
            raise ValueError(_structure_message(values, r))


def _structure_message(values: Sequence[Any], r: int) -> str:
    return (
        f"Replicas returned values of different structures: replica 0 returned "
        f"{_describe(values[0])} but replica {r} returned {_describe(values[r])}. Every replica "
        "must return the same nest structure (the same list/tuple lengths and dict keys)."
    )


def _describe(v: Any) -> str:
    if isinstance(v, Mapping):
        return f"{type(v).__name__} with keys {sorted(map(str, v.keys()))}"
    if isinstance(v, list | tuple):
        return f"{type(v).__name__} of length {len(v)}"
    return str(type(v).__name__)
