"""Linear regression on MultiWorkerMirroredStrategy: one program, three engines.

Two workers with two replicas each (virtual CPU replicas when there are no
GPUs). Each worker reads its shard of every global batch, and one
``all_reduce`` sums the gradients of all four replicas. The chief writes a
checkpoint after every step (``--ckpt DIR``), atomically; started again, the
workers resume from the latest one. At the end every worker prints the weights
and their difference from the simulator's ``MultiWorkerMirroredStrategy`` of
the same cluster, which it runs in-process (the sums across workers are added
in the engine's order, so the difference is rounding, not zero).

    python examples/multi_worker_train.py                               # the simulator
    polydist launch -n 2 examples/multi_worker_train.py --engine torch  # 2 processes, gloo
    polydist launch -n 2 examples/multi_worker_train.py --engine jax    # jax.distributed
    torchrun --standalone --nproc-per-node=2 examples/multi_worker_train.py --engine torch
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

import polydist as pd

WORKERS = 2
REPLICAS_PER_WORKER = 2
GLOBAL_BATCH = 64
STEPS = 16
LR = 0.1
TRUE_W = np.asarray([[1.0], [-2.0], [0.5], [3.0]], np.float32)


def make_strategy(engine: str) -> pd.Strategy:
    """MultiWorkerMirroredStrategy on ``engine``: torch and jax run one process per worker
    (the cluster from ``polydist launch``/``torchrun``/``TF_CONFIG``); the sim runs every
    worker in this process."""
    options = pd.experimental.CommunicationOptions(timeout_seconds=60)
    if engine in ("torch", "jax"):
        return pd.MultiWorkerMirroredStrategy(
            communication_options=options, local_devices=REPLICAS_PER_WORKER, backend=engine
        )
    from polydist.cluster_resolver import ClusterSpec, SimpleClusterResolver
    from polydist_sim import SimBackend

    resolver = SimpleClusterResolver(
        ClusterSpec({"worker": [f"127.0.0.1:{2222 + w}" for w in range(WORKERS)]}),
        task_type="worker",
        task_id=0,
        num_accelerators={"GPU": REPLICAS_PER_WORKER},
    )
    backend = SimBackend(num_gpus=REPLICAS_PER_WORKER)
    return pd.MultiWorkerMirroredStrategy(resolver, options, backend=backend)


def train(strategy: pd.Strategy, ckpt: str | None = None) -> np.ndarray:
    """SGD on y = x @ TRUE_W; returns the final weights."""
    rng = np.random.RandomState(0)
    x = rng.standard_normal((STEPS * GLOBAL_BATCH, 4)).astype(np.float32)
    y = x @ TRUE_W
    with strategy.scope():
        w = pd.Variable(np.zeros((4, 1), np.float32), name="w")
    options = pd.data.Options()  # in-memory data: shard by element, as TF's DATA policy
    options.experimental_distribute.auto_shard_policy = pd.data.AutoShardPolicy.DATA
    dataset = pd.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).with_options(options)

    def grad(x: Any, y: Any) -> Any:
        local = 2.0 * (x.T @ (x @ w.read_value() - y)) / GLOBAL_BATCH
        return pd.get_replica_context().all_reduce(pd.ReduceOp.SUM, local)

    start = 0
    if ckpt and pd.checkpoint.latest_checkpoint(ckpt) is not None:
        start = pd.checkpoint.restore(ckpt, strategy).step + 1
    for step, batch in enumerate(strategy.experimental_distribute_dataset(dataset)):
        if step < start:
            continue  # in the checkpoint already
        g = strategy.run(grad, args=batch)
        w.assign_sub(LR * strategy.experimental_local_results(g)[0])
        if ckpt:
            # The chief writes (atomically); the other workers skip.
            pd.checkpoint.save(ckpt, strategy, step=step, max_to_keep=3)
    value = w.read_value()
    return np.asarray(value.detach() if hasattr(value, "detach") else value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["sim", "torch", "jax"], default="sim")
    parser.add_argument("--ckpt", help="checkpoint directory (resumed from when it has one)")
    args = parser.parse_args()
    strategy = make_strategy(args.engine)
    resolver = strategy.cluster_resolver
    where = f"{resolver.task_type} {resolver.task_id}" if resolver is not None else "worker 0"
    w = train(strategy, args.ckpt)
    reference = w if args.engine == "sim" else train(make_strategy("sim"))
    print(f"{where}: {strategy.num_replicas_in_sync} replicas in sync, engine {args.engine}")
    shown = ", ".join(f"{v:.4f}" for v in w.ravel())
    print(f"{where}: w = [{shown}] (true: {TRUE_W.ravel().tolist()})")
    print(f"{where}: largest difference from the sim: {np.abs(w - reference).max():.2e}")


if __name__ == "__main__":
    main()
