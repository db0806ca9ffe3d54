"""``PerReplica`` and ``Mirrored`` as JAX pytrees (their components are the children),
and JAX's pytrees as polydist nests.

So ``jax.tree.map``, ``jax.block_until_ready`` and ``jax.jit`` arguments and
results see through distributed values, as ``tf.nest`` does with
``expand_composites=True``. polydist's own nest helpers still treat them as leaves.
The other way round, `register_tree_system` gives core JAX's registry, so an
``nnx.State`` or an optax state is a nest in ``strategy.run``, ``all_reduce``,
``reduce`` and checkpoints, as a dict is.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax

from polydist import DistributedValues, Mirrored, PerReplica

__all__ = ["register", "register_tree_system"]


def _flatten(value: DistributedValues) -> tuple[tuple[Any, ...], None]:
    return value.values, None


def register() -> None:
    for cls in (PerReplica, Mirrored):

        def unflatten(_: None, children: Iterable[Any], cls: type = cls) -> Any:
            return cls(tuple(children))

        try:
            jax.tree_util.register_pytree_node(cls, _flatten, unflatten)
        except ValueError:  # already registered (e.g. the module was reloaded)
            pass


# -- JAX's pytree registry as polydist nests ------------------------------------------------

#: One level of a node's PyTreeDef, per (type, node data, child count): building it
#: costs a full one-level flatten, so it is made once per structure.
_treedefs: dict[tuple[type, Any, int], Any] = {}
_TREEDEFS_MAX = 4096


def _one_level_treedef(x: Any) -> Any:
    return jax.tree_util.tree_structure(x, is_leaf=lambda y: y is not x)


def flatten_one_level(x: Any) -> tuple[list[Any], Any] | None:
    """``(children, treedef)`` when JAX's registry holds ``type(x)`` as a node, else
    ``None``; ``treedef`` is ``x``'s one-level ``PyTreeDef`` (equal for equal
    structures, hashable)."""
    try:
        children, aux = jax.tree_util.flatten_one_level(x)
    except ValueError:  # a leaf for JAX
        return None
    children = list(children)
    try:
        key = (type(x), aux, len(children))
        treedef = _treedefs.get(key)
    except (TypeError, ValueError):  # node data that cannot key a dict (arrays): no cache
        return children, _one_level_treedef(x)
    if treedef is None:
        if len(_treedefs) >= _TREEDEFS_MAX:
            _treedefs.clear()
        treedef = _treedefs[key] = _one_level_treedef(x)
    return children, treedef


def unflatten(treedef: Any, children: Iterable[Any]) -> Any:
    return treedef.unflatten(children)


def keys(x: Any) -> list[Any]:
    """The keys JAX gives ``x``'s children (dict keys, attribute names, indices)."""
    pairs, _ = jax.tree_util.flatten_one_level_with_keys(x)
    return [_key(k) for k, _ in pairs]


def _key(entry: Any) -> Any:
    for attribute in ("key", "name", "idx"):  # DictKey/FlattenedIndexKey, GetAttrKey, SequenceKey
        if hasattr(entry, attribute):
            return getattr(entry, attribute)
    return str(entry)


def register_tree_system() -> None:
    """Makes JAX pytrees (``nnx.State``, ``FrozenDict``, optax states, registered
    dataclasses) polydist nests."""
    from polydist.backend import register_tree_system

    register_tree_system("jax", flatten_one_level, unflatten, keys)
