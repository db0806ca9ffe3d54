"""A worker for ``polydist launch`` (the backends' test_multi_worker_checkpoint.py):
trains on backend ``$ENGINE`` (torch, jax) with a ``train.Checkpoint(model=,
optimizer=, iterator=)`` and a ``CheckpointManager`` saving after every step, resuming
from the latest checkpoint when there is one.

``python checkpoint_worker.py CKPT_DIR OUT STOP_AT [--per-worker-dir]``: stops after step
STOP_AT (0: runs to the end of the input) and writes ``OUT.<task_id>.json`` with the
final weights, the steps run, what each step gathered and the manager's list.
``--per-worker-dir`` gives each worker a directory of its own (a cluster without a
shared filesystem). ``ENGINE=sim`` runs the simulator's cluster of 2 in this process.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import numpy as np

import polydist as pd

GLOBAL_BATCH = 8
EXAMPLES = 21  # 42 with repeat(2): 5 steps of 8 and a partial one of 2


def make_strategy() -> pd.Strategy:
    if os.environ.get("ENGINE") == "sim":
        from polydist.cluster_resolver import ClusterSpec, SimpleClusterResolver
        from polydist_sim import SimBackend

        spec = ClusterSpec({"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]})
        resolver = SimpleClusterResolver(spec, task_type="worker", task_id=0)
        return pd.MultiWorkerMirroredStrategy(resolver, backend=SimBackend(num_gpus=1))
    options = pd.experimental.CommunicationOptions(timeout_seconds=60)
    return pd.MultiWorkerMirroredStrategy(
        communication_options=options, local_devices=1, backend=os.environ["ENGINE"]
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt")
    parser.add_argument("out")
    parser.add_argument("stop_at", type=int)
    parser.add_argument("--per-worker-dir", action="store_true")
    args = parser.parse_args()
    strategy = make_strategy()
    task = strategy.cluster_resolver.task_id
    x = (np.arange(EXAMPLES * 3, dtype=np.float32).reshape(EXAMPLES, 3)) / 10
    y = x @ np.asarray([[1.0], [-2.0], [0.5]], np.float32)
    options = pd.data.Options()
    options.experimental_distribute.auto_shard_policy = pd.data.AutoShardPolicy.DATA
    dataset = (
        pd.data.Dataset.from_tensor_slices((x, y))
        .shuffle(EXAMPLES, seed=7)
        .repeat(2)
        .batch(GLOBAL_BATCH)
        .with_options(options)
    )
    with strategy.scope():
        w = pd.Variable(np.zeros((3, 1), np.float32), name="w")
        momentum = pd.Variable(np.zeros((3, 1), np.float32), name="momentum")
        steps = pd.Variable(np.asarray(0, np.int64), name="steps")
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    ckpt = pd.train.Checkpoint(
        model={"w": w}, optimizer={"momentum": momentum, "steps": steps}, iterator=iterator
    )
    directory = os.path.join(args.ckpt, f"worker{task}") if args.per_worker_dir else args.ckpt
    manager = pd.train.CheckpointManager(ckpt, directory, max_to_keep=2)
    manager.restore_or_initialize()

    def step(x: Any, y: Any) -> Any:
        local = 2.0 * (x.T @ (x @ w.read_value() - y)) / GLOBAL_BATCH
        ctx = pd.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce(pd.ReduceOp.SUM, local), x

    seen = []
    for batch in iterator:
        grad, xs = strategy.run(step, args=batch)
        momentum.assign(0.9 * momentum.read_value() + strategy.experimental_local_results(grad)[0])
        w.assign_sub(0.05 * momentum.read_value())
        steps.assign_add(np.asarray(1, np.int64))
        seen.append(np.asarray(strategy.gather(xs, axis=0)).ravel().tolist())
        manager.save()
        if int(np.asarray(steps.read_value())) == args.stop_at:
            break
    result = {
        "w": np.asarray(w.read_value()).ravel().tolist(),
        "steps": int(np.asarray(steps.read_value())),
        "seen": seen,
        "checkpoints": [os.path.basename(p) for p in manager.checkpoints],
    }
    with open(f"{args.out}.{task}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
