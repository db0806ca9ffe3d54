"""`TPUClusterResolver` for SIMULATED TPU slices and a backend's local TPU.

Mirrors TensorFlow's
``tensorflow/python/distribute/cluster_resolver/tpu/tpu_cluster_resolver.py``
but never contacts Cloud TPU: the ``tpu`` argument names a slice from
`polydist.tpu.SIMULATED_SLICES` (``"v3-8"``, ``"v4-32"``, ``"v5litepod-16"``,
...) or is ``"local"``.

What matches TensorFlow:

* ``tpu=None`` or ``""`` falls back to the ``KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS``
  and then the ``TPU_NAME`` environment variables; with neither set a
  ``ValueError`` asks for a TPU name.
* ``task_type`` defaults to ``job_name`` (``"worker"``) and ``task_id`` to 0.
* For a named TPU, ``cluster_spec()`` is ``{job_name: [one address per
  host]}`` plus ``{coordinator_name: [coordinator_address]}`` when a
  coordinator is configured, and ``master()`` is ``"grpc://"`` + the address of
  (``task_type``, ``task_id``). For ``"local"``, ``cluster_spec()`` is empty
  and ``master()`` is ``""``.
* ``num_accelerators()`` is ``{"TPU": cores_per_host}`` (``"local"``: the
  TPU devices of the one host).
* ``environment`` is ``""`` and ``rpc_layer`` is ``"grpc"`` (for ``"local"``
  too), as TensorFlow sets them outside Google's internal environment.

Simulation choices: each host's address is ``"<slice>-w-<i>:8470"`` (8470 is
the Cloud TPU worker port, TensorFlow's ``_DEFAULT_ENDPOINT_PORT``); ``"local"``
simulates the single-host slice named by the ``POLYDIST_LOCAL_TPU`` environment
variable, default ``"v3-8"``; a coordinator without an address gets
``"127.0.0.1:0"`` (TensorFlow would start a server on a free port);
``get_tpu_system_metadata().topology`` is the slice's `Topology` (TensorFlow
leaves it ``None`` there). ``zone``, ``project``, ``credentials``, ``service``
and ``discovery_url`` are accepted and kept but unused.

``"local"`` on a backend with real devices: a backend that describes its TPU
cores (``local_tpu_system()``, see `polydist.tpu.LocalTPUSystem`: JAX, torch-xla)
replaces the simulated slice. A resolver answers for one backend: the one
given as ``backend=``, else the first of these: the backend of the first
`TPUStrategy` it is passed to, or ``$POLYDIST_BACKEND`` if a question
(``get_tpu_system_metadata``, ``num_accelerators``) comes first. Until then it
answers with the simulator's slice.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from polydist.backend._contract import ENV_VAR, Backend, get_backend, local_tpu_system
from polydist.cluster_resolver._base import ClusterResolver, format_master_url
from polydist.cluster_resolver._cluster_spec import ClusterSpec
from polydist.cluster_resolver._connect import experimental_connect_to_cluster
from polydist.tpu import (
    LocalTPUSystem,
    SliceSpec,
    Topology,
    _system,
    known_slice_names,
    simulated_slice,
)

__all__ = ["LOCAL_TPU_ENV", "TPUClusterResolver", "TPUSystemMetadata", "default_tpu_resolver"]

#: Environment variable naming the slice that ``tpu="local"`` simulates.
LOCAL_TPU_ENV = "POLYDIST_LOCAL_TPU"
_DEFAULT_LOCAL_SLICE = "v3-8"
_TPU_NAME_ENV_VARS = ("KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS", "TPU_NAME")
_ENDPOINT_PORT = 8470
_LOCAL_COORDINATOR_ADDRESS = "127.0.0.1:0"


@dataclasses.dataclass(frozen=True)
class TPUSystemMetadata:
    """Facts about a TPU system (``tf.tpu.experimental.TPUSystemMetadata``).

    Attributes:
      num_cores: TPU devices in the whole system.
      num_hosts: hosts (TPU workers).
      num_of_cores_per_host: TPU devices per host.
      topology: the system's `Topology`.
      devices: names of all devices, sorted by (job, task, device type,
        index): per host ``CPU:0``, ``TPU:0``.. and ``TPU_SYSTEM:0``.
    """

    num_cores: int
    num_hosts: int
    num_of_cores_per_host: int
    topology: Topology | None
    devices: tuple[str, ...]


def _known_names() -> str:
    return ", ".join(known_slice_names())


@dataclasses.dataclass(frozen=True)
class _Binding:
    """Whose local TPU a ``"local"`` resolver describes."""

    backend: str  # the backend's name, for messages
    system: LocalTPUSystem | None  # None: the simulated local slice


def _binding(backend: Backend) -> _Binding:
    return _Binding(backend.name, local_tpu_system(backend))


class TPUClusterResolver(ClusterResolver):
    """Cluster resolver for simulated Cloud TPU slices.

    Args:
      tpu: a simulated slice name (see `polydist.tpu.SIMULATED_SLICES`), or
        ``"local"`` for a TPU attached to this machine. A one-element list is
        accepted, as in TensorFlow. ``None``/``""`` reads the
        ``KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS`` or ``TPU_NAME`` environment variable.
      zone, project, credentials, service, discovery_url: accepted for
        compatibility; unused (there is no Cloud TPU API to call).
      job_name: the TensorFlow job of the TPU hosts (``task_type``).
      coordinator_name: if set, a job of that name with one task (the
        coordinator) is added to the cluster spec.
      coordinator_address: the coordinator's address.
      backend: for ``tpu="local"`` (a polydist extension): the backend (name
        or instance) whose TPU cores this resolver describes. Default: the
        backend of the first `TPUStrategy` it is passed to, or
        ``$POLYDIST_BACKEND`` if the resolver is asked first (until then, the
        simulator's slice). A backend on real devices (JAX, torch-xla)
        reports its own cores; the simulator reports the slice named by
        ``$POLYDIST_LOCAL_TPU``.

    Raises:
      ValueError: if ``tpu`` names no simulated slice (real Cloud TPU names
        and ``grpc://`` addresses cannot be reached from a simulation).
    """

    def __init__(
        self,
        tpu: str | list[str] | None = None,
        zone: str | None = None,
        project: str | None = None,
        job_name: str = "worker",
        coordinator_name: str | None = None,
        coordinator_address: str | None = None,
        credentials: Any = "default",
        service: Any = None,
        discovery_url: str | None = None,
        *,
        backend: str | Backend | None = None,
    ) -> None:
        if backend is not None and not isinstance(backend, str | Backend):
            raise TypeError(
                "backend must be a backend name or a polydist.backend.Backend; got "
                f"{type(backend).__name__}."
            )
        if isinstance(tpu, list):
            if not tpu:
                raise ValueError("At least one TPU must be specified; got an empty list.")
            if len(tpu) != 1:
                raise NotImplementedError(
                    f"Using multiple TPUs in a single session is not yet implemented; got {tpu}."
                )
            tpu = tpu[0]
        if not tpu:
            for env_var in _TPU_NAME_ENV_VARS:
                if os.environ.get(env_var):
                    tpu = os.environ[env_var]
                    break
        if not tpu:
            raise ValueError(
                "Please provide a TPU name to connect to: TPUClusterResolver(tpu=...) got "
                f"{tpu!r} and neither KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS nor TPU_NAME is set. "
                f"polydist simulates these slices: {_known_names()}; or pass tpu='local'."
            )
        if not isinstance(tpu, str):
            raise ValueError(
                f"tpu must be a slice name string such as 'v3-8' or 'local'; got "
                f"{type(tpu).__name__} {tpu!r}."
            )

        self._zone = zone
        self._project = project
        self._credentials = credentials
        self._service = service
        self._discovery_url = discovery_url

        self._is_local = tpu == "local"
        if self._is_local:
            local_name = os.environ.get(LOCAL_TPU_ENV) or _DEFAULT_LOCAL_SLICE
            spec = self._lookup(local_name, f"{LOCAL_TPU_ENV}={local_name!r}")
            if spec.num_hosts != 1:
                raise ValueError(
                    f"tpu='local' simulates a TPU attached to this machine, so its slice must "
                    f"have one host; {LOCAL_TPU_ENV}={local_name!r} has {spec.num_hosts} hosts. "
                    "Set it to a single-host slice such as 'v3-8', 'v4-8' or 'v5e-8'."
                )
            self._tpu = "local"
        else:
            spec = self._lookup(tpu, f"tpu={tpu!r}")
            self._tpu = spec.name
        self._slice = spec

        self.task_type = job_name
        self.task_id = 0
        self.rpc_layer = "grpc"  # TF's, outside Google's internal environment
        self._coordinator_name = coordinator_name
        if coordinator_name and not coordinator_address:
            self._coordinator_address: str | None = _LOCAL_COORDINATOR_ADDRESS
        else:
            self._coordinator_address = coordinator_address
        self._tpu_topology: Topology | None = None
        self._backend_choice = backend
        self._binding: _Binding | None = None

    @staticmethod
    def _lookup(name: str, what: str) -> SliceSpec:
        if name.startswith("grpc://"):
            raise ValueError(
                f"{what} is a TPU worker address; polydist cannot reach real TPUs (there is no "
                f"network access). Use a simulated slice name instead: {_known_names()}."
            )
        try:
            return simulated_slice(name)
        except ValueError:
            raise ValueError(
                f"{what} is not a known simulated TPU slice, and real Cloud TPU names cannot be "
                f"resolved (polydist has no network access to the Cloud TPU API). Known "
                f"simulated slices: {_known_names()}; or pass tpu='local'."
            ) from None

    @classmethod
    def connect(
        cls,
        tpu: str | list[str] | None = None,
        zone: str | None = None,
        project: str | None = None,
    ) -> TPUClusterResolver:
        """Creates a resolver and "initialises" the simulated TPU system.

        As TensorFlow's, it calls ``polydist.config.experimental_connect_to_cluster``
        and then ``polydist.tpu.initialize_tpu_system`` with the new resolver, which
        stores the system's topology in it (see `tpu_topology`).
        """
        resolver = cls(tpu, zone, project)
        experimental_connect_to_cluster(resolver)
        _system.initialize_tpu_system(resolver)
        return resolver

    @property
    def slice_spec(self) -> SliceSpec:
        """The simulated slice behind this resolver.

        Raises:
          ValueError: for ``tpu="local"`` describing a backend's real TPU cores
            (there is no simulated slice; see `get_tpu_system_metadata`).
        """
        if self._local_system() is not None:
            raise ValueError(
                f"{self!r} describes the TPU cores of backend "
                f"{self._bound().backend!r}, not a simulated slice; read them with "
                "get_tpu_system_metadata()."
            )
        return self._slice

    # -- the local TPU of a backend ------------------------------------------------------
    def _bound(self) -> _Binding:
        if self._binding is None:
            choice = self._backend_choice
            if choice is None:
                choice = os.environ.get(ENV_VAR)
            if not choice:
                # No backend named yet: the sim's slice, until a TPUStrategy binds one.
                return _Binding("sim", None)
            self._binding = _binding(get_backend(choice))
        return self._binding

    def _local_system(self) -> LocalTPUSystem | None:
        """The backend's TPU cores behind ``tpu="local"``; None: a simulated slice."""
        return self._bound().system if self._is_local else None

    def _bind(self, backend: Backend) -> LocalTPUSystem | None:
        """Called by `TPUStrategy`: the cores of ``backend`` for ``tpu="local"``.

        A resolver not yet bound to a backend binds to ``backend``.

        Raises:
          ValueError: if the resolver already describes a different TPU system.
        """
        if not self._is_local:
            return None
        wanted = _binding(backend)
        if self._binding is None and self._backend_choice is None:
            self._binding = wanted
            return wanted.system
        current = self._bound()
        if current.system != wanted.system:
            raise ValueError(
                f"This TPUClusterResolver('local') already describes the local TPU of "
                f"{self._text(current)}, but the TPUStrategy runs on {self._text(wanted)}. "
                f"Create the resolver for that backend: TPUClusterResolver('local', "
                f"backend={backend.name!r}) (or set ${ENV_VAR}={backend.name})."
            )
        return current.system

    def _text(self, binding: _Binding) -> str:
        if binding.system is None:
            return f"backend {binding.backend!r}, the simulated slice {self._slice.name!r}"
        return f"backend {binding.backend!r}, {binding.system.num_cores} TPU core(s)"

    def _topology(self) -> Topology:
        system = self._local_system()
        return self._slice.topology() if system is None else system.topology()

    def _generation(self) -> str:
        """The TPU generation (``"v4"``); ``""`` if the backend's cores do not say."""
        system = self._local_system()
        return self._slice.generation if system is None else system.generation

    def _describe(self, num_devices: int) -> str:
        """``"<this TPU> does not have (...)"``, for messages about a missing device."""
        system = self._local_system()
        if system is None:
            return (
                f"slice {self._slice.name!r} does not have (it has {num_devices} TPU devices "
                f"on {self._slice.num_hosts} hosts)"
            )
        return (
            f"the local TPU of backend {self._bound().backend!r} does not have (it has "
            f"{num_devices} TPU cores)"
        )

    def __enter__(self) -> TPUClusterResolver:
        return self

    def __exit__(self, exc_type: object, exc_value: object, traceback: object) -> None:
        return None

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """``"grpc://<address>"`` of the selected task (default: this one); ``""`` if local.

        ``rpc_layer`` is ignored: TPU workers always speak gRPC.
        """
        del rpc_layer
        if self._is_local:
            return ""
        cluster_spec = self.cluster_spec()
        if task_type is not None and task_id is not None:
            master = cluster_spec.task_address(task_type, task_id)
        elif self.task_type is not None and self.task_id is not None:
            master = cluster_spec.task_address(self.task_type, self.task_id)
        else:
            job = self.task_type if self.task_type is not None else "worker"
            tasks = [t for t in cluster_spec.job_tasks(job) if t is not None]
            if not tasks:
                raise ValueError("No TPUs with the specified names exist.")
            master = tasks[0]
        return format_master_url(master, "grpc")

    def get_master(self) -> str:
        """Same as ``master()``."""
        return self.master()

    def get_job_name(self) -> str | None:
        """The TPU hosts' job name (``task_type``)."""
        return self.task_type

    def get_coordination_service_leader(self) -> str:
        """Where the coordination service runs: ``/job:<job>/task:0``."""
        return f"/job:{self.get_job_name()}/task:0"

    def cluster_spec(self) -> ClusterSpec:
        """One task per host of the slice in job ``task_type`` (+ coordinator); empty if local."""
        if self._is_local:
            return ClusterSpec({})
        job = self.task_type if self.task_type is not None else "worker"
        workers = [
            f"{self._slice.name}-w-{i}:{_ENDPOINT_PORT}" for i in range(self._slice.num_hosts)
        ]
        spec: dict[str, list[str]] = {job: workers}
        if self._coordinator_address and self._coordinator_name:
            spec[self._coordinator_name] = [self._coordinator_address]
        return ClusterSpec(spec)

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: Any = None,
    ) -> dict[str, int]:
        """``{"TPU": cores per host}`` (every host of a slice has the same count).

        For ``tpu="local"`` on a backend with real devices: its TPU cores.
        """
        del task_type, task_id, config_proto
        system = self._local_system()
        return {"TPU": self._slice.cores_per_host if system is None else system.num_cores}

    def _device_names(self, cores_per_host: int) -> tuple[str, ...]:
        if self._is_local:
            prefixes = ["/job:localhost/replica:0/task:0"]
        else:
            job = self.task_type if self.task_type is not None else "worker"
            prefixes = [f"/job:{job}/replica:0/task:{t}" for t in range(self._slice.num_hosts)]
        names: list[str] = []
        for prefix in prefixes:
            names.append(f"{prefix}/device:CPU:0")
            names.extend(f"{prefix}/device:TPU:{i}" for i in range(cores_per_host))
            names.append(f"{prefix}/device:TPU_SYSTEM:0")
        return tuple(names)

    def get_tpu_system_metadata(self) -> TPUSystemMetadata:
        """Returns the simulated slice's `TPUSystemMetadata`, or for ``tpu="local"`` on a
        backend with real devices, that of its TPU cores (one host)."""
        system = self._local_system()
        if system is not None:
            return TPUSystemMetadata(
                num_cores=system.num_cores,
                num_hosts=1,
                num_of_cores_per_host=system.num_cores,
                topology=system.topology(),
                devices=self._device_names(system.num_cores),
            )
        return TPUSystemMetadata(
            num_cores=self._slice.num_cores,
            num_hosts=self._slice.num_hosts,
            num_of_cores_per_host=self._slice.cores_per_host,
            topology=self._slice.topology(),
            devices=self._device_names(self._slice.cores_per_host),
        )

    def set_tpu_topology(self, serialized_tpu_topology: bytes | str) -> None:
        """Stores a topology (the output of `Topology.serialized()`)."""
        self._tpu_topology = Topology(serialized=serialized_tpu_topology)

    @property
    def tpu_topology(self) -> Topology | None:
        """The topology stored by `connect` or `set_tpu_topology`, else None."""
        return self._tpu_topology

    @property
    def environment(self) -> str:
        return ""

    def __repr__(self) -> str:
        binding = self._binding if self._is_local else None
        if binding is not None and binding.system is not None:
            return (
                f"TPUClusterResolver(tpu={self._tpu!r}, backend={binding.backend!r}, "
                f"cores={binding.system.num_cores})"
            )
        return f"TPUClusterResolver(tpu={self._tpu!r}, slice={self._slice.name!r})"


def default_tpu_resolver(backend: Backend) -> TPUClusterResolver:
    """The resolver of ``TPUStrategy()`` and ``initialize_tpu_system()`` on ``backend``."""
    # TF's TPUClusterResolver("") reads TPU_NAME & co.; with none set we simulate
    # the TPU "attached to this machine" ($POLYDIST_LOCAL_TPU, default v3-8). A
    # backend on real devices has only its local TPU.
    if local_tpu_system(backend) is None and any(os.environ.get(v) for v in _TPU_NAME_ENV_VARS):
        return TPUClusterResolver()
    return TPUClusterResolver("local")


def _read_tpu_system(cluster_resolver: object, caller: str) -> _system.ResolvedTPUSystem:
    """The TPU system of ``cluster_resolver`` (None: the default one), for polydist.tpu."""
    resolver = default_tpu_resolver(get_backend()) if cluster_resolver is None else cluster_resolver
    if not isinstance(resolver, TPUClusterResolver):
        raise TypeError(
            f"{caller}: cluster_resolver must be a polydist.cluster_resolver.TPUClusterResolver "
            f"(e.g. TPUClusterResolver(tpu='v3-8') or 'local'), or None for the default one; "
            f"got {type(resolver).__name__}."
        )
    return _system.ResolvedTPUSystem(resolver._tpu, resolver._topology(), resolver)


_system.set_resolver_reader(_read_tpu_system)
