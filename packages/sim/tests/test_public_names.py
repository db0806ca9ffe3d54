"""polydist_sim re-exports the simulator that ships with core, and adds the cost model."""

from __future__ import annotations

import importlib.metadata

import numpy as np

import polydist as pd
import polydist_sim
from polydist.backend import sim as core_sim


def test_names_are_cores_objects() -> None:
    for name in polydist_sim.__all__:
        assert getattr(polydist_sim, name) is getattr(core_sim, name), name
    assert pd.get_backend("sim").__class__ is polydist_sim.SimBackend


def test_a_configured_backend_from_polydist_sim_runs() -> None:
    strategy = pd.MirroredStrategy(3, backend=polydist_sim.SimBackend("sequential"))
    out = strategy.run(lambda: pd.get_replica_context().all_reduce("SUM", np.float32(0.1)))
    assert strategy.extended.backend.reduction_order == "sequential"
    want = np.float32(np.float32(np.float32(0.1) + np.float32(0.1)) + np.float32(0.1))
    assert strategy.experimental_local_results(out)[0] == want


def test_only_core_registers_the_sim_entry_point() -> None:
    sims = [
        e for e in importlib.metadata.entry_points(group="polydist.backends") if e.name == "sim"
    ]
    assert [(e.value, e.dist.name if e.dist else None) for e in sims] == [
        ("polydist._sim:SimBackend", "polydist")
    ]
