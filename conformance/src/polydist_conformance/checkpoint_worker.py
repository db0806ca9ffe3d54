"""A worker for ``polydist launch`` (the backends' test_multi_worker_checkpoint.py):
trains on backend ``$ENGINE`` (torch, jax) with a ``train.Checkpoint(model=,
optimizer=, iterator=)`` and a ``CheckpointManager`` saving after every step, resuming
from the latest checkpoint when there is one.

``python checkpoint_worker.py CKPT_DIR OUT STOP_AT [--per-worker-dir]``: stops after step
STOP_AT (0: runs to the end of the input) and writes ``OUT.<task_id>.json`` with the
final weights, the steps run, what each step gathered and the manager's list.
``--per-worker-dir`` gives each worker a directory of its own (a cluster without a
shared filesystem). ``ENGINE=sim`` runs the simulator's cluster of 2 in this process.

`launch`, `run`, `load` and `simulated` are the tests' side: both backends' tests
start the workers and read their results through them.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

import polydist as pd
from polydist.backend import launch as _launch

if TYPE_CHECKING:
    from polydist_conformance.multiprocess_tests import Engine

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


# -- the tests' side ----------------------------------------------------------------------


def launch(engine: Engine, *args: str) -> tuple[int, str]:
    """Two workers of this program under ``polydist launch`` with ``engine``'s
    environment: the exit code and their whole output."""
    log = io.StringIO()
    result = _launch.launch(
        2, __file__, list(args), timeout=120, stdout=log, stderr=log, env=engine.environment()
    )
    return result.exit_code, log.getvalue()


def run(engine: Engine, *args: str) -> None:
    """`launch`, which must succeed."""
    code, out = launch(engine, *args)
    assert code == 0, out[-3000:]


def load(out: Path) -> list[dict[str, Any]]:
    """What each of the 2 workers wrote (``OUT.<task_id>.json``)."""
    return [json.loads(Path(f"{out}.{w}.json").read_text()) for w in range(2)]


def simulated(engine: Engine, tmp: Path) -> dict[str, Any]:
    """The simulator's cluster of 2 workers, uninterrupted, in one process."""
    env = {**engine.environment(), "ENGINE": "sim"}
    args = [sys.executable, __file__, str(tmp / "ckpt"), str(tmp / "out"), "0"]
    done = subprocess.run(args, env=env, timeout=90, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads((tmp / "out.0.json").read_text())
    return result


if __name__ == "__main__":
    main()
