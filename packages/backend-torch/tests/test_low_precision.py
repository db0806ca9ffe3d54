"""torch's bfloat16 and float8 dtypes as ml_dtypes' NumPy dtypes, and back, bit for bit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

import polydist as pd
from polydist.data import AutoShardPolicy, Dataset, Options
from polydist.debugging import ReplicaDivergenceError, check_replicas_identical
from polydist_sim import SimBackend
from polydist_torch import TorchBackend
from polydist_torch._low_precision import SHARED

N = 4
BF16 = np.dtype(ml_dtypes.bfloat16)
# bfloat16 bit patterns: 1.0078125 (1 + 2**-7), -0.0, inf, -inf, a quiet NaN, a
# signalling NaN with the sign set, the smallest subnormal, the largest finite.
BF16_BITS = [0x3F81, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFF81, 0x0001, 0x7F7F]
# The formats both torch and ml_dtypes have here (float8_e8m0fnu needs torch >= 2.7).
SHARED_HERE = [n for n in SHARED if hasattr(torch, n) and hasattr(ml_dtypes, n)]


def bf16_tensor(bits: list[int]) -> torch.Tensor:
    return torch.tensor(np.array(bits, np.uint16).view(np.int16)).view(torch.bfloat16)


def bits_of(array: np.ndarray) -> list[int]:
    return list(
        array.view(np.uint16 if array.dtype.itemsize == 2 else np.uint8).reshape(-1).tolist()
    )


def torch_bits(tensor: torch.Tensor) -> list[int]:
    width = torch.int16 if tensor.element_size() == 2 else torch.uint8
    raw = tensor.view(width).numpy()
    return list((raw.view(np.uint16) if width == torch.int16 else raw).reshape(-1).tolist())


def test_bfloat16_round_trips_bit_for_bit() -> None:
    backend = TorchBackend()
    tensor = bf16_tensor(BF16_BITS)
    array = backend.to_numpy(tensor)
    assert array.dtype == BF16
    assert bits_of(array) == BF16_BITS
    assert array[0] == np.float32(1.0078125)
    assert np.signbit(array[1]) and array[1] == 0
    assert np.isposinf(array[2]) and np.isneginf(array[3]) and np.isnan(array[4])
    back = backend.place(array, "/cpu:1")
    assert back.dtype == torch.bfloat16
    assert torch_bits(back) == BF16_BITS


def test_to_numpy_hands_out_a_copy_of_any_layout() -> None:
    backend = TorchBackend()
    tensor = bf16_tensor(BF16_BITS).reshape(2, 4)
    array = backend.to_numpy(tensor.T)  # not contiguous
    assert array.shape == (4, 2) and bits_of(array.T.reshape(-1)) == BF16_BITS
    array[0, 0] = 5
    assert torch_bits(tensor.reshape(-1)) == BF16_BITS
    scalar = backend.to_numpy(torch.tensor(1.0078125, dtype=torch.bfloat16))
    assert scalar.shape == () and scalar.dtype == BF16 and scalar == np.float32(1.0078125)
    grad = torch.tensor([1.5], dtype=torch.bfloat16, requires_grad=True)
    assert backend.to_numpy(grad * 2).tolist() == [3.0]


def test_to_numpy_of_a_negated_view_keeps_its_values() -> None:
    # A tensor with torch's negative bit set cannot be viewed as another dtype as it is.
    negated = torch._neg_view(torch.tensor([1.0078125, -2.0], dtype=torch.bfloat16))
    assert negated.is_neg()
    array = TorchBackend().to_numpy(negated)
    assert array.dtype == BF16 and array.tolist() == [-1.0078125, 2.0]


@pytest.mark.parametrize("name", SHARED_HERE)
def test_every_bit_pattern_means_the_same_value_in_both(name: str) -> None:
    backend = TorchBackend()
    dtype = np.dtype(getattr(ml_dtypes, name))
    raw = np.arange(2 ** (8 * dtype.itemsize), dtype=np.int64)
    unsigned = raw.astype(np.uint16 if dtype.itemsize == 2 else np.uint8)
    tensor = backend.place(unsigned.view(dtype), "/cpu:0")
    assert tensor.dtype == getattr(torch, name)
    assert torch_bits(tensor) == unsigned.tolist()
    array = backend.to_numpy(tensor)
    assert array.dtype == dtype and bits_of(array) == unsigned.tolist()
    # torch's and ml_dtypes' own conversions to float32 agree on every pattern.
    np.testing.assert_array_equal(array.astype(np.float32), tensor.float().numpy())


def test_place_takes_read_only_reversed_and_scalar_arrays() -> None:
    backend = TorchBackend()
    array = np.array([1.0078125, -0.0, 3.0], BF16)
    array.flags.writeable = False
    reversed_ = backend.place(array[::-1], "/cpu:0")
    assert reversed_.dtype == torch.bfloat16 and reversed_.tolist() == [3.0, -0.0, 1.0078125]
    scalar = backend.place(array[0], "/cpu:0")  # an ml_dtypes scalar
    assert scalar.dtype == torch.bfloat16 and scalar.shape == () and scalar.item() == 1.0078125
    source = np.array([2.0], BF16)
    placed = backend.place(source, "/cpu:0")
    source[0] = 4.0
    assert placed.tolist() == [2.0]  # a private copy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bfloat16_round_trips_through_a_gpu() -> None:
    # Onto the GPU through pinned host memory, as int16 bits viewed as bfloat16 there.
    backend = TorchBackend()
    placed = backend.place(np.array(BF16_BITS, np.uint16).view(BF16), "/gpu:0")
    assert placed.device.type == "cuda" and placed.dtype == torch.bfloat16
    assert torch_bits(placed.cpu()) == BF16_BITS
    array = backend.to_numpy(placed)
    assert array.dtype == BF16 and bits_of(array) == BF16_BITS


@pytest.mark.parametrize("name", ["int4", "float8_e4m3b11fnuz"])
def test_place_refuses_ml_dtypes_torch_lacks(name: str) -> None:
    with pytest.raises(TypeError, match=rf"of dtype {name}.*torch takes these ml_dtypes dtypes"):
        TorchBackend().place(np.zeros(2, getattr(ml_dtypes, name)), "/cpu:0")


def test_array_namespace_asarray_takes_ml_dtypes_arrays() -> None:
    xp = TorchBackend().array_namespace()
    source = np.array(BF16_BITS, np.uint16).view(BF16)
    copied = xp.asarray(source)
    assert copied.dtype == torch.bfloat16 and torch_bits(copied) == BF16_BITS
    source[0] = 0
    assert torch_bits(copied)[0] == BF16_BITS[0]  # a private copy unless copy=False
    shared = xp.asarray(source, copy=False)
    source[0] = 2.0
    assert shared[0].item() == 2.0
    widened = xp.asarray(np.array([1.0078125], BF16), dtype=torch.float32)
    assert widened.dtype == torch.float32 and widened.tolist() == [1.0078125]


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_ml_dtypes_is_imported_only_for_low_precision_values() -> None:
    out = _run(
        """
        import sys
        import numpy as np, torch
        from polydist_torch import TorchBackend
        backend = TorchBackend()
        backend.to_numpy(backend.place(np.arange(3.0), "/cpu:0"))
        backend.array_namespace().asarray(np.arange(3.0))
        print("ml_dtypes" in sys.modules)
        print(backend.to_numpy(torch.ones(1, dtype=torch.bfloat16)).dtype)
        print("ml_dtypes" in sys.modules)
        """
    )
    assert out.split() == ["False", "bfloat16", "True"]


def test_without_ml_dtypes_to_numpy_widens_to_float32() -> None:
    out = _run(
        """
        import sys
        sys.modules["ml_dtypes"] = None  # import ml_dtypes raises ImportError
        import torch
        from polydist_torch import TorchBackend
        backend = TorchBackend()
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            a = backend.to_numpy(torch.tensor([1.125, -0.0, 448.0], dtype=dtype))
            print(a.dtype, a.tolist())
        """
    )
    assert out.splitlines() == ["float32 [1.125, -0.0, 448.0]"] * 2


# -- through strategies -----------------------------------------------------------------


def torch_strategy() -> pd.MirroredStrategy:
    return pd.MirroredStrategy([f"/cpu:{i}" for i in range(N)], backend=TorchBackend("sequential"))


def test_mirrored_variable_reads_and_writes_bfloat16() -> None:
    strategy = torch_strategy()
    with strategy.scope():
        v = pd.Variable(bf16_tensor(BF16_BITS[:2]))
    value = v.numpy()
    assert value.dtype == BF16 and bits_of(value) == BF16_BITS[:2]
    v.assign(np.array([3.0, 1.0078125], BF16))
    v.assign(v.numpy())  # what a restore from a snapshot does
    for copy in strategy.experimental_local_results(v):
        assert copy.dtype == torch.bfloat16 and copy.read_value().tolist() == [3.0, 1.0078125]
    with strategy.scope():
        w = pd.Variable(np.array([1.0078125], BF16))  # ml_dtypes' initial value
    assert [c.dtype for c in strategy.experimental_local_results(w)] == [torch.bfloat16] * N


def _bf16_inputs() -> list[np.ndarray]:
    # Replica 0 has 1, the others 2**-8: adding in bfloat16 each tie goes to 1.0.
    return [np.array([1.0 if r == 0 else 2.0**-8, 0.25 * r - 0.5], BF16) for r in range(N)]


def _reduce(strategy: pd.Strategy, op: str, place: bool) -> np.ndarray:
    inputs = _bf16_inputs()
    backend = strategy.extended.backend

    devices = strategy.extended.worker_devices

    def value_fn(ctx: pd.experimental.ValueContext) -> Any:
        r = ctx.replica_id_in_sync_group
        return backend.place(inputs[r], devices[r]) if place else inputs[r]

    per_replica = strategy.experimental_distribute_values_from_function(value_fn)
    out = strategy.reduce(op, per_replica, axis=None)
    return np.asarray(backend.to_numpy(out))


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("place", [True, False], ids=["tensors", "ml_dtypes-arrays"])
def test_reduce_of_bfloat16_matches_the_sim(op: str, place: bool) -> None:
    got = _reduce(torch_strategy(), op, place)
    expected = _reduce(pd.MirroredStrategy(N, backend=SimBackend("sequential")), op, place)
    assert expected.dtype == BF16 and got.dtype == BF16
    assert bits_of(got) == bits_of(expected)
    if op == "SUM":
        assert got.tolist() == [1.0, 0.25 * N * (N - 1) / 2 - 0.5 * N]


def test_divergent_bfloat16_copies_are_reported_with_their_difference() -> None:
    strategy = torch_strategy()
    with strategy.scope():
        w = pd.Variable(torch.zeros(2, dtype=torch.bfloat16), name="w")
    strategy.experimental_local_results(w)[2].assign(
        torch.tensor([0.0, 1.0078125], dtype=torch.bfloat16)
    )
    with pytest.raises(ReplicaDivergenceError) as info:
        check_replicas_identical(strategy)
    message = str(info.value)
    assert "index (1,): 0.0 (replica 0) vs 1.0078125 (replica 2)" in message
    assert "max abs difference 1.00781" in message


def test_mean_of_nan_bfloat16_batch_means_warns_about_empty_batches() -> None:
    strategy = torch_strategy()
    options = Options()
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
    dataset = Dataset.range(10).batch(4).with_options(options)  # last step: 2 of 4 empty

    def batch_mean(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16).sum() / x.shape[0]  # NaN for an empty batch

    results = []
    for x in strategy.experimental_distribute_dataset(dataset):
        means = strategy.run(batch_mean, (x,))
        if any(v.isnan().item() for v in means.values):
            with pytest.warns(pd.PartialBatchWarning, match=r"replica\(s\) \[2, 3\]"):
                results.append(strategy.reduce("MEAN", means, axis=None))
        else:
            results.append(strategy.reduce("MEAN", means, axis=None))
    assert [r.dtype for r in results] == [torch.bfloat16] * 3
    assert [r.item() for r in results[:2]] == [1.5, 5.5]
    assert np.isnan(results[2].item())
