"""The shared multi-worker program (``polydist_conformance.multiprocess``) as a torch worker.

``python mw_program.py OUT MODE [OPTIONS]``; see that module for the modes.
"""

from __future__ import annotations

import argparse

import polydist as pd
from polydist_conformance.multiprocess import D, load, main, program

__all__ = ["D", "load", "program"]


def torch_strategy(args: argparse.Namespace) -> pd.Strategy:
    options = pd.experimental.CommunicationOptions(timeout_seconds=args.timeout)
    return pd.MultiWorkerMirroredStrategy(
        communication_options=options, local_devices=D, backend="torch"
    )


if __name__ == "__main__":
    main(torch_strategy)
