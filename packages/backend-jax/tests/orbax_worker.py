"""A worker of test_orbax.py's multi-worker test, under ``polydist launch -n 2``.

Trains a Linear + BatchNorm model 2 steps on 2 workers (one replica each), saves
``nnx.state`` of the model and its optimizer with Orbax (the host-local arrays made
global by Orbax's own ``fully_replicated_host_local_array_to_global_array``),
restores into a fresh model, and writes what it holds to ``OUT/worker<rank>.npz``.
With ``plain`` it saves without the conversion and records Orbax's error instead.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from orbax.checkpoint import utils as orbax_utils

import polydist as pd
from polydist_jax import nnx as pdnnx


def build(strategy: pd.Strategy, seed: int) -> tuple[Any, Any]:
    with strategy.scope():
        rngs = nnx.Rngs(seed)
        model = nnx.Sequential(nnx.Linear(4, 2, rngs=rngs), nnx.BatchNorm(2, rngs=rngs))
        optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
        return pdnnx.distribute(model), pdnnx.distribute(optimizer)


def to_global(state: Any) -> Any:
    return jax.tree.map(orbax_utils.fully_replicated_host_local_array_to_global_array, state)


def to_local(state: Any) -> Any:
    return jax.tree.map(lambda a: a.addressable_data(0), state)


def main(out: Path, plain: bool) -> None:
    strategy = pd.MultiWorkerMirroredStrategy(backend="jax", local_devices=1)
    rank = jax.process_index()
    model, optimizer = build(strategy, seed=0)

    def step(x: jax.Array) -> None:
        def loss_fn(model: Any) -> jax.Array:
            return pd.nn.compute_average_loss(jnp.sum(model(x) ** 2, axis=1))  # type: ignore[no-any-return]

        grads = nnx.grad(loss_fn)(model)
        ctx = pd.get_replica_context()
        assert ctx is not None
        optimizer.update(model, ctx.all_reduce(pd.ReduceOp.SUM, grads))

    for _ in range(2):
        strategy.run(step, args=(np.arange(8, dtype=np.float32).reshape(2, 4) * (rank + 1),))
    state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    path = out / "ckpt"
    if plain:
        try:
            with ocp.StandardCheckpointer() as checkpointer:
                checkpointer.save(path, state)
        except ValueError as e:
            (out / f"error{rank}.txt").write_text(str(e))
        return
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, to_global(state))
    other, other_optimizer = build(strategy, seed=1)
    target = {"model": nnx.state(other), "optimizer": nnx.state(other_optimizer)}
    with ocp.StandardCheckpointer() as checkpointer:
        restored = to_local(checkpointer.restore(path, to_global(target)))
    nnx.update(other, restored["model"])
    nnx.update(other_optimizer, restored["optimizer"])
    flat = {
        "saved": [np.asarray(v) for v in jax.tree.leaves(state)],
        "restored": [
            np.asarray(v)
            for v in jax.tree.leaves(
                {"model": nnx.state(other), "optimizer": nnx.state(other_optimizer)}
            )
        ],
    }
    arrays = {f"{k}{i}": v for k, vs in flat.items() for i, v in enumerate(vs)}
    np.savez(out / f"worker{rank}.npz", **arrays)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] == ["plain"])
