"""A variable's values are placed once (``TorchBackend.place_variable``), a step's
inputs through ``place``: on a GPU the first copies from pageable memory, the second
stages in a page-locked buffer torch keeps for the next batch."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import polydist as pd
from polydist.backend import SupportsPlaceVariable, features
from polydist_torch import TorchBackend
from polydist_torch import _backend as torch_backend


def test_variables_are_placed_by_place_variable_and_inputs_by_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = TorchBackend()
    assert isinstance(backend, SupportsPlaceVariable) and features(backend).place_variable
    placed: list[str] = []
    place_variable = backend.place_variable

    def recorded(value: Any, device: str) -> Any:
        placed.append(device)
        return place_variable(value, device)

    monkeypatch.setattr(backend, "place_variable", recorded)
    strategy = pd.MirroredStrategy(["/cpu:0", "/cpu:1"], backend=backend)
    devices = list(strategy.extended.worker_devices)
    with strategy.scope():
        v = pd.Variable(np.zeros(3, np.float32))
    assert placed == devices  # each copy of the initial value
    v.assign(np.ones(3, np.float32))  # a host value assigned: placed as the variable's
    assert placed == devices * 2
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full(2, ctx.replica_id_in_sync_group, np.float32)
    )
    assert placed == devices * 2  # a step's inputs: place
    assert [x.tolist() for x in values.values] == [[0.0, 0.0], [1.0, 1.0]]
    assert [c.value().tolist() for c in v.values] == [[1.0, 1.0, 1.0]] * 2


def test_a_host_array_for_a_gpu_is_copied_once_for_a_variable_and_staged_for_a_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Which copy each path takes to a CUDA device (no GPU needed: the copies recorded).
    taken: list[str] = []

    def fake(name: str) -> Any:
        def copy(array: np.ndarray, target: torch.device) -> torch.Tensor:
            taken.append(name)
            assert target == torch.device("cuda", 0)
            return torch.from_numpy(np.array(array))

        return copy

    monkeypatch.setattr(torch_backend, "_to_cuda", fake("pinned, asynchronous"))
    monkeypatch.setattr(torch_backend, "_to_cuda_once", fake("pageable, once"))
    backend = TorchBackend()
    host = np.arange(4, dtype=np.float32)
    assert backend.place_variable(host, "/gpu:0").tolist() == host.tolist()
    assert backend.place(host, "/gpu:0").tolist() == host.tolist()
    assert taken == ["pageable, once", "pinned, asynchronous"]
    # A tensor is moved as place moves it (no staging of its own).
    tensor = torch.ones(2)
    assert backend.place_variable(tensor, "/cpu:0") is tensor


def test_place_variable_copies_what_it_is_given() -> None:
    backend = TorchBackend()
    host = np.arange(3, dtype=np.float32)
    placed = backend.place_variable(host, "/cpu:0")
    host[0] = 7.0
    assert placed.tolist() == [0.0, 1.0, 2.0]  # its own copy (TF's convert_to_tensor)
    frozen = np.arange(3, dtype=np.float32)
    frozen.flags.writeable = False
    assert torch_backend._to_cuda_once(frozen, torch.device("cpu")).tolist() == [0.0, 1.0, 2.0]
