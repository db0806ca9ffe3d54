"""torch.compile and distributed modules: a compiled module distributed, and a distributed
module compiled, train as one device does, with every replica's copy equal."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import polydist as pd
import polydist_torch

RTOL, ATOL = 1e-5, 1e-6


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)
    ]


def compiled(module: nn.Module, backend: str) -> Callable[..., Any]:
    return torch.compile(module, backend=backend)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("where", "backend"),
    [
        ("inside", "aot_eager"),
        ("outside", "aot_eager"),
        pytest.param(
            "outside",
            "inductor",
            # torch's own, raised as inductor imports torch.utils.mkldnn (torch 2.13).
            marks=pytest.mark.filterwarnings(
                "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
            ),
        ),
    ],
)
def test_compiled_modules_train_as_one_device(where: str, backend: str) -> None:
    reference = make_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches():
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    strategy = pd.MirroredStrategy([f"/cpu:{i}" for i in range(2)], backend="torch")
    with strategy.scope():
        # torch.compile(module) is an nn.Module (its state_dict keys gain "_orig_mod.").
        inner = compiled(make_model(), backend) if where == "inside" else make_model()
        model = polydist_torch.distribute_module(inner)  # type: ignore[arg-type]
    opt = polydist_torch.distribute_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    forward = compiled(model, backend) if where == "outside" else model

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = pd.nn.compute_average_loss(F.cross_entropy(forward(x), y, reduction="none"))
        loss.backward()
        opt.step()
        opt.zero_grad()

    for batch in strategy.experimental_distribute_dataset(batches()):
        strategy.run(step, args=batch)
    assert pd.debugging.check_replicas_identical(strategy) == 4
    got = {k.removeprefix("_orig_mod."): v for k, v in model.state_dict().items()}
    want = reference.state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=RTOL, atol=ATOL, msg=key)
    assert not torch.equal(got["0.weight"], make_model().state_dict()["0.weight"])  # trained
