"""Distributed input on the jax backend: each step's batch as one sharded ``jax.Array``.

Core's input pipeline (``polydist.experimental_distribute_dataset``) hands the backend all the
replicas' components of one leaf of a step at once, through the backend's
optional ``place_per_replica(values, devices)``. When the components have one
shape and dtype (rank >= 1) and go to distinct devices, they become **one**
``jax.Array`` sharded ``NamedSharding(mesh, P("replica"))`` over the mesh
that the compiled ``strategy.run`` uses (axis 0 is the replicas' components,
one after the other), made by one batched host-to-device transfer. The
``PerReplica`` users see holds per-device arrays over its buffers, committed
to their devices as ``place`` would give them; :func:`joined` maps such
components back to the global array, which the compiled run passes to the
program as it is (no copy, no resharding).

Components of different shapes (partial or empty final batches), rank-0
values, repeated devices (``experimental_fetch_to_device=False`` places on
the host CPU) and eager backends keep one ``place`` per replica.

JAX dispatches transfers asynchronously, so core's read-ahead
(``InputOptions.experimental_per_replica_buffer_size`` steps, default 1)
already has the next steps' transfers in flight while the current step runs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np

from polydist.backend.values import DistributedValues
from polydist_jax._collectives import on_device
from polydist_jax._lazy import is_tracer

if TYPE_CHECKING:
    from jax.sharding import NamedSharding

    from polydist_jax._spmd import _Mesh

__all__ = ["Aval", "global_array", "joined", "place_per_replica", "register", "run_input"]

#: A per-replica leaf's signature, as ``polydist_jax._spmd`` keys programs: the
#: component's shape, and its dtype with JAX's weak-type flag.
Aval = tuple[tuple[int, ...], tuple[np.dtype[Any], bool]]

# NumPy dtype kinds JAX transfers; others (strings, objects) go to ``place``, which
# raises its own error.
_NUMERIC_KINDS = frozenset("biufc")


class _Joined(NamedTuple):
    refs: tuple[weakref.ref[Any], ...]  # the components, in replica order
    array: jax.Array  # the global array; it holds the buffers, not the components
    split: NamedSharding  # the sharding object it was made with (the mesh's own)
    aval: Aval


# id(component 0) -> its step's global array. An entry lives as long as every one of
# its components: the first to die drops it (weakref callbacks), so nothing here
# keeps a step's batch alive after the PerReplica is gone.
_JOINED: dict[int, _Joined] = {}


def place_per_replica(
    place: Callable[[Any, str], Any],
    mesh_of: Callable[[tuple[str, ...]], _Mesh] | None,
    values: Sequence[Any],
    devices: Sequence[str],
) -> list[Any]:
    """``[place(v, d) for v, d in zip(values, devices)]``, as one global array when it can be.

    ``mesh_of(devices)`` is the replica mesh the compiled run uses for ``devices``;
    None (an eager backend) always places per replica.
    """
    devices = tuple(devices)
    if mesh_of is None or not _joinable(values, devices):
        return [place(v, d) for v, d in zip(values, devices, strict=True)]
    mesh = mesh_of(devices)
    if isinstance(values[0], np.ndarray):
        _, components = _transfer(values, mesh)
    else:
        components = [on_device(v, d) for v, d in zip(values, mesh.devices, strict=True)]
    # The registered global array gets its own per-device objects over the same
    # buffers: it must not keep the components alive (the registry's weak references).
    register(components, mesh.assemble(components), mesh.split)
    return components


def _transfer(values: Sequence[np.ndarray], mesh: _Mesh) -> tuple[jax.Array | None, list[Any]]:
    """NumPy blocks onto ``mesh.devices`` in one batched transfer: the global array it
    made (None across processes) and each replica's block, in replica order."""
    block = values[0].shape[0]
    if mesh.spans_processes:  # this process's blocks only: one transfer each
        return None, list(jax.device_put(list(values), list(mesh.devices)))
    # make_array_from_callback batches the copies (cheaper than device_put of a list).
    shape = (block * len(values), *values[0].shape[1:])

    def block_at(index: tuple[slice, ...] | None) -> Any:
        assert index is not None  # a split array: every shard has an index
        start: int = index[0].start or 0
        return values[start // block]

    array = jax.make_array_from_callback(shape, mesh.split, block_at)
    return array, mesh.parts(array)


def _joinable(values: Sequence[Any], devices: tuple[str, ...]) -> bool:
    n = len(values)
    if n < 2 or len(devices) != n or len(set(devices)) != n:
        return False
    first = values[0]
    if isinstance(first, np.ndarray):
        if first.dtype.kind not in _NUMERIC_KINDS or not all(
            isinstance(v, np.ndarray) for v in values
        ):
            return False
    elif not isinstance(first, jax.Array) or not all(
        isinstance(v, jax.Array) and not is_tracer(v) and len(v.devices()) == 1 for v in values
    ):
        return False
    shape, dtype = first.shape, first.dtype
    if not shape or not shape[0]:
        return False  # rank 0 travels as [1] in a compiled run; empty blocks: nothing to join
    return all(v.shape == shape and v.dtype == dtype for v in values[1:])


def register(components: list[Any], array: jax.Array, split: NamedSharding) -> None:
    key = id(components[0])

    def drop(ref: weakref.ref[Any], table: dict[int, _Joined] = _JOINED) -> None:
        # Only this step's entry (the id may since name a newer component). The
        # callback holds the key, not the entry: no cycle keeps the buffers alive.
        # (The table is bound now: at interpreter exit the module's globals are gone.)
        entry = table.get(key)
        if entry is not None and any(r is ref for r in entry.refs):
            table.pop(key, None)

    first = components[0]
    aval: Aval = (tuple(first.shape), (np.dtype(first.dtype), bool(first.weak_type)))
    refs = tuple(weakref.ref(c, drop) for c in components)
    _JOINED[key] = _Joined(refs, array, split, aval)


def joined(components: Sequence[Any], split: NamedSharding | None) -> tuple[jax.Array, Aval] | None:
    """The global array whose per-device arrays are exactly ``components``, with the
    components' signature; None if there is none, or if ``split`` is given and the
    array is not sharded by that very sharding object (another mesh)."""
    if not components:
        return None
    entry = _JOINED.get(id(components[0]))
    if (
        entry is None
        or (split is not None and entry.split is not split)
        or len(entry.refs) != len(components)
        or any(ref() is not c for ref, c in zip(entry.refs, components, strict=True))
    ):
        return None
    return entry.array, entry.aval


def run_input(column: Sequence[Any], mesh: _Mesh) -> tuple[jax.Array, Aval] | None:
    """A per-replica leaf of a compiled run as one global array split over ``mesh``.

    The array :func:`place_per_replica` made for these very components; else, for
    NumPy components of one shape and dtype (e.g. ``experimental_distribute_values_
    from_function``'s, which stay NumPy as in TF), one batched transfer of them (not
    remembered: NumPy arrays can change in place). None: the caller's general path.
    """
    found = joined(column, mesh.split)
    if found is not None or not isinstance(column[0], np.ndarray):
        return found
    if not _joinable(column, tuple(map(str, mesh.devices))):
        return None
    array, components = _transfer(column, mesh)
    first = components[0]
    aval: Aval = (tuple(first.shape), (np.dtype(first.dtype), bool(first.weak_type)))
    return (mesh.assemble(components) if array is None else array), aval


def global_array(value: DistributedValues) -> jax.Array | None:
    """The global ``jax.Array`` behind a ``PerReplica`` from a distributed dataset, if any."""
    found = joined(value.values, None)
    return None if found is None else found[0]
