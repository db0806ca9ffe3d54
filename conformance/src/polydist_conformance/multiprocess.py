"""One multi-worker program, run on the sim (in the test process) and as real worker processes.

A backend's multi-process tests compare the two. Each backend keeps a small
worker script that calls ``main(make_strategy)`` with its engine's
``MultiWorkerMirroredStrategy``; ``python SCRIPT OUT MODE [OPTIONS]`` is then one
worker, whose cluster comes from the environment (``TF_CONFIG``, set by
``polydist launch``, or torchrun's). Modes:

* ``compute``: the collectives and a small SGD (`program`); writes ``OUT/worker<i>.npz``.
* ``train``: SGD with a checkpoint after every step (``--ckpt DIR``), resuming from the
  latest one; ``--die-at K`` exits abruptly at step K; ``--slow`` sleeps between steps
  and writes ``OUT/progress<i>``; ``--stall-at K`` (worker 1 only) stops calling
  collectives at step K. Writes ``OUT/train<i>.npz``.
* ``late`` (worker 1 only): sleeps instead of joining.
* ``mismatch --case C``: the workers disagree on a collective (`mismatch`); writes
  ``OUT/done<i>`` if it returns.
* ``caught --case before|after|traced --fail-at K [--slow S] [--linger L]``: `caught`, a
  loop that catches every error of ``strategy.run`` and goes on, while the last replica
  (``traced``: worker 1, while its compiled step is traced) raises in step K; writes
  ``OUT/caught<i>.json``; worker 1 then waits L seconds before it ends.

A worker that fails writes ``OUT/error<i>.json`` (the error's class and message) and
exits with code 17.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import polydist as pd

D = 2  # replicas per worker
GLOBAL_BATCH = 8
FEATURES = 4
LR = 0.05


def _data(r: int, size: int = 16) -> np.ndarray:
    rng = np.random.RandomState(100 + r)
    return (rng.standard_normal(size) * 10.0 ** rng.randint(-3, 4, size)).astype(np.float32)


def regression_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(7)
    x = rng.standard_normal((64, FEATURES)).astype(np.float32)
    w = np.arange(1, FEATURES + 1, dtype=np.float32) / 4
    y = (x @ w + 0.1 * rng.standard_normal(64)).astype(np.float32)
    return x, y[:, None]


def local_components(strategy: pd.Strategy, value: Any) -> list[np.ndarray]:
    """The components this process holds, as NumPy (every worker's on the sim)."""
    backend = strategy.extended.backend
    values = value.values if isinstance(value, pd.DistributedValues) else (value,)
    return [np.asarray(backend.to_numpy(v)) for v in values]


def as_numpy(strategy: pd.Strategy, value: Any) -> np.ndarray:
    """One value (a cross-replica result), as NumPy."""
    return np.asarray(strategy.extended.backend.to_numpy(value))


def _ctx() -> pd.ReplicaContext:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return ctx


#: Dtypes whose sums wrap around or are exact (integer-valued floats), so that every
#: backend's order gives the sim's values; int16 is one gloo cannot sum itself.
NARROW_DTYPES = ("int16", "int8", "uint8", "float16", "complex64")


def _narrow_values(dtype: str, context: pd.experimental.ValueContext) -> np.ndarray:
    r = int(context.replica_id_in_sync_group) + 1
    if dtype == "complex64":
        return (np.arange(4) * r + 1j * r).astype(np.complex64)
    wide = np.array([9000, -20000, 3, 127], dtype=np.int64) * r  # int16 sums overflow
    if dtype == "float16":
        return (np.arange(4) * r).astype(np.float16)
    return wide.astype(dtype)


#: A nest all-reduced in one call (engines may pack it): (dtype, shape) of each array.
NEST = (
    ("int32", (2, 3)),
    ("float32", (5,)),
    ("int16", (4,)),
    ("float32", ()),
    ("float16", (3, 1)),
    ("int32", (7,)),
)


def _nest_values(context: pd.experimental.ValueContext) -> list[np.ndarray]:
    r = context.replica_id_in_sync_group
    return [
        ((np.arange(int(np.prod(shape))) % 7) * (r + 1) + i).astype(dtype).reshape(shape)
        for i, (dtype, shape) in enumerate(NEST)
    ]


def collectives(strategy: pd.Strategy) -> dict[str, list[np.ndarray]]:
    """Per-replica results (lists) and cross-replica results (one-element lists)."""
    out: dict[str, list[np.ndarray]] = {}
    ids = strategy.run(lambda: _ctx().replica_id_in_sync_group)
    out["replica_id"] = local_components(strategy, ids)
    values = strategy.experimental_distribute_values_from_function(
        lambda c: _data(c.replica_id_in_sync_group)
    )
    out["local_values"] = local_components(strategy, values)
    ints = strategy.experimental_distribute_values_from_function(
        lambda c: np.arange(5, dtype=np.int32) * (c.replica_id_in_sync_group + 1)
    )
    uneven = strategy.experimental_distribute_values_from_function(
        lambda c: (
            np.arange(c.replica_id_in_sync_group + 1, dtype=np.float32)
            + 10 * c.replica_id_in_sync_group
        )
    )
    out["all_reduce_sum"] = local_components(
        strategy, strategy.run(lambda v: _ctx().all_reduce(pd.ReduceOp.SUM, v), args=(values,))
    )
    out["all_reduce_mean"] = local_components(
        strategy, strategy.run(lambda v: _ctx().all_reduce(pd.ReduceOp.MEAN, v), args=(values,))
    )
    out["all_reduce_int"] = local_components(
        strategy, strategy.run(lambda v: _ctx().all_reduce(pd.ReduceOp.SUM, v), args=(ints,))
    )
    out["all_gather"] = local_components(
        strategy, strategy.run(lambda v: _ctx().all_gather(v, axis=0), args=(uneven,))
    )
    nest = strategy.experimental_distribute_values_from_function(_nest_values)
    sums = strategy.run(lambda v: _ctx().all_reduce(pd.ReduceOp.SUM, v), args=(nest,))
    for i, summed in enumerate(sums):
        out[f"all_reduce_nest_{i}"] = local_components(strategy, summed)
    # batch_reduce_to onto each value's own devices (engines may pack), and one more pair.
    pairs = [(v, v) for v in nest] + [(ints, ints)]
    for i, mirrored in enumerate(strategy.extended.batch_reduce_to(pd.ReduceOp.SUM, pairs)):
        out[f"batch_reduce_{i}"] = local_components(strategy, mirrored)
    # A call's own options, merged over the strategy's: packs of about 8 bytes.
    packed = pd.experimental.CommunicationOptions(bytes_per_pack=8)
    sums = strategy.run(
        lambda v: _ctx().all_reduce(pd.ReduceOp.SUM, v, options=packed), args=(nest,)
    )
    for i, summed in enumerate(sums):
        out[f"all_reduce_nest_packed_{i}"] = local_components(strategy, summed)
    batched = strategy.extended.batch_reduce_to(pd.ReduceOp.SUM, pairs, options=packed)
    for i, mirrored in enumerate(batched):
        out[f"batch_reduce_packed_{i}"] = local_components(strategy, mirrored)
    floats = [(nest[1], nest[1]), (nest[3], nest[3])]  # exact means: integer sums / 4
    for i, mirrored in enumerate(strategy.extended.batch_reduce_to(pd.ReduceOp.MEAN, floats)):
        out[f"batch_reduce_mean_{i}"] = local_components(strategy, mirrored)
    for dtype in NARROW_DTYPES:  # gloo refuses int16: the backend must widen it
        narrow = strategy.experimental_distribute_values_from_function(
            functools.partial(_narrow_values, dtype)
        )
        out[f"all_reduce_{dtype}"] = local_components(
            strategy, strategy.run(lambda v: _ctx().all_reduce(pd.ReduceOp.SUM, v), args=(narrow,))
        )
        out[f"gather_{dtype}"] = [as_numpy(strategy, strategy.gather(narrow, axis=0))]
    with strategy.scope():  # created on the chief, broadcast to the others
        small = pd.Variable(np.array([-3, 7, 32767], dtype=np.int16), name="small")
    out["variable_int16"] = local_components(strategy, small)
    out["reduce_sum"] = [as_numpy(strategy, strategy.reduce(pd.ReduceOp.SUM, values, axis=None))]
    out["reduce_mean"] = [as_numpy(strategy, strategy.reduce(pd.ReduceOp.MEAN, values, axis=None))]
    out["reduce_int_mean"] = [
        as_numpy(strategy, strategy.reduce(pd.ReduceOp.MEAN, ints, axis=None))
    ]
    out["reduce_axis_mean"] = [
        as_numpy(strategy, strategy.reduce(pd.ReduceOp.MEAN, uneven, axis=0))
    ]

    def merge_axis_mean(v: Any) -> Any:  # inside run: compiled on JAX
        return _ctx().merge_call(lambda s, x: s.reduce(pd.ReduceOp.MEAN, x, axis=0), args=(v,))

    merged = strategy.run(merge_axis_mean, args=(ints,))  # exact: the same in any order
    out["merge_axis_mean"] = [as_numpy(strategy, strategy.experimental_local_results(merged)[0])]
    out["gather"] = [as_numpy(strategy, strategy.gather(uneven, axis=0))]
    out["host_sum"] = [
        as_numpy(strategy, strategy.reduce(pd.ReduceOp.SUM, np.float32(1.5), axis=None))
    ]
    # A host value gathers as one component per worker (TF): every worker's copy.
    host = np.arange(3, dtype=np.float32)
    out["host_gather"] = [as_numpy(strategy, strategy.gather(host, axis=0))]
    worker = int(out["replica_id"][0]) // D  # this worker's index (0 on the sim)
    out["host_gather_workers"] = [
        as_numpy(strategy, strategy.gather(np.full((1, 2), worker, np.int32), axis=0))
    ]
    flags = strategy.experimental_distribute_values_from_function(
        lambda c: np.array([True, c.replica_id_in_sync_group % 2 == 0])
    )
    refused = []
    cases: list[tuple[pd.ReduceOp, Any, int | None]] = [
        (pd.ReduceOp.SUM, flags, None),
        (pd.ReduceOp.MEAN, flags, 0),
        (pd.ReduceOp.SUM, np.bool_(True), None),
    ]
    for op, value, axis in cases:
        try:  # every worker refuses before any collective, so they stay in step
            strategy.reduce(op, value, axis=axis)
            refused.append(False)
        except TypeError as e:
            refused.append("cannot SUM bool" in str(e))
    out["bool_refused"] = [np.asarray(refused)]
    pipelines: list[tuple[int, int]] = []

    def dataset_fn(ctx: pd.InputContext) -> Any:
        pipelines.append((ctx.num_input_pipelines, ctx.input_pipeline_id))
        return pd.data.Dataset.range(4).batch(1)

    strategy.distribute_datasets_from_function(dataset_fn)
    out["input_pipelines"] = [np.asarray(pipelines, dtype=np.int64)]
    return out


def make_sgd(strategy: pd.Strategy) -> tuple[Any, Any]:
    """The weights (a MirroredVariable) and the distributed dataset."""
    x, y = regression_data()
    with strategy.scope():
        w = pd.Variable(np.zeros((FEATURES, 1), dtype=np.float32), name="w")
    options = pd.data.Options()
    options.experimental_distribute.auto_shard_policy = pd.data.AutoShardPolicy.DATA
    dataset = pd.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).with_options(options)
    return w, strategy.experimental_distribute_dataset(dataset)


def sgd_step(strategy: pd.Strategy, w: Any, batch: Any) -> tuple[Any, Any]:
    """One step; returns (per-replica local gradients, all-reduced gradient)."""

    def grad(x: Any, y: Any) -> Any:
        wv = w.read_value()
        local = 2.0 * (x.T @ (x @ wv - y)) / GLOBAL_BATCH
        return local, _ctx().all_reduce(pd.ReduceOp.SUM, local)

    local, total = strategy.run(grad, args=batch)
    w.assign_sub(LR * strategy.experimental_local_results(total)[0])
    return local, total


def sgd(strategy: pd.Strategy, steps: int) -> dict[str, list[np.ndarray]]:
    w, dist = make_sgd(strategy)
    out: dict[str, list[np.ndarray]] = {}
    for step, batch in zip(range(steps), dist):
        local, total = sgd_step(strategy, w, batch)
        out[f"sgd_local_{step}"] = local_components(strategy, local)
        out[f"sgd_total_{step}"] = local_components(strategy, total)
        out[f"sgd_w_{step}"] = [as_numpy(strategy, w.read_value())]
    return out


def program(strategy: pd.Strategy, steps: int = 3) -> dict[str, list[np.ndarray]]:
    return {**collectives(strategy), **sgd(strategy, steps)}


MISMATCH_CASES = (
    "op",
    "shape",
    "reduce_op",
    "extra",
    "early_exit",
    "run_or_gather",
    "chief_only_save",
)


def mismatch_site(marker: str) -> str:
    """``multiprocess.py:N``: the line of `mismatch` that ends ``# mismatch: <marker>``."""
    lines = Path(__file__).read_text().splitlines()
    hits = [n for n, text in enumerate(lines, start=1) if text.endswith(f"# mismatch: {marker}")]
    if len(hits) != 1:
        raise ValueError(f"{len(hits)} lines of {__file__} end with '# mismatch: {marker}'")
    return f"{Path(__file__).name}:{hits[0]}"


def mismatch(strategy: pd.Strategy, case: str, rank: int, out: Path | None = None) -> None:
    """One agreeing collective, then worker 0 and worker 1 disagree on the next one. Each
    disagreeing call ends with ``# mismatch: <case>`` (and `` (worker <i>)`` where the
    workers' calls are on different lines): see `mismatch_site`."""
    values = strategy.experimental_distribute_values_from_function(
        lambda c: np.full(3, c.replica_id_in_sync_group, dtype=np.float32)
    )

    def sums(v: Any) -> Any:
        return _ctx().all_reduce(pd.ReduceOp.SUM, v)  # mismatch: op (worker 0)

    def gathers(v: Any) -> Any:
        return _ctx().all_gather(v, axis=0)  # mismatch: op (worker 1)

    def sums_ones(size: int) -> Any:
        return _ctx().all_reduce(pd.ReduceOp.SUM, np.ones(size, np.float32))  # mismatch: shape

    def sums_again(v: Any) -> Any:
        return _ctx().all_reduce(pd.ReduceOp.SUM, v)  # mismatch: run_or_gather (worker 0)

    strategy.run(lambda v: _ctx().all_reduce(pd.ReduceOp.SUM, v), args=(values,))
    if case == "op":
        strategy.run(sums if rank == 0 else gathers, args=(values,))
    elif case == "shape":
        strategy.run(sums_ones, args=(3 if rank == 0 else 4,))
    elif case == "reduce_op":
        op = pd.ReduceOp.SUM if rank == 0 else pd.ReduceOp.MEAN
        strategy.reduce(op, values, axis=None)  # mismatch: reduce_op
    elif case == "extra":
        if rank == 0:
            strategy.reduce(pd.ReduceOp.SUM, values, axis=None)  # mismatch: extra (worker 0)
        strategy.gather(values, axis=0)  # mismatch: extra (worker 1)
    elif case == "early_exit":
        if rank == 0:
            strategy.reduce(pd.ReduceOp.SUM, values, axis=None)  # mismatch: early_exit (worker 0)
    elif case == "run_or_gather":
        if rank == 0:
            strategy.run(sums_again, args=(values,))  # mismatch: run_or_gather (run)
        else:
            strategy.gather(values, axis=0)  # mismatch: run_or_gather (worker 1)
    elif case == "chief_only_save":  # only the chief saves: its read of `total` is checked
        with strategy.scope():
            total = pd.Variable(
                np.float32(0),
                name="total",
                synchronization=pd.VariableSynchronization.ON_READ,
                aggregation=pd.VariableAggregation.SUM,
            )
        strategy.run(lambda: total.assign(np.float32(rank + 1)))
        assert out is not None
        if rank == 0:
            pd.checkpoint.save(out / "ckpt", strategy)  # mismatch: chief_only_save (worker 0)
        strategy.run(lambda: _ctx().all_reduce(pd.ReduceOp.SUM, np.float32(10)))
    else:
        raise ValueError(f"unknown mismatch case {case!r}; expected one of {MISMATCH_CASES}")


CAUGHT_CASES = ("before", "after", "traced")


def caught_expected(step: int) -> float:
    """What every replica of `caught`'s ``step`` returns when nothing fails."""
    replicas = 2 * D
    return float(replicas * (10 * step + 1) + replicas * (10 * step + 2))


def caught(
    strategy: pd.Strategy,
    case: str,
    fail_at: int,
    steps: int,
    rank: int = 0,
    late: float = 0.0,
) -> list[dict[str, Any]]:
    """``steps`` steps of two all_reduces each, in a loop that catches the errors of
    ``strategy.run`` and goes on; in step ``fail_at`` the last replica (on the last
    worker) raises ``ValueError``, ``before`` its first all_reduce or ``after`` it (its
    worker's other replica then waits in the local part of a collective that never
    runs across the workers). Case ``traced``, for a compiled step (whose function runs
    only while it is traced, where the replica id is not a Python int): worker 1
    (``rank``) raises before its first all_reduce, in each of its replicas (the step's
    ``step`` is a static value: every step is traced). Worker 0 starts step ``fail_at``
    ``late`` seconds late. Returns each step's outcome: ``{"values": [...]}`` (this
    worker's replicas') or ``{"type": ..., "message": ...}``."""
    last = 2 * D - 1

    def step_fn(step: int) -> Any:
        ctx = _ctx()
        if case == "traced":
            if step == fail_at and rank == 1:
                time.sleep(1.0)  # the peers wait in the step's collective
                raise ValueError(f"worker 1 fails while its step {step} is traced")
            failing = False
        else:
            failing = step == fail_at and int(ctx.replica_id_in_sync_group) == last
        if failing and case == "before":
            time.sleep(1.0)  # the peers wait in the step's collective (the fast path)
            raise ValueError(f"replica {last} fails before its all_reduce")
        x = ctx.all_reduce(pd.ReduceOp.SUM, np.float32(10 * step + 1))
        if failing and case == "after":
            time.sleep(1.0)
            raise ValueError(f"replica {last} fails after its all_reduce")
        return x + ctx.all_reduce(pd.ReduceOp.SUM, np.float32(10 * step + 2))

    outcomes: list[dict[str, Any]] = []
    for step in range(steps):
        if step == fail_at and rank == 0:
            time.sleep(late)
        try:
            result = strategy.run(step_fn, args=(step,))
            values = [float(v) for v in local_components(strategy, result)]
            outcomes.append({"values": values})
        except Exception as e:  # what the program under test does: go on
            outcomes.append({"type": type(e).__name__, "message": str(e)})
    return outcomes


def save(path: Path, results: dict[str, list[np.ndarray]]) -> None:
    """Writes ``results`` for `load`."""
    arrays = {f"{k}#{i}": v for k, vs in results.items() for i, v in enumerate(vs)}
    np.savez(path, **arrays)  # type: ignore[arg-type]  # stubs type savez kwargs as flags


def load(path: Path) -> dict[str, list[np.ndarray]]:
    out: dict[str, list[np.ndarray]] = {}
    with np.load(path) as data:
        for name in sorted(data.files, key=lambda n: (n.split("#")[0], int(n.split("#")[1]))):
            out.setdefault(name.split("#")[0], []).append(data[name])
    return out


def _train(strategy: pd.Strategy, args: argparse.Namespace, out: Path, rank: int) -> None:
    w, dist = make_sgd(strategy)
    start = 0
    if args.ckpt and pd.checkpoint.latest_checkpoint(args.ckpt) is not None:
        manifest = pd.checkpoint.restore(args.ckpt, strategy)
        start = manifest.step + 1
    iterator = iter(dist)
    saved = 0
    for step in range(args.steps):
        batch = next(iterator)
        if step < start:
            continue  # already in the checkpoint: skip its batch
        if args.die_at is not None and step == args.die_at and rank == 1:
            os._exit(3)
        if args.stall_at is not None and step == args.stall_at and rank == 1:
            time.sleep(120)
        sgd_step(strategy, w, batch)
        if args.ckpt and pd.checkpoint.save(args.ckpt, strategy, step=step) is not None:
            saved += 1
        if args.slow:
            # The step's collectives are done (an asynchronous dispatch returns before
            # them): a kill after this report lands between steps, not inside one.
            as_numpy(strategy, w.read_value())
            # Atomically: a reader never sees the file truncated.
            (out / f"progress{rank}.tmp").write_text(str(step))
            os.replace(out / f"progress{rank}.tmp", out / f"progress{rank}")
            time.sleep(args.slow)
    save(
        out / f"train{rank}.npz",
        {
            "w": [as_numpy(strategy, w.read_value())],
            "saved": [np.asarray(saved)],
            "start": [np.asarray(start)],
        },
    )


def write_error(out: Path, rank: int, error: BaseException) -> None:
    """Records ``error`` as worker ``rank``'s (``error<rank>.json``, what the harness's
    ``multiprocess_tests.error`` reads); the worker then exits with code 17."""
    record = {
        "type": type(error).__name__,
        "message": str(error),
        "time": time.time(),
        "traceback": traceback.format_exc(),
    }
    (out / f"error{rank}.json").write_text(json.dumps(record))
    sys.stdout.flush()


def wait_for_peers(out: Path, rank: int, seconds: float = 30.0) -> None:
    """Worker 0 leaves last: it hosts the cluster's coordination service (JAX's), and
    its exit ends the others at once, before a slower one has written its own outcome.
    It waits (at most ``seconds``) until every worker that joined wrote one."""
    if rank != 0:
        return
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        joined = {p.name.removeprefix("joined") for p in out.glob("joined*")}
        ended = {p.name.removeprefix("error").removesuffix(".json") for p in out.glob("error*")}
        ended |= {p.name.removeprefix("done") for p in out.glob("done*")}
        if joined <= ended:
            return
        time.sleep(0.05)


def wait_for_peers_outcome(out: Path, rank: int, name: str, seconds: float = 30.0) -> None:
    """Worker 0 waits (at most ``seconds``) until every worker wrote ``OUT/<name><i>.json``
    (see `wait_for_peers`)."""
    if rank != 0:
        return
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        joined = {p.name.removeprefix("joined") for p in out.glob("joined*")}
        ended = {p.name.removeprefix(name).removesuffix(".json") for p in out.glob(f"{name}*")}
        if joined <= ended:
            return
        time.sleep(0.05)


def main(make_strategy: Callable[[argparse.Namespace], pd.Strategy]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("mode", choices=["compute", "train", "late", "mismatch", "caught"])
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ckpt")
    parser.add_argument("--die-at", type=int)
    parser.add_argument("--stall-at", type=int)
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--case", choices=MISMATCH_CASES + CAUGHT_CASES)
    parser.add_argument("--fail-at", type=int, default=0)
    parser.add_argument("--linger", type=float, default=0.0)
    args = parser.parse_args()
    out = Path(args.out)
    rank = int(os.environ.get("RANK", "0"))
    try:
        if args.mode == "late" and rank == 1:
            time.sleep(120)
        strategy = make_strategy(args)
        (out / f"joined{rank}").write_text(f"{time.time()}")
        if args.mode == "compute":
            save(out / f"worker{rank}.npz", program(strategy, args.steps))
        elif args.mode == "train":
            _train(strategy, args, out, rank)
        elif args.mode == "mismatch":
            mismatch(strategy, args.case, rank, out)
            (out / f"done{rank}").write_text(f"{time.time()}")
        elif args.mode == "caught":
            outcomes = caught(strategy, args.case, args.fail_at, args.steps, rank, args.slow)
            (out / f"caught{rank}.json").write_text(json.dumps(outcomes))
            wait_for_peers_outcome(out, rank, "caught")
            if rank == 1:
                time.sleep(args.linger)  # its process stays (a peer may be in a collective)
        else:
            strategy.run(lambda: _ctx().all_reduce(pd.ReduceOp.SUM, np.float32(1)))
    except Exception as e:
        write_error(out, rank, e)
        if args.mode == "mismatch":  # every worker raises: let each report its own
            wait_for_peers(out, rank)
        os._exit(17)
