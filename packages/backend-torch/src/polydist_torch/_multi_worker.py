"""``MultiWorkerMirroredStrategy`` over ``torch.distributed``: one process per worker.

Each worker is one process that runs its own D replicas eagerly, like
``MirroredStrategy`` on the torch backend. Every cross-replica collective is
a sequential sum (or concatenation) over this worker's replicas followed by
one ``torch.distributed`` collective across the workers' processes
(``all_reduce``, ``all_gather``, ``broadcast``): gloo for CPU tensors, NCCL
for CUDA ones (``init_process_group("cpu:gloo,cuda:nccl")``). The sum
across workers is in gloo's (or NCCL's) order, so results equal the sim's
within the rounding bound of a sum, not bit for bit
(``Capabilities.reduction_orders`` is empty). TF's all_reduce leaves its
input unchanged: it copies the input into recycled host memory (no page
faults; ``polydist_torch._host_all_reduce``) and sums the copy in place with
the engine's own ``all_reduce``.

The cluster comes from, in order: the ``cluster_resolver`` argument;
``TF_CONFIG`` (``polydist launch`` sets it); ``torchrun``'s ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. Worker 0's address is
the rendezvous: worker 0 hosts a ``TCPStore`` there (under ``torchrun``, the
agent's store is used instead) through which the workers find each other
(``init_process_group(store=...)``, the ``tcp://`` rendezvous with the store
kept for diagnosis). The store listens on that address only (`_listen_on`),
not on every interface as TCPStore's own server does; it is unauthenticated
(docs/multi-host.md).

Bounds and faults (``CommunicationOptions.timeout_seconds``, default
`DEFAULT_TIMEOUT_SECONDS` = 60 s; 0 disables):

* joining: a worker that does not arrive within the timeout makes the others
  raise ``DeadlineExceededError`` naming it; a worker that cannot reach
  worker 0's rendezvous raises it naming worker 0;
* collectives: gloo gives up after the timeout. Each process sends a
  heartbeat to the store every `HEARTBEAT_SECONDS`; when a collective fails,
  the survivors look at the heartbeats (about 2 s) and raise
  ``UnavailableError`` naming the workers whose heartbeats stopped (dead or
  hung process, lost network), or ``DeadlineExceededError`` naming those
  that are alive but did not reach the collective. Worker 0 hosts the store:
  when it dies, the others name it. A dead peer is usually noticed at once
  (its sockets close); a hung one after the timeout.
* After such an error the process group is unusable: stop every worker and
  restart them (from the latest checkpoint). ``polydist launch`` stops the
  other workers when one fails.

Agreement: before each collective every worker publishes its signature (op,
reduce op, dtype, shape, call site) to the store and compares the others'
(``polydist.backend.multiprocess``); workers that disagree all raise
``CollectiveMismatchError`` before issuing it (unchecked, gloo would hang,
abort the process or return wrong values). ``POLYDIST_CHECK_COLLECTIVES=0``
turns this off; a process group the program initialized itself is not
checked (no store).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import os
import re
import socket
import sys
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore
from torch.torch_version import TorchVersion

import polydist as pd
from polydist import errors
from polydist.backend import Backend, ClusterToJoin, pack_by_dtype, tracing
from polydist.backend import multiprocess as mp
from polydist.backend.devices import DeviceSpec
from polydist.backend.multiprocess import (
    DEFAULT_TIMEOUT_SECONDS,
    HEARTBEAT_SECONDS,
    PeerMissing,
    Pending,
    collective_intent,
    describe_workers,
)
from polydist.cluster_resolver import ClusterResolver
from polydist.experimental import CommunicationOptions
from polydist_torch._backend import Reduction, TorchBackend, _tensors
from polydist_torch._devices import MAX_VIRTUAL_CPU_REPLICAS, cuda_device_count, torch_device
from polydist_torch._host_all_reduce import CACHE_MIN_BYTES, ResultCache

__all__ = [
    "DEFAULT_RESULT_CACHE_BYTES",
    "DEFAULT_TIMEOUT_SECONDS",
    "HEARTBEAT_SECONDS",
    "MultiWorkerMirroredStrategy",
    "WORKER_PROCESSES",
    "TorchProcessGroupBackend",
    "TorchWorkerProcesses",
    "shutdown",
]

#: ``TorchProcessGroupBackend(result_cache_bytes=...)``'s default.
DEFAULT_RESULT_CACHE_BYTES = 1 << 30
# Bound on the store operations of the diagnosis itself.
_DIAGNOSIS_TIMEOUT = datetime.timedelta(seconds=2)
# Bound on each store operation of the heartbeat thread.
_HEARTBEAT_STORE_SECONDS = 2.0


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit():
        raise ValueError(
            f"The rendezvous address {address!r} (worker 0's address) must be 'host:port', e.g. "
            "'10.0.0.1:2222'. Fix the cluster's first worker (TF_CONFIG) or MASTER_ADDR/"
            "MASTER_PORT."
        )
    return host, int(port)


# The libuv store server listens on a socket it is given only from torch 2.8 on
# (pytorch#150215); before, the classic server takes it.
_LIBUV_TAKES_LISTEN_FD = TorchVersion(torch.__version__) >= "2.8"


def _listen_on(host: str, port: int) -> socket.socket | None:
    """A socket listening on ``host:port`` only, for worker 0's store to serve on.

    TCPStore's own server binds every interface whatever host it is given; this
    binds the address the cluster names for worker 0 (loopback under ``polydist
    launch``). None where that address is not one of this machine's (a NAT or a
    load balancer in front of it): the store then binds every interface, as torch
    does. Other failures (the port is in use) raise ``OSError``.
    """
    not_here: OSError | None = None
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            # As TCPStore's own server: a restarted worker 0 may take the port at once.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(socket.SOMAXCONN)
        except OSError as e:
            sock.close()
            if e.errno != errno.EADDRNOTAVAIL:
                raise
            not_here = e
            continue
        return sock
    if not_here is None:  # getaddrinfo found nothing (it raises instead, but be sure)
        raise OSError(errno.EADDRNOTAVAIL, f"no address for {host!r}")
    return None


def _tcp_store(host: str, port: int, world_size: int, *, is_master: bool, seconds: float) -> Any:
    """A ``TCPStore`` client of ``host:port``; with ``is_master``, also its server, listening
    on that address only where it is one of this machine's (`_listen_on`)."""
    listener = _listen_on(host, port) if is_master else None
    if is_master and listener is None:
        warnings.warn(
            f"Worker 0 cannot listen on {host} only (the cluster's address for it is not one "
            f"of this machine's), so the rendezvous store listens on port {port} of every "
            "interface, unauthenticated. Keep that port reachable only from the cluster's "
            "machines (docs/multi-host.md: 'PyTorch: what the rendezvous store exposes').",
            RuntimeWarning,
            stacklevel=2,
        )
    try:
        store = TCPStore(
            host,
            port,
            world_size,
            is_master=is_master,
            timeout=_timedelta(seconds),
            wait_for_workers=False,
            master_listen_fd=None if listener is None else listener.fileno(),
            use_libuv=listener is None or _LIBUV_TAKES_LISTEN_FD,
        )
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    if listener is not None:
        listener.detach()  # the store's server owns the socket now
    return store


# torch <= 2.9's gloo prints "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number
# of connected peer ranks is : 1" on standard output (C++ std::cout) for every worker, with
# no setting to turn it off; later gloo logs it only with GLOO_LOG_LEVEL=INFO.
_GLOO_CONNECTED = re.compile(rb"^\[Gloo\] Rank \d+ is (NOT )?connected to")


@contextlib.contextmanager
def _without_gloo_connection_lines() -> Iterator[None]:
    """Drops gloo's report of its connections from this process's standard output (file
    descriptor 1) while the process group connects; everything else written there
    meanwhile is written out afterwards, in order. ``GLOO_LOG_LEVEL=INFO`` (or ``DEBUG``)
    asks for gloo's reports: then nothing is dropped."""
    if os.environ.get("GLOO_LOG_LEVEL", "").strip().upper() in ("INFO", "DEBUG"):
        yield
        return
    _flush_stdout()  # what Python printed before goes out first
    try:
        saved = os.dup(1)
    except OSError:  # no standard output at all: nothing to keep clean
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 1)
        try:
            yield
        finally:
            _flush_stdout()  # Python's prints meanwhile land in the capture, in order
            os.dup2(saved, 1)
            os.close(saved)
            captured.seek(0)
            kept = b"".join(line for line in captured if not _GLOO_CONNECTED.match(line))
            with open(1, "wb", closefd=False) as out:  # writes it all, as os.write may not
                out.write(kept)


def _flush_stdout() -> None:
    with contextlib.suppress(Exception):  # None, closed, or not a file
        sys.stdout.flush()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    # gloo prefixes its messages with a source location: "[/path/pair.cc:537] Read error ..."
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    # ... and ends some with advice that does not apply here.
    return text.split(" This is typically caused by", 1)[0].rstrip(". ")


class _StoreAdapter:
    """A torch ``Store`` as the `HeartbeatStore` of polydist's heartbeats and the
    `SignatureStore` of its collective checks."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._timeout: float | None = None

    def set(self, key: str, value: str) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> str | None:
        if not self._store.check([key]):
            return None
        return bytes(self._store.get(key)).decode()

    def delete(self, key: str) -> None:
        self._store.delete_key(key)

    def get_all(self, keys: Sequence[str], seconds: float) -> list[str] | None:
        if seconds != self._timeout:  # a local setting, no round trip
            self._store.set_timeout(_timedelta(seconds))
            self._timeout = seconds
        try:
            values = self._store.multi_get(list(keys))  # waits for every key
        except dist.DistStoreError:  # not all set in time (a lost store is DistNetworkError)
            return None
        return [bytes(v).decode() for v in values]


class _ProcessGroup(mp.ClusterMembership):
    """This process's membership in the cluster: the store, the torch process group,
    the heartbeat, and the translation of torch's errors."""

    engine_errors = (RuntimeError,)
    #: The rendezvous's store (kept: worker 0 hosts it); None when the program set up
    #: torch.distributed itself, or for one worker.
    store: Any = None
    #: Makes a new connection to ``store``.
    make_store: Callable[[], Any] | None = None

    def attach(self, store: Any, make_store: Callable[[], Any]) -> None:
        """Keeps the rendezvous's ``store`` and watches the cluster through new connections
        to it (`ClusterMembership.watch`)."""
        self.store = store
        self.make_store = make_store
        self.watch(lambda: _StoreAdapter(make_store()), release=self._release)

    # -- joining -----------------------------------------------------------------------------
    @classmethod
    def join(
        cls,
        address: str,
        *,
        rank: int,
        world_size: int,
        timeout: float,
        names: Sequence[str],
        addresses: Sequence[str],
        dist_backend: str,
    ) -> _ProcessGroup:
        host, port = _split_address(address)
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        prefix = (
            f"polydist/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/"
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        )
        hosts_store = rank == 0 and not agent_store
        who = describe_workers([0], names, addresses)

        def make_store(is_master: bool, seconds: float) -> Any:
            raw = _tcp_store(host, port, world_size, is_master=is_master, seconds=seconds)
            return PrefixStore(prefix, raw)

        try:
            store = make_store(hosts_store, timeout)
        except (RuntimeError, OSError) as e:
            if hosts_store:
                advice = (
                    f"Is {host!r} right? Worker 0 must resolve it to one of its addresses "
                    "(TF_CONFIG's first worker, or MASTER_ADDR)."
                    if isinstance(e, socket.gaierror)
                    else "Is the port in use? Give worker 0 a free port (in TF_CONFIG, or "
                    "MASTER_PORT), or let `polydist launch` pick free ports."
                )
                raise errors.UnavailableError(
                    f"Worker 0 ({names[0]}) cannot host the cluster's rendezvous at {address}: "
                    f"{_first_line(e)}. {advice}"
                ) from e
            raise errors.DeadlineExceededError(
                f"Worker {rank} ({names[rank]}) could not reach the cluster's rendezvous at "
                f"{address}, hosted by {who}, within {timeout:g} s: worker 0 did not start, "
                f"exited, or the address is wrong ({_first_line(e)}). Start every worker with "
                "the same cluster, or raise CommunicationOptions(timeout_seconds=...)."
            ) from e
        arrived = [f"arrived/{r}" for r in range(world_size)]
        try:
            store.set(arrived[rank], "1")
            store.wait(arrived, _timedelta(timeout))
        except RuntimeError as e:
            missing = cls._not_arrived(store, arrived)
            if missing is None:
                raise errors.UnavailableError(
                    f"Worker {rank} lost the cluster's rendezvous at {address} ({who}) while "
                    f"waiting for the other workers: {_first_line(e)}. Worker 0 probably "
                    "exited; restart every worker."
                ) from e
            raise errors.DeadlineExceededError(
                f"Worker(s) {describe_workers(missing, names, addresses)} did not join the cluster "
                f"of {world_size} workers within {timeout:g} s (worker {rank} waited for them at "
                f"{address}). Start every worker of the cluster, check that each got its own "
                "task index, or raise CommunicationOptions(timeout_seconds=...)."
            ) from e
        try:
            with _without_gloo_connection_lines():
                dist.init_process_group(
                    dist_backend,
                    store=PrefixStore("pg/", store),
                    rank=rank,
                    world_size=world_size,
                    timeout=_timedelta(timeout),
                )
        except RuntimeError as e:
            raise errors.UnavailableError(
                f"Worker {rank} could not set up torch.distributed ({dist_backend!r}) with the "
                f"other {world_size - 1} worker(s) after all joined at {address}: "
                f"{_first_line(e)}."
            ) from e
        group = cls(
            rank=rank, world_size=world_size, timeout=timeout, names=names, addresses=addresses
        )
        group.attach(store, lambda: make_store(False, _HEARTBEAT_STORE_SECONDS))
        return group

    @staticmethod
    def _not_arrived(store: Any, keys: Sequence[str]) -> list[int] | None:
        try:
            store.set_timeout(_DIAGNOSIS_TIMEOUT)
            return [r for r, key in enumerate(keys) if not store.check([key])]
        except RuntimeError:
            return None

    # -- collectives -----------------------------------------------------------------------
    def check(self, op: str, tensor: torch.Tensor, axis: int | None = None) -> None:
        """Before collective ``op`` of ``tensor``: `check_signature` (no store: no check)."""
        self.check_signature(op, tensor.dtype, tensor.shape, axis)

    def translate(self, what: str, err: BaseException) -> errors.OpError:
        said = _first_line(err)
        timed_out = "timed out" in said.lower() or "timeout" in said.lower()
        dead, behind = self.diagnose()
        source = (
            "polydist's collective check" if isinstance(err, PeerMissing) else "torch.distributed"
        )
        tail = (
            f" {source} said: {said}. The process group cannot be used any more: stop "
            "every worker and restart them all, from the latest checkpoint (polydist launch "
            "stops the others when one fails). If the peers are merely slow, raise "
            "CommunicationOptions(timeout_seconds=...)."
        )
        head = self.collective(what)
        if dead:
            return errors.UnavailableError(f"{head} failed: {self.unavailable(dead)}.{tail}")
        if behind:
            return errors.DeadlineExceededError(
                f"{head} did not complete within {self.timeout:g} s: {self.behind(behind)}.{tail}"
            )
        cls = errors.DeadlineExceededError if timed_out else errors.UnavailableError
        return cls(f"{head} failed; no other worker looks unavailable or late.{tail}")

    # -- the presence flag (``polydist._collectives.check``'s fast path) ---------------------
    def wire(self, numel: int, dtype: torch.dtype, device: torch.device) -> str | None:
        """`wire_of`, where a check will read the flag: ``None`` with checks off or no
        store. Every worker learns the agreed setting at its first collective (until
        then the flag travels), so the workers' buffers stay the same size; and gloo
        sums a round size faster (2**20 floats about 10% faster than 2**20 + 1)."""
        checker = self.checker
        if checker is None or checker.enabled is False:
            return None
        return wire_of(numel, dtype, device)

    def reduce_checked_(
        self, flat: torch.Tensor, wire: str | None, pending: Pending | None
    ) -> None:
        """The in-place sum of `presence_buffer`'s ``flat`` (checked by `checked_wire` as
        ``pending``), then its presence flag read (`arrived`)."""
        self.all_reduce_(flat, pending)
        if wire is not None:
            self.arrived(pending, int(flat[-1]))

    def _release(self, wire: str) -> None:
        """Completes a fast peer's collective ``wire`` (``"cpu float32 1025"``) with zeros
        (see ``polydist._collectives.check``); an engine error is left for the next
        collective to report."""
        device, dtype, numel = wire.split()
        zeros = torch.zeros(int(numel), dtype=getattr(torch, dtype), device=device)
        with contextlib.suppress(RuntimeError):
            dist.all_reduce(zeros, op=dist.ReduceOp.SUM)

    def _wait_watching(self, work: Any) -> None:
        """Waits for gloo's ``work`` in slices, looking at the heartbeats in between: a
        fast collective was issued before the peers were known to be there, so a hung
        peer is named as at the check's wait (about 6 s), not after the timeout, and a
        peer that abandoned the cluster (`ClusterMembership.abandon`: it never joins)
        within about a second."""
        deadline = None
        while True:
            try:
                work.wait(timeout=_WAIT_SLICE)
                return
            except RuntimeError:
                if work.is_completed():  # gloo's own error (or its timeout)
                    raise
            if deadline is None:  # after the first slice (most waits end within it)
                deadline = time.monotonic() + self.timeout
            silent = self.heartbeat.silent() if self.heartbeat is not None else []
            failed = self.heartbeat.failed() if self.heartbeat is not None else []
            if silent or failed or time.monotonic() > deadline:
                why = (
                    f"worker(s) {', '.join(map(str, silent))} stopped sending heartbeats"
                    if silent
                    else f"worker(s) {', '.join(map(str, failed))} abandoned the cluster"
                    if failed
                    else f"timed out after {self.timeout:g} s"
                )
                raise PeerMissing(f"{why} while worker {self.rank} waited in the collective")

    def all_reduce_(self, tensor: torch.Tensor, pending: Pending | None = None) -> None:
        wide = _SUM_WIDER.get(tensor.dtype)
        if wide is not None:  # a dtype gloo cannot sum: sum wider, then cast back
            wider = tensor.to(wide)
            self.call("all_reduce", lambda: dist.all_reduce(wider, op=dist.ReduceOp.SUM))
            tensor.copy_(wider)  # integers wrap around, as their own sum would
            return
        if tensor.is_complex():
            view = torch.view_as_real(tensor)
        elif tensor.dtype in _SAME_BITS:  # the signed sum of the same bits is the modular one
            view = tensor.view(_SAME_BITS[tensor.dtype])
        else:  # the tensor itself: gloo's work may outlive the call a little, and a view
            view = tensor  # of it would count as another holder of its memory meanwhile
        if pending is not None and pending.fast and view.device.type == "cpu":

            def reduce() -> None:
                # The process group's own call (what dist.all_reduce issues, without its
                # per-call Python: logging, profiler ranges), waited for in slices.
                self._wait_watching(_world().allreduce([view], _SUM_OPTIONS))

            self.call("all_reduce", reduce, pending)
            return
        self.call("all_reduce", lambda: dist.all_reduce(view, op=dist.ReduceOp.SUM))

    def all_reduce(self, tensor: torch.Tensor, cache: ResultCache) -> torch.Tensor:
        """The sum over workers of ``tensor`` as a new tensor; ``tensor`` is only read.
        Checked (`checked_wire`): the copy into the result overlaps the check's round trip."""
        numel = tensor.numel()
        wire = self.wire(numel, tensor.dtype, tensor.device)

        def copy() -> torch.Tensor:
            flat = presence_buffer(numel, tensor.dtype, tensor.device, cache, wire)
            flat[:numel].view(tensor.shape).copy_(tensor)
            return flat

        flat, pending = self.checked_wire("all_reduce", tensor.dtype, tensor.shape, copy, wire)
        self.reduce_checked_(flat, wire, pending)
        return own_tensor(flat, 0, tensor.shape)

    def broadcast_(self, tensor: torch.Tensor) -> None:
        view = _wire(tensor)
        self.call("broadcast", lambda: dist.broadcast(view, src=0))
        if view is not tensor and view.data_ptr() != tensor.data_ptr():
            tensor.copy_(_unwire(view, tensor.dtype))

    def all_gather(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        """Every worker's ``tensor`` concatenated along ``axis`` in worker order; sizes
        along ``axis`` may differ, the other dimensions must match."""
        shape = torch.from_numpy(mp.shape_row(tensor.shape))
        shapes = [torch.empty_like(shape) for _ in range(self.world_size)]
        self.call("all_gather", lambda: dist.all_gather(shapes, shape))
        rows = [s.tolist() for s in shapes]
        sizes = mp.gathered_sizes(rows, tensor.shape, axis, self.rank)
        biggest = max(sizes)
        wire = _wire(tensor.contiguous())
        if tensor.shape[axis] < biggest:
            pad = list(wire.shape)
            pad[axis] = biggest - tensor.shape[axis]
            wire = torch.cat([wire, wire.new_zeros(pad)], dim=axis)
        parts = [torch.empty_like(wire) for _ in range(self.world_size)]
        self.call("all_gather", lambda: dist.all_gather(parts, wire))
        trimmed = [p.narrow(axis, 0, size) for p, size in zip(parts, sizes)]
        return _unwire(torch.cat(trimmed, dim=axis), tensor.dtype)


# Dtypes gloo refuses ("Invalid scalar type"). A SUM of them runs in a dtype gloo
# sums: unsigned ints as the signed ints of the same bits (two's complement addition
# is the modular unsigned one), 16-bit ints and float8 in a wider dtype.
_SAME_BITS = {torch.uint32: torch.int32, torch.uint64: torch.int64}
_SUM_WIDER = {
    torch.int16: torch.int32,
    torch.uint16: torch.int32,
    **{dtype: torch.float32 for dtype in (torch.float8_e4m3fn, torch.float8_e5m2)},
}
# What moves (broadcast, all_gather) a dtype gloo refuses: any dtype of its size.
_MOVE_AS = {
    torch.bool: torch.uint8,
    torch.int16: torch.float16,
    torch.uint16: torch.float16,
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e5m2: torch.uint8,
    **_SAME_BITS,
}


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """A view gloo can move (the same bytes): complex as real pairs, other dtypes gloo
    refuses as a dtype of the same size (`_MOVE_AS`)."""
    if tensor.is_complex():
        return torch.view_as_real(tensor)
    return tensor.view(_MOVE_AS.get(tensor.dtype, tensor.dtype))


def _unwire(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_complex:
        return torch.view_as_complex(tensor.contiguous())
    return tensor.view(dtype)


_SUM_OPTIONS = dist.AllreduceOptions()
_SUM_OPTIONS.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # RedOpType in stubs


def _world() -> Any:
    """torch.distributed's default process group (the cluster's): what
    ``_get_default_group`` returns, without its checks' calls while there is one."""
    world = dist.GroupMember.WORLD
    return world if world is not None else dist.distributed_c10d._get_default_group()


#: Dtypes whose sum of presence flags (one 1 per worker) is exact, by torch name.
_PRESENCE = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int32: "int32",
    torch.int64: "int64",
}
# A fast collective's wait looks at the heartbeats this often.
_WAIT_SLICE_SECONDS = 0.5
_WAIT_SLICE = _timedelta(_WAIT_SLICE_SECONDS)


def _nothing() -> None:
    return None


def wire_of(numel: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """What an all_reduce of ``numel`` elements of ``dtype`` on ``device`` puts on the
    wire with its presence flag (one element more: ``polydist._collectives.check``'s
    fast path), e.g. ``"cpu float32 1025"``; ``None`` where the flag's sum would not be
    exact (the collective then is always checked through the store)."""
    name = _PRESENCE.get(dtype)
    return None if name is None else f"{device.type} {name} {numel + 1}"


def presence_buffer(
    numel: int, dtype: torch.dtype, device: torch.device, cache: ResultCache, wire: str | None
) -> torch.Tensor:
    """A flat buffer for ``numel`` elements, plus the presence flag (set to 1) when
    ``wire`` (`wire_of`) has one; on CPU from ``cache``."""
    size = numel + (wire is not None)
    if device.type == "cpu":
        flat = cache.empty((size,), dtype)
    else:
        flat = torch.empty(size, dtype=dtype, device=device)
    if wire is not None:
        flat[numel] = 1
    return flat


def own_tensor(
    flat: torch.Tensor, offset: int, shape: torch.Size | tuple[int, ...]
) -> torch.Tensor:
    """A tensor of its own (not a view: autograd and in-place updates treat it as fresh)
    on ``flat``'s memory from element ``offset``, contiguous (``set_`` without strides)."""
    own = torch.empty(0, dtype=flat.dtype, device=flat.device)
    return own.set_(flat.untyped_storage(), flat.storage_offset() + offset, shape, ())


def _check_workers_own_their_gpus() -> None:
    """Several workers on this host must not use the same GPUs.

    torchrun (and ``polydist launch``) set ``LOCAL_WORLD_SIZE``; TF's rule gives every
    worker all the GPUs it sees, from ``cuda:0``, and NCCL refuses two ranks on one
    GPU. A worker cannot narrow its GPUs itself once torch has asked CUDA for them
    (``torch.cuda.is_available()`` fixes the set), so it raises, before any collective,
    saying how to give each worker its own. ``CUDA_VISIBLE_DEVICES`` set for the
    worker is taken as that.
    """
    try:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return
    if local_world <= 1 or "CUDA_VISIBLE_DEVICES" in os.environ:
        return
    gpus = cuda_device_count()
    if gpus:
        raise ValueError(
            f"{local_world} workers run on this host (LOCAL_WORLD_SIZE={local_world}), and "
            f"each would use the {gpus} GPU(s) torch sees here, from cuda:0: NCCL refuses two "
            "workers on one GPU. Give each worker its own GPUs before it starts: "
            "`polydist launch --gpus-per-worker 1`, or under torchrun a wrapper running "
            "`CUDA_VISIBLE_DEVICES=$LOCAL_RANK python train.py`; or run one worker per host "
            "with all of its GPUs (torchrun --nproc-per-node=1, TF's layout)."
        )


class TorchProcessGroupBackend(TorchBackend):
    """The torch backend with ``Capabilities.multi_worker``: one process per worker.

    Until ``connect_cluster`` joins a cluster it is the plain torch backend.
    Afterwards its list collectives (``all_reduce``, ``reduce_to``,
    ``all_gather``) reduce this process's values in replica order and then
    across every worker's process with ``torch.distributed``. One instance
    serves a process (a process joins one cluster); strategies get it from
    `MultiWorkerMirroredStrategy`.

    Args:
        reduction: the local (in-process) summation, as for `TorchBackend`.
        timeout_seconds: how long one replica may run between two collectives
            (the eager runner's bound, as for `TorchBackend`); the cluster's
            bound is ``CommunicationOptions.timeout_seconds``.
        dist_backend: torch.distributed's backend; default ``"cpu:gloo,cuda:nccl"``
            when CUDA is available, else ``"gloo"``.
        result_cache_bytes: host memory kept for the results of collectives
            across workers (default `DEFAULT_RESULT_CACHE_BYTES`; 0: none). A
            block is reused once the program holds no tensor on it, which spares
            the page faults of fresh memory (see ``polydist_torch._host_all_reduce``).
    """

    name = "torch"

    def __init__(
        self,
        reduction: Reduction = "auto",
        *,
        timeout_seconds: float | None = None,
        dist_backend: str | None = None,
        result_cache_bytes: int = DEFAULT_RESULT_CACHE_BYTES,
    ) -> None:
        super().__init__(reduction, timeout_seconds=timeout_seconds)
        self._cache = ResultCache(result_cache_bytes)
        self.capabilities = mp.process_capabilities(self.capabilities)
        self._dist_backend = dist_backend
        self._group: _ProcessGroup | None = None
        self._rendezvous: str | None = None
        self._addresses: list[str] = []
        self._timeout = DEFAULT_TIMEOUT_SECONDS

    def __repr__(self) -> str:
        where = (
            f"worker {self._group.rank} of {self._group.world_size}"
            if self._group is not None
            else "not connected"
        )
        return f"TorchProcessGroupBackend({where})"

    # -- the cluster -------------------------------------------------------------------------
    def cluster_membership(self) -> _ProcessGroup | None:
        """This process's membership in its cluster of several workers, if it joined one
        (`polydist.backend.multiprocess.ClusterMembership`)."""
        return self._group if self.connected else None

    @property
    def connected(self) -> bool:
        """Whether this process has joined a cluster of several workers."""
        return self._group is not None and self._group.world_size > 1

    def prepare(self, rendezvous: str | None, addresses: Sequence[str], timeout: float) -> None:
        """Where the cluster meets (worker 0's ``host:port``) and how long to wait; called by
        `MultiWorkerMirroredStrategy` before ``connect_cluster``."""
        self._rendezvous = rendezvous
        self._addresses = list(addresses)
        self._timeout = timeout

    def connect_cluster(
        self, worker_devices: Sequence[Sequence[str]], worker_index: int
    ) -> tuple[int, ...]:
        world = len(worker_devices)
        joined = None if self._group is None else (self._group.rank, self._group.world_size)
        if mp.check_joining(worker_index, world, joined):
            return (worker_index,)
        names = mp.worker_task_names(worker_devices)
        if world == 1 or dist.is_initialized():
            # One worker, or the program set up torch.distributed itself (e.g.
            # init_process_group("env://")): no store to watch through.
            if world > 1 and (dist.get_rank(), dist.get_world_size()) != (worker_index, world):
                raise ValueError(
                    f"torch.distributed is already initialized as rank {dist.get_rank()} of "
                    f"{dist.get_world_size()}, but the cluster makes this process worker "
                    f"{worker_index} of {world}. Let MultiWorkerMirroredStrategy initialize "
                    "it, or give it a cluster that matches."
                )
            self._group = _ProcessGroup(
                rank=worker_index,
                world_size=world,
                timeout=self._timeout,
                names=names,
                addresses=self._addresses,
            )
            return (worker_index,)
        if self._rendezvous is None:
            raise ValueError(
                f"TorchProcessGroupBackend needs the rendezvous address (worker 0's host:port) "
                f"to join a cluster of {world} workers: create the strategy with "
                "polydist.MultiWorkerMirroredStrategy(backend='torch'), which passes it."
            )
        uses_cuda = any(DeviceSpec.parse(d).device_type == "GPU" for d in worker_devices[0])
        dist_backend = self._dist_backend or ("cpu:gloo,cuda:nccl" if uses_cuda else "gloo")
        if uses_cuda:
            torch.cuda.set_device(0)
        self._group = _ProcessGroup.join(
            self._rendezvous,
            rank=worker_index,
            world_size=world,
            timeout=self._timeout,
            names=names,
            addresses=self._addresses,
            dist_backend=dist_backend,
        )
        _LIVE.add(self)
        return (worker_index,)

    # -- polydist.backend.SupportsWorkerProcesses: given as backend=, it is the engine ----------
    def worker_cluster(
        self,
        cluster_resolver: ClusterResolver | None,
        communication_options: CommunicationOptions | None,
    ) -> ClusterToJoin:
        """The cluster (see `TorchWorkerProcesses`)."""
        return _worker_cluster(cluster_resolver, communication_options)

    def worker_process_engine(self, cluster: ClusterToJoin, local_devices: int | None) -> Backend:
        """This backend, ready to join ``cluster``."""
        self.prepare(cluster.rendezvous, cluster.addresses, cluster.timeout)
        return self

    def local_device_count(self, requested: int | None) -> tuple[str, int] | None:
        """``local_devices=N``: the first N CUDA devices, or N virtual CPU replicas."""
        _check_workers_own_their_gpus()
        if requested is None:
            return None  # TF's rule: this machine's GPUs, else one CPU replica
        gpus = cuda_device_count()
        if gpus:
            if requested > gpus:
                raise ValueError(
                    f"local_devices={requested} asks for {requested} replicas per worker, but "
                    f"torch sees {gpus} CUDA device(s) here. Ask for at most {gpus}."
                )
            return "GPU", requested
        if requested > MAX_VIRTUAL_CPU_REPLICAS:
            raise ValueError(
                f"local_devices={requested}: the torch backend runs at most "
                f"{MAX_VIRTUAL_CPU_REPLICAS} virtual CPU replicas per worker."
            )
        return "CPU", requested

    def broadcast_from_chief(self, value: Any, device: str) -> Any:
        tensor = self.place(value, device)
        if self.connected:
            assert self._group is not None
            self._group.check("broadcast", tensor)
            with torch.no_grad():
                tensor = tensor.clone() if isinstance(value, torch.Tensor) else tensor
                self._group.broadcast_(tensor)
        return tensor

    # -- collectives across workers -----------------------------------------------------------
    def all_reduce(self, values: Sequence[Any], destinations: Sequence[str]) -> list[Any]:
        if not self.connected:
            return super().all_reduce(values, destinations)
        total = self.reduce_to(values, destinations[0])  # a new tensor, on destinations[0]
        return [total, *self._copies(total, destinations[1:])]

    def reduce_to(self, values: Sequence[Any], destination: str) -> Any:
        if not self.connected:
            return super().reduce_to(values, destination)
        assert self._group is not None
        with torch.no_grad():
            if len(values) == 1 and isinstance(values[0], torch.Tensor):
                # Out of place: the replica's tensor is only read.
                return self._group.all_reduce(values[0].to(torch_device(destination)), self._cache)
            first = values[0]  # the local sum overlaps the check's round trip
            device = torch_device(destination)
            wire = None
            if all(isinstance(v, torch.Tensor) for v in values):
                wire = self._group.wire(first.numel(), first.dtype, device)
            if wire is None:
                local, _ = self._group.checked(
                    "all_reduce",
                    first.dtype,
                    first.shape,
                    None,
                    lambda: self._local_sum(values, destination),
                )  # a new tensor
                self._group.all_reduce_(local)
                return local
            numel = first.numel()

            def local_sum() -> torch.Tensor:
                flat = presence_buffer(numel, first.dtype, device, self._cache, wire)
                total = flat[:numel].view(first.shape)
                if device.type == "cpu":
                    self._local_sum(values, destination, out=total)
                else:
                    total.copy_(TorchBackend.reduce_to(self, values, destination))
                return flat

            flat, pending = self._group.checked_wire(
                "all_reduce", first.dtype, first.shape, local_sum, wire
            )
            self._group.reduce_checked_(flat, wire, pending)
        return own_tensor(flat, 0, first.shape)

    def owns_buckets(self, dtype: torch.dtype) -> bool:
        """Whether `all_reduce_bucket_` sums buckets of ``dtype`` (connected to a cluster,
        and a dtype whose presence flag sums exactly)."""
        return self.connected and dtype in _PRESENCE and not tracing.is_tracing()

    def all_reduce_bucket_(
        self, flat: torch.Tensor, parts: Sequence[tuple[int, ...]], marks: torch.Tensor
    ) -> list[float]:
        """Sums ``flat`` over the workers in place: a flat buffer that a library component
        owns and no user code reaches (``DistributedOptimizer``'s gradient bucket), of a
        process whose one replica calls this (no local sum), outside autograd. Its last
        element is the presence flag, which the caller has set to 1; ``marks`` is a tail
        of ``flat`` that ends with it (the caller's flags, then the presence flag).
        Checked as an ``all_reduce(SUM)`` of the ``parts`` (their shapes) packed, with
        the fast path of ``polydist._collectives.check``: no copy, and no round trip for
        a repeated step, as DDP's bucket. Returns ``marks`` summed, read in one call
        (a training step's every torch call costs host time)."""
        group = self._group
        assert group is not None
        numel = flat.numel() - 1
        wire = wire_of(numel, flat.dtype, flat.device)
        with collective_intent("SUM"):
            _, pending = group.checked_wire(
                "all_reduce", flat.dtype, (numel,), _nothing, wire, parts=parts
            )
            group.all_reduce_(flat, pending)
            summed: list[float] = marks.tolist()
            if wire is not None:
                group.arrived(pending, int(summed[-1]))
        return summed

    def batch_all_reduce(
        self, columns: Sequence[Sequence[Any]], destinations: Sequence[str], bytes_per_pack: int
    ) -> list[list[Any]]:
        """`all_reduce` of each column (a nest's arrays), packed as TF packs a nest: the
        arrays of one dtype go into one flat buffer per pack (`pack_by_size`) and cross
        the workers in one checked collective, whose results are handed out as tensors
        of their own (not views) on the buffer's memory."""
        if not self.connected:
            return [self.all_reduce(column, destinations) for column in columns]
        firsts = [_tensors(column)[0] for column in columns]
        sizes = [t.numel() * t.dtype.itemsize for t in firsts]
        results: list[list[Any]] = [[] for _ in columns]
        for pack in pack_by_dtype([t.dtype for t in firsts], sizes, bytes_per_pack):
            if len(pack) == 1:
                results[pack[0]] = self.all_reduce(columns[pack[0]], destinations)
                continue
            dtype = firsts[pack[0]].dtype
            parts = self._packed([columns[i] for i in pack], dtype, destinations[0])
            for i, total in zip(pack, parts, strict=True):
                more = self._copies(total, destinations[1:]) if len(destinations) > 1 else []
                results[i] = [total, *more]
        return results

    def _packed(
        self, columns: Sequence[Sequence[torch.Tensor]], dtype: torch.dtype, destination: str
    ) -> list[torch.Tensor]:
        """The sums over every replica of several arrays of ``dtype``: one collective.

        The pack holds the large arrays first, then the small ones (under
        `CACHE_MIN_BYTES`: a bias, a loss), each group in the nest's order: the small
        results then live on one copy of the pack's tail, so that keeping one does not
        keep the whole pack alive, and a single-element one (a loss: a loss history)
        gets memory of its own. Few torch calls per array: on CPU each costs
        microseconds of Python."""
        assert self._group is not None
        device = torch_device(destination)
        shapes = [column[0].shape for column in columns]
        numels = [column[0].numel() for column in columns]
        small = [n * dtype.itemsize < CACHE_MIN_BYTES for n in numels]
        order = [i for i, s in enumerate(small) if not s] + [i for i, s in enumerate(small) if s]
        total = sum(numels)
        wire = self._group.wire(total, dtype, device)

        def fill() -> torch.Tensor:  # the local sums, while the check's round trip travels
            flat = presence_buffer(total, dtype, device, self._cache, wire)
            body = flat[:total] if wire is not None else flat
            if device.type != "cpu":
                offset = 0
                for i in order:
                    local = TorchBackend.reduce_to(self, columns[i], destination)
                    body[offset : offset + numels[i]].copy_(local.reshape(-1))
                    offset += numels[i]
                return flat
            # In replica order, as `_local_sum`: replica 0's arrays, plus replica 1's, ...
            torch.cat([columns[i][0].to(device).reshape(-1) for i in order], out=body)
            for k in range(1, len(columns[0])):
                scratch = self._cache.empty((total,), dtype)
                torch.cat([columns[i][k].to(device).reshape(-1) for i in order], out=scratch)
                body.add_(scratch)
            return flat

        with torch.no_grad():
            flat, pending = self._group.checked_wire(
                "all_reduce", dtype, (total,), fill, wire, parts=[tuple(s) for s in shapes]
            )
            self._group.reduce_checked_(flat, wire, pending)
            start = sum(numels[i] for i in order if not small[i])  # where the small ones are
            tail = flat[start:total].clone().untyped_storage() if any(small) else None
        # Tensors of their own (not views), so that autograd and in-place updates treat
        # each as the fresh tensor a lone all_reduce returns (set_ with no strides:
        # contiguous).
        storage, offset = flat.untyped_storage(), 0
        results: list[torch.Tensor] = [flat] * len(columns)
        for i in order:
            shape, n = shapes[i], numels[i]
            if n == 1:
                results[i] = flat[offset : offset + 1].view(shape).clone()
            else:
                own = torch.empty(0, dtype=dtype, device=device)
                if small[i]:
                    assert tail is not None
                    results[i] = own.set_(tail, offset - start, shape, ())
                else:
                    results[i] = own.set_(storage, offset, shape, ())
            offset += n
        return results

    def _local_sum(
        self, values: Sequence[Any], destination: str, out: torch.Tensor | None = None
    ) -> Any:
        """The sum of this worker's values in replica order, into ``out`` or a cached block
        on CPU."""
        device = torch_device(destination)
        if device.type != "cpu" or not all(isinstance(v, torch.Tensor) for v in values):
            return super().reduce_to(values, destination)
        first = values[0].to(device)
        total = self._cache.empty(first.shape, first.dtype) if out is None else out
        torch.add(first, values[1].to(device), out=total)
        for value in values[2:]:
            total.add_(value.to(device))
        return total

    def _copies(self, value: torch.Tensor, destinations: Sequence[str]) -> list[Any]:
        """A new copy of ``value`` per destination, into cached blocks on CPU."""
        copies = []
        with torch.no_grad():
            for destination in destinations:
                device = torch_device(destination)
                if device.type == "cpu":
                    copies.append(self._cache.empty(value.shape, value.dtype).copy_(value))
                else:
                    copies.append(value.to(device, copy=True))
        return copies

    def all_gather(
        self, values: Sequence[Any], axis: int, destinations: Sequence[str]
    ) -> list[Any]:
        local = super().all_gather(values, axis, destinations[:1])[0]
        if not self.connected:
            return super().broadcast(local, destinations) if len(destinations) > 1 else [local]
        assert self._group is not None
        axis = axis % max(local.dim(), 1)
        self._group.check("all_gather", local, axis)
        with torch.no_grad():
            gathered = self._group.all_gather(local, axis)
        return super().broadcast(gathered, destinations)

    def close(self) -> None:
        """Leaves the cluster: stops the heartbeat and destroys the torch process group."""
        group, self._group = self._group, None
        self._cache.clear()
        if group is None:
            return
        group.close()
        if group.make_store is not None and dist.is_initialized():
            dist.destroy_process_group()


_LIVE: weakref.WeakSet[TorchProcessGroupBackend] = weakref.WeakSet()
_shared_backend = mp.once_per_process(TorchProcessGroupBackend)


def shutdown() -> None:
    """Leaves the cluster: every `TorchProcessGroupBackend` of this process stops its
    heartbeat and destroys its torch process group. Optional: exiting does it too."""
    for backend in list(_LIVE):
        backend.close()


@atexit.register
def _leave_at_exit() -> None:
    # The process group goes too: a gloo group still alive while the interpreter tears
    # down can abort the process ("terminate called without an active exception").
    for backend in list(_LIVE):
        group, backend._group = backend._group, None
        if group is None:
            continue
        group.close(wait=5.0)
        if group.make_store is not None and dist.is_initialized():
            dist.destroy_process_group()


def _worker_cluster(
    cluster_resolver: ClusterResolver | None, communication_options: CommunicationOptions | None
) -> ClusterToJoin:
    master = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return mp.resolve_cluster(
        cluster_resolver,
        communication_options,
        "RANK",
        "WORLD_SIZE",
        f"{master[0]}:{master[1]}" if all(master) else None,
        what="torchrun",
    )


class TorchWorkerProcesses:
    """The torch backend's `polydist.backend.SupportsWorkerProcesses` (entry point
    ``polydist.worker_processes: torch``): ``MultiWorkerMirroredStrategy(backend="torch")``
    runs on this process's shared `TorchProcessGroupBackend`. The cluster comes from the
    ``cluster_resolver``, ``TF_CONFIG`` (``polydist launch`` sets it), or torchrun's
    ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``."""

    def worker_cluster(
        self,
        cluster_resolver: ClusterResolver | None,
        communication_options: CommunicationOptions | None,
    ) -> ClusterToJoin:
        return _worker_cluster(cluster_resolver, communication_options)

    def worker_process_engine(self, cluster: ClusterToJoin, local_devices: int | None) -> Backend:
        backend = _shared_backend()
        backend.prepare(cluster.rendezvous, cluster.addresses, cluster.timeout)
        return backend


#: What the ``polydist.worker_processes`` entry point ``torch`` names.
WORKER_PROCESSES = TorchWorkerProcesses()


class MultiWorkerMirroredStrategy(pd.MultiWorkerMirroredStrategy):
    """Deprecated: use ``polydist.MultiWorkerMirroredStrategy(backend="torch")``.

    Kept for one release: it warns (``DeprecationWarning``) and builds that strategy
    on ``backend`` (default: this process's shared `TorchProcessGroupBackend`), so a
    single worker also runs on the process-group engine, as before.

    Args:
        cluster_resolver: the cluster and this worker's task. Default:
            ``TFConfigClusterResolver()`` when ``TF_CONFIG`` names a cluster, else
            torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``, else
            a single worker.
        communication_options: ``timeout_seconds`` bounds joining and each
            collective (default `DEFAULT_TIMEOUT_SECONDS`; 0: no bound).
        local_devices: replicas per worker (a polydist extension): the first N
            CUDA devices, or N virtual CPU replicas without CUDA. Default (TF's
            rule): every CUDA device of the machine, else one CPU replica.
        backend: a `TorchProcessGroupBackend` (default: this process's shared one).
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        *,
        local_devices: int | None = None,
        backend: TorchProcessGroupBackend | None = None,
    ) -> None:
        warnings.warn(
            "polydist_torch.MultiWorkerMirroredStrategy is deprecated and will be removed in the "
            "next release: use polydist.MultiWorkerMirroredStrategy(backend='torch') (same "
            "arguments; or set POLYDIST_BACKEND=torch, as `polydist launch --backend torch` does).",
            DeprecationWarning,
            stacklevel=2,
        )
        if backend is None:
            backend = _shared_backend()
        if not isinstance(backend, TorchProcessGroupBackend):
            raise TypeError(
                "backend must be a polydist_torch.TorchProcessGroupBackend (or None for the "
                f"process's shared one), got {type(backend).__name__} {backend!r}."
            )
        super().__init__(
            cluster_resolver, communication_options, backend=backend, local_devices=local_devices
        )
