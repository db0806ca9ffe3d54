"""Out-of-place all-reduce of host (CPU) tensors across worker processes.

TF's ``all_reduce`` returns a new tensor and leaves its input unchanged;
``torch.distributed.all_reduce`` works in place. Cloning the input and
reducing the clone in place costs, besides the collective, a copy pass over
the tensor and, for tensors of more than a few hundred KiB, one page fault per
4 KiB page of the fresh memory (glibc maps large blocks fresh from the kernel,
which zeroes every page on first touch). On loopback that adds up to as much
as the collective itself (``benchmarks/bench_multiworker.py``). Two remedies:

* `ResultCache` recycles the memory of results the program has dropped, as
  torch's CUDA caching allocator does on GPUs (the CPU allocator has no cache).
* `ring_all_reduce` runs the ring algorithm (reduce-scatter, then all-gather)
  over the process group's send/recv: each chunk of the result is received
  from the previous worker and the local chunk is added to it in place, so
  the input is only read and no separate copy pass is needed.
"""

from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist

__all__ = ["RING_MIN_BYTES", "ResultCache", "ring_all_reduce"]

#: Host tensors at least this large are reduced by `ring_all_reduce` (below, the
#: ring's extra point-to-point round trips cost more than the copy they save).
RING_MIN_BYTES = 1 << 20
#: Results smaller than this are allocated as usual: small blocks come from the
#: allocator's heap without page faults.
CACHE_MIN_BYTES = 64 << 10


def _use_count(storage: torch.UntypedStorage) -> int:
    # The count of tensors (and storage objects) holding this memory; the same
    # check torch's cudagraph trees use to tell whether an output is still alive.
    count: int = torch._C._storage_Use_Count(storage._cdata)
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
        if nbytes < CACHE_MIN_BYTES or nbytes > self.max_bytes:
            return torch.empty(size, dtype=dtype, device="cpu")
        with self._lock:
            storage = self._take(nbytes)
        if storage is None:
            return torch.empty(size, dtype=dtype, device="cpu")
        strides: list[int] = []
        step = 1
        for dim in reversed(size):
            strides.insert(0, step)
            step *= max(dim, 1)
        empty = torch.empty(0, dtype=dtype, device="cpu")
        tensor: torch.Tensor = empty.set_(storage, 0, size, strides)
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
        blocks.append(block)
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


def ring_all_reduce(
    value: torch.Tensor,
    out: torch.Tensor,
    *,
    rank: int,
    world_size: int,
    timeout: float,
    group: dist.ProcessGroup | None = None,
) -> None:
    """``out`` = the sum of every worker's ``value``; ``value`` is only read.

    ``out`` is contiguous with ``value``'s shape and dtype (not bool or
    complex: pass real views) and does not overlap ``value``. The ring splits the flat tensor into
    ``world_size`` chunks; in step s of the reduce-scatter, worker r receives
    chunk r-s-1 (the partial sum of the workers before it) into ``out`` and
    adds its own chunk, then sends it on; after W-1 steps each worker holds
    one complete chunk, and W-1 all-gather steps pass the complete chunks
    around. Every worker ends with the same bits. Each wait is bounded by
    ``timeout`` seconds. ``group``: default, the default group (whose ranks
    ``rank`` and ``world_size`` are).
    """
    pg = group if group is not None else dist.group.WORLD
    if not isinstance(pg, dist.ProcessGroup):
        raise RuntimeError(
            "ring_all_reduce needs torch.distributed's default group: call "
            "torch.distributed.init_process_group first, or pass group=..."
        )
    src = value.reshape(-1)
    dst = out.view(-1)
    n = src.numel()
    bounds = [n * i // world_size for i in range(world_size + 1)]
    wait = datetime.timedelta(seconds=timeout)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size

    def chunk(t: torch.Tensor, c: int) -> torch.Tensor:
        c %= world_size
        return t[bounds[c] : bounds[c + 1]]

    def exchange(send: torch.Tensor, recv: torch.Tensor) -> None:
        # The group's own send/recv: dist.isend/irecv's checks cost more than small chunks.
        works = [pg.send([send], right, 0), pg.recv([recv], left, 0)]
        for work in works:
            work.wait(wait)

    for s in range(world_size - 1):
        send = chunk(src if s == 0 else dst, rank - s)
        recv = chunk(dst, rank - s - 1)
        exchange(send, recv)
        recv.add_(chunk(src, rank - s - 1))
    for s in range(world_size - 1):
        exchange(chunk(dst, rank + 1 - s), chunk(dst, rank - s))
