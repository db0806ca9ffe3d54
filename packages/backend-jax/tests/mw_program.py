"""The shared multi-worker program (``polydist_conformance.multiprocess``) as a JAX worker.

``python mw_program.py OUT MODE [OPTIONS]``; see that module for the modes. One more
mode is JAX's own: ``compiled`` (`compiled_program`) writes ``OUT/compiled<i>.npz``
with the backend's compile and eager-fallback counts. ``$MW_PROGRAM_JIT=0`` runs
every mode eagerly (``backend=JaxWorkerProcesses(jit=False)``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import polydist as pd
from polydist_conformance.multiprocess import (
    D,
    as_numpy,
    load,
    local_components,
    main,
    program,
    save,
    write_error,
)

__all__ = ["D", "STEPS", "compiled_program", "load", "program"]

STEPS = 4
VS, VA = pd.VariableSynchronization, pd.VariableAggregation


def jax_strategy(args: argparse.Namespace) -> pd.Strategy:
    import jax

    jax.config.update("jax_enable_x64", True)  # TF's float64 MEAN of integers
    from polydist_jax import JaxWorkerProcesses

    options = pd.experimental.CommunicationOptions(timeout_seconds=args.timeout)
    jit = os.environ.get("MW_PROGRAM_JIT", "1") != "0"
    backend = "jax" if jit else JaxWorkerProcesses(jit=False)
    return pd.MultiWorkerMirroredStrategy(
        communication_options=options, local_devices=D, backend=backend
    )


def _ctx() -> pd.ReplicaContext:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return ctx


def compiled_program(
    strategy: pd.Strategy, steps: int = STEPS, stall: float = 0.0
) -> dict[str, list[np.ndarray]]:
    """One step function run ``steps`` times: collectives, a merge_call and variables
    (mirrored, sync-on-read) on integer-valued float32 data, whose sums are exact in any
    order (gloo's across processes too). Per-replica results list this process's
    replicas (the sim's: every worker's). ``stall``: seconds this worker sleeps before
    step 1 (a peer that is late, not gone)."""
    with strategy.scope():
        w = pd.Variable(np.zeros(3, np.float32), name="w", aggregation=VA.SUM)
        seen = pd.Variable(
            np.float32(0), name="seen", synchronization=VS.ON_READ, aggregation=VA.SUM
        )

    def step(x: Any, scale: float) -> Any:
        ctx = _ctx()
        total = ctx.all_reduce(pd.ReduceOp.SUM, x * scale)
        mean = ctx.all_reduce(pd.ReduceOp.MEAN, x)
        gathered = ctx.all_gather(x, axis=0)
        merged = ctx.merge_call(lambda s, v: s.reduce(pd.ReduceOp.SUM, v, axis=None), args=(x,))
        w.assign_add(x)  # SUM-aggregated: every copy adds the sum of all replicas' x
        seen.assign_add(x.sum())  # this replica's own copy
        return ctx.replica_id_in_sync_group, total, mean, gathered, merged, w.read_value()

    out: dict[str, list[np.ndarray]] = {}
    names = ("replica_id", "total", "mean", "gathered", "merged", "w_in_replica")
    for s in range(steps):
        x = strategy.experimental_distribute_values_from_function(
            lambda c, s=s: np.arange(3, dtype=np.float32) + 10 * c.replica_id_in_sync_group + s
        )
        if s == 1 and stall:
            time.sleep(stall)
        results = strategy.run(step, args=(x, 2.0))
        for name, value in zip(names, results, strict=True):
            out[f"{name}_{s}"] = local_components(strategy, value)
        out[f"w_{s}"] = [as_numpy(strategy, w.read_value())]
        out[f"seen_{s}"] = [as_numpy(strategy, seen.read_value())]
    made: list[Any] = []

    def extras(x: Any) -> Any:
        made.append(pd.Variable(np.full(3, 5.0, np.float32), name="made"))  # created in run
        # merge_fn reduces a host value: one copy per worker.
        host = _ctx().merge_call(lambda s: s.reduce(pd.ReduceOp.SUM, np.float32(1.5), axis=None))
        return host, x + made[-1].read_value()

    host, plus = strategy.run(extras, args=(x,))
    out["host_in_merge_call"] = local_components(strategy, host)
    out["plus_made"] = local_components(strategy, plus)
    out["made"] = [as_numpy(strategy, made[-1].read_value())]
    # Worker 0's replicas hold 2 elements, worker 1's 3: even on each worker, not across.
    uneven = strategy.experimental_distribute_values_from_function(
        lambda c: np.arange(2 + c.replica_id_in_sync_group // D, dtype=np.float32)
    )
    gathered = strategy.run(lambda v: _ctx().all_gather(v, axis=0), args=(uneven,))
    out["uneven_gather"] = local_components(strategy, gathered)
    return out


#: ``programs --case``: one step function, whose closure differs between the workers.
PROGRAM_CASES = ("shape", "reduce_op", "op")


def programs(
    strategy: pd.Strategy, case: str, rank: int, same_steps: int = 0
) -> dict[str, list[np.ndarray]]:
    """Two compiled steps of the same function (one name, one module, no inputs) whose
    collectives come from a closure that differs between the workers: other shapes, SUM
    against MEAN, all_reduce against all_gather. Results: ``out`` of each step.

    ``same_steps``: instead, two step functions (sums of 3 and of 4 floats) that every
    worker runs alike, alternately, ``same_steps`` times (``same_<s>``); then worker 0
    runs the first while worker 1 runs the second: two programs every worker has
    compiled and agreed on before, which still disagree at that step (``out_0``)."""
    if same_steps:

        def summing(n: int) -> Callable[[], Any]:
            def step() -> Any:
                ctx = _ctx()
                value = np.arange(n, dtype=np.float32) * (ctx.replica_id_in_sync_group + 1)
                return ctx.all_reduce(pd.ReduceOp.SUM, value)

            return step

        three, four = summing(3), summing(4)
        out = {
            f"same_{s}": local_components(strategy, strategy.run(three if s % 2 else four))
            for s in range(same_steps)
        }
        out["out_0"] = local_components(strategy, strategy.run(three if rank == 0 else four))
        return out
    n = 3 if rank == 0 or case != "shape" else 4
    op = pd.ReduceOp.MEAN if rank == 1 and case == "reduce_op" else pd.ReduceOp.SUM
    gather = rank == 1 and case == "op"

    def step() -> Any:
        ctx = _ctx()
        value = np.arange(1, n + 1, dtype=np.float32) * (ctx.replica_id_in_sync_group + 1)
        if gather:
            return ctx.all_gather(value, axis=0)
        return ctx.all_reduce(op, value)

    return {f"out_{s}": local_components(strategy, strategy.run(step)) for s in range(2)}


def uneven_here(strategy: pd.Strategy, rank: int) -> dict[str, list[np.ndarray]]:
    """A step that worker 0 cannot compile (its own replicas' inputs differ in shape)
    while worker 1 can: worker 0 sends its agreement alone, worker 1's compiled step
    finds it and runs nothing, and both run the call eagerly, after a compiled step.
    Results: each step's ``out``, and the eager fallbacks."""

    def step(v: Any) -> Any:
        return _ctx().all_gather(v * 2, axis=0)

    def rows(c: pd.InputContext) -> np.ndarray:
        replica = c.replica_id_in_sync_group
        uneven = rank == 0 and replica % D == 1
        return np.arange(3 if uneven else 2, dtype=np.float32) + 10 * replica

    out: dict[str, list[np.ndarray]] = {}
    even = strategy.experimental_distribute_values_from_function(
        lambda c: np.arange(2, dtype=np.float32) + 10 * c.replica_id_in_sync_group
    )
    out["out_0"] = local_components(strategy, strategy.run(step, args=(even,)))
    values = strategy.experimental_distribute_values_from_function(rows)
    out["out_1"] = local_components(strategy, strategy.run(step, args=(values,)))
    out["out_2"] = local_components(strategy, strategy.run(step, args=(even,)))
    backend: Any = strategy.extended.backend
    out["eager_fallback_count"] = [np.asarray(backend.eager_fallback_count)]
    return out


def one_device(rank: int, timeout: float) -> dict[str, list[np.ndarray]]:
    """Two workers of one replica each (where a worker's compiled step holds each
    output whole on its device, the parameters it returns the next step's inputs as
    they are): parameters passed in and returned, a rank-0 loss, on integer-valued
    float32 data (exact in any order)."""
    import jax
    import jax.numpy as jnp

    options = pd.experimental.CommunicationOptions(timeout_seconds=timeout)
    strategy = pd.MultiWorkerMirroredStrategy(
        communication_options=options, local_devices=1, backend="jax"
    )

    def step(w: Any, x: Any) -> Any:
        grad = _ctx().all_reduce(pd.ReduceOp.SUM, x * w)
        return w - 0.5 * grad, jnp.sum(grad)

    w = jnp.asarray(np.array([1, 2, 3], np.float32))
    x = jnp.asarray(np.array([1, 2, 4], np.float32) * (rank + 1))
    out: dict[str, list[np.ndarray]] = {}
    # What each call waits for: the agreement's gathered digests, not the step.
    waited: list[list[tuple[int, ...]]] = []
    real = jax.block_until_ready

    def recording(x: Any) -> Any:
        waited.append([np.shape(leaf) for leaf in jax.tree.leaves(x)])
        return real(x)

    jax.block_until_ready = recording
    try:
        for s in range(ONE_DEVICE_STEPS):
            w, loss = strategy.run(step, args=(w, x))
            out[f"w_{s}"] = [np.asarray(w)]
            out[f"loss_{s}"] = [np.asarray(loss)]
    finally:
        jax.block_until_ready = real
    out["waited"] = [np.asarray(waited)]
    runner: Any = strategy.extended.backend._compiled
    # The parameters returned are the last step's output array's part: passed back in,
    # that array is the input (`_worker_outputs`), with no global array built.
    (plan,) = runner._plans[strategy.extended].values()
    hit = plan.parted.get(id(w))
    out["placed"] = [np.asarray(hit is not None and hit[1] is w and hit[0].shape == w.shape)]
    out["loss_rank"] = [np.asarray(np.ndim(loss))]
    return out


ONE_DEVICE_STEPS = 5


def _compiled_main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("mode", choices=["compiled", "programs", "uneven_here", "one_device"])
    parser.add_argument("--case", choices=PROGRAM_CASES)
    parser.add_argument("--same-steps", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--stall-worker-1", type=float, default=0.0)
    args = parser.parse_args()
    out, rank = Path(args.out), int(os.environ.get("RANK", "0"))
    try:
        strategy = jax_strategy(args)
        if args.mode == "programs":
            results = programs(strategy, args.case, rank, args.same_steps)
            save(out / f"programs{rank}.npz", results)
            return
        if args.mode == "one_device":
            save(out / f"one_device{rank}.npz", one_device(rank, args.timeout))
            return
        if args.mode == "uneven_here":
            save(out / f"uneven_here{rank}.npz", uneven_here(strategy, rank))
            return
        stall = args.stall_worker_1 if rank == 1 else 0.0
        results = compiled_program(strategy, args.steps, stall)
        backend: Any = strategy.extended.backend
        results["compile_count"] = [np.asarray(backend.compile_count)]
        results["eager_fallback_count"] = [np.asarray(backend.eager_fallback_count)]
        save(out / f"compiled{rank}.npz", results)
    except Exception as e:
        write_error(out, rank, e)
        os._exit(17)


if __name__ == "__main__":
    if sys.argv[2:3] in (["compiled"], ["programs"], ["uneven_here"], ["one_device"]):
        _compiled_main()
    else:
        main(jax_strategy)
