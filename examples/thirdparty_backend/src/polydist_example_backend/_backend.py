"""``ThreadsBackend``: NumPy replicas that run at the same time, on threads.

Each replica of ``strategy.run`` runs on a thread of its own, concurrently with
the others (NumPy releases the GIL in its kernels). The replicas meet at every
collective through a :class:`_Group`, a rendezvous in shared memory: each
replica posts a copy of its arrays, waits until every replica has posted, and
then computes its own result from its peers' copies, as a direct all-reduce
over shared memory does. ``merge_call`` runs ``merge_fn`` once, on the thread
that called ``strategy.run``, which waits for the replicas there. Core runs an
eager backend's replicas with its ``replica_runner``: here a `ThreadsRunner`.

Written against the public contract only: ``polydist`` and ``polydist.backend.*``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import polydist as pd
from polydist.backend import (
    Backend,
    Capabilities,
    EagerReplicaRunner,
    ReplicaChannel,
    ReplicaGroup,
    SupportsReplicaRunner,
    timeout_seconds_from_env,
)
from polydist.backend.context import cross_replica_scope
from polydist.backend.devices import DeviceSpec
from polydist.backend.tracing import (
    declare_internal_modules,
    is_tracing,
    record_collective,
    user_source_line,
)
from polydist.backend.values import regroup, select_replica
from polydist.errors import CollectiveMismatchError, DeadlineExceededError

__all__ = ["DEFAULT_DEVICES", "ThreadsBackend", "ThreadsRunner", "sum_in_replica_order"]

#: Virtual CPU devices, one thread each while a step runs.
DEFAULT_DEVICES = 8
_VERSION = "0.1.0"


def _device(index: int) -> str:
    return f"/job:localhost/replica:0/task:0/device:CPU:{index}"


def sum_in_replica_order(values: Sequence[np.ndarray]) -> np.ndarray:
    """The sum of ``values`` (same shape and dtype), added in replica order.

    Floating values are added in float64 (complex in complex128) and rounded once
    to their dtype, so a float32, bfloat16 or float16 sum is as good as a
    correctly rounded one except in rare double-rounding cases; float64 is added
    in its own type, one rounding per addition. Integers add in their own dtype
    and wrap on overflow, as TF's ``add_n`` does. The result is a new array.
    """
    first = np.asarray(values[0])
    dtype = first.dtype
    if dtype.kind in "iu":
        total = first.copy()
        for v in values[1:]:
            np.add(total, v, out=total)
        return total
    wide = np.complex128 if dtype.kind == "c" else np.float64
    acc = first.astype(wide)  # a copy
    for v in values[1:]:
        np.add(acc, np.asarray(v).astype(wide, copy=False), out=acc)
    return acc.astype(dtype)


# -- the rendezvous ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Post:
    """What one replica brings to one collective."""

    kind: str  # "all_reduce" | "all_gather" | "merge_call"
    signature: tuple[Any, ...]
    payload: Any
    where: str  # the user's source line, for diagnostics

    def describe(self) -> str:
        if self.kind == "merge_call":
            return f"merge_call at {self.where}"
        leaves = ", ".join(f"{np.dtype(d).name}{list(s)}" for d, s in self.signature[1])
        head = (
            f"all_reduce({self.signature[0]})"
            if self.kind == "all_reduce"
            else f"all_gather(axis={self.signature[0]})"
        )
        return f"{head} of [{leaves}] at {self.where}"


class _Abort(BaseException):
    """Unwinds a replica waiting at a collective after another replica failed.

    A BaseException, so that a user's ``except Exception`` does not swallow it.
    """


class _Group:
    """One ``strategy.run``: ``n`` replica threads and the thread that started them.

    Collective number ``k`` of every replica meets in round ``k``: the replica
    posts, waits until all ``n`` have posted (or a replica failed, returned early,
    or the timeout passed), and reads every post. Posts are copies, so a replica
    that goes on and writes its arrays in place cannot change what a slower peer
    still reads. The last replica to read a round drops it.
    """

    def __init__(self, strategy: pd.Strategy, devices: Sequence[str], timeout: float) -> None:
        self.strategy = strategy
        self.devices = tuple(devices)
        self.n = len(devices)
        self.timeout = timeout
        self.cond = threading.Condition()
        self.rounds: dict[int, list[_Post | None]] = {}
        self.readers: dict[int, int] = {}
        self.merges: list[int] = []  # complete merge_call rounds, for the caller's thread
        self.merge_results: dict[int, Any] = {}
        self.returned: dict[int, int] = {}  # replica -> collectives it made before returning
        self.waiting = 0  # replicas waiting in meet or merge_result (they time out there)
        self.ended: set[int] = set()  # replicas whose thread has returned, failed or aborted
        self.results: list[Any] = [None] * self.n
        self.errors: dict[int, BaseException] = {}
        self.failure: BaseException | None = None  # stops every replica

    # On a replica's thread ---------------------------------------------------------
    def meet(self, replica: int, k: int, post: _Post) -> list[_Post]:
        with self.cond:
            posts = self.rounds.setdefault(k, [None] * self.n)
            posts[replica] = post
            if all(p is not None for p in posts) and post.kind == "merge_call":
                self.merges.append(k)
            self.cond.notify_all()
            deadline = time.monotonic() + self.timeout
            self.waiting += 1
            try:
                self._wait_for_posts(replica, k, post, posts, deadline)
            finally:
                self.waiting -= 1
            done = [p for p in posts if p is not None]
            if any(p.kind != done[0].kind or p.signature != done[0].signature for p in done):
                raise self._mismatch(k)
            return done

    def _wait_for_posts(
        self, replica: int, k: int, post: _Post, posts: list[_Post | None], deadline: float
    ) -> None:
        while not all(p is not None for p in posts):
            if self.failure is not None:
                raise _Abort()
            if any(count <= k for count in self.returned.values()):
                raise self._mismatch(k)
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r, p in enumerate(posts) if p is None]
                raise DeadlineExceededError(
                    f"Replica {replica} ({self.devices[replica]}) waited {self.timeout:g} s "
                    f"at {post.describe()} for replica(s) {missing}, which neither reached "
                    "it nor returned. Check for a blocking call or an endless loop in the "
                    "replica function, or raise $POLYDIST_TIMEOUT_SECONDS."
                )
            self.cond.wait(left)

    def leave(self, k: int) -> None:
        """This replica has read round ``k``."""
        with self.cond:
            self.readers[k] = self.readers.get(k, 0) + 1
            if self.readers[k] == self.n:
                del self.readers[k], self.rounds[k]
                self.merge_results.pop(k, None)

    def merge_result(self, replica: int, k: int) -> Any:
        with self.cond:
            deadline = time.monotonic() + self.timeout
            self.waiting += 1
            try:
                while k not in self.merge_results:
                    if self.failure is not None:
                        raise _Abort()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise DeadlineExceededError(
                            f"Replica {replica} ({self.devices[replica]}) waited "
                            f"{self.timeout:g} s for merge_fn to return on the thread that "
                            "called strategy.run. Check merge_fn for a blocking call, or raise "
                            "$POLYDIST_TIMEOUT_SECONDS."
                        )
                    self.cond.wait(left)
            finally:
                self.waiting -= 1
            return select_replica(replica, self.merge_results[k])

    def finish(self, replica: int, collectives: int, error: BaseException | None) -> None:
        with self.cond:
            self.ended.add(replica)
            if error is None:
                self.returned[replica] = collectives
            elif not isinstance(error, _Abort):
                self.errors[replica] = error
                if self.failure is None:
                    self.failure = error
            self.cond.notify_all()

    def _mismatch(self, k: int) -> CollectiveMismatchError:
        posts = self.rounds.get(k, [None] * self.n)
        lines = ["Replicas disagree on the next collective; on real hardware this would hang."]
        for r in range(self.n):
            post = posts[r]
            state = post.describe() if post is not None else "returned from fn"
            if post is None and r not in self.returned:
                state = "still running"
            lines.append(f"  replica {r} ({self.devices[r]}): {state}")
        lines.append(
            "Every replica must call the same collectives (all_reduce, all_gather, "
            "merge_call) in the same order, with the same shapes and dtypes."
        )
        return CollectiveMismatchError("\n".join(lines))

    # On the thread that called strategy.run -------------------------------------
    def serve(self) -> None:
        """Runs the replicas' ``merge_fn`` calls until every replica has ended."""
        with self.cond:
            deadline = time.monotonic() + self.timeout
            while len(self.ended) < self.n:
                if self.merges:
                    k = self.merges.pop(0)
                    posts = [p for p in self.rounds[k] if p is not None]
                    self.cond.release()
                    try:
                        result = self._merge(posts)
                    except BaseException as e:
                        self.cond.acquire()
                        self.failure = self.failure or e
                        self.errors.setdefault(-1, e)
                        self.cond.notify_all()
                        continue
                    self.cond.acquire()
                    self.merge_results[k] = result
                    self.cond.notify_all()
                    deadline = time.monotonic() + self.timeout
                    continue
                left = deadline - time.monotonic()
                if left <= 0 and self.waiting:
                    # Replicas wait at a collective: they time out there, naming who is late.
                    deadline = time.monotonic() + self.timeout
                    continue
                if left <= 0:
                    if self.failure is None:
                        stuck = sorted(set(range(self.n)) - self.ended)
                        self.failure = DeadlineExceededError(
                            f"Replica(s) {stuck} neither reached a collective nor returned "
                            f"within {self.timeout:g} s; their threads are left running. Check "
                            "for a blocking call or an endless loop in the replica function, "
                            "or raise $POLYDIST_TIMEOUT_SECONDS."
                        )
                        self.errors[self.n] = self.failure  # after the replicas' own errors
                        self.cond.notify_all()
                    return  # a replica stuck in user code cannot be stopped: leave it
                if not self.cond.wait(left):
                    continue
                deadline = time.monotonic() + self.timeout  # progress: a post or a return

    def _merge(self, posts: Sequence[_Post]) -> Any:
        merge_fn = posts[0].payload[0]
        args = regroup(tuple(p.payload[1] for p in posts))
        kwargs = regroup(tuple(p.payload[2] for p in posts))
        with cross_replica_scope(self.strategy):
            return merge_fn(self.strategy, *args, **kwargs)


# Diagnostics and traces name the user's line, looking past this package's frames.
declare_internal_modules("polydist_example_backend")


def _gather_shape(shape: tuple[int, ...], axis: int) -> tuple[Any, ...]:
    # Sizes along the gather axis may differ between replicas.
    marked: list[Any] = list(shape)
    if marked:
        marked[axis] = "*"
    return tuple(marked)


class _ThreadChannel:
    """One replica's end of the rendezvous (a ``polydist.backend.ReplicaChannel``)."""

    def __init__(self, group: _Group, replica: int) -> None:
        self._group = group
        self._replica = replica
        self.collectives = 0  # how many this replica has made: its next round

    def _meet(self, kind: str, signature: tuple[Any, ...], payload: Any) -> tuple[int, list[_Post]]:
        k = self.collectives
        self.collectives += 1
        post = _Post(kind, signature, payload, user_source_line())
        return k, self._group.meet(self._replica, k, post)

    def all_reduce(self, reduce_op: pd.ReduceOp, values: Sequence[Any]) -> list[Any]:
        start = time.perf_counter()
        arrays = [np.array(v) for v in values]  # copies: see _Group
        signature = (reduce_op.value, tuple((a.dtype, a.shape) for a in arrays))
        k, posts = self._meet("all_reduce", signature, arrays)
        try:
            # Every replica adds in the same order, so all get bit-identical sums.
            sums = [sum_in_replica_order([p.payload[i] for p in posts]) for i in range(len(arrays))]
        finally:
            self._group.leave(k)
        self._record(posts[0], arrays, start)
        return sums

    def all_gather(self, values: Sequence[Any], axis: int) -> list[Any]:
        arrays = [np.array(v) for v in values]
        leaves = tuple((a.dtype, _gather_shape(a.shape, axis)) for a in arrays)
        start = time.perf_counter()
        k, posts = self._meet("all_gather", (axis, leaves), arrays)
        try:
            gathered = [
                np.concatenate([p.payload[i] for p in posts], axis=axis) for i in range(len(arrays))
            ]
        finally:
            self._group.leave(k)
        self._record(posts[0], arrays, start)
        return gathered

    def _record(self, post: _Post, arrays: Sequence[np.ndarray], start: float) -> None:
        """Puts this collective into the active ``polydist.trace()`` (replica 0 speaks
        for the group, as one collective is one event), timed from its call to its end."""
        if self._replica != 0 or not is_tracing():
            return
        duration = time.perf_counter() - start
        for a in arrays:
            record_collective(
                post.kind,
                reduce_op=post.signature[0] if post.kind == "all_reduce" else None,
                dtype=a.dtype.name,
                nbytes=a.nbytes,
                shape=a.shape,
                participants=self._group.devices,
                backend=ThreadsBackend.name,
                duration=duration / len(arrays),
                source=post.where,
                start=start,
            )

    def merge_call(
        self, merge_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        k, _ = self._meet("merge_call", (), (merge_fn, args, kwargs))
        try:
            return self._group.merge_result(self._replica, k)
        finally:
            self._group.leave(k)


# -- the runner ---------------------------------------------------------------------------


class ThreadsRunner(EagerReplicaRunner):
    """Runs each replica of ``strategy.run`` on a thread of its own, all at once.

    Core's `EagerReplicaRunner` lets replicas take turns and performs their
    collectives with the backend's list collectives; this one replaces its ``run``
    and lets the replicas meet each other (`_Group`). The thread that called
    ``strategy.run`` runs ``merge_fn`` while it waits.
    """

    def __init__(self, timeout: float | None = None) -> None:
        super().__init__("thread", timeout)
        self._replica_timeout = timeout

    def runs_inline(self, replicas: int) -> bool:
        return False  # even a lone replica gets its thread: merge_fn runs on the caller's

    def run(
        self,
        group: ReplicaGroup,
        fn: Callable[..., Any],
        per_replica_args: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
    ) -> list[Any]:
        if group.strategy is None:
            raise ValueError(
                "ThreadsRunner.run needs the ReplicaGroup of a run, with its strategy: "
                "polydist.backend.replica_group(strategy)."
            )
        timeout = self._replica_timeout
        if timeout is None:
            timeout = timeout_seconds_from_env()
        replicas = _Group(group.strategy, group.devices, timeout)
        threads = [
            threading.Thread(
                target=_run_replica,
                args=(group.backend, replicas, r, fn, per_replica_args[r]),
                name=f"polydist-threads-replica-{r}",
                daemon=True,  # a replica stuck in user code must not keep Python alive
            )
            for r in range(replicas.n)
        ]
        for t in threads:
            t.start()
        replicas.serve()
        for r in replicas.ended:
            threads[r].join(timeout)  # it has ended: this returns at once
        if replicas.errors:
            raise replicas.errors[min(replicas.errors)]
        return replicas.results


def _run_replica(
    backend: Backend,
    group: _Group,
    replica: int,
    fn: Callable[..., Any],
    args_kwargs: tuple[tuple[Any, ...], dict[str, Any]],
) -> None:
    """One replica's thread: ``fn`` in the replica's context, then report to the group."""
    device = group.devices[replica]
    channel = _ThreadChannel(group, replica)
    replica_id = backend.place(np.asarray(replica, dtype=np.int32), device)
    ctx = pd.ReplicaContext(group.strategy, replica_id, channel=channel, replica_index=replica)
    error: BaseException | None = None
    try:
        args, kwargs = args_kwargs
        with ctx, backend.device_scope(device):
            group.results[replica] = fn(*args, **kwargs)
    except BaseException as e:  # raised by ThreadsRunner.run, on the caller's thread
        error = e
    group.finish(replica, channel.collectives, error)


# -- the backend --------------------------------------------------------------------------


class ThreadsBackend:
    """NumPy arrays on ``num_devices`` virtual CPU devices; replicas run concurrently.

    Args:
        num_devices: the virtual devices ``/cpu:0`` .. ``/cpu:{num_devices-1}``.
            ``MirroredStrategy()`` uses ``/cpu:0`` alone, as TF does on a machine
            without accelerators; ``MirroredStrategy(n)`` uses the first ``n``.
        timeout_seconds: how long a replica may wait at a collective for the others
            (default ``$POLYDIST_TIMEOUT_SECONDS`` or 300).
    """

    name = "threads"
    version = _VERSION

    def __init__(
        self, num_devices: int = DEFAULT_DEVICES, timeout_seconds: float | None = None
    ) -> None:
        if num_devices < 1:
            raise ValueError(f"num_devices must be at least 1, got {num_devices}.")
        self._num_devices = num_devices
        self._runner = ThreadsRunner(timeout_seconds)
        self.capabilities = Capabilities(
            execution_model="eager",
            # Sums are added in float64 (see sum_in_replica_order), which no sim order
            # reproduces bit for bit: the suite compares them within its error bound.
            reduction_orders=(),
            autodiff=False,
            multi_worker=False,
            tpu=False,
            dynamic_shapes=True,
            float64=True,
            uneven_gather=True,
            # Each collective's wall time goes into polydist.trace() (see _record).
            measured_timing=True,
        )

    def __repr__(self) -> str:
        return f"ThreadsBackend(num_devices={self._num_devices})"

    # -- devices ------------------------------------------------------------------------
    def array_namespace(self) -> Any:
        return np

    def list_devices(self) -> tuple[str, ...]:
        return tuple(_device(i) for i in range(self._num_devices))

    def replica_devices(self, count: int | None) -> tuple[str, ...]:
        if count is None:
            return (_device(0),)
        if count > self._num_devices:
            raise ValueError(
                f"MirroredStrategy({count}) asks for {count} replicas, but the threads backend "
                f"has {self._num_devices} devices. Ask for at most {self._num_devices}, or "
                f"create ThreadsBackend(num_devices={count})."
            )
        return tuple(_device(i) for i in range(count))

    def validate_devices(self, devices: Sequence[str]) -> None:
        for d in devices:
            spec = DeviceSpec.parse(d)
            if spec.job != "localhost" or spec.task != 0:
                raise ValueError(
                    f"Device {d!r} is on another worker; the threads backend runs replicas on "
                    "this machine's devices (/job:localhost/task:0)."
                )
            if spec.device_type != "CPU" or not 0 <= spec.device_index < self._num_devices:
                raise ValueError(
                    f"The threads backend cannot place replicas on {d!r}: its devices are "
                    f"/cpu:0 .. /cpu:{self._num_devices - 1}."
                )

    def device_scope(self, device: str) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # host memory: every device is the same

    def place(self, value: Any, device: str) -> Any:
        return np.array(value)  # a copy of its own, as TF's convert_to_tensor makes

    def to_numpy(self, value: Any) -> np.ndarray:
        return np.asarray(value)

    # -- running ------------------------------------------------------------------------
    @property
    def replica_runner(self) -> EagerReplicaRunner:
        """What core runs ``strategy.run``'s replicas with (``SupportsReplicaRunner``)."""
        return self._runner

    # -- list collectives (cross-replica context) -------------------------------------
    def all_reduce(self, values: Sequence[Any], destinations: Sequence[str]) -> list[Any]:
        total = sum_in_replica_order([np.asarray(v) for v in values])
        return [total, *(total.copy() for _ in destinations[1:])]

    def reduce_to(self, values: Sequence[Any], destination: str) -> Any:
        return sum_in_replica_order([np.asarray(v) for v in values])

    def all_gather(
        self, values: Sequence[Any], axis: int, destinations: Sequence[str]
    ) -> list[Any]:
        gathered = np.concatenate([np.asarray(v) for v in values], axis=axis)
        return [gathered, *(gathered.copy() for _ in destinations[1:])]

    def broadcast(self, value: Any, destinations: Sequence[str]) -> list[Any]:
        return [np.array(value) for _ in destinations]


# Typed proofs that the classes implement the public protocols.
_channel_check: Callable[[_Group, int], ReplicaChannel] = _ThreadChannel
_backend_check: Callable[[], Backend] = ThreadsBackend
_runner_check: Callable[[], SupportsReplicaRunner] = ThreadsBackend
