"""Turning a program's result into host data, and comparing two of them.

A program returns a nest (lists, tuples, namedtuples, dicts) of backend
arrays, distributed values and plain Python values. :func:`observe` turns it
into the same nest with NumPy arrays (through the backend's ``to_numpy``) and
:class:`Distributed` records in place of distributed values, keeping every
type that matters: the container types, ``PerReplica`` versus ``Mirrored``
versus a bare array, the dtypes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

import polydist as pd
from polydist.backend.arrays import is_array
from polydist_conformance.tolerance import Reduction, _finfo, within_bound

__all__ = ["Distributed", "Leaf", "Reduced", "compare", "observe", "plain", "reduced"]

_PYTHON_VALUES = (bool, int, float, complex, str, bytes, type(None))


class Reduced:
    """A program result marked with the :class:`Reduction` that produced it."""

    __slots__ = ("reduction", "value")

    def __init__(self, value: Any, reduction: Reduction) -> None:
        self.value = value
        self.reduction = reduction


def reduced(value: Any, reduction: Reduction) -> Reduced:
    """Marks a program's result (a nest, a distributed value or an array) as a sum.

    Its float leaves are then compared with the error bound of ``reduction``
    where the backend cannot reproduce the oracle's order bit for bit (see
    :mod:`polydist_conformance.tolerance`). Use it inside the program::

        red = Reduction.across_replicas(inputs)
        def program(strategy, xp):
            ...
            return reduced(strategy.reduce("SUM", values, axis=None), red)
    """
    return Reduced(value, reduction)


@dataclass(frozen=True)
class Distributed:
    """A distributed value in an observed result: its class name and components.

    A ``polydist.Variable`` is recorded the same way: its class name
    (``"MirroredVariable"``, ``"SyncOnReadVariable"``, ``"Variable"``) and the value
    of each copy. An expected result may use these records too.
    """

    kind: str
    values: tuple[Any, ...]


@dataclass(frozen=True, eq=False)
class Leaf:
    """An array in an observed result, with the reduction that produced it, if marked."""

    array: npt.NDArray[Any]
    reduction: Reduction | None = None


def observe(
    value: Any, to_numpy: Callable[[Any], npt.NDArray[Any]], reduction: Reduction | None = None
) -> Any:
    """The host-side record of a program's result (see the module docs)."""
    if isinstance(value, Reduced):
        return observe(value.value, to_numpy, value.reduction)
    if isinstance(value, Distributed):  # a documented result spelled as a record
        return Distributed(value.kind, tuple(observe(v, to_numpy, reduction) for v in value.values))
    if isinstance(value, pd.Variable):
        # A variable is recorded as its class and the value of each copy (a plain
        # variable has one), read from storage whatever the context.
        parts = value.values if isinstance(value, pd.DistributedValues) else (value,)
        return Distributed(
            type(value).__name__, tuple(observe(c.value(), to_numpy, reduction) for c in parts)
        )
    if isinstance(value, pd.DistributedValues):
        return Distributed(
            type(value).__name__, tuple(observe(v, to_numpy, reduction) for v in value.values)
        )
    if isinstance(value, np.generic):
        # NumPy returns scalars where other libraries return 0-d arrays: same thing.
        # (Checked first: np.float64 is also a Python float.)
        return Leaf(np.asarray(value), reduction)
    if isinstance(value, _PYTHON_VALUES):
        return value
    if is_array(value):
        return Leaf(np.asarray(to_numpy(value)), reduction)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(observe(v, to_numpy, reduction) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(observe(v, to_numpy, reduction) for v in value)
    if isinstance(value, Mapping):
        items = {k: observe(v, to_numpy, reduction) for k, v in value.items()}
        return items if type(value) is dict else type(value)(items)  # type: ignore[call-arg]
    raise TypeError(
        f"A conformance program returned a {type(value).__name__} ({value!r}). Programs must "
        "return arrays, distributed values, Python numbers/strings/None, or lists, tuples, "
        "namedtuples and dicts of them; turn other objects into such values first (e.g. "
        "`ctx.strategy is strategy`)."
    )


def plain(observed: Any) -> Any:
    """An observed result with :class:`Leaf` records replaced by their NumPy arrays."""
    if isinstance(observed, Leaf):
        return observed.array
    if isinstance(observed, Distributed):
        return Distributed(observed.kind, tuple(plain(v) for v in observed.values))
    if isinstance(observed, tuple) and hasattr(observed, "_fields"):
        return type(observed)(*(plain(v) for v in observed))
    if isinstance(observed, list | tuple):
        return type(observed)(plain(v) for v in observed)
    if isinstance(observed, Mapping):
        return {k: plain(v) for k, v in observed.items()}
    return observed


@dataclass(frozen=True)
class Policy:
    """How marked sums are compared.

    Attributes:
        bitwise_sums: the backend reproduces the reference's cross-replica
            summation order, so sums without a local part must match bit for bit
            (NumPy's floats only: see :meth:`bound_for`).
        reference_exact: the reference's cross-replica sums are correctly rounded.
        reference_name: what the reference is called in messages.
    """

    bitwise_sums: bool
    reference_exact: bool
    reference_name: str = "oracle"

    def bound_for(self, reduction: Reduction, dtype: Any = None) -> bool | None:
        """``None``: compare bitwise; else compare within the bound, with ``oracle_exact``.

        A declared order is no bitwise claim for extension floats (``dtype``
        bfloat16, float8_*): the sim adds them in the dtype, while runtimes
        add them in a wider type (XLA:CPU's psum does), so they always get
        the bound.
        """
        if self.bitwise_sums and not reduction.local_sum and not _is_extension_float(dtype):
            return None
        return self.reference_exact and not reduction.local_sum


#: Comparing with a documented result: expected values are exact answers.
EXPECTED = Policy(bitwise_sums=False, reference_exact=True, reference_name="documented result")


def compare(actual: Any, reference: Any, policy: Policy, path: str = "result") -> list[str]:
    """Differences between two observed results, one message per difference."""
    errors: list[str] = []
    _compare(actual, reference, policy, path, errors)
    return errors


def _type_name(x: Any) -> str:
    if isinstance(x, Leaf):
        return f"array {_describe(x.array)}"
    if isinstance(x, Distributed):
        return f"{x.kind} of {len(x.values)}"
    return type(x).__qualname__


def _describe(a: npt.NDArray[Any]) -> str:
    return f"{a.dtype}{list(a.shape)}"


def _compare(a: Any, b: Any, policy: Policy, path: str, errors: list[str]) -> None:
    ref = policy.reference_name
    if isinstance(a, Leaf) and isinstance(b, Leaf):
        _compare_leaves(a, b, policy, path, errors)
        return
    if isinstance(a, Distributed) and isinstance(b, Distributed):
        if a.kind != b.kind or len(a.values) != len(b.values):
            errors.append(f"{path}: backend gave {_type_name(a)}, {ref} gave {_type_name(b)}")
            return
        for i, (x, y) in enumerate(zip(a.values, b.values)):
            _compare(x, y, policy, f"{path}.values[{i}]", errors)
        return
    if type(a) is not type(b) or isinstance(a, Leaf | Distributed):
        errors.append(
            f"{path}: backend gave {_type_name(a)} {_short(a)}, {ref} gave {_type_name(b)} "
            f"{_short(b)}"
        )
        return
    if isinstance(a, Mapping):
        if list(a.keys()) != list(b.keys()):
            errors.append(f"{path}: backend keys {list(a.keys())}, {ref} keys {list(b.keys())}")
            return
        for k in a:
            _compare(a[k], b[k], policy, f"{path}[{k!r}]", errors)
        return
    if isinstance(a, list | tuple):
        if len(a) != len(b):
            errors.append(
                f"{path}: backend gave a {type(a).__name__} of length {len(a)}, {ref} one of "
                f"length {len(b)}"
            )
            return
        for i, (x, y) in enumerate(zip(a, b)):
            _compare(x, y, policy, f"{path}[{i}]", errors)
        return
    if not _same_python_value(a, b):
        errors.append(f"{path}: backend gave {a!r}, {ref} gave {b!r}")


def _same_python_value(a: Any, b: Any) -> bool:
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
        )
    return bool(a == b)


def _short(x: Any) -> str:
    if isinstance(x, Leaf):
        return np.array2string(x.array, threshold=20)
    if isinstance(x, Distributed):
        return (
            "{"
            + ", ".join(_short(v) for v in x.values[:4])
            + ("...}" if len(x.values) > 4 else "}")
        )
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def _compare_leaves(a: Leaf, b: Leaf, policy: Policy, path: str, errors: list[str]) -> None:
    ref = policy.reference_name
    x, y = a.array, b.array
    if x.shape != y.shape or x.dtype != y.dtype:
        errors.append(f"{path}: backend gave {_describe(x)}, {ref} gave {_describe(y)}")
        return
    reduction = a.reduction or b.reduction
    oracle_exact = None
    if reduction is not None and is_float_dtype(x.dtype):
        oracle_exact = policy.bound_for(reduction, x.dtype)
    if oracle_exact is None:
        if not bitwise_equal(x, y):
            how = "exactly" if x.dtype.kind in "biuSU" else "bit for bit"
            errors.append(
                f"{path}: backend gave {_short(a)}, {ref} gave {_short(b)} "
                f"({_describe(x)}; must match {how})"
            )
        return
    assert reduction is not None
    ok = within_bound(x, y, reduction, oracle_exact=oracle_exact)
    if not ok.all():
        bad = tuple(int(i) for i in np.argwhere(~ok)[0])
        kind = "mean" if reduction.divisor is not None else "sum"
        errors.append(
            f"{path}: backend gave {_short(a)}, {ref} gave {_short(b)}; at index {bad} the "
            f"difference {abs(float(x[bad]) - float(y[bad])):.3g} exceeds the error bound of a "
            f"{x.dtype} {kind} of {reduction.terms} terms with sum|x| = "
            f"{float(np.broadcast_to(reduction.abs_sum, x.shape)[bad]):.6g} "
            "(see polydist_conformance.tolerance)"
        )


def is_float_dtype(dtype: np.dtype[Any]) -> bool:
    """Real floating point, including extension floats such as ml_dtypes' bfloat16."""
    if dtype.kind == "f":
        return True
    if dtype.kind != "V":
        return False
    try:
        _finfo(dtype)
    except (TypeError, ValueError, ImportError):
        return False
    return True


def _is_extension_float(dtype: Any) -> bool:
    """A float dtype that NumPy does not define (ml_dtypes' bfloat16, float8_*)."""
    if dtype is None:
        return False
    dtype = np.dtype(dtype)
    # float8_e5m2 has kind "f" too: only NumPy's own dtypes are builtin.
    return dtype.isbuiltin != 1 and is_float_dtype(dtype)


def bitwise_equal(x: npt.NDArray[Any], y: npt.NDArray[Any]) -> bool:
    """Same shape, dtype and bits; NaNs match NaNs whatever their payload and sign."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if np.issubdtype(x.dtype, np.complexfloating):
        return bitwise_equal(x.real.copy(), y.real.copy()) and bitwise_equal(
            x.imag.copy(), y.imag.copy()
        )
    if is_float_dtype(x.dtype):
        nan_x, nan_y = np.isnan(x), np.isnan(y)
        if not np.array_equal(nan_x, nan_y):
            return False
        same = (x == y) & (np.signbit(x) == np.signbit(y))
        return bool(np.all(same | nan_x))
    return bool(np.array_equal(x, y))
