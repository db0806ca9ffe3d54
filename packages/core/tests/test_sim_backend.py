"""The sim backend: devices, orders, and the demo."""

from __future__ import annotations

import io

import numpy as np
import pytest

import polydist as pd
from polydist._sim import MAX_DEVICES, SimBackend


def test_reduction_order_is_validated() -> None:
    with pytest.raises(ValueError, match="Unknown reduction_order 'fast'"):
        SimBackend("fast")  # type: ignore[arg-type]


def test_max_replicas() -> None:
    strategy = pd.MirroredStrategy(MAX_DEVICES)
    assert strategy.num_replicas_in_sync == 1024
    with pytest.raises(ValueError, match="at most 1024"):
        pd.MirroredStrategy(MAX_DEVICES + 1)


def test_1024_replicas_all_reduce() -> None:
    strategy = pd.MirroredStrategy(1024)
    out = strategy.run(
        lambda: pd.get_replica_context().all_reduce(
            "SUM", np.float32(pd.get_replica_context().replica_id_in_sync_group)
        )
    )
    assert {float(v) for v in out.values} == {1023 * 1024 / 2}


def test_num_gpus_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLYDIST_SIM_GPUS", "3")
    backend = SimBackend()
    assert pd.MirroredStrategy(backend=backend).num_replicas_in_sync == 3
    assert backend.list_devices()[0].endswith("CPU:0")


def test_other_worker_devices_are_refused() -> None:
    with pytest.raises(ValueError, match="another worker"):
        pd.MirroredStrategy(["/job:worker/task:1/device:GPU:0"])


@pytest.mark.parametrize("order", ["exact", "sequential", "reverse", "tree", "ring"])
def test_every_order_runs_through_a_strategy(order: str) -> None:
    strategy = pd.MirroredStrategy(4, backend=SimBackend(order))  # type: ignore[arg-type]
    value = pd.PerReplica([np.full(5, i + 1, np.float32) for i in range(4)])
    np.testing.assert_array_equal(strategy.reduce("SUM", value, axis=None), np.full(5, 10.0))


def test_orders_change_the_bits_visibly() -> None:
    values = [np.float32(1e8), np.float32(1.0), np.float32(-1e8), np.float32(1.0)]
    got = {
        order: float(
            pd.MirroredStrategy(4, backend=SimBackend(order)).reduce(  # type: ignore[arg-type]
                "SUM", pd.PerReplica(values), axis=None
            )
        )
        for order in ("exact", "sequential", "reverse")
    }
    # exact: 2.0; left to right: ((1e8+1)-1e8)+1 = 1.0; right to left: ((1-1e8)+1)+1e8 = 0.0
    assert got == {"exact": 2.0, "sequential": 1.0, "reverse": 0.0}


def test_demo_agrees_with_single_device_training() -> None:
    from polydist._tools.demo import run_demo

    out = io.StringIO()
    assert run_demo(replicas=8, steps=5, out=out)
    text = out.getvalue()
    assert "data-parallel on 8 replicas (backend: sim, reduction: exact)" in text
    assert "all replicas hold bitwise-identical weights: yes" in text
    assert text.rstrip().endswith("equals single-device training.")


def test_cli_demo_and_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    from polydist._tools.cli import main

    assert main(["demo", "--replicas", "2", "--steps", "2"]) == 0
    assert "step   2/2" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["demo", "--replicas", "0"])
    assert info.value.code == 2
    assert "expected a positive integer, got 0" in capsys.readouterr().err
    assert main(["demo", "--backend", "nope"]) == 2
    err = capsys.readouterr().err
    assert "To use it, install the package that provides the 'nope' backend" in err
