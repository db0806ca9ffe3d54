"""``checkpoint.save`` and ``checkpoint.restore``: variables to and from checkpoints.

Built on the storage layer (:mod:`polydist.checkpoint._io`), so a save is
atomic: a crash leaves the previous checkpoint intact and the latest one.

What is stored for each variable (TF's rules): a ``MirroredVariable`` its
value (replica 0's copy); a ``SyncOnReadVariable`` its aggregated value (the
SUM or MEAN of the copies, or replica 0's with ``ONLY_FIRST_REPLICA``;
``aggregation=NONE`` cannot be saved); a plain variable its value. Values
are stored bit for bit, ml_dtypes' bfloat16 and float8_* included (by their
bits, see :mod:`polydist.checkpoint._io`). The stored
values do not depend on the number of replicas, so a checkpoint restores
into a strategy with any replica count: a mirrored value goes to every copy,
and a ``SUM`` ``SyncOnReadVariable`` is split exactly among its N copies
(:func:`exact_sum_split`), so that it reads back as the saved sum bit for bit
(TF writes ``value / N`` into each copy, which loses integer counts and float
bits).

Names in the checkpoint:

* a ``Strategy``: every live variable it created, under its name without the
  ``:0`` suffix (``"dense/kernel"``). Names must be unique: give variables
  ``name=...`` or pass a dict.
* a ``Variable``: its name without ``:0``.
* a dict, list or tuple of variables: the path of each variable, keys and
  indices joined with ``/`` (``{"w": w, "layers": [a, b]}`` gives ``"w"``,
  ``"layers/0"``, ``"layers/1"``).
"""

from __future__ import annotations

import difflib
import hashlib
import os
from pathlib import Path
from typing import Any, cast

import numpy as np

from polydist._base.arrays import dtype_name
from polydist._collectives.check import collective_purpose
from polydist._strategies import context as _context
from polydist._strategies.strategy import Strategy
from polydist._valuetypes import nest as _nest
from polydist._valuetypes.variables import (
    DistributedVariable,
    MirroredVariable,
    SyncOnReadVariable,
    Variable,
    VariableAggregation,
    _common_name,
    _components,
    _copy,
    _global_copies,
    tracked_variables,
)
from polydist.checkpoint._format import _MANIFEST_NAME
from polydist.checkpoint._io import (
    CheckpointError,
    CheckpointNotFoundError,
    Manifest,
    read_arrays,
    read_manifest,
    write_arrays,
)

__all__ = ["CheckpointMismatchError", "restore", "save"]

_META_KEY = "polydist_variables"


class CheckpointMismatchError(CheckpointError, ValueError):
    """A checkpoint does not fit the variables to restore (missing name, shape, dtype)."""


def save(
    directory: str | os.PathLike[str],
    variables_or_strategy_or_nest: Any,
    *,
    step: int | None = None,
    max_to_keep: int | None = None,
) -> Path | None:
    """Saves variables atomically as ``directory/ckpt-<step>`` and makes it the latest.

    Args:
        directory: the checkpoint root directory (created if needed).
        variables_or_strategy_or_nest: a ``Strategy`` (every variable it
            created), a ``Variable``, or a dict/list/tuple of variables.
        step: the checkpoint's step; default one more than the latest.
        max_to_keep: keep only this many checkpoints (the newest).

    Returns:
        The new checkpoint's directory, or ``None`` on a worker that must not
        write (``strategy.extended.should_checkpoint`` is False: not the chief
        of a multi-worker cluster). Such a worker still reads the values, so
        it takes part in the collectives the read needs.
    """
    _require_cross_replica("save")
    items, strategy = _collect(variables_or_strategy_or_nest, "save")
    arrays: dict[str, np.ndarray] = {}
    info: dict[str, Any] = {}
    # The reads' collectives (SyncOnRead values) are marked as the save's: a worker at a
    # collective of its own instead raises CollectiveMismatchError, before any write.
    with collective_purpose("checkpoint save"):
        for key, var in items:
            arrays[key] = _saved_value(var)
            info[key] = _saved_info(var)
    if strategy is not None and not strategy.extended.should_checkpoint:
        return None
    # A nest of variables carries its strategies: only their chief writes.
    owners = {id(s): s for _, v in items if (s := getattr(v, "_distribute_strategy", None))}
    if any(not s.extended.should_checkpoint for s in owners.values()):
        return None
    return write_arrays(
        directory, arrays, metadata={_META_KEY: info}, step=step, max_to_keep=max_to_keep
    )


def restore(
    directory_or_path: str | os.PathLike[str], variables_or_strategy_or_nest: Any
) -> Manifest:
    """Restores variables from a checkpoint; every variable or none is changed.

    Args:
        directory_or_path: a checkpoint directory (``ckpt-<step>``) or a root
            directory (its latest checkpoint is used).
        variables_or_strategy_or_nest: as for :func:`save`. The checkpoint may
            hold more variables than asked for; the others are ignored.

    Returns:
        The restored checkpoint's ``Manifest`` (its ``step``, ``path``, ``metadata``).

    Raises:
        CheckpointMismatchError: a variable is missing from the checkpoint, or
            its shape or dtype differs, byte order included (the message names
            each one).
        CheckpointCorruptError: the checkpoint's files are damaged.
        CheckpointNotFoundError: there is no checkpoint at ``directory_or_path``.
    """
    _require_cross_replica("restore")
    items, strategy = _collect(variables_or_strategy_or_nest, "restore")
    try:
        manifest = read_manifest(directory_or_path)
    except CheckpointNotFoundError:
        found = None
    else:
        found = manifest
    # Every worker process must restore the same checkpoint (only the chief wrote it).
    agree_on_restore(_restore_strategies(items, strategy), found, directory_or_path)
    if found is None:
        manifest = read_manifest(directory_or_path)  # raises CheckpointNotFoundError
    problems = []
    for key, var in items:
        spec = manifest.arrays.get(key)
        what = f"{type(var).__name__} {var.name!r}"
        if spec is None:
            close = difflib.get_close_matches(key, list(manifest.arrays), n=3)
            hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
            problems.append(f"{key!r} ({what}) is not in the checkpoint{hint}")
            continue
        want = f"{dtype_name(var.dtype)}{list(var.shape)}"
        have = f"{dtype_name(spec.dtype)}{list(spec.shape)}"
        if spec.shape != var.shape or dtype_name(spec.dtype) != dtype_name(var.dtype):
            problems.append(f"{key!r} ({what}) is {want} but the checkpoint holds {have}")
    if problems:
        names = list(manifest.arrays)
        shown = ", ".join(map(repr, names[:20])) + (", ..." if len(names) > 20 else "")
        raise CheckpointMismatchError(
            f"checkpoint {manifest.path} (step {manifest.step}) does not fit the variables to "
            "restore:\n" + "\n".join(f"  - {p}" for p in problems) + f"\nIt holds {len(names)} "
            f"variable(s): {shown or '(none)'}. Restore into variables with the same names, "
            "shapes and dtypes, or pass a dict that maps the checkpoint's names to variables."
        )
    stored = read_arrays(manifest.path, [key for key, _ in items])
    # Convert everything before writing anything, so that a failure changes nothing.
    updates = [(var, _restored_copies(var, stored[key])) for key, var in items]
    for var, copies in updates:
        for component, array in zip(_components(var), copies):
            component._write_storage(array)
    return manifest


def _saved_info(var: Variable) -> dict[str, Any]:
    """What the manifest records about a saved variable."""
    return {
        "name": var.name,
        "class": type(var).__name__,
        "synchronization": var.synchronization.name,
        "aggregation": var.aggregation.name,
        "replicas": len(_components(var)),
    }


def _require_cross_replica(what: str) -> None:
    if _context.has_strategy() and _context.get_replica_context() is not None:
        raise RuntimeError(
            f"checkpoint.{what} must be called in cross-replica context, not inside "
            f"strategy.run: call it after strategy.run returns (e.g. every N steps)."
        )


def _collect(obj: Any, what: str) -> tuple[list[tuple[str, Variable]], Strategy | None]:
    items: list[tuple[str, Variable]] = []
    if isinstance(obj, Strategy):
        variables = tracked_variables(obj.extended)
        if not variables:
            raise ValueError(
                f"checkpoint.{what}: {obj!r} has created no variables, so there is nothing to "
                f"{what}. Create them with polydist.Variable inside strategy.scope(), or pass "
                "the variables (a dict of them) instead."
            )
        items = [(_common_name(v.name), v) for v in variables]
        strategy: Strategy | None = obj
    else:
        paths, leaves, _ = _nest.flatten_with_path(obj, is_leaf=lambda x: isinstance(x, Variable))
        for path, leaf in zip(paths, leaves):
            where = "/".join(str(p) for p in path)
            if not isinstance(leaf, Variable):
                raise TypeError(
                    f"checkpoint.{what}: the value at {where or '(top level)'} is a "
                    f"{type(leaf).__name__}, not a polydist.Variable. Pass a Strategy, a "
                    "Variable, or a dict/list/tuple of Variables."
                )
            items.append((where or _common_name(leaf.name), leaf))
        if not items:
            raise ValueError(
                f"checkpoint.{what}: no variables given ({obj!r}); pass a Strategy, a Variable, "
                "or a dict/list/tuple of Variables."
            )
        strategy = _owner(items)
    seen: dict[str, Variable] = {}
    for key, var in items:
        other = seen.get(key)
        if other is not None and other is not var:
            raise ValueError(
                f"checkpoint.{what}: two variables would be stored as {key!r}: "
                f"{type(other).__name__} {other.name!r} and {type(var).__name__} {var.name!r}. "
                "Give the variables unique names (polydist.Variable(..., name='...')), or pass "
                "a dict {key: variable}."
            )
        seen[key] = var
    return items, strategy


def _owner(items: list[tuple[str, Variable]]) -> Strategy | None:
    owners = {id(s): s for _, v in items if (s := v.distribute_strategy) is not None}
    if len(owners) == 1:  # a variable knows its strategy by the context's protocol
        return cast(Strategy, next(iter(owners.values())))
    return _context.get_strategy()


def _saved_value(var: Variable) -> np.ndarray:
    if isinstance(var, SyncOnReadVariable):
        array = var._cross_replica_value()
    elif isinstance(var, MirroredVariable):
        array = var.values[0]._read_storage()
    elif isinstance(var, DistributedVariable):
        raise TypeError(f"checkpoint.save does not know how to save {type(var).__name__}.")
    else:
        array = var._read_storage()
    host = np.asarray(var._backend.to_numpy(array))
    if dtype_name(host.dtype) != dtype_name(var.dtype):
        # torch's to_numpy widens bfloat16/float8 to float32 without ml_dtypes: such a
        # checkpoint would not restore into the variable (dtype mismatch).
        raise TypeError(
            f"checkpoint.save: {type(var).__name__} {var.name!r} has dtype "
            f"{dtype_name(var.dtype)}, but its backend hands it to NumPy as "
            f"{dtype_name(host.dtype)}, so it cannot be saved bit for bit; pip install "
            "ml_dtypes (NumPy arrays of bfloat16 and float8_* need it)."
        )
    return host


def _restored_copies(var: Variable, stored: np.ndarray) -> list[Any]:
    backend = var._backend
    xp = backend.array_namespace()
    components = _components(var)
    if isinstance(var, SyncOnReadVariable) and var.aggregation is VariableAggregation.SUM:
        # Not TF's value / N in each copy (it loses counts and float bits): an exact split.
        n = _global_copies(var)
        strategy = getattr(var, "_distribute_strategy", None)
        offset = int(getattr(getattr(strategy, "extended", None), "_replica_offset", 0))
        shares = exact_sum_split(stored, n)[offset : offset + len(components)]
        return [c._place(xp.asarray(s)) for c, s in zip(components, shares)]
    value = xp.asarray(stored)
    return [c._place(_copy(value, xp)) for c in components]


def exact_sum_split(value: np.ndarray, n: int) -> list[np.ndarray]:
    """``n`` arrays whose sum is ``value`` bit for bit, whatever order they are added in.

    Integers: ``value // n`` in each copy but the first, which holds the rest
    (``value - (n - 1) * (value // n)``; integer arithmetic is exact, and wraps
    exactly where it overflows). Floats (and complex, bfloat16, float8):
    ``value`` in the first copy and ``-0.0`` in the others, since ``x + -0.0 == x``
    for every ``x`` (``-0.0``, infinities and NaNs included), where ``value / n``
    rounds. TF writes ``value / n`` (cast) into every copy and loses both.
    """
    value = np.asarray(value)
    if n == 1:
        return [value.copy()]
    flat = value.reshape(-1)  # 1-d, so that NumPy's integer arithmetic wraps silently
    if flat.dtype.kind in "iu":
        # in native byte order (a ufunc's dtype= refuses '>i4'), stored back in value's
        native = flat.dtype.newbyteorder("=")
        work = flat.astype(native, copy=False)
        share = np.floor_divide(work, n)
        first = np.subtract(work, np.multiply(share, n - 1, dtype=native), dtype=native)
        first, share = first.astype(flat.dtype, copy=False), share.astype(flat.dtype, copy=False)
        parts = [first] + [share.copy() for _ in range(n - 1)]
    else:
        # complex: both parts -0.0 (NumPy's complex(-0.0) has imaginary part +0.0)
        negative_zero = np.full_like(flat, complex(-0.0, -0.0) if flat.dtype.kind == "c" else -0.0)
        parts = [flat.copy()] + [negative_zero.copy() for _ in range(n - 1)]
    return [p.reshape(value.shape) for p in parts]


def agree_on_restore(strategies: Any, manifest: Manifest | None, looked_in: object) -> None:
    """Checks, on a cluster of worker processes, that every worker restores the same
    checkpoint (or that none restores one); raises ``CheckpointMismatchError`` on every
    worker otherwise. Only the chief writes checkpoints, so a worker that cannot read the
    chief's directory would otherwise go on from other weights and another input
    position than the rest, silently. One collective (a gather of a few int32s) per
    restore, only where several worker processes run."""
    cluster = [s for s in {id(s): s for s in strategies}.values() if _worker_processes(s) > 1]
    if not cluster:
        return
    strategy = cluster[0]
    mine = [0, 0, 0, 0]
    if manifest is not None:
        digest = hashlib.sha256((Path(manifest.path) / _MANIFEST_NAME).read_bytes()).digest()
        mine = [1, manifest.step % 2**31] + [
            int.from_bytes(digest[i : i + 4], "little") % 2**31 for i in (0, 4)
        ]
    with collective_purpose("checkpoint restore"):
        seen = np.asarray(strategy.gather(np.asarray([mine], np.int32), axis=0))
    rows = [tuple(int(v) for v in row) for row in seen.reshape(-1, 4)]
    if len(set(rows)) == 1:
        return
    me = int(strategy.extended._worker_index)

    def view(w: int, row: tuple[int, ...]) -> str:
        this = " (this worker)" if w == me else ""
        if not row[0]:
            return f"worker {w}{this}: no checkpoint"
        return f"worker {w}{this}: the checkpoint of step {row[1]} (manifest {row[2]:08x})"

    raise CheckpointMismatchError(
        "The workers would restore different checkpoints, and so train from different "
        "weights and input positions without any error:\n"
        + "\n".join(f"  - {view(w, row)}" for w, row in enumerate(rows))
        + f"\nThis worker looked in {os.fspath(cast(Any, looked_in))!r}. Only the chief "
        "writes checkpoints (TF's other workers write to a temporary directory), so every "
        "worker must restore from the chief's directory: give every worker the same path "
        "on a filesystem they all read (on one machine, the same directory), or copy the "
        "chief's latest checkpoint to each worker before restoring. Every worker raised "
        "this error; nothing was restored."
    )


def _restore_strategies(items: Any, strategy: Strategy | None) -> list[Strategy]:
    found = [] if strategy is None else [strategy]
    found += [s for _, v in items if (s := getattr(v, "_distribute_strategy", None))]
    if _context.has_strategy():
        found.append(_context.get_strategy())
    return found


def _worker_processes(strategy: Any) -> int:
    """The workers of ``strategy`` that run in processes of their own (1: none, or all
    simulated in this one, where every worker reads the same files)."""
    extended = getattr(strategy, "extended", None)
    mode = getattr(extended, "_in_multi_worker_mode", None)
    if mode is None or not mode() or getattr(extended, "_runs_other_workers", lambda: True)():
        return 1
    return int(getattr(extended, "_num_workers", 1))
