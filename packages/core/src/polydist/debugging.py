"""``polydist.debugging``: checks for distributed programs that TF does not have.

:func:`check_replicas_identical` verifies that values which must be the same
on every replica (``Mirrored`` values and ``MirroredVariable`` copies) really
are, bit for bit, and names the ones that are not.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polydist._base.arrays import describe, is_floating
from polydist._strategies import context as _context
from polydist._strategies.strategy import Strategy
from polydist._valuetypes import nest as _nest
from polydist._valuetypes.values import DistributedValues, Mirrored
from polydist._valuetypes.variables import MirroredVariable, Variable, tracked_variables
from polydist.backend._contract import Backend
from polydist.errors import InvalidArgumentError

__all__ = ["ReplicaDivergenceError", "check_replicas_identical"]


class ReplicaDivergenceError(InvalidArgumentError):
    """Copies that must be identical on every replica are not (see
    :func:`check_replicas_identical`)."""


def check_replicas_identical(strategy_or_values: Any = None) -> int:
    """Verifies that mirrored values are bitwise identical on every replica.

    Args:
        strategy_or_values: ``None`` checks every ``MirroredVariable`` the
            current strategy created; a ``Strategy`` checks every
            ``MirroredVariable`` it created; anything else is a value or a
            nest (dict, list, tuple) whose ``Mirrored`` values and
            ``MirroredVariable`` leaves are checked (other leaves, such as
            ``PerReplica`` values, may differ and are skipped).

    Returns:
        How many values were checked.

    Raises:
        ReplicaDivergenceError: naming each value whose copies differ, the
            replicas that differ from replica 0, and the first differing element.
    """
    if strategy_or_values is None:
        strategy_or_values = _context.get_strategy()
    items: list[tuple[str, DistributedValues, Backend]] = []
    if isinstance(strategy_or_values, Strategy):
        backend = strategy_or_values.extended._backend
        for var in tracked_variables(strategy_or_values.extended):
            if isinstance(var, MirroredVariable):
                items.append((f"MirroredVariable {var.name!r}", var, var._backend))
    else:
        backend = _context.get_strategy().extended._backend
        paths, leaves, _ = _nest.flatten_with_path(strategy_or_values)
        for path, leaf in zip(paths, leaves):
            where = "".join(f"[{p!r}]" for p in path)
            if isinstance(leaf, MirroredVariable):
                label = f"MirroredVariable {leaf.name!r}" + (f" at {where}" if where else "")
                items.append((label, leaf, leaf._backend))
            elif isinstance(leaf, Mirrored):
                items.append((f"Mirrored value at {where or '(top level)'}", leaf, backend))
    problems = [p for label, value, b in items if (p := _compare(label, value, b))]
    if problems:
        raise ReplicaDivergenceError(
            "Replicas are not identical:\n"
            + "\n".join(f"  {p}" for p in problems)
            + "\nMirrored values and MirroredVariables must hold bitwise-identical copies on "
            "every replica. Typical causes: an update with aggregation=NONE in replica context "
            "(each replica wrote only its own copy), a Mirrored built from different arrays, or "
            "code that wrote into one copy (v.values[i].assign). Give the variable an "
            "aggregation (SUM, MEAN or ONLY_FIRST_REPLICA), or update it in cross-replica "
            "context (merge_call + strategy.extended.update)."
        )
    return len(items)


def _host(backend: Backend, x: Any) -> np.ndarray:
    if isinstance(x, Variable):
        x = x._read_storage()
    return np.asarray(backend.to_numpy(x))


def _compare(label: str, value: DistributedValues, backend: Backend) -> str | None:
    copies = [_host(backend, c) for c in value.values]
    devices = [str(getattr(c, "device", "")) for c in value.values]
    first = copies[0]
    differing = [
        r
        for r, c in enumerate(copies[1:], start=1)
        if c.shape != first.shape or c.dtype != first.dtype or c.tobytes() != first.tobytes()
    ]
    if not differing:
        return None

    def replica(r: int) -> str:
        return f"{r} ({devices[r]})" if devices[r] else str(r)

    shown = ", ".join(replica(r) for r in differing[:6]) + (", ..." if len(differing) > 6 else "")
    return f"{label}: replica(s) {shown} differ from replica {replica(0)}; " + _first_difference(
        first, copies[differing[0]], differing[0]
    )


def _first_difference(a: np.ndarray, b: np.ndarray, r: int) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"replica 0 holds {describe(a)} but replica {r} holds {describe(b)}"
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    bytes_a = flat_a.view(np.uint8).reshape(flat_a.size, -1) if flat_a.size else flat_a
    bytes_b = flat_b.view(np.uint8).reshape(flat_b.size, -1) if flat_b.size else flat_b
    unequal = np.flatnonzero((bytes_a != bytes_b).any(axis=-1)) if flat_a.size else np.zeros(0)
    if not len(unequal):
        return "the copies differ"
    i = int(unequal[0])
    index = np.unravel_index(i, a.shape) if a.ndim else ()
    text = (
        f"first difference at index {tuple(int(k) for k in index)}: "
        f"{flat_a[i].item()!r} (replica 0) vs {flat_b[i].item()!r} (replica {r})"
    )
    if a.dtype.kind in "iuc" or is_floating(np, a.dtype):  # ml_dtypes' floats are kind 'V'
        wide = np.complex128 if a.dtype.kind == "c" else np.float64
        with np.errstate(all="ignore"):
            diff = np.abs(a.astype(wide) - b.astype(wide)).reshape(-1)
        diff = diff[~np.isnan(diff)]
        if diff.size:
            text += f"; max abs difference {float(diff.max()):.6g}"
    return text
