"""The variable-related members of ``StrategyExtended`` (TF's V2 and V1 APIs).

``StrategyExtended`` inherits them from :class:`ExtendedVariablesMixin`, so
every strategy has them; a strategy changes how its variables are made by
overriding ``_create_variable`` (see ``polydist._valuetypes.variables.create_variable``
for the default) or by setting ``_distributed_variables = False`` (a plain
variable on the strategy's only device, as ``OneDeviceStrategy`` does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

from polydist._base.arrays import convert_to_array
from polydist._collectives import cross_device_ops as _cross_device_ops
from polydist._strategies import context as _context
from polydist._valuetypes import variables as _variables
from polydist._valuetypes.values import select_replica, value_container

if TYPE_CHECKING:
    from polydist._strategies.strategy import StrategyExtended

__all__ = ["ExtendedVariablesMixin"]


class ExtendedVariablesMixin:
    """Variables, updates and the V1 members of ``StrategyExtended``."""

    #: False: variables are plain single-copy variables on the strategy's device.
    _distributed_variables = True

    def _ext(self) -> StrategyExtended:
        return cast("StrategyExtended", self)

    def _is_default(self) -> bool:
        return self._ext()._container_strategy() is _context._get_default_mode().strategy

    # -- creation ------------------------------------------------------------------------------
    def _create_variable(self, **kwargs: Any) -> Any:
        """Creates a variable for ``polydist.Variable(...)`` under this strategy.

        Keyword arguments: ``initial_value``, ``trainable``, ``name``,
        ``dtype``, ``synchronization``, ``aggregation`` (already validated).
        Called in cross-replica context, once per variable.
        """
        return _variables.create_variable(self._ext(), **kwargs)

    def variable_created_in_scope(self, v: Any) -> bool:
        """True if ``v`` was created while this strategy's scope was active."""
        strategy = getattr(v, "_distribute_strategy", None)
        if not isinstance(v, _variables.Variable):
            return False
        if self._is_default():
            return strategy is None
        return strategy is self._ext()._container_strategy()

    def colocate_vars_with(self, colocate_with_variable: Any) -> AbstractContextManager[Any]:
        """A context manager: variables created inside it live on the same devices as
        ``colocate_with_variable``. Must be called inside this strategy's scope."""
        ext = self._ext()
        strategy = ext._container_strategy()
        m = _context.current_mode()
        if m.strategy is not strategy:
            _context.wrong_strategy_scope(strategy, m)
        if not self._is_default():
            ok = getattr(colocate_with_variable, "_distribute_strategy", None) is strategy
            if self._distributed_variables:
                ok = ok and isinstance(colocate_with_variable, _variables.DistributedVariable)
            if not ok:
                raise ValueError(
                    "`colocate_vars_with` must only be passed a variable created in this "
                    f"tf.distribute.Strategy.scope(), not: {colocate_with_variable!r}"
                )
        return _variables.colocate_scope(colocate_with_variable)

    def value_container(self, value: Any) -> Any:
        """The distributed variable a component belongs to (else ``value`` itself)."""
        return value_container(value)

    # -- updates ---------------------------------------------------------------------------------
    def update(
        self,
        var: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """Calls ``fn(component, *args, **kwargs)`` on each component of ``var``.

        Mirrored values in ``args``/``kwargs`` are replaced by the component's
        copy. Returns the results regrouped (a ``Mirrored`` of them by
        default; with ``group=False`` a tuple per result, one element per
        replica). In replica context it goes through ``merge_call``, so every
        replica must call it.
        """
        ext = self._ext()
        strategy = ext._container_strategy()
        kwargs = {} if kwargs is None else dict(kwargs)
        m = _context.current_mode()
        ctx = m.replica_context
        if ctx is not None and not _context.is_default_mode(m) and m.strategy is strategy:

            def merge_fn(strategy: Any, *merged_args: Any, **merged_kwargs: Any) -> Any:
                return strategy.extended.update(var, fn, merged_args, merged_kwargs, group=group)

            return ctx.merge_call(merge_fn, args=tuple(args), kwargs=kwargs)
        _context.require_cross_replica_or_default_context(strategy)
        with _variables._enter_strategy(strategy):
            return _variables.update_components(ext, var, fn, tuple(args), kwargs, group)

    def update_non_slot(
        self,
        colocate_with: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """Runs ``fn(*args, **kwargs)`` once per device of ``colocate_with`` (from
        ``non_slot_devices``), each as an update of that replica (TF V1)."""
        ext = self._ext()
        strategy = ext._container_strategy()
        _context.require_cross_replica_or_default_context(strategy)
        kwargs = {} if kwargs is None else dict(kwargs)
        if self._is_default() or isinstance(colocate_with, str | _variables.Variable):
            with _variables.update_context(0):
                result = fn(*args, **kwargs)
            return result if group else _variables.update_regroup(ext, [result], False)
        devices = tuple(colocate_with)
        results = []
        with _variables._enter_strategy(strategy):
            for i, device in enumerate(devices):
                with _variables.update_context(i), ext._backend.device_scope(device):
                    results.append(
                        fn(
                            *select_replica(i, tuple(args)),
                            **select_replica(i, kwargs),
                        )
                    )
        return _variables.update_regroup(ext, results, group)

    def non_slot_devices(self, var_list: Sequence[Any]) -> Any:
        """Where to put variables that are not slots of another variable (TF V1): the
        replica devices (OneDevice: its device; default strategy: the variable of
        ``var_list`` with the smallest name; TPUStrategy overrides it: the host)."""
        if self._is_default():
            return min(var_list, key=lambda x: x.name)
        ext = self._ext()
        if not self._distributed_variables:
            return ext._devices[0]
        return tuple(ext._devices)

    def read_var(self, v: Any) -> Any:
        """The value of ``v`` in cross-replica context: the aggregate of a
        ``SyncOnReadVariable``, a copy of any other variable's value."""
        if isinstance(v, _variables.SyncOnReadVariable):
            return v._get_cross_replica()
        if isinstance(v, _variables.Variable):
            return v.read_value()
        return convert_to_array(v)

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """Copies ``tensor`` to the devices of ``destinations`` (a device string gives one
        array, a distributed value or variable a ``Mirrored``). Python numbers are
        returned as they are, so that the variable's dtype decides their type (TF)."""
        ext = self._ext()
        _context.require_cross_replica_or_default_context(ext._container_strategy())
        if destinations is None or isinstance(destinations, list | tuple):
            raise ValueError(
                "broadcast_to needs destinations: a device string, a distributed value or a "
                f"variable, got {destinations!r}."
            )
        if isinstance(tensor, float | int):
            return tensor
        if self._is_default():
            return tensor
        ops = ext._cross_device_ops
        if ops is not None:
            with _cross_device_ops.active(ext):
                return ops.broadcast(tensor, destinations)
        _cross_device_ops.validate_destinations(destinations)
        return _cross_device_ops.simple_broadcast(ext._backend, tensor, destinations)

    # -- V1 properties ---------------------------------------------------------------------------
    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker should save checkpoints (the chief only, when multi-worker)."""
        return bool(getattr(self, "_is_chief", True))

    @property
    def should_save_summary(self) -> bool:
        """Whether this worker should write summaries (the chief only, when multi-worker)."""
        return bool(getattr(self, "_is_chief", True))

    @property
    def experimental_should_init(self) -> bool:
        """Whether this worker should run variable initializers (always, in TF 2)."""
        return True

    @property
    def experimental_between_graph(self) -> bool:
        """Whether each worker runs its own copy of the program (multi-worker strategies)."""
        return bool(getattr(self, "_between_graph", False))
