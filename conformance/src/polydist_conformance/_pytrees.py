"""The optional hook through which a backend supplies its framework's pytrees.

A backend package whose framework has a pytree registry (JAX's ``jax.tree_util``,
torch's ``torch.utils._pytree``) registers it with
``polydist.backend.register_tree_system``, and may let the conformance cases check
it by declaring, under its backend's name, an entry point in the group
``polydist_conformance.pytrees``::

    [project.entry-points."polydist_conformance.pytrees"]
    jax = "polydist_jax._conformance:pytrees"

The entry point is a function returning ``{name: build}``: ``build(leaf)`` makes one
of the framework's pytrees (an ``nnx.State``, an optax state, a registered class)
whose every leaf is a fresh ``leaf()``, in the framework's flattening order. The
cases build them with the backend's arrays and with the sim oracle's NumPy arrays.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any

__all__ = ["ENTRY_POINT_GROUP", "Build", "framework_pytrees"]

ENTRY_POINT_GROUP = "polydist_conformance.pytrees"

#: ``build(leaf)``: a framework pytree whose leaves are ``leaf()`` calls, in order.
Build = Callable[[Callable[[], Any]], Any]


def framework_pytrees(backend_name: str) -> dict[str, Build]:
    """The pytrees the backend named ``backend_name`` supplies (empty without a hook)."""
    found: dict[str, Build] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name != backend_name:
            continue
        samples = ep.load()()
        if not isinstance(samples, dict) or not all(callable(b) for b in samples.values()):
            raise TypeError(
                f"Entry point {ep.value!r} ({ENTRY_POINT_GROUP}) must return a dict of "
                f"name -> build(leaf) callables; got {samples!r}."
            )
        found.update(samples)
    return found
