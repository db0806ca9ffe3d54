"""``torch.nn`` modules and ``torch.optim`` optimizers as distributed state.

:func:`distribute_module` is what building a Keras model under
``strategy.scope()`` is in TF: every parameter of the module becomes a
``MirroredVariable`` (one copy per replica, named by its ``state_dict`` key)
and every persistent buffer a ``SyncOnReadVariable`` (TF's rule for Keras
BatchNormalization's moving statistics: ``MEAN`` for floating-point buffers,
``ONLY_FIRST_REPLICA`` for the others, such as ``num_batches_tracked``). The
library keeps one copy of the module per replica (the user's module is replica
0's); the copies' parameters and buffers *are* the variables' storage. Inside
``strategy.run`` the returned module computes with the replica's own copy.

:func:`distribute_optimizer` wraps one ordinary ``torch.optim`` optimizer built
over ``model.parameters()`` and keeps one copy of it per replica (the user's
optimizer is replica 0's). Its ``step()`` in replica context first sums every
parameter's gradient across the replicas (one ``all_reduce``) and then steps
the replica's copy, as TF's ``optimizer.apply_gradients`` does in replica
context. Every replica then applies the same update from the same state, so
the copies stay bitwise identical.
"""

from __future__ import annotations

import copy
import inspect
import sys
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

import polydist as pd
from polydist.backend import replica_group
from polydist.backend.context import current_replica
from polydist.backend.tracing import is_tracing, swap_storage
from polydist_torch._backend import TorchBackend, _GradMode, _OutsideDefaultDevice, torch_made
from polydist_torch._storage import mark_variable_storage
from polydist_torch._sync_batch_norm import adopt_sync_batch_norms

__all__ = [
    "DistributedModule",
    "DistributedOptimizer",
    "distribute_module",
    "distribute_optimizer",
]

# Replica 0's parameters -> their DistributedModule (weakly both ways: tensors hash by
# identity here, and the module owns the parameters).
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


class LocalGradientWarning(UserWarning):
    """A `DistributedOptimizer`'s gradients were changed in place (clipped) after
    backward and before they were summed across replicas: that code saw one replica's
    gradients, not the sum. Call ``all_reduce_gradients()`` first."""


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside polydist_torch and torch."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in (
        "polydist_torch",
        "torch",
    ):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


def _owner(p: torch.Tensor, replica: int = 0) -> DistributedModule | None:
    """The DistributedModule that ``p`` is replica ``replica``'s copy of a parameter of."""
    entry = _OWNERS.get(p)  # type: ignore[no-untyped-call]
    if entry is None or entry[1] != replica:
        return None
    owner: DistributedModule | None = entry[0]()
    return owner


def _strategy_for(strategy: pd.Strategy | None, what: str) -> pd.Strategy:
    if strategy is None:
        if not pd.has_strategy():
            raise RuntimeError(
                f"{what} needs a strategy: call it inside `with strategy.scope():` (as a Keras "
                "model is built there in TF) or pass strategy=..."
            )
        strategy = pd.get_strategy()
    elif not isinstance(strategy, pd.Strategy):
        raise TypeError(f"{what}: strategy must be a polydist Strategy, got {strategy!r}.")
    if not isinstance(strategy.extended.backend, TorchBackend):
        backend = strategy.extended.backend
        raise TypeError(
            f"{what} works with strategies of the torch backend (backend='torch'); "
            f"{strategy!r} runs on {getattr(backend, 'name', backend)!r}."
        )
    if pd.has_strategy() and pd.get_replica_context() is not None:
        raise RuntimeError(
            f"{what} must be called outside strategy.run (in cross-replica context), once, "
            "before training; pass the result into the run, or capture it."
        )
    return strategy


def _replica_index(strategy: pd.Strategy, what: str) -> int | None:
    """This replica's index among the strategy's local replicas, ``None`` outside ``run``."""
    # Asked several times per training step: one look at the mode stack in the common
    # case (inside a run of ``strategy``), has_strategy only when that is not it.
    found = current_replica()
    if found is None:
        return None
    running, _, index = found
    if running is not strategy:
        if not pd.has_strategy():
            return None
        raise RuntimeError(
            f"{what} belongs to {strategy!r} but is used inside a run of {running!r}; "
            "use it with the strategy it was distributed with."
        )
    if index is None:
        raise NotImplementedError(
            f"{what} needs a replica with a Python index (the eager torch backend); a compiled "
            "SPMD replica context (torch_xla) cannot run per-replica modules."
        )
    return int(index)


def _components(variable: Any) -> tuple[Any, ...]:
    if isinstance(variable, pd.DistributedValues):
        return tuple(variable.values)
    return (variable,)


def _floating(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _owning(module: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    """The submodule that holds ``dotted`` (a state_dict key) and its attribute name."""
    path, _, attr = dotted.rpartition(".")
    return (module.get_submodule(path) if path else module), attr


def _slot(module: nn.Module, dotted: str, kind: str) -> torch.Tensor:
    owner, attr = _owning(module, dotted)
    tensor = getattr(owner, kind)[attr]
    assert isinstance(tensor, torch.Tensor)
    return tensor


class DistributedModule(nn.Module):
    """An ``nn.Module`` whose parameters and buffers are polydist distributed variables.

    Made by :func:`distribute_module`. Inside ``strategy.run`` calling it runs
    the replica's own copy of the wrapped module; outside it runs replica 0's
    copy (the wrapped module itself) with every ``SyncOnRead`` buffer read
    across replicas (BatchNorm's running statistics averaged), as TF reads a
    sync-on-read variable in cross-replica context.

    ``model.module`` is the wrapped module (replica 0's copy; inside
    ``strategy.run``, the replica's own), so outside ``run``
    ``model.parameters()`` are replica 0's parameters: build the optimizer on
    them and wrap it with :func:`distribute_optimizer`. ``variables`` and
    ``trainable_variables`` list the polydist variables, as in Keras.
    ``state_dict()`` has the wrapped module's keys (no ``module.`` prefix), so
    it loads into a plain module too; ``load_state_dict`` writes every replica.
    """

    module: nn.Module

    def __init__(self, module: nn.Module, strategy: pd.Strategy, name: str | None) -> None:
        super().__init__()
        what = "polydist_torch.distribute_module"
        if not isinstance(module, nn.Module):
            raise TypeError(f"{what} takes a torch.nn.Module, got {type(module).__name__}.")
        if isinstance(module, DistributedModule):
            raise TypeError(f"{what}: {module!r} is already distributed.")
        self.module = module
        prefix = f"{name}/" if name else ""
        devices = [_device_of(d) for d in _local_devices(strategy)]
        replicas = [module.to(devices[0])]
        for device in devices[1:]:
            replicas.append(copy.deepcopy(module).to(device))
        for m in replicas:  # each copy's SyncBatchNorm syncs over the strategy's replicas
            adopt_sync_batch_norms(m, what)
        variables: OrderedDict[str, Any] = OrderedDict()
        buffer_slots: list[tuple[str, Any]] = []
        keys = set(module.state_dict(keep_vars=True))
        with strategy.scope():
            for key, param in module.named_parameters():
                for m in replicas:
                    owner, attr = _owning(m, key)
                    if owner._parameters.get(attr) is None:  # replaced by a hook or a tie
                        raise TypeError(f"{what}: cannot find parameter {key!r} in a copy.")
                v = pd.Variable(
                    param.detach(),
                    name=prefix + key,
                    trainable=param.requires_grad,
                )
                copies = [_slot(m, key, "_parameters") for m in replicas]
                self._adopt(v, copies, key)
                variables[key] = v
            for key, buf in module.named_buffers():
                if key not in keys or buf is None:
                    continue  # non-persistent buffers are each replica's own working state
                sync = pd.VariableSynchronization.ON_READ
                agg = (
                    pd.VariableAggregation.MEAN
                    if buf.is_floating_point()
                    else pd.VariableAggregation.ONLY_FIRST_REPLICA
                )
                v = pd.Variable(
                    buf.detach(),
                    name=prefix + key,
                    trainable=False,
                    synchronization=sync,
                    aggregation=agg,
                )
                copies = [_slot(m, key, "_buffers") for m in replicas]
                self._adopt(v, copies, key)
                variables[key] = v
                buffer_slots.append((key, v))
        # Plain attributes, not submodules: nn.Module's recursion (parameters(),
        # state_dict(), train()) must see replica 0's copy only, through self.module.
        object.__setattr__(self, "_strategy", strategy)
        object.__setattr__(self, "_replicas", tuple(replicas))
        object.__setattr__(self, "_variables", variables)
        object.__setattr__(self, "_buffer_slots", tuple(buffer_slots))
        object.__setattr__(self, "_params", tuple(tuple(m.parameters()) for m in replicas))
        object.__setattr__(self, "_submodules", tuple(tuple(m.modules()) for m in replicas))
        for r, m in enumerate(replicas):
            for p in m.parameters():
                _OWNERS[p] = (weakref.ref(self), r)

    @staticmethod
    def _adopt(variable: Any, copies: list[torch.Tensor], key: str) -> None:
        """Makes each replica's tensor the storage of the variable's copy, with its value."""
        comps = _components(variable)
        if len(comps) != len(copies):
            raise RuntimeError(
                f"polydist_torch.distribute_module: variable {key!r} has {len(comps)} copies "
                f"but the strategy has {len(copies)} local replicas."
            )
        with torch.no_grad():
            for c, t in zip(comps, copies):
                value = c._read_storage()
                if value is not t:
                    t.copy_(value)  # the variable's value (the same on every copy)
                mark_variable_storage(t)  # optimizers and BatchNorm write into it in place
        swap_storage(variable, copies)

    # -- what users see ------------------------------------------------------------------
    @property
    def strategy(self) -> pd.Strategy:
        """The strategy whose replicas hold the copies."""
        strategy: pd.Strategy = self._strategy
        return strategy

    @property
    def replicas(self) -> tuple[nn.Module, ...]:
        """The per-replica copies, in local replica order (``replicas[0] is module``)."""
        replicas: tuple[nn.Module, ...] = self._replicas
        return replicas

    @property
    def variables(self) -> list[Any]:
        """Every variable (parameters, then persistent buffers), in ``state_dict`` order."""
        return list(self._variables.values())

    @property
    def trainable_variables(self) -> list[Any]:
        """The variables of parameters that require gradients (replica 0's flags, so
        layers frozen after distributing drop out, as Keras' ``trainable = False``)."""
        params = dict(self._replicas[0].named_parameters())
        return [v for k, v in self._variables.items() if k in params and params[k].requires_grad]

    def __getattr__(self, name: str) -> Any:
        if name == "module" and "_replicas" in self.__dict__:
            # DDP's `model.module.encode(x)` in the step: the replica's own copy, which
            # computes with its own weights and updates its own buffers.
            r = _replica_index(self._strategy, "this DistributedModule")
            if r:
                return self._replica_copy(r)
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "_replicas" not in self.__dict__:
                raise
        # The wrapped module's attributes (model.fc, model.running_mean): the replica's own
        # copy's inside strategy.run, replica 0's outside.
        r = _replica_index(self.strategy, "this DistributedModule")
        replica = self._replicas[0] if r is None else self._replica_copy(r)
        if name == "no_sync" and not hasattr(replica, name):
            raise AttributeError(
                "DistributedModule has no no_sync(): DDP's context that skips the gradients' "
                "all-reduce in backward. Here backward() sums nothing (optimizer.step() "
                "sums the gradients, once, as TF's apply_gradients), so accumulating "
                "gradients over several backward() calls needs no context: drop the "
                "`with model.no_sync():` and call optimizer.step() after the last one."
            )
        return getattr(replica, name)

    def _replica_copy(self, r: int) -> nn.Module:
        """Replica ``r``'s copy, its buffers and flags brought up to date (inside run)."""
        self._refresh_buffers(r)
        if r:
            self._follow_replica_zero(r)
        replica: nn.Module = self._replicas[r]
        return replica

    def __getitem__(self, index: Any) -> Any:
        # A container's layers (model[0] of an nn.Sequential), as attributes are reached.
        r = _replica_index(self.strategy, "this DistributedModule")
        replica: Any = self._replicas[0] if r is None else self._replica_copy(r)
        return replica[index]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        r = _replica_index(self._strategy, "this DistributedModule")
        if r is not None:
            if self._buffer_slots:  # most models' steps have none to refresh
                self._refresh_buffers(r)
            if r:
                self._follow_replica_zero(r)
            return self._replicas[r](*args, **kwargs)
        self._refresh_buffers(0)
        with self._cross_replica_buffers():
            return self.module(*args, **kwargs)

    def _follow_replica_zero(self, r: int) -> None:
        # Layers frozen (or unfrozen) through model.parameters() outside run, and layers
        # put in eval mode there (model.encoder.eval(), BatchNorm frozen through
        # model.modules()), changed replica 0's copy only: the other copies follow it.
        # Outside the default-device mode: two attribute reads per parameter per call.
        with _OutsideDefaultDevice():
            for p0, p in zip(self._params[0], self._params[r]):
                if p.requires_grad is not p0.requires_grad:
                    p.requires_grad_(p0.requires_grad)
        for m0, m in zip(self._submodules[0], self._submodules[r]):
            if m.training is not m0.training:
                m.training = m0.training

    def _refresh_buffers(self, r: int) -> None:
        # A polydist write (assign, checkpoint.restore) stores a new tensor: point the
        # module at whatever the variable holds now. In-place updates (BatchNorm's
        # running statistics) write into that same tensor.
        for key, v in self._buffer_slots:
            owner, attr = _owning(self._replicas[r], key)
            stored = _components(v)[r]._read_storage()
            if owner._buffers.get(attr) is not stored:
                owner._buffers[attr] = stored

    @contextmanager
    def _cross_replica_buffers(self) -> Iterator[None]:
        """Replica 0's buffers hold copies of their cross-replica values meanwhile."""
        # Copies (read_value), so a training-mode forward here changes no replica's buffers.
        swapped = []
        for key, v in self._buffer_slots:
            owner, attr = _owning(self.module, key)
            swapped.append((owner, attr, owner._buffers[attr]))
            owner._buffers[attr] = _aggregate(v)
        try:
            yield
        finally:
            for owner, attr, original in swapped:
                owner._buffers[attr] = original

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Replica 0's parameters; inside ``strategy.run``, the replica's own copy's."""
        r = _replica_index(self.strategy, "this DistributedModule")
        if r is None or not recurse:
            return super().named_parameters(prefix, recurse, remove_duplicate)
        inner = f"{prefix}.module" if prefix else "module"
        replica: nn.Module = self._replicas[r]
        return replica.named_parameters(inner, recurse, remove_duplicate)

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        """``("module", replica 0's copy)``; inside ``strategy.run``, the replica's own."""
        r = _replica_index(self.strategy, "this DistributedModule")
        if r is None:
            return super().named_children()
        return iter((("module", self._replica_copy(r)),))

    def named_modules(
        self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Module]]:
        """This module, then replica 0's copy's; inside ``strategy.run``, the replica's
        own copy's (``for m in model.modules()`` in the step walks its own layers)."""
        r = _replica_index(self.strategy, "this DistributedModule")
        if r is None:
            modules: Iterator[tuple[str, nn.Module]] = super().named_modules(
                memo, prefix, remove_duplicate
            )
            return modules
        replica = self._replica_copy(r)

        def walk() -> Iterator[tuple[str, nn.Module]]:
            seen = set() if memo is None else memo
            if self in seen:
                return
            if remove_duplicate:
                seen.add(self)
            yield prefix, self
            inner = f"{prefix}.module" if prefix else "module"
            yield from replica.named_modules(seen, inner, remove_duplicate)

        return walk()

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Replica 0's buffers; inside ``strategy.run``, the replica's own copy's."""
        r = _replica_index(self.strategy, "this DistributedModule")
        if r is None or not recurse:
            return super().named_buffers(prefix, recurse, remove_duplicate)
        self._refresh_buffers(r)
        inner = f"{prefix}.module" if prefix else "module"
        replica: nn.Module = self._replicas[r]
        return replica.named_buffers(inner, recurse, remove_duplicate)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the replica's gradients inside ``strategy.run``, every replica's outside."""
        r = _replica_index(self.strategy, "this DistributedModule")
        for m in self._replicas if r is None else (self._replicas[r],):
            m.zero_grad(set_to_none)

    def train(self, mode: bool = True) -> DistributedModule:
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        self.training = mode
        for m in self._replicas:
            m.train(mode)
        return self

    def requires_grad_(self, requires_grad: bool = True) -> DistributedModule:
        """Sets ``requires_grad`` on every replica's copy. Flags set on replica 0's
        parameters (``model.parameters()`` outside run) reach the other copies too."""
        for m in self._replicas:
            m.requires_grad_(requires_grad)
        return self

    def apply(self, fn: Callable[[nn.Module], None]) -> DistributedModule:
        raise RuntimeError(
            "DistributedModule.apply would run fn on replica 0's copy only (and a random "
            "initializer would give every replica different weights): initialize the module "
            "before polydist_torch.distribute_module, or write new values with "
            "model.load_state_dict(...) or variable.assign(...), which reach every replica."
        )

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> DistributedModule:
        raise RuntimeError(
            "A DistributedModule's copies live on the strategy's devices, one per replica, and "
            "must keep one dtype: convert the module (.to(dtype), .double(), ...) before "
            "polydist_torch.distribute_module, and let the strategy place it."
        )

    # -- state_dict ----------------------------------------------------------------------
    def state_dict(
        self,
        *args: Any,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
    ) -> Any:
        """The wrapped module's ``state_dict`` with cross-replica values.

        Parameters are replica 0's (every replica holds the same); a buffer is
        its variable's cross-replica value (the mean over replicas for floating
        point buffers). Inside ``strategy.run`` it is the replica's own copy's.
        """
        if args:
            raise TypeError("DistributedModule.state_dict takes keyword arguments only.")
        r = _replica_index(self.strategy, "this DistributedModule")
        if r is not None:
            self._refresh_buffers(r)
            return self._replicas[r].state_dict(
                destination=destination, prefix=prefix, keep_vars=keep_vars
            )
        self._refresh_buffers(0)
        with self._cross_replica_buffers():
            return self.module.state_dict(
                destination=destination, prefix=prefix, keep_vars=keep_vars
            )

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Loads ``state_dict`` (the wrapped module's keys) into every replica's copy."""
        if assign:
            raise ValueError(
                "DistributedModule.load_state_dict(assign=True) would replace the parameters "
                "that are the variables' storage; load with assign=False (values are copied)."
            )
        if _replica_index(self.strategy, "this DistributedModule") is not None:
            raise RuntimeError(
                "DistributedModule.load_state_dict writes every replica's copy: call it "
                "outside strategy.run."
            )
        result = None
        for r, m in enumerate(self._replicas):
            self._refresh_buffers(r)
            loaded = m.load_state_dict(state_dict, strict=strict)
            result = loaded if result is None else result
        return result

    def extra_repr(self) -> str:
        return f"replicas={len(self._replicas)}"


def _aggregate(v: Any) -> torch.Tensor:
    value = v.read_value()
    assert isinstance(value, torch.Tensor)
    return value


def _local_devices(strategy: pd.Strategy) -> list[str]:
    try:
        devices = list(strategy.extended.worker_devices)
    except RuntimeError:
        devices = []
    if not devices:
        raise ValueError(f"polydist_torch.distribute_module: {strategy!r} has no devices.")
    return devices


def _device_of(device: str) -> torch.device:
    from polydist_torch._devices import torch_device

    return torch_device(device)


def distribute_module(
    module: nn.Module, strategy: pd.Strategy | None = None, *, name: str | None = None
) -> DistributedModule:
    """Makes ``module``'s parameters and buffers distributed variables of ``strategy``.

    TF builds a Keras model under ``strategy.scope()`` to get mirrored
    variables; torch has no hook for creating modules, so this is the one call.

    Args:
        module: the model, built as usual (any ``nn.Module``). It becomes
            replica 0's copy and is moved to replica 0's device; the library
            deep-copies it onto the other replicas' devices.
        strategy: the strategy (default: the one whose ``scope()`` is entered).
            Must use the torch backend (``TorchBackend``).
        name: an optional prefix for the variables' names (``name/0.weight``),
            to tell two models apart in one checkpoint of the strategy.

    Returns:
        A :class:`DistributedModule`. Call it as the module inside and outside
        ``strategy.run``; build the optimizer on ``model.parameters()`` and wrap
        it with :func:`distribute_optimizer`.

    Every parameter becomes a ``MirroredVariable`` named by its ``state_dict``
    key (trainable if it requires gradients); every persistent buffer a
    ``SyncOnReadVariable`` (``MEAN`` if floating-point, else
    ``ONLY_FIRST_REPLICA``), as Keras makes BatchNormalization's moving
    statistics. Convert dtypes before the call (``.double()``); moving the
    distributed module (``.to()``) is refused, as the strategy places it.
    """
    chosen = _strategy_for(strategy, "polydist_torch.distribute_module")
    return DistributedModule(module, chosen, name)


def _init_arguments(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor takes (AdamW's defaults hold
    ``decoupled_weight_decay``, which only Adam's constructor takes); every param group
    carries all of them anyway."""
    try:
        parameters = inspect.signature(type(optimizer).__init__).parameters
    except (TypeError, ValueError):
        return dict(optimizer.defaults)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in parameters}


#: torch's ``Optimizer.zero_grad`` (an optimizer that does not override it runs it).
_TORCH_ZERO_GRAD = torch.optim.Optimizer.zero_grad


def _zero_grad_wrapped(optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
    # torch's own zero_grad outside the replica's default-device mode, as its step is
    # (`_backend._step_pre_hook`; torch has no global zero_grad hook).
    if torch_made(optimizer, "zero_grad"):
        with _OutsideDefaultDevice():
            optimizer.zero_grad(set_to_none=set_to_none)
    else:
        optimizer.zero_grad(set_to_none=set_to_none)


_profiler_enabled: Callable[[], bool] = torch._C._autograd._profiler_enabled


#: Callers that read a DistributedOptimizer's ``param_groups`` in run and need care.
_WATCHED_CALLERS = (torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler)


def _watched_caller(frame: Any) -> Any:
    """The learning-rate scheduler or GradScaler whose method is among the few callers
    nearest ``frame`` (a scheduler's get_lr reads ``param_groups`` from a
    comprehension's frame), else None."""
    for _ in range(4):
        if frame is None:
            return None
        caller = frame.f_locals.get("self")
        if isinstance(caller, _WATCHED_CALLERS):
            return caller
        frame = frame.f_back
    return None


#: Float dtypes whose integers are exact up to any replica count polydist runs.
_EXACT_COUNTS = (torch.float32, torch.float64)


class DistributedOptimizer(torch.optim.Optimizer):
    """One logical ``torch.optim`` optimizer over a :class:`DistributedModule`'s replicas.

    Made by :func:`distribute_optimizer`. ``param_groups``, ``state`` and
    ``defaults`` are the wrapped optimizer's (replica 0's; inside
    ``strategy.run``, ``param_groups`` and ``state`` are the replica's own
    copy's), so learning-rate schedulers and ``for g in opt.param_groups:
    g["lr"] = ...`` work; every replica's copy takes the hyperparameters from
    replica 0's at each ``step``.

    Inside ``strategy.run``: ``zero_grad()`` clears the replica's gradients;
    ``step()`` all-reduces (SUM) the gradients, unless
    :meth:`all_reduce_gradients` already did in this step, and steps the
    replica's copy. Outside ``run``: ``zero_grad()`` clears every replica's
    gradients, ``state_dict()`` is replica 0's (torch's own format; every
    replica holds the same), ``load_state_dict`` loads into every replica.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        # Optimizer.__init__ is not called: the param groups and state are the wrapped
        # optimizer's, not this object's own.
        what = "polydist_torch.distribute_optimizer"
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError(f"{what}: {optimizer!r} is already distributed.")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"{what} takes a torch.optim.Optimizer built on model.parameters(), got "
                f"{type(optimizer).__name__}."
            )
        params = [p for g in optimizer.param_groups for p in g["params"]]
        owners = {id(o): o for p in params if (o := _owner(p)) is not None}
        strays = [p for p in params if _owner(p) is None]
        if any(_OWNERS.get(p) is not None for p in strays):  # type: ignore[no-untyped-call]
            raise ValueError(
                f"{what}: the optimizer holds parameters of a replica other than replica 0; "
                "build it on model.parameters() (outside strategy.run)."
            )
        if strays or not owners:
            shape = tuple(strays[0].shape) if strays else ()
            raise ValueError(
                f"{what}: the optimizer's parameters must be those of distributed modules "
                f"(model.parameters() of polydist_torch.distribute_module(...)); "
                f"{len(strays)} of {len(params)} are not (the first has shape {shape}). Build "
                "the optimizer after distributing the model, on model.parameters()."
            )
        modules = list(owners.values())
        strategy = modules[0].strategy
        if any(m.strategy is not strategy for m in modules):
            raise ValueError(f"{what}: the parameters belong to modules of different strategies.")
        # Each replica-0 parameter -> its copy on every replica.
        copies: dict[torch.Tensor, list[torch.Tensor]] = {}
        for m in modules:
            lists = [list(rm.parameters()) for rm in m.replicas]
            for k, p in enumerate(lists[0]):
                copies[p] = [ps[k] for ps in lists]
        replicas = [optimizer]
        for r in range(1, len(modules[0].replicas)):
            groups = []
            for g in optimizer.param_groups:
                group = {k: v for k, v in g.items() if k != "params"}
                group["params"] = [copies[p][r] for p in g["params"]]
                groups.append(group)
            try:
                clone = type(optimizer)(groups, **_init_arguments(optimizer))
            except TypeError as e:
                raise TypeError(
                    f"{what}: cannot build a copy of {type(optimizer).__name__} per replica "
                    f"as type(optimizer)(param_groups, **optimizer.defaults): {e}"
                ) from e
            clone.defaults = dict(optimizer.defaults)
            replicas.append(clone)
        if optimizer.state:
            # State made by the constructor (Adagrad's sums) or by earlier steps: the same
            # on every copy, on its replica's device.
            for opt in replicas[1:]:
                opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        self._strategy = strategy
        # A strategy's replica count is fixed: one replica in sync sums nothing.
        self._alone = strategy.num_replicas_in_sync == 1
        self._replicas = tuple(replicas)
        self._reduced: dict[int, bool] = {}
        self._bucket: _GradientBucket | None = None
        self._optimizer_step_pre_hooks: dict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Callable[..., Any]] = OrderedDict()
        self._sentinels: list[torch.Tensor | None] = []
        self._accumulated: dict[int, tuple[int, int]] = {}
        # Replicas whose backward() added to gradients already summed (see _watch_gradients).
        self._stale: set[int] = set()
        self._warned_local = False
        # Each GradScaler that stepped this optimizer -> the one replica it belongs to.
        self._scalers: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        if not self._alone:
            self._watch_gradients()

    def _watch_gradients(self) -> None:
        """One parameter per replica (its first) records its gradient's version after
        each backward accumulates into it, so that the sum can tell a gradient changed
        in place after backward (a clip): one hook per replica per step, not per
        parameter. The hooks go with this optimizer."""
        accumulated = self._accumulated  # the hooks hold these, not the optimizer
        reduced, stale = self._reduced, self._stale

        def record(r: int) -> Callable[[torch.Tensor], None]:
            def hook(p: torch.Tensor) -> None:
                if p.grad is not None:
                    accumulated[r] = (id(p.grad), p.grad._version)

            return hook

        def before(r: int, sentinel: weakref.ref[torch.Tensor]) -> Callable[[torch.Tensor], None]:
            # A backward() after the gradients were summed and neither stepped nor zeroed
            # through this optimizer (a step a GradScaler skipped, or all_reduce_gradients()
            # alone): zeroed some other way (model.zero_grad()), they are summed again;
            # added to the sum, they cannot be (it would count N times), so the sum raises.
            def hook(incoming: torch.Tensor) -> None:
                if reduced.get(r):
                    p = sentinel()
                    old = None if p is None else p.grad
                    if old is None or not bool(old.any()):
                        reduced[r] = False
                    else:
                        stale.add(r)

            return hook

        for r in range(len(self._replicas)):
            params = [p for p in self._params(r) if p.requires_grad]
            self._sentinels.append(params[0] if params else None)
            if params:
                handle = params[0].register_post_accumulate_grad_hook(record(r))  # type: ignore[no-untyped-call]
                weakref.finalize(self, handle.remove)
                handle = params[0].register_hook(before(r, weakref.ref(params[0])))  # type: ignore[no-untyped-call]
                weakref.finalize(self, handle.remove)

    def _warn_if_changed_after_backward(self, r: int) -> None:
        """Before summing replica ``r``'s gradients: warns (once) if they were changed
        in place since backward, e.g. clipped: that saw this replica's own gradients."""
        sentinel = self._sentinels[r] if r < len(self._sentinels) else None
        grad = sentinel.grad if sentinel is not None else None
        seen = self._accumulated.get(r)
        if self._warned_local or grad is None or seen is None:
            return
        if seen != (id(grad), grad._version):
            self._warned_local = True
            warnings.warn(
                "DistributedOptimizer: the gradients changed after backward() and before "
                "they were summed across replicas (by clip_grad_norm_ or an in-place edit "
                "of p.grad), so that code saw this replica's own "
                f"gradients, not the sum over the {self._strategy.num_replicas_in_sync} "
                "replicas (DDP sums them during backward; TF sums them in "
                "apply_gradients, after a clip in the replica function, as here). To clip "
                "the global gradients, call optimizer.all_reduce_gradients() first, then "
                "clip, then optimizer.step().",
                LocalGradientWarning,
                stacklevel=_user_stacklevel(),
            )

    # The wrapped optimizer's, so schedulers and hyperparameter edits reach it.
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        r = self._index()
        caller = None if r is None else _watched_caller(sys._getframe(1))
        if isinstance(caller, torch.amp.GradScaler):
            assert r is not None
            self._sum_for_scaler(caller, r)
        elif caller is not None:
            # Stepped on every replica it would advance N times per step, silently.
            raise RuntimeError(
                "A learning-rate scheduler of this DistributedOptimizer ran inside "
                "strategy.run: its step() would run once per replica "
                f"({self._strategy.num_replicas_in_sync} times per training step) and set "
                "each replica's own copy. Create and step it outside strategy.run, once per "
                "step (`strategy.run(train_step, ...); scheduler.step()`): every copy takes "
                "replica 0's hyperparameters at its next step()."
            )
        return self._replicas[r or 0].param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._read_only("param_groups")

    def _sum_for_scaler(self, scaler: Any, r: int) -> None:
        """A GradScaler is about to unscale this replica's gradients and check them for
        inf/NaN: they are summed across replicas first, as TF's LossScaleOptimizer
        aggregates them before its check, so that every replica skips the same steps."""
        first = self._scalers.setdefault(scaler, r)
        if first != r:
            raise RuntimeError(
                f"One torch.amp.GradScaler is used by replicas {first} and {r} of this "
                "DistributedOptimizer: a GradScaler keeps one state per optimizer (unscaled "
                "or not, its inf checks), so the replicas would mix theirs up, and each "
                "replica's update() would change the one scale. Distribute it once, outside "
                "strategy.run: `scaler = polydist_torch.distribute_grad_scaler("
                "torch.amp.GradScaler(...), strategy)` gives each replica its own copy behind "
                "the one object, and the copies stay equal: the gradients are summed before "
                "a scaler checks them, so every replica skips the same steps."
            )
        with _GradMode(False), _OutsideDefaultDevice():
            self._all_reduce_gradients(r)

    @property
    def state(self) -> Any:
        return self._current().state

    @state.setter
    def state(self, value: Any) -> None:
        self._read_only("state")

    @property
    def defaults(self) -> dict[str, Any]:
        return self._replicas[0].defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._read_only("defaults")

    @staticmethod
    def _read_only(name: str) -> None:
        raise AttributeError(
            f"DistributedOptimizer.{name} is the wrapped optimizer's; change its contents "
            "(opt.param_groups[0]['lr'] = ...) or load a state_dict, not the attribute."
        )

    def _current(self) -> torch.optim.Optimizer:
        # Inside strategy.run the replica's own copy, so code that walks
        # opt.param_groups there sees its own parameters and gradients.
        return self._replicas[self._index() or 0]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer (replica 0's copy)."""
        return self._replicas[0]

    @property
    def replicas(self) -> tuple[torch.optim.Optimizer, ...]:
        """The per-replica copies, in local replica order (``replicas[0] is optimizer``)."""
        return self._replicas

    def __repr__(self) -> str:
        replicas = self.__dict__.get("_replicas", ())
        inner = repr(replicas[0]) if replicas else "(not built)"
        return f"DistributedOptimizer({inner}, replicas={len(replicas)})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "A DistributedOptimizer cannot be pickled; save opt.state_dict() (or use "
            "polydist.train.Checkpoint(optimizer=opt))."
        )

    def _index(self) -> int | None:
        return _replica_index(self._strategy, "this DistributedOptimizer")

    def _params(self, r: int) -> list[torch.Tensor]:
        return [p for g in self._replicas[r].param_groups for p in g["params"]]

    def all_reduce_gradients(self) -> None:
        """Sums the replica's gradients across replicas (once per step; replica context).

        ``step()`` calls it; call it yourself to see the global gradients
        before the step (to clip them: ``torch.nn.utils.clip_grad_norm_``).
        A parameter without a gradient on some replicas counts zero there;
        one without a gradient on every replica keeps ``grad=None`` (the
        optimizer skips it, as without polydist).
        """
        r = self._index()
        if r is None:
            raise RuntimeError(
                "DistributedOptimizer.all_reduce_gradients sums gradients across replicas: "
                "call it inside strategy.run, on every replica."
            )
        with _GradMode(False):
            self._all_reduce_gradients(r)

    def _all_reduce_gradients(self, r: int) -> None:
        if self._reduced.get(r):
            if r in self._stale:
                raise RuntimeError(
                    "DistributedOptimizer: backward() added to gradients that were already "
                    "summed across replicas (by all_reduce_gradients(), or a GradScaler's "
                    "unscale_ in a step it then skipped) with no optimizer.zero_grad() or "
                    "step() in between. Summing again would count the summed part "
                    f"{self._strategy.num_replicas_in_sync} times, and not summing would "
                    "leave each replica its own gradients. Call optimizer.zero_grad() after "
                    "every step, a skipped one too, and sum once, after the last backward() "
                    "of the step."
                )
            return
        if self._alone:
            # One replica in sync: the sum is its own gradients, so nothing is copied.
            self._reduced[r] = True
            return
        self._warn_if_changed_after_backward(r)
        params = self._params(r)
        if not params:
            self._reduced[r] = True
            return
        if len(self._replicas) == 1 and self._bucket_sum(params):
            self._reduced[r] = True
            return
        if r:
            for p0, p in zip(self._params(0), params):
                if not p0.requires_grad and p.grad is not None:
                    p.grad = None  # frozen on replica 0 (the model's own): no gradient
        ctx = pd.get_replica_context()
        assert ctx is not None
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        # The flags travel in the gradients' pack when they share a float dtype that
        # counts replicas exactly: a pack of their own would be a second collective
        # (and, across workers, a second check's round trip) per step.
        dtype = grads[0].dtype
        same = dtype in _EXACT_COUNTS and all(g.dtype == dtype for g in grads)
        has_grad = torch.tensor(
            [p.grad is not None for p in params],
            dtype=dtype if same else torch.int32,
            device=params[0].device,
        )
        if any(g.is_sparse for g in grads):
            raise NotImplementedError(
                "DistributedOptimizer: sparse gradients (nn.Embedding(sparse=True)) cannot be "
                "all-reduced yet; use dense gradients."
            )
        summed = ctx.all_reduce(pd.ReduceOp.SUM, [has_grad, *(g.detach() for g in grads)])
        counts = [int(c) for c in summed[0].tolist()]
        with torch.no_grad():
            for p, count, total in zip(params, counts, summed[1:]):
                if count == 0:
                    p.grad = None
                elif p.grad is None:
                    p.grad = total.detach().to(p.device).clone()
                else:
                    p.grad.copy_(total)
        self._reduced[r] = True

    def _bucket_sum(self, params: list[torch.Tensor]) -> bool:
        """With one replica per worker process: the gradients summed in place in this
        optimizer's own flat bucket (`_GradientBucket`), as DDP does; ``False`` where the
        engine or the parameters do not allow it (then the general path sums them)."""
        if is_tracing():  # a collective trace records the general path's collective
            return False
        bucket = self._bucket
        if bucket is None or not bucket.fits(params):
            if bucket is not None:
                bucket.remove()
            bucket = self._bucket = _GradientBucket.build(self._strategy, params)
            if bucket is None:
                return False
        bucket.sum(params)  # outside autograd (the callers): a copy in records no history
        return True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """All-reduces the gradients (SUM) and steps this replica's copy (replica context)."""
        if (
            len(self._replicas) == 1
            and closure is None
            and not self._optimizer_step_pre_hooks
            and not self._optimizer_step_post_hooks
            and _replica_index(self._strategy, "this DistributedOptimizer") == 0
        ):
            # The process's one replica, inside run (a one-replica strategy, or a worker
            # process's replica): `_step` without its questions, the per-step path. With one
            # replica in sync the sum is its own gradients, so the step is the wrapped
            # optimizer's, on the very .grad tensors backward() made.
            opt = self._replicas[0]
            # torch's own step leaves the default-device mode anyway (its global hook,
            # `_backend._step_pre_hook`); here, the per-step path, its profiler range and
            # the grad mode's switches leave it too (4 calls less through the mode).
            outside: Any = _OutsideDefaultDevice() if torch_made(opt, "step") else nullcontext()
            with outside, _GradMode(False):
                if not self._alone:
                    with _OutsideDefaultDevice():  # polydist's own work: devices named
                        self._all_reduce_gradients(0)
                loss = opt.step()
            self._reduced[0] = False
            return loss
        # torch.no_grad as a decorator clones its context at every call: a plain one here.
        with _GradMode(False):
            return self._step(closure)

    def _step(self, closure: Callable[[], Any] | None) -> Any:
        r = self._index()
        if r is None:
            raise RuntimeError(
                "DistributedOptimizer.step() sums the gradients across replicas, so it runs "
                "inside strategy.run, on every replica, after loss.backward() (as TF's "
                "optimizer.apply_gradients in replica context)."
            )
        if closure is not None:
            raise NotImplementedError(
                "DistributedOptimizer.step(closure) is not supported: a closure would "
                "recompute the loss after the gradients were summed."
            )
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        with _OutsideDefaultDevice():
            self._all_reduce_gradients(r)
        replica = self._replicas[r]
        if r:
            # Hyperparameters (lr, ...) come from the wrapped optimizer's groups; a change
            # made inside run to another replica's copy does not count.
            for mine, main in zip(replica.param_groups, self._replicas[0].param_groups):
                for k, v in main.items():
                    if k != "params":
                        mine[k] = v
        loss = replica.step()  # torch's own leaves the mode (_backend._step_pre_hook)
        self._reduced[r] = False
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        r = _replica_index(self._strategy, "this DistributedOptimizer")
        if len(self._replicas) == 1:  # inside run or not, the one copy
            opt, bucket = self._replicas[0], self._bucket
            if bucket is None or not set_to_none:
                _zero_grad_wrapped(opt, set_to_none)
            else:
                if type(opt).zero_grad is _TORCH_ZERO_GRAD and not _profiler_enabled():
                    # torch's own zero_grad(set_to_none=True), without the profiler range
                    # it opens (two dispatcher calls per step) when no profiler listens.
                    for group in opt.param_groups:
                        for p in group["params"]:
                            p.grad = None
                else:
                    opt.zero_grad(set_to_none=True)
                bucket.clear()  # the next backward() finds the bucket zeroed
            self._reduced[0] = False
            self._stale.discard(0)
            return
        chosen = self._replicas if r is None else (self._replicas[r],)
        for opt in chosen:
            _zero_grad_wrapped(opt, set_to_none)
        for i in range(len(self._replicas)) if r is None else (r,):
            self._reduced[i] = False
            self._stale.discard(i)

    def state_dict(self) -> dict[str, Any]:
        """Replica 0's ``state_dict`` (torch's format; every replica holds the same)."""
        if self._index() is not None:
            raise RuntimeError("DistributedOptimizer.state_dict(): call it outside strategy.run.")
        return self._replicas[0].state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads ``state_dict`` (torch's format) into every replica's copy.

        Unlike torch's, it first checks the saved per-parameter state against the
        parameters (torch casts it and fails at a later ``step``, or not at all):

        Raises:
          polydist.checkpoint.CheckpointMismatchError: a saved state tensor does not
            have the shape of this optimizer's state for its parameter: of the same
            tensor in the current state, else, for torch's own optimizers, of the
            parameter (Adam's ``exp_avg``, SGD's ``momentum_buffer``, ...). Nothing
            is loaded.
        """
        if self._index() is not None:
            raise RuntimeError(
                "DistributedOptimizer.load_state_dict(): call it outside strategy.run."
            )
        _check_state_shapes(self._replicas[0], state_dict)
        for opt in self._replicas:
            # torch keeps references into the dict it loads: give each copy its own.
            opt.load_state_dict(copy.deepcopy(state_dict))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "DistributedOptimizer.add_param_group: add the group to the optimizer before "
            "polydist_torch.distribute_optimizer."
        )


# The state that torch.optim's optimizers keep per parameter element (shaped like the
# parameter): {class name: keys}. LBFGS (flat history) and Adafactor (factored row and
# column variances) keep other shapes; optimizers outside torch.optim are unknown.
_ELEMENTWISE_STATE = {
    "SGD": ("momentum_buffer",),
    "Adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "AdamW": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "Adamax": ("exp_avg", "exp_inf"),
    "NAdam": ("exp_avg", "exp_avg_sq"),
    "RAdam": ("exp_avg", "exp_avg_sq"),
    "SparseAdam": ("exp_avg", "exp_avg_sq"),
    "Adagrad": ("sum",),
    "Adadelta": ("square_avg", "acc_delta"),
    "RMSprop": ("square_avg", "momentum_buffer", "grad_avg"),
    "Rprop": ("prev", "step_size"),
    "ASGD": ("ax",),
}


def _elementwise_keys(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    for klass in type(optimizer).__mro__:
        name = klass.__name__
        if name in _ELEMENTWISE_STATE and getattr(torch.optim, name, None) is klass:
            return _ELEMENTWISE_STATE[name]
    return ()


def _check_state_shapes(optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
    """Raises CheckpointMismatchError if ``state_dict``'s per-parameter state does not
    fit ``optimizer``'s parameters (see `DistributedOptimizer.load_state_dict`)."""
    if not isinstance(state_dict, Mapping):
        return  # torch's load_state_dict says what is wrong
    saved_groups, saved_state = state_dict.get("param_groups"), state_dict.get("state")
    groups = optimizer.param_groups
    if (
        not isinstance(saved_groups, list)
        or not isinstance(saved_state, Mapping)
        or [len(g.get("params", ())) for g in saved_groups] != [len(g["params"]) for g in groups]
    ):
        return  # torch checks the groups' sizes, with its own ValueError
    # torch's own pairing: saved parameter ids to parameters, in group order.
    where: dict[Any, tuple[int, int, torch.Tensor]] = {}
    k = 0
    for gi, (saved, group) in enumerate(zip(saved_groups, groups, strict=True)):
        for saved_id, param in zip(saved["params"], group["params"], strict=True):
            where[saved_id] = (gi, k, param)
            k += 1
    elementwise = _elementwise_keys(optimizer)
    problems = []
    for saved_id, entry in saved_state.items():
        if saved_id not in where or not isinstance(entry, Mapping):
            continue  # torch ignores state of unknown ids
        gi, index, param = where[saved_id]
        current = optimizer.state.get(param, {})
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor):
                continue
            now = current.get(key)
            if isinstance(now, torch.Tensor):
                want, what = tuple(now.shape), f"its current {key!r}"
            elif key in elementwise:
                want, what = tuple(param.shape), "the parameter"
            else:
                continue
            if tuple(value.shape) != want:
                problems.append(
                    f"parameter {index} (group {gi}, shape {list(param.shape)}): the saved "
                    f"{key!r} has shape {list(value.shape)}, expected {list(want)} ({what})"
                )
    if problems:
        raise pd.checkpoint.CheckpointMismatchError(
            f"{type(optimizer).__name__} state does not fit this optimizer's parameters:\n"
            + "\n".join(f"  - {p}" for p in problems[:10])
            + "\nNothing was loaded. The state was saved for other parameters (another "
            "model, or its parameters in another order): restore the optimizer state saved "
            "with this model, or keep the fresh optimizer."
        )


class _GradientBucket:
    """A `DistributedOptimizer`'s gradients in one flat buffer that it owns, for a worker
    process whose one replica steps it (``MultiWorkerMirroredStrategy`` with one replica
    per worker): DDP's ``gradient_as_bucket_view``, keeping torch's semantics of
    ``p.grad``.

    Layout: every parameter's gradient (each a tensor of its own on the buffer's memory,
    which becomes ``p.grad``), one has-gradient flag per parameter, and the engine's
    presence flag (``TorchProcessGroupBackend.all_reduce_bucket_``). A hook on each
    parameter runs before autograd accumulates its gradient: where ``p.grad`` is None
    (after ``zero_grad()``), it becomes the bucket's tensor, zeroed, so that
    ``backward()`` accumulates into the bucket in place; a ``p.grad`` kept by
    ``zero_grad(set_to_none=False)`` is the bucket's tensor already. ``step()`` then sums
    the bucket in place with the engine's own ``all_reduce``: no copy in or out. A
    gradient that is another tensor (one you assigned; ``create_graph=True``) is copied
    in, and ``p.grad`` becomes the bucket's tensor; a parameter that got no gradient
    (also one whose hook ran but that ``backward()`` did not accumulate into, as
    ``torch.autograd.grad`` does) counts zero, and keeps ``grad=None`` when no replica
    has one. The memory is reused only while nothing else refers to it: if your program
    kept a gradient of an earlier step (``g = p.grad``, a view, a NumPy array of it),
    the next step takes fresh memory and yours keeps its values. Rebuilt when the
    parameters change (another list, shape, dtype or device).

    A training step's host time is the cost here (two worker processes on two cores
    run with no spare CPU, so every torch call and Python frame adds to the step): the
    optimizer's ``zero_grad()`` zeroes the buffer in one call (`clear`) so that the
    hooks only hand out tensors, and ``step()`` makes two torch calls besides the
    collective (the flags set, then read with the presence flag) when every gradient
    was accumulated in place.
    """

    def __init__(
        self, backend: Any, params: list[torch.Tensor], parts: list[tuple[int, ...]], size: int
    ) -> None:
        self.backend = backend
        self.params = params
        self.layout = [(p.shape, p.dtype, p.device) for p in params]
        self.parts = parts
        self._everyone = float(size)  # a flag's sum when every replica has the gradient
        self.total = sum(p.numel() for p in params)
        self.flat = torch.empty(0)
        self.grads: list[torch.Tensor] = []
        self.flags = self.marks = self.flat
        # zeroed[i]: grads[i] holds zeros (the hook need not zero it); `_dirty` when none
        # is known to (a list nothing writes True into).
        self._dirty = [False] * len(params)
        self.zeroed = self._dirty
        self._allocate()
        # Hook-installed gradients' versions: unchanged at step() means not accumulated.
        self.installed: dict[int, int] = {}
        self.checked = False  # memory checked for other holders since the last step
        me = weakref.ref(self)
        self.handles = [
            p.register_hook(_installer(me, i))  # type: ignore[no-untyped-call]
            for i, p in enumerate(params)
        ]

    def _allocate(self) -> None:
        first, k = self.params[0], len(self.params)
        flat = torch.zeros(self.total + k + 1, dtype=first.dtype, device=first.device)
        grads, offset = [], 0
        for p in self.params:
            own = torch.empty(0, dtype=flat.dtype, device=flat.device)
            grads.append(own.set_(flat.untyped_storage(), offset, p.shape, ()))
            offset += p.numel()
        self.flat, self.grads = flat, grads
        self.zeroed = [True] * k
        self.flags = flat[self.total : self.total + k]
        self.marks = flat[self.total :]  # the flags and the presence flag
        self._storage_uses = _storage_uses(flat)
        own = grads[0]
        self._grad_refs = sys.getrefcount(own)  # as `private` counts: the list, a local

    @classmethod
    def build(cls, strategy: pd.Strategy, params: list[torch.Tensor]) -> _GradientBucket | None:
        from polydist_torch._multi_worker import TorchProcessGroupBackend

        if _STORAGE_USE_COUNT is None:  # no way to tell whether the memory is shared
            return None
        group = replica_group(strategy)
        backend = group.backend
        if not isinstance(backend, TorchProcessGroupBackend) or len(group.devices) != 1:
            return None
        first = params[0]
        if not backend.owns_buckets(first.dtype) or first.dtype not in _EXACT_COUNTS:
            return None
        if any(p.dtype != first.dtype or p.device != first.device for p in params):
            return None
        if len({id(p) for p in params}) != len(params):
            return None  # a parameter listed twice
        parts = [tuple(p.shape) for p in params] + [(len(params),)]
        return cls(backend, list(params), parts, group.size)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def fits(self, params: list[torch.Tensor]) -> bool:
        if len(params) != len(self.params):
            return False
        for p, q, (shape, dtype, device) in zip(params, self.params, self.layout):
            if p is not q or p.shape != shape or p.dtype != dtype or p.device != device:
                return False
        return True

    def private(self) -> bool:
        """Before the bucket writes into its tensors that are not ``p.grad`` (zeroing one
        for autograd, copying a gradient in): if anything else refers to the memory (a
        gradient of an earlier step the program kept, a view of it), fresh memory (zeros),
        and True. (A tensor that is ``p.grad`` is summed in place, as ``step()``
        promises.)"""
        self.checked = True
        shared = _storage_uses(self.flat) != self._storage_uses
        grads, params = self.grads, self.params
        for i in range(len(grads)):  # no zip: its reused tuple would hold a reference
            if shared:
                break
            own = grads[i]
            if params[i].grad is not own:
                shared = sys.getrefcount(own) != self._grad_refs
        if shared:
            self._allocate()  # what the program holds keeps its values
        return shared

    def clear(self) -> None:
        """After ``zero_grad()`` set every ``p.grad`` to None: the buffer's gradients
        zeroed in one call (fresh memory if the program holds any of them), so that the
        hooks of the next ``backward()`` hand them out as they are."""
        for p in self.params:
            if p.grad is not None:
                return  # set back by a hook or the program: the hooks zero as they go
        if not self.private():
            self.flat.zero_()
            self.zeroed = [True] * len(self.grads)

    def sum(self, params: list[torch.Tensor]) -> None:
        """Sums the gradients over the workers (outside autograd), in place."""
        grads = self.grads
        installed, self.installed = self.installed, {}
        self.zeroed = self._dirty
        # Every p.grad the bucket's, accumulated into: nothing to write first.
        fast = _all_own(params, grads)
        if fast:
            for i, version in installed.items():
                if grads[i]._version == version:  # hooked, never accumulated
                    fast = False
                    break
        missing: list[int] = []
        if not fast:
            missing = self._gather(params, installed)
            grads = self.grads  # fresh memory if the program held the old
        self.marks.fill_(1)
        for i in missing:
            self.flags[i] = 0
        summed = self.backend.all_reduce_bucket_(self.flat, self.parts, self.marks)
        self.checked = False
        if fast and min(summed) == self._everyone:
            return  # every worker had every gradient (the common case): p.grad is the sum
        for i, (p, own) in enumerate(zip(params, grads)):
            if summed[i] == 0:
                p.grad = None  # no gradient on any replica: the optimizer skips it
            elif p.grad is not own:
                p.grad = own

    def _gather(self, params: list[torch.Tensor], installed: dict[int, int]) -> list[int]:
        """Brings every gradient into the bucket (copied in, or zero where there is none)
        and returns the parameters without one."""
        grads = self.grads
        if not self.checked and any(p.grad is not own for p, own in zip(params, grads)):
            self.private()  # about to zero or copy into a tensor that is not p.grad
            grads = self.grads
        missing: list[int] = []
        for i, (p, own) in enumerate(zip(params, grads)):
            g = p.grad
            if g is own:
                if installed.get(i, -1) == own._version:  # hooked, never accumulated
                    p.grad = None
                    missing.append(i)
                continue  # accumulated in place by backward()
            if g is None:
                own.zero_()
                missing.append(i)
            else:
                if g.is_sparse:
                    raise NotImplementedError(
                        "DistributedOptimizer: sparse gradients (nn.Embedding(sparse=True)) "
                        "cannot be all-reduced yet; use dense gradients."
                    )
                own.copy_(g)
        return missing


def _all_own(params: list[torch.Tensor], grads: list[torch.Tensor]) -> bool:
    """Whether every ``params[i].grad`` is ``grads[i]``. (A function of its own: a loop
    variable left in the caller would hold a gradient, which `_GradientBucket.private`
    counts as the program's. A loop, not all(...): a generator resumes once per element.)"""
    for i in range(len(grads)):  # noqa: SIM110
        if params[i].grad is not grads[i]:
            return False
    return True


def _installer(bucket: weakref.ref[_GradientBucket], i: int) -> Callable[[torch.Tensor], None]:
    """Parameter ``i``'s hook: autograd is about to accumulate its gradient. Where
    ``p.grad`` is None, it becomes the bucket's tensor, zeroed. (One frame: it runs for
    every parameter at every step.)"""

    def hook(grad: torch.Tensor) -> None:
        owner = bucket()
        if owner is None:
            return
        p = owner.params[i]
        if p.grad is not None:
            return
        if not owner.checked:
            owner.private()
        own = owner.grads[i]
        try:
            p.grad = own
        except RuntimeError:
            return  # a changed parameter (shape, dtype, device): step() rebuilds the bucket
        zeroed = owner.zeroed
        if zeroed[i]:
            zeroed[i] = False
        else:
            own.zero_()
        owner.installed[i] = own._version

    return hook


#: How many tensors (and storage objects) share a storage (see ``_host_all_reduce``).
_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _storage_uses(tensor: torch.Tensor) -> int:
    assert _STORAGE_USE_COUNT is not None
    count: int = _STORAGE_USE_COUNT(tensor.untyped_storage()._cdata)
    return count


def distribute_optimizer(optimizer: torch.optim.Optimizer) -> DistributedOptimizer:
    """One ``torch.optim`` optimizer that steps every replica's copy of a distributed module.

    Build the optimizer as usual on ``model.parameters()`` of a
    :class:`DistributedModule` (replica 0's parameters), then wrap it::

        opt = polydist_torch.distribute_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3))

    The library makes one copy per replica (``type(optimizer)(param_groups,
    **defaults)``, with the defaults its constructor takes, as every
    ``torch.optim`` optimizer allows) and gives it the optimizer's state, if it
    has any (Adagrad's sums, or earlier steps). In
    ``strategy.run``, ``opt.step()`` sums the gradients across replicas and
    then steps the replica's copy: so scale the loss as TF does, by the
    *global* batch size (``polydist.nn.compute_average_loss``), not with a
    per-replica mean.
    """
    return DistributedOptimizer(optimizer)
