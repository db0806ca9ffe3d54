"""``polydist launch``: N local worker processes of one script, each told its place in the cluster.

Every worker ``i`` of ``N`` runs ``python SCRIPT ARGS...`` with

* ``TF_CONFIG`` = ``{"cluster": {"worker": ["127.0.0.1:p0", ..., "127.0.0.1:pN-1"]},
  "task": {"type": "worker", "index": i}}`` (what ``MultiWorkerMirroredStrategy``
  reads through ``TFConfigClusterResolver``);
* torch's variables, as ``torchrun`` sets them: ``RANK=i``, ``WORLD_SIZE=N``,
  ``LOCAL_RANK=i``, ``LOCAL_WORLD_SIZE=N``, ``MASTER_ADDR=127.0.0.1``,
  ``MASTER_PORT=p0``;
* JAX's: ``JAX_COORDINATOR_ADDRESS=127.0.0.1:p0`` (read by
  ``jax.distributed.initialize`` itself) and polydist's own
  ``POLYDIST_COORDINATOR_ADDRESS``, ``POLYDIST_NUM_PROCESSES=N`` and
  ``POLYDIST_PROCESS_ID=i`` (JAX has no variables for the last two);
* ``POLYDIST_BACKEND`` when ``--backend`` is given, and ``PYTHONUNBUFFERED=1``
  so that output streams as it is printed;
* with ``--gpus-per-worker G``, ``CUDA_VISIBLE_DEVICES``: worker ``i`` sees GPUs
  ``i*G`` .. ``i*G+G-1`` (of the launcher's own ``CUDA_VISIBLE_DEVICES`` list when
  it has one), so that workers on one machine never share a GPU (NCCL refuses
  that) and each names its GPUs from 0.

Worker 0's port ``p0`` is the cluster's rendezvous (torch's store, JAX's
coordinator service). Ports are free ports of this machine found by binding
port 0 (or ``P, P+1, ...`` with ``--port P``).

Each line a worker writes to stdout (stderr) appears on the launcher's stdout
(stderr) prefixed with ``[worker i]``. Each worker runs in a process group of
its own (a new session). When a worker exits with a non-zero code, or the
``--timeout`` expires, or the launcher gets SIGINT, SIGTERM, SIGHUP (its
terminal or ssh session closed) or SIGQUIT, every worker's process group gets
SIGTERM, and SIGKILL after ``--grace`` seconds; then the launcher exits
non-zero and names the worker that failed. A launcher killed with SIGKILL
cannot stop anything: its workers then run on (stop them by their process
group, ``kill -- -PID``).

Exit codes: 0 every worker exited 0; the first failed worker's code (128+N
for a worker killed by signal N); 124 the timeout expired; 128+N the
launcher was stopped by signal N (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP); 2 bad
usage.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Any

__all__ = [
    "DEFAULT_GRACE_SECONDS",
    "LaunchResult",
    "free_ports",
    "launch",
    "worker_environment",
]

#: Seconds between SIGTERM and SIGKILL when the launcher stops its workers.
DEFAULT_GRACE_SECONDS = 5.0
#: Exit code when ``--timeout`` expires (as GNU ``timeout`` uses).
TIMEOUT_EXIT_CODE = 124
HOST = "127.0.0.1"
_POLL_SECONDS = 0.05
# How long to wait for the output of stopped workers to drain (a grandchild that
# escaped the process group could keep a pipe open forever).
_DRAIN_SECONDS = 2.0


def free_ports(count: int, host: str = HOST) -> list[int]:
    """``count`` distinct ports of ``host`` that were free a moment ago (bound to port 0).

    The sockets are held until all are chosen, so the ports differ; another
    process could still take one before the worker binds it.
    """
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def worker_environment(
    index: int,
    ports: Sequence[int],
    *,
    backend: str | None = None,
    host: str = HOST,
    base: Mapping[str, str] | None = None,
    gpus_per_worker: int | None = None,
) -> dict[str, str]:
    """The environment of worker ``index`` of a cluster whose workers listen on ``ports``."""
    n = len(ports)
    if not 0 <= index < n:
        raise ValueError(f"worker index {index} is out of range for {n} workers (0..{n - 1}).")
    env = dict(os.environ if base is None else base)
    if gpus_per_worker is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(
            _worker_gpus(env.get("CUDA_VISIBLE_DEVICES"), n, gpus_per_worker)[index]
        )
    addresses = [f"{host}:{p}" for p in ports]
    coordinator = addresses[0]
    env.update(
        {
            "TF_CONFIG": json.dumps(
                {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}
            ),
            # torch (torchrun's names)
            "RANK": str(index),
            "WORLD_SIZE": str(n),
            "LOCAL_RANK": str(index),
            "LOCAL_WORLD_SIZE": str(n),
            "MASTER_ADDR": host,
            "MASTER_PORT": str(ports[0]),
            # JAX (jax.distributed.initialize reads JAX_COORDINATOR_ADDRESS itself)
            "JAX_COORDINATOR_ADDRESS": coordinator,
            "POLYDIST_COORDINATOR_ADDRESS": coordinator,
            "POLYDIST_NUM_PROCESSES": str(n),
            "POLYDIST_PROCESS_ID": str(index),
            "PYTHONUNBUFFERED": "1",
        }
    )
    # A torchrun agent's store is not there: a worker must not look for one.
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if backend:
        env["POLYDIST_BACKEND"] = backend
    return env


#: File descriptors the launcher holds per worker: the read ends of its stdout and
#: stderr pipes (a free-port socket per worker is closed before any worker starts).
FDS_PER_WORKER = 2
# Starting one worker opens a few more for a moment (Popen's pipes and its error pipe).
_FD_HEADROOM = 16


def _open_fd_count() -> int:
    """File descriptors this process has open now (an estimate where /proc is missing)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return len(os.listdir(folder))
    return 3


def _check_open_file_limit(num_workers: int) -> None:
    """Raises ``ValueError`` if ``num_workers`` workers' pipes need more file descriptors
    than ``RLIMIT_NOFILE`` allows, before anything starts (else the launch fails midway
    with "Too many open files")."""
    try:
        import resource
    except ImportError:  # not POSIX: no such limit to check
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    in_use = _open_fd_count()
    needed = num_workers * FDS_PER_WORKER + _FD_HEADROOM
    if in_use + needed <= soft:
        return
    most = max(0, (soft - in_use - _FD_HEADROOM) // FDS_PER_WORKER)
    raise ValueError(
        f"-n {num_workers} workers need about {needed} open files in the launcher "
        f"({FDS_PER_WORKER} pipes per worker for its output, plus {_FD_HEADROOM} to start "
        f"them), but the open-file limit (ulimit -n, RLIMIT_NOFILE) is {soft} with {in_use} "
        f"already open. Start at most {most} workers, or raise the limit first "
        f"(ulimit -n {in_use + needed}"
        + ("" if hard == resource.RLIM_INFINITY else f"; the hard limit is {hard}")
        + ")."
    )


def _worker_gpus(listed: str | None, workers: int, per_worker: int) -> list[list[str]]:
    """Each worker's GPUs: consecutive groups of ``per_worker`` of the ``listed`` ones
    (``CUDA_VISIBLE_DEVICES``), or of GPUs 0, 1, ... when there is no list."""
    if isinstance(per_worker, bool) or not isinstance(per_worker, int) or per_worker < 1:
        raise ValueError(f"gpus_per_worker must be a positive integer, got {per_worker!r}.")
    needed = workers * per_worker
    if listed:
        gpus = [g.strip() for g in listed.split(",") if g.strip()]
        if len(gpus) < needed:
            raise ValueError(
                f"{workers} workers x {per_worker} GPU(s) need {needed} GPUs, but "
                f"CUDA_VISIBLE_DEVICES lists {len(gpus)} ({listed!r}). Start fewer workers, "
                "give each fewer GPUs, or list more."
            )
    else:
        gpus = [str(i) for i in range(needed)]
    return [gpus[w * per_worker : (w + 1) * per_worker] for w in range(workers)]


@dataclass
class LaunchResult:
    """What happened to a launch: the exit code and why."""

    exit_code: int
    #: Each worker's exit code (``None``: it was still running when stopped, then killed).
    worker_codes: list[int | None] = field(default_factory=list)
    #: The worker whose failure stopped the others (``None``: success, timeout or interrupt).
    failed_worker: int | None = None
    timed_out: bool = False
    interrupted_by: int | None = None
    message: str = ""


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Output:
    """Copies a worker's lines to the launcher's stream with a ``[worker i]`` prefix."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._threads: list[threading.Thread] = []

    def follow(self, pipe: IO[bytes], prefix: str, sink: IO[str]) -> None:
        thread = threading.Thread(
            target=self._copy, args=(pipe, prefix, sink), name=f"polydist-launch {prefix}"
        )
        thread.daemon = True
        thread.start()
        self._threads.append(thread)

    def _copy(self, pipe: IO[bytes], prefix: str, sink: IO[str]) -> None:
        with contextlib.suppress(OSError, ValueError):
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                with self._lock, contextlib.suppress(OSError, ValueError):
                    sink.write(f"{prefix} {line}\n")
                    sink.flush()
        with contextlib.suppress(OSError):
            pipe.close()

    def drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


# What stops the launcher, and so every worker: Ctrl-C, kill, a closed terminal or
# ssh session (SIGHUP), Ctrl-\\ (SIGQUIT).
_STOP_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
    if hasattr(signal, name)
)


class _Interruptions:
    """Turns `_STOP_SIGNALS` into `_Interrupted` while the launcher waits (main thread
    only); inside `deferred`, the signal is held and raised at its end, so that a worker
    started is always recorded (and so stopped)."""

    def __init__(self) -> None:
        self._deferring = False
        self._pending: int | None = None

    def active(self) -> contextlib.AbstractContextManager[None]:
        return _stop_signals_handled_by(self._handler)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._pending is not None:
            raise _Interrupted(self._pending)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self._deferring:
            self._pending = signum
            return
        raise _Interrupted(signum)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    # The worker leads its own session, so its pgid is its pid; the group may outlive it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _stop_all(procs: Sequence[subprocess.Popen[bytes]], grace: float) -> list[int]:
    """SIGTERM to every worker's group, SIGKILL to those still running after ``grace`` s.

    Returns the workers that were still running and got SIGTERM.
    """
    running = [i for i, p in enumerate(procs) if p.poll() is None]
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(_POLL_SECONDS)
    for p in procs:
        # Also the groups of workers that exited: their children may still run.
        _signal_group(p, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=grace)
    return running


def _describe_code(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def _exit_code_of(code: int) -> int:
    return 128 - code if code < 0 else code


def launch(
    num_workers: int,
    script: str,
    script_args: Sequence[str] = (),
    *,
    backend: str | None = None,
    port: int | None = None,
    timeout: float | None = None,
    grace: float = DEFAULT_GRACE_SECONDS,
    python: str | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    env: Mapping[str, str] | None = None,
    gpus_per_worker: int | None = None,
) -> LaunchResult:
    """Runs ``num_workers`` copies of ``script`` as the workers of a local cluster.

    See the module docstring for the environment each worker gets and how
    failures stop the others. Returns when every worker has exited (or has
    been stopped); the result's ``exit_code`` is what ``polydist launch``
    exits with, and its ``message`` says what happened.

    Raises:
        ValueError: ``num_workers < 1`` or more workers than the open-file limit
            (``RLIMIT_NOFILE``) allows pipes for, a port out of range, too few GPUs listed in
            ``CUDA_VISIBLE_DEVICES`` for ``gpus_per_worker``, or a negative
            ``timeout``/``grace``.
        FileNotFoundError: ``script`` does not exist.
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}.")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}.")
    if not grace >= 0:
        raise ValueError(f"grace must be >= 0 seconds, got {grace!r}.")
    if port is not None and not (port > 0 and port + num_workers - 1 <= 65535):
        raise ValueError(
            f"port {port} leaves no room for {num_workers} workers (ports {port}.."
            f"{port + num_workers - 1} must lie in 1..65535); pick a lower port or omit it "
            "to use free ports."
        )
    _check_open_file_limit(num_workers)
    if gpus_per_worker is not None:  # checked before any worker starts
        base_env = os.environ if env is None else env
        _worker_gpus(base_env.get("CUDA_VISIBLE_DEVICES"), num_workers, gpus_per_worker)
    if not os.path.isfile(script):
        raise FileNotFoundError(
            f"no such script: {script!r} (the working directory is {os.getcwd()}). Pass the "
            "path of a Python file: polydist launch -n 2 train.py [ARGS...]."
        )
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    ports = [port + i for i in range(num_workers)] if port is not None else free_ports(num_workers)
    command = [python or sys.executable, script, *script_args]
    lock = threading.Lock()
    output = _Output(lock)
    procs: list[subprocess.Popen[bytes]] = []
    result = LaunchResult(exit_code=0)
    # Workers in the order they exited, each seen by a thread of its own: a worker whose
    # peer died fails moments later, often within one poll, and the failure is the
    # first one's (`failed_worker`).
    exited: list[int] = []

    def reap(i: int, proc: subprocess.Popen[bytes]) -> None:
        proc.wait()
        with lock:
            exited.append(i)

    def note(text: str) -> None:
        with lock:
            err.write(f"polydist launch: {text}\n")
            err.flush()

    interruptions = _Interruptions()
    with interruptions.active():
        try:
            for i in range(num_workers):
                with interruptions.deferred():
                    proc = subprocess.Popen(
                        command,
                        env=worker_environment(
                            i, ports, backend=backend, base=env, gpus_per_worker=gpus_per_worker
                        ),
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        start_new_session=True,
                    )
                    procs.append(proc)
                threading.Thread(
                    target=reap, args=(i, proc), name=f"polydist-launch-reap-{i}", daemon=True
                ).start()
                assert proc.stdout is not None
                assert proc.stderr is not None
                output.follow(proc.stdout, f"[worker {i}]", out)
                output.follow(proc.stderr, f"[worker {i}]", err)
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                with lock:
                    order = list(exited)
                codes = [p.returncode if i in order else None for i, p in enumerate(procs)]
                failed = next((i for i in order if codes[i] != 0), None)
                if failed is not None:
                    code = codes[failed]
                    assert code is not None
                    result.failed_worker = failed
                    result.exit_code = _exit_code_of(code)
                    result.message = (
                        f"worker {failed} (pid {procs[failed].pid}) {_describe_code(code)}"
                    )
                    break
                if all(c == 0 for c in codes):
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    result.timed_out = True
                    result.exit_code = TIMEOUT_EXIT_CODE
                    pending = [i for i, c in enumerate(codes) if c is None]
                    result.message = (
                        f"timed out after {timeout:g} s with worker(s) "
                        f"{', '.join(map(str, pending))} still running"
                    )
                    break
                time.sleep(_POLL_SECONDS)
        except _Interrupted as e:
            result.interrupted_by = e.signum
            result.exit_code = 128 + e.signum
            result.message = f"interrupted by {signal.Signals(e.signum).name}"
        except BaseException:
            _stop_all(procs, grace)
            raise
        finally:
            # Every worker's group is signalled, whatever happened (also on success:
            # a worker's own children must not outlive the launch).
            with _stop_signals_handled_by(signal.SIG_IGN):  # while stopping the workers
                stopped = _stop_all(procs, grace) if procs else []
    output.drain(_DRAIN_SECONDS)
    result.worker_codes = [p.returncode if i not in stopped else None for i, p in enumerate(procs)]
    if result.exit_code != 0:
        if stopped:
            result.message += f"; stopped worker(s) {', '.join(map(str, stopped))}"
        note(result.message)
    return result


@contextlib.contextmanager
def _stop_signals_handled_by(handler: Any) -> Iterator[None]:
    """`_STOP_SIGNALS` go to ``handler`` (a function, or ``signal.SIG_IGN``) inside; main
    thread only (elsewhere Python cannot set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in _STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def main(args: Any) -> int:
    """The handler of ``polydist launch`` (``args`` from its argparse parser)."""
    script: str | None = args.script
    rest = list(args.script_args)
    if args.passthrough_args:
        if script is None:
            script, rest = args.passthrough_args[0], list(args.passthrough_args[1:])
        else:
            rest += ["--", *args.passthrough_args]
    if script is None:
        args.parser.error("the following arguments are required: SCRIPT")  # exits
        raise AssertionError("unreachable")
    result = launch(
        args.num_workers,
        script,
        rest,
        backend=args.backend,
        port=args.port,
        timeout=args.timeout,
        grace=args.grace,
        gpus_per_worker=args.gpus_per_worker,
    )
    return result.exit_code
