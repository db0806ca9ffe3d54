"""Distributed datasets: experimental_distribute_dataset, datasets from a function, iterators.

The partial-batch rule exactly as TF implements it (reference, "Partial-batch
rule" and its worked examples; B.18, B.20, B.21, B.31): with the default
``AUTO`` policy a ``range`` source is DATA-sharded, so every global batch of
``b`` is cut into slices of ``ceil(b/R)`` (legacy ``RebatchDataset``) and
trailing replicas get empty batches; with ``AutoShardPolicy.OFF`` the
balanced ``RebatchDatasetV2`` rule applies. ``distribute_datasets_from_function``
does not rebatch: replicas dequeue per-replica batches round-robin. Every
replica's batch is compared exactly (contents, dtype, shape, so an empty
batch is ``int32[0]``), and ``reduce(MEAN, x, axis=0)`` divides by the true
number of examples (1.5, 5.5, 8.5).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist.data import AutoShardPolicy, AutoShardWarning, Dataset, InputOptions, Options
from polydist.errors import OutOfRangeError
from polydist_conformance import Conformance
from polydist_conformance.cases._helpers import per_replica

Steps = list[list[list[int]]]


def _dataset(
    size: int,
    batch: int,
    *,
    drop_remainder: bool = False,
    policy: AutoShardPolicy | None = AutoShardPolicy.DATA,
    dtype: Any = np.int32,
) -> Dataset:
    """``range(size).batch(batch)`` with an explicit auto-shard policy (``None``: AUTO)."""
    dataset = Dataset.range(size, output_type=dtype).batch(batch, drop_remainder=drop_remainder)
    if policy is None:
        return dataset
    options = Options()
    options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


def _expected(steps: Steps, dtype: Any = np.int32) -> list[Any]:
    return [per_replica([np.asarray(b, dtype=dtype) for b in step]) for step in steps]


def _legacy_steps(size: int, batch: int, replicas: int) -> Steps:
    """The legacy rule written out: slice r of a batch of b is [r*c, min((r+1)*c, b))."""
    steps = []
    for start in range(0, size, batch):
        rows = list(range(start, min(start + batch, size)))
        c = math.ceil(len(rows) / replicas)
        steps.append([rows[r * c : (r + 1) * c] for r in range(replicas)])
    return steps


# The reference's and docs/concepts/input.md's worked examples: (size, batch,
# drop_remainder, replicas) -> each step's per-replica batches.
LEGACY_EXAMPLES = [
    pytest.param(10, 4, False, 2, [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], [9]]], id="10by4-R2"),
    pytest.param(
        10,
        4,
        False,
        3,
        [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []], [[8], [9], []]],
        id="10by4-R3",
    ),
    pytest.param(
        10,
        4,
        False,
        4,
        [[[0], [1], [2], [3]], [[4], [5], [6], [7]], [[8], [9], [], []]],
        id="10by4-R4",
    ),
    pytest.param(10, 4, True, 3, [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []]], id="10by4-drop-R3"),
    pytest.param(5, 5, False, 3, [[[0, 1], [2, 3], [4]]], id="5by5-R3"),
    pytest.param(10, 10, False, 4, [[[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]], id="10by10-R4"),
    pytest.param(
        13,
        5,
        False,
        4,
        [[[0, 1], [2, 3], [4], []], [[5, 6], [7, 8], [9], []], [[10], [11], [12], []]],
        id="13by5-R4",
    ),
    pytest.param(
        9,
        2,
        False,
        2,
        [[[0], [1]], [[2], [3]], [[4], [5]], [[6], [7]], [[8], []]],
        id="9by2-R2",  # B.18, input_lib_test.testUnevenDatasetBatches
    ),
]

BALANCED_EXAMPLES = [
    pytest.param(
        10, 4, False, 2, [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], []]], id="10by4-R2"
    ),
    pytest.param(
        10,
        4,
        False,
        3,
        [[[0, 1], [2], [3]], [[4, 5], [6], [7]], [[8, 9], [], []]],
        id="10by4-R3",
    ),
    pytest.param(10, 4, True, 3, [[[0, 1], [2], [3]], [[4, 5], [6], [7]]], id="10by4-drop-R3"),
    pytest.param(10, 10, False, 4, [[[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]], id="10by10-R4"),
    pytest.param(
        13,
        5,
        False,
        4,
        [[[0, 1], [2], [3], [4]], [[5, 6], [7], [8], [9]], [[10, 11], [12], [], []]],
        id="13by5-R4",
    ),
]


@pytest.mark.parametrize(("size", "batch", "drop", "replicas", "steps"), LEGACY_EXAMPLES)
def test_partial_batches_data_sharded(
    conformance: Conformance, size: int, batch: int, drop: bool, replicas: int, steps: Steps
) -> None:
    """DATA sharding (what AUTO picks for ``range``): legacy ``ceil(b/R)`` slices."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        dataset = _dataset(size, batch, drop_remainder=drop)
        return list(strategy.experimental_distribute_dataset(dataset))

    conformance.check(program, replicas=replicas, expected=_expected(steps))


@pytest.mark.parametrize(("size", "batch", "drop", "replicas", "steps"), BALANCED_EXAMPLES)
def test_partial_batches_not_sharded(
    conformance: Conformance, size: int, batch: int, drop: bool, replicas: int, steps: Steps
) -> None:
    """``AutoShardPolicy.OFF`` (or a file source): the balanced ``RebatchDatasetV2`` rule."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        dataset = _dataset(size, batch, drop_remainder=drop, policy=AutoShardPolicy.OFF)
        return list(strategy.experimental_distribute_dataset(dataset))

    conformance.check(program, replicas=replicas, expected=_expected(steps))


def test_default_auto_policy_falls_back_to_data(conformance: Conformance) -> None:
    """The reference's first row: ``range(10).batch(4)``, default AUTO, 3 replicas gives
    ``[0,1] [2,3] []`` ... ``[8] [9] []``. With one worker the fallback to DATA keeps
    every element, so it does not warn (TF logs it; it tells a user nothing)."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dist = strategy.experimental_distribute_dataset(_dataset(10, 4, policy=None))
        warned = any(issubclass(w.category, AutoShardWarning) for w in caught)
        return {"steps": list(dist), "warned": warned}

    steps = [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []], [[8], [9], []]]
    conformance.check(program, replicas=3, expected={"steps": _expected(steps), "warned": False})


def test_partial_batches_with_the_runs_replicas(conformance: Conformance) -> None:
    """The legacy rule for this run's replica count, on batches of 4 and 7 rows."""
    n = conformance.replicas

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return {
            "by4": list(strategy.experimental_distribute_dataset(_dataset(10, 4))),
            "by7": list(strategy.experimental_distribute_dataset(_dataset(10, 7))),
        }

    conformance.check(
        program,
        expected={
            "by4": _expected(_legacy_steps(10, 4, n)),
            "by7": _expected(_legacy_steps(10, 7, n)),
        },
    )


def test_a_list_of_batches_keeps_its_structure(conformance: Conformance) -> None:
    """A plain iterable of global batches (no static batch size): the legacy rule, no
    warning; dicts and tuples keep their structure with a ``PerReplica`` per leaf."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        batches = [
            {"x": np.arange(4, dtype=np.float32), "y": (np.arange(4, dtype=np.int32) * 10,)},
            {"x": np.arange(4, 6, dtype=np.float32), "y": (np.arange(4, 6, dtype=np.int32) * 10,)},
        ]
        return list(strategy.experimental_distribute_dataset(batches))

    def split(rows: list[int]) -> list[list[int]]:
        c = math.ceil(len(rows) / 3)
        return [rows[r * c : (r + 1) * c] for r in range(3)]

    expected = []
    for rows in ([0, 1, 2, 3], [4, 5]):
        parts = split(rows)
        expected.append(
            {
                "x": per_replica([np.asarray(p, np.float32) for p in parts]),
                "y": (per_replica([np.asarray(p, np.int32) * 10 for p in parts]),),
            }
        )
    conformance.check(program, replicas=3, expected=expected)


def test_distribute_datasets_from_function(conformance: Conformance) -> None:
    """No rebatching: ``range(10).batch(2)`` per replica, 3 replicas dequeue round-robin:
    ``[0,1] [2,3] [4,5]`` then ``[6,7] [8,9] []``. ``dataset_fn`` is called once, with
    ``InputContext(1, 0, 3)`` (B.20)."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        contexts: list[tuple[int, int, int]] = []

        def dataset_fn(ctx: pd.InputContext) -> Dataset:
            contexts.append(
                (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync)
            )
            return Dataset.range(10, output_type=np.int32).batch(2)

        dist = strategy.distribute_datasets_from_function(dataset_fn)
        return {"contexts": contexts, "steps": list(dist)}

    steps = [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9], []]]
    conformance.check(
        program, replicas=3, expected={"contexts": [(1, 0, 3)], "steps": _expected(steps)}
    )


def test_distribute_datasets_from_function_per_replica(conformance: Conformance) -> None:
    """``InputReplicationMode.PER_REPLICA``: one pipeline per replica, called with
    ``InputContext(R, r, R)``; replica r reads only its own pipeline."""
    n = conformance.replicas

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        contexts: list[tuple[int, int, int]] = []

        def dataset_fn(ctx: pd.InputContext) -> Dataset:
            contexts.append(
                (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync)
            )
            start = 10 * ctx.input_pipeline_id
            return Dataset.range(start, start + 3, output_type=np.int32).batch(2)

        options = InputOptions(experimental_replication_mode=pd.InputReplicationMode.PER_REPLICA)
        dist = strategy.distribute_datasets_from_function(dataset_fn, options)
        return {"contexts": contexts, "steps": list(dist)}

    steps = [
        [[10 * r, 10 * r + 1] for r in range(n)],
        [[10 * r + 2] for r in range(n)],
    ]
    conformance.check(
        program,
        expected={
            "contexts": [(n, r, n) for r in range(n)],
            "steps": _expected(steps),
        },
    )


def test_reduce_mean_over_the_batch_axis(conformance: Conformance) -> None:
    """The reference's consequences: ``reduce(MEAN, x, axis=0)`` of each step of
    ``range(10).batch(4)`` over 3 replicas is 1.5, 5.5, 8.5 (the empty replica counts no
    examples); SUM is 6, 22, 17."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        dist = strategy.experimental_distribute_dataset(_dataset(10, 4, dtype=np.float32))
        return {
            "mean": [strategy.reduce("MEAN", x, axis=0) for x in dist],
            "sum": [strategy.reduce("SUM", x, axis=0) for x in dist],
        }

    conformance.check(
        program,
        replicas=3,
        expected={
            "mean": [np.float32(1.5), np.float32(5.5), np.float32(8.5)],
            "sum": [np.float32(6.0), np.float32(22.0), np.float32(17.0)],
        },
    )


@pytest.mark.requires("dynamic_shapes")
def test_batches_feed_run(conformance: Conformance) -> None:
    """Each step's ``PerReplica`` goes into ``strategy.run``: replica r gets its own batch,
    empty ones included, and ``reduce(MEAN, ..., axis=0)`` of the results is exact."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        dist = strategy.experimental_distribute_dataset(_dataset(10, 4, dtype=np.float32))
        doubled = [strategy.run(lambda x: x * 2, args=(x,)) for x in dist]
        means = [strategy.reduce("MEAN", d, axis=0) for d in doubled]
        return {"doubled": doubled, "means": means}

    steps = [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []], [[8], [9], []]]
    conformance.check(
        program,
        replicas=3,
        expected={
            "doubled": _expected(
                [[[2 * x for x in b] for b in step] for step in steps], np.float32
            ),
            "means": [np.float32(3.0), np.float32(11.0), np.float32(17.0)],
        },
    )


@pytest.mark.requires("dynamic_shapes")
def test_mean_of_per_replica_means_is_nan_with_an_empty_batch(conformance: Conformance) -> None:
    """The reference: ``reduce(MEAN, per_replica_means, axis=None)`` is NaN in a step where a
    replica got no examples (TF, silently); polydist keeps the NaN and warns."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        dist = strategy.experimental_distribute_dataset(_dataset(10, 4, dtype=np.float32))
        results = []
        warned = []
        for x in dist:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                means = strategy.run(lambda b: xp.sum(b) / b.shape[0], args=(x,))
                results.append(strategy.reduce("MEAN", means, axis=None))
            warned.append(any(issubclass(w.category, pd.PartialBatchWarning) for w in caught))
        return {"means": results, "warned": warned}

    nan = np.float32(np.nan)
    conformance.check(
        program,
        replicas=3,
        expected={"means": [nan, nan, nan], "warned": [True, True, True]},
    )


def test_iterator_semantics(conformance: Conformance) -> None:
    """``next``/``get_next``/``get_next_as_optional``; the end raises ``StopIteration``
    (``OutOfRangeError`` from ``get_next``) on every further call; each ``iter()`` starts
    over, independently; ``next`` inside ``run`` raises ``ValueError`` (B.31); a
    distributed dataset cannot be transformed further."""
    n = conformance.replicas

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        dist = strategy.experimental_distribute_dataset(_dataset(5, 2))
        result: dict[str, Any] = {}
        it = iter(dist)
        result["next"] = next(it)
        result["get_next"] = it.get_next()
        optional = it.get_next_as_optional()
        result["has_value"] = optional.has_value()
        result["value"] = optional.get_value()
        result["at_end"] = it.get_next_as_optional().has_value()
        stops = 0
        for _ in range(2):
            try:
                next(it)
            except StopIteration:
                stops += 1
        result["stop_iteration"] = stops
        try:
            it.get_next()
            result["out_of_range"] = False
        except OutOfRangeError:
            result["out_of_range"] = True
        first, second = iter(dist), iter(dist)
        next(first)
        result["independent"] = next(second)
        result["again"] = list(dist)
        inner = iter(dist)
        try:
            strategy.run(lambda: next(inner))
            result["next_in_run"] = ""
        except ValueError as e:
            result["next_in_run"] = "should be called from outside of replica_fn" in str(e)
        result["map"] = hasattr(dist, "map")
        return result

    steps = _expected(_legacy_steps(5, 2, n))
    conformance.check(
        program,
        expected={
            "next": steps[0],
            "get_next": steps[1],
            "has_value": True,
            "value": steps[2],
            "at_end": False,
            "stop_iteration": 2,
            "out_of_range": True,
            "independent": steps[0],
            "again": steps,
            "next_in_run": True,
            "map": False,
        },
    )


def test_element_spec(conformance: Conformance) -> None:
    """B.21: with partial batches possible the batch dimension is ``None``; with
    ``drop_remainder`` and batches that divide evenly it stays static."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        def spec(dataset: Dataset) -> Any:
            element = strategy.experimental_distribute_dataset(dataset).element_spec
            return [(s.shape, str(np.dtype(s.dtype))) for s in element.value_specs]

        return {
            "partial": spec(_dataset(10, 4, policy=AutoShardPolicy.OFF)),
            "static": spec(_dataset(12, 4, drop_remainder=True, policy=AutoShardPolicy.OFF)),
        }

    conformance.check(
        program,
        replicas=2,
        expected={"partial": [((None,), "int32")] * 2, "static": [((2,), "int32")] * 2},
    )


def test_one_device_strategy_does_not_split(conformance: Conformance) -> None:
    """A single replica gets each global batch whole, as a plain array (TF's _always_wrap)."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return list(strategy.experimental_distribute_dataset(_dataset(5, 2)))

    conformance.check(
        program,
        strategy="one_device",
        expected=[np.asarray(b, np.int32) for b in ([0, 1], [2, 3], [4])],
    )
