"""A torch worker for the out-of-place all-reduce tests (test_multi_worker_out_of_place.py).

``python mw_out_of_place.py OUT [stall]`` under ``polydist launch -n W``: reduces the
`inputs` of every case through the process group's out-of-place all-reduce
(a copy into recycled memory, then gloo's all_reduce) and through
``MultiWorkerMirroredStrategy`` with 1 and 2 replicas per worker, and writes
``OUT/worker<rank>.npz``: each result, each input as it was afterwards, and
a few facts about memory.
With ``stall``, worker 1 stops before the second all-reduce; worker 0
writes the error it gets to ``OUT/error0.json`` and exits with code 17.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

# float32 elements: 8 MiB and a bit, not a multiple of 2 or 3 (uneven ring chunks in gloo).
BIG = (8 << 20) // 4 + 12_345
SMALL = 5


def inputs(case: str, worker: int, replica: int = 0) -> np.ndarray:
    """Case ``case``'s value on ``worker``'s replica ``replica`` (NumPy, float32 unless named)."""
    rng = np.random.RandomState(1000 * worker + 10 * replica + sum(map(ord, case)))
    if case == "random":  # rounding matters: only 2 workers give one exact rounding per element
        return (rng.standard_normal(BIG) * 10.0 ** rng.randint(-3, 4, BIG)).astype(np.float32)
    ints = rng.randint(-1000, 1000, size=BIG)
    if case == "int64":
        return ints.astype(np.int64)
    if case == "float16":
        return (ints % 64).astype(np.float16)
    if case == "complex64":
        return (ints + 1j * ints[::-1]).astype(np.complex64)
    if case == "matrix_t":  # a transposed (non-contiguous) input
        return ints[: BIG // 1000 * 1000].reshape(BIG // 1000, 1000).astype(np.float32)
    if case == "small":
        return ints[:SMALL].astype(np.float32)
    return ints.astype(np.float32)  # "ints": sums exact in any order


CASES = ("random", "ints", "int64", "float16", "complex64", "matrix_t", "small")


def stall(out: Path) -> None:
    import torch

    import polydist as pd

    options = pd.experimental.CommunicationOptions(timeout_seconds=3)
    strategy = pd.MultiWorkerMirroredStrategy(
        backend="torch", communication_options=options, local_devices=1
    )
    rank = int(os.environ["RANK"])
    x = torch.ones(BIG)

    def step(v: Any) -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce(pd.ReduceOp.SUM, v)

    strategy.run(step, args=(x,))
    if rank == 1:
        time.sleep(60)  # alive (heartbeats go on) but never at the next collective
        return
    start = time.monotonic()
    try:
        strategy.run(step, args=(x,))
    except Exception as e:
        error = {"type": type(e).__name__, "message": str(e), "after": time.monotonic() - start}
        (out / "error0.json").write_text(json.dumps(error))
        sys.stdout.flush()
        os._exit(17)


def _idle(cache: Any, address: int) -> None:
    """Waits (up to 5 s) until the cache's block at ``address`` is idle: gloo's worker
    thread drops its reference to a collective's tensor a moment after ``wait()``
    returns, and until then the cache (rightly) takes a fresh block."""
    from polydist_torch._host_all_reduce import _use_count

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        blocks = [b for size in cache._blocks.values() for b in size if b.data_ptr() == address]
        if blocks and _use_count(blocks[0]) == 1:
            return
        time.sleep(0.001)


def main(out: Path) -> None:
    import torch

    import polydist as pd
    import polydist_torch._multi_worker as mw

    rank = int(os.environ["RANK"])
    one = pd.MultiWorkerMirroredStrategy(backend="torch", local_devices=1)
    two = pd.MultiWorkerMirroredStrategy(backend="torch", local_devices=2)
    backend = one.extended.backend
    assert isinstance(backend, mw.TorchProcessGroupBackend)
    group = backend._group
    assert group is not None
    saved: dict[str, Any] = {}

    def tensor(case: str, replica: int = 0) -> torch.Tensor:
        t = torch.from_numpy(inputs(case, rank, replica))
        return t.t() if case == "matrix_t" else t

    # The process group's out-of-place all-reduce, each dtype and layout.
    for case in CASES:
        x = tensor(case)
        result = group.all_reduce(x, backend._cache)
        saved[f"group_{case}"] = result.numpy()
        saved[f"group_{case}_input_after"] = x.numpy().copy()

    def all_reduce(op: pd.ReduceOp) -> Any:
        def step(v: Any) -> Any:
            ctx = pd.get_replica_context()
            assert ctx is not None
            return ctx.all_reduce(op, v)

        return step

    # Through the strategy, 1 replica per worker: a dropped result's memory
    # is recycled, one still held is not.
    x = tensor("ints")
    held = one.run(all_reduce(pd.ReduceOp.SUM), args=(x,))
    dropped_address = one.run(all_reduce(pd.ReduceOp.SUM), args=(x * 2,)).data_ptr()
    _idle(backend._cache, dropped_address)
    again = one.run(all_reduce(pd.ReduceOp.SUM), args=(x * 3,))
    mean = one.run(all_reduce(pd.ReduceOp.MEAN), args=(x,))
    saved["one_sum"] = held.numpy()  # after the later runs: still the first sum
    saved["one_sum_x3"] = again.numpy()
    saved["one_mean"] = mean.numpy()
    saved["one_input_after"] = x.numpy()
    saved["one_recycled"] = np.asarray(again.data_ptr() == dropped_address)
    saved["one_held_kept"] = np.asarray(held.data_ptr() not in (dropped_address, again.data_ptr()))
    saved["one_reduce"] = one.reduce(pd.ReduceOp.SUM, x, axis=None).numpy()

    # 2 replicas per worker: every replica gets its own result.
    values = two.experimental_distribute_values_from_function(
        lambda c: torch.from_numpy(inputs("ints", rank, c.replica_id_in_sync_group % 2))
    )
    results = two.experimental_local_results(two.run(all_reduce(pd.ReduceOp.SUM), args=(values,)))
    saved["two_sum"] = np.stack([r.numpy().copy() for r in results])
    results[0].add_(1)  # in place on replica 0's copy only
    saved["two_sum_after_add"] = np.stack([r.numpy() for r in results])
    saved["two_distinct"] = np.asarray(results[0].data_ptr() != results[1].data_ptr())
    saved["two_inputs_after"] = np.stack(
        [v.numpy() for v in two.experimental_local_results(values)]
    )
    packed(rank, one, two, saved)
    np.savez(out / f"worker{rank}.npz", **saved)
    mw.shutdown()


#: A nest's arrays (case, shape), all-reduced in one call: packed per dtype (the int16
#: array crosses gloo widened), shapes that are no multiple of 2 or 3, a scalar.
NEST = (
    ("ints", (7, 3)),
    ("small", ()),
    ("int64", (5,)),
    ("ints", (1000,)),
    ("float16", (2, 2)),
    ("int16", (6,)),
    ("complex64", (3,)),
    ("ints", (0,)),
    ("ints", (20_000,)),  # 64 KiB or more: results on the pack's memory
    ("ints", (17_000,)),
)


def nest_inputs(worker: int, replica: int = 0) -> list[np.ndarray]:
    """`NEST`'s arrays on ``worker``'s replica ``replica``."""
    arrays = []
    for i, (case, shape) in enumerate(NEST):
        size = int(np.prod(shape))
        if case == "int16":
            value = (inputs("ints", worker, replica)[:size] % 100).astype(np.int16)
        else:
            value = inputs(case, worker, replica)[i : i + size]
        arrays.append(value.reshape(shape))
    return arrays


def packed(rank: int, one: Any, two: Any, saved: dict[str, Any]) -> None:
    """A nest all-reduced in one call, packed per dtype: one pack (the default), packs of
    at most 64 bytes, and 2 replicas per worker; with autograd through the packed call."""
    import torch

    import polydist as pd

    def sums(nest: Any) -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce(pd.ReduceOp.SUM, nest)

    nest = [torch.from_numpy(a) for a in nest_inputs(rank)]
    small = pd.MultiWorkerMirroredStrategy(
        backend="torch",
        local_devices=1,
        communication_options=pd.experimental.CommunicationOptions(bytes_per_pack=64),
    )
    group = one.extended.backend._group
    for name, strategy in (("packed", one), ("packed_small", small)):
        before = group.collectives
        results = strategy.run(sums, args=(nest,))
        saved[f"{name}_collectives"] = np.asarray(group.collectives - before)
        for i, result in enumerate(results):
            saved[f"{name}_{i}"] = result.numpy().copy()
        saved[f"{name}_own_tensors"] = np.asarray([r._base is None for r in results])
        memory = [r.untyped_storage().data_ptr() for r in results]
        saved[f"{name}_scalar_own_memory"] = np.asarray(memory[1] not in memory[:1] + memory[2:])
        saved[f"{name}_big_share_memory"] = np.asarray(memory[8] == memory[9])
        tail = memory[0] == memory[3] and memory[0] not in (memory[8], memory[1])
        saved[f"{name}_small_share_a_tail"] = np.asarray(tail)
        results[0].add_(1)  # in place on one result: the others keep their values
        saved[f"{name}_after_add"] = results[3].numpy().copy()
    saved["packed_inputs_after"] = np.concatenate([t.numpy().ravel().real for t in nest])
    # batch_reduce_to packs too: onto each value's devices, and onto one device.
    values = [one.experimental_distribute_values_from_function(lambda c, t=t: t) for t in nest]
    for name, pairs in (
        ("batch", [(v, v) for v in values]),
        ("batch_mixed", [(v, v) for v in values] + [(v, "/cpu:0") for v in values]),
    ):
        before = group.collectives
        batched = one.extended.batch_reduce_to(pd.ReduceOp.SUM, pairs)
        saved[f"{name}_collectives"] = np.asarray(group.collectives - before)
        for i, result in enumerate(batched):
            local = one.experimental_local_results(result)[0]
            saved[f"{name}_{i}"] = local.numpy().copy()
    per_replica = two.experimental_distribute_values_from_function(
        lambda c: [torch.from_numpy(a) for a in nest_inputs(rank, c.replica_id_in_sync_group % 2)]
    )
    results = two.experimental_local_results(two.run(sums, args=(per_replica,)))
    for i in range(len(NEST)):
        saved[f"packed_two_{i}"] = np.stack([r[i].numpy() for r in results])

    def grads(xs: Any) -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        ys = ctx.all_reduce(pd.ReduceOp.SUM, [x * 2 for x in xs])
        ys[0].mul_(1.0)  # in place on a result autograd tracks: allowed (not a view)
        (ys[0].sum() * (rank + 3) + ys[1].sum()).backward()
        return [x.grad for x in xs]

    leaves = [torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)]
    saved["packed_grads"] = np.concatenate([g.numpy() for g in one.run(grads, args=(leaves,))])


def pack_mismatch(out: Path) -> None:
    """Worker 0 all-reduces a nest of shapes [2], [4, 1]; worker 1 of [4], [2, 1]: as many
    elements, packed in another layout. Each writes the error it gets to
    ``OUT/error<rank>.json`` and exits with code 17."""
    import torch

    import polydist as pd

    strategy = pd.MultiWorkerMirroredStrategy(backend="torch", local_devices=1)
    rank = int(os.environ["RANK"])
    first, second = (2, 4) if rank == 0 else (4, 2)
    nest = [torch.ones(first), torch.ones(second, 1)]

    def sums(v: Any) -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce(pd.ReduceOp.SUM, v)

    try:
        strategy.run(sums, args=(nest,))
    except Exception as e:
        error = {"type": type(e).__name__, "message": str(e)}
        (out / f"error{rank}.json").write_text(json.dumps(error))
        sys.stdout.flush()
        os._exit(17)


def unchecked(out: Path) -> None:
    """With $POLYDIST_CHECK_COLLECTIVES=0: the sums, and the number of elements of every
    gloo all_reduce issued (no presence flag: the input's own size)."""
    import torch
    import torch.distributed as dist

    import polydist as pd
    import polydist_torch._multi_worker as mw

    issued: list[int] = []
    engine_all_reduce = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        issued.append(tensor.numel())
        return engine_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment]
    rank = int(os.environ["RANK"])
    one = pd.MultiWorkerMirroredStrategy(backend="torch", local_devices=1)
    two = pd.MultiWorkerMirroredStrategy(backend="torch", local_devices=2)
    saved: dict[str, Any] = {}
    x = torch.from_numpy(inputs("ints", rank))

    def step(v: Any) -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce(pd.ReduceOp.SUM, v)

    saved["one_sum"] = one.run(step, args=(x,)).numpy().copy()
    saved["one_sum_again"] = one.run(step, args=(x,)).numpy().copy()
    nest = [torch.from_numpy(inputs("ints", rank)[:n]) for n in (1000, 20_000, 7)]
    saved["nest"] = np.concatenate([r.numpy() for r in one.run(step, args=(nest,))])
    values = two.experimental_distribute_values_from_function(
        lambda c: torch.from_numpy(inputs("ints", rank, c.replica_id_in_sync_group % 2))
    )
    results = two.experimental_local_results(two.run(step, args=(values,)))
    saved["two_sum"] = np.stack([r.numpy().copy() for r in results])
    saved["issued"] = np.asarray(issued)
    np.savez(out / f"worker{rank}.npz", **saved)
    mw.shutdown()


if __name__ == "__main__":
    if sys.argv[2:] == ["stall"]:
        stall(Path(sys.argv[1]))
    elif sys.argv[2:] == ["unchecked"]:
        unchecked(Path(sys.argv[1]))
    elif sys.argv[2:] == ["pack_mismatch"]:
        pack_mismatch(Path(sys.argv[1]))
    else:
        main(Path(sys.argv[1]))
