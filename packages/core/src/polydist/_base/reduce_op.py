"""``ReduceOp``: how values from several replicas are combined."""

from __future__ import annotations

import enum

__all__ = ["ReduceOp"]


class ReduceOp(enum.Enum):
    """Indicates how a set of values should be reduced.

    * ``SUM``: add all the values.
    * ``MEAN``: take the arithmetic mean ("average") of the values. Integer
      inputs give a float64 mean, as in TF.

    Like TF, only these two exist; strings are accepted case-insensitively.
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @staticmethod
    def from_variable_aggregation(aggregation: object) -> ReduceOp:
        """Maps a ``VariableAggregation`` (SUM or MEAN) to a ``ReduceOp``."""
        name = getattr(aggregation, "name", aggregation)
        if name in ("SUM", "MEAN"):
            return ReduceOp(name)
        raise ValueError(
            f"Could not convert from VariableAggregation {aggregation!r} to ReduceOp: "
            "only SUM and MEAN have a ReduceOp equivalent."
        )


def as_reduce_op(reduce_op: ReduceOp | str) -> ReduceOp:
    """Normalises ``reduce_op`` the way TF does: strings are upper-cased."""
    if isinstance(reduce_op, ReduceOp):
        return reduce_op
    if isinstance(reduce_op, str):
        try:
            return _BY_NAME[reduce_op.upper()]
        except KeyError:
            raise ValueError(
                f"{reduce_op!r} is not a valid ReduceOp: expected 'SUM' or 'MEAN' "
                "(any case) or polydist.ReduceOp.SUM / ReduceOp.MEAN."
            ) from None
    raise ValueError(
        f"reduce_op must be a polydist.ReduceOp or a string, got {type(reduce_op).__name__} "
        f"{reduce_op!r}. Pass ReduceOp.SUM or ReduceOp.MEAN."
    )


_BY_NAME = {op.value: op for op in ReduceOp}
