"""JAX pytrees for the conformance suite's nest cases (entry point group
``polydist_conformance.pytrees``): a registered dataclass, a registered class, and
flax's ``nnx.State`` and ``FrozenDict`` and an optax state where those are installed."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["pytrees"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    """A dataclass registered with ``jax.tree_util.register_dataclass``."""

    kernel: Any
    bias: Any
    name: str = dataclasses.field(default="dense", metadata={"static": True})


class Pair:
    """A class registered with ``jax.tree_util.register_pytree_node``."""

    def __init__(self, first: Any, rest: list[Any]) -> None:
        self.first, self.rest = first, rest


jax.tree_util.register_pytree_node(
    Pair, lambda p: ((p.first, p.rest), None), lambda _, children: Pair(*children)
)

Build = Callable[[Callable[[], Any]], Any]


def _like(template: Any) -> Build:
    """Builds trees with ``template``'s structure (its leaves replaced, in order)."""
    treedef = jax.tree.structure(template)
    count = len(jax.tree.leaves(template))
    return lambda leaf: jax.tree.unflatten(treedef, [leaf() for _ in range(count)])


def pytrees() -> dict[str, Build]:
    samples: dict[str, Build] = {
        "register_dataclass": lambda leaf: Layer(leaf(), leaf(), "head"),
        "register_pytree_node": lambda leaf: Pair(leaf(), [leaf(), leaf()]),
    }
    try:
        from flax import nnx
        from flax.core import FrozenDict
    except ImportError:
        return samples
    state = nnx.split(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))[1]
    samples["nnx.State"] = _like(state)
    samples["FrozenDict"] = lambda leaf: FrozenDict(  # type: ignore[no-untyped-call]
        {"w": leaf(), "inner": {"b": leaf()}}
    )
    try:
        optax = importlib.import_module("optax")  # untyped: no stubs
    except ImportError:
        return samples
    samples["optax.adam state"] = _like(optax.adam(1e-3).init(state))
    return samples
