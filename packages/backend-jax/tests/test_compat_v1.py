"""polydist.compat.v1 and contrib on the jax backend: no traced value passes as a real one."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import polydist as pd
import polydist.compat.v1 as v1
from polydist.contrib import distribute
from polydist_jax import JaxBackend

N = 4  # replicas; each step's global batch of 8 gives each replica 2 elements


def _iterator(strategy: v1.MirroredStrategy) -> v1.InputIterator:
    data = pd.data.Dataset.from_tensor_slices(np.arange(16, dtype=np.float32)).batch(8)
    with strategy.scope():
        return strategy.make_dataset_iterator(data)


def test_set_last_step_output_in_compiled_replica_fn_raises() -> None:
    # Recorded at trace time, the value was a leaked tracer (and a cached program
    # would never record the later steps).
    strategy = v1.MirroredStrategy(N, backend=JaxBackend())

    def step_fn(ctx: v1.MultiStepContext, x: Any) -> None:
        def replica_fn(y: Any) -> Any:
            ctx.set_last_step_output("loss", y.sum(), reduce_op="MEAN")
            return y

        strategy.extended.call_for_each_replica(replica_fn, args=(x,))

    with pytest.raises(ValueError, match="cross-replica context instead"):
        strategy.extended.experimental_run_steps_on_iterator(step_fn, _iterator(strategy), 2)


def test_set_non_tensor_output_of_traced_value_raises() -> None:
    strategy = v1.MirroredStrategy(N, backend=JaxBackend())

    def step_fn(ctx: v1.MultiStepContext, x: Any) -> None:
        def replica_fn(y: Any) -> Any:
            ctx.set_non_tensor_output("first", y[0])
            return y

        strategy.extended.call_for_each_replica(replica_fn, args=(x,))

    with pytest.raises(ValueError, match="set_non_tensor_output"):
        strategy.extended.experimental_run_steps_on_iterator(step_fn, _iterator(strategy), 1)


def test_set_last_step_output_in_cross_replica_context_compiled() -> None:
    strategy = v1.MirroredStrategy(N, backend=JaxBackend())

    def step_fn(ctx: v1.MultiStepContext, x: Any) -> None:
        out = strategy.extended.call_for_each_replica(lambda y: y.sum(), args=(x,))
        ctx.set_last_step_output("loss", out, reduce_op="MEAN")
        ctx.set_non_tensor_output("tag", "done")

    ctx = strategy.extended.experimental_run_steps_on_iterator(step_fn, _iterator(strategy), 2)
    # Step 2's batch is 8..15: the replicas' sums 17, 21, 25, 29 average to 23.
    assert float(np.asarray(ctx.last_step_outputs["loss"])) == 23.0
    assert ctx.non_tensor_outputs == {"tag": "done"}


def test_set_last_step_output_in_replica_fn_eager() -> None:
    strategy = v1.MirroredStrategy(N, backend=JaxBackend(jit=False))

    def step_fn(ctx: v1.MultiStepContext, x: Any) -> None:
        def replica_fn(y: Any) -> Any:
            ctx.set_last_step_output("loss", y.sum(), reduce_op="SUM")
            ctx.set_non_tensor_output("first", float(y[0]))
            return y

        strategy.extended.call_for_each_replica(replica_fn, args=(x,))

    ctx = strategy.extended.experimental_run_steps_on_iterator(step_fn, _iterator(strategy), 2)
    assert float(np.asarray(ctx.last_step_outputs["loss"])) == float(np.arange(8, 16).sum())
    assert ctx.non_tensor_outputs == {"first": (8.0, 10.0, 12.0, 14.0)}


def _tower_device() -> str:
    ctx = distribute.get_tower_context()
    assert ctx is not None
    return ctx.device


def test_tower_device_in_compiled_run_raises() -> None:
    # It used to answer the host's CPU for every tower.
    strategy = distribute.MirroredStrategy(backend=JaxBackend())
    with pytest.raises(RuntimeError, match="compiled"):
        strategy.call_for_each_tower(_tower_device)


def test_tower_device_eager() -> None:
    strategy = distribute.MirroredStrategy(backend=JaxBackend(jit=False))
    devices = strategy.unwrap(strategy.call_for_each_tower(_tower_device))
    assert devices == strategy.worker_devices
    assert len(set(devices)) == strategy.num_towers == 8
