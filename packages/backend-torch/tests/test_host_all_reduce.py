"""ResultCache: recycled host memory for the results of cross-process collectives.

The all-reduce that uses it needs several processes: see
test_multi_worker_out_of_place.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from polydist_torch._host_all_reduce import CACHE_MIN_BYTES, ResultCache

N = CACHE_MIN_BYTES // 4 * 2  # float32 elements: twice the smallest cached size
MIB = 1 << 20


def _dropped(cache: ResultCache, fill: float = 1.0) -> int:
    """The address of a cached tensor the caller no longer holds."""
    t = cache.empty((N,), torch.float32)
    t.fill_(fill)
    return t.data_ptr()


def test_a_dropped_result_is_recycled_and_the_new_tensor_is_well_formed() -> None:
    cache = ResultCache(MIB)
    address = _dropped(cache)
    t = cache.empty((2, N // 2), torch.float32)
    assert t.data_ptr() == address  # same bytes: the same block
    assert t.shape == (2, N // 2) and t.dtype == torch.float32 and t.device.type == "cpu"
    assert t.is_contiguous() and t.stride() == (N // 2, 1) and not t.requires_grad
    assert cache.nbytes == N * 4
    t.resize_(4 * N)  # as resizable as torch.empty's tensors
    t[-1] = 3.0
    assert float(t[-1]) == 3.0


@pytest.mark.parametrize(
    "keep",
    [
        lambda t: t,
        lambda t: t[1:],
        lambda t: t.detach(),
        lambda t: t.numpy(),
        lambda t: t.view(torch.int32),
    ],
    ids=["tensor", "view", "detach", "numpy", "dtype-view"],
)
def test_memory_anything_still_uses_is_never_handed_out(keep: object) -> None:
    cache = ResultCache(MIB)
    t = cache.empty((N,), torch.float32)
    t.fill_(7.0)
    kept = keep(t)  # type: ignore[operator]
    del t
    other = cache.empty((N,), torch.float32)
    other.fill_(-1.0)
    assert np.asarray(kept).view(np.float32)[-1] == 7.0  # untouched
    assert cache.nbytes == 2 * N * 4


def test_a_result_saved_for_backward_is_kept() -> None:
    cache = ResultCache(MIB)
    x = torch.ones(N, requires_grad=True)
    t = cache.empty((N,), torch.float32).fill_(2.0)
    loss = (x * t).sum()  # autograd saves t for x's gradient
    del t
    cache.empty((N,), torch.float32).fill_(0.0)
    loss.backward()
    assert x.grad is not None and float(x.grad[0]) == 2.0


def test_the_cache_is_bounded() -> None:
    nbytes = N * 4
    cache = ResultCache(2 * nbytes)
    first = cache.empty((N,), torch.float32)
    second = cache.empty((N,), torch.float32)
    third = cache.empty((N,), torch.float32)  # both blocks in use, no room: plain memory
    assert cache.nbytes == 2 * nbytes
    del first
    smaller = cache.empty((N // 2,), torch.float32)  # evicts the idle block
    assert cache.nbytes == nbytes + nbytes // 2
    assert second.data_ptr() != smaller.data_ptr() != third.data_ptr()


def test_a_new_size_that_evicts_every_idle_block_is_still_kept() -> None:
    """Eviction may empty the list of the very size being requested: the new block
    must still be kept, and recycled once dropped."""
    nbytes = N * 4
    cache = ResultCache(2 * nbytes)
    _dropped(cache)  # an idle block of nbytes
    address = _dropped_size(cache, 2 * N)  # needs all the room: evicts it
    assert cache.nbytes == 2 * nbytes
    again = cache.empty((2 * N,), torch.float32)
    assert again.data_ptr() == address  # the block was kept, and is handed out again
    assert cache.nbytes == 2 * nbytes


def _dropped_size(cache: ResultCache, n: int) -> int:
    t = cache.empty((n,), torch.float32)
    t.fill_(2.0)
    return t.data_ptr()


def test_small_and_oversized_results_are_not_cached() -> None:
    cache = ResultCache(MIB)
    small = cache.empty((CACHE_MIN_BYTES // 4 - 1,), torch.float32)
    huge = cache.empty((MIB // 4 + 1,), torch.float32)
    assert small.numel() == CACHE_MIN_BYTES // 4 - 1 and huge.numel() == MIB // 4 + 1
    assert cache.nbytes == 0
    disabled = ResultCache(0)
    assert disabled.empty((N,), torch.float64).shape == (N,) and disabled.nbytes == 0


def test_clear_forgets_blocks_but_results_stay_valid() -> None:
    cache = ResultCache(MIB)
    t = cache.empty((N,), torch.float32).fill_(5.0)
    cache.clear()
    assert cache.nbytes == 0
    cache.empty((N,), torch.float32).fill_(0.0)
    assert float(t[0]) == 5.0


def test_factory_defaults_do_not_move_the_cache_off_the_host() -> None:
    cache = ResultCache(MIB)
    with torch.device("meta"):
        t = cache.empty((N,), torch.float32)
        small = cache.empty((3,), torch.float32)
    assert t.device.type == "cpu" and small.device.type == "cpu"


def test_bad_max_bytes() -> None:
    with pytest.raises(
        ValueError, match=r"max_bytes must be >= 0 \(0 disables the cache\), got -1"
    ):
        ResultCache(-1)
