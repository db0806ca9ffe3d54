"""What the datasets of :mod:`polydist.data._dataset` do to one element: freeze it,
call a user function on it, conform it to a signature, stack and probe it, and the
small readers of file sources.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from polydist.data._nest import Nest, flatten, map_structure, to_array, unflatten
from polydist.data._spec import TensorSpec

FilePaths = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


class _SpecInferenceError(ValueError):
    """An element_spec cannot be inferred (an empty source without a signature)."""


def _frozen(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A read-only copy: dataset values are snapshots, like TF constants."""
    result = np.array(array, copy=True)
    result.setflags(write=False)
    return result


def _call(fn: Callable[..., Any], element: Nest) -> Any:
    # tf.data unpacks exactly `tuple` elements into positional arguments;
    # namedtuples and dicts are passed as one argument.
    return fn(*element) if type(element) is tuple else fn(element)


# Leaves whose conversion always builds a new array (nothing to alias).
_CONVERTED_AFRESH = (bool, int, float, complex, str, bytes, list, np.generic)


def _owned(leaf: object, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``array`` (``leaf`` converted), copied if it may be the producer's memory.

    A generator may refill one buffer before each yield; the element is held
    while the next is produced (batching, read-ahead), so it must not alias
    it. TF's conversion to a tensor copies likewise.
    """
    return array if isinstance(leaf, _CONVERTED_AFRESH) else array.copy()


def _to_owned_array(leaf: object) -> np.ndarray[Any, Any]:
    return _owned(leaf, to_array(leaf))


def _conform(value: Nest, signature: Nest | None, producer: str, *, copy: bool = True) -> Nest:
    """Convert a produced element, checking it against ``signature`` when given.

    ``copy``: the arrays may not alias the produced ones (see ``_owned``); False
    only for elements that exist before the pass (a list's), which no producer
    refills.
    """
    if signature is None:
        return map_structure(_to_owned_array if copy else to_array, value)
    spec_leaves, spec_tree = flatten(signature)
    try:
        leaves = spec_tree.flatten_up_to(value)
    except (ValueError, TypeError) as error:
        raise TypeError(
            f"{producer} yielded an element that did not match the expected structure. "
            f"The expected structure was {signature!r}, but the yielded element was {value!r}."
        ) from error
    arrays = []
    for spec, leaf in zip(spec_leaves, leaves):
        array = to_array(leaf)
        if spec.dtype.kind in "US":  # strings: any length of the same kind
            convertible = array.dtype.kind == spec.dtype.kind
        else:
            convertible = array.dtype.kind not in "US" and np.can_cast(
                array.dtype, spec.dtype, casting="same_kind"
            )
        if not convertible:
            raise TypeError(
                f"{producer} yielded an element that could not be converted to the expected "
                f"type. The expected type was {spec.dtype}, but the yielded element was "
                f"{leaf!r} of dtype {array.dtype}."
            )
        if spec.dtype.kind not in "US":
            cast = array.astype(spec.dtype, copy=False)
            array = _owned(leaf, cast) if copy and cast is array else cast
        elif copy:
            array = _owned(leaf, array)
        if not spec.is_compatible_with(TensorSpec(array.shape, spec.dtype)):
            raise ValueError(
                f"{producer} yielded an element of shape {array.shape} where an element of "
                f"shape {spec.shape} was expected."
            )
        arrays.append(array)
    return unflatten(spec_tree, arrays)


def _check_signature(signature: Nest) -> Nest:
    leaves, _ = flatten(signature)
    for leaf in leaves:
        if not isinstance(leaf, TensorSpec):
            raise TypeError(
                "output_signature must be a nest of polydist.data.TensorSpec, "
                f"found {leaf!r}; e.g. TensorSpec(shape=(None,), dtype=np.int64)."
            )
    return signature


def _check_batched(leaves: list[np.ndarray[Any, Any]]) -> int:
    """Leading size shared by all components (TF's unbatch/rebatch input checks)."""
    for leaf in leaves:
        if leaf.ndim == 0:
            raise ValueError("Input element must have a non-scalar value in each component.")
    for i, leaf in enumerate(leaves):
        if leaf.shape[0] != leaves[0].shape[0]:
            raise ValueError(
                "Input element must have the same batch size in each component. "
                f"Component 0 had size {leaves[0].shape[0]} but component {i} had size, "
                f"{leaf.shape[0]}."
            )
    return int(leaves[0].shape[0]) if leaves else 0


def _stack(elements: list[Nest]) -> Nest:
    flat = [flatten(element) for element in elements]
    treespec = flat[0][1]
    components = []
    for i in builtins.range(len(flat[0][0])):
        parts = [leaves[i] for leaves, _ in flat]
        for j, part in enumerate(parts):
            if part.shape != parts[0].shape:
                raise ValueError(
                    f"Cannot batch tensors with different shapes in component {i}. First "
                    f"element had shape {parts[0].shape} and element {j} had shape "
                    f"{part.shape}; map() the elements to one shape before batching."
                )
        components.append(np.stack(parts))
    return unflatten(treespec, components)


def _probe(spec: Nest, fill: int, unknown_size: int) -> Nest:
    """A synthetic element matching ``spec`` (unknown dims get ``unknown_size``)."""

    def make(leaf: TensorSpec) -> np.ndarray[Any, Any]:
        shape = tuple(unknown_size if d is None else d for d in leaf.shape)
        return np.full(shape, fill).astype(leaf.dtype)

    return map_structure(make, spec)


def _filename_tuple(filenames: FilePaths) -> tuple[str, ...]:
    if isinstance(filenames, str | os.PathLike):
        return (os.fspath(filenames),)
    return tuple(os.fspath(name) for name in filenames)


def _read_lines(filename: str) -> Iterator[str]:
    # TF's TextLineDataset splits on "\n" and drops one trailing "\r".
    with open(filename, "rb") as handle:
        data = handle.read()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for line in lines:
        yield line.removesuffix(b"\r").decode("utf-8")


def _as_bool(value: object) -> bool:
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype == np.bool_:
        return bool(value)
    raise ValueError(
        f"Invalid `predicate`. `predicate` must return a scalar boolean, but it returned {value!r}."
    )
