"""torch pytrees for the conformance suite's nest cases (entry point group
``polydist_conformance.pytrees``): classes registered with ``torch.utils._pytree``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.utils._pytree as torch_pytree

__all__ = ["pytrees"]


class Moments:
    """An optimizer-state-like class registered with keys (its children are named)."""

    def __init__(self, mu: Any, nu: Any, step: int) -> None:
        self.mu, self.nu, self.step = mu, nu, step


class Bag:
    """A class registered without keys (its children are named by position)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items


def _moments(children: Any, step: int) -> Moments:
    mu, nu = children
    return Moments(mu, nu, step)


torch_pytree.register_pytree_node(
    Moments,
    lambda m: ([m.mu, m.nu], m.step),
    _moments,
    flatten_with_keys_fn=lambda m: (
        [(torch_pytree.GetAttrKey("mu"), m.mu), (torch_pytree.GetAttrKey("nu"), m.nu)],
        m.step,
    ),
)
torch_pytree.register_pytree_node(
    Bag, lambda b: (list(b.items), None), lambda children, _: Bag(list(children))
)

Build = Callable[[Callable[[], Any]], Any]


def pytrees() -> dict[str, Build]:
    return {
        "register_pytree_node with keys": lambda leaf: Moments({"w": leaf()}, [leaf()], step=3),
        "register_pytree_node without keys": lambda leaf: Bag([leaf(), {"b": leaf()}]),
    }
