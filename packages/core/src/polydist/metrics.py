"""Metrics: Keras's ``keras.metrics`` API on sync-on-read variables.

``Mean``, ``Sum``, ``Accuracy``, ``BinaryAccuracy``, ``CategoricalAccuracy`` and
``SparseCategoricalAccuracy`` compute what Keras 3 (the ``tf.keras`` of TF 2.21)
computes for the same inputs: the same ``sample_weight`` rules
(``reduce_to_samplewise_values``), float32 by default, ``argmax`` ties to the
first index, and ``result()`` of an empty metric 0 (``divide_no_nan``), not NaN.

State lives in variables created with ``synchronization=ON_READ`` and
``aggregation=SUM`` (``total``, and ``count`` for the means), as Keras creates
them. So a metric created under ``strategy.scope()`` works as a tf.distribute
metric does::

    with strategy.scope():
        accuracy = pd.metrics.SparseCategoricalAccuracy()

    def step(x, y):
        accuracy.update_state(y, model(x))  # each replica adds to its own copy

    strategy.run(step, args=(x, y))
    accuracy.result()  # cross-replica context: the SUM of the copies, then total / count

Inside ``strategy.run`` (replica context) each replica updates its own copies,
compiled or eager; ``result()`` there reads the replica's own copies. In
cross-replica context ``result()`` reads the aggregated value (a collective
when the replicas live in several processes: call it on every worker).

Two differences from TF, both where TF gives no usable result:

* ``update_state`` in cross-replica context (outside ``strategy.run``, in or out
  of ``strategy.scope()``) adds the update once, to replica 0's copy, so
  ``result()`` equals a single-device metric's. TF raises ``ValueError`` there
  (``assign_add`` of a SUM sync-on-read variable in cross-replica context). Where
  this process holds only some of the replicas (a worker of a multi-process
  ``MultiWorkerMirroredStrategy``), it raises ``ValueError`` as TF does: each worker
  might pass different values, and adding them once could not be checked.
* An update whose batch is empty (a zero-size first dimension, as a replica gets
  from a partial last batch) adds nothing. Keras adds NaN to the total where
  its per-sample reduction averages an empty axis (``Accuracy`` of 1-D labels,
  or a scalar ``sample_weight``), and the NaN would then spread to the result.

A metric's variables (``metric.variables``) go into checkpoints like any other
variables: a sync-on-read SUM variable saves its aggregated value, and restoring
it into another replica count keeps the total.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from polydist._base.arrays import convert_to_array, dtype_name, is_array
from polydist._strategies import context as _context
from polydist._valuetypes.values import DistributedValues
from polydist._valuetypes.variables import (
    SyncOnReadVariable,
    Variable,
    VariableAggregation,
    VariableSynchronization,
)
from polydist.backend._contract import Backend, backends_owning, get_backend_for_value, is_symbolic

__all__ = [
    "Accuracy",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "Mean",
    "MeanMetricWrapper",
    "Metric",
    "SparseCategoricalAccuracy",
    "Sum",
    "accuracy",
    "binary_accuracy",
    "categorical_accuracy",
    "sparse_categorical_accuracy",
]

#: Keras's ``backend.floatx()``.
FLOATX = "float32"

_AGGREGATIONS = {
    "sum": VariableAggregation.SUM,
    "mean": VariableAggregation.MEAN,
    "only_first_replica": VariableAggregation.ONLY_FIRST_REPLICA,
}


def _snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _dtype_text(dtype: Any) -> str:
    """A dtype argument by name: ``"float32"``, ``np.float32``, ``np.dtype``, torch's or JAX's."""
    if isinstance(dtype, type) and issubclass(dtype, np.generic):
        return np.dtype(dtype).name
    return dtype_name(dtype)


def _xp_of(variable: Variable) -> Any:
    return variable._backend.array_namespace()


def _as_array(xp: Any, value: Any, what: str, backend: Backend | None = None) -> Any:
    """``value`` as an array ``xp`` computes with (Python numbers follow TF's dtypes).

    With ``backend`` (the metric's), an array of another backend's type (a
    ``torch.Tensor`` given to a metric on the sim) goes through host NumPy.
    """
    if isinstance(value, Variable):
        value = value.value()
    if isinstance(value, DistributedValues):
        raise TypeError(
            f"{what} is a {type(value).__name__} (one value per replica). Update a metric "
            "with per-replica values inside strategy.run, where each replica passes its own "
            "(strategy.run(lambda y, p: metric.update_state(y, p), args=(y, p))), or pass "
            "host values in cross-replica context."
        )
    if is_array(value) and not isinstance(value, np.ndarray):
        owners = backends_owning(value)
        if backend is None or not owners or backend.name in owners:
            return value
        owner = get_backend_for_value(value)
        if is_symbolic(owner, value):
            raise TypeError(
                f"{what} is a value of a compiled {owner.name!r} program, but the metric's "
                f"variables are on backend {backend.name!r}: the metric was created outside "
                "the strategy's scope. Create it under strategy.scope(), so that each replica "
                "updates its own copy."
            )
        value = np.asarray(owner.to_numpy(value))
    return xp.asarray(convert_to_array(value))


def _reduce_axes(xp: Any, reduce_fn: Callable[..., Any], x: Any, start: int, stop: int) -> Any:
    return reduce_fn(x, axis=tuple(range(start, stop)))


def _squeeze_or_expand(xp: Any, x1: Any, x2: Any, expand_rank_1: bool = True) -> tuple[Any, Any]:
    """Keras's ``squeeze_or_expand_to_same_rank``: fixes a last dimension of 1."""
    r1, r2 = len(x1.shape), len(x2.shape)
    if r1 == r2:
        return x1, x2
    if r1 == r2 + 1 and x1.shape[-1] == 1:
        if r2 == 1 and expand_rank_1:
            x2 = xp.expand_dims(x2, axis=-1)
        else:
            x1 = xp.squeeze(x1, axis=-1)
    if r2 == r1 + 1 and x2.shape[-1] == 1:
        if r1 == 1 and expand_rank_1:
            x1 = xp.expand_dims(x1, axis=-1)
        else:
            x2 = xp.squeeze(x2, axis=-1)
    return x1, x2


def _is_empty_batch(x: Any) -> bool:
    return len(x.shape) >= 1 and int(x.shape[0]) == 0


def _samplewise(
    xp: Any,
    values: Any,
    sample_weight: Any,
    reduce_fn: Callable[..., Any],
    dtype: Any,
    backend: Backend,
) -> tuple[Any, Any]:
    """Keras's ``reduce_to_samplewise_values``: one value per sample, weighted.

    Returns the weighted values (rank 1, or 0 for a scalar) and the weights
    reduced the same way (``None`` without ``sample_weight``).
    """
    values = xp.astype(values, dtype)
    if sample_weight is not None:
        weights = xp.astype(_as_array(xp, sample_weight, "sample_weight", backend), dtype)
        values, weights = _squeeze_or_expand(xp, values, weights)
        weight_ndim, values_ndim = len(weights.shape), len(values.shape)
        if values_ndim > weight_ndim:
            values = _reduce_axes(xp, reduce_fn, values, weight_ndim, values_ndim)
        weights = xp.broadcast_to(weights, tuple(values.shape))
        values = values * weights
        if weight_ndim > 1:
            weights = _reduce_axes(xp, reduce_fn, weights, 1, weight_ndim)
        sample_weight = weights
    if len(values.shape) > 1:
        values = _reduce_axes(xp, reduce_fn, values, 1, len(values.shape))
    return values, sample_weight


def _div_no_nan(xp: Any, total: Any, count: Any) -> Any:
    zero = count == 0
    safe = xp.where(zero, xp.ones_like(count), count)
    return xp.where(zero, xp.zeros_like(total), total / safe)


def _accumulate(variable: Variable, delta: Any) -> None:
    """``variable.assign_add(delta)``, where a SUM sync-on-read variable in
    cross-replica context takes the whole update into replica 0's copy (see the
    module docstring: TF raises there)."""
    if not (
        isinstance(variable, SyncOnReadVariable)
        and variable._replica_in_context() is None
        and variable.aggregation is VariableAggregation.SUM
    ):
        variable.assign_add(delta, read_value=False)
        return
    strategy = variable.distribute_strategy
    assert strategy is not None
    if len(variable.values) != strategy.num_replicas_in_sync:
        raise ValueError(
            f"Cannot update metric variable {variable.name!r} in cross-replica context: this "
            f"process holds {len(variable.values)} of the {strategy.num_replicas_in_sync} "
            "replicas' copies, and every worker runs this line, perhaps with different "
            "values (TF raises here too). Update the metric inside strategy.run, where each "
            "replica adds its own part of the batch."
        )
    variable.values[0].assign_add(delta, read_value=False)


# -- the metric base class ----------------------------------------------------------------------


class Metric:
    """The base class of metrics: Keras's ``keras.metrics.Metric``.

    A subclass creates its state in ``__init__`` with `add_variable` and
    implements ``update_state(*args, **kwargs)`` and ``result()``.

    Args:
        name: the metric's name (default: the class name in snake case). Its
            variables are named ``"<name>/<variable name>"``.
        dtype: the dtype of the state and of ``result()``: a name such as
            ``"float32"`` (the default, Keras's ``floatx``), a NumPy dtype, or the
            backend's dtype.
    """

    def __init__(self, name: str | None = None, dtype: Any = None) -> None:
        if name is not None and not isinstance(name, str):
            raise TypeError(f"Metric name must be a str or None, got {type(name).__name__}.")
        self.name: str = name or _snake_case(type(self).__name__)
        self._dtype = FLOATX if dtype is None else _dtype_text(dtype)
        self._variables: list[Variable] = []

    @property
    def dtype(self) -> str:
        """The dtype of the metric's state and result, by name (e.g. ``"float32"``)."""
        return self._dtype

    @property
    def variables(self) -> list[Variable]:
        """The metric's variables, in creation order (e.g. ``[total, count]``): what a
        checkpoint saves to hold the metric."""
        return list(self._variables)

    def add_variable(
        self,
        shape: Sequence[int] = (),
        initializer: str | Callable[..., Any] = "zeros",
        dtype: Any = None,
        aggregation: str | VariableAggregation = "sum",
        name: str | None = None,
    ) -> Variable:
        """Creates a state variable: ``synchronization=ON_READ``, not trainable.

        Under a strategy's scope it is a ``SyncOnReadVariable`` (one copy per
        replica), as Keras creates metric variables; outside any scope a plain
        variable.

        Args:
            shape: the variable's shape.
            initializer: ``"zeros"``, ``"ones"``, or ``fn(shape, dtype)`` returning
                the initial value.
            dtype: default: the metric's dtype.
            aggregation: how reads in cross-replica context combine the copies:
                ``"sum"`` (default), ``"mean"``, ``"only_first_replica"``, or a
                ``polydist.VariableAggregation``.
            name: the variable's name within the metric.
        """
        dtype_ = self._dtype if dtype is None else _dtype_text(dtype)
        shape_ = tuple(int(d) for d in shape)
        if isinstance(aggregation, str):
            if aggregation not in _AGGREGATIONS:
                raise ValueError(
                    f"Invalid aggregation {aggregation!r} for metric variable {name!r}: "
                    f"expected one of {', '.join(map(repr, _AGGREGATIONS))}, or a "
                    "polydist.VariableAggregation."
                )
            aggregation = _AGGREGATIONS[aggregation]
        if initializer == "zeros":
            initial: Any = np.zeros(shape_, dtype=np.float32)
        elif initializer == "ones":
            initial = np.ones(shape_, dtype=np.float32)
        elif callable(initializer):
            initial = initializer(shape_, dtype_)
        else:
            raise ValueError(
                f"Invalid initializer {initializer!r} for metric variable {name!r}: expected "
                "'zeros', 'ones', or a function (shape, dtype) -> initial value."
            )
        variable = Variable(
            initial,
            trainable=False,
            name=f"{self.name}/{name or 'variable'}",
            dtype=dtype_,
            synchronization=VariableSynchronization.ON_READ,
            aggregation=aggregation,
        )
        self._variables.append(variable)
        return variable

    def add_weight(
        self,
        shape: Sequence[int] = (),
        initializer: str | Callable[..., Any] = "zeros",
        dtype: Any = None,
        name: str | None = None,
    ) -> Variable:
        """Keras's alias of `add_variable`."""
        return self.add_variable(shape=shape, initializer=initializer, dtype=dtype, name=name)

    def update_state(self, *args: Any, **kwargs: Any) -> None:
        """Accumulates statistics (each subclass defines its arguments)."""
        raise NotImplementedError(f"{type(self).__name__} must implement update_state().")

    def result(self) -> Any:
        """The metric's current value, from its variables."""
        raise NotImplementedError(f"{type(self).__name__} must implement result().")

    def reset_state(self) -> None:
        """Sets every variable to zeros (every replica's copy, in cross-replica context)."""
        for variable in self._variables:
            xp = _xp_of(variable)
            variable.assign(xp.zeros(variable.shape, dtype=variable.dtype), read_value=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``update_state(*args, **kwargs)``, then ``result()``."""
        self.update_state(*args, **kwargs)
        return self.result()

    def get_config(self) -> dict[str, Any]:
        """The arguments that recreate this metric (without its state)."""
        return {"name": self.name, "dtype": self.dtype}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Metric:
        """A new metric from `get_config`'s dict."""
        return cls(**config)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name}>"


# -- reductions ----------------------------------------------------------------------------------


class Sum(Metric):
    """The (weighted) sum of the values: Keras's ``keras.metrics.Sum``.

    ``update_state([1, 3, 5, 7])`` gives 16; with ``sample_weight=[1, 1, 0, 0]``, 4.
    One variable: ``total``.
    """

    def __init__(self, name: str = "sum", dtype: Any = None) -> None:
        super().__init__(name=name, dtype=dtype)
        self.total = self.add_variable(name="total")

    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        """Adds ``sum(values * sample_weight)`` to the total."""
        xp = _xp_of(self.total)
        dtype = self.total.dtype
        values = _as_array(xp, values, "values", self.total._backend)
        if _is_empty_batch(values):
            _accumulate(self.total, xp.zeros((), dtype=dtype))
            return
        values, _ = _samplewise(xp, values, sample_weight, xp.sum, dtype, self.total._backend)
        _accumulate(self.total, xp.sum(values))

    def result(self) -> Any:
        return self.total.read_value()


class Mean(Metric):
    """The (weighted) mean of the values: Keras's ``keras.metrics.Mean``.

    ``update_state([1, 3, 5, 7])`` gives 4; with ``sample_weight=[1, 1, 0, 0]``, 2.
    Two variables, ``total`` and ``count``; ``result()`` is ``total / count``, 0
    while ``count`` is 0.
    """

    def __init__(self, name: str = "mean", dtype: Any = None) -> None:
        super().__init__(name=name, dtype=dtype)
        self.total = self.add_variable(name="total")
        self.count = self.add_variable(name="count")

    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        """Adds the weighted per-sample values to ``total`` and their weights (or the
        number of samples) to ``count``."""
        xp = _xp_of(self.total)
        values = _as_array(xp, values, "values", self.total._backend)
        self._add_samplewise(xp, values, sample_weight, empty=_is_empty_batch(values))

    def _add_samplewise(self, xp: Any, values: Any, sample_weight: Any, *, empty: bool) -> None:
        dtype = self.total.dtype
        if empty:
            zero = xp.zeros((), dtype=dtype)
            _accumulate(self.total, zero)
            _accumulate(self.count, zero)
            return
        backend = self.total._backend
        values, weights = _samplewise(xp, values, sample_weight, xp.mean, dtype, backend)
        if weights is not None:
            count = xp.sum(weights)
        else:
            count = xp.asarray(int(values.shape[0]) if len(values.shape) >= 1 else 1, dtype=dtype)
        _accumulate(self.total, xp.sum(values))
        _accumulate(self.count, xp.astype(xp.asarray(count), dtype))

    def result(self) -> Any:
        xp = _xp_of(self.total)
        return _div_no_nan(xp, xp.asarray(self.total.value()), xp.asarray(self.count.value()))


class MeanMetricWrapper(Mean):
    """The mean of ``fn(y_true, y_pred, **kwargs)`` over the samples seen: Keras's
    ``keras.metrics.MeanMetricWrapper``.

    ``fn`` takes the backend's arrays and returns one value per sample (or per
    element: the non-batch dimensions are averaged).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str | None = None,
        dtype: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(name=name or _snake_case(getattr(fn, "__name__", "mean")), dtype=dtype)
        self._fn = fn
        self._fn_kwargs = kwargs

    # Keras's signature: (y_true, y_pred) where Mean takes (values).
    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:  # type: ignore[override]
        """Adds ``fn(y_true, y_pred)`` per sample, weighted by ``sample_weight``."""
        xp = _xp_of(self.total)
        y_true = _as_array(xp, y_true, "y_true", self.total._backend)
        y_pred = _as_array(xp, y_pred, "y_pred", self.total._backend)
        empty = _is_empty_batch(y_pred) or _is_empty_batch(y_true)
        values = None if empty else self._fn(y_true, y_pred, **self._fn_kwargs)
        self._add_samplewise(xp, values, sample_weight, empty=empty)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), **self._fn_kwargs}


# -- accuracy functions (the backend's arrays in, float32 matches out) ---------------------------


def _namespace_of(*arrays: Any) -> Any:
    """The namespace of the backend owning the first array that has one (see
    ``polydist.backend.backends_owning``), else the current strategy's."""
    for a in arrays:
        if backends_owning(a):
            return get_backend_for_value(a).array_namespace()
    return _context.get_strategy().extended.array_namespace() if _context.has_strategy() else np


def accuracy(y_true: Any, y_pred: Any) -> Any:
    """How often ``y_pred`` equals ``y_true``, per sample (the mean over the last axis):
    Keras's ``keras.metrics.accuracy``."""
    xp = _namespace_of(y_pred, y_true)
    y_pred = _as_array(xp, y_pred, "y_pred")
    y_true = xp.astype(_as_array(xp, y_true, "y_true"), y_pred.dtype)
    y_true, y_pred = _squeeze_or_expand(xp, y_true, y_pred)
    return xp.mean(xp.astype(y_true == y_pred, getattr(xp, FLOATX)), axis=-1)


def binary_accuracy(y_true: Any, y_pred: Any, threshold: float = 0.5) -> Any:
    """How often ``y_pred > threshold`` equals the binary ``y_true``, per sample:
    Keras's ``keras.metrics.binary_accuracy``."""
    xp = _namespace_of(y_pred, y_true)
    y_true = _as_array(xp, y_true, "y_true")
    y_pred = _as_array(xp, y_pred, "y_pred")
    y_true, y_pred = _squeeze_or_expand(xp, y_true, y_pred)
    above = y_pred > xp.asarray(threshold, dtype=y_pred.dtype)
    y_pred = xp.astype(above, y_true.dtype)
    return xp.mean(xp.astype(y_true == y_pred, getattr(xp, FLOATX)), axis=-1)


def categorical_accuracy(y_true: Any, y_pred: Any) -> Any:
    """Whether ``argmax(y_pred)`` equals ``argmax(y_true)`` (one-hot labels), per sample:
    Keras's ``keras.metrics.categorical_accuracy``. Ties go to the first index."""
    xp = _namespace_of(y_pred, y_true)
    y_true = xp.argmax(_as_array(xp, y_true, "y_true"), axis=-1)
    y_pred = _as_array(xp, y_pred, "y_pred")
    shape = tuple(y_true.shape)
    reshape = False
    if len(y_true.shape) == len(y_pred.shape):
        y_true = xp.squeeze(y_true, axis=-1)
        reshape = True
    predicted = xp.argmax(y_pred, axis=-1)
    if predicted.dtype != y_true.dtype:
        predicted = xp.astype(predicted, y_true.dtype)
    matches = xp.astype(y_true == predicted, getattr(xp, FLOATX))
    return xp.reshape(matches, shape) if reshape else matches


def sparse_categorical_accuracy(y_true: Any, y_pred: Any) -> Any:
    """Whether ``argmax(y_pred)`` equals the integer label ``y_true``, per sample:
    Keras's ``keras.metrics.sparse_categorical_accuracy``. Labels of shape
    ``(batch, 1)`` are taken as ``(batch,)``; ties go to the first index."""
    xp = _namespace_of(y_pred, y_true)
    y_pred = _as_array(xp, y_pred, "y_pred")
    y_true = _as_array(xp, y_true, "y_true")
    shape = tuple(y_true.shape)
    reshape = False
    if (
        len(y_true.shape) >= 1
        and len(y_true.shape) == len(y_pred.shape)
        and int(y_true.shape[-1]) == 1
    ):
        y_true = xp.squeeze(y_true, axis=-1)
        reshape = True
    predicted = xp.argmax(y_pred, axis=-1)
    if predicted.dtype != y_true.dtype:
        predicted = xp.astype(predicted, y_true.dtype)
    matches = xp.astype(y_true == predicted, getattr(xp, FLOATX))
    if reshape:
        matches = xp.reshape(matches, shape)
    if len(matches.shape) > 1 and int(matches.shape[-1]) == 1:
        matches = xp.squeeze(matches, axis=-1)
    return matches


class Accuracy(MeanMetricWrapper):
    """How often predictions equal labels: Keras's ``keras.metrics.Accuracy``.

    ``update_state([[1], [2], [3], [4]], [[0], [2], [3], [4]])`` gives 0.75.
    """

    def __init__(self, name: str = "accuracy", dtype: Any = None) -> None:
        super().__init__(accuracy, name=name, dtype=dtype)


class BinaryAccuracy(MeanMetricWrapper):
    """How often ``y_pred > threshold`` matches binary labels: Keras's
    ``keras.metrics.BinaryAccuracy``."""

    def __init__(
        self, name: str = "binary_accuracy", dtype: Any = None, threshold: float = 0.5
    ) -> None:
        if threshold is not None and not 0 < threshold < 1:
            raise ValueError(
                "Invalid value for argument `threshold`. Expected a value in interval (0, 1). "
                f"Received: threshold={threshold}"
            )
        super().__init__(binary_accuracy, name=name, dtype=dtype, threshold=threshold)
        self.threshold = threshold


class CategoricalAccuracy(MeanMetricWrapper):
    """How often ``argmax(y_pred)`` matches one-hot labels: Keras's
    ``keras.metrics.CategoricalAccuracy``.

    ``update_state([[0, 0, 1], [0, 1, 0]], [[0.1, 0.9, 0.8], [0.05, 0.95, 0]])`` gives
    0.5; with ``sample_weight=[0.7, 0.3]``, 0.3.
    """

    def __init__(self, name: str = "categorical_accuracy", dtype: Any = None) -> None:
        super().__init__(categorical_accuracy, name=name, dtype=dtype)


class SparseCategoricalAccuracy(MeanMetricWrapper):
    """How often ``argmax(y_pred)`` matches integer labels: Keras's
    ``keras.metrics.SparseCategoricalAccuracy``.

    ``update_state([[2], [1]], [[0.1, 0.6, 0.3], [0.05, 0.95, 0]])`` gives 0.5; with
    ``sample_weight=[0.7, 0.3]``, 0.3.
    """

    def __init__(self, name: str = "sparse_categorical_accuracy", dtype: Any = None) -> None:
        super().__init__(sparse_categorical_accuracy, name=name, dtype=dtype)
