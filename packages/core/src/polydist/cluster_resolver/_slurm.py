"""`SlurmClusterResolver`: the cluster of a Slurm job step, from Slurm's environment.

Behaviour follows TensorFlow 2.x's
``tensorflow/python/distribute/cluster_resolver/slurm_cluster_resolver.py``,
which reads the job step's environment variables and expands the node list
itself (no ``scontrol``):

* ``SLURM_PROCID``: this process's rank (always required).
* ``SLURM_STEP_NUM_TASKS``: the number of tasks, when ``jobs`` is not given
  (then ``jobs={"worker": SLURM_STEP_NUM_TASKS}``).
* ``SLURM_STEP_NODELIST``: the step's hosts, a Slurm hostlist such as
  ``node[01-03,07],other[1-2]``; needed unless ``tasks_per_node`` is a dict.
* ``SLURM_STEP_TASKS_PER_NODE``: tasks on each of those hosts, such as
  ``2(x3),1``; needed when ``tasks_per_node`` is None.
* ``CUDA_VISIBLE_DEVICES`` (else ``nvidia-smi --list-gpus``): the GPUs of a
  node, when ``gpus_per_node`` is None.

Hosts are taken in sorted order; the tasks of a host get ports ``port_base``,
``port_base + 1``, ... and consecutive blocks of ``gpus_per_task`` GPUs. The
jobs, sorted by name, take consecutive ranks: with ``jobs={"ps": 1,
"worker": 2}`` rank 0 is ``ps`` task 0 and rank 2 is ``worker`` task 1.
``task_type`` and ``task_id`` are None until `cluster_spec` has run (it sets
them, and with ``auto_set_gpu`` sets ``CUDA_VISIBLE_DEVICES`` to this task's
GPUs), as in TensorFlow.

Where polydist differs (each a case TensorFlow gets wrong or fails on):

* Zero-padded ranges keep their width, as Slurm writes the names:
  ``n[009-011]`` is ``n009, n010, n011`` (TensorFlow gives ``n9, n10, n11``,
  tensorflow/tensorflow#49956). A range whose end is below its start raises
  ``ValueError`` (TensorFlow silently yields no hosts).
* ``CUDA_VISIBLE_DEVICES=""`` counts as no GPUs (TensorFlow counts one).
  Without ``CUDA_VISIBLE_DEVICES`` and without ``nvidia-smi``, the GPUs
  listed in ``SLURM_STEP_GPUS`` are counted; with none of the three a
  ``RuntimeError`` asks for ``gpus_per_node`` (TensorFlow raises
  ``FileNotFoundError`` from ``subprocess``).
* ``gpus_per_task=0`` (CPU-only nodes, or more tasks than GPUs with
  ``gpus_per_task`` left to default) works: every task gets no GPU and
  ``CUDA_VISIBLE_DEVICES=""`` (TensorFlow's ``cluster_spec`` fails with
  ``range() arg 3 must not be zero``).
* A rank outside ``[0, number of tasks)``, or a node list and tasks-per-node
  list of different lengths, raise ``RuntimeError`` in the constructor.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator, Mapping
from typing import Any

from polydist.cluster_resolver._base import ClusterResolver, task_master
from polydist.cluster_resolver._cluster_spec import ClusterSpec

__all__ = [
    "SlurmClusterResolver",
    "expand_hostlist",
    "expand_tasks_per_node",
    "get_num_gpus",
]

_HOST_PART = re.compile(r"([^,\[\]]*)(?:\[([^\]]+)\])?")
_TASKS_PART = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def _split_hostlist(hostlist: str) -> Iterator[str]:
    """Splits at the commas outside ``[...]``."""
    depth = 0
    start = 0
    for i, char in enumerate(hostlist):
        if char == "[":
            if depth:
                raise ValueError("nested '['")
            depth = 1
        elif char == "]":
            if not depth:
                raise ValueError("']' without '['")
            depth = 0
        elif char == "," and not depth:
            if i == start:
                raise ValueError("empty host name")
            yield hostlist[start:i]
            start = i + 1
    if depth:
        raise ValueError("unclosed '['")
    if start < len(hostlist):
        yield hostlist[start:]
    elif hostlist:
        raise ValueError("empty host name")


def _expand_ranges(ranges: str) -> Iterator[str]:
    """``"01-03,7"`` -> ``"01", "02", "03", "7"`` (each number as wide as its range start)."""
    for part in ranges.split(","):
        bounds = part.split("-")
        if len(bounds) == 1:
            bounds *= 2
        if len(bounds) != 2 or not all(b.isdigit() for b in bounds):
            raise ValueError(f"invalid range {part!r}")
        low, high = int(bounds[0]), int(bounds[1])
        if high < low:
            raise ValueError(f"range {part!r} ends before it starts")
        width = len(bounds[0])
        for number in range(low, high + 1):
            yield str(number).zfill(width)


def expand_hostlist(hostlist: str) -> list[str]:
    """Expands a Slurm hostlist, in order and without removing duplicates.

    ``"n[1-2],m5,o[3-4,6,7-9]"`` -> ``["n1", "n2", "m5", "o3", "o4", "o6", "o7",
    "o8", "o9"]``; zero-padded numbers keep their width (``"n[08-10]"`` ->
    ``["n08", "n09", "n10"]``).

    Raises:
      ValueError: ``Invalid hostlist format "<hostlist>": <reason>``.
    """
    hosts: list[str] = []
    try:
        for part in _split_hostlist(hostlist):
            match = _HOST_PART.fullmatch(part)
            if match is None:
                raise ValueError(f"invalid part {part!r}")
            prefix, ranges = match.group(1), match.group(2)
            if ranges is None:
                hosts.append(prefix)
            else:
                hosts.extend(prefix + number for number in _expand_ranges(ranges))
    except ValueError as err:
        raise ValueError(f'Invalid hostlist format "{hostlist}": {err}') from None
    return hosts


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """Expands Slurm's tasks-per-node list: ``"3(x2),2,1"`` -> ``[3, 3, 2, 1]``.

    Raises:
      ValueError: ``Invalid tasks-per-node list format "<value>": <reason>``.
    """
    result: list[int] = []
    for part in tasks_per_node.split(","):
        match = _TASKS_PART.fullmatch(part)
        if match is None:
            raise ValueError(
                f'Invalid tasks-per-node list format "{tasks_per_node}": invalid part {part!r}'
            )
        result.extend([int(match.group(1))] * int(match.group(2) or 1))
    return result


def _get_slurm_var(name: str) -> str:
    """``$SLURM_<name>``; RuntimeError (as TensorFlow's) when it is not set."""
    key = "SLURM_" + name
    try:
        return os.environ[key]
    except KeyError:
        raise RuntimeError(
            f"{key} not found in environment. Not running inside a SLURM step?"
        ) from None


def _count_devices(value: str) -> int:
    return len([d for d in value.split(",") if d.strip()])


def _nvidia_smi_list_gpus() -> str | None:
    """The output of ``nvidia-smi --list-gpus``; None if there is no ``nvidia-smi``."""
    try:
        return subprocess.check_output(["nvidia-smi", "--list-gpus"], encoding="utf-8")
    except FileNotFoundError:
        return None
    except subprocess.CalledProcessError as err:
        raise RuntimeError(
            "Could not get number of GPUs from nvidia-smi. Maybe it is missing?\n"
            f"Output: {err.output}"
        ) from err


def get_num_gpus() -> int:
    """The number of (NVIDIA) GPUs visible on this node.

    Counts ``CUDA_VISIBLE_DEVICES`` when it is set, else the ``GPU ...`` lines
    of ``nvidia-smi --list-gpus``, else (no ``nvidia-smi``) ``SLURM_STEP_GPUS``.

    Raises:
      RuntimeError: if ``nvidia-smi`` fails, or none of the three is available.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return _count_devices(visible)
    output = _nvidia_smi_list_gpus()
    if output is not None:
        return sum(line.startswith("GPU ") for line in output.strip().split("\n"))
    step_gpus = os.environ.get("SLURM_STEP_GPUS")
    if step_gpus is not None:
        return _count_devices(step_gpus)
    raise RuntimeError(
        "Could not get number of GPUs: CUDA_VISIBLE_DEVICES and SLURM_STEP_GPUS are not set "
        "and nvidia-smi is missing. Pass gpus_per_node= to SlurmClusterResolver (0 for "
        "CPU-only nodes)."
    )


class SlurmClusterResolver(ClusterResolver):
    """ClusterResolver for a system with the Slurm workload manager.

    Every argument left at None is read from the Slurm job step's environment
    (see the module docs).

    Args:
      jobs: ``{job name: number of tasks}``. Default: ``{"worker":
        SLURM_STEP_NUM_TASKS}``.
      port_base: the port of the first task on each node; further tasks on
        the node count up from it.
      gpus_per_node: GPUs on each node. Default: counted (`get_num_gpus`).
      gpus_per_task: GPUs for each task. Default: ``gpus_per_node`` divided
        evenly (rounded down) among the most tasks any node runs.
      tasks_per_node: tasks on each node: an int for every node of
        ``SLURM_STEP_NODELIST``, or a dict ``{hostname: tasks}``. Default:
        ``SLURM_STEP_NODELIST`` with ``SLURM_STEP_TASKS_PER_NODE``.
      auto_set_gpu: whether `cluster_spec` sets ``CUDA_VISIBLE_DEVICES`` to
        this task's GPUs.
      rpc_layer: the protocol between tasks, prefixed by `master`.

    Raises:
      RuntimeError: if a needed Slurm variable is missing, the tasks need more
        GPUs per node than there are (``"Requested more GPUs per node then
        available."``, TensorFlow's wording), or ``jobs`` asks for a number of
        tasks other than the step has (``"Requested N tasks but only M were
        assigned."``).
      ValueError: if the node list or tasks-per-node list is malformed.
    """

    def __init__(
        self,
        jobs: Mapping[str, int] | None = None,
        port_base: int = 8888,
        gpus_per_node: int | None = None,
        gpus_per_task: int | None = None,
        tasks_per_node: int | Mapping[str, int] | None = None,
        auto_set_gpu: bool = True,
        rpc_layer: str | None = "grpc",
    ) -> None:
        self._rank = self._resolve_own_rank()
        if jobs is None:
            jobs = {"worker": self._resolve_num_tasks()}
        self._jobs: dict[str, int] = {str(k): int(v) for k, v in jobs.items()}
        self._port_base = int(port_base)

        if tasks_per_node is None:
            configuration = self._resolve_task_configuration()
        elif isinstance(tasks_per_node, Mapping):
            configuration = {str(host): int(n) for host, n in tasks_per_node.items()}
        else:
            configuration = {host: int(tasks_per_node) for host in self._resolve_hostlist()}
        if not configuration:
            raise RuntimeError("The Slurm job step has no nodes (empty tasks_per_node).")
        self._task_configuration = configuration

        max_tasks_per_node = max(configuration.values())
        num_tasks = sum(configuration.values())
        if gpus_per_node is None:
            gpus_per_node = get_num_gpus()
        if gpus_per_task is None:
            gpus_per_task = gpus_per_node // max_tasks_per_node if max_tasks_per_node else 0
        self._gpus_per_node = int(gpus_per_node)
        self._gpus_per_task = int(gpus_per_task)

        self._auto_set_gpu = auto_set_gpu
        self.task_type = None
        self.task_id = None
        self.rpc_layer = rpc_layer
        self._gpu_allocation: list[str] = []
        self._cluster_allocation: dict[str, list[str]] = {}

        if max_tasks_per_node * self._gpus_per_task > self._gpus_per_node:
            raise RuntimeError(
                "Requested more GPUs per node then available. "
                f"({max_tasks_per_node} tasks on a node x gpus_per_task={self._gpus_per_task} "
                f"> gpus_per_node={self._gpus_per_node})"
            )
        requested = sum(self._jobs.values())
        if requested != num_tasks:
            raise RuntimeError(f"Requested {requested} tasks but only {num_tasks} were assigned.")
        if not 0 <= self._rank < num_tasks:
            raise RuntimeError(
                f"SLURM_PROCID={self._rank} is not a task of this job step, which has "
                f"{num_tasks} tasks (ranks 0..{num_tasks - 1})."
            )

    # The environment lookups, one method each (TensorFlow's names), so tests can patch them.
    def _resolve_own_rank(self) -> int:
        """This task's rank in ``[0, number of tasks)``: ``SLURM_PROCID``."""
        return int(_get_slurm_var("PROCID"))

    def _resolve_num_tasks(self) -> int:
        """The number of tasks of the job step: ``SLURM_STEP_NUM_TASKS``."""
        return int(_get_slurm_var("STEP_NUM_TASKS"))

    def _resolve_hostlist(self) -> list[str]:
        """The job step's hosts: ``SLURM_STEP_NODELIST``, expanded."""
        return expand_hostlist(_get_slurm_var("STEP_NODELIST"))

    def _resolve_task_configuration(self) -> dict[str, int]:
        """``{hostname: number of tasks}`` from the job step's environment."""
        hosts = self._resolve_hostlist()
        raw = _get_slurm_var("STEP_TASKS_PER_NODE")
        counts = expand_tasks_per_node(raw)
        if len(hosts) != len(counts):
            raise RuntimeError(
                f"SLURM_STEP_NODELIST lists {len(hosts)} nodes but SLURM_STEP_TASKS_PER_NODE="
                f"{raw!r} gives task counts for {len(counts)}."
            )
        return dict(zip(hosts, counts, strict=True))

    def cluster_spec(self) -> ClusterSpec:
        """Returns the cluster of the job step; sets `task_type` and `task_id`.

        Resolved again on every call. With ``auto_set_gpu``, also sets
        ``CUDA_VISIBLE_DEVICES`` to this task's GPUs (``"2,3"``; ``""`` for none).
        """
        task_list: list[str] = []
        gpu_allocation: list[str] = []
        per_task = self._gpus_per_task
        for host, num_tasks in sorted(self._task_configuration.items()):
            for offset in range(num_tasks):
                task_list.append(f"{host}:{self._port_base + offset}")
                first = offset * per_task
                gpu_allocation.append(",".join(str(g) for g in range(first, first + per_task)))

        allocation: dict[str, list[str]] = {}
        start = 0
        for task_type, num_tasks in sorted(self._jobs.items()):
            end = start + num_tasks
            allocation[task_type] = task_list[start:end]
            if start <= self._rank < end:
                self.task_type = task_type
                self.task_id = self._rank - start
            start = end

        self._gpu_allocation = gpu_allocation
        self._cluster_allocation = allocation
        if self._auto_set_gpu:
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu_allocation[self._rank]
        return ClusterSpec(allocation)

    def get_task_info(self) -> tuple[str | None, int | None]:
        """``(task_type, task_id)`` of this process; ``(None, None)`` before `cluster_spec`."""
        return self.task_type, self.task_id

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """``"<rpc_layer>://host:port"`` of a task (default: this one); ``""`` if unknown.

        ``task_type`` and ``task_id`` default to this task's, which are only
        known after `cluster_spec` has run.
        """
        return task_master(self, task_type, task_id, rpc_layer)

    @property
    def environment(self) -> str:
        """Always ``""``."""
        return ""

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: Any = None,
    ) -> dict[str, int]:
        """``{"GPU": gpus_per_task}``: every task has the same GPUs."""
        del task_type, task_id, config_proto
        return {"GPU": self._gpus_per_task}
