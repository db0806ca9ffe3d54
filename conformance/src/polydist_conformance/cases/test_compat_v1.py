"""compat.v1 MirroredStrategy: TF 1's Strategy and StrategyExtended members on the backend.

``polydist.compat.v1.MirroredStrategy`` over the backend's devices (seed
001): ``make_dataset_iterator`` with ``experimental_run``,
``make_input_fn_iterator`` with the seed's example,
``experimental_make_numpy_dataset``, ``reduce`` with ``axis=None`` by
default, ``update_config_proto``, ``steps_per_run``,
``extended.experimental_run_steps_on_iterator`` (``MultiStepContext``) and
``extended.call_for_each_replica``. Inputs are integer-valued floats, so
every sum is exact on every backend.

Recording outputs from replica context (``set_last_step_output`` and
``set_non_tensor_output`` inside ``call_for_each_replica``) stores values
from inside ``merge_fn`` outside the replicas' function: those cases need
the eager execution model.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

import polydist as pd
import polydist.compat.v1 as v1
from polydist.data import AutoShardPolicy, AutoShardWarning, Dataset, InputContext, Options
from polydist.errors import OutOfRangeError
from polydist_conformance import Conformance
from polydist_conformance.cases._helpers import NamedStrategy, distribute, per_replica, replica_id

EAGER = pytest.mark.requires("eager")


def _v1_mirrored(replicas: int) -> NamedStrategy:
    """``compat.v1.MirroredStrategy(devices)`` on the backend's first ``replicas`` devices."""
    return NamedStrategy(
        f"compat.v1.MirroredStrategy({replicas} devices)",
        lambda backend: v1.MirroredStrategy(
            list(backend.replica_devices(replicas)), backend=backend
        ),
    )


def _data_sharded(dataset: Dataset) -> Dataset:
    """DATA sharding: what AUTO falls back to for in-memory sources, without the warning."""
    options = Options()
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
    return dataset.with_options(options)


def _batches(size: int, batch: int) -> Dataset:
    """``0..size-1`` as float32, batched by ``batch`` (global batches), DATA-sharded."""
    return _data_sharded(Dataset.from_tensor_slices(np.arange(size, dtype=np.float32)).batch(batch))


def _f32(values: Any) -> Any:
    return np.asarray(values, dtype=np.float32)


def _step(n: int, step: int) -> list[Any]:
    """Replica r's batch of step ``step`` of ``_batches(.., 2 * n)``: two elements each."""
    return [_f32([2 * n * step + 2 * r, 2 * n * step + 2 * r + 1]) for r in range(n)]


def _v1(strategy: pd.Strategy) -> v1.MirroredStrategy:
    assert isinstance(strategy, v1.MirroredStrategy)
    return strategy


# -- input: make_dataset_iterator, make_input_fn_iterator, numpy datasets ------------------------


def test_experimental_run_with_make_dataset_iterator(conformance: Conformance) -> None:
    """``experimental_run(fn, iterator)`` feeds one ``get_next()`` to ``run``; ``initialize()``
    starts over and returns ``[]``; without an iterator ``fn`` takes no arguments."""
    n = conformance.replicas

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        s = _v1(strategy)
        with s.scope():
            iterator = s.make_dataset_iterator(_batches(4 * n, 2 * n))

        def fn(x: Any) -> Any:
            return x + xp.astype(replica_id(), xp.float32)

        first = s.experimental_run(fn, iterator)
        second = s.experimental_run(fn, iterator)
        with s.scope():
            restarted = iterator.initialize()
            again = iterator.get_next()
        return {
            "first": first,
            "second": second,
            "initialize": restarted,
            "again": again,
            "no_iterator": s.experimental_run(replica_id),
        }

    conformance.check(
        program,
        strategy=_v1_mirrored(n),
        expected={
            "first": per_replica([b + r for r, b in enumerate(_step(n, 0))]),
            "second": per_replica([b + r for r, b in enumerate(_step(n, 1))]),
            "initialize": [],
            "again": per_replica(_step(n, 0)),
            "no_iterator": per_replica([np.int32(r) for r in range(n)]),
        },
    )


def test_dataset_iterator_runs_out(conformance: Conformance) -> None:
    n = conformance.replicas

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        s = _v1(strategy)
        with s.scope():
            iterator = s.make_dataset_iterator(_batches(2 * n, 2 * n))
            iterator.get_next()
            return iterator.get_next()

    conformance.check_raises(program, OutOfRangeError, strategy=_v1_mirrored(n))


def test_make_input_fn_iterator_seed_example(conformance: Conformance) -> None:
    """Seed 001's example: ``input_fn`` is called once with TF's ``InputContext``; replica r
    gets a per-replica batch of ``[[1.0]]`` and multiplies it by ``r + 1``."""
    n = conformance.replicas

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        s = _v1(strategy)
        global_batch_size = 2 * n
        contexts: list[tuple[int, int, int]] = []

        def input_fn(input_context: InputContext) -> Dataset:
            contexts.append(
                (
                    input_context.num_input_pipelines,
                    input_context.input_pipeline_id,
                    input_context.num_replicas_in_sync,
                )
            )
            batch_size = input_context.get_per_replica_batch_size(global_batch_size)
            d = Dataset.from_tensors(np.ones((1, 1), dtype=np.float32)).repeat().batch(batch_size)
            return d.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)

        def replica_fn(x: Any) -> Any:
            return x * xp.astype(replica_id() + 1, xp.float32)

        with s.scope():
            iterator = s.make_input_fn_iterator(input_fn)
            replica_results = s.experimental_run(replica_fn, iterator)
        total = s.reduce("SUM", replica_results, axis=0)
        with s.scope():
            restarted = iterator.initialize()
            shape = s.extended.call_for_each_replica(
                lambda x: tuple(x.shape), args=(iterator.get_next(),)
            )
        return {
            "contexts": contexts,
            "results": replica_results,
            "sum_axis_0": total,
            "initialize": restarted,
            "shape": shape,
        }

    conformance.check(
        program,
        strategy=_v1_mirrored(n),
        expected={
            "contexts": [(1, 0, n)],
            "results": per_replica([np.full((2, 1, 1), r + 1, np.float32) for r in range(n)]),
            "sum_axis_0": np.full((1, 1), n * (n + 1), np.float32),
            "initialize": [],
            "shape": (2, 1, 1),
        },
    )


def test_make_input_fn_iterator_refuses_per_replica_mode(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return _v1(strategy).make_input_fn_iterator(
            lambda ctx: Dataset.from_tensors(np.float32(1.0)).repeat(),
            pd.InputReplicationMode.PER_REPLICA,
        )

    conformance.check_raises(
        program,
        ValueError,
        match="Input replication mode not supported",
        strategy=_v1_mirrored(conformance.replicas),
    )


def test_experimental_make_numpy_dataset_seed_example(conformance: Conformance) -> None:
    """Seed 001's example: a dataset of the slices of ``np.ones``, batched and distributed
    (an in-memory source: AUTO sharding falls back to DATA, with no ``AutoShardWarning``
    on one worker, where DATA keeps every element);
    ``session`` is accepted and unused; the extended member takes a nest."""
    n = conformance.replicas

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        s = _v1(strategy)
        numpy_input = np.ones([4 * n + 1], dtype=np.float32)
        dataset = s.experimental_make_numpy_dataset(numpy_input)
        elements = list(dataset.as_numpy_iterator())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dist_dataset = s.experimental_distribute_dataset(
                dataset.batch(2 * n, drop_remainder=True)
            )
        steps = list(dist_dataset)
        with_session = s.experimental_make_numpy_dataset(
            {"x": np.arange(3, dtype=np.int32)}, session=object()
        )
        pairs = s.extended.experimental_make_numpy_dataset(
            (np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int32) * 2)
        )
        return {
            "is_dataset": isinstance(dataset, Dataset),
            "elements": elements,
            "auto_shard_warning": any(issubclass(w.category, AutoShardWarning) for w in caught),
            "steps": steps,
            "with_session": list(with_session.as_numpy_iterator()),
            "pairs": list(pairs.as_numpy_iterator()),
        }

    ones = per_replica([np.ones(2, np.float32)] * n)
    conformance.check(
        program,
        strategy=_v1_mirrored(n),
        expected={
            "is_dataset": True,
            "elements": [np.float32(1.0)] * (4 * n + 1),
            "auto_shard_warning": False,
            "steps": [ones, ones],
            "with_session": [{"x": np.int32(i)} for i in range(3)],
            "pairs": [(np.int32(i), np.int32(2 * i)) for i in range(3)],
        },
    )


def test_v1_extended_members_need_cross_replica_context(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        s = _v1(strategy)

        def fn() -> None:
            s.extended.experimental_make_numpy_dataset(np.arange(2, dtype=np.int32))

        return s.run(fn)

    conformance.check_raises(
        program,
        RuntimeError,
        match="requires being in cross-replica context",
        strategy=_v1_mirrored(conformance.replicas),
    )


# -- reduce: axis defaults to None ------------------------------------------------------------


def test_reduce_axis_defaults_to_none(conformance: Conformance) -> None:
    """TF 1's ``reduce(reduce_op, value, axis=None)``: across replicas only by default."""
    n = conformance.replicas
    host = [_f32([2 * r, 2 * r + 1]) for r in range(n)]

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        s = _v1(strategy)
        values = distribute(s, xp, host)
        return {
            "sum": s.reduce(pd.ReduceOp.SUM, values),
            "mean": s.reduce("MEAN", values),
            "sum_axis_0": s.reduce("SUM", values, axis=0),
            "mean_axis_0": s.reduce("MEAN", values, axis=0),
        }

    conformance.check(
        program,
        strategy=_v1_mirrored(n),
        expected={
            "sum": _f32([n * (n - 1), n * n]),
            "mean": _f32([n - 1, n]),
            "sum_axis_0": np.float32(n * (2 * n - 1)),
            "mean_axis_0": np.float32((2 * n - 1) / 2),
        },
    )


# -- session configs and steps_per_run ----------------------------------------------------------


def test_update_config_proto_and_steps_per_run(conformance: Conformance) -> None:
    """``update_config_proto`` sets ``isolate_session_state`` on a deep copy (TF's
    ``MirroredExtended``); ``configure`` does it in place; ``steps_per_run`` is 1."""
    n = conformance.replicas

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        s = _v1(strategy)
        config: dict[str, Any] = {
            "allow_soft_placement": True,
            "graph_options": {"build_cost_model": 1},
        }
        updated = s.update_config_proto(config)
        updated["graph_options"]["build_cost_model"] = 2
        configured: dict[str, Any] = {"log_device_placement": False}
        s.configure(session_config=configured)
        return {
            "updated": dict(updated),
            "original": config,
            "configured": configured,
            "steps_per_run": s.steps_per_run,
            "extended_steps_per_run": s.extended.steps_per_run,
            "num_replicas_in_sync": s.num_replicas_in_sync,
            "worker_devices": len(s.extended.worker_devices),
            "is_v1": isinstance(s.extended, v1.StrategyExtended),
        }

    conformance.check(
        program,
        strategy=_v1_mirrored(n),
        expected={
            "updated": {
                "allow_soft_placement": True,
                "graph_options": {"build_cost_model": 2},
                "isolate_session_state": True,
            },
            "original": {"allow_soft_placement": True, "graph_options": {"build_cost_model": 1}},
            "configured": {"log_device_placement": False, "isolate_session_state": True},
            "steps_per_run": 1,
            "extended_steps_per_run": 1,
            "num_replicas_in_sync": n,
            "worker_devices": n,
            "is_v1": True,
        },
    )


def test_update_config_proto_needs_a_dict(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        return _v1(strategy).update_config_proto("allow_soft_placement: true")

    conformance.check_raises(
        program,
        TypeError,
        match="a dict of ConfigProto fields",
        strategy=_v1_mirrored(conformance.replicas),
    )


# -- call_for_each_replica and experimental_run_steps_on_iterator ------------------------------


def test_extended_call_for_each_replica(conformance: Conformance) -> None:
    """``extended.call_for_each_replica(fn, args, kwargs)``: ``fn(*args, **kwargs)`` per
    replica, with each replica's component of distributed arguments."""
    n = conformance.replicas

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        s = _v1(strategy)
        one = xp.asarray(1, dtype=xp.int32)
        two = xp.asarray(2, dtype=xp.int32)
        plain = s.extended.call_for_each_replica(
            lambda a, b: a + b + replica_id(), args=(one,), kwargs={"b": two}
        )
        values = distribute(s, xp, [_f32(10 * r) for r in range(n)])
        doubled = s.extended.call_for_each_replica(lambda x: x * 2, args=(values,))
        return {"plain": plain, "doubled": doubled}

    conformance.check(
        program,
        strategy=_v1_mirrored(n),
        expected={
            "plain": per_replica([np.int32(3 + r) for r in range(n)]),
            "doubled": per_replica([np.float32(20 * r) for r in range(n)]),
        },
    )


def _steps_expected(n: int, step: int) -> list[float]:
    """The per-replica sums of step ``step``: ``4 n step + 4 r + 1``."""
    return [float(4 * n * step + 4 * r + 1) for r in range(n)]


def test_experimental_run_steps_on_iterator(conformance: Conformance) -> None:
    """``fn(ctx, inputs)`` runs ``iterations`` times in cross-replica context;
    ``set_last_step_output`` keeps the last step's output, reduced with ``reduce_op`` or as
    the ``PerReplica``; the loop reads exactly ``iterations`` steps; ``run_op`` is ``None``."""
    n = conformance.replicas

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        s = _v1(strategy)
        seen: list[Any] = []

        def step_fn(ctx: v1.MultiStepContext, inputs: Any) -> None:
            seen.append(inputs)
            per_replica_sums = s.extended.call_for_each_replica(xp.sum, args=(inputs,))
            ctx.set_last_step_output("sum", per_replica_sums, reduce_op=pd.ReduceOp.SUM)
            ctx.set_last_step_output("mean", per_replica_sums, reduce_op="MEAN")
            ctx.set_last_step_output("raw", per_replica_sums)
            ctx.set_non_tensor_output("step", len(seen))

        with s.scope():
            iterator = s.make_dataset_iterator(_batches(6 * n, 2 * n))
            ctx = s.extended.experimental_run_steps_on_iterator(
                step_fn, iterator, iterations=2, initial_loop_values={"sum": 0.0}
            )
            following = iterator.get_next()
        return {
            "seen": seen,
            "last_step_outputs": ctx.last_step_outputs,
            "non_tensor_outputs": ctx.non_tensor_outputs,
            "run_op": ctx.run_op,
            "initial_loop_values": ctx.initial_loop_values,
            "following": following,
        }

    last = _steps_expected(n, 1)
    conformance.check(
        program,
        strategy=_v1_mirrored(n),
        expected={
            "seen": [per_replica(_step(n, 0)), per_replica(_step(n, 1))],
            "last_step_outputs": {
                "sum": np.float32(sum(last)),
                "mean": np.float32(sum(last) / n),
                "raw": per_replica([np.float32(x) for x in last]),
            },
            "non_tensor_outputs": {"step": 2},
            "run_op": None,
            "initial_loop_values": {"sum": 0.0},
            "following": per_replica(_step(n, 2)),
        },
    )


@EAGER
def test_run_steps_outputs_from_replica_context(conformance: Conformance) -> None:
    """In replica context ``set_last_step_output`` needs ``reduce_op`` and reduces across
    replicas (a ``merge_call``); ``set_non_tensor_output`` keeps one value per replica."""
    n = conformance.replicas

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        s = _v1(strategy)

        def step_fn(ctx: v1.MultiStepContext, inputs: Any) -> None:
            def replica_fn(x: Any) -> None:
                ctx.set_last_step_output("sum", xp.sum(x), reduce_op="SUM")
                ctx.set_last_step_output("mean", xp.sum(x), reduce_op=pd.ReduceOp.MEAN)
                ctx.set_non_tensor_output("replica", replica_id())

            s.extended.call_for_each_replica(replica_fn, args=(inputs,))

        with s.scope():
            iterator = s.make_dataset_iterator(_batches(4 * n, 2 * n))
            ctx = s.extended.experimental_run_steps_on_iterator(step_fn, iterator, iterations=2)
        return {"last": ctx.last_step_outputs, "non_tensor": ctx.non_tensor_outputs}

    last = _steps_expected(n, 1)
    conformance.check(
        program,
        strategy=_v1_mirrored(n),
        expected={
            "last": {"sum": np.float32(sum(last)), "mean": np.float32(sum(last) / n)},
            "non_tensor": {"replica": tuple(np.int32(r) for r in range(n))},
        },
    )


def test_run_steps_needs_reduce_op_in_replica_context(conformance: Conformance) -> None:
    n = conformance.replicas

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        s = _v1(strategy)

        def step_fn(ctx: v1.MultiStepContext, inputs: Any) -> None:
            s.extended.call_for_each_replica(
                lambda: ctx.set_last_step_output("x", xp.asarray(1.0, dtype=xp.float32))
            )

        with s.scope():
            iterator = s.make_dataset_iterator(_batches(2 * n, 2 * n))
        return s.extended.experimental_run_steps_on_iterator(step_fn, iterator)

    conformance.check_raises(
        program, ValueError, match="without a reduction: pass reduce_op", strategy=_v1_mirrored(n)
    )


@pytest.mark.parametrize("case", ["too_many_iterations", "negative_iterations", "no_iterator"])
def test_run_steps_on_iterator_errors(conformance: Conformance, case: str) -> None:
    """More iterations than steps: ``OutOfRangeError``; ``iterations=-1``: ``ValueError``;
    an object without ``get_next``: ``TypeError``."""
    n = conformance.replicas

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        s = _v1(strategy)
        with s.scope():
            iterator: Any = s.make_dataset_iterator(_batches(2 * n, 2 * n))
        iterations = {"too_many_iterations": 2, "negative_iterations": -1, "no_iterator": 1}[case]
        if case == "no_iterator":
            iterator = [1, 2]
        return s.extended.experimental_run_steps_on_iterator(
            lambda ctx, x: None, iterator, iterations=iterations
        )

    error: type[Exception]
    error, match = {
        "too_many_iterations": (OutOfRangeError, None),
        "negative_iterations": (ValueError, "iterations must be an int >= 0"),
        "no_iterator": (TypeError, "must have a get_next"),
    }[case]
    conformance.check_raises(program, error, match=match, strategy=_v1_mirrored(n))
