"""Checkpoints: checkpoint.save and restore of distributed variables, across replica counts.

TF's rules (reference, "Checkpoints"; ``docs/concepts/variables.md``): a
``MirroredVariable`` saves its value, a ``SyncOnReadVariable`` its aggregate
(a SUM variable the sum of its copies) and restoring into N copies puts the
value in each copy. A SUM ``SyncOnReadVariable`` is split exactly (polydist, not
TF's ``value / N``): integers ``value // N`` in each copy but the first, which
holds the rest; floats the value in the first copy and ``-0.0`` in the others,
so it reads back the saved sum bit for bit. The stored values do not depend on the replica
count, so a checkpoint restores into a strategy with any number of replicas,
and a checkpoint written on the backend restores on the simulator.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist.checkpoint import CheckpointMismatchError
from polydist_conformance import Conformance, Distributed, Reduction, reduced

VA = pd.VariableAggregation
VS = pd.VariableSynchronization
#: The value of the SUM variables: divisible by every replica count up to 10, so that
#: each of N copies holds TOTAL / N exactly after ``assign(TOTAL)``, whatever N the run uses.
TOTAL = 2520.0


def _f32(x: float) -> np.float32:
    return np.float32(x)


def _variables(xp: Any) -> dict[str, Any]:
    """One variable of each kind, with values that survive any replica count exactly."""
    return {
        "kernel": pd.Variable(xp.asarray([1.0, 2.0, 3.0], dtype=xp.float32), name="dense/kernel"),
        "seen": pd.Variable(0.0, name="seen", synchronization=VS.ON_READ, aggregation=VA.SUM),
        "count": pd.Variable(0, name="count", synchronization=VS.ON_READ, aggregation=VA.SUM),
        "mean": pd.Variable(0.0, name="mean", synchronization=VS.ON_READ, aggregation=VA.MEAN),
        "first": pd.Variable(
            0.0, name="first", synchronization=VS.ON_READ, aggregation=VA.ONLY_FIRST_REPLICA
        ),
    }


def _set(variables: dict[str, Any], xp: Any) -> None:
    variables["kernel"].assign(xp.asarray([1.0, 2.0, 3.0], dtype=xp.float32))
    variables["seen"].assign(TOTAL)  # TOTAL / N in each copy
    variables["count"].assign(int(TOTAL))
    variables["mean"].assign(2.5)
    variables["first"].assign(7.0)


def _scramble(variables: dict[str, Any], xp: Any) -> None:
    variables["kernel"].assign(xp.zeros((3,), dtype=xp.float32))
    variables["seen"].assign(0.0)
    variables["count"].assign(0)
    variables["mean"].assign(0.0)
    variables["first"].assign(0.0)


def _reads(variables: dict[str, Any]) -> dict[str, Any]:
    reads = {k: v.read_value() for k, v in variables.items()}
    # The restored SUM variable reads as the sum of its copies, TOTAL and N - 1 -0.0s.
    n = len(variables["seen"].values) if isinstance(variables["seen"], pd.DistributedValues) else 1
    shares = [np.float32(TOTAL)] + [np.float32(-0.0)] * (n - 1)
    reads["seen"] = reduced(reads["seen"], Reduction.across_replicas(shares))
    return reads


def _expected_reads() -> dict[str, Any]:
    return {
        "kernel": np.asarray([1.0, 2.0, 3.0], np.float32),
        "seen": _f32(TOTAL),
        "count": np.int32(TOTAL),
        "mean": _f32(2.5),
        "first": _f32(7.0),
    }


def _expected_copies(n: int) -> dict[str, Any]:
    return {
        "kernel": Distributed("MirroredVariable", (np.asarray([1.0, 2.0, 3.0], np.float32),) * n),
        "seen": Distributed("SyncOnReadVariable", (_f32(TOTAL),) + (_f32(-0.0),) * (n - 1)),
        "count": Distributed("SyncOnReadVariable", (np.int32(TOTAL // n),) * n),
        "mean": Distributed("SyncOnReadVariable", (_f32(2.5),) * n),
        "first": Distributed("SyncOnReadVariable", (_f32(7.0),) * n),
    }


def test_round_trip(conformance: Conformance) -> None:
    """Save a strategy's variables, change them, restore: every copy is back. Names are
    the variables' names without ``:0``; steps count up from 1."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with tempfile.TemporaryDirectory() as tmp:
            with strategy.scope():
                variables = _variables(xp)
            _set(variables, xp)
            path = pd.checkpoint.save(tmp, strategy)
            assert path is not None
            _scramble(variables, xp)
            manifest = pd.checkpoint.restore(tmp, strategy)
            stored = pd.checkpoint.read_arrays(path)
            return {
                "step": manifest.step,
                "names": sorted(manifest.arrays),
                "stored": {k: xp.asarray(v) for k, v in sorted(stored.items())},
                "reads": _reads(variables),
                "copies": dict(variables),
            }

    n = conformance.replicas
    stored = {
        "count": np.int32(TOTAL),
        "dense/kernel": np.asarray([1.0, 2.0, 3.0], np.float32),
        "first": _f32(7.0),
        "mean": _f32(2.5),
        "seen": _f32(TOTAL),
    }
    conformance.check(
        program,
        expected={
            "step": 1,
            "names": sorted(stored),
            "stored": stored,
            "reads": _expected_reads(),
            "copies": _expected_copies(n),
        },
    )


@pytest.mark.parametrize("other", [1, 2, 3])
def test_restore_into_another_replica_count(conformance: Conformance, other: int) -> None:
    """Saved with the run's replicas, restored into ``MirroredStrategy(other)``: mirrored
    values go to every copy, a SUM variable's sum is split exactly among the N copies."""
    try:
        devices = conformance.backend.replica_devices(other)
    except ValueError as e:
        pytest.skip(f"needs {other} replicas: {e}")
    if len(devices) != other:
        pytest.skip(f"needs {other} replicas; the backend gives {len(devices)}")

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        target = pd.MirroredStrategy(other, backend=strategy.extended.backend)
        with tempfile.TemporaryDirectory() as tmp:
            with strategy.scope():
                saved = _variables(xp)
            _set(saved, xp)
            pd.checkpoint.save(tmp, saved)
            with target.scope():
                restored = _variables(xp)
            pd.checkpoint.restore(tmp, restored)
            return {"reads": _reads(restored), "copies": dict(restored)}

    conformance.check(
        program, expected={"reads": _expected_reads(), "copies": _expected_copies(other)}
    )


def test_restore_into_one_device_and_plain_variables(conformance: Conformance) -> None:
    """A checkpoint of distributed variables restores into plain variables (no strategy)
    and into a ``OneDeviceStrategy``: each holds the saved (aggregated) value."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        backend = strategy.extended.backend
        one = pd.OneDeviceStrategy(backend.replica_devices(1)[0], backend=backend)
        with tempfile.TemporaryDirectory() as tmp:
            with strategy.scope():
                saved = _variables(xp)
            _set(saved, xp)
            pd.checkpoint.save(tmp, saved)
            with one.scope():
                on_device = _variables(xp)
            pd.checkpoint.restore(tmp, on_device)
            return {k: v for k, v in on_device.items()}

    conformance.check(
        program,
        expected={
            "kernel": Distributed("Variable", (np.asarray([1.0, 2.0, 3.0], np.float32),)),
            "seen": Distributed("Variable", (_f32(TOTAL),)),
            "count": Distributed("Variable", (np.int32(TOTAL),)),
            "mean": Distributed("Variable", (_f32(2.5),)),
            "first": Distributed("Variable", (_f32(7.0),)),
        },
    )


def test_a_checkpoint_of_the_backend_restores_on_the_simulator(conformance: Conformance) -> None:
    """The stored arrays do not depend on the backend: what the backend saves, a sim
    strategy restores (the oracle runs the same program, sim to sim)."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        from polydist_sim import SimBackend

        sim = pd.MirroredStrategy(strategy.num_replicas_in_sync, backend=SimBackend())
        with tempfile.TemporaryDirectory() as tmp:
            with strategy.scope():
                saved = _variables(xp)
            _set(saved, xp)
            pd.checkpoint.save(tmp, saved, step=7)
            with sim.scope():
                restored = _variables(np)
            manifest = pd.checkpoint.restore(Path(tmp) / "ckpt-7", restored)
            return {"step": manifest.step, "reads": _reads(restored)}

    conformance.check(program, expected={"step": 7, "reads": _expected_reads()})


def test_restore_checks_names_shapes_and_dtypes(conformance: Conformance) -> None:
    """A missing name or a different shape or dtype raises ``CheckpointMismatchError``
    before any variable changes."""

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with tempfile.TemporaryDirectory() as tmp:
            with strategy.scope():
                w = pd.Variable(xp.ones((2,), dtype=xp.float32), name="w")
                pd.checkpoint.save(tmp, {"w": w})
                wrong_shape = pd.Variable(xp.zeros((3,), dtype=xp.float32), name="w")
                untouched = pd.Variable(xp.zeros((2,), dtype=xp.float32), name="w2")
            outcomes = []
            for target in ({"w": wrong_shape}, {"w": untouched, "missing": untouched}):
                try:
                    pd.checkpoint.restore(tmp, target)
                    outcomes.append("")
                except CheckpointMismatchError as e:
                    outcomes.append(type(e).__name__)
            return {"outcomes": outcomes, "untouched": untouched}

    n = conformance.replicas
    conformance.check(
        program,
        expected={
            "outcomes": ["CheckpointMismatchError"] * 2,
            "untouched": Distributed("MirroredVariable", (np.zeros(2, np.float32),) * n),
        },
    )


def test_sync_on_read_none_cannot_be_saved(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with tempfile.TemporaryDirectory() as tmp, strategy.scope():
            v = pd.Variable(0.0, name="m", synchronization=VS.ON_READ)
            return pd.checkpoint.save(tmp, v)

    conformance.check_raises(program, ValueError, match="aggregation NONE")


def test_save_in_replica_context_is_refused(conformance: Conformance) -> None:
    def program(strategy: pd.Strategy, xp: Any) -> Any:
        with tempfile.TemporaryDirectory() as tmp:
            with strategy.scope():
                pd.Variable(0.0, name="v")
            return strategy.run(lambda: pd.checkpoint.save(tmp, strategy))

    conformance.check_raises(program, RuntimeError, match="must be called in cross-replica")


@pytest.mark.parametrize("other", [1, 3])
def test_train_checkpoint_manager_round_trip(conformance: Conformance, other: int) -> None:
    """``polydist.train.Checkpoint`` with a ``CheckpointManager``: saved on the backend,
    restored into ``MirroredStrategy(other)`` of the backend and into the simulator; a
    SUM variable reads back its sum exactly, and ``assert_consumed`` passes."""
    try:
        devices = conformance.backend.replica_devices(other)
    except ValueError as e:
        pytest.skip(f"needs {other} replicas: {e}")
    if len(devices) != other:
        pytest.skip(f"needs {other} replicas; the backend gives {len(devices)}")

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        from polydist_sim import SimBackend

        targets = [
            pd.MirroredStrategy(other, backend=strategy.extended.backend),
            pd.MirroredStrategy(2, backend=SimBackend()),
        ]
        with tempfile.TemporaryDirectory() as tmp:
            with strategy.scope():
                saved = _variables(xp)
            _set(saved, xp)
            ckpt = pd.train.Checkpoint(model=saved)
            manager = pd.train.CheckpointManager(ckpt, tmp, max_to_keep=1)
            first, path = manager.save(), manager.save()
            out: dict[str, Any] = {"kept": [Path(p).name for p in manager.checkpoints]}
            out["first_deleted"] = not Path(str(first)).exists()
            for i, target in enumerate(targets):
                with target.scope():
                    restored = _variables(xp if i == 0 else np)
                ck = pd.train.Checkpoint(model=restored)
                ck.restore(path).assert_consumed()
                out[f"reads{i}"] = _reads(restored)
                out[f"counter{i}"] = int(np.asarray(ck.save_counter.read_value()))
            return out

    conformance.check(
        program,
        expected={
            "kept": ["ckpt-2"],
            "first_deleted": True,
            "reads0": _expected_reads(),
            "counter0": 2,
            "reads1": _expected_reads(),
            "counter1": 2,
        },
    )
