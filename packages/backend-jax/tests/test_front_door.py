"""What a new JAX user meets first: the demo without XLA_FLAGS, a plain Variable of a
jax.Array without POLYDIST_BACKEND, and metrics in compiled and eager runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import polydist as pd
from polydist import metrics
from polydist.backend import backends_owning
from polydist_jax import JaxBackend


def _polydist_command() -> str:
    # Next to this Python (a virtualenv), else on PATH (``pip install --target`` puts it
    # in the target's bin/, as benchmarks/device_check.sh does).
    found = shutil.which("polydist", path=str(Path(sys.executable).parent)) or shutil.which(
        "polydist"
    )
    assert found is not None, "the polydist command is neither next to this Python nor on PATH"
    return found


def _demo(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_polydist_command(), "demo", "--backend", "jax", "--replicas", "4", "--steps", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_demo_runs_without_xla_flags() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "POLYDIST_BACKEND")}
    env.pop("JAX_PLATFORMS", None)
    done = _demo(env)
    if done.returncode != 0 and "1 GPU device(s)" in done.stderr:
        # A one-GPU machine: JAX's default platform is the GPU, and the error says the
        # way out, which then works.
        way_out = "at most 1 replica(s), or run on CPU devices with JAX_PLATFORMS=cpu"
        assert way_out in done.stderr
        done = _demo({**env, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr
    assert "Result: data-parallel training on 4 replicas equals single-device training." in (
        done.stdout
    )


def test_a_plain_variable_of_a_jax_array_is_a_jax_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("POLYDIST_BACKEND", raising=False)
    assert backends_owning(jnp.zeros(3)) == ("jax",)
    assert backends_owning(np.zeros(3)) == ()
    v = pd.Variable(jnp.arange(3.0))
    assert v.distribute_strategy is None
    assert v._backend.name == "jax"
    assert isinstance(v.value(), type(jnp.zeros(1)))
    v.assign_add(jnp.ones(3))
    assert v.numpy().tolist() == [1.0, 2.0, 3.0]
    # Even with the environment naming another backend: the sim cannot hold a jax.Array.
    monkeypatch.setenv("POLYDIST_BACKEND", "sim")
    assert pd.Variable(jnp.zeros(2))._backend.name == "jax"
    assert pd.Variable(np.zeros(2))._backend.name == "sim"


@pytest.mark.parametrize("jit", [True, False], ids=["compiled", "eager"])
def test_metrics_update_inside_run(jit: bool) -> None:
    backend = JaxBackend(jit=jit)
    strategy = pd.MirroredStrategy(4, backend=backend)
    with strategy.scope():
        accuracy = metrics.SparseCategoricalAccuracy()
        loss = metrics.Mean()
    labels = strategy.experimental_distribute_values_from_function(
        lambda ctx: jnp.asarray([0, 1], dtype=jnp.int32)
    )
    logits = strategy.experimental_distribute_values_from_function(
        lambda ctx: jnp.asarray([[2.0, 1.0], [3.0, 0.0]]) + ctx.replica_id_in_sync_group
    )

    def step(y: jnp.ndarray, p: jnp.ndarray) -> None:
        accuracy.update_state(y, p)  # every replica: sample 0 right, sample 1 wrong
        loss.update_state(p[:, 0])

    strategy.run(step, args=(labels, logits))
    strategy.run(step, args=(labels, logits))
    assert float(accuracy.result()) == 0.5
    # Replica r adds (2 + r) + (3 + r), twice: sum over r of 10 + 4r over 16 samples.
    assert float(loss.result()) == pytest.approx((4 * 10 + 4 * 6) / 16)
    assert [float(c.numpy()) for c in accuracy.count.values] == [4.0] * 4
    assert backend.eager_fallback_count == 0
    if jit:
        assert backend.compile_count == 1  # one program, reused by the second step


def test_a_metric_from_outside_the_scope_says_so_in_a_compiled_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("POLYDIST_BACKEND", raising=False)
    mean = metrics.Mean()  # outside any scope: plain variables on the sim
    strategy = pd.MirroredStrategy(2, backend=JaxBackend())
    values = strategy.experimental_distribute_values_from_function(lambda ctx: jnp.ones(2))
    with pytest.raises(TypeError, match=r"created outside the strategy's scope"):
        strategy.run(mean.update_state, args=(values,))
    # Outside any strategy, JAX values are read through NumPy.
    mean.update_state(jnp.asarray([1.0, 2.0]))
    assert float(mean.result()) == 1.5


def test_loss_helpers_outside_any_strategy_take_jax_arrays() -> None:
    average = pd.nn.compute_average_loss(jnp.asarray([1.0, 2.0, 3.0]), global_batch_size=3)
    assert isinstance(average, type(jnp.zeros(1))) and float(average) == 2.0
