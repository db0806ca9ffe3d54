"""Distributed values as a backend handles them.

``DistributedValues`` (``PerReplica``, ``Mirrored``) and ``DistributedVariable`` hold
one value per replica; :func:`select_replica` picks replica ``r``'s value out of a
nest of them, :func:`regroup` combines one nest per replica into one nest of
distributed values (what a backend that runs its own replicas hands ``merge_fn``), and
:func:`value_container` returns the distributed value a component belongs to (or the
value itself). :func:`variable_backend` names the backend a variable's arrays belong to.

:func:`deferred` makes a ``PerReplica`` (or ``Mirrored``) whose components a
``ComponentSource`` makes on first read: a compiled backend returns a per-replica
result that way, and recognizes it whole (:func:`component_source`) when it is passed
back into the next run, so a training loop's parameters are never split per replica.
"""

from typing import TypeVar

from polydist._valuetypes.values import ComponentSource as ComponentSource
from polydist._valuetypes.values import DistributedValues as DistributedValues
from polydist._valuetypes.values import Mirrored as Mirrored
from polydist._valuetypes.values import PerReplica as PerReplica
from polydist._valuetypes.values import regroup as regroup
from polydist._valuetypes.values import select_replica as select_replica
from polydist._valuetypes.values import value_container as value_container
from polydist._valuetypes.variables import DistributedVariable as DistributedVariable
from polydist._valuetypes.variables import MirroredVariable as MirroredVariable
from polydist._valuetypes.variables import SyncOnReadVariable as SyncOnReadVariable
from polydist._valuetypes.variables import Variable as Variable
from polydist.backend._contract import Backend

_D = TypeVar("_D", bound=DistributedValues)


def deferred(cls: type[_D], source: ComponentSource) -> _D:
    """A ``cls`` (``PerReplica`` or ``Mirrored``) whose components ``source.components()``
    makes the first time anything reads them (``values``, a replica's pick, a reduction);
    until then it holds only ``source``."""
    if cls not in _DEFERRABLE:  # checked once per class: a step defers each result
        if not (issubclass(cls, DistributedValues) and not getattr(cls, "_select_whole", False)):
            raise TypeError(
                f"deferred() makes PerReplica or Mirrored values, got {cls.__name__}: pass one "
                "of those classes (a variable's copies are deferred with "
                "polydist.backend.tracing.defer_storage)."
            )
        _DEFERRABLE.add(cls)
    value: _D = cls._deferred(source)
    return value


#: The classes `deferred` has checked.
_DEFERRABLE: set[type] = set()


def component_source(value: DistributedValues) -> ComponentSource | None:
    """The source of a :func:`deferred` value (whether or not its components were made
    since), else None."""
    source: ComponentSource | None = value._source
    return source


def variable_backend(variable: Variable) -> Backend:
    """The backend whose arrays ``variable`` (plain or distributed) stores."""
    return variable._backend


__all__ = [
    "ComponentSource",
    "DistributedValues",
    "DistributedVariable",
    "Mirrored",
    "MirroredVariable",
    "PerReplica",
    "SyncOnReadVariable",
    "Variable",
    "component_source",
    "deferred",
    "regroup",
    "select_replica",
    "value_container",
    "variable_backend",
]
