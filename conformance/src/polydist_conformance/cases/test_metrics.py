"""polydist.metrics: Keras's metrics on sync-on-read variables, on every backend.

Each case updates metrics created under ``strategy.scope()`` (their state is
``ON_READ``/``SUM`` variables, one copy per replica) inside ``strategy.run``
and reads ``result()`` in cross-replica context. The documented result is the
single-device metric on the whole batch, computed here with NumPy from Keras's
rules: ``argmax`` ties to the first index, float32, an empty metric reads 0.
Replicas with empty batches (a partial last batch) add nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist import metrics
from polydist_conformance import Conformance
from polydist_conformance.cases._helpers import distribute

IN_RUN = pytest.mark.requires("variables_in_replica_context")


def _data(samples: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Labels, logits and weights of ``samples`` samples of 4 classes (some ties)."""
    rng = np.random.default_rng(11)
    logits = rng.integers(0, 3, size=(samples, 4)).astype(np.float32)  # small ints: ties
    labels = rng.integers(0, 4, size=samples).astype(np.int32)
    weights = rng.integers(1, 4, size=samples).astype(np.float32)
    return labels, logits, weights


def _expected(labels: np.ndarray, logits: np.ndarray, weights: np.ndarray) -> dict[str, Any]:
    """The single-device results (Keras's rules, with NumPy)."""
    hits = (np.argmax(logits, axis=-1) == labels).astype(np.float32)
    loss = logits[:, 0].astype(np.float32)
    n = len(labels)

    def div(a: float, b: float) -> np.float32:
        return np.float32(a / b if b else 0.0)

    return {
        "accuracy": div(hits.sum(), n),
        "weighted_accuracy": div((hits * weights).sum(), weights.sum()),
        "categorical_accuracy": div(hits.sum(), n),
        "loss": div(loss.sum(), n),
        "seen": np.float32(n),
    }


def _metrics() -> dict[str, metrics.Metric]:
    return {
        "accuracy": metrics.SparseCategoricalAccuracy(),
        "weighted_accuracy": metrics.SparseCategoricalAccuracy(name="weighted"),
        "categorical_accuracy": metrics.CategoricalAccuracy(),
        "loss": metrics.Mean(name="loss"),
        "seen": metrics.Sum(name="seen"),
    }


def _step(made: dict[str, metrics.Metric], xp: Any, labels: Any, logits: Any, w: Any) -> None:
    made["accuracy"].update_state(labels, logits)
    made["weighted_accuracy"].update_state(labels, logits, sample_weight=w)
    one_hot = xp.astype(labels[:, None] == xp.arange(4, dtype=labels.dtype), xp.float32)
    made["categorical_accuracy"].update_state(one_hot, logits)
    made["loss"].update_state(logits[:, 0])
    made["seen"].update_state(xp.ones(labels.shape[0], dtype=xp.float32))


def _split(sizes: list[int], arrays: tuple[np.ndarray, ...]) -> list[tuple[np.ndarray, ...]]:
    """Replica r gets the next ``sizes[r]`` samples of each array."""
    starts = np.cumsum([0, *sizes])
    return [tuple(a[s : s + n] for a in arrays) for s, n in zip(starts, sizes)]


def _run_metrics(strategy: pd.Strategy, xp: Any, parts: list[tuple[np.ndarray, ...]]) -> Any:
    with strategy.scope():
        made = _metrics()
    labels, logits, weights = (distribute(strategy, xp, [p[i] for p in parts]) for i in range(3))
    strategy.run(lambda y, p, w: _step(made, xp, y, p, w), args=(labels, logits, weights))
    return {name: m.result() for name, m in made.items()}


@IN_RUN
def test_metrics_over_even_batches(conformance: Conformance) -> None:
    """Every replica gets 3 samples (one compiled program on an SPMD backend)."""
    n = conformance.replicas
    data = _data(3 * n)
    parts = _split([3] * n, data)
    conformance.check(lambda s, xp: _run_metrics(s, xp, parts), expected=_expected(*data))


@IN_RUN
def test_metrics_over_a_partial_batch(conformance: Conformance) -> None:
    """A partial last batch: the first replicas get 2 and 1 samples, the others none."""
    n = conformance.replicas
    sizes = ([2, 1] + [0] * n)[:n] if n > 1 else [3]
    data = _data(sum(sizes))
    parts = _split(sizes, data)
    conformance.check(lambda s, xp: _run_metrics(s, xp, parts), expected=_expected(*data))


@IN_RUN
def test_metrics_over_several_steps(conformance: Conformance) -> None:
    """Two steps accumulate; the second is partial (replica 0 only)."""
    n = conformance.replicas
    data = _data(2 * n + 1)
    first = _split([2] * n, tuple(a[: 2 * n] for a in data))
    second = _split([1] + [0] * (n - 1), tuple(a[2 * n :] for a in data))

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            made = _metrics()
        for parts in (first, second):
            args = tuple(distribute(strategy, xp, [p[i] for p in parts]) for i in range(3))
            strategy.run(lambda y, p, w: _step(made, xp, y, p, w), args=args)
        return {name: m.result() for name, m in made.items()}

    conformance.check(program, expected=_expected(*data))


def test_metric_state_is_sync_on_read_sum(conformance: Conformance) -> None:
    """The variables are SyncOnReadVariables (SUM), one copy per replica, named
    ``<metric>/total`` and ``<metric>/count``; an empty metric reads 0."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            m = metrics.SparseCategoricalAccuracy()
        return {
            "classes": [type(v).__name__ for v in m.variables],
            "names": [v.name for v in m.variables],
            "synchronization": [v.synchronization.name for v in m.variables],
            "aggregation": [v.aggregation.name for v in m.variables],
            "copies": [len(strategy.experimental_local_results(v)) for v in m.variables],
            "result": m.result(),
        }

    n = conformance.replicas
    conformance.check(
        program,
        expected={
            "classes": ["SyncOnReadVariable"] * 2,
            "names": [
                "sparse_categorical_accuracy/total:0",
                "sparse_categorical_accuracy/count:0",
            ],
            "synchronization": ["ON_READ"] * 2,
            "aggregation": ["SUM"] * 2,
            "copies": [n, n],
            "result": np.float32(0.0),
        },
    )


def test_cross_replica_update_and_reset(conformance: Conformance) -> None:
    """In cross-replica context an update counts once (TF raises there); ``reset_state``
    zeroes every copy."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with strategy.scope():
            m = metrics.Mean()
            m.update_state(xp.asarray([1.0, 2.0, 6.0], dtype=xp.float32))
        after_update = m.result()
        total = m.total.read_value()
        m.reset_state()
        return {"after_update": after_update, "total": total, "after_reset": m.result()}

    conformance.check(
        program,
        expected={
            "after_update": np.float32(3.0),
            "total": np.float32(9.0),
            "after_reset": np.float32(0.0),
        },
    )
