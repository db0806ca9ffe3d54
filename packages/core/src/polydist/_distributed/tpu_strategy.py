"""``TPUStrategy`` (TF 2's ``TPUStrategyV2``) on simulated TPU slices and real backends.

The slice comes from a `polydist.cluster_resolver.TPUClusterResolver`
(``TPUClusterResolver(tpu="v3-8")``, ``"v4-32"``, ... or ``"local"``). One
replica runs per TPU device, in the order of the device assignment: without
one, host by host and device by device; with
``experimental_device_assignment=DeviceAssignment.build(...)``, replica ``r``
runs on ``device_assignment.tpu_device(r, logical_core=0)``, the core at
physical coordinates ``core_assignment[r][0]``.

On a backend with real devices (one with ``local_tpu_system()``: JAX,
torch-xla) the slice is ``TPUClusterResolver("local")``: the backend's own TPU
cores, or where it has none, its devices standing in for them
(`polydist.tpu.LocalTPUSystem`). Named slices run on the sim only.

TPUStrategy is a single-client strategy: this process drives every host of
the slice, so ``experimental_local_results`` has all replicas. On the sim the
hosts are simulated in this process (see `polydist._distributed.cluster`).

Differences from TensorFlow, all deliberate:

* ``run`` works eagerly. TF raises ``NotImplementedError`` unless the function
  is a ``tf.function``; on the sim there is nothing to compile.
* No ``initialize_tpu_system`` / ``connect_to_cluster`` is needed first. After
  ``shutdown_tpu_system``, ``run`` raises ``FailedPreconditionError`` until the
  system is initialized again, as TF's TPU runtime does.
* Model-parallel annotations (``experimental_assign_to_logical_device`` and
  friends) validate their arguments exactly as TF does and return the very
  same array. They do not move data: the sim records the annotation on a side
  table, read with ``strategy.extended.logical_device_annotation(array)``.
* TPU rules the sim enforces: ``gather`` and ``all_gather`` need the same
  shape on every replica (other strategies allow uneven sizes along the
  axis), and ``extended.experimental_require_static_shapes`` is True.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from polydist._base.devices import DeviceSpec, canonicalize
from polydist._base.reduce_op import ReduceOp
from polydist._distributed.cluster import InReplicaContext, connect_cluster
from polydist._strategies import context as _context
from polydist._strategies.replica_context import ReplicaContext
from polydist._strategies.strategy import Strategy, StrategyExtended
from polydist._valuetypes import nest as _nest
from polydist._valuetypes import variables as _variables
from polydist.backend._contract import Backend, ReplicaChannel, get_backend, local_tpu_system
from polydist.cluster_resolver import TPUClusterResolver
from polydist.cluster_resolver._tpu import default_tpu_resolver
from polydist.errors import FailedPreconditionError, InvalidArgumentError
from polydist.tpu import DeviceAssignment, LocalTPUSystem, Topology
from polydist.tpu import _system as _tpu_system

if TYPE_CHECKING:
    from polydist.data import Dataset

__all__ = [
    "LogicalDeviceAnnotation",
    "TPUExtended",
    "TPUHardwareFeature",
    "TPUReplicaContext",
    "TPUStrategy",
]


class TPUHardwareFeature:
    """What the TPU hardware supports (``tf.tpu.experimental.HardwareFeature``)."""

    class EmbeddingFeature(enum.Enum):
        """Embedding lookup accelerator of the chip.

        ``UNSUPPORTED``: none. ``V1``: lookups only at the start of the
        computation, one embedding layer. ``V2``: lookups anywhere, several layers.
        """

        UNSUPPORTED = "UNSUPPORTED"
        V1 = "V1"
        V2 = "V2"

    def __init__(self, embedding_feature: EmbeddingFeature, num_embedding_devices_per_chip: int):
        self._embedding_feature = embedding_feature
        self._num_embedding_devices_per_chip = num_embedding_devices_per_chip

    @property
    def embedding_feature(self) -> EmbeddingFeature:
        """The chip's `EmbeddingFeature`."""
        return self._embedding_feature

    @property
    def num_embedding_devices_per_chip(self) -> int:
        """Embedding accelerator devices (SparseCores) per chip."""
        return self._num_embedding_devices_per_chip

    def __repr__(self) -> str:
        return (
            f"TPUHardwareFeature(embedding_feature={self._embedding_feature.name}, "
            f"num_embedding_devices_per_chip={self._num_embedding_devices_per_chip})"
        )


# A simulation choice, not read from hardware: v2/v3 run TPU embeddings on the
# TensorCores (V1); v4 chips have 4 SparseCores (Jouppi et al., ISCA 2023) used
# through the V1 API; v5e chips have no embedding accelerator.
_EMBEDDING = TPUHardwareFeature.EmbeddingFeature
_HARDWARE_FEATURES: dict[str, tuple[TPUHardwareFeature.EmbeddingFeature, int]] = {
    "v2": (_EMBEDDING.V1, 0),
    "v3": (_EMBEDDING.V1, 0),
    "v4": (_EMBEDDING.V1, 4),
    "v5e": (_EMBEDDING.UNSUPPORTED, 0),
}


@dataclasses.dataclass(frozen=True)
class LogicalDeviceAnnotation:
    """How a model-parallel annotation asked XLA to lay an array out over logical devices.

    ``kind`` is ``"maximal"`` (whole array on ``logical_device_id``),
    ``"tiled"`` (split by ``partition_dimensions``; tile ``i`` on logical
    device ``tile_assignment.flat[i]``) or ``"replicated"`` (a copy on each).
    """

    kind: Literal["maximal", "tiled", "replicated"]
    logical_device_id: int | None = None
    partition_dimensions: tuple[int, ...] | None = None

    @property
    def tile_assignment(self) -> np.ndarray | None:
        """For ``"tiled"``: ``arange(prod(dims)).reshape(dims)``, as TF builds it."""
        if self.partition_dimensions is None:
            return None
        dims = self.partition_dimensions
        return np.arange(math.prod(dims)).reshape(dims)


class _AnnotationTable:
    """Annotations by array identity; an entry goes when its array is garbage collected."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Any], LogicalDeviceAnnotation]] = {}

    def record(self, value: Any, annotation: LogicalDeviceAnnotation) -> None:
        key = id(value)
        entries = self._entries
        try:
            ref = weakref.ref(value, lambda _: entries.pop(key, None))
        except TypeError:
            return  # Python and NumPy scalars cannot be tracked; nothing to lay out anyway
        entries[key] = (ref, annotation)

    def lookup(self, value: Any) -> LogicalDeviceAnnotation | None:
        entry = self._entries.get(id(value))
        if entry is None or entry[0]() is not value:
            return None
        return entry[1]

    def __deepcopy__(self, memo: dict[int, Any]) -> _AnnotationTable:
        return _AnnotationTable()  # annotations belong to the original's arrays


def _check_topology(da: DeviceAssignment, system: LocalTPUSystem, backend: Backend) -> None:
    """The assignment's coordinates mean this system's cores only if it was built from
    this system's topology."""
    topology = system.topology()
    if not (
        np.array_equal(da.topology.mesh_shape, topology.mesh_shape)
        and np.array_equal(da.topology.device_coordinates, topology.device_coordinates)
    ):
        raise ValueError(
            f"The device assignment was built for {_topology_text(da.topology)}, but backend "
            f"{backend.name!r} runs TPUStrategy on {_topology_text(topology)}. Build it from "
            f"this TPU's topology: TPUClusterResolver('local', backend={backend.name!r})"
            ".get_tpu_system_metadata().topology."
        )


def _topology_text(topology: Topology) -> str:
    return (
        f"a TPU mesh of shape {topology.mesh_shape.tolist()} with "
        f"{topology.num_tasks * topology.num_tpus_per_task} devices"
    )


class TPUExtended(StrategyExtended):
    """``StrategyExtended`` of `TPUStrategy`.

    Args mirror TF's ``TPUExtended``; ``steps_per_run`` is kept for the v1
    strategies that build on this class.
    """

    _gather_needs_same_shape = True

    def __init__(
        self,
        container_strategy: Strategy,
        tpu_cluster_resolver: TPUClusterResolver | None = None,
        steps_per_run: int | None = None,
        device_assignment: DeviceAssignment | None = None,
        use_spmd_for_xla_partitioning: bool = False,
        *,
        backend: str | Backend | None = None,
    ) -> None:
        resolved = get_backend(backend)
        if not resolved.capabilities.has("tpu"):
            raise ValueError(
                f"TPUStrategy needs a backend that declares Capabilities.tpu; backend "
                f"{resolved.name!r} does not. Simulated TPU slices run on the simulator: "
                "pass backend='sim'."
            )
        resolver = (
            default_tpu_resolver(resolved) if tpu_cluster_resolver is None else tpu_cluster_resolver
        )
        if not isinstance(resolver, TPUClusterResolver):
            raise TypeError(
                "tpu_cluster_resolver must be a polydist.cluster_resolver.TPUClusterResolver, "
                f"e.g. TPUClusterResolver(tpu='v3-8'); got {type(resolver).__name__}."
            )
        if device_assignment is not None and not isinstance(device_assignment, DeviceAssignment):
            raise TypeError(
                "device_assignment must be a polydist.tpu.DeviceAssignment (build one with "
                f"DeviceAssignment.build(topology, ...)); got {type(device_assignment).__name__}."
            )
        system = resolver._bind(resolved)
        if system is None and local_tpu_system(resolved) is not None:
            raise ValueError(
                f"Backend {resolved.name!r} runs TPUStrategy on the TPU cores of this process "
                f"only: pass TPUClusterResolver('local') (or no resolver). {resolver!r} is a "
                "simulated slice; those run on the simulator (backend='sim')."
            )
        if system is not None and device_assignment is not None:
            _check_topology(device_assignment, system, resolved)
        self._tpu_cluster_resolver = resolver
        self._cluster_resolver = resolver
        self._tpu_metadata = resolver.get_tpu_system_metadata()
        self._device_assignment = device_assignment
        self.steps_per_run = steps_per_run
        self._use_spmd_for_xla_partitioning = bool(use_spmd_for_xla_partitioning)
        self._logical_device_stack = [0]
        self._annotations = _AnnotationTable()

        flat = [canonicalize(d) for d in self._tpu_metadata.devices if "/device:TPU:" in d]
        self._tpu_devices = _replica_devices(flat, device_assignment, resolver)
        self._host_device = _host_of(self._tpu_devices[0][0])
        replicas = tuple(r[0] for r in self._tpu_devices)
        if system is None:
            self._connect(resolved, flat)
        else:
            # The backend's own cores: it checks the replicas' devices, in replica order.
            resolved.validate_devices(replicas)
        super().__init__(container_strategy, resolved, replicas)

    def _connect(self, backend: Backend, flat: Sequence[str]) -> None:
        by_host: dict[tuple[str, int], list[str]] = {}
        for device in flat:
            spec = DeviceSpec.parse(device)
            by_host.setdefault((spec.job, spec.task), [_host_of(device)]).append(device)
        if list(by_host) == [("localhost", 0)]:
            backend.validate_devices([d for ds in by_host.values() for d in ds])
            return
        # A single client drives every host of the slice, so all their replicas run here.
        hosts = [by_host[k] for k in sorted(by_host, key=lambda k: k[1])]
        local = connect_cluster(backend, hosts, 0, what="TPUStrategy")
        if len(local) != len(hosts):
            raise NotImplementedError(
                f"Backend {backend.name!r} runs only hosts {local} of this {len(hosts)}-host "
                "slice in this process; TPUStrategy drives every host from one client."
            )

    # -- properties -------------------------------------------------------------------
    @property
    def num_hosts(self) -> int:
        """Hosts whose TPUs run replicas."""
        da = self._device_assignment
        if da is None:
            return self._tpu_metadata.num_hosts
        return len({da.host_device(r) for r in range(da.num_replicas)})

    @property
    def num_replicas_per_host(self) -> int:
        """Replicas per host (with a device assignment: TF's upper bound)."""
        da = self._device_assignment
        if da is None:
            return self._tpu_metadata.num_of_cores_per_host
        max_models_per_host = self._tpu_metadata.num_of_cores_per_host // da.num_cores_per_replica
        return min(da.num_replicas, max_models_per_host)

    @property
    def _num_logical_devices_per_replica(self) -> int:
        return len(self._tpu_devices[0])

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """Each replica's TPU device for the current logical device (see
        `experimental_logical_device`), in replica order."""
        logical = self._logical_device_stack[-1]
        return tuple(r[logical] for r in self._tpu_devices)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Same as `worker_devices`."""
        return self.worker_devices

    @property
    def experimental_require_static_shapes(self) -> bool:
        """True: XLA compiles TPU programs for fixed shapes."""
        return True

    @property
    def tpu_hardware_feature(self) -> TPUHardwareFeature:
        """What the slice's chips support (`TPUHardwareFeature`)."""
        feature, per_chip = _HARDWARE_FEATURES.get(
            self._tpu_cluster_resolver._generation(), (_EMBEDDING.UNSUPPORTED, 0)
        )
        return TPUHardwareFeature(feature, per_chip)

    @property
    def should_checkpoint(self) -> bool:
        """True: the single client saves checkpoints."""
        return True

    @property
    def should_save_summary(self) -> bool:
        """True: the single client writes summaries."""
        return True

    @property
    def experimental_should_init(self) -> bool:
        """True."""
        return True

    @property
    def experimental_between_graph(self) -> bool:
        """False: one client builds the program for every host."""
        return False

    def get_host(self, host_id: int) -> str:
        """The task prefix of host ``host_id`` (``/job:worker/task:1``)."""
        if self._tpu_cluster_resolver.get_master() in ("", "local"):
            return "/replica:0/task:0"
        job_name = self._tpu_cluster_resolver.get_job_name() or "tpu_worker"
        return f"/job:{job_name}/task:{host_id}"

    def get_host_cpu_device(self, host_id: int) -> str:
        """The CPU device of host ``host_id``."""
        return self.get_host(host_id) + "/device:CPU:0"

    @contextmanager
    def experimental_logical_device(self, logical_device_id: int) -> Iterator[None]:
        """Places variables and ops created inside on logical device ``logical_device_id``.

        On the sim this changes ``worker_devices``, not where arrays live.
        """
        n = self._num_logical_devices_per_replica
        if logical_device_id >= n:
            raise ValueError(
                f"`logical_device_id` not in range (was {logical_device_id}, but there are only "
                f"{n} logical devices per replica). Build the DeviceAssignment with a "
                "computation_shape covering more cores to get more logical devices."
            )
        self._logical_device_stack.append(logical_device_id)
        try:
            yield
        finally:
            self._logical_device_stack.pop()

    def logical_device_annotation(self, tensor: Any) -> LogicalDeviceAnnotation | None:
        """The annotation a model-parallel call recorded for ``tensor`` (a polydist extension).

        ``None`` when ``tensor`` was not annotated (or is a Python or NumPy
        scalar, which cannot be tracked).
        """
        return self._annotations.lookup(tensor)

    def _gather_to(self, value: Any, destination: str, axis: int) -> Any:
        try:
            return super()._gather_to(value, destination, axis)
        except InvalidArgumentError as err:
            raise InvalidArgumentError(
                f"{err} TPUStrategy.gather needs the same shape on every replica, along the "
                "gather axis too (XLA compiles TPU programs for static shapes); pad every "
                "replica's value to the same size before gathering."
            ) from None

    # -- non-slot variables (TF V1) ---------------------------------------------------------
    def non_slot_devices(self, var_list: Sequence[Any]) -> str:
        """The host's CPU device (TF's TPU ``non_slot_devices``): non-slot state, such as
        an optimizer's step counters, lives once, on the host, not once per TPU core."""
        del var_list
        return self._host_device

    def update_non_slot(
        self,
        colocate_with: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """Runs ``fn(*args, **kwargs)`` once, on the host device (TF's TPU
        ``update_non_slot``; ``colocate_with`` is ignored). Returns ``fn``'s result;
        with ``group=False`` each of its values as a tuple of local results. A
        distributed variable that ``fn`` writes is updated on every copy, once."""
        del colocate_with
        strategy = self._container_strategy()
        _context.require_cross_replica_or_default_context(strategy)
        kwargs = {} if kwargs is None else dict(kwargs)
        with _variables._enter_strategy(strategy), self._backend.device_scope(self._host_device):
            result = fn(*args, **kwargs)
        if group:
            return result
        return _nest.map_structure(self._local_results, result)

    # -- running ------------------------------------------------------------------------
    def _check_not_shut_down(self) -> None:
        name = self._tpu_cluster_resolver._tpu
        if _tpu_system.is_shut_down(name):
            # TF's TPU runtime: "The TPU system has not been initialized."
            raise FailedPreconditionError(
                f"The TPU system has not been initialized: TPU system {name!r} was shut down "
                "with shutdown_tpu_system. Call polydist.tpu.initialize_tpu_system(resolver) "
                "before running on it again."
            )

    def _call_for_each_replica(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        self._check_not_shut_down()
        wrapped = InReplicaContext(fn, TPUReplicaContext, _SameShapeGatherChannel)
        return super()._call_for_each_replica(wrapped, args, kwargs)


class _SameShapeGatherChannel:
    """Wraps a replica's channel: ``all_gather`` must see the same shape on every replica."""

    __slots__ = ("_ctx", "_inner")

    def __init__(self, inner: ReplicaChannel, ctx: ReplicaContext) -> None:
        self._inner = inner
        self._ctx = ctx

    def all_reduce(self, reduce_op: ReduceOp, values: Sequence[Any]) -> list[Any]:
        return self._inner.all_reduce(reduce_op, values)

    def all_gather(self, values: Sequence[Any], axis: int) -> list[Any]:
        gathered = self._inner.all_gather(values, axis)
        # Replicas cannot see each other's shapes, but if every replica's size along
        # the axis times n equals the gathered size, all sizes are equal.
        n = self._ctx.num_replicas_in_sync
        for v, g in zip(values, gathered):
            own, total = int(v.shape[axis]), int(g.shape[axis])
            if own * n != total:
                raise InvalidArgumentError(
                    f"TPU all_gather needs the same shape on every replica: replica "
                    f"{self._ctx._replica_index} has size {own} along axis {axis}, but the "
                    f"{n} replicas' sizes add up to {total}. XLA compiles TPU programs for "
                    "static shapes; pad every replica's value to the same size (and mask "
                    "the padding) before gathering."
                )
        return gathered

    def merge_call(
        self, merge_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        return self._inner.merge_call(merge_fn, args, kwargs)


class TPUReplicaContext(ReplicaContext):
    """The replica context inside `TPUStrategy.run`."""

    @contextmanager
    def experimental_logical_device(self, logical_device_id: int) -> Iterator[None]:
        """Places ops created inside on logical device ``logical_device_id`` of this replica."""
        extended = self._strategy.extended
        assert isinstance(extended, TPUExtended)
        with extended.experimental_logical_device(logical_device_id):
            yield


def _replica_devices(
    flat: Sequence[str], da: DeviceAssignment | None, resolver: TPUClusterResolver
) -> tuple[tuple[str, ...], ...]:
    """``[replica][logical_device]`` TPU device names."""
    if da is None:
        return tuple((d,) for d in flat)
    if da.num_replicas < 1:
        raise ValueError(
            f"The device assignment has {da.num_replicas} replicas; TPUStrategy needs at "
            "least one. Build it with num_replicas >= 1."
        )
    job = DeviceSpec.parse(flat[0]).job
    known = set(flat)
    devices = tuple(
        tuple(
            canonicalize(da.tpu_device(replica=r, logical_core=c, job=job))
            for c in range(da.num_cores_per_replica)
        )
        for r in range(da.num_replicas)
    )
    for r, replica in enumerate(devices):
        for c, device in enumerate(replica):
            if device not in known:
                raise ValueError(
                    f"The device assignment puts replica {r}, logical core {c} on {device}, "
                    f"which {resolver._describe(len(flat))}. Build "
                    "the DeviceAssignment from this slice's topology: "
                    "resolver.get_tpu_system_metadata().topology."
                )
    return devices


def _host_of(device: str) -> str:
    spec = DeviceSpec.parse(device)
    return f"/job:{spec.job}/replica:{spec.replica}/task:{spec.task}/device:CPU:0"


class TPUStrategy(Strategy):
    """Synchronous training on the TPU devices of a (simulated) TPU slice.

    One replica per TPU device, or per replica of ``experimental_device_assignment``.
    ``run`` works eagerly on the sim (TF requires a ``tf.function``) and compiles
    on jax and torch-xla, which run on their own TPU cores (or on devices
    standing in for them; see `polydist.tpu.LocalTPUSystem`).

    Args:
        tpu_cluster_resolver: a `polydist.cluster_resolver.TPUClusterResolver`
            naming a simulated slice (``TPUClusterResolver(tpu="v4-32")``) or
            ``"local"``. Default: ``TPUClusterResolver()`` if ``TPU_NAME`` (or
            ``KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS``) is set, else
            ``TPUClusterResolver("local")``, the slice named by
            ``$POLYDIST_LOCAL_TPU`` (default ``v3-8``). On a backend with its
            own TPU cores only ``"local"`` is accepted, and it is the default.
        experimental_device_assignment: a `polydist.tpu.DeviceAssignment`
            placing the replicas (and, with ``computation_shape``, several
            logical devices per replica for model parallelism).
        experimental_spmd_xla_partitioning: use XLA SPMD partitioning for
            model parallelism; then ``experimental_assign_to_logical_device``
            is not allowed.
        device_assignment: TF 2.0's name for ``experimental_device_assignment``.
        backend: a backend that declares ``Capabilities.tpu`` (default ``sim``).
    """

    def __init__(
        self,
        tpu_cluster_resolver: TPUClusterResolver | None = None,
        experimental_device_assignment: DeviceAssignment | None = None,
        experimental_spmd_xla_partitioning: bool = False,
        *,
        device_assignment: DeviceAssignment | None = None,
        backend: str | Backend | None = None,
    ) -> None:
        if experimental_device_assignment is not None and device_assignment is not None:
            raise ValueError(
                "Pass the device assignment once: both experimental_device_assignment and "
                "device_assignment (its TF 2.0 name) were given."
            )
        assignment = (
            experimental_device_assignment
            if experimental_device_assignment is not None
            else device_assignment
        )
        super().__init__(
            TPUExtended(
                self,
                tpu_cluster_resolver,
                device_assignment=assignment,
                use_spmd_for_xla_partitioning=experimental_spmd_xla_partitioning,
                backend=backend,
            )
        )

    @property
    def extended(self) -> TPUExtended:
        """A `TPUExtended` with additional methods."""
        extended = self._extended
        assert isinstance(extended, TPUExtended)
        return extended

    @property
    def cluster_resolver(self) -> TPUClusterResolver:
        """The `TPUClusterResolver` of the slice."""
        return self.extended._tpu_cluster_resolver

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        options: Any = None,
    ) -> Any:
        """Calls ``fn`` once per TPU replica: eagerly on the sim (TF requires a
        ``tf.function``), compiled on jax and torch-xla.

        Inside, ``get_replica_context()`` is a `TPUReplicaContext`; its
        ``all_gather`` needs the same shape on every replica. ``options`` (a
        `polydist.RunOptions`) is accepted and changes nothing.

        Raises:
          polydist.errors.FailedPreconditionError: the TPU system was shut down
            (`polydist.tpu.shutdown_tpu_system`) and not initialized again.
        """
        self.extended._check_not_shut_down()  # (the prepared path skips the extended's)
        return super().run(fn, args, kwargs, options)

    def experimental_make_numpy_dataset(self, numpy_input: Any) -> Dataset:
        """A ``polydist.data.Dataset`` of the slices of ``numpy_input`` along its first axis.

        TF 2's ``TPUStrategy.experimental_make_numpy_dataset(numpy_input)``:
        ``numpy_input`` is a nest of NumPy arrays, whose lists are stacked (as
        ``tf.data.Dataset`` does). The dataset lives on the host; batch it and
        distribute it with ``experimental_distribute_dataset``::

            numpy_input = np.ones([10], dtype=np.float32)
            dataset = strategy.experimental_make_numpy_dataset(numpy_input)
            dist_dataset = strategy.experimental_distribute_dataset(dataset.batch(8))

        Requires cross-replica (or default) context.
        """
        from polydist._input.input_lib import make_numpy_dataset
        from polydist._strategies import context as _context

        _context.require_cross_replica_or_default_context(self)
        return make_numpy_dataset(numpy_input)

    # -- model parallelism ------------------------------------------------------------
    def experimental_assign_to_logical_device(self, tensor: Any, logical_device_id: int) -> Any:
        """Annotates ``tensor`` to live on logical device ``logical_device_id``; returns it.

        Raises:
            ValueError: in SPMD mode, or if ``logical_device_id`` is not in
                ``0..logical devices per replica - 1``.
        """
        extended = self.extended
        if extended._use_spmd_for_xla_partitioning:
            raise ValueError(
                "Cannot assign a tensor to a logical device in SPMD mode. To disable SPMD, "
                "Please construct the TPUStrategy with `experimental_spmd_xla_partitioning=False`"
            )
        n = extended._num_logical_devices_per_replica
        if logical_device_id < 0 or logical_device_id >= n:
            raise ValueError(
                "`logical_core_id` to assign must be lower then total number of logical devices "
                f"per replica. Received logical device id {logical_device_id} but there are only "
                f"total of {n} logical devices in replica."
            )
        annotation = LogicalDeviceAnnotation("maximal", logical_device_id=int(logical_device_id))
        extended._annotations.record(tensor, annotation)
        return tensor

    def experimental_split_to_logical_devices(
        self, tensor: Any, partition_dimensions: Sequence[int]
    ) -> Any:
        """Annotates ``tensor`` to be split over the logical devices; returns it.

        ``partition_dimensions[i]`` is how many pieces dimension ``i`` is cut
        into. Raises ``ValueError`` unless there is one entry per dimension,
        each divides its dimension, and their product is the number of
        logical devices per replica.
        """
        extended = self.extended
        n = extended._num_logical_devices_per_replica
        dims = tuple(int(d) for d in partition_dimensions)
        splits = math.prod(dims)
        shape = tuple(getattr(tensor, "shape", ()))
        if len(shape) != len(dims):
            raise ValueError(
                "Length of `partition_dimensions` must equal to the rank of `tensor.shape` "
                f"({len(shape)}). Received len(partition_dimensions)={len(dims)}."
            )
        for index, size in enumerate(dims):
            if size < 1 or int(shape[index]) % size != 0:
                raise ValueError(
                    f"Tensor shape at `partition_dimensions[{index}]` must be divisible by "
                    f"corresponding value specified by `partition_dimensions` ({size}). "
                    f"Received: {shape[index]}."
                )
        if splits != n:
            raise ValueError(
                "The product of `partition_dimensions` should be the same as the number of "
                f"logical devices (={n}). Received `partition_dimensions`={list(dims)},and "
                f"their product is {splits}."
            )
        extended._annotations.record(tensor, LogicalDeviceAnnotation("tiled", None, dims))
        return tensor

    def experimental_replicate_to_logical_devices(self, tensor: Any) -> Any:
        """Annotates ``tensor`` to be copied to every logical device; returns it."""
        self.extended._annotations.record(tensor, LogicalDeviceAnnotation("replicated"))
        return tensor
