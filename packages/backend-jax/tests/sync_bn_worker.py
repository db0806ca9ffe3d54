"""One worker of `test_sync_batch_norm.py`'s MultiWorkerMirroredStrategy run.

``python sync_bn_worker.py OUT`` under ``polydist launch`` (2 workers x 2 CPU devices:
4 replicas; ``$MW_PROGRAM_JIT=0`` runs eagerly): trains `test_sync_batch_norm.Net`
(with ``SyncBatchNorm``) for `STEPS` even steps and one uneven one, and draws
dropout masks in ``run``. Writes ``OUT/worker<rank>.npz`` (`save`: this worker's
replicas' outputs and masks, the global losses and the final state), or
``OUT/error<rank>.json`` and exits 17.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

import polydist as pd
from polydist_conformance.multiprocess import D, local_components, save, write_error

STEPS = 2
#: The uneven last step's examples per global replica (the last replica gets none).
UNEVEN = (2, 2, 1, 0)
DROPOUT_WIDTH = 64


def batches() -> list[tuple[np.ndarray, np.ndarray]]:
    """The global batches: `STEPS` of 16 examples, then one of ``sum(UNEVEN)``."""
    import test_sync_batch_norm as t

    return [*t.data(STEPS), t.data(1, batch=sum(UNEVEN), seed=1)[0]]


def rows(batch: np.ndarray, step: int) -> list[np.ndarray]:
    """Each global replica's part of ``batch``."""
    if step < STEPS:
        return np.split(batch, 2 * D)
    return np.split(batch, np.cumsum(UNEVEN)[:-1])


def program(strategy: pd.Strategy) -> dict[str, list[np.ndarray]]:
    import jax.numpy as jnp
    import test_sync_batch_norm as t
    from flax import nnx

    from polydist_jax import nnx as pdnnx

    model, step = t.distributed(strategy)
    out: dict[str, list[np.ndarray]] = {}
    for s, (x, y) in enumerate(batches()):
        xs, ys = rows(x, s), rows(y, s)
        args = [
            strategy.experimental_distribute_values_from_function(
                lambda c, parts=parts: parts[c.replica_id_in_sync_group]
            )
            for parts in (xs, ys)
        ]
        loss, output = strategy.run(step, args=tuple(args))
        out[f"out_{s}"] = local_components(strategy, output)
        out[f"loss_{s}"] = [np.asarray(float(strategy.reduce("SUM", loss, axis=None)))]
        for name in ("norm/mean", "norm/var"):
            out[f"{name}_{s}"] = [v.numpy() for v in pdnnx.variables(model)[name].values]
    for name, value in t.state_of(model).items():
        out[f"state/{name}"] = [value]
    backend: Any = strategy.extended.backend
    out["eager_fallback_count"] = [np.asarray(backend.eager_fallback_count)]

    with strategy.scope():
        dropout = pdnnx.distribute(nnx.Dropout(0.5, rngs=nnx.Rngs(0)))
    masks = strategy.run(lambda: dropout(jnp.ones(DROPOUT_WIDTH)))
    out["masks"] = local_components(strategy, masks)
    out["replica_ids"] = local_components(
        strategy, strategy.run(lambda: pd.get_replica_context().replica_id_in_sync_group)
    )
    return out


def main() -> None:
    out, rank = Path(sys.argv[1]), int(os.environ.get("RANK", "0"))
    try:
        from polydist_jax import JaxWorkerProcesses

        jit = os.environ.get("MW_PROGRAM_JIT", "1") != "0"
        strategy = pd.MultiWorkerMirroredStrategy(
            communication_options=pd.experimental.CommunicationOptions(timeout_seconds=60),
            local_devices=D,
            backend="jax" if jit else JaxWorkerProcesses(jit=False),
        )
        save(out / f"worker{rank}.npz", program(strategy))
    except Exception as e:
        write_error(out, rank, e)
        os._exit(17)


if __name__ == "__main__":
    main()
