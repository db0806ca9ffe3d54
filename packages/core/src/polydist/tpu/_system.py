"""``initialize_tpu_system`` / ``shutdown_tpu_system``: which TPU systems are initialized.

TensorFlow's ``tf.tpu.experimental.initialize_tpu_system`` (``tpu_strategy_util.py``)
keeps ``_INITIALIZED_TPU_SYSTEMS``, the topology of each initialized system keyed by
the resolver's TPU name; re-initializing or shutting down an uninitialized system
logs a warning. This module keeps the same record, and also which systems were shut
down: TF's TPU runtime then refuses to run ("The TPU system has not been
initialized"), and so does `TPUStrategy.run`.

This package sits below ``polydist.cluster_resolver``, so it does not know
``TPUClusterResolver``: the resolver module registers how to read one
(`set_resolver_reader`), as TF passes its ``TPUClusterResolver`` class to
``initialize_tpu_system_impl``. ``import polydist`` registers it.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable
from typing import Protocol

from polydist.tpu._topology import Topology

__all__ = [
    "ResolvedTPUSystem",
    "get_initialized_tpu_systems",
    "initialize_tpu_system",
    "is_shut_down",
    "set_resolver_reader",
    "shutdown_tpu_system",
]


class _StoresTopology(Protocol):
    def set_tpu_topology(self, serialized_tpu_topology: bytes | str) -> None: ...


@dataclasses.dataclass(frozen=True)
class ResolvedTPUSystem:
    """What a ``TPUClusterResolver`` says about its TPU system."""

    name: str  # TF's key: the resolver's TPU name ("local", "v4-32")
    topology: Topology
    resolver: _StoresTopology


#: ``reader(cluster_resolver, caller)``: the system a resolver (None: the default
#: one) names; raises TypeError for anything but a TPUClusterResolver.
_Reader = Callable[[object, str], ResolvedTPUSystem]

_reader: _Reader | None = None
_lock = threading.Lock()
_initialized: dict[str, Topology] = {}
_shut_down: set[str] = set()


def set_resolver_reader(reader: _Reader) -> None:
    """Called by ``polydist.cluster_resolver`` when it is imported."""
    global _reader
    _reader = reader


def _resolve(cluster_resolver: object, caller: str) -> ResolvedTPUSystem:
    if _reader is None:  # only if this module is used without `import polydist`
        raise RuntimeError(f"{caller}: TPUClusterResolver is not registered: import polydist.")
    return _reader(cluster_resolver, caller)


def initialize_tpu_system(cluster_resolver: object = None) -> Topology:
    """Initializes the TPU system a resolver names (``tf.tpu.experimental.initialize_tpu_system``).

    Records the system as initialized, stores its topology in the resolver
    (``cluster_resolver.tpu_topology``, as TF's ``set_tpu_topology``) and returns it.
    A system shut down with `shutdown_tpu_system` runs ``TPUStrategy.run`` again.
    polydist's TPU systems need no initialization to run: this is for code ported
    from TF, which needs it.

    Args:
      cluster_resolver: a `polydist.cluster_resolver.TPUClusterResolver`.
        Default: the resolver ``TPUStrategy()`` would use, ``TPUClusterResolver()``
        if ``TPU_NAME`` (or ``KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS``) is set, else
        ``TPUClusterResolver("local")``.

    Returns:
      The `Topology` of the system: for a simulated slice, its mesh and one task
      per host; for ``"local"`` on a backend with TPU cores, those cores'.

    Raises:
      TypeError: if ``cluster_resolver`` is not a ``TPUClusterResolver`` (TF asserts).

    Warns:
      UserWarning: if the system is already initialized (TF logs this warning:
        re-initializing a real TPU loses the variables on it).
    """
    system = _resolve(cluster_resolver, "initialize_tpu_system")
    with _lock:
        again = system.name in _initialized
        _initialized[system.name] = system.topology
        _shut_down.discard(system.name)
    if again:
        warnings.warn(
            f"TPU system {system.name} has already been initialized. Reinitializing the TPU "
            "can cause previously created variables on TPU to be lost.",
            UserWarning,
            stacklevel=2,
        )
    system.resolver.set_tpu_topology(system.topology.serialized())
    return system.topology


def shutdown_tpu_system(cluster_resolver: object = None) -> None:
    """Shuts down the TPU system a resolver names (``tf.tpu.experimental.shutdown_tpu_system``).

    Until `initialize_tpu_system` is called for it again, ``TPUStrategy.run`` on
    that system raises ``polydist.errors.FailedPreconditionError``, as TF's TPU
    runtime does. Creating a ``TPUStrategy`` still works, as in TF.

    Args:
      cluster_resolver: as for `initialize_tpu_system`.

    Raises:
      TypeError: if ``cluster_resolver`` is not a ``TPUClusterResolver`` (TF asserts).

    Warns:
      UserWarning: if the system was not initialized (TF logs this warning). It
        is shut down all the same.
    """
    system = _resolve(cluster_resolver, "shutdown_tpu_system")
    with _lock:
        known = _initialized.pop(system.name, None) is not None
        _shut_down.add(system.name)
    if not known:
        warnings.warn(
            f"You are shutting down a TPU system {system.name} that has not been initialized.",
            UserWarning,
            stacklevel=2,
        )


def get_initialized_tpu_systems() -> dict[str, Topology]:
    """The initialized systems: TPU name -> `Topology` (a copy, as TF's)."""
    with _lock:
        return dict(_initialized)


def is_shut_down(name: str) -> bool:
    """Whether the system of TPU name ``name`` was shut down and not initialized since."""
    return name in _shut_down
