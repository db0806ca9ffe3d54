"""Recycled host memory for the results of out-of-place all-reduces across workers.

TF's ``all_reduce`` returns a new tensor and leaves its input unchanged;
``torch.distributed.all_reduce`` works in place, so the strategy copies the
input and reduces the copy with gloo's own all_reduce (no collective of our
own: the engine's is the one users trust). Besides the copy pass, fresh memory
costs one page fault per 4 KiB page for tensors of more than a few hundred KiB
(glibc maps large blocks fresh from the kernel, which zeroes every page on
first touch); on loopback that adds up to as much as the collective itself
(``benchmarks/bench_multiworker.py``). `ResultCache` recycles the memory of
results the program has dropped, as torch's CUDA caching allocator does on
GPUs (the CPU allocator has no cache).
"""

from __future__ import annotations

import threading

import torch

__all__ = ["CACHE_MIN_BYTES", "ResultCache"]

#: Results smaller than this are allocated as usual: small blocks come from the
#: allocator's heap without page faults.
CACHE_MIN_BYTES = 64 << 10


#: How many tensors (and storage objects) hold a block: the private call torch's
#: cudagraph trees use to tell whether an output is still alive. Without it (another
#: torch version) the cache stays off rather than guess.
_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _use_count(storage: torch.UntypedStorage) -> int:
    assert _STORAGE_USE_COUNT is not None
    count: int = _STORAGE_USE_COUNT(storage._cdata)
    return count


class ResultCache:
    """Host memory for collective results, recycled once the program drops them.

    ``empty(shape, dtype)`` returns a new contiguous CPU tensor. Its memory is a
    block this cache keeps: a block is handed out again only when no tensor
    refers to it any more (no view, ``detach()``, NumPy array or autograd
    graph), so a result the program still holds is never overwritten. At most
    ``max_bytes`` are kept (blocks in use count); beyond that, idle blocks are
    freed, oldest first, or the tensor is allocated as usual.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0 disables the cache), got {max_bytes}.")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._blocks: dict[int, list[torch.UntypedStorage]] = {}  # by size, oldest first
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks kept (idle or in use)."""
        return self._bytes

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        size = torch.Size(shape)
        nbytes = size.numel() * dtype.itemsize
        if nbytes < CACHE_MIN_BYTES or nbytes > self.max_bytes or _STORAGE_USE_COUNT is None:
            return torch.empty(size, dtype=dtype, device="cpu")
        with self._lock:
            storage = self._take(nbytes)
        if storage is None:
            return torch.empty(size, dtype=dtype, device="cpu")
        empty = torch.empty(0, dtype=dtype, device="cpu")
        tensor: torch.Tensor = empty.set_(storage, 0, size, ())  # no strides: contiguous
        return tensor

    def clear(self) -> None:
        """Forgets every block (blocks in use stay valid: their tensors own them)."""
        with self._lock:
            self._blocks.clear()
            self._bytes = 0

    def _take(self, nbytes: int) -> torch.UntypedStorage | None:
        blocks = self._blocks.setdefault(nbytes, [])
        for i, block in enumerate(blocks):
            if _use_count(block) == 1 and block.nbytes() == nbytes:
                blocks.append(blocks.pop(i))  # most recently used last
                return block
        if self._bytes + nbytes > self.max_bytes:
            self._evict(self._bytes + nbytes - self.max_bytes)
            if self._bytes + nbytes > self.max_bytes:
                return None
        # A resizable storage, as torch.empty's (UntypedStorage(n) is not).
        block = torch.empty(nbytes, dtype=torch.uint8, device="cpu").untyped_storage()
        # Looked up again: _evict may have deleted this size's (empty) list.
        self._blocks.setdefault(nbytes, []).append(block)
        self._bytes += nbytes
        return block

    def _evict(self, need: int) -> None:
        """Frees idle blocks, oldest first within each size, until ``need`` bytes are freed."""
        for nbytes, blocks in list(self._blocks.items()):
            for block in list(blocks):
                if need <= 0:
                    return
                if _use_count(block) == 1:
                    blocks.remove(block)
                    self._bytes -= nbytes
                    need -= nbytes
            if not blocks:
                del self._blocks[nbytes]
