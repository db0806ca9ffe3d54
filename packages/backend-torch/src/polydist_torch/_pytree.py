"""torch's pytrees as polydist nests.

`register_tree_system` gives core ``torch.utils._pytree``'s registry, so what torch's
own pytree utilities open (dicts, ``OrderedDict`` state dicts, namedtuples, and classes
registered with ``torch.utils._pytree.register_pytree_node``) is a nest in
``strategy.run``, ``all_reduce``, ``reduce`` and checkpoints, keeping its type.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.utils._pytree as torch_pytree

__all__ = ["flatten_one_level", "keys", "register_tree_system", "unflatten"]


def flatten_one_level(x: Any) -> tuple[list[Any], tuple[type, Any]] | None:
    """``(children, (type, context))`` when torch's registry holds ``type(x)`` as a node."""
    node = torch_pytree.SUPPORTED_NODES.get(type(x))
    if node is None:
        return None
    children, context = node.flatten_fn(x)
    return list(children), (type(x), context)


def unflatten(aux: tuple[type, Any], children: Iterable[Any]) -> Any:
    cls, context = aux
    return torch_pytree.SUPPORTED_NODES[cls].unflatten_fn(list(children), context)


def keys(x: Any) -> list[Any]:
    """The keys torch gives ``x``'s children (mapping keys, attribute names, indices)."""
    node = torch_pytree.SUPPORTED_NODES[type(x)]
    with_keys = getattr(node, "flatten_with_keys_fn", None)
    if with_keys is None:  # registered without keys: named by position
        return list(range(len(node.flatten_fn(x)[0])))
    pairs, _ = with_keys(x)
    return [_key(k) for k, _ in pairs]


def _key(entry: Any) -> Any:
    for attribute in ("key", "name", "idx"):  # MappingKey, GetAttrKey, SequenceKey
        if hasattr(entry, attribute):
            return getattr(entry, attribute)
    return str(entry)


def register_tree_system() -> None:
    """Makes torch pytrees (classes registered with ``torch.utils._pytree``) polydist
    nests."""
    from polydist.backend import register_tree_system

    register_tree_system("torch", flatten_one_level, unflatten, keys)
