"""Multi-worker training step: MultiWorkerMirroredStrategy vs hand-written engine code.

Two worker processes on 127.0.0.1 (``polydist launch``'s machinery, as
``bench_multiworker.py``), one replica each. Each step trains an MLP
(``width -> width -> width -> 1``, ReLU, float32, SGD) on the worker's shard of
the batch (`LOCAL_BATCH` rows), sums the gradients across the workers and
updates every worker's copy of the weights. The widths give about 1, 4, 16 and
64 MiB of gradients (`WIDTHS`).

Contestants, in one run, on the same data and starting weights:

* torch **polydist**: the idiom the torch docs give for training an
  ``nn.Module`` (docs/backends/torch.md), ``distribute_module`` +
  ``distribute_optimizer``: ``strategy.run`` of a replica function that calls
  ``loss.backward()``, ``opt.step()`` (which sums the gradients across the
  workers: with one replica per worker, in the optimizer's own flat gradient
  bucket, in place) and ``opt.zero_grad()``, on
  ``pd.MultiWorkerMirroredStrategy(backend="torch")``;
* torch **polydist, ctx.all_reduce** (informational): TF's idiom in the replica
  function, ``ctx.all_reduce(SUM, [p.grad ...])`` (out of place: a copy into one
  flat buffer), the sums assigned to ``p.grad``, ``torch.optim.SGD`` stepped;
* torch **hand-written**, DDP's two ways with ``torch.distributed.all_reduce``
  over gloo: **bucket** (the gradients are views of one flat buffer, DDP's
  ``gradient_as_bucket_view``: one in-place all_reduce, no copy) and **per
  parameter** (an in-place all_reduce of each ``p.grad``);
* torch, informational, **copy bucket**: what polydist's semantics cost at
  least, by hand: the gradients copied into one flat buffer (TF's all_reduce
  leaves its input unchanged), one in-place all_reduce, views handed out;
* JAX **polydist**: ``strategy.run`` of a function that takes the weights and
  the shard, computes ``jax.grad``, ``ctx.all_reduce(SUM, grads)`` and returns
  the new weights (passed in again at the next step), on
  ``pd.MultiWorkerMirroredStrategy(backend="jax")``: one compiled program per
  step, behind the workers' agreement on it (a tiny all-gather of their
  program digests, dispatched right before it and the only thing the host
  waits for), which packs the gradients below 1 MiB into one all-reduce
  operand;
* JAX **hand-written**: the same function as one ``jax.jit(jax.shard_map(...))``
  over the multi-process mesh (``jax.distributed``), the weights replicated, in
  two ways: ``lax.psum`` of the gradients' list (XLA:CPU runs each operand as a
  collective of its own across processes) and **packed**: ``lax.psum`` of the
  gradients concatenated into one flat array, split afterwards;
* JAX, informational, **agreed packed**: what polydist's semantics cost at
  least, by hand: the workers' digests all-gathered in a program of their own
  and read back on the host, the packed step under a ``lax.cond`` on them.

Each sample is a burst of back-to-back steps after a barrier; the contestants
alternate round by round; the time is worker 0's median sample. ``ratio =
hand-written time / polydist time`` against the faster hand-written variant
(target >= 0.95: polydist keeps at least 95% of the hand-written step rate).
The collective check (``$POLYDIST_CHECK_COLLECTIVES``) is on, its default.

    python benchmarks/bench_multiworker_step.py                  # engines importable here
    python benchmarks/bench_multiworker_step.py --engine torch   # one engine

Engines live in different virtualenvs: run the script once in each; rows of
an engine that did not run are kept from the existing results file.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import io
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, machine, today

NAME = "multiworker-step-cpu"
TARGET = 0.95
WORKERS = 2
LOCAL_BATCH = 64
GLOBAL_BATCH = WORKERS * LOCAL_BATCH
LR = 1e-3
#: MLP width -> about this many MiB of float32 gradients (2 w^2 + 3 w + 1 numbers).
WIDTHS = {1: 362, 4: 724, 16: 1448, 64: 2896}
#: ``BENCH_SIZES=1,4``: only those sizes (MiB), for a quick look (use ``--name``).
if os.environ.get("BENCH_SIZES"):
    WIDTHS = {int(m): WIDTHS[int(m)] for m in os.environ["BENCH_SIZES"].split(",")}
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "15"))
#: ``BENCH_PIPELINED=1`` (JAX; informational): steps in flight, as a training loop that
#: does not read each step's results runs them: each burst of steps waits once, at its
#: end, instead of after every step (then use ``--name``).
PIPELINED = os.environ.get("BENCH_PIPELINED") == "1"
CHECK_ENV = "POLYDIST_CHECK_COLLECTIVES"


def _grad_mib(width: int) -> float:
    return (2 * width * width + 3 * width + 1) * 4 / 2**20


def _burst(mib: int) -> int:
    return max(2, 16 // mib)


def _data(width: int, rank: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """This worker's shard, and the starting weights (the same on every worker)."""
    g = np.random.default_rng(0)
    shapes = [(width, width), (width,), (width, width), (width,), (1, width), (1,)]
    weights = [(g.standard_normal(s) / np.sqrt(width)).astype(np.float32) for s in shapes]
    x = g.standard_normal((GLOBAL_BATCH, width)).astype(np.float32)
    y = g.standard_normal((GLOBAL_BATCH, 1)).astype(np.float32)
    part = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    return x[part], y[part], weights


def _medians(
    fns: dict[str, Callable[[], None]],
    burst: int,
    barrier: Callable[[], None],
    settle: dict[str, Callable[[], None]] | None = None,
) -> dict[str, float]:
    """Median time per step of each contestant; they alternate, after two warm-up rounds.
    ``settle``: per contestant, what waits for its steps at the end of each burst."""
    for _ in range(2):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(ROUNDS):
        names = list(fns) if i % 2 == 0 else list(reversed(fns))
        for name in names:
            barrier()
            start = time.perf_counter()
            for _ in range(burst):
                fns[name]()
            if settle is not None:
                settle[name]()
            times[name].append((time.perf_counter() - start) / burst)
    return {name: statistics.median(t) for name, t in times.items()}


# --------------------------------------------------------------------------- torch


def _torch_worker() -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist
    from torch import nn

    import polydist as pd
    import polydist_torch

    torch.set_num_threads(1)
    strategy = pd.MultiWorkerMirroredStrategy(backend="torch", local_devices=1)
    rank = dist.get_rank()

    def model_of(weights: list[np.ndarray]) -> nn.Module:
        width = weights[0].shape[0]
        model = nn.Sequential(
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, 1),
        )  # fmt: skip
        with torch.no_grad():
            for p, w in zip(model.parameters(), weights, strict=True):
                p.copy_(torch.from_numpy(w))
        return model

    rows = []
    for mib, width in WIDTHS.items():
        xn, yn, weights = _data(width, rank)
        x, y = torch.from_numpy(xn), torch.from_numpy(yn)

        # polydist, informational: TF's idiom in the replica function.
        model = model_of(weights)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        params = list(model.parameters())

        def replica_step(
            x: torch.Tensor,
            y: torch.Tensor,
            model: nn.Module = model,
            opt: torch.optim.Optimizer = opt,
            params: list[torch.Tensor] = params,
        ) -> torch.Tensor:
            ctx = pd.get_replica_context()
            assert ctx is not None
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).sum() / GLOBAL_BATCH
            loss.backward()
            summed = ctx.all_reduce(pd.ReduceOp.SUM, [p.grad for p in params])
            for p, g in zip(params, summed, strict=True):
                p.grad = g
            opt.step()
            return loss.detach()

        def all_reduce_step(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            strategy.run(replica_step, args=(x, y))

        # Hand-written, DDP's bucket: the gradients are views of one flat buffer.
        bucket_model = model_of(weights)
        bucket_opt = torch.optim.SGD(bucket_model.parameters(), lr=LR)
        bucket_params = list(bucket_model.parameters())
        flat = torch.zeros(sum(p.numel() for p in bucket_params))
        offset = 0
        for p in bucket_params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

        def bucket_step(
            x: torch.Tensor = x,
            y: torch.Tensor = y,
            model: nn.Module = bucket_model,
            opt: torch.optim.Optimizer = bucket_opt,
            flat: torch.Tensor = flat,
        ) -> None:
            flat.zero_()  # zero_grad(set_to_none=False): backward accumulates into the views
            loss = ((model(x) - y) ** 2).sum() / GLOBAL_BATCH
            loss.backward()
            dist.all_reduce(flat)
            opt.step()

        # Hand-written, per parameter: an in-place all_reduce of each gradient.
        each_model = model_of(weights)
        each_opt = torch.optim.SGD(each_model.parameters(), lr=LR)
        each_params = list(each_model.parameters())

        def per_parameter_step(
            x: torch.Tensor = x,
            y: torch.Tensor = y,
            model: nn.Module = each_model,
            opt: torch.optim.Optimizer = each_opt,
            params: list[torch.Tensor] = each_params,
        ) -> None:
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).sum() / GLOBAL_BATCH
            loss.backward()
            for p in params:
                dist.all_reduce(p.grad)
            opt.step()

        # Hand-written with polydist's semantics: the gradients copied into one flat
        # buffer (the input left unchanged), reduced in place, handed out as views.
        copy_model = model_of(weights)
        copy_opt = torch.optim.SGD(copy_model.parameters(), lr=LR)
        copy_params = list(copy_model.parameters())
        copy_flat = torch.empty(sum(p.numel() for p in copy_params))
        copy_sizes = [p.numel() for p in copy_params]

        def copy_step(
            x: torch.Tensor = x,
            y: torch.Tensor = y,
            model: nn.Module = copy_model,
            opt: torch.optim.Optimizer = copy_opt,
            params: list[torch.Tensor] = copy_params,
            flat: torch.Tensor = copy_flat,
            sizes: list[int] = copy_sizes,
        ) -> None:
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).sum() / GLOBAL_BATCH
            loss.backward()
            torch.cat([p.grad.reshape(-1) for p in params], out=flat)
            dist.all_reduce(flat)
            for p, g in zip(params, flat.split(sizes), strict=True):
                p.grad = g.view_as(p)
            opt.step()

        # polydist: polydist_torch's idiom for nn.Module training (the docs'):
        # distribute_module + distribute_optimizer, whose step() sums the gradients.
        with strategy.scope():
            dmodel = polydist_torch.distribute_module(model_of(weights))
        dopt = polydist_torch.distribute_optimizer(torch.optim.SGD(dmodel.parameters(), lr=LR))

        def optimizer_replica_step(
            x: torch.Tensor, y: torch.Tensor, model: Any = dmodel, opt: Any = dopt
        ) -> torch.Tensor:
            loss = ((model(x) - y) ** 2).sum() / GLOBAL_BATCH
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        def polydist_step(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            strategy.run(optimizer_replica_step, args=(x, y))

        times = _medians(
            {
                "polydist": polydist_step,
                "polydist_all_reduce": all_reduce_step,
                "bucket": bucket_step,
                "per_parameter": per_parameter_step,
                "copy_bucket": copy_step,
            },
            _burst(mib),
            dist.barrier,
        )
        # Same arithmetic: the three models took the same steps (sums in gloo's order).
        for other in (bucket_params, each_params, copy_params, list(dmodel.parameters())):
            for a, b in zip(params, other, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        rows.append(_row("torch", f"torch {torch.__version__} gloo", width, times))
    return rows


# --------------------------------------------------------------------------- JAX


def _jax_worker() -> list[dict[str, Any]]:
    import polydist as pd

    strategy = pd.MultiWorkerMirroredStrategy(backend="jax", local_devices=1)
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = [
        min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
        for p in range(jax.process_count())
    ]
    rank = jax.process_index()
    mine = devices[rank]
    mesh = Mesh(np.array(devices, dtype=object), ("p",))
    split, replicated = NamedSharding(mesh, P("p")), NamedSharding(mesh, P())
    sync = jax.jit(
        jax.shard_map(lambda t: jax.lax.psum(t, "p"), mesh=mesh, in_specs=P("p"), out_specs=P())
    )
    token = jax.make_array_from_single_device_arrays(
        (WORKERS, 1), split, [jax.device_put(np.ones((1, 1), np.float32), mine)]
    )

    def barrier() -> None:
        sync(token).block_until_ready()

    def loss_fn(w: list[Any], x: Any, y: Any) -> Any:
        h = jax.nn.relu(x @ w[0].T + w[1])
        h = jax.nn.relu(h @ w[2].T + w[3])
        return jnp.sum((h @ w[4].T + w[5] - y) ** 2) / GLOBAL_BATCH

    def polydist_fn(w: list[Any], x: Any, y: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(w, x, y)
        ctx = pd.get_replica_context()
        assert ctx is not None
        grads = ctx.all_reduce(pd.ReduceOp.SUM, grads)
        return [p - LR * g for p, g in zip(w, grads, strict=True)], loss

    def hand_fn(w: list[Any], x: Any, y: Any) -> Any:
        # pcast: the gradient of a replicated input would already be summed over workers.
        varying = jax.lax.pcast(w, "p", to="varying")
        loss, grads = jax.value_and_grad(loss_fn)(varying, x, y)
        grads = jax.lax.psum(grads, "p")
        return [p - LR * g for p, g in zip(w, grads, strict=True)], loss[None]

    def packed_fn(w: list[Any], x: Any, y: Any) -> Any:
        varying = jax.lax.pcast(w, "p", to="varying")
        loss, grads = jax.value_and_grad(loss_fn)(varying, x, y)
        flat = jax.lax.psum(jnp.concatenate([g.reshape(-1) for g in grads]), "p")
        ends = list(itertools.accumulate(g.size for g in grads))
        sums = [p.reshape(g.shape) for p, g in zip(jnp.split(flat, ends[:-1]), grads, strict=True)]
        return [p - LR * g for p, g in zip(w, sums, strict=True)], loss[None]

    def compiled(fn: Callable[..., Any]) -> Any:
        specs = {"in_specs": (P(), P("p"), P("p")), "out_specs": (P(), P("p"))}
        return jax.jit(jax.shard_map(fn, mesh=mesh, **specs))

    hand, packed = compiled(hand_fn), compiled(packed_fn)

    # polydist's semantics by hand: each worker's program digest all-gathered in a
    # program of its own, the packed step under lax.cond on the digests, the host
    # reading the digests back (what polydist's compiled step runs, without its Python).
    gather = jax.jit(
        jax.shard_map(
            functools.partial(jax.lax.all_gather, axis_name="p", tiled=True),
            mesh=mesh,
            in_specs=P("p"),
            out_specs=P(),
            check_vma=False,
        )
    )
    mine_digest = np.arange(8, dtype=np.uint32)[None] + 1
    digest = jax.make_array_from_single_device_arrays(
        (WORKERS, 8), split, [jax.device_put(mine_digest, mine)]
    )
    expected = np.repeat(mine_digest, WORKERS, axis=0).tobytes()

    @jax.jit
    def agreed_packed(rows: Any, w: list[Any], x: Any, y: Any) -> Any:
        shapes = jax.eval_shape(packed, w, x, y)
        zeros = functools.partial(jax.tree.map, lambda s: jnp.zeros(s.shape, s.dtype))
        return jax.lax.cond(
            jnp.all(rows == rows[0]), lambda: packed(w, x, y), lambda: zeros(shapes)
        )

    def global_of(local: np.ndarray, sharding: NamedSharding, stacked: bool) -> Any:
        block = jax.device_put(local, mine)
        shape = (WORKERS * local.shape[0], *local.shape[1:]) if stacked else local.shape
        return jax.make_array_from_single_device_arrays(shape, sharding, [block])

    rows = []
    for mib, width in WIDTHS.items():
        xn, yn, weights = _data(width, rank)
        x, y = jax.device_put(xn, mine), jax.device_put(yn, mine)
        state: dict[str, Any] = {"w": [jax.device_put(w, mine) for w in weights]}

        def polydist_step(state: dict[str, Any] = state, x: Any = x, y: Any = y) -> None:
            out = strategy.run(polydist_fn, args=(state["w"], x, y))
            w, _loss = strategy.experimental_local_results(out)[0]
            state["w"] = w
            if not PIPELINED:
                jax.block_until_ready(w)

        hand_state: dict[str, Any] = {"w": [global_of(w, replicated, False) for w in weights]}
        gx, gy = global_of(xn, split, True), global_of(yn, split, True)

        packed_state: dict[str, Any] = {"w": list(hand_state["w"])}
        agreed_state: dict[str, Any] = {"w": list(hand_state["w"])}

        def hand_step(
            state: dict[str, Any] = hand_state, x: Any = gx, y: Any = gy, step: Any = hand
        ) -> None:
            w, _loss = step(state["w"], x, y)
            state["w"] = w
            if not PIPELINED:
                jax.block_until_ready(w)

        def packed_step(state: dict[str, Any] = packed_state, x: Any = gx, y: Any = gy) -> None:
            hand_step(state, x, y, packed)

        def agreed_step(state: dict[str, Any] = agreed_state, x: Any = gx, y: Any = gy) -> None:
            rows = gather(digest)
            w, _loss = agreed_packed(rows, state["w"], x, y)
            if np.asarray(rows).tobytes() != expected:
                raise RuntimeError(
                    f"agreed packed step: gathered digests {np.asarray(rows).tolist()}, "
                    "expected every worker's row to equal this one's; the workers' "
                    "benchmark programs differ (run them from the same checkout)"
                )
            state["w"] = w
            if not PIPELINED:
                jax.block_until_ready(w)

        states = {
            "polydist": state,
            "jit_shard_map": hand_state,
            "packed": packed_state,
            "agreed_packed": agreed_state,
        }
        times = _medians(
            {
                "polydist": polydist_step,
                "jit_shard_map": hand_step,
                "packed": packed_step,
                "agreed_packed": agreed_step,
            },
            _burst(mib),
            barrier,
            {k: functools.partial(_wait, jax, s) for k, s in states.items()} if PIPELINED else None,
        )
        for other in (hand_state, packed_state, agreed_state):
            for a, b in zip(state["w"], other["w"], strict=True):
                np.testing.assert_allclose(
                    np.asarray(a), np.asarray(b.addressable_data(0)), rtol=1e-4, atol=1e-6
                )
        rows.append(_row("jax", f"jax {jax.__version__} gloo", width, times))
    return rows


# --------------------------------------------------------------------------- rows


_HAND = {"torch": ("bucket", "per_parameter"), "jax": ("jit_shard_map", "packed")}
#: Hand-written code with polydist's semantics (informational: no target).
_SAME_SEMANTICS = {"torch": "copy_bucket", "jax": "agreed_packed"}
_HAND_WORDS = {
    "agreed_packed": "the same semantics by hand (the workers' digests all-gathered in a "
    "program of their own and read back, the packed step under lax.cond on them)",
    "copy_bucket": "the same semantics by hand (the gradients copied into one flat buffer, "
    "one in-place dist.all_reduce, views handed out)",
    "bucket": "hand-written DDP bucket (gradient views of one flat buffer, one in-place "
    "dist.all_reduce)",
    "per_parameter": "hand-written in-place dist.all_reduce per gradient",
    "jit_shard_map": "hand-written jit(shard_map), lax.psum of the gradients",
    "packed": "hand-written jit(shard_map), lax.psum of the gradients concatenated",
}


def _wait(jax: Any, state: dict[str, Any]) -> None:
    jax.block_until_ready(state["w"])


def _row(engine: str, label: str, width: int, times: dict[str, float]) -> dict[str, Any]:
    best = min(_HAND[engine], key=lambda k: times[k])
    row: dict[str, Any] = {
        "engine": engine,
        "collective": label,
        "checked": os.environ.get(CHECK_ENV, "1") != "0",
        "workers": WORKERS,
        "replicas_per_worker": 1,
        "width": width,
        "grad_mib": _grad_mib(width),
        "local_batch": LOCAL_BATCH,
        "rounds": ROUNDS,
        "burst": _burst(round(_grad_mib(width))),
        "pipelined": PIPELINED and engine == "jax",
        "baseline": best,
        "ratio": times[best] / times["polydist"],
    }
    for name, seconds in times.items():
        row[f"{name}_s"] = seconds
        if not name.startswith("polydist"):
            row[f"ratio_vs_{name}"] = seconds / times["polydist"]
    if "polydist_all_reduce" in times:
        row["all_reduce_ratio"] = times[best] / times["polydist_all_reduce"]
    return row


def worker(engine: str, out: Path) -> None:
    rows = _torch_worker() if engine == "torch" else _jax_worker()
    if os.environ.get("RANK", os.environ.get("POLYDIST_PROCESS_ID", "0")) == "0":
        out.write_text(json.dumps(rows))


# --------------------------------------------------------------------------- driver


def _available(engine: str) -> bool:
    return importlib.util.find_spec(f"polydist_{engine}") is not None


def run_engine(engine: str, timeout: float) -> list[dict[str, Any]]:
    from polydist.backend import launch as _launch

    with tempfile.TemporaryDirectory(prefix="polydist-bench-") as tmp:
        out = Path(tmp) / "rows.json"
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TF_CONFIG")}
        log = io.StringIO()
        result = _launch.launch(
            WORKERS,
            str(Path(__file__).resolve()),
            ["--worker", engine, str(out)],
            timeout=timeout,
            stdout=log,
            stderr=log,
            env=env,
        )
        if result.exit_code != 0 or not out.exists():
            raise SystemExit(f"{engine} workers failed: {result.message}\n{log.getvalue()[-4000:]}")
        rows: list[dict[str, Any]] = json.loads(out.read_text())
        return rows


def _ratios(row: dict[str, Any]) -> list[dict[str, Any]]:
    size = f"{row['grad_mib']:.1f} MiB of gradients (width {row['width']})"
    idiom = " (distribute_module + distribute_optimizer)" if row["engine"] == "torch" else ""
    if row.get("pipelined"):  # informational: the target is the step waited for
        idiom = ", steps in flight (each burst waits at its end)"
    out = [
        {
            "case": f"{row['engine']} MLP step{idiom}, {size}, vs the faster hand-written step "
            f"({_HAND_WORDS[row['baseline']]})",
            "ratio": row["ratio"],
            "target": "" if row.get("pipelined") else f">= {TARGET}",
            "met": None if row.get("pipelined") else row["ratio"] >= TARGET,
        }
    ]
    if "all_reduce_ratio" in row:
        out.append(
            {
                "case": f"{row['engine']} MLP step, {size}, TF's idiom (ctx.all_reduce of the "
                f"gradients, out of place, into p.grad; torch.optim.SGD), vs the faster "
                f"hand-written step ({_HAND_WORDS[row['baseline']]})",
                "ratio": row["all_reduce_ratio"],
                "target": "",
                "met": None,
            }
        )
    for name in (*_HAND[row["engine"]], _SAME_SEMANTICS.get(row["engine"], "")):
        if name and name != row["baseline"] and f"ratio_vs_{name}" in row:
            out.append(
                {
                    "case": f"{row['engine']} MLP step, {size}, vs {_HAND_WORDS[name]}",
                    "ratio": row[f"ratio_vs_{name}"],
                    "target": "",
                    "met": None,
                }
            )
    return [{**ratio, "device": "CPU"} for ratio in out]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["torch", "jax"], action="append")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument(
        "--name", default=NAME, help=f"results file benchmarks/results/NAME.json ({NAME})"
    )
    parser.add_argument("--worker", nargs=2, metavar=("ENGINE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]))
        return 0
    engines = args.engine or [e for e in ("torch", "jax") if _available(e)]
    if not engines:
        print("bench_multiworker_step: neither polydist_torch nor polydist_jax is installed")
        return 0
    path = RESULTS / f"{args.name}.json"
    previous: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    rows = [r for r in previous.get("rows", []) if r.get("engine") not in engines]
    for engine in engines:
        print(f"== {engine}: {WORKERS} processes x 1 replica, widths {list(WIDTHS.values())}")
        new = [r | {"date": today()} for r in run_engine(engine, args.timeout)]
        for r in new:
            for x in _ratios(r):
                print(f"   {x['ratio']:.3f}  {x['case']}", flush=True)
        rows += new
    rows.sort(key=lambda r: (r["engine"], r["width"]))
    payload = {
        "benchmark": "multi-worker training step (2 worker processes on one machine, "
        "loopback, 1 replica each): an MLP whose gradients are all-reduced every step "
        "through MultiWorkerMirroredStrategy vs hand-written engine code",
        "device": "CPU",
        "machine": machine(),
        "notes": "ratio = hand-written time per step / polydist's (higher is better), "
        "against the faster hand-written variant; medians of worker 0's samples, each a "
        f"burst of back-to-back steps, the contestants alternating round by round "
        f"({ROUNDS} rounds). MLP width -> width -> width -> 1, ReLU, float32, SGD, "
        f"{LOCAL_BATCH} rows per worker, 1 torch thread per worker. The collective check "
        "is on (the default)."
        + (
            " JAX: steps in flight, each burst waiting at its end (informational)."
            if PIPELINED
            else ""
        ),
        "target": f"ratio >= {TARGET} for 1-64 MiB of gradients",
        # Each row keeps its own date: a run of one engine keeps the other's rows.
        "ratios": [ratio | {"date": r["date"]} for r in rows for ratio in _ratios(r)],
        "rows": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
