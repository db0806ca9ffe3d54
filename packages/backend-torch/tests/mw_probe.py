"""A torch worker for ``polydist launch`` that reports how worker 0's rendezvous is exposed.

``python mw_probe.py [--old-gloo]``: joins the cluster (TF_CONFIG); worker 0 prints
whether its rendezvous port takes connections on 127.0.0.2 (every interface) and on the
cluster's own address; then the workers sum their ids. ``--old-gloo`` makes the process group's
start print what torch <= 2.9's gloo prints on standard output (C++ ``std::cout``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

import polydist as pd
from polydist_torch import MultiWorkerMirroredStrategy, shutdown_multi_worker


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def print_as_old_gloo() -> None:
    real = dist.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        rank, size = dist.get_rank(), dist.get_world_size()
        line = (
            f"[Gloo] Rank {rank} is connected to {size - 1} peer ranks. "
            f"Expected number of connected peer ranks is : {size - 1}\n"
        )
        os.write(1, line.encode())  # below Python, as gloo's std::cout

    dist.init_process_group = init_process_group


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old-gloo", action="store_true")
    args = parser.parse_args()
    if args.old_gloo:
        print_as_old_gloo()
    strategy = MultiWorkerMirroredStrategy()
    worker = strategy.cluster_resolver.task_id
    print(f"worker {worker}: joined", flush=True)
    if worker == 0:  # before the last collective, which every worker leaves together
        host, port = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][0].rsplit(":", 1)
        print(f"worker 0: from 127.0.0.2 {reachable('127.0.0.2', int(port))}", flush=True)
        print(f"worker 0: from {host} {reachable(host, int(port))}", flush=True)
    total = strategy.run(
        lambda: pd.get_replica_context().all_reduce("SUM", torch.tensor(float(worker + 1)))
    )
    print(f"worker {worker}: sum {float(total)}", flush=True)
    # Leave the cluster before exiting: a process that exits with its process group alive
    # is sometimes aborted by torch ("terminate called without an active exception").
    shutdown_multi_worker()


if __name__ == "__main__":
    main()
