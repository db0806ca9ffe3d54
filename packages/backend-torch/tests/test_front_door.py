"""What a new torch user meets first: a plain Variable of a torch.Tensor without
POLYDIST_BACKEND, errors that say what is wrong, and metrics fed torch tensors."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import polydist as pd
from polydist import metrics
from polydist.backend import backends_owning


def test_a_plain_variable_of_a_tensor_is_a_torch_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("POLYDIST_BACKEND", raising=False)
    assert backends_owning(torch.zeros(3)) == ("torch", "torch_xla")
    assert backends_owning(np.zeros(3)) == ()
    v = pd.Variable(torch.zeros(3))
    assert v.distribute_strategy is None
    assert v._backend.name == "torch"
    assert isinstance(v.value(), torch.Tensor)
    v.assign_add(torch.ones(3))
    assert v.numpy().tolist() == [1.0, 1.0, 1.0]
    assert pd.Variable(lambda: torch.ones(2))._backend.name == "torch"
    # The environment naming another backend does not move a tensor onto the sim.
    monkeypatch.setenv("POLYDIST_BACKEND", "sim")
    assert pd.Variable(torch.zeros(2))._backend.name == "torch"
    assert pd.Variable(np.zeros(2))._backend.name == "sim"


def test_a_tensor_on_a_sim_strategy_gets_an_error_that_says_why() -> None:
    strategy = pd.MirroredStrategy(2, backend="sim")
    with pytest.raises(TypeError) as info, strategy.scope():
        pd.Variable(torch.zeros(3), name="w")
    message = str(info.value)
    assert "initial_value is a torch.Tensor (dtype float32), an array of backend 'torch'" in (
        message
    )
    assert "this variable is on backend 'sim'" in message
    assert "MirroredStrategy(backend='torch')" in message
    assert "cannot hold" not in message  # the old message called float32 non-floating
    sim_variable = pd.Variable(np.zeros(3, np.float32))
    with pytest.raises(TypeError, match=r"The value to assign is a torch.Tensor"):
        sim_variable.assign(torch.ones(3))


def test_numpy_values_never_import_torch() -> None:
    code = (
        "import sys, numpy as np, polydist as pd\n"
        "v = pd.Variable(np.zeros(3))\n"
        "assert v._backend.name == 'sim', v._backend.name\n"
        "m = pd.metrics.Mean(); m.update_state([1.0, 2.0]); assert float(m.result()) == 1.5\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        timeout=120,
        # Where the packages are found by PYTHONPATH (installed with --target), keep it.
        env={"PATH": "/usr/bin:/bin", **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}},
    )


def test_a_metric_outside_any_scope_takes_tensors() -> None:
    accuracy = metrics.SparseCategoricalAccuracy()
    accuracy.update_state(torch.tensor([0, 1]), torch.tensor([[2.0, 1.0], [3.0, 0.0]]))
    assert float(accuracy.result()) == 0.5
    assert metrics.sparse_categorical_accuracy(
        torch.tensor([1]), torch.tensor([[0.0, 1.0]])
    ).tolist() == [1.0]


@pytest.mark.usefixtures("cpu_only")
def test_metrics_on_torch_replicas() -> None:
    strategy = pd.MirroredStrategy(4, backend="torch")
    with strategy.scope():
        accuracy = metrics.SparseCategoricalAccuracy()
    sizes = [2, 1, 0, 0]  # a partial last batch
    labels = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.zeros(sizes[ctx.replica_id_in_sync_group], dtype=torch.int64)
    )
    logits = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([[1.0, 0.0], [0.0, 1.0]])[: sizes[ctx.replica_id_in_sync_group]]
    )
    strategy.run(accuracy.update_state, args=(labels, logits))
    result = accuracy.result()
    assert isinstance(result, torch.Tensor) and result.dtype == torch.float32
    assert float(result) == pytest.approx(2 / 3)


def test_loss_helpers_outside_any_strategy_take_tensors() -> None:
    # The default strategy computes with the namespace of the tensor's backend.
    losses = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    average = pd.nn.compute_average_loss(losses, global_batch_size=3)
    assert isinstance(average, torch.Tensor) and float(average.detach()) == 2.0
    average.backward()
    assert losses.grad is not None and losses.grad.tolist() == pytest.approx([1 / 3] * 3)
    in_run = pd.get_strategy().run(lambda: pd.nn.compute_average_loss_exact(losses))
    assert isinstance(in_run, torch.Tensor) and float(in_run.detach()) == 2.0
    regularization = pd.get_strategy().run(lambda: pd.nn.scale_regularization_loss(losses))
    assert float(regularization.detach()) == 6.0
