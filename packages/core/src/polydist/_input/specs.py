"""What a distributed input hands out besides values: ``PerReplicaSpec`` (the
``element_spec`` of a per-replica value), ``Optional`` (``get_next_as_optional``) and
the warning about a partial batch under a MEAN reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from polydist._base.arrays import dtype_name
from polydist._valuetypes.values import DistributedValues
from polydist.data._spec import TensorSpec
from polydist.errors import InvalidArgumentError

if TYPE_CHECKING:
    pass


_END: Final = object()


class PartialBatchWarning(UserWarning):
    """``strategy.reduce(MEAN, value, axis=None)`` averaged a NaN from an empty batch.

    When the data run out unevenly, some replicas get an empty batch in the
    last step (TF's partial-batch rule), and the mean over an empty batch is
    NaN. Averaging per-replica means with ``axis=None`` then gives NaN (as in
    TF, silently); polydist keeps the NaN and warns. Reduce per-example values
    with ``axis=0`` instead, which divides by the true number of examples.
    """


class PerReplicaSpec:
    """The spec of a ``PerReplica``: one ``TensorSpec`` per replica (TF's ``PerReplicaSpec``)."""

    __slots__ = ("_value_specs",)

    def __init__(self, *value_specs: TensorSpec) -> None:
        if not value_specs:
            raise ValueError("PerReplicaSpec needs at least one value spec, got none.")
        self._value_specs: tuple[TensorSpec, ...] = tuple(value_specs)

    @property
    def value_specs(self) -> tuple[TensorSpec, ...]:
        """The spec of each replica's component, in replica order."""
        return self._value_specs

    @property
    def num_replicas(self) -> int:
        return len(self._value_specs)

    def is_compatible_with(self, value: Any) -> bool:
        """True if ``value`` (a ``PerReplica`` or a ``PerReplicaSpec``) fits this spec."""
        if isinstance(value, PerReplicaSpec):
            others = value.value_specs
        elif isinstance(value, DistributedValues):
            others = tuple(_spec_of_array(v) for v in value.values)
        else:
            return False
        return len(others) == len(self._value_specs) and all(
            mine.is_compatible_with(other) for mine, other in zip(self._value_specs, others)
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PerReplicaSpec):
            return NotImplemented
        return self._value_specs == other._value_specs

    def __hash__(self) -> int:
        return hash(self._value_specs)

    def __repr__(self) -> str:
        return f"PerReplicaSpec({', '.join(map(repr, self._value_specs))})"


def _spec_of_array(value: Any) -> TensorSpec:
    shape = tuple(None if d is None else int(d) for d in value.shape)
    try:
        dtype = np.dtype(dtype_name(value.dtype))
    except TypeError:  # e.g. bfloat16 has no NumPy dtype: it matches no TensorSpec
        dtype = np.dtype(np.void)
    return TensorSpec(shape, dtype)


class Optional:
    """A value that may be absent, as ``tf.experimental.Optional``.

    Returned by ``DistributedIterator.get_next_as_optional()``: empty at the
    end of the data instead of raising.
    """

    __slots__ = ("_element_spec", "_value")

    def __init__(self, value: Any, element_spec: Callable[[], Any]) -> None:
        self._value = value
        self._element_spec = element_spec

    def has_value(self) -> bool:
        """True if this optional holds a value."""
        return self._value is not _END

    def get_value(self) -> Any:
        """The value; ``InvalidArgumentError`` if there is none."""
        if self._value is _END:
            raise InvalidArgumentError(
                "The Optional does not have a value: the iterator reached the end of the data. "
                "Check optional.has_value() before calling get_value()."
            )
        return self._value

    @property
    def element_spec(self) -> Any:
        """The spec of the value this optional holds (or would hold)."""
        return self._element_spec()

    def __repr__(self) -> str:
        return f"Optional(has_value={self.has_value()})"
