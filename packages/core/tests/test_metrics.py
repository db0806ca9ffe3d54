"""polydist.metrics on the sim: Keras's results, sync-on-read state, any replica count.

Expected values are Keras 3's documented examples (``keras.metrics.Mean`` etc.,
the ``tf.keras`` of TF 2.21) and its ``reduce_to_samplewise_values`` rules worked
by hand; distributed results must equal the single-device metric on the full
batch, partial last batches (replicas with empty batches) included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist import metrics
from polydist.data import AutoShardPolicy, Dataset, Options

VS = pd.VariableSynchronization
VA = pd.VariableAggregation


def value(x: Any) -> float:
    array = np.asarray(x)
    assert array.shape == () and array.dtype == np.float32, (array.shape, array.dtype)
    return float(array)


# -- Keras's documented results (one device) --------------------------------------------


KERAS_EXAMPLES = [
    (metrics.Mean, ([1, 3, 5, 7],), {}, 4.0),
    (metrics.Mean, ([1, 3, 5, 7],), {"sample_weight": [1, 1, 0, 0]}, 2.0),
    (metrics.Sum, ([1, 3, 5, 7],), {}, 16.0),
    (metrics.Sum, ([1, 3, 5, 7],), {"sample_weight": [1, 1, 0, 0]}, 4.0),
    (metrics.Accuracy, ([[1], [2], [3], [4]], [[0], [2], [3], [4]]), {}, 0.75),
    (
        metrics.Accuracy,
        ([[1], [2], [3], [4]], [[0], [2], [3], [4]]),
        {"sample_weight": [1, 1, 0, 0]},
        0.5,
    ),
    (metrics.BinaryAccuracy, ([[1], [1], [0], [0]], [[0.98], [1], [0], [0.6]]), {}, 0.75),
    (
        metrics.BinaryAccuracy,
        ([[1], [1], [0], [0]], [[0.98], [1], [0], [0.6]]),
        {"sample_weight": [1, 0, 0, 1]},
        0.5,
    ),
    (
        metrics.CategoricalAccuracy,
        ([[0, 0, 1], [0, 1, 0]], [[0.1, 0.9, 0.8], [0.05, 0.95, 0]]),
        {},
        0.5,
    ),
    (
        metrics.CategoricalAccuracy,
        ([[0, 0, 1], [0, 1, 0]], [[0.1, 0.9, 0.8], [0.05, 0.95, 0]]),
        {"sample_weight": [0.7, 0.3]},
        0.3,
    ),
    (
        metrics.SparseCategoricalAccuracy,
        ([[2], [1]], [[0.1, 0.6, 0.3], [0.05, 0.95, 0]]),
        {},
        0.5,
    ),
    (
        metrics.SparseCategoricalAccuracy,
        ([[2], [1]], [[0.1, 0.6, 0.3], [0.05, 0.95, 0]]),
        {"sample_weight": [0.7, 0.3]},
        0.3,
    ),
    (metrics.SparseCategoricalAccuracy, ([2, 1], [[0.1, 0.6, 0.3], [0.05, 0.95, 0]]), {}, 0.5),
]


@pytest.mark.parametrize(("cls", "args", "kwargs", "expected"), KERAS_EXAMPLES)
def test_keras_documented_results(
    cls: type[metrics.Metric], args: tuple[Any, ...], kwargs: dict[str, Any], expected: float
) -> None:
    m = cls()
    m.update_state(*args, **kwargs)
    assert value(m.result()) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    "cls",
    [
        metrics.Mean,
        metrics.Sum,
        metrics.Accuracy,
        metrics.CategoricalAccuracy,
        metrics.SparseCategoricalAccuracy,
    ],
)
def test_an_empty_metric_is_zero_not_nan(cls: type[metrics.Metric]) -> None:
    assert value(cls().result()) == 0.0


def test_names_dtype_and_variables() -> None:
    m = metrics.SparseCategoricalAccuracy()
    assert m.name == "sparse_categorical_accuracy" and m.dtype == "float32"
    total, count = m.variables
    assert (total.name, count.name) == (
        "sparse_categorical_accuracy/total:0",
        "sparse_categorical_accuracy/count:0",
    )
    assert total.synchronization is VS.ON_READ and total.aggregation is VA.SUM
    assert not total.trainable
    assert metrics.Mean(name="loss", dtype="float64").variables[0].dtype == np.float64
    for dtype in (np.float64, np.dtype("float64")):
        wide = metrics.Mean(dtype=dtype)
        assert wide.dtype == "float64" and wide.variables[1].dtype == np.float64
    assert m.get_config() == {"name": "sparse_categorical_accuracy", "dtype": "float32"}
    assert repr(metrics.Sum()) == "<Sum name=sum>"


def test_keras_sample_weight_rules() -> None:
    # A scalar weight: the values are first averaged over the batch (Keras reduces the
    # values to the weight's rank), so [1, 3, 5, 7] weighted 2 adds total 8, count 2.
    m = metrics.Mean()
    m.update_state([1.0, 3.0, 5.0, 7.0], sample_weight=2.0)
    assert (float(m.total.numpy()), float(m.count.numpy())) == (8.0, 2.0)
    # 2-D values, one weight per sample: each sample's mean is weighted.
    m = metrics.Mean()
    m.update_state([[1.0, 2.0], [3.0, 4.0]], sample_weight=[1.0, 0.0])
    assert (float(m.total.numpy()), float(m.count.numpy())) == (1.5, 1.0)
    # Values (2, 1) and weights (2,): the weights gain the last axis.
    m = metrics.Mean()
    m.update_state([[1.0], [3.0]], sample_weight=[2.0, 0.0])
    assert (float(m.total.numpy()), float(m.count.numpy())) == (2.0, 2.0)
    # Sum reduces the non-batch axes with a sum.
    s = metrics.Sum()
    s.update_state([[1.0, 2.0], [3.0, 4.0]], sample_weight=[1.0, 0.5])
    assert value(s.result()) == 6.5


def test_argmax_ties_go_to_the_first_index() -> None:
    sparse = metrics.SparseCategoricalAccuracy()
    sparse.update_state([0, 1], [[0.5, 0.5], [0.5, 0.5]])
    assert value(sparse.result()) == 0.5
    categorical = metrics.CategoricalAccuracy()
    categorical.update_state([[0.0, 1.0, 1.0]], [[0.2, 0.4, 0.4]])  # argmax 1 both
    assert value(categorical.result()) == 1.0


def test_float_labels_compare_with_the_argmax() -> None:
    m = metrics.SparseCategoricalAccuracy()
    m.update_state(np.asarray([[2.0], [0.0]], np.float32), [[0.1, 0.2, 0.7], [0.1, 0.8, 0.1]])
    assert value(m.result()) == 0.5


def test_reset_state_and_call() -> None:
    m = metrics.Mean()
    assert value(m([1.0, 2.0])) == 1.5
    assert value(m([6.0])) == 3.0
    m.reset_state()
    assert (float(m.total.numpy()), float(m.count.numpy())) == (0.0, 0.0)


def test_an_empty_batch_adds_nothing() -> None:
    # Keras adds NaN here (the mean of an empty axis); polydist adds nothing.
    acc = metrics.Accuracy()
    acc.update_state([1, 2], [1, 0])
    acc.update_state(np.zeros((0,), np.int32), np.zeros((0,), np.int32))
    assert value(acc.result()) == 0.5
    mean = metrics.Mean()
    mean.update_state([4.0])
    mean.update_state(np.zeros((0,), np.float32), sample_weight=3.0)
    assert (float(mean.total.numpy()), float(mean.count.numpy())) == (4.0, 1.0)


def test_bad_arguments_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="threshold"):
        metrics.BinaryAccuracy(threshold=1.5)
    with pytest.raises(ValueError, match="Invalid aggregation 'max'"):
        metrics.Metric().add_variable(aggregation="max", name="v")
    strategy = pd.MirroredStrategy(2)
    with strategy.scope():
        m = metrics.Mean()
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.ones(2, np.float32)
    )
    with pytest.raises(TypeError, match="inside strategy.run"):
        m.update_state(per_replica)


# -- distributed ---------------------------------------------------------------------------


def batches(total: int, batch: int) -> Dataset:
    """``total`` samples of 3 classes, with labels that the argmax matches 2 times in 3."""
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(total, 3)).astype(np.float32)
    labels = np.argmax(logits, axis=-1).astype(np.int32)
    labels[::3] = (labels[::3] + 1) % 3
    weights = rng.uniform(0.5, 2.0, size=total).astype(np.float32)
    options = Options()
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
    return Dataset.from_tensor_slices((labels, logits, weights)).batch(batch).with_options(options)


def single_device(total: int, batch: int) -> dict[str, float]:
    made = make_metrics()
    for labels, logits, weights in batches(total, batch):
        update(made, labels, logits, weights)
    return {k: value(m.result()) for k, m in made.items()}


def make_metrics() -> dict[str, metrics.Metric]:
    return {
        "loss": metrics.Mean(name="loss"),
        "seen": metrics.Sum(name="seen"),
        "accuracy": metrics.SparseCategoricalAccuracy(),
        "weighted": metrics.SparseCategoricalAccuracy(name="weighted"),
        "categorical": metrics.CategoricalAccuracy(),
    }


def update(made: dict[str, metrics.Metric], labels: Any, logits: Any, weights: Any) -> None:
    made["loss"].update_state(logits[:, 0] * 2.0)
    made["seen"].update_state(np.ones(labels.shape[0], np.float32))
    made["accuracy"].update_state(labels, logits)
    made["weighted"].update_state(labels, logits, sample_weight=weights)
    made["categorical"].update_state(np.eye(3, dtype=np.float32)[labels], logits)


@pytest.mark.parametrize("replicas", [1, 3, 8])
def test_distributed_results_equal_single_device_with_partial_batches(replicas: int) -> None:
    # 10 samples in batches of 4: the last step is [8, 9] split over the replicas, so
    # at 3 and 8 replicas some replicas get empty batches.
    strategy = pd.MirroredStrategy(replicas)
    with strategy.scope():
        made = make_metrics()
    dist = strategy.experimental_distribute_dataset(batches(10, 4))
    empty_seen = 0
    for labels, logits, weights in dist:
        local = strategy.experimental_local_results(labels)
        empty_seen += sum(1 for x in local if x.shape[0] == 0)
        strategy.run(update, args=(made, labels, logits, weights))
    if replicas > 1:
        assert empty_seen > 0  # the case the test is about
    got = {k: value(m.result()) for k, m in made.items()}
    want = single_device(10, 4)
    assert got == pytest.approx(want, rel=1e-6)
    assert got["seen"] == 10.0
    for m in made.values():
        assert all(isinstance(v, pd.SyncOnReadVariable) for v in m.variables)
        assert len(m.variables[0].values) == replicas


def test_each_replica_updates_its_own_copy_and_result_in_run_is_local() -> None:
    strategy = pd.MirroredStrategy(3)
    with strategy.scope():
        m = metrics.Mean()

    def step() -> Any:
        r = int(pd.get_replica_context().replica_id_in_sync_group)  # type: ignore[union-attr]
        m.update_state(np.full(r + 1, float(r), np.float32))
        return m.result()

    local = strategy.run(step)
    assert [float(x) for x in strategy.experimental_local_results(local)] == [0.0, 1.0, 2.0]
    assert [float(c.numpy()) for c in m.total.values] == [0.0, 2.0, 6.0]
    assert [float(c.numpy()) for c in m.count.values] == [1.0, 2.0, 3.0]
    assert value(m.result()) == pytest.approx(8.0 / 6.0)


def test_cross_replica_update_counts_once() -> None:
    # TF raises ValueError here (assign_add of a SUM sync-on-read variable in
    # cross-replica context); polydist adds the update once, to replica 0's copy.
    strategy = pd.MirroredStrategy(4)
    with strategy.scope():
        m = metrics.Mean()
        s = metrics.Sum()
    m.update_state([1.0, 2.0, 3.0])
    with strategy.scope():
        s.update_state([1.0, 2.0, 3.0])
        m.update_state([6.0])
    assert value(m.result()) == 3.0
    assert value(s.result()) == 6.0
    assert [float(c.numpy()) for c in s.total.values] == [6.0, 0.0, 0.0, 0.0]


def test_reset_state_zeroes_every_copy() -> None:
    strategy = pd.MirroredStrategy(3)
    with strategy.scope():
        m = metrics.Mean()
    strategy.run(lambda: m.update_state([1.0, 2.0]))
    assert value(m.result()) == 1.5
    m.reset_state()
    assert [float(c.numpy()) for c in m.total.values] == [0.0, 0.0, 0.0]
    assert value(m.result()) == 0.0


def test_a_checkpoint_holds_a_metric_across_replica_counts(tmp_path: Path) -> None:
    three = pd.MirroredStrategy(3)
    with three.scope():
        m = metrics.Mean()
    three.run(lambda: m.update_state([1.0, 2.0]))  # total 9, count 6
    pd.checkpoint.save(tmp_path, m.variables)
    two = pd.MirroredStrategy(2)
    with two.scope():
        restored = metrics.Mean()
    pd.checkpoint.restore(tmp_path, restored.variables)
    assert value(restored.result()) == 1.5
    assert float(np.asarray(restored.count.value())) == 6.0
