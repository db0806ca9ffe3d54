"""How a ``polydist.train.Checkpoint`` finds what it saves: the registry of
checkpointable classes, the named slots that the walk over its objects yields, and
the encoding of state dicts (tensors duck-typed, torch never imported) and registered
nests as arrays plus JSON.  The list of what a ``Checkpoint`` holds is in
:mod:`polydist.train._checkpoint`.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from polydist._base.arrays import dtype_name
from polydist._valuetypes import nest as _nest
from polydist._valuetypes.variables import Variable
from polydist.checkpoint._io import (
    CheckpointError,
    JSONValue,
)
from polydist.checkpoint._save import (
    _saved_value,
)

# --------------------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class _Registration:
    to_nest: Callable[[Any], Any]
    from_nest: Callable[[Any, Any], None] | None


_REGISTRY: dict[type, _Registration] = {}


def register_checkpointable(
    cls: type,
    *,
    to_nest: Callable[[Any], Any],
    from_nest: Callable[[Any, Any], None] | None = None,
) -> None:
    """Lets ``Checkpoint`` save and restore instances of ``cls`` (and its subclasses).

    Args:
        cls: the class, e.g. a framework's module or optimizer-state type.
        to_nest: ``to_nest(obj)`` returns a nest (dicts, lists, tuples, namedtuples)
            whose leaves are ``polydist.Variable`` s or arrays (NumPy arrays, or anything
            ``np.asarray`` converts: JAX arrays, ...). It is called on save, and on
            restore to learn the structure (shapes, dtypes) the values must fit.
        from_nest: ``from_nest(obj, nest)`` writes restored values back into ``obj``;
            ``nest`` has ``to_nest(obj)``'s structure with a NumPy array at every leaf.
            ``None``: every leaf of ``to_nest(obj)`` is a Variable, which restore assigns
            in place.

    Entries are named by the object's path and the leaf's path in the nest
    (``model/layers/0/kernel``). Registering a class again replaces its functions.
    """
    if not isinstance(cls, type):
        raise TypeError(
            f"register_checkpointable: cls must be a class, got {cls!r} "
            f"({type(cls).__name__}); pass the type, e.g. type(obj)"
        )
    if not callable(to_nest) or (from_nest is not None and not callable(from_nest)):
        raise TypeError(
            "register_checkpointable: to_nest must be callable and from_nest callable or "
            f"None, got to_nest={to_nest!r}, from_nest={from_nest!r}"
        )
    _REGISTRY[cls] = _Registration(to_nest, from_nest)


def _registration(obj: object) -> _Registration | None:
    for klass in type(obj).__mro__:
        if klass in _REGISTRY:
            return _REGISTRY[klass]
    return None


# --------------------------------------------------------------------------- walking


def _escape(part: object) -> str:
    # "/" separates path components: escape it (and "%", the escape) inside one.
    return str(part).replace("%", "%25").replace("/", "%2F")


def _join(prefix: str, part: object) -> str:
    return f"{prefix}/{_escape(part)}" if prefix else _escape(part)


@dataclasses.dataclass
class _VarSlot:
    """A Variable, saved and restored under ``key``."""

    key: str
    var: Variable


@dataclasses.dataclass
class _StateSlot:
    """An object with state_dict()/load_state_dict() at ``path``."""

    path: str
    obj: Any


@dataclasses.dataclass
class _NestSlot:
    """A registered object at ``path``."""

    path: str
    obj: Any
    reg: _Registration


@dataclasses.dataclass
class _JsonSlot:
    """An object whose state is JSON (an input iterator's position) at ``path``.

    Duck-typed: ``_checkpoint_state()`` gives the state (ValueError if it cannot be
    saved), ``_checkpoint_problems(state)`` why a saved state does not fit, and
    ``_checkpoint_restore(state)`` prepares the restore (it may raise; nothing has
    changed then) and returns what commits it. See ``polydist.data._iterator``.
    """

    path: str
    obj: Any


def _is_json_trackable(obj: object) -> bool:
    return all(
        callable(getattr(obj, name, None))
        for name in ("_checkpoint_state", "_checkpoint_problems", "_checkpoint_restore")
    )


_Slot = _VarSlot | _StateSlot | _NestSlot | _JsonSlot


def _pytree_node(x: Any) -> Any:
    """optree's one-level view of ``x`` if it is a pytree node under core's nest rule
    (framework pytrees included, through the backends' tree systems), else None."""
    if isinstance(x, Variable):
        return None
    return _nest.flatten_one_level(x)


def _is_namedtuple(x: object) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


# --------------------------------------------------------------------------- tensors (duck-typed)


def _is_tensor(x: object) -> bool:
    """A framework tensor (torch's): detach(), cpu() and numpy(), not a NumPy array."""
    return (
        not isinstance(x, np.ndarray)
        and callable(getattr(x, "detach", None))
        and callable(getattr(x, "cpu", None))
        and callable(getattr(x, "numpy", None))
    )


def _framework(obj: object) -> Any:
    """The (already imported) framework module of ``obj``'s class: ``torch`` for a
    ``torch.nn.Module`` subclass; found on the class's MRO, never imported here."""
    for klass in type(obj).__mro__:
        module = sys.modules.get(klass.__module__.partition(".")[0])
        if module is not None and callable(getattr(module, "from_numpy", None)):
            return module
    raise TypeError(
        f"Checkpoint: cannot turn arrays back into tensors for {type(obj).__qualname__}: "
        "none of its classes comes from a framework with from_numpy (torch); register "
        "the class with polydist.train.register_checkpointable instead"
    )


def _ml_dtype(name: str) -> np.dtype[Any]:
    ml = importlib.import_module("ml_dtypes")
    dtype: np.dtype[Any] = np.dtype(getattr(ml, name))
    return dtype


def _tensor_to_numpy(t: Any) -> np.ndarray:
    t = t.detach().cpu()
    try:
        return np.array(t.numpy(), copy=True)  # a copy: numpy() shares the tensor's memory
    except (TypeError, RuntimeError):  # bfloat16, float8: NumPy has no such dtype
        name = str(t.dtype).rpartition(".")[2]
        dtype = _ml_dtype(name)
        torch = _framework(t)
        bits = t.view(getattr(torch, f"int{8 * dtype.itemsize}")).numpy()
        return np.array(bits, copy=True).view(dtype)


def _tensor_from_numpy(framework: Any, arr: np.ndarray) -> Any:
    a = np.array(arr, copy=True)  # writable and owned: from_numpy shares it
    if a.dtype.isbuiltin == 2:  # ml_dtypes: through the bits
        bits = framework.from_numpy(a.view(f"i{a.dtype.itemsize}"))
        return bits.view(getattr(framework, a.dtype.name))
    return framework.from_numpy(a)


def _tensor_spec(t: Any) -> tuple[tuple[int, ...], str]:
    return tuple(int(d) for d in t.shape), str(t.dtype).rpartition(".")[2]


# --------------------------------------------------------------------------- state dicts


def _encode(value: Any, key: str, arrays: dict[str, np.ndarray], where: str) -> JSONValue:
    """A state dict as JSON, its tensors and arrays moved to ``arrays`` under paths."""
    if _is_tensor(value):
        arrays[key] = _tensor_to_numpy(value)
        return {"__tensor__": key}
    if isinstance(value, (np.ndarray, np.generic)):
        arrays[key] = np.array(value, copy=True)
        return {"__array__": key}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, Mapping):
        items = [
            [_encode(k, "", {}, where), _encode(v, _join(key, k), arrays, where)]
            for k, v in value.items()
        ]
        doc: dict[str, JSONValue] = {"__dict__": list(items)}
        if isinstance(value, OrderedDict):
            doc["ordered"] = True
        meta = getattr(value, "_metadata", None)  # torch's per-module state-dict versions
        if isinstance(meta, Mapping):
            doc["_metadata"] = _encode(meta, "", {}, where)
        return doc
    if _is_namedtuple(value):
        raise TypeError(
            f"Checkpoint: {where} holds a namedtuple at {key!r}, which a state dict cannot "
            "round-trip; convert it to a tuple or dict"
        )
    if isinstance(value, (list, tuple)):
        kind = "__list__" if isinstance(value, list) else "__tuple__"
        return {kind: [_encode(v, _join(key, i), arrays, where) for i, v in enumerate(value)]}
    raise TypeError(
        f"Checkpoint: {where}'s state_dict() holds a {type(value).__qualname__} at {key!r} "
        f"({value!r:.60}), which a checkpoint cannot store: state dicts may hold tensors, "
        "NumPy arrays, None, bool, int, float, str, and dicts, lists and tuples of them"
    )


def _decode(doc: JSONValue, arrays: Mapping[str, np.ndarray], framework: Any) -> Any:
    if isinstance(doc, dict):
        if isinstance(arrays, _NoArrays) and ("__tensor__" in doc or "__array__" in doc):
            return None  # the structure only
        if "__tensor__" in doc:
            return _tensor_from_numpy(framework, arrays[str(doc["__tensor__"])])
        if "__array__" in doc:
            return np.array(arrays[str(doc["__array__"])], copy=True)
        if "__float__" in doc:
            return float(str(doc["__float__"]))
        if "__list__" in doc:
            return [_decode(v, arrays, framework) for v in _as_list(doc["__list__"])]
        if "__tuple__" in doc:
            return tuple(_decode(v, arrays, framework) for v in _as_list(doc["__tuple__"]))
        pairs = [
            (_decode(k, arrays, framework), _decode(v, arrays, framework))
            for k, v in (_as_list(p) for p in _as_list(doc["__dict__"]))
        ]
        out: dict[Any, Any] = OrderedDict(pairs) if doc.get("ordered") else dict(pairs)
        if "_metadata" in doc:
            out._metadata = _decode(doc["_metadata"], arrays, framework)  # type: ignore[attr-defined]
        return out
    return doc


def _as_list(x: JSONValue) -> list[JSONValue]:
    if not isinstance(x, list):
        raise CheckpointError(f"invalid state dict in the checkpoint's manifest: {x!r:.60}")
    return x


def _tensor_paths(doc: JSONValue, out: dict[str, None]) -> dict[str, None]:
    """The array keys a state dict's JSON refers to, in order."""
    if isinstance(doc, dict):
        for tag in ("__tensor__", "__array__"):
            if tag in doc:
                out[str(doc[tag])] = None
                return out
        for v in doc.values():
            _tensor_paths(v, out)
    elif isinstance(doc, list):
        for v in doc:
            _tensor_paths(v, out)
    return out


# --------------------------------------------------------------------------- nests (registered)


def _nest_leaves(nest: Any, path: str, out: list[tuple[str, Any]]) -> None:
    if nest is None:
        return
    if isinstance(nest, Mapping):
        for k, v in nest.items():
            _nest_leaves(v, _join(path, k), out)
    elif _is_namedtuple(nest):
        for f in nest._fields:
            _nest_leaves(getattr(nest, f), _join(path, f), out)
    elif isinstance(nest, (list, tuple)):
        for i, v in enumerate(nest):
            _nest_leaves(v, _join(path, i), out)
    elif (node := _pytree_node(nest)) is not None:
        for entry, child in zip(node.entries, node.children):
            _nest_leaves(child, _join(path, entry), out)
    else:
        out.append((path, nest))


def _nest_rebuild(nest: Any, path: str, values: Mapping[str, np.ndarray]) -> Any:
    if nest is None:
        return None
    if isinstance(nest, Mapping):
        return type(nest)((k, _nest_rebuild(v, _join(path, k), values)) for k, v in nest.items())  # type: ignore[call-arg]
    if _is_namedtuple(nest):
        return type(nest)(
            *(_nest_rebuild(getattr(nest, f), _join(path, f), values) for f in nest._fields)
        )
    if isinstance(nest, (list, tuple)):
        return type(nest)(_nest_rebuild(v, _join(path, i), values) for i, v in enumerate(nest))
    node = _pytree_node(nest)
    if node is not None:
        children = [
            _nest_rebuild(c, _join(path, e), values) for e, c in zip(node.entries, node.children)
        ]
        return node.unflatten_func(node.metadata, children)
    return values[path]


def _leaf_to_numpy(leaf: Any) -> np.ndarray:
    if isinstance(leaf, Variable):
        return _saved_value(leaf)
    if _is_tensor(leaf):
        return _tensor_to_numpy(leaf)
    return np.array(leaf, copy=True)


def _leaf_spec(leaf: Any) -> tuple[tuple[int, ...], str]:
    if isinstance(leaf, Variable):
        return tuple(leaf.shape), dtype_name(leaf.dtype)
    if _is_tensor(leaf):
        return _tensor_spec(leaf)
    a = np.asarray(leaf)
    return a.shape, dtype_name(a.dtype)


class _NoArrays(dict[str, np.ndarray]):
    """Decodes a state dict's structure without its arrays."""
