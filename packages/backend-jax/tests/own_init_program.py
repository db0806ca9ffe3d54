"""A JAX worker whose program starts ``jax.distributed`` itself, then creates the strategy.

``python own_init_program.py OUT``, one of 2 workers under ``polydist launch``: sums one
value per replica across the workers (float32, then bfloat16), then exits normally. An
exit handler registered before the strategy's (so run after polydist's) writes
``OUT/exit<i>.json``: the sums, and whether polydist's heartbeat thread was still
running by then.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np

D = 2


def main() -> None:
    out, rank = Path(sys.argv[1]), int(os.environ["POLYDIST_PROCESS_ID"])
    jax.config.update("jax_num_cpu_devices", D)  # type: ignore[no-untyped-call]
    jax.distributed.initialize(
        os.environ["JAX_COORDINATOR_ADDRESS"],
        int(os.environ["POLYDIST_NUM_PROCESSES"]),
        rank,
        initialization_timeout=60,
    )
    import polydist as pd

    result: dict[str, Any] = {}

    def at_exit() -> None:
        names = [t.name for t in threading.enumerate() if t.is_alive()]
        result["heartbeat_running"] = any(n.startswith("polydist-heartbeat") for n in names)
        (out / f"exit{rank}.json").write_text(json.dumps(result))

    atexit.register(at_exit)  # before the strategy registers polydist's: runs after it
    options = pd.experimental.CommunicationOptions(timeout_seconds=30)
    strategy = pd.MultiWorkerMirroredStrategy(
        communication_options=options, local_devices=D, backend="jax"
    )
    values = strategy.experimental_distribute_values_from_function(
        lambda c: np.float32(1 + c.replica_id_in_sync_group)
    )
    result["sum"] = float(strategy.reduce(pd.ReduceOp.SUM, values, axis=None))
    # bfloat16 across processes, as TF's add_n and JAX's psum sum it.
    halves = strategy.experimental_distribute_values_from_function(
        lambda c: jax.numpy.asarray([0.5, 1 + c.replica_id_in_sync_group], jax.numpy.bfloat16)
    )
    total = strategy.reduce(pd.ReduceOp.SUM, halves, axis=None)
    result["bfloat16_sum"] = [str(total.dtype), *np.asarray(total, np.float32).tolist()]


if __name__ == "__main__":
    main()
