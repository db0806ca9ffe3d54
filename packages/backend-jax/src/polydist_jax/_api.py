"""Small helpers for replica functions that run on the jax backend."""

from __future__ import annotations

from typing import Any

import jax
from jax import lax

import polydist as pd
from polydist import Mirrored, Strategy
from polydist_jax._devices import jax_device
from polydist_jax._lazy import AXIS, is_tracer, is_varying
from polydist_jax._spmd import SpmdChannel

__all__ = ["AXIS", "in_compiled_run", "replicate", "varying"]


def in_compiled_run() -> bool:
    """True inside a replica function that the jax backend is tracing for compilation."""
    ctx = pd.get_replica_context()
    return ctx is not None and isinstance(ctx._channel, SpmdChannel)


def varying(tree: Any) -> Any:
    """Marks values built inside a compiled replica function as this replica's own.

    JAX treats a value computed only from constants as one value shared by all
    replicas, so ``jax.grad`` with respect to it sums the gradients of every
    replica. TF gives each replica its own copy and its own gradient. Wrap
    such a value, e.g. ``x = varying(jnp.float32(42.0))``, to get TF's rule.
    Inputs of ``strategy.run`` are already varying. Outside a compiled run
    this returns ``tree`` unchanged.
    """
    if not in_compiled_run():
        return tree

    def mark(x: Any) -> Any:
        if is_tracer(x) and is_varying(x):
            return x
        return lax.pcast(x, AXIS, to="varying")

    return jax.tree.map(mark, tree)


def replicate(strategy: Strategy, tree: Any) -> Any:
    """A copy of every array in ``tree`` on each replica's device, as ``Mirrored`` values.

    Pass initial parameters this way when a training loop feeds ``run``'s
    outputs back into ``run``: the outputs are per-replica arrays, and a
    ``Mirrored`` input has the same compiled signature, so the second step
    does not recompile (a plain array, the same on every replica, would be a
    replicated input: a different signature).
    """
    devices = [jax_device(d) for d in strategy.extended.worker_devices]

    def mirror(x: Any) -> Mirrored:
        return Mirrored([jax.device_put(x, d) for d in devices])

    return jax.tree.map(mirror, tree)
