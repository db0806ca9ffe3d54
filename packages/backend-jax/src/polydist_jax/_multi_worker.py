"""``MultiWorkerMirroredStrategy`` over ``jax.distributed``: one process per worker.

Each worker is one JAX process (``jax.distributed.initialize``; on CPU, gloo
carries the cross-process collectives, JAX 0.10's default) with D replicas,
one per local device (``local_devices=D``; on CPU this sets
``jax_num_cpu_devices``).

``strategy.run`` compiles as in one process (``polydist_jax._spmd``), on a
``("workers", "replica")`` mesh of every process's replica devices,
worker-major, so the mesh's linear index is the global replica id. Each
worker assembles its global inputs from its own replicas' values, and gets
back its own replicas' outputs and variable copies. The workers agree on the
program first: each compiled step is preceded by one small all-gather of a
digest of the function, its input shapes and the collectives of its trace,
and runs its body under ``lax.cond`` only if every digest is the same
(`_Cluster.compile`); when one differs or cannot compile, every worker runs
that call eagerly (where each collective is
checked: workers whose steps issue other collectives raise
``CollectiveMismatchError``). Eager runs (``jit=False``, or that fallback)
run the D replicas on threads, like ``JaxBackend(jit=False)``: each
cross-replica collective is a sequential sum (or concatenation) over this
worker's replicas, then one compiled cross-process step on a mesh of one
device per process (``lax.psum`` for sums, a replicated ``jax.jit`` identity
for gathers and broadcasts). Sums across workers are in gloo's order:
results equal the sim's within the rounding bound of a sum.

The cluster comes from the ``cluster_resolver`` argument, else ``TF_CONFIG``,
else ``polydist launch``'s ``POLYDIST_PROCESS_ID``/``POLYDIST_NUM_PROCESSES``
with ``JAX_COORDINATOR_ADDRESS``. Worker 0's address is the coordinator.
Create the strategy (or call `initialize`) before anything else touches JAX
devices: ``jax.distributed.initialize`` must run before JAX's backends start.

Bounds and faults (``CommunicationOptions.timeout_seconds``, default 60 s):

* Before each cross-process collective (each compiled step counts as one,
  ``strategy.run``) every worker publishes its signature through the
  coordination service and compares the others'
  (``polydist.backend.multiprocess``): workers that disagree all raise
  ``CollectiveMismatchError`` before issuing it.

* A collective that raises (gloo notices a dead peer's closed connection at
  once) becomes ``UnavailableError`` / ``DeadlineExceededError`` naming the
  workers whose heartbeats stopped (see `polydist.backend.multiprocess.Heartbeat`;
  the heartbeats go through JAX's coordination service, hosted by worker 0).
* A collective (or a compiled step, compiled before the bound starts) that
  does not return within the timeout cannot be interrupted (XLA blocks in
  C++). A watchdog thread then prints the same diagnosis as a
  ``DeadlineExceededError`` message to stderr and ends the process with exit
  code `WATCHDOG_EXIT_CODE` (75). Joining the cluster is
  watched the same way; there, which worker is missing is not known (JAX's
  coordinator does not say), so the message names the coordinator.
* After a failure the process cannot leave JAX's cluster cleanly (JAX's
  shutdown barrier would wait for the dead peer, then abort): at interpreter
  exit polydist ends the process with ``os._exit(1)`` instead. JAX's own
  coordination service also ends every process about ``timeout + 10`` s
  after a peer stops heartbeating (``heartbeat_timeout_seconds``).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import functools
import ipaddress
import itertools
import math
import operator
import os
import socket
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

import polydist as pd
from polydist import errors
from polydist.backend import Backend, ClusterToJoin, pack_by_dtype
from polydist.backend import multiprocess as mp
from polydist.backend import tracing as _trace
from polydist.backend.devices import DeviceSpec
from polydist.backend.multiprocess import (
    DEFAULT_TIMEOUT_SECONDS,
    Pending,
    id_in_cluster,
    worker_count,
)
from polydist.cluster_resolver import ClusterResolver
from polydist.experimental import CommunicationOptions
from polydist_jax import _collectives
from polydist_jax._backend import JaxBackend
from polydist_jax._lazy import WORKERS, find_lazy, is_tracer, replica_axes, replica_axis
from polydist_jax._spmd import CompiledRunner, _Mesh
from polydist_jax._typed import pspec, psum

__all__ = [
    "DEFAULT_TIMEOUT_SECONDS",
    "WATCHDOG_EXIT_CODE",
    "WORKER_PROCESSES",
    "JaxProcessBackend",
    "JaxWorkerProcesses",
    "MultiWorkerMirroredStrategy",
    "initialize",
]

#: Exit code of a process whose collective (or cluster join) outlived the timeout.
WATCHDOG_EXIT_CODE = 75
# What messages call a compiled step, and the bytes of its signature the workers compare.
_RUN = "strategy.run"
_SIGNATURE_BYTES = 32
# What `_Cluster.agree` exchanges: a flag (this worker can compile the call), then the digest.
_DIGEST_WORDS = 1 + _SIGNATURE_BYTES // 4
_DIGEST_CACHE = 64  # programs whose digest array stays on the device
_AXIS = "polydist_workers"
_PLATFORMS = {"CPU": "cpu", "GPU": "gpu", "TPU": "tpu"}
# When the watchdog first probes a waiting call (a compiled step's agreement: see
# `agree`); each later probe waits twice as long, up to `_PROBE_MAX_SECONDS` (each probe
# reads every peer's key: a store load that grows with the cluster).
_PROBE_SECONDS = 0.25
_PROBE_MAX_SECONDS = 4.0
# How long a collective that failed while a probe ends the process waits for that end
# (the probe lingers up to 5 s for the peers to read the mismatch).
_ENDING_WAIT_SECONDS = 15.0
# How long worker 0, ending after a probe found a mismatch, leaves its peers to raise it.
_COORDINATOR_GRACE_SECONDS = 2.0
# How long each read of a peer's signature may take when a collective failed (`translate`).
_PEEK_SECONDS = 0.25
# JAX's own liveness bounds are set this far beyond polydist's, so that ours fire first.
_JAX_MARGIN_SECONDS = 10


def _set_cpu_devices(count: int) -> None:
    jax.config.update("jax_num_cpu_devices", count)  # type: ignore[no-untyped-call]


def _backends_started() -> bool:
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())


def _client() -> Any:
    from jax._src import distributed

    return distributed.global_state.client


# --------------------------------------------------------------------------- the watchdog


class _Watchdog:
    """Ends the process when the current blocking call outlives its deadline.

    XLA's collectives and JAX's cluster join block in C++, so a stuck one cannot
    be interrupted from Python: the only bounded way out is to exit.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = 0  # how many times it was armed: the current arm's number
        self._deadline: float | None = None
        self._explain: Callable[[], str] = lambda: ""
        # While the call waits: (when next, the interval, a probe that may end the process).
        self._probe: tuple[float, float, Callable[[], str | None]] | None = None
        self._wake = threading.Event()
        thread = threading.Thread(target=self._loop, name="polydist-watchdog", daemon=True)
        thread.start()

    def arm(
        self,
        seconds: float,
        explain: Callable[[], str],
        probe: Callable[[], str | None] | None = None,
    ) -> int:
        """Watches the next ``seconds``; returns the arm's number, for `disarm`. While the
        call waits, ``probe`` runs on the watchdog's thread after `_PROBE_SECONDS`, then at
        doubling intervals: a message it returns ends the process at once (even if the
        call failed while the probe ran: the message is the cause)."""
        with self._lock:
            self._generation += 1
            now = time.monotonic()
            self._deadline = now + seconds
            self._explain = explain
            self._probe = None if probe is None else (now + _PROBE_SECONDS, _PROBE_SECONDS, probe)
            generation = self._generation
        self._wake.set()
        return generation

    def disarm(self, generation: int) -> None:
        """Ends arm number ``generation``, unless a later arm replaced it."""
        with self._lock:
            if generation == self._generation:
                self._deadline = None

    def _loop(self) -> None:
        while True:
            with self._lock:
                generation, deadline, explain = self._generation, self._deadline, self._explain
            if deadline is None:
                self._wake.wait()  # until armed
                self._wake.clear()
                continue
            now = time.monotonic()
            probe = self._probe
            if probe is not None and now >= probe[0]:
                with self._lock:
                    run = self._probe is probe and generation == self._generation
                    if run:
                        interval = min(2 * probe[1], _PROBE_MAX_SECONDS)
                        self._probe = (now + interval, interval, probe[2])
                found = probe[2]() if run else None
                if found is not None:  # even if the call failed meanwhile: the cause
                    _exit_with(found, WATCHDOG_EXIT_CODE)
                continue
            remaining = deadline - now
            if remaining > 0:
                time.sleep(min(remaining, 0.1))
                continue
            message = explain()  # diagnosing takes seconds: the call may return meanwhile
            with self._lock:
                # Only the late call itself, still armed, ends the process (not a later one).
                late = generation == self._generation and self._deadline is not None
            if late:
                _exit_with(message, WATCHDOG_EXIT_CODE)


def _outside_jax(frame: FrameType | None) -> FrameType | None:
    """The first frame from ``frame`` outward that is not JAX's (a step waits in
    ``jax.block_until_ready``)."""
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in (
        "jax",
        "jaxlib",
    ):
        frame = frame.f_back
    return frame


def _exit_with(message: str, code: int) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.write(f"polydist: {message}\n")
        sys.stderr.flush()
    finally:
        os._exit(code)


_watchdog = mp.once_per_process(_Watchdog)


# --------------------------------------------------------------------------- joining


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_devices: int | None = None,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    coordinator_bind_address: str | None = None,
) -> tuple[int, int]:
    """``jax.distributed.initialize`` with polydist's bounds; returns ``(process_id, count)``.

    Arguments default to ``$JAX_COORDINATOR_ADDRESS`` (or
    ``$POLYDIST_COORDINATOR_ADDRESS``), ``$POLYDIST_NUM_PROCESSES`` and
    ``$POLYDIST_PROCESS_ID``, which ``polydist launch`` sets. Worker 0 hosts JAX's
    coordination service (unauthenticated) on ``coordinator_bind_address``: default
    ``$JAX_COORDINATOR_BIND_ADDRESS``, else the coordinator address itself, so it
    listens only on the interface the cluster names (loopback under ``polydist
    launch``), not on every interface as JAX's own default (``[::]:PORT``) does.
    ``local_devices`` sets ``jax_num_cpu_devices`` on CPU. Must run before JAX's backends start
    (before any ``jax.devices()`` or computation). A process that has not
    joined within ``timeout_seconds`` prints why and exits with
    `WATCHDOG_EXIT_CODE`. Calling it again in a joined process is a no-op.
    """
    if jax.distributed.is_initialized():
        return jax.process_index(), jax.process_count()
    address = (
        coordinator_address
        or os.environ.get("JAX_COORDINATOR_ADDRESS")
        or os.environ.get("POLYDIST_COORDINATOR_ADDRESS")
    )
    count = num_processes if num_processes is not None else _env_int("POLYDIST_NUM_PROCESSES")
    index = process_id if process_id is not None else _env_int("POLYDIST_PROCESS_ID")
    if address is None or count is None or index is None:
        raise ValueError(
            "polydist_jax.initialize needs the coordinator address, the number of processes and "
            f"this process's id; got coordinator_address={address!r}, num_processes={count!r}, "
            f"process_id={index!r}. Pass them, run under `polydist launch`, or set "
            "JAX_COORDINATOR_ADDRESS, POLYDIST_NUM_PROCESSES and POLYDIST_PROCESS_ID."
        )
    if _backends_started():
        raise RuntimeError(
            "JAX's backends have already started in this process (something called jax.devices(), "
            "created an array or ran a computation), so jax.distributed.initialize can no longer "
            "run. Create polydist.MultiWorkerMirroredStrategy(backend='jax') (or call "
            "polydist_jax.initialize_multi_worker) first thing in the program, before any "
            "other JAX call."
        )
    bind = _bind_address(address, coordinator_bind_address)
    if local_devices is not None:  # only the CPU platform reads it
        _set_cpu_devices(local_devices)
    jax_bound = math.ceil(timeout_seconds) + _JAX_MARGIN_SECONDS
    watchdog = _watchdog()

    def explain() -> str:
        return (
            f"DeadlineExceededError: worker {index} of {count} could not join the cluster within "
            f"{timeout_seconds:g} s: not every worker connected to the coordinator at {address} "
            "(worker 0's address). A worker did not start, got a wrong task index or address, or "
            "worker 0 is unreachable. Start every worker of the cluster, or raise "
            "CommunicationOptions(timeout_seconds=...)."
        )

    armed = watchdog.arm(timeout_seconds, explain)
    try:
        jax.distributed.initialize(
            address,
            count,
            index,
            initialization_timeout=jax_bound,
            heartbeat_timeout_seconds=jax_bound,
            coordinator_bind_address=bind,
        )
    finally:
        watchdog.disarm(armed)
    return index, count


def _bind_address(coordinator_address: str, explicit: str | None = None) -> str:
    """Where worker 0's coordination service listens: ``explicit``, else
    ``$JAX_COORDINATOR_BIND_ADDRESS``, else ``coordinator_address`` itself (the address
    the cluster spec gives worker 0: only that interface). One exception: a host *name*
    that resolves to loopback here only (Debian and Ubuntu map the machine's own name to
    127.0.1.1) names this host to the others by its network address, which this process
    cannot know: the service then listens on every interface (``[::]:PORT``, JAX's
    default), as before."""
    override = explicit or os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")
    bind = override or coordinator_address
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(
            f"The coordinator's bind address {bind!r} is not HOST:PORT. Pass "
            "coordinator_bind_address='HOST:PORT' (or set $JAX_COORDINATOR_BIND_ADDRESS), e.g. "
            "'10.0.0.5:1234' for one interface, or '[::]:1234' for every interface."
        )
    if not override and _only_loopback_by_name(host):
        return f"[::]:{port}"
    return bind


def _only_loopback_by_name(host: str) -> bool:
    """Whether ``host`` is a name (not an IP literal, not ``localhost``) whose every
    address here is a loopback address."""
    if host.lower() == "localhost":
        return False
    try:
        ipaddress.ip_address(host.strip("[]"))
        return False  # an IP literal: bind exactly that
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, None)
    except OSError:
        return False  # JAX reports an unresolvable name itself
    addresses = {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in found}
    return bool(addresses) and all(a.is_loopback for a in addresses)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"${name}={value!r} must be an integer (polydist launch sets it); unset it or "
            "set it to this process's number."
        ) from None


_FAILED: list[errors.OpError] = []


_CLUSTERS: weakref.WeakSet[_Cluster] = weakref.WeakSet()


def _exit_without_jax_shutdown() -> None:
    # Runs before JAX's own exit handlers (see _exit_handler). The heartbeat thread must
    # not be inside a call into JAX's C++ client when the interpreter finalizes.
    for cluster in list(_CLUSTERS):
        cluster.close(wait=5.0)  # leaves the collective check unless the cluster failed
    # After a failed collective JAX's shutdown barrier waits for the dead peer and then
    # aborts; leave without it (exit code 1, as for the uncaught error). So too after any
    # other failure of the cluster: an error that escaped strategy.run (`abandon`), or a
    # peer's such error (`CollectiveMismatchError`): a peer may have ended (the watchdog's
    # exit) or leave without the barrier itself, which this one would wait for.
    failures = [*_FAILED, *(c.failure for c in list(_CLUSTERS) if c.failure is not None)]
    if failures:
        _exit_with(f"exiting after {type(failures[0]).__name__} (skipping JAX's shutdown).", 1)


# Registered by the first cluster, whether `initialize` or the program itself started
# jax.distributed. atexit runs the last registered first; JAX registers its handlers (the
# one that shuts jax.distributed down) on import and when its backends start, both earlier.
_exit_handler = mp.once_per_process(lambda: atexit.register(_exit_without_jax_shutdown))


# --------------------------------------------------------------------------- the cluster


class _KeyValueStore:
    """JAX's coordination service as the `HeartbeatStore` of polydist's heartbeats and
    the `SignatureStore` of its collective checks."""

    def __init__(self, prefix: str) -> None:
        self._client = _client()
        self._prefix = prefix

    def set(self, key: str, value: str) -> None:
        self._client.key_value_set(self._prefix + key, value, allow_overwrite=True)

    def get(self, key: str) -> str | None:
        try:
            return str(self._client.key_value_try_get(self._prefix + key))
        except Exception as e:
            if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
                return None
            raise

    def delete(self, key: str) -> None:
        self._client.key_value_delete(self._prefix + key)

    def get_all(self, keys: Sequence[str], seconds: float) -> list[str] | None:
        deadline = time.monotonic() + seconds
        values = []
        for key in keys:
            ms = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                values.append(str(self._client.blocking_key_value_get(self._prefix + key, ms)))
            except Exception as e:
                if "DEADLINE_EXCEEDED" in str(e):
                    return None
                raise
        return values


class _Cluster(mp.ClusterMembership):
    """The cross-process half of the collectives: a mesh of one device per process."""

    def __init__(
        self, rank: int, world_size: int, timeout: float, names: list[str], addresses: list[str]
    ) -> None:
        super().__init__(
            rank=rank, world_size=world_size, timeout=timeout, names=names, addresses=addresses
        )
        by_process: dict[int, list[jax.Device]] = {}
        for d in jax.devices():
            by_process.setdefault(d.process_index, []).append(d)
        if sorted(by_process) != list(range(world_size)):
            raise ValueError(
                f"JAX sees processes {sorted(by_process)} but the cluster has {world_size} "
                "workers: every worker must be one JAX process (jax.distributed.initialize with "
                "num_processes equal to the number of workers)."
            )
        self.devices = [min(by_process[p], key=lambda d: d.id) for p in range(world_size)]
        self.local = self.devices[rank]
        self.mesh = Mesh(np.array(self.devices, dtype=object), (_AXIS,))
        self.split = NamedSharding(self.mesh, pspec(_AXIS))
        self.replicated = NamedSharding(self.mesh, pspec())
        _exit_handler()  # before the heartbeat starts; after JAX's backends (jax.devices())
        # The check waits longer than the watchdog: a peer alive but late gets its message.
        self.watch(
            lambda: _KeyValueStore("polydist/"),
            check_timeout=timeout + _JAX_MARGIN_SECONDS,
            overlap_writes=True,  # each write is a gRPC round trip
        )
        _CLUSTERS.add(self)
        self._psum = jax.jit(
            jax.shard_map(
                functools.partial(jax.lax.psum, axis_name=_AXIS),
                mesh=self.mesh,
                in_specs=pspec(_AXIS),
                out_specs=pspec(),
            )
        )
        # An XLA all-gather: about a fifth of the time of resharding to replicated on CPU
        # (`_reshard`, which `gather` uses only inside a compiled step's trace, a
        # variable's creation: a shard_map there would meet the step's mesh). Replicated
        # by construction (every worker gets every row): no replication check.
        self._reshard = jax.jit(lambda x: x, out_shardings=self.replicated)
        self._gather = jax.jit(
            jax.shard_map(
                functools.partial(jax.lax.all_gather, axis_name=_AXIS, tiled=True),
                mesh=self.mesh,
                in_specs=pspec(_AXIS),
                out_specs=pspec(),
                check_vma=False,
            )
        )
        self._announced: Pending | None = None  # the step agree is at (for a diagnosis)
        self._ending = threading.Event()  # a probe found a mismatch: the process ends
        self._digest_arrays: collections.OrderedDict[
            tuple[bytes | None, Mesh], tuple[Any, bytes | None]
        ] = collections.OrderedDict()
        self._rows_programs: dict[Mesh, Any] = {}  # `_rows_program`, per step mesh

    def _stacked(self, local: Any) -> Any:
        """A global array whose row ``w`` is worker ``w``'s ``local``."""
        # A NumPy value goes to the device in one transfer, without a dispatch.
        expand = np.expand_dims if isinstance(local, np.ndarray) else jnp.expand_dims
        block = jax.device_put(expand(local, 0), self.local)
        shape = (self.world_size, *block.shape[1:])
        return jax.make_array_from_single_device_arrays(shape, self.split, [block])

    def _concatenated(self, local: Any) -> Any:
        """A global array of every worker's ``local`` along axis 0 (no copy of ``local``)."""
        if local.ndim == 0 or local.shape[0] == 0:
            return self._stacked(local)
        block = jax.device_put(local, self.local)
        shape = (self.world_size * block.shape[0], *block.shape[1:])
        return jax.make_array_from_single_device_arrays(shape, self.split, [block])

    def _arm(self, what: str, probe: Callable[[], str | None] | None = None) -> int:
        """The watchdog, armed for the next collective, ``what`` (``probe``: see `arm`);
        what `_Watchdog.disarm` takes."""
        n = self.collectives + 1
        return _watchdog().arm(self.timeout, lambda: self._late_message(what, n), probe)

    @contextlib.contextmanager
    def _watched(self, what: str, probe: Callable[[], str | None] | None = None) -> Iterator[None]:
        armed = self._arm(what, probe)
        try:
            yield
        finally:
            _watchdog().disarm(armed)

    def _run(
        self, what: str, fn: Callable[[], Any], probe: Callable[[], str | None] | None = None
    ) -> Any:
        def completed() -> Any:
            return jax.block_until_ready(fn())  # type: ignore[no-untyped-call]

        armed = self._arm(what, probe)  # not `_watched`: no generator's frames per step
        try:
            return self.call(what, completed)
        finally:
            _watchdog().disarm(armed)

    def check(
        self,
        op: str,
        array: Any,
        axis: int | None = None,
        parts: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Before collective ``op`` of ``array``: `checked` (raises on a mismatch); a late
        peer meets the watchdog, as in `_run`. ``parts``: the shapes packed into
        ``array``, if several."""
        with self._watched(op):
            self.checked(op, array.dtype, array.shape, axis, lambda: None, parts=parts)

    def failed(self, what: str, err: BaseException) -> errors.OpError:
        if self._ending.is_set():
            # A probe found the cause (a peer at another collective) and is ending the
            # process with it: the peer's exit broke this collective, so do not raise
            # a misleading error first.
            time.sleep(_ENDING_WAIT_SECONDS)
        failure = super().failed(what, err)
        _FAILED.append(failure)  # the process then exits without JAX's shutdown
        return failure

    def psum(self, local: Any, parts: Sequence[Sequence[int]] | None = None) -> Any:
        """The sum of every worker's ``local`` (same shape and dtype everywhere; ``parts``:
        the shapes of the arrays packed into it, if several)."""
        self.check("all_reduce", local, parts=parts)
        stacked = local.ndim == 0 or local.shape[0] == 0
        out = self._run("all_reduce", lambda: self._psum(self._concatenated(local)))
        result = out.addressable_data(0)
        return result[0] if stacked else result

    def gather(self, local: Any, what: str = "all_gather") -> Any:
        """Every worker's ``local`` stacked on a new axis 0, in worker order."""
        gather = self._gather if jax.sharding.get_abstract_mesh().empty else self._reshard
        out = self._run(what, lambda: gather(self._stacked(local)))
        return out.addressable_data(0)

    # -- compiled runs (polydist_jax._spmd.ProcessGroup) -----------------------------------
    # Every compiled step is preceded by the workers' agreement on its program: one tiny
    # XLA all-gather of each worker's digest (`_digest_array`), over the step's own mesh,
    # a program of its own whose gathered rows the step takes as its first input, running
    # its body in a ``lax.cond`` on the digests being equal. The host dispatches both and
    # waits for the rows only, never for the step: the step's outputs come back while it
    # runs, and the host's work for the next step overlaps it (waiting for the step too,
    # as before the agreement moved into the step's program, cost about 1 ms per step on
    # CPU; a step with the all-gather inside made the host wait for the whole step). The
    # all-gather is the first cross-process collective of every step, the same for all,
    # so that workers at different programs (or one that cannot compile: `agree` runs
    # the all-gather alone) meet there, all see the digests differ, skip the body, and
    # run the call eagerly together. With checks on, the step is numbered as a checked
    # collective; its signature reaches the store only if the agreement waits (a peer at
    # another, store-checked collective then raises the mismatch).
    def agree(self, signature: bytes | None, mesh: _Mesh) -> str | None:
        """A step's agreement alone (see `polydist_jax._spmd.ProcessGroup`)."""
        out = self._agreed(signature, mesh, self._rows_program(mesh))
        return self._disagreement(out, signature, mesh)

    def compile(self, jitted: Any, mesh: _Mesh, inputs: Sequence[Any]) -> Any:
        """``jitted`` behind the agreement, taking its gathered rows first (see
        `polydist_jax._spmd.ProcessGroup`)."""

        def step(rows: Any, *args: Any) -> Any:
            agreed = jnp.all(rows[:, 0] == 1) & jnp.all(rows == rows[0])
            shapes = jax.eval_shape(jitted, *args)
            outputs = jax.lax.cond(
                agreed, lambda: jitted(*args), lambda: jax.tree.map(_zeros, shapes)
            )
            return outputs

        digest = self._digest_array(None, mesh)[0]
        rows = jax.ShapeDtypeStruct(digest.shape, digest.dtype, sharding=mesh.replicated)  # type: ignore[no-untyped-call]
        return jax.jit(step).lower(rows, *inputs).compile()

    def execute(
        self,
        signature: bytes,
        mesh: _Mesh,
        executable: Any,
        inputs: Sequence[Any],
        then: Callable[[Any], Any] | None = None,
    ) -> tuple[str | None, Any]:
        """Runs `compile`'s ``executable`` (see `polydist_jax._spmd.ProcessGroup`)."""
        made: list[Any] = []
        rows_program = self._rows_program(mesh)

        def run(digest: Any) -> Any:
            rows = rows_program(digest)
            outputs = executable(rows, *inputs)
            made.append(outputs if then is None else then(outputs))
            return rows  # the wait: the agreement, not the step

        rows = self._agreed(signature, mesh, run)
        why = self._disagreement(rows, signature, mesh)
        return why, (None if why is not None else made[0])

    def _agreed(self, signature: bytes | None, mesh: _Mesh, run: Callable[[Any], Any]) -> Any:
        """``run(digest)`` of this worker's digest of ``signature``: the agreement (and the
        step behind it), bounded and checked (see `agree`); ``run`` returns what is waited
        for, the gathered rows, and its host work after its dispatches overlaps them."""
        digest = self._digest_array(signature, mesh)[0]
        if self.heartbeat is not None and self.failure is None and self.heartbeat.failed():
            self._raise_abandoned()
        pending = self.announce(_RUN)
        self._announced = pending
        try:
            out = self._run(_RUN, lambda: run(digest), self._probe_agreement(pending))
        finally:
            self._announced = None
        self.settle(pending)
        return out

    def _raise_abandoned(self) -> None:
        """Before a compiled step, when a peer's heartbeat says an error left the cluster
        out of step (`ClusterMembership.abandon`): the peer never joins this step's
        agreement, which XLA could not leave (the watchdog would end the process), so the
        step is checked through the store instead, where the peer published its failure:
        raises that ``CollectiveMismatchError`` (the cluster has failed)."""
        self.check_signature(_RUN)  # raises the peer's failure (it published it first)
        # The collective check is off (nothing published): the heartbeat's word alone.
        failed = self.heartbeat.failed() if self.heartbeat is not None else []
        self.failure = errors.CollectiveMismatchError(
            f"{self.collective(_RUN)} cannot run: worker(s) {self.describe(failed)} raised an "
            "error that left the cluster's collectives out of step, and call no more "
            "collectives. The cluster cannot be used any more: stop every worker and restart "
            "them all, from the latest checkpoint."
        )
        raise self.failure

    def _disagreement(self, rows: Any, signature: bytes | None, mesh: _Mesh) -> str | None:
        """Why the workers' gathered digests ``rows`` do not agree; None if they do
        (this worker's digest of ``signature`` on ``mesh`` on every row)."""
        # Replicated: NumPy reads it without this worker's shard built first (half the
        # CPU time of `addressable_data(0)` on a step's fresh output).
        gathered = np.asarray(rows)
        if gathered.tobytes() == self._digest_array(signature, mesh)[1]:
            return None  # one comparison: the step's only host work on the agreement
        if gathered[:, 0].all() and (gathered == gathered[self.rank]).all():
            return None
        digests = [row[1:].tobytes().hex() if row[0] else "" for row in gathered]
        unable = [w for w, digest in enumerate(digests) if not digest]
        if unable:
            return (
                f"worker(s) {self.describe(unable)} cannot compile this call (their replicas' "
                "inputs differ from one replica to another)"
            )
        differ = [w for w, digest in enumerate(digests) if digest != digests[self.rank]]
        if differ:
            return (
                f"worker(s) {self.describe(differ)} call another program than worker "
                f"{self.rank}: another function, inputs of other shapes, dtypes or static "
                "values (e.g. a partial last batch on some workers), or other collectives "
                "in its trace (closures or globals that differ between workers)"
            )
        return None

    def _rows_of(self, mesh: _Mesh) -> Callable[[Any], Any]:
        """The agreement's all-gather on ``mesh``: every worker's digest row, from a
        ``(workers, words)`` array split over the workers (each replica device of a
        worker holds its row; replica k of every worker gathers among themselves)."""
        return jax.shard_map(
            functools.partial(jax.lax.all_gather, axis_name=WORKERS, tiled=True),
            mesh=mesh.mesh,
            in_specs=pspec(WORKERS),
            out_specs=pspec(),
            check_vma=False,
        )

    def _rows_program(self, mesh: _Mesh) -> Any:
        program = self._rows_programs.get(mesh.mesh)
        if program is None:
            program = self._rows_programs[mesh.mesh] = jax.jit(self._rows_of(mesh))
        return program

    def _probe_agreement(self, pending: Pending | None) -> Callable[[], str | None] | None:
        """While a step (or its agreement alone) waits: publishes the step's signature
        (once), then looks for a peer at another collective, which raised
        ``CollectiveMismatchError``; the step can never complete then, so this process
        ends at once, saying so."""
        if pending is None or self.checker is None:
            return None
        checker, caller, published = self.checker, threading.get_ident(), False

        def probe() -> str | None:
            nonlocal published
            if not published:
                self.publish_late(pending)
                published = True
            try:
                found = checker.peek(pending)
            except Exception:  # the store is gone: the watchdog's diagnosis says so later
                return None
            if not found:
                return None
            self._ending.set()
            site = _trace.user_source_line(frame=_outside_jax(sys._current_frames().get(caller)))
            # (A peer that abandoned the cluster reads no site: nobody to wait for.)
            readers = [] if checker.peer_failed else sorted(found)
            with contextlib.suppress(Exception):  # the peers' messages then lack the line
                checker.report_site(pending, site, readers)
            if self.rank == 0:
                # The peers have read the mismatch and now raise it; JAX aborts them once
                # the coordination service (this process) is gone: let them report first.
                time.sleep(_COORDINATOR_GRACE_SECONDS)
            if checker.peer_failed:  # (`ClusterMembership.abandon`)
                return (
                    f"CollectiveMismatchError: Collective #{pending.n} cannot run: worker "
                    f"{self.describe([self.rank])} is at a compiled {_RUN} at {site}, "
                    f"{self._at_others(found)}: an error on that worker left the cluster's "
                    "collectives out of step. XLA cannot interrupt the step's collective, so "
                    f"this process exits with code {WATCHDOG_EXIT_CODE}. The cluster cannot "
                    "be used any more: stop every worker and restart them all, from the "
                    "latest checkpoint."
                )
            return (
                f"CollectiveMismatchError: Workers disagree on their collective #{pending.n}: "
                f"worker {self.describe([self.rank])} is at a compiled {_RUN} at {site}, "
                f"{self._at_others(found)}. "
                "XLA cannot interrupt the step's collective, so this process exits with code "
                f"{WATCHDOG_EXIT_CODE}. Every worker must call the same collectives "
                "(strategy.run, reduce, gather, ...) in the same order."
            )

        return probe

    def _elsewhere(self, pending: Pending | None, seconds: float = 0.001) -> str:
        """Which peers are at another collective than ``pending`` (`CollectiveChecker.peek`):
        '' if none, or the store cannot tell."""
        if self.checker is None:
            return ""
        try:
            found = self.checker.peek(pending, seconds)
        except Exception:  # the store is gone: the diagnosis names the dead instead
            return ""
        return self._at_others(found)

    def _at_others(self, found: dict[int, str]) -> str:
        """`CollectiveChecker.peek`'s answer in words."""
        return "; ".join(
            f"worker {self.describe([w])} is at {at} instead" for w, at in sorted(found.items())
        )

    def _digest_array(self, signature: bytes | None, mesh: _Mesh) -> tuple[Any, bytes | None]:
        """What the agreement gathers: this worker's row (a flag: it can compile the
        call, then ``signature``) of a ``(workers, words)`` array on ``mesh``, made once
        per signature (a transfer per step would cost half as much as the gather); and
        the bytes of the gathered rows where every worker agrees (None: it cannot)."""
        key = (signature, mesh.mesh)
        cached = self._digest_arrays.get(key)
        if cached is not None:
            self._digest_arrays.move_to_end(key)
            return cached
        words = np.zeros((1, _DIGEST_WORDS), dtype=np.int32)
        if signature is not None:
            words[0, 0] = 1
            words[0, 1:] = np.frombuffer(signature[:_SIGNATURE_BYTES], dtype=np.int32)
        blocks = [jax.device_put(words, d) for d in mesh.devices]
        sharding = NamedSharding(mesh.mesh, pspec(WORKERS))
        array = jax.make_array_from_single_device_arrays(
            (self.world_size, _DIGEST_WORDS), sharding, blocks
        )
        agreed = words.tobytes() * self.world_size if signature is not None else None
        entry = self._digest_arrays[key] = (array, agreed)
        while len(self._digest_arrays) > _DIGEST_CACHE:
            self._digest_arrays.popitem(last=False)
        return entry

    def translate(self, what: str, err: BaseException) -> errors.OpError:
        said = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        dead, behind = self.diagnose()
        head = self.collective(what)
        tail = (
            f" JAX said: {said}. The cluster cannot be used any more: stop every worker and "
            "restart them all, from the latest checkpoint."
        )
        pending = self._announced
        # (The failed peer's signature is there: it wrote it before its exit broke this.)
        elsewhere = self._elsewhere(pending, _PEEK_SECONDS) if pending is not None else ""
        if elsewhere and self.checker is not None and self.checker.peer_failed:
            # A peer's error left it out of this compiled step (`ClusterMembership.abandon`),
            # and its exit broke the step's collective: the cause, not the exit.
            return errors.UnavailableError(
                f"{head} failed: {elsewhere}: an error on that worker left the cluster's "
                f"collectives out of step.{tail}"
            )
        if dead:
            return errors.UnavailableError(f"{head} failed: {self.unavailable(dead)}.{tail}")
        cls = (
            errors.DeadlineExceededError if "deadline" in said.lower() else errors.UnavailableError
        )
        if behind:
            return cls(
                f"{head} failed; worker(s) {self.describe(behind)} had not reached it.{tail}"
            )
        return cls(f"{head} failed.{tail}")

    def _late_message(self, what: str, n: int) -> str:
        dead, behind = self.diagnose(n)
        head = (
            f"DeadlineExceededError: {self.collective(what, n)} did not complete within "
            f"{self.timeout:g} s"
        )
        elsewhere = self._elsewhere(self._announced)
        if dead:
            why = self.unavailable(dead)
        elif elsewhere:
            why = elsewhere
        elif behind:
            why = self.behind(behind)
        else:
            why = "every worker looks alive and has reached it"
        return (
            f"{head}: {why}. XLA cannot interrupt a collective, so this process exits with code "
            f"{WATCHDOG_EXIT_CODE}. Restart every worker (from the latest checkpoint), or raise "
            "CommunicationOptions(timeout_seconds=...) if the workers are merely slow."
        )


# --------------------------------------------------------------------------- the backend


def _local_total(values: Sequence[Any], target: jax.Device) -> Any:
    """This worker's replicas' sum on ``target``, in replica order."""
    total = jax.device_put(values[0], target)
    for v in values[1:]:
        total = _add_jit(total, jax.device_put(v, target))
    return total


def _zeros(shape: jax.ShapeDtypeStruct) -> Any:
    """What a step whose workers disagree gives back instead of its outputs (unused)."""
    from jax._src.lax.lax import _convert_element_type

    zeros = jax.lax.full(shape.shape, 0, shape.dtype)
    # Weakly typed like the step's own output: the cond's result keeps its type.
    return _convert_element_type(zeros, shape.dtype, weak_type=bool(shape.weak_type))


def _add(x: Any, y: Any) -> Any:
    return x + y


_add_jit = jax.jit(_add)


class JaxProcessBackend(JaxBackend):
    """The jax backend with ``Capabilities.multi_worker``: one process per worker.

    Until ``connect_cluster`` connects it, it is ``JaxBackend`` for this process's
    devices. Afterwards ``strategy.run`` compiles one program over every worker's
    replicas, and its list collectives also span every worker's process (see the
    module docstring). Device strings of this worker
    (``/job:worker/replica:0/task:<this worker>/device:CPU:k``) name its k-th local
    device of that type. `MultiWorkerMirroredStrategy` creates it.

    Args:
        jit: compile ``strategy.run`` (default); ``False`` runs the replicas eagerly.
        timeout_seconds: for eager runs, how long one replica may run between two
            collectives (as ``JaxBackend``'s).
    """

    def __init__(self, *, jit: bool = True, timeout_seconds: float | None = None) -> None:
        super().__init__(jit=jit, eager_fallback=True, timeout_seconds=timeout_seconds)
        self.capabilities = mp.process_capabilities(self.capabilities)
        self._compiled = CompiledRunner(mesh_of=self._replica_mesh, group=self._process_group)
        self._cluster: _Cluster | None = None
        self._task: tuple[str, int] | None = None
        self._timeout = DEFAULT_TIMEOUT_SECONDS
        self._addresses: list[str] = []

    def __repr__(self) -> str:
        c = self._cluster
        where = f"worker {c.rank} of {c.world_size}" if c is not None else "not connected"
        return f"JaxProcessBackend({where})"

    @property
    def connected(self) -> bool:
        """Whether this process has joined a cluster of several workers."""
        return self._cluster is not None and self._cluster.world_size > 1

    def prepare(self, addresses: Sequence[str], timeout: float) -> None:
        """The workers' addresses (for messages) and the collectives' bound."""
        self._addresses = list(addresses)
        self._timeout = timeout

    def set_jit(self, jit: bool) -> None:
        """Compile ``strategy.run`` (True) or run the replicas eagerly (False)."""
        self.jit = jit
        self.capabilities = dataclasses.replace(
            self.capabilities, execution_model="spmd" if jit else "eager"
        )

    # -- the compiled run's mesh -------------------------------------------------------------
    def _process_group(self) -> _Cluster | None:
        return self._cluster if self.connected else None

    def _replica_mesh(self, devices: tuple[str, ...]) -> _Mesh:
        """This worker's replica devices; once connected, every worker's (worker-major)."""
        local = tuple(self._jax_device(d) for d in devices)
        cluster = self._process_group()
        if cluster is None:
            return _Mesh.of(local)
        by_process: dict[int, list[jax.Device]] = {}
        for d in jax.devices(local[0].platform):
            by_process.setdefault(d.process_index, []).append(d)
        # Worker w's k-th replica is its k-th local device: JAX lists each process's
        # devices in that order everywhere.
        grid = [by_process.get(w, [])[: len(local)] for w in range(cluster.world_size)]
        if grid[cluster.rank] != list(local) or any(len(row) != len(local) for row in grid):
            raise ValueError(
                f"Worker {cluster.rank}'s replica devices {list(devices)} are not the first "
                f"{len(local)} local devices of every JAX process ({grid}); a compiled run "
                "needs the same number of local devices, in JAX's order, on every worker. "
                "Pass the same local_devices=N to every worker's MultiWorkerMirroredStrategy."
            )
        return _Mesh.across_processes(local, grid)

    # -- devices -------------------------------------------------------------------------------
    def _jax_device(self, device: str) -> jax.Device:
        spec = DeviceSpec.parse(device)
        task = (spec.job, spec.task)
        if task != ("localhost", 0) and self._task is not None and task != self._task:
            raise ValueError(
                f"Device {device!r} belongs to another worker; this process is "
                f"/job:{self._task[0]}/task:{self._task[1]} and runs only its own devices."
            )
        platform = _PLATFORMS.get(spec.device_type)
        if platform is None:
            raise ValueError(f"The jax backend cannot place values on {device!r} (CPU/GPU/TPU).")
        try:
            local = jax.local_devices(backend=platform)
        except RuntimeError:
            local = []
        if spec.device_index >= len(local):
            raise ValueError(
                f"Device {device!r} is out of range: this process has {len(local)} "
                f"{spec.device_type} device(s). On CPU pass local_devices=N to "
                "MultiWorkerMirroredStrategy (it sets jax_num_cpu_devices)."
            )
        return local[spec.device_index]

    def validate_devices(self, devices: Sequence[str]) -> None:
        for d in devices:
            self._jax_device(d)

    def device_scope(self, device: str) -> Any:
        return self._scope_on(self._jax_device(device))

    def place(self, value: Any, device: str) -> Any:
        if isinstance(value, jax.core.Tracer):
            return value
        target = self._jax_device(device)
        if isinstance(value, jax.Array) and value.sharding.device_set == {target}:
            return value
        if isinstance(value, np.ndarray):  # a copy, never a view (place_copies_host_arrays)
            return _collectives.host_copy(value, target)
        return jax.device_put(value, target)

    # -- the cluster -------------------------------------------------------------------------
    def cluster_membership(self) -> _Cluster | None:
        """This process's membership in its cluster of several workers, if it joined one
        (`polydist.backend.multiprocess.ClusterMembership`): core fails it when an error
        escapes ``strategy.run`` (``abandon``)."""
        return self._cluster if self.connected else None

    def connect_cluster(
        self, worker_devices: Sequence[Sequence[str]], worker_index: int
    ) -> tuple[int, ...]:
        world = len(worker_devices)
        joined = None if self._cluster is None else (self._cluster.rank, self._cluster.world_size)
        if mp.check_joining(worker_index, world, joined):
            return (worker_index,)
        spec = DeviceSpec.parse(worker_devices[worker_index][0])
        if jax.process_count() != world or jax.process_index() != worker_index:
            raise ValueError(
                f"JAX runs as process {jax.process_index()} of {jax.process_count()}, but the "
                f"cluster makes this process worker {worker_index} of {world}. Create "
                "polydist.MultiWorkerMirroredStrategy(backend='jax') before any other JAX call "
                "(it runs jax.distributed.initialize), or initialize JAX with the same cluster."
            )
        names = mp.worker_task_names(worker_devices)
        self._task = (spec.job, spec.task)
        self._cluster = _Cluster(worker_index, world, self._timeout, names, self._addresses)
        return (worker_index,)

    def local_device_count(self, requested: int | None) -> tuple[str, int] | None:
        """``local_devices=N``: this process's first N devices of JAX's default platform."""
        if requested is None:
            return None
        local = jax.local_devices()
        kind = {"cpu": "CPU", "gpu": "GPU", "cuda": "GPU", "rocm": "GPU", "tpu": "TPU"}.get(
            local[0].platform, "CPU"
        )
        if requested > len(local):
            raise ValueError(
                f"local_devices={requested} asks for {requested} replicas per worker, but this "
                f"JAX process has {len(local)} {kind} device(s). On CPU, create the strategy "
                "before any other JAX call so that it can set jax_num_cpu_devices."
            )
        return kind, requested

    def broadcast_from_chief(self, value: Any, device: str) -> Any:
        array = self.place(value, device)
        if not self.connected:
            return array
        assert self._cluster is not None
        self._cluster.check("broadcast", array)
        return self.place(self._cluster.gather(array)[0], device)

    # -- collectives -----------------------------------------------------------------------
    def reduce_to(self, values: Sequence[Any], destination: str) -> Any:
        if any(is_tracer(v) for v in values):
            return self._traced_sum(values)
        target = self._jax_device(destination)
        total = _local_total(values, target)
        if not self.connected:
            return total if len(values) > 1 else jnp.array(total, copy=True)
        assert self._cluster is not None
        return jax.device_put(self._cluster.psum(total), target)

    def all_reduce(self, values: Sequence[Any], destinations: Sequence[str]) -> list[Any]:
        total = self.reduce_to(values, destinations[0])  # a new array, on destinations[0]
        return [total, *self.broadcast(total, destinations[1:])]

    def batch_all_reduce(
        self, columns: Sequence[Sequence[Any]], destinations: Sequence[str], bytes_per_pack: int
    ) -> list[list[Any]]:
        """`all_reduce` of each column (a nest's arrays, eager): this worker's sums, packed
        per dtype (`pack_by_size`) into one flat array that crosses the workers in one
        checked psum. (A compiled step is one XLA program: its compiler combines.)"""
        if not self.connected or any(is_tracer(v) for column in columns for v in column):
            return [self.all_reduce(column, destinations) for column in columns]
        assert self._cluster is not None
        target = self._jax_device(destinations[0])
        sums = [_local_total(column, target) for column in columns]
        sizes = [s.size * s.dtype.itemsize for s in sums]
        results: list[Any] = [None] * len(columns)
        for pack in pack_by_dtype([s.dtype for s in sums], sizes, bytes_per_pack):
            if len(pack) == 1:
                results[pack[0]] = jax.device_put(self._cluster.psum(sums[pack[0]]), target)
                continue
            shapes = [sums[i].shape for i in pack]
            flat = jnp.concatenate([sums[i].reshape(-1) for i in pack])
            total = self._cluster.psum(flat, parts=shapes)
            ends = list(itertools.accumulate(math.prod(shape) for shape in shapes))
            for i, shape, piece in zip(pack, shapes, jnp.split(total, ends[:-1]), strict=True):
                results[i] = jax.device_put(piece.reshape(shape), target)
        return [[r, *self.broadcast(r, destinations[1:])] for r in results]

    def all_gather(
        self, values: Sequence[Any], axis: int, destinations: Sequence[str]
    ) -> list[Any]:
        if any(is_tracer(v) for v in values):
            return [self._traced_gather(values, axis)] * len(destinations)
        target = self._jax_device(destinations[0])
        local = jnp.concatenate([jax.device_put(v, target) for v in values], axis=axis)
        if self.connected:
            assert self._cluster is not None
            local = jax.device_put(self._gather_across(local, axis % local.ndim), target)
        return self.broadcast(local, destinations)

    # Inside a compiled run (merge_fn's reductions), one replica's program stands for all:
    # the values of this worker's replicas are summed (or concatenated) in the program,
    # then combined across the workers by a collective over the mesh's worker axis.
    def _traced_sum(self, values: Sequence[Any]) -> Any:
        lazy = find_lazy(values)
        if lazy is not None:  # every replica's own value: one psum over all of them
            return psum(lazy.local, replica_axis())
        local = functools.reduce(operator.add, (jnp.asarray(v) for v in values))
        return self._across_workers(local, lambda x: psum(x, WORKERS))

    def _traced_gather(self, values: Sequence[Any], axis: int) -> Any:
        lazy = find_lazy(values)
        if lazy is not None:
            rank = len(lazy.local.shape)
            return jax.lax.all_gather(lazy.local, replica_axis(), axis=axis % rank, tiled=True)
        local = jnp.concatenate([jnp.asarray(v) for v in values], axis=axis)
        return self._across_workers(
            local, lambda x: jax.lax.all_gather(x, WORKERS, axis=axis % x.ndim, tiled=True)
        )

    def _across_workers(self, local: Any, combine: Callable[[Any], Any]) -> Any:
        if WORKERS in replica_axes():
            return combine(local)
        if self.connected:
            raise NotImplementedError(
                "A cross-replica collective of MultiWorkerMirroredStrategy got traced values "
                "outside a compiled strategy.run (inside your own jax.jit or jax.grad), which "
                "cannot reach the other workers' processes. Call strategy.reduce/gather "
                "outside JAX transformations, or inside strategy.run."
            )
        return local

    def _gather_across(self, local: Any, axis: int) -> Any:
        assert self._cluster is not None
        cluster = self._cluster
        cluster.check("all_gather", local, axis)
        rows = np.asarray(cluster.gather(jnp.asarray(mp.shape_row(local.shape))))
        sizes = mp.gathered_sizes(rows.tolist(), local.shape, axis, cluster.rank)
        biggest = max(sizes)
        padded = local
        if local.shape[axis] < biggest:
            widths = [(0, 0)] * local.ndim
            widths[axis] = (0, biggest - local.shape[axis])
            padded = jnp.pad(local, widths)
        stacked = cluster.gather(padded)
        parts = [
            jax.lax.slice_in_dim(stacked[w], 0, size, axis=axis) for w, size in enumerate(sizes)
        ]
        return jnp.concatenate(parts, axis=axis)

    def broadcast(self, value: Any, destinations: Sequence[str]) -> list[Any]:
        if is_tracer(value):
            return [value] * len(destinations)
        copies: list[Any] = []
        for d in destinations:
            target = self._jax_device(d)
            copy = jax.device_put(value, target)
            if copy is value or any(copy is c for c in copies):
                copy = jax.device_put(value, target, may_alias=False)
            copies.append(copy)
        return copies


_shared_backend = mp.once_per_process(JaxProcessBackend)


def _worker_cluster(
    cluster_resolver: ClusterResolver | None, communication_options: CommunicationOptions | None
) -> ClusterToJoin:
    return mp.resolve_cluster(
        cluster_resolver,
        communication_options,
        "POLYDIST_PROCESS_ID",
        "POLYDIST_NUM_PROCESSES",
        os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("POLYDIST_COORDINATOR_ADDRESS"),
        what="polydist launch",
    )


class JaxWorkerProcesses:
    """The jax backend's `polydist.backend.SupportsWorkerProcesses` (entry point
    ``polydist.worker_processes: jax``): ``MultiWorkerMirroredStrategy(backend="jax")``
    runs ``jax.distributed.initialize`` for the cluster and then this process's shared
    `JaxProcessBackend`.

    Pass one as ``backend=`` to choose ``jit``:
    ``pd.MultiWorkerMirroredStrategy(backend=polydist_jax.JaxWorkerProcesses(jit=False))``.

    Args:
        jit: compile ``strategy.run`` into one program over every worker's replicas
            (default); ``False`` runs this worker's replicas eagerly, like
            ``JaxBackend(jit=False)``. Every worker must pass the same value.
    """

    def __init__(self, *, jit: bool = True) -> None:
        if not isinstance(jit, bool):
            raise TypeError(f"jit must be True or False, got {type(jit).__name__} {jit!r}.")
        self.jit = jit

    def __repr__(self) -> str:
        return f"JaxWorkerProcesses(jit={self.jit})"

    def worker_cluster(
        self,
        cluster_resolver: ClusterResolver | None,
        communication_options: CommunicationOptions | None,
    ) -> ClusterToJoin:
        return _worker_cluster(cluster_resolver, communication_options)

    def worker_process_engine(self, cluster: ClusterToJoin, local_devices: int | None) -> Backend:
        spec = cluster.resolver.cluster_spec()
        task_type, task_id = cluster.resolver.task_type, cluster.resolver.task_id
        if spec and task_type is not None and task_id is not None:
            workers = worker_count(spec, task_type)
            if workers > 1:
                initialize(
                    cluster.rendezvous,
                    workers,
                    id_in_cluster(spec, task_type, int(task_id)),
                    local_devices=local_devices,
                    timeout_seconds=cluster.timeout,
                )
        if local_devices is not None and not _backends_started():
            _set_cpu_devices(local_devices)
        backend = _shared_backend()
        backend.prepare(cluster.addresses, cluster.timeout)
        backend.set_jit(self.jit)
        return backend


#: What the ``polydist.worker_processes`` entry point ``jax`` names.
WORKER_PROCESSES = JaxWorkerProcesses()


class MultiWorkerMirroredStrategy(pd.MultiWorkerMirroredStrategy):
    """Deprecated: use ``polydist.MultiWorkerMirroredStrategy(backend="jax")``.

    Kept for one release: it warns (``DeprecationWarning``) and builds that strategy
    with ``backend=JaxWorkerProcesses(jit=jit)``, so a single worker also runs on the
    process engine, as before.

    Args:
        cluster_resolver: the cluster and this worker's task. Default:
            ``TFConfigClusterResolver()`` when ``TF_CONFIG`` names a cluster, else
            ``polydist launch``'s ``POLYDIST_PROCESS_ID``/``POLYDIST_NUM_PROCESSES``
            with ``JAX_COORDINATOR_ADDRESS``, else a single worker.
        communication_options: ``timeout_seconds`` bounds joining and each
            collective (default 60 s; 0: no bound).
        local_devices: replicas per worker (a polydist extension): the first N
            local devices; on CPU it sets ``jax_num_cpu_devices`` to N. Default
            (TF's rule): every GPU of the process, else one CPU replica.
        jit: as `JaxWorkerProcesses`'s.
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        *,
        local_devices: int | None = None,
        jit: bool = True,
    ) -> None:
        warnings.warn(
            "polydist_jax.MultiWorkerMirroredStrategy is deprecated and will be removed in the "
            "next release: use polydist.MultiWorkerMirroredStrategy(backend='jax') (same "
            "arguments; jit=False: backend=polydist_jax.JaxWorkerProcesses(jit=False)).",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(
            cluster_resolver,
            communication_options,
            backend=JaxWorkerProcesses(jit=jit),
            local_devices=local_devices,
        )
