"""``polydist.train.Checkpoint``: TF's object-based checkpoints (the manager: ``_manager``).

A ``Checkpoint`` names the objects it saves (``Checkpoint(model=..., optimizer=...)``)
and stores each value under its path, as TF's object graph does: ``model/fc.weight``,
``optimizer/state/0/exp_avg``, ``metrics/0``. It writes through the storage layer of
:mod:`polydist.checkpoint` (one format, one writer): atomic saves, a safetensors file
beside a JSON manifest, and every value checked before any is changed on restore.

What a ``Checkpoint`` holds, found by walking its objects (see :func:`_walk`):

* a ``polydist.Variable`` (mirrored, sync-on-read or plain): saved as
  ``checkpoint.save`` saves it (a SUM ``SyncOnReadVariable`` its sum), restored into
  any replica count, or without a strategy;
* a nested ``Checkpoint``;
* an object whose class was registered with :func:`register_checkpointable`;
* an object with ``state_dict()`` and ``load_state_dict()`` (``torch.nn.Module``,
  ``torch.optim`` optimizers; duck-typed, torch is never imported here): its tensors are
  stored as arrays, everything else (step counts, hyperparameters, the structure) in the
  manifest as JSON;
* an object with a ``variables`` attribute, a sequence of Variables (Keras-style layers
  and metrics, ``polydist.metrics``);
* an input iterator (``iter(dataset)``, ``iter(distributed_dataset)``): its position,
  stored in the manifest as JSON (see :mod:`polydist.data._iterator`);
* dicts, lists, tuples and namedtuples of the above.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from polydist._base.arrays import dtype_name
from polydist._collectives.check import collective_purpose
from polydist._strategies import context as _context
from polydist._strategies.strategy import Strategy
from polydist._valuetypes.variables import Variable, VariableAggregation, _components
from polydist.checkpoint._io import (
    CheckpointNotFoundError,
    JSONValue,
    Manifest,
    read_arrays,
    read_manifest,
    write_checkpoint,
)
from polydist.checkpoint._save import (
    CheckpointMismatchError,
    _require_cross_replica,
    _restored_copies,
    _saved_info,
    _saved_value,
    agree_on_restore,
)
from polydist.train._objects import (
    _decode,
    _encode,
    _framework,
    _is_json_trackable,
    _is_namedtuple,
    _is_tensor,
    _join,
    _JsonSlot,
    _leaf_spec,
    _leaf_to_numpy,
    _nest_leaves,
    _nest_rebuild,
    _NestSlot,
    _NoArrays,
    _pytree_node,
    _registration,
    _Slot,
    _StateSlot,
    _tensor_paths,
    _tensor_spec,
    _VarSlot,
    register_checkpointable,
)

__all__ = [
    "Checkpoint",
    "CheckpointLoadStatus",
    "InitializationOnlyStatus",
    "register_checkpointable",
]

_META = "polydist_checkpoint"  # the manifest's metadata entry of a Checkpoint
_VARIABLES = "polydist_variables"  # per variable: class, synchronization, aggregation
_OBJECTS = "polydist_objects"  # per array of a state dict / registered nest: what it is
_SAVE_COUNTER = "save_counter"


def _walk(obj: Any, path: str, out: list[_Slot], seen: dict[int, str], where: str) -> None:
    """Appends the slots of ``obj`` (at ``path``) to ``out``, in a fixed order."""
    if obj is None:
        return
    if isinstance(obj, Variable):
        out.append(_VarSlot(path or "variable", obj))
        return
    if not isinstance(obj, (Mapping, list, tuple)):  # containers may be shared: ()
        previous = seen.get(id(obj))
        if previous is not None:
            raise ValueError(
                f"Checkpoint: the same {type(obj).__qualname__} is reachable as {previous!r} "
                f"and {path!r}; TF's object graph would save it once under its first path, "
                "polydist refuses (restore would load it twice): keep one of them"
            )
        seen[id(obj)] = path
    if isinstance(obj, Checkpoint):
        for name, child in obj._children.items():
            _walk(child, _join(path, name), out, seen, where)
        return
    reg = _registration(obj)
    if reg is not None:
        out.append(_NestSlot(path, obj, reg))
        return
    if _is_json_trackable(obj):
        out.append(_JsonSlot(path, obj))
        return
    if callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    ):
        out.append(_StateSlot(path, obj))
        return
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _walk(v, _join(path, k), out, seen, where)
        return
    if _is_namedtuple(obj):
        for f in obj._fields:
            _walk(getattr(obj, f), _join(path, f), out, seen, where)
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, _join(path, i), out, seen, where)
        return
    node = _pytree_node(obj)
    if node is not None:
        for entry, child in zip(node.entries, node.children):
            _walk(child, _join(path, entry), out, seen, where)
        return
    variables = getattr(obj, "variables", None)
    if variables is not None and not isinstance(variables, (str, bytes)):
        items = list(variables() if callable(variables) else variables)
        if all(isinstance(v, Variable) for v in items):
            for i, v in enumerate(items):
                out.append(_VarSlot(_join(path, i), v))
            return
    raise ValueError(
        f"Checkpoint was expecting {path or where!r} to be a trackable object, got "
        f"{type(obj).__module__}.{type(obj).__qualname__}: {obj!r:.80}. A Checkpoint holds "
        "polydist Variables, nested Checkpoints, objects with state_dict()/"
        "load_state_dict() (torch modules and optimizers), objects with a `variables` "
        "sequence (layers, metrics), input iterators (iter(dataset), "
        "iter(distributed_dataset)), classes registered with "
        "polydist.train.register_checkpointable, and dicts/lists/tuples of these."
    )


# --------------------------------------------------------------------------- status


class _Status:
    """What a restore matched, for TF's assertions; warns when dropped with values left."""

    def __init__(self, path: str, unconsumed: list[str], unmatched: list[str], matched: int):
        self._path = path
        self._unconsumed = unconsumed
        self._unmatched = unmatched
        self._matched = matched
        self._silenced = False

    def assert_consumed(self) -> _Status:
        """Raises AssertionError unless every value was restored and every object got one."""
        if self._unconsumed:
            raise AssertionError(
                f"Unresolved object in checkpoint {self._path}: "
                + ", ".join(self._unconsumed[:20])
                + (" ..." if len(self._unconsumed) > 20 else "")
                + " (the checkpoint holds values that no object of this Checkpoint took; "
                "use restore(...).expect_partial() if that is intended)"
            )
        self.assert_existing_objects_matched()
        self._silenced = True
        return self

    def assert_existing_objects_matched(self) -> _Status:
        """Raises AssertionError if an object of this Checkpoint got no value."""
        if self._unmatched:
            raise AssertionError(
                f"Object not assigned a value from checkpoint {self._path}: "
                + ", ".join(self._unmatched[:20])
                + (" ..." if len(self._unmatched) > 20 else "")
            )
        return self

    def assert_nontrivial_match(self) -> _Status:
        """Raises AssertionError if nothing but the save counter was restored."""
        if self._matched == 0:
            raise AssertionError(
                f"Nothing except the root object matched a checkpointed value in {self._path}. "
                "Typically this means that the checkpoint does not match the Python program."
            )
        return self

    def expect_partial(self) -> _Status:
        """Silences the warning about values or objects left unrestored."""
        self._silenced = True
        return self

    def run_restore_ops(self, session: Any = None) -> None:
        """Nothing to run: polydist restores eagerly (TF's graph-mode method)."""

    def initialize_or_restore(self, session: Any = None) -> None:
        """Nothing to run: polydist restores eagerly (TF's graph-mode method)."""

    def __del__(self) -> None:
        if self._silenced or not (self._unconsumed or self._unmatched):
            return
        parts = []
        if self._unconsumed:
            parts.append(
                "Value in checkpoint could not be found in the restored object: "
                + ", ".join(self._unconsumed[:10])
            )
        if self._unmatched:
            parts.append("Object not restored from checkpoint: " + ", ".join(self._unmatched[:10]))
        warnings.warn(
            f"A checkpoint restore status of {self._path} is being deleted with unrestored "
            "values. To silence this warning, use status.expect_partial(). " + "; ".join(parts),
            UserWarning,
            stacklevel=2,
        )


class CheckpointLoadStatus(_Status):
    """What ``Checkpoint.restore``/``read`` returns: TF's assertions about the match."""


class InitializationOnlyStatus(_Status):
    """What ``Checkpoint.restore(None)`` returns: nothing was restored."""

    def __init__(self) -> None:
        super().__init__("(none)", [], [], 0)

    def _nothing(self) -> AssertionError:
        return AssertionError(
            "No checkpoint specified (save_path=None); nothing is being restored."
        )

    def assert_consumed(self) -> _Status:
        raise self._nothing()

    def assert_existing_objects_matched(self) -> _Status:
        raise self._nothing()

    def assert_nontrivial_match(self) -> _Status:
        raise self._nothing()


# --------------------------------------------------------------------------- Checkpoint


class Checkpoint:
    """Saves and restores named objects, as ``tf.train.Checkpoint``.

    ``Checkpoint(model=model, optimizer=optimizer)`` (or ``Checkpoint(root, **kwargs)``)
    holds polydist Variables, nests of them, nested Checkpoints, objects with
    ``state_dict()``/``load_state_dict()`` (torch modules and optimizers), objects with
    a ``variables`` sequence (layers, ``polydist.metrics``) and classes registered with
    :func:`register_checkpointable`. Each value is stored under its path
    (``optimizer/state/0/exp_avg``). Attributes assigned later (``ckpt.extra = v``) are
    saved too.

    ``save(file_prefix)`` writes ``<file_prefix>-<save_counter>`` and makes it the
    latest of its directory; ``restore(path)`` returns a status with TF's
    ``assert_consumed()``, ``assert_existing_objects_matched()``,
    ``assert_nontrivial_match()`` and ``expect_partial()``. A status dropped while
    values or objects were left unrestored warns, unless ``expect_partial()`` was
    called (TF logs the same at the Checkpoint's deletion).

    Unlike TF, restore is never deferred: every object must exist when ``restore`` is
    called (TF restores objects created later, such as optimizer slots, on creation).
    A shape or dtype that differs raises ``CheckpointMismatchError`` and a damaged
    checkpoint ``CheckpointCorruptError``, both before any value is changed.
    """

    def __init__(self, root: Any = None, **kwargs: Any) -> None:
        object.__setattr__(self, "_children", {})
        object.__setattr__(self, "_save_counter", None)
        if root is not None:
            self._children[""] = root
        for name, value in kwargs.items():
            setattr(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        if name == _SAVE_COUNTER or hasattr(type(self), name):
            raise ValueError(
                f"Checkpoint: {name!r} is the name of a Checkpoint attribute; it cannot "
                "name a saved object. Choose another keyword"
            )
        if value is not None:
            probe: list[_Slot] = []
            _walk(value, name, probe, {}, name)  # refuses what a checkpoint cannot hold
        self._children[name] = value

    def __getattr__(self, name: str) -> Any:
        children = self.__dict__.get("_children", {})
        if name in children:
            return children[name]
        raise AttributeError(f"'Checkpoint' object has no attribute {name!r}")

    # -- the save counter -----------------------------------------------------------------------
    @property
    def save_counter(self) -> Variable:
        """An integer Variable that starts at zero and is incremented by ``save``."""
        if self._save_counter is None:
            dtype = np.int64
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a backend without int64 may warn: int32
                var = Variable(
                    np.zeros((), dtype),
                    name=_SAVE_COUNTER,
                    trainable=False,
                    aggregation=VariableAggregation.ONLY_FIRST_REPLICA,
                )
            object.__setattr__(self, "_save_counter", var)
        counter: Variable = self._save_counter
        return counter

    def _counter_value(self) -> int:
        return 0 if self._save_counter is None else int(np.asarray(_saved_value(self.save_counter)))

    # -- what is saved --------------------------------------------------------------------------
    def _slots(self, *, counter: bool) -> list[_Slot]:
        out: list[_Slot] = []
        _walk(self, "", out, {}, "(root)")
        if counter and self._save_counter is not None:
            out.append(_VarSlot(_SAVE_COUNTER, self._save_counter))
        keys: dict[str, str] = {}
        for slot in out:
            key = slot.key if isinstance(slot, _VarSlot) else slot.path
            if key in keys:
                raise ValueError(
                    f"Checkpoint: two objects would be stored as {key!r}; give them different names"
                )
            keys[key] = key
        return out

    def _gather(self) -> tuple[dict[str, np.ndarray], dict[str, Any], list[Any]]:
        arrays: dict[str, np.ndarray] = {}
        variables: dict[str, JSONValue] = {}
        objects: dict[str, JSONValue] = {}
        states: dict[str, JSONValue] = {}
        nests: dict[str, JSONValue] = {}
        jsons: dict[str, JSONValue] = {}
        strategies: list[Any] = []
        for slot in self._slots(counter=True):
            if isinstance(slot, _VarSlot) and slot.var is self._save_counter:
                # int64 whatever the backend holds (JAX without x64: int32), so that it
                # restores on every backend
                arrays[slot.key] = np.asarray(self._counter_value(), np.int64)
                variables[slot.key] = _saved_info(slot.var)
            elif isinstance(slot, _VarSlot):
                arrays[slot.key] = _saved_value(slot.var)
                variables[slot.key] = _saved_info(slot.var)
                if slot.var.distribute_strategy is not None:
                    strategies.append(slot.var.distribute_strategy)
            elif isinstance(slot, _StateSlot):
                found: dict[str, np.ndarray] = {}
                where = f"{slot.path or '(root)'} ({type(slot.obj).__qualname__})"
                states[slot.path] = _encode(slot.obj.state_dict(), slot.path, found, where)
                for key in found:
                    objects[key] = {"describe": f"state_dict of {type(slot.obj).__name__}"}
                arrays.update(found)
            elif isinstance(slot, _JsonSlot):
                try:
                    jsons[slot.path] = slot.obj._checkpoint_state()
                except ValueError as error:
                    raise ValueError(f"{error} (saving {slot.path or '(root)'!r})") from None
            else:
                leaves: list[tuple[str, Any]] = []
                _nest_leaves(slot.reg.to_nest(slot.obj), slot.path, leaves)
                nests[slot.path] = [k for k, _ in leaves]
                for key, leaf in leaves:
                    arrays[key] = _leaf_to_numpy(leaf)
                    if isinstance(leaf, Variable):
                        variables[key] = _saved_info(leaf)
                    else:
                        objects[key] = {"describe": f"{type(slot.obj).__name__} state"}
        meta = {
            _VARIABLES: variables,
            _OBJECTS: objects,
            _META: {"format": 1, "state_dicts": states, "nests": nests, "json_states": jsons},
        }
        return arrays, meta, strategies

    def _write_to(self, path: Path, step: int, pointer: Mapping[str, Any] | None) -> Path | None:
        _require_cross_replica_train()
        with collective_purpose("checkpoint save"):  # its reads: see checkpoint.save
            arrays, meta, strategies = self._gather()
        owners = {id(s): s for s in strategies}
        if _context.has_strategy():
            s = _context.get_strategy()
            owners[id(s)] = s
        if any(not s.extended.should_checkpoint for s in owners.values()):
            return None  # not the chief: it took part in the reads, the chief writes
        return write_checkpoint(path, arrays, step=step, metadata=meta, pointer=pointer)

    def write(self, file_prefix: str | os.PathLike[str], options: Any = None) -> str:
        """Writes a checkpoint at exactly ``file_prefix`` (a directory), without numbering
        it and without making it the directory's latest. Returns the path."""
        out = self._write_to(Path(file_prefix), self._counter_value(), None)
        return os.fspath(file_prefix if out is None else out)

    def save(self, file_prefix: str | os.PathLike[str], options: Any = None) -> str:
        """Increments ``save_counter`` and writes ``<file_prefix>-<save_counter>``, the
        latest checkpoint of its directory (``latest_checkpoint(directory)``). Returns
        its path. On a worker that must not write (not the chief), nothing is written."""
        prefix = Path(file_prefix)
        if not prefix.name or os.fspath(file_prefix).endswith(("/", os.sep)):
            raise ValueError(
                f"Checkpoint.save: file_prefix {os.fspath(file_prefix)!r} names a directory; "
                "pass a prefix inside it, such as 'ckpts/ckpt' (saved as ckpts/ckpt-1, ...)"
            )
        _require_cross_replica_train()
        with collective_purpose("checkpoint save"):
            counter = self.save_counter
            counter.assign(np.asarray(self._counter_value() + 1, dtype=counter.dtype))
            n = self._counter_value()
            path = prefix.parent / f"{prefix.name}-{n}"
            record = {"all": [path.name], "timestamps": [time.time()]}
            out = self._write_to(path, n, record)
        return os.fspath(path if out is None else out)

    # -- restoring ------------------------------------------------------------------------------
    def restore(self, save_path: str | os.PathLike[str] | None, options: Any = None) -> _Status:
        """Restores every object from ``save_path`` (a path ``save`` returned, or a
        directory: its latest checkpoint); ``None`` restores nothing. Returns a status
        for TF's assertions. Every value is checked (names, shapes, dtypes, checksums)
        before any is changed."""
        if save_path is None:
            self._agree(None, "(no checkpoint: save_path=None)")
            return InitializationOnlyStatus()
        self.save_counter  # noqa: B018 -- restore() expects it, as TF's does
        return self._restore(save_path, counter=True)

    def _strategies(self) -> list[Any]:
        found = []
        for slot in self._slots(counter=False):
            obj = slot.var if isinstance(slot, _VarSlot) else slot.obj
            # A variable's, an optimizer's, a distributed module's (polydist_torch's).
            for name in ("distribute_strategy", "_strategy", "strategy"):
                strategy = getattr(obj, name, None)
                if isinstance(strategy, Strategy):
                    found.append(strategy)
                    break
        if _context.has_strategy():
            found.append(_context.get_strategy())
        return found

    def _agree(self, manifest: Any, looked_in: object) -> None:
        """Every worker process restores the same checkpoint, or none (see
        ``checkpoint.restore``): only the chief wrote it."""
        agree_on_restore(self._strategies(), manifest, looked_in)

    def read(self, save_path: str | os.PathLike[str], options: Any = None) -> _Status:
        """As ``restore``, but for a checkpoint ``write`` wrote: ``save_counter`` is
        neither expected nor restored."""
        return self._restore(save_path, counter=False)

    def _restore(self, save_path: str | os.PathLike[str], *, counter: bool) -> _Status:
        _require_cross_replica_train()
        try:
            manifest = read_manifest(save_path)
        except CheckpointNotFoundError:
            self._agree(None, save_path)
            raise
        self._agree(manifest, save_path)
        slots = self._slots(counter=counter)
        meta = manifest.metadata.get(_META)
        found = meta.get("state_dicts") if isinstance(meta, dict) else None
        states: dict[str, JSONValue] = found if isinstance(found, dict) else {}
        found_json = meta.get("json_states") if isinstance(meta, dict) else None
        jsons: dict[str, JSONValue] = found_json if isinstance(found_json, dict) else {}
        json_matched: dict[str, None] = {}
        consumed: dict[str, None] = {}
        unmatched: list[str] = []
        problems: list[str] = []
        plan: list[tuple[_Slot, Any]] = []  # what to read, per slot
        for slot in slots:
            if isinstance(slot, _VarSlot):
                spec = manifest.arrays.get(slot.key)
                if spec is None:
                    unmatched.append(slot.key)
                    continue
                want = (tuple(slot.var.shape), dtype_name(slot.var.dtype))
                if slot.var is self._save_counter:
                    want = ((), "int64")
                _check(slot.key, want, (spec.shape, dtype_name(spec.dtype)), problems)
                consumed[slot.key] = None
                plan.append((slot, [slot.key]))
            elif isinstance(slot, _StateSlot):
                doc = states.get(slot.path)
                if doc is None:
                    unmatched.append(slot.path or "(root)")
                    continue
                keys = list(_tensor_paths(doc, {}))
                _check_state(slot, doc, keys, manifest, problems)
                consumed.update(dict.fromkeys(keys))
                plan.append((slot, doc))
            elif isinstance(slot, _JsonSlot):
                saved = jsons.get(slot.path)
                if saved is None:
                    unmatched.append(slot.path or "(root)")
                    continue
                found_problems = slot.obj._checkpoint_problems(saved)
                problems.extend(f"{slot.path or '(root)'!r}: {p}" for p in found_problems)
                json_matched[slot.path] = None
                plan.append((slot, saved))
            else:
                leaves: list[tuple[str, Any]] = []
                nest = slot.reg.to_nest(slot.obj)
                _nest_leaves(nest, slot.path, leaves)
                # TF restores each value it finds: the leaves the checkpoint lacks (a layer
                # added since) are unmatched, the others still restored.
                present = [(k, leaf) for k, leaf in leaves if k in manifest.arrays]
                unmatched.extend(k for k, _ in leaves if k not in manifest.arrays)
                if not present:
                    continue
                for key, leaf in present:
                    spec = manifest.arrays[key]
                    _check(key, _leaf_spec(leaf), (spec.shape, dtype_name(spec.dtype)), problems)
                consumed.update(dict.fromkeys(k for k, _ in present))
                plan.append((slot, (nest, leaves)))
        if problems:
            raise CheckpointMismatchError(
                f"checkpoint {manifest.path} (step {manifest.step}) does not fit the objects "
                "to restore:\n" + "\n".join(f"  - {p}" for p in problems) + "\nNothing was "
                "restored. Restore into objects of the same shapes and dtypes (the model and "
                "optimizer the checkpoint was saved from)."
            )
        stored = read_arrays(manifest.path, list(consumed))
        # Convert everything before writing anything, so that a failure changes nothing
        # (an iterator replays its input here).
        actions = [(_write_order(slot), _prepare(slot, what, stored)) for slot, what in plan]
        # load_state_dict and from_nest first: they may still raise (a torch optimizer
        # checks its parameter groups), and then no Variable has been written yet.
        # Optimizers before modules: a module's state was checked above, and a
        # distributed optimizer checks its state's shapes against the parameters.
        for _, act in sorted(actions, key=lambda a: a[0]):
            act()
        ignored = {_SAVE_COUNTER} if not counter else set()
        unconsumed = [k for k in manifest.arrays if k not in consumed and k not in ignored]
        unconsumed += [
            p or "(root)"
            for p in states
            if not any(isinstance(s, _StateSlot) and s.path == p for s in slots)
            and p not in unconsumed
        ]
        unconsumed += [p or "(root)" for p in jsons if p not in json_matched]
        matched = sum(1 for k in consumed if k != _SAVE_COUNTER) + len(json_matched)
        return CheckpointLoadStatus(str(manifest.path), unconsumed, unmatched, matched)


def _write_order(slot: _Slot) -> int:
    """0: optimizers (state_dict objects with ``param_groups``), 1: other state_dict
    objects and registered nests, 2: Variables."""
    if isinstance(slot, _VarSlot):
        return 2
    return 0 if isinstance(slot, _StateSlot) and hasattr(slot.obj, "param_groups") else 1


def _require_cross_replica_train() -> None:
    _require_cross_replica("Checkpoint")


def _check(
    key: str,
    want: tuple[tuple[int, ...], str],
    have: tuple[tuple[int, ...], str],
    problems: list[str],
) -> None:
    if (tuple(want[0]), want[1]) != (tuple(have[0]), have[1]):
        problems.append(
            f"{key!r} is {want[1]}{list(want[0])} but the checkpoint holds {have[1]}{list(have[0])}"
        )


def _check_state(
    slot: _StateSlot, doc: JSONValue, keys: list[str], manifest: Manifest, problems: list[str]
) -> None:
    """Where a module's current state dict has tensors, the saved one must have the same
    (load_state_dict may copy some before it raises on the others). An optimizer's saved
    state replaces its current one, as torch's ``Optimizer.load_state_dict`` does: per
    parameter state on one side only is fine (a checkpoint saved before the first step,
    a parameter that had no gradient yet); its parameter groups must have the same sizes,
    and a tensor on both sides the same shape and dtype."""
    current: dict[str, np.ndarray] = {}
    try:
        now = slot.obj.state_dict()
        _collect_specs(now, slot.path, current)
    except TypeError:
        return
    missing = [k for k in keys if k not in manifest.arrays]
    if missing:
        problems.append(f"{missing[0]!r} is named by the manifest but not stored (damaged?)")
        return
    saved_groups = _group_sizes(_decode(doc, _NoArrays(), None))
    now_groups = _group_sizes(now)
    if saved_groups is not None and now_groups is not None and saved_groups != now_groups:
        problems.append(
            f"{slot.path!r} ({type(slot.obj).__name__}) has parameter groups of sizes "
            f"{now_groups} but the checkpoint holds {saved_groups}"
        )
    if current and not _is_optimizer_state(now):
        extra = [k for k in current if k not in keys]
        absent = [k for k in keys if k not in current]
        for k in extra[:5]:
            problems.append(f"{k!r} ({type(slot.obj).__qualname__}) is not in the checkpoint")
        for k in absent[:5]:
            problems.append(f"{k!r} is in the checkpoint but not in {type(slot.obj).__qualname__}")
    for k in keys:
        if k in current:
            spec = manifest.arrays[k]
            _check(k, current[k], (spec.shape, dtype_name(spec.dtype)), problems)  # type: ignore[arg-type]


def _is_optimizer_state(state: Any) -> bool:
    """A torch optimizer's state dict: exactly ``state`` (a mapping) and ``param_groups``
    (a list); its ``load_state_dict`` replaces the state (checks the groups first)."""
    return (
        isinstance(state, Mapping)
        and set(state) == {"state", "param_groups"}
        and isinstance(state["state"], Mapping)
        and isinstance(state["param_groups"], list)
    )


def _group_sizes(state: Any) -> list[int] | None:
    """The sizes of an optimizer state dict's ``param_groups`` (torch checks them in
    ``load_state_dict``, but only after the model before it in a Checkpoint loaded)."""
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    if not isinstance(groups, list):
        return None
    sizes = [len(g["params"]) for g in groups if isinstance(g, Mapping) and "params" in g]
    return sizes if len(sizes) == len(groups) else None


def _collect_specs(value: Any, key: str, out: dict[str, Any]) -> None:
    if _is_tensor(value):
        out[key] = _tensor_spec(value)
    elif isinstance(value, (np.ndarray, np.generic)):
        out[key] = (np.shape(value), dtype_name(np.asarray(value).dtype))
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _collect_specs(v, _join(key, k), out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _collect_specs(v, _join(key, i), out)


def _prepare(slot: _Slot, what: Any, stored: Mapping[str, np.ndarray]) -> Callable[[], None]:
    """Converts the restored values of ``slot``; returns what writes them."""
    if isinstance(slot, _VarSlot):
        value = stored[slot.key]
        if slot.key == _SAVE_COUNTER and slot.var.name.startswith(_SAVE_COUNTER):
            value = value.astype(dtype_name(slot.var.dtype))  # int64 on disk, see _gather
        return _assign_later(slot.var, value)
    if isinstance(slot, _JsonSlot):
        commit: Callable[[], None] = slot.obj._checkpoint_restore(what)
        return commit
    if isinstance(slot, _StateSlot):
        framework = _framework(slot.obj) if _tensor_paths_in(what) else None
        state = _decode(what, stored, framework)
        return lambda: slot.obj.load_state_dict(state)
    nest, leaves = what
    if slot.reg.from_nest is None:
        bad = [k for k, leaf in leaves if not isinstance(leaf, Variable)]
        if bad:
            raise TypeError(
                f"Checkpoint: {type(slot.obj).__qualname__} was registered without from_nest, "
                f"so every leaf of to_nest must be a polydist.Variable; {bad[0]!r} is not. "
                "Register it with a from_nest(obj, nest) that writes the values back"
            )
    if slot.reg.from_nest is None or (
        any(k not in stored for k, _ in leaves)
        and all(isinstance(leaf, Variable) for _, leaf in leaves)
    ):
        # Variables are assigned here, the ones the checkpoint holds only (a distributed
        # nnx object restored partially keeps its other copies untouched).
        writes = [_assign_later(leaf, stored[k]) for k, leaf in leaves if k in stored]

        def write_all() -> None:
            for w in writes:
                w()

        return write_all
    # A leaf the checkpoint lacks gets its current value back.
    values = {k: stored[k] if k in stored else _leaf_to_numpy(leaf) for k, leaf in leaves}
    rebuilt = _nest_rebuild(nest, slot.path, values)
    from_nest = slot.reg.from_nest
    return lambda: from_nest(slot.obj, rebuilt)


def _tensor_paths_in(doc: JSONValue) -> bool:
    return _has_tag(doc, "__tensor__")


def _has_tag(doc: JSONValue, tag: str) -> bool:
    if isinstance(doc, dict):
        return tag in doc or any(_has_tag(v, tag) for v in doc.values())
    if isinstance(doc, list):
        return any(_has_tag(v, tag) for v in doc)
    return False


def _assign_later(var: Variable, value: np.ndarray) -> Callable[[], None]:
    copies = _restored_copies(var, value)

    def write() -> None:
        for component, array in zip(_components(var), copies):
            component._write_storage(array)

    return write


# --------------------------------------------------------------------------- manager
