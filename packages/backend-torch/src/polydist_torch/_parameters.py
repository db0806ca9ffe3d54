"""polydist variables as ``torch.nn.Parameter``\\ s that ``torch.optim`` can update.

:func:`parameters` makes the storage of every copy of a variable a
``torch.nn.Parameter`` (once; later calls return the same objects), so:

* in ``strategy.run`` the variable *is* the replica's parameter: ``x @ w``,
  ``w.value()`` and ``w + 1`` use it, and ``loss.backward()`` fills its
  ``.grad``;
* a torch optimizer built over those parameters updates the variable in place
  (``optimizer.step()``), and polydist's own writes (``assign``,
  ``assign_add``, ``assign_sub``, ``checkpoint.restore``) copy the new value
  into the same parameter in place (the backend's ``store_variable`` hook), so
  both always see the same storage.

Semantics stay polydist's (TF's) for every read and write. The one difference
from the sim is aliasing: on the sim a write stores a new array, so an array
obtained earlier from ``v.value()`` keeps the old value; the parameter is
updated in place, so such an array is the live parameter and changes with it,
as any ``torch.nn.Parameter`` does. Use ``v.read_value()`` (a copy) or
``v.numpy()`` for a snapshot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import polydist as pd
from polydist.backend import nest as _nest
from polydist.backend.tracing import swap_storage, tracked_variables
from polydist_torch._backend import TorchBackend

__all__ = ["parameters"]


def parameters(variables: Any) -> list[list[torch.nn.Parameter]]:
    """The ``torch.nn.Parameter`` behind each copy of polydist variables, per replica.

    Args:
        variables: a ``Strategy`` (every trainable floating-point variable it
            created and that is still alive, in creation order), a
            ``polydist.Variable``, or a nest of variables (lists, tuples, dicts,
            ``OrderedDict`` state dicts, classes registered with
            ``torch.utils._pytree``), in the nest's order. Variables must be of the torch backend
            (``TorchBackend``) and have the same number of copies.

    Returns:
        One list per replica: ``result[r][k]`` is copy ``r`` of variable ``k``,
        a ``torch.nn.Parameter`` on replica ``r``'s device, with
        ``requires_grad`` if the variable is trainable and floating-point (or
        complex). A plain or ``OneDeviceStrategy`` variable has one copy, so
        one list. Calling again returns the same objects.

    The first call turns each copy's storage into a parameter (a copy of the
    value, so arrays obtained earlier from ``value()`` keep theirs) and must
    happen outside ``strategy.run``. From then on the parameters are the
    variables' storage: see the module docstring. Typical use, one optimizer
    per replica::

        with strategy.scope():
            w = pd.Variable(np.zeros((8, 1), np.float32), name="w")
        params = polydist_torch.parameters(strategy)
        optimizers = [torch.optim.SGD(p, lr=0.1) for p in params]
    """
    chosen = _variables(variables)
    if not chosen:
        if isinstance(variables, pd.Strategy):
            try:
                devices = variables.extended.worker_devices
            except RuntimeError:  # the default strategy has none
                devices = ()
            return [[] for _ in devices]  # one empty list per replica
        return []
    counts = {len(_copies(v)) for v in chosen}
    if len(counts) != 1:
        shown = ", ".join(f"{v.name!r} ({len(_copies(v))})" for v in chosen)
        raise ValueError(
            "polydist_torch.parameters: the variables have different numbers of copies, so "
            f"they cannot be listed per replica: {shown}. Ask for them separately."
        )
    for v in chosen:
        backend = v._backend
        if not isinstance(backend, TorchBackend):
            raise TypeError(
                f"polydist_torch.parameters: variable {v.name!r} belongs to backend "
                f"{getattr(backend, 'name', backend)!r}; only variables of the torch backend "
                "(TorchBackend) can be torch parameters."
            )
    pending = [v for v in chosen if not all(_is_parameter(c) for c in _copies(v))]
    if pending:
        if pd.has_strategy() and pd.get_replica_context() is not None:
            raise RuntimeError(
                "polydist_torch.parameters turns variables into torch parameters, which must "
                f"happen outside strategy.run ({pending[0].name!r} is not one yet). Call it once "
                "after creating the variables, e.g. right after the strategy.scope() block, and "
                "pass the parameters (or optimizers built on them) into the run."
            )
        for v in pending:
            swap_storage(v, [_as_parameter(c) for c in _copies(v)])
    (count,) = counts
    return [[_copies(v)[r]._read_storage() for v in chosen] for r in range(count)]


def _variables(obj: Any) -> list[Any]:
    if isinstance(obj, pd.Strategy):
        return [
            v
            for v in tracked_variables(obj.extended)
            if v.trainable and _floating(_copies(v)[0]._read_storage())
        ]
    if isinstance(obj, pd.Variable):
        return [obj]
    leaves, _ = _nest.flatten(obj, is_leaf=lambda x: isinstance(x, pd.Variable))
    for leaf in leaves:
        if not isinstance(leaf, pd.Variable):
            raise TypeError(
                "polydist_torch.parameters takes a Strategy, a polydist.Variable, or a nest "
                "(list/tuple/dict/state dict/torch pytree) of variables; found a "
                f"{type(leaf).__name__} in {obj!r}."
            )
    return list(leaves)


def _copies(variable: Any) -> Sequence[Any]:
    if isinstance(variable, pd.DistributedValues):
        copies: Sequence[Any] = variable.values
        return copies
    return (variable,)


def _is_parameter(component: Any) -> bool:
    return isinstance(component._read_storage(), torch.nn.Parameter)


def _floating(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and (tensor.is_floating_point() or tensor.is_complex())


def _as_parameter(component: Any) -> torch.nn.Parameter:
    stored = component._read_storage()
    if isinstance(stored, torch.nn.Parameter):
        return stored
    if not isinstance(stored, torch.Tensor):
        raise TypeError(
            f"polydist_torch.parameters: variable {component.name!r} stores a "
            f"{type(stored).__name__}, not a torch tensor."
        )
    requires_grad = component.trainable and _floating(stored)
    return torch.nn.Parameter(stored.detach().clone(), requires_grad=requires_grad)
