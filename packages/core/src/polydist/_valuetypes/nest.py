"""Nest helpers over optree, with TF's conventions, plus frameworks' pytrees.

``None`` is a leaf (as in ``tf.nest``) and distributed values are leaves, so
mapping over a structure never looks inside a ``PerReplica``.

Besides optree's own nodes (lists, tuples, namedtuples, dicts, ``OrderedDict``,
``defaultdict``, ``deque``), a framework's pytree nodes are nests too (a JAX
``nnx.State`` or ``FrozenDict``, an optax state, a class registered with
``jax.tree_util`` or ``torch.utils._pytree``): a backend registers its framework's
registry with :func:`register_tree_system` when it loads. The first time a nest holds
an instance of a type optree does not know, the systems are asked whether that type
is a node; if one says so, the type is registered with optree in polydist's own
namespace (so no other optree user sees it), flattening through that system. The
answer is cached per type, so the hot path stays one dict lookup per node.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optree

__all__ = [
    "NAMESPACE",
    "flatten",
    "flatten_one_level",
    "flatten_with_path",
    "framework_node",
    "is_nested",
    "is_plain_leaf",
    "map_structure",
    "register_tree_system",
    "unflatten",
]

#: The optree namespace that framework node types are registered in.
NAMESPACE = "polydist"
#: The same types, flattening with their children's keys (for paths only: it costs more).
_PATHS_NAMESPACE = "polydist.paths"

#: ``flatten_one_level(x)``: ``None`` when ``x`` is not a node of the framework, else
#: ``(children, aux)``.
FlattenOneLevel = Callable[[Any], "tuple[Sequence[Any], Any] | None"]
#: ``unflatten(aux, children)``: the node ``aux`` came from, with ``children``.
Unflatten = Callable[[Any, Sequence[Any]], Any]
#: ``keys(x)``: one key per child of the node ``x`` (dict keys, field names).
Keys = Callable[[Any], Sequence[Any]]


@dataclass(frozen=True)
class _System:
    name: str
    flatten_one_level: FlattenOneLevel
    unflatten: Unflatten
    keys: Keys | None


_lock = threading.Lock()
_systems: dict[str, _System] = {}
#: Per type: whether core forces it to be a leaf (distributed values). Every type met
#: is cached here once it has been classified (and, if a node, registered).
_forced_leaf: dict[type, bool] = {}
#: Per type, once classified: whether its instances are plain leaves (`is_plain_leaf`).
#: Cleared with ``_forced_leaf``.
_plain_leaf: dict[type, bool] = {}
#: Framework node types registered with optree, and the system that flattens each.
_registered: dict[type, str] = {}

_distributed_type: type | None = None
_variable_type: type | None = None


def register_tree_system(
    name: str,
    flatten_one_level: FlattenOneLevel,
    unflatten: Unflatten,
    keys: Keys | None = None,
) -> None:
    """Makes a framework's pytree nodes polydist nests, as lists and dicts are.

    A backend calls this when it loads, with its framework's pytree registry (the JAX
    backend: ``jax.tree_util``'s; torch: ``torch.utils._pytree``'s). Then a framework
    pytree (an ``nnx.State``, an optax state, a registered dataclass) flows through
    ``strategy.run`` arguments and results, ``all_reduce``, ``reduce``, ``gather``,
    ``experimental_distribute_values_from_function`` and checkpoints keeping its type.

    Args:
        name: names the system; registering a name again replaces it.
        flatten_one_level: ``flatten_one_level(x)`` returns ``None`` when ``x`` is not
            a node of this framework (a leaf, or a type it does not know), else
            ``(children, aux)``: ``x``'s direct children in order, and what else its
            structure holds. Whether a type is a node is asked once per type: it must
            hold for every instance.
        unflatten: ``unflatten(aux, children)`` returns a node of the same type and
            structure holding ``children``.
        keys: ``keys(x)`` returns one key per child of the node ``x`` (a dict key, a
            field name), which name the leaves' paths (checkpoint entries); without
            it children are named by position. Called only where paths are needed.

    Two nodes have the same structure when their types are the same and their
    ``aux`` compare equal (``==``); ``aux`` should be hashable (compiled programs
    are cached by structure). ``None``, distributed values and polydist variables are
    leaves whatever a system says, and optree's own nodes (lists, tuples,
    namedtuples, dicts) never reach a system.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_tree_system: name must be a non-empty str, got {name!r}.")
    for what, fn in (
        ("flatten_one_level", flatten_one_level),
        ("unflatten", unflatten),
        ("keys", keys),
    ):
        if not callable(fn) and not (what == "keys" and fn is None):
            raise TypeError(
                f"register_tree_system({name!r}): {what} must be callable, got {type(fn).__name__}."
            )
    with _lock:
        _systems[name] = _System(name, flatten_one_level, unflatten, keys)
        # Types already classified as leaves may be this system's nodes: ask again.
        _forced_leaf.clear()
        _plain_leaf.clear()


def _unregister_tree_system(name: str) -> None:
    """Removes a system and the node types it registered (for tests)."""
    with _lock:
        _systems.pop(name, None)
        for cls in [c for c, s in _registered.items() if s == name]:
            optree.unregister_pytree_node(cls, namespace=NAMESPACE)
            optree.unregister_pytree_node(cls, namespace=_PATHS_NAMESPACE)
            del _registered[cls]
        _forced_leaf.clear()
        _plain_leaf.clear()


class _Aux:
    """A system's ``aux`` as optree node data: compared with ``==``, hashable even when
    the ``aux`` is not (specs are cache keys of compiled programs)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Aux):
            return NotImplemented
        if self.value is other.value:
            return True
        try:
            return bool(self.value == other.value)
        except Exception:  # e.g. arrays in aux whose == is elementwise
            return False

    def __hash__(self) -> int:
        try:
            return hash(self.value)
        except TypeError:
            return hash(type(self.value))

    def __repr__(self) -> str:
        return repr(self.value)


def _parts(system: _System, x: Any) -> tuple[list[Any], _Aux]:
    parts = system.flatten_one_level(x)
    if parts is None:
        raise TypeError(
            f"The {system.name!r} tree system said {type(x).__qualname__} is a node, but its "
            f"flatten_one_level returned None for {x!r}. A type must be a node for every "
            "instance or for none."
        )
    children, aux = parts
    return list(children), _Aux(aux)


def _keyed_parts(system: _System, x: Any) -> tuple[list[Any], _Aux, tuple[Any, ...] | None]:
    children, aux = _parts(system, x)
    if system.keys is None:
        return children, aux, None
    keys = tuple(system.keys(x))
    if len(keys) != len(children):
        raise ValueError(
            f"The {system.name!r} tree system gave {len(keys)} keys for the "
            f"{len(children)} children of a {type(x).__qualname__}."
        )
    return children, aux, keys


def _register(cls: type, system: _System) -> None:
    # Look the system up at each call: registering its name again replaces it.
    def flatten_func(x: Any) -> tuple[list[Any], _Aux]:
        return _parts(_systems.get(system.name, system), x)

    def flatten_with_keys(x: Any) -> tuple[list[Any], _Aux, tuple[Any, ...] | None]:
        return _keyed_parts(_systems.get(system.name, system), x)

    def unflatten_func(aux: _Aux, children: Any) -> Any:
        return _systems.get(system.name, system).unflatten(aux.value, list(children))

    with _lock:
        if cls in _registered:
            return
        for namespace, flatten in (
            (NAMESPACE, flatten_func),
            (_PATHS_NAMESPACE, flatten_with_keys),
        ):
            try:
                optree.register_pytree_node(
                    cls,
                    flatten,
                    unflatten_func,  # type: ignore[arg-type]
                    namespace=namespace,
                )
            except ValueError:  # registered already (e.g. by optree's user directly)
                pass
        _registered[cls] = system.name


def _classify(x: Any) -> bool:
    global _distributed_type, _variable_type
    if _distributed_type is None:  # _values imports this module, so resolve lazily
        from polydist._valuetypes.values import DistributedValues
        from polydist._valuetypes.variables import Variable

        _distributed_type = DistributedValues
        _variable_type = Variable
    cls = type(x)
    if isinstance(x, _distributed_type):
        _forced_leaf[cls] = True
        return True
    if (
        x is not None
        and _systems
        and cls not in _registered
        and not isinstance(x, _variable_type)  # type: ignore[arg-type]
        and optree.tree_is_leaf(x, none_is_leaf=True, namespace=NAMESPACE)
    ):
        for system in list(_systems.values()):
            if system.flatten_one_level(x) is not None:
                _register(cls, system)
                break
    _forced_leaf[cls] = False
    return False


def _is_leaf(x: Any) -> bool:
    forced = _forced_leaf.get(type(x))
    return _classify(x) if forced is None else forced


def is_plain_leaf(x: Any) -> bool:
    """Whether ``x`` is a leaf that is no distributed value and no ``Mapping`` (which
    regrouping rebuilds even where optree sees a leaf), by what was learned about its
    type before (``False`` also when its type was not classified yet): lets a per-step
    path skip a flatten when its values are plain arrays."""
    cls = type(x)
    plain = _plain_leaf.get(cls)
    if plain is None:
        if _forced_leaf.get(cls) is not False:
            return False  # distributed, or not classified yet
        # optree's answer depends on the type alone (its registry, namedtuple-ness).
        plain = _plain_leaf[cls] = not isinstance(x, Mapping) and optree.tree_is_leaf(
            x, none_is_leaf=True, namespace=NAMESPACE
        )
    return plain


def has_only_plain_leaves(tree: Any) -> bool:
    """Whether every leaf of ``tree`` is a `is_plain_leaf` (so nothing in it is
    distributed): optree's flatten with no callback per node, then a type lookup per
    leaf. False also while a leaf's type was not classified yet (ask `flatten`)."""
    return all(map(is_plain_leaf, optree.tree_leaves(tree, none_is_leaf=True, namespace=NAMESPACE)))


def _leaf_predicate(is_leaf: Callable[[Any], bool] | None) -> Callable[[Any], bool]:
    if is_leaf is None:
        return _is_leaf
    return lambda x: bool(is_leaf(x)) or _is_leaf(x)


def flatten(
    tree: Any, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[Any], optree.PyTreeSpec]:
    """The leaves of ``tree`` and its structure. ``is_leaf`` marks further leaves."""
    return optree.tree_flatten(
        tree, is_leaf=_leaf_predicate(is_leaf), none_is_leaf=True, namespace=NAMESPACE
    )


def flatten_with_path(
    tree: Any, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[tuple[Any, ...]], list[Any], optree.PyTreeSpec]:
    """Like `flatten`, plus each leaf's path: dict keys, sequence indices and the keys a
    framework gives its nodes' children (a dataclass's field names)."""
    return optree.tree_flatten_with_path(
        tree, is_leaf=_leaf_predicate(is_leaf), none_is_leaf=True, namespace=_PATHS_NAMESPACE
    )


def unflatten(spec: optree.PyTreeSpec, leaves: list[Any]) -> Any:
    """The nest of structure ``spec`` (from `flatten`) holding ``leaves``."""
    return optree.tree_unflatten(spec, leaves)


def map_structure(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``tree`` with each leaf ``x`` replaced by ``fn(x, *others)`` (the leaves of ``rest``,
    nests of the same structure, at the same place)."""
    return optree.tree_map(
        fn, tree, *rest, is_leaf=_is_leaf, none_is_leaf=True, namespace=NAMESPACE
    )


def is_nested(x: Any) -> bool:
    """True for lists, tuples, namedtuples, dicts (TF's ``nest.is_nested``) and a
    registered framework's pytree nodes."""
    return not optree.tree_is_leaf(x, is_leaf=_is_leaf, none_is_leaf=True, namespace=NAMESPACE)


def flatten_one_level(x: Any) -> Any:
    """optree's one-level view of ``x`` under these rules (``children``, ``metadata``,
    ``entries``: the children's keys, ``unflatten_func``), or ``None`` for a leaf. For
    walks over nests that need each level (checkpoint object graphs)."""
    if _is_leaf(x) or optree.tree_is_leaf(x, none_is_leaf=True, namespace=_PATHS_NAMESPACE):
        return None
    return optree.tree_flatten_one_level(
        x, is_leaf=_is_leaf, none_is_leaf=True, namespace=_PATHS_NAMESPACE
    )


def framework_node(x: Any) -> tuple[list[Any], Any, Callable[[list[Any]], Any]] | None:
    """``(children, aux, rebuild)`` when ``x`` is a registered framework's node (not one
    of optree's own), else ``None``. Two nodes have the same structure when their
    types and ``aux`` are equal; ``rebuild(children)`` makes a node like ``x``."""
    _is_leaf(x)
    name = _registered.get(type(x))
    if name is None:
        return None
    system = _systems.get(name)
    if system is None:
        return None
    children, aux = _parts(system, x)
    return children, aux, lambda new: system.unflatten(aux.value, list(new))
