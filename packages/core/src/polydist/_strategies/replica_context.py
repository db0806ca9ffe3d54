"""``ReplicaContext``: what code running on one replica sees."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from polydist._base.arrays import check_summable, convert_to_array, is_array, mean_from_sum
from polydist._base.communication import call_options, check_call_options
from polydist._base.devices import HOST_DEVICE
from polydist._base.reduce_op import ReduceOp, as_reduce_op
from polydist._strategies import context as _context
from polydist._valuetypes import nest as _nest
from polydist._valuetypes.indexed_slices import IndexedSlices
from polydist.backend._contract import ReplicaChannel, SupportsLibraryScope, features
from polydist.errors import InvalidArgumentError

if TYPE_CHECKING:
    from polydist._strategies.strategy import Strategy

__all__ = ["LazyReplicaId", "ReplicaContext"]


class LazyReplicaId:
    """A replica id placed on its device only when the replica asks for it
    (``ReplicaContext.replica_id_in_sync_group``): most steps never do, and each
    placement is a host-to-device copy. Placed once per run, never shared between runs
    (a torch tensor can be changed in place: ``rid += 1``)."""

    __slots__ = ("_backend", "_device", "_index")

    def __init__(self, backend: Any, index: int, device: str) -> None:
        self._backend = backend
        self._index = index
        self._device = device

    def place(self) -> Any:
        return self._backend.place(np.asarray(self._index, dtype=np.int32), self._device)


class ReplicaContext:
    """The context of one replica inside ``strategy.run``.

    Get it with ``polydist.get_replica_context()``. Its collectives
    (``all_reduce``, ``all_gather``, ``merge_call``) must be called by every
    replica, in the same order, with the same shapes and dtypes; on the
    simulator a disagreement raises ``CollectiveMismatchError`` instead of
    hanging.
    """

    def __init__(
        self,
        strategy: Strategy,
        replica_id_in_sync_group: Any,
        *,
        channel: ReplicaChannel | None = None,
        replica_index: int | None = None,
    ) -> None:
        self._strategy = strategy
        self._replica_id_in_sync_group = replica_id_in_sync_group
        if replica_index is None and isinstance(replica_id_in_sync_group, int):
            replica_index = replica_id_in_sync_group
        self._replica_index = replica_index
        self._channel = channel
        self._depth = 0

    def __enter__(self) -> ReplicaContext:
        _context.push_mode(_context._Mode(self._strategy, self, None))
        return self

    def __exit__(self, *exc: object) -> None:
        _context.pop_mode()

    @property
    def strategy(self) -> Strategy:
        """The strategy this replica belongs to."""
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas that take part in each collective."""
        return self._strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> Any:
        """This replica's id in ``0..num_replicas_in_sync-1``, as an int32 array.

        Like TF, it is a (0-d) array, not a Python int: in a compiled (SPMD)
        backend it is a traced value.
        """
        replica_id = self._replica_id_in_sync_group
        if type(replica_id) is LazyReplicaId:
            replica_id = self._replica_id_in_sync_group = replica_id.place()
        return replica_id

    @property
    def devices(self) -> tuple[str, ...]:
        """Deprecated in TF: the devices of this replica (in the default replica context,
        the current device: the host's CPU, as TF's ``(device_util.current(),)``)."""
        if self._strategy is _context._get_default_mode().strategy:
            return (HOST_DEVICE,)
        if self._replica_index is None:
            raise RuntimeError("devices is not available in a compiled (SPMD) replica context.")
        return (self._strategy.extended.worker_devices[self._replica_index],)

    def merge_call(
        self,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Runs ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context.

        The ``args`` and ``kwargs`` of all replicas are regrouped first, so a
        value that differs between replicas arrives as a ``PerReplica``. The
        result is handed back to every replica, with each ``PerReplica`` in it
        replaced by that replica's component.
        """
        _context.require_replica_context(self)
        if not callable(merge_fn):
            raise TypeError(
                "merge_fn must be a callable, called as merge_fn(strategy, *args, **kwargs) in "
                f"cross-replica context; got {type(merge_fn).__name__} {merge_fn!r}. Pass the "
                "function itself: get_replica_context().merge_call(merge_fn, args=(...))."
            )
        kwargs = {} if kwargs is None else dict(kwargs)
        if self._channel is None:
            strategy = self._strategy
            with _context.mode(strategy, None, strategy):
                return merge_fn(strategy, *args, **kwargs)
        return self._channel.merge_call(merge_fn, tuple(args), kwargs)

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: Any = None) -> Any:
        """Reduces ``value`` (a nest of arrays) across all replicas.

        Every replica gets the result. MEAN of integers gives float64, as in
        TF. The gradient of an all-reduce is the all-reduce of the upstream
        gradient (on backends with autodiff). ``options``, a
        ``CommunicationOptions``, is merged over the strategy's as in TF: its
        ``bytes_per_pack`` packs this nest across workers (its
        ``timeout_seconds`` is not applied: see docs/multi-host.md).
        """
        _context.require_replica_context(self)
        reduce_op = as_reduce_op(reduce_op)
        check_call_options(options)
        if self._channel is None:  # one replica: the value is its own sum, read at the call
            return _read_copies(value)
        scope = self._library_scope()
        if scope is None:
            return self._all_reduce(reduce_op, value, options)
        with scope:
            return self._all_reduce(reduce_op, value, options)

    def _library_scope(self) -> AbstractContextManager[Any] | None:
        """The backend's scope for core's own work in this replica's collectives
        (`polydist.backend.SupportsLibraryScope`), or None."""
        backend = self._strategy.extended._backend
        if features(backend).library_scope:
            return cast(SupportsLibraryScope, backend).library_scope()
        return None

    def _all_reduce(self, reduce_op: ReduceOp, value: Any, options: Any) -> Any:
        assert self._channel is not None
        # One flatten; a variable contributes this replica's copy (its current array).
        if is_array(value):  # the common case (a variable included) skips flattening
            flat, spec = [_operand(value)], None
        else:
            flat, spec = _nest.flatten(value)
            flat = [_operand(x) for x in flat]
        arrays = [convert_to_array(x) for x in flat]
        check_summable(reduce_op, arrays)
        if options is None:  # the common case: no context manager to enter
            summed = self._channel.all_reduce(reduce_op, arrays)
        else:
            with call_options(options):  # its bytes_per_pack packs this nest
                summed = self._channel.all_reduce(reduce_op, arrays)
        n = self.num_replicas_in_sync
        if reduce_op is ReduceOp.MEAN and n > 1:
            xp = self._strategy.extended._backend.array_namespace()
            summed = [mean_from_sum(xp, s, n) for s in summed]
        return summed[0] if spec is None else _nest.unflatten(spec, summed)

    def all_gather(self, value: Any, axis: int, options: Any = None) -> Any:
        """Concatenates ``value`` (a nest of arrays) from all replicas along ``axis``.

        Every replica gets the result. Sizes along ``axis`` may differ between
        replicas (except on TPU); other dimensions must match. ``IndexedSlices``
        raise ``NotImplementedError``, as in TF.
        """
        _context.require_replica_context(self)
        check_call_options(options)
        scope = None if self._channel is None else self._library_scope()
        if scope is None:
            return self._all_gather(value, axis)
        with scope:
            return self._all_gather(value, axis)

    def _all_gather(self, value: Any, axis: int) -> Any:
        flat, spec = _nest.flatten(_variables_snapshot(value))
        for x in flat:
            if isinstance(x, IndexedSlices):
                raise NotImplementedError(
                    "all_gather does not support IndexedSlices (TF), got one. all_gather "
                    "its values and its indices separately (every replica's rows, in replica "
                    "order), or pass a dense array."
                )
        arrays = [convert_to_array(x) for x in flat]
        for a in arrays:
            _check_gather_axis(a, axis)
        if self._channel is None:
            return value
        gathered = self._channel.all_gather(arrays, axis)
        return _nest.unflatten(spec, gathered)

    def _update(
        self,
        var: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """Updates every component of ``var`` with ``fn`` from replica context (TF's
        private ``ReplicaContext._update``): a ``merge_call`` into
        ``strategy.extended.update``. Not exported, as in TF."""

        def merge_fn(strategy: Strategy, *merged_args: Any, **merged_kwargs: Any) -> Any:
            return strategy.extended.update(var, fn, merged_args, merged_kwargs, group=group)

        return self.merge_call(merge_fn, args=tuple(args), kwargs=kwargs)

    def __repr__(self) -> str:
        return (
            f"ReplicaContext(replica={self._replica_index}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


def _read_copies(value: Any) -> Any:
    from polydist._valuetypes.variables import read_copies  # see _variables_snapshot

    return read_copies(value)


def _variables_snapshot(value: Any) -> Any:
    from polydist._valuetypes.variables import snapshot  # _variables imports this module's users

    return snapshot(value)


_variable_type: type | None = None


def _operand(leaf: Any) -> Any:
    """A leaf as an all_reduce sends it: a variable's current array, else itself."""
    global _variable_type
    if _variable_type is None:  # _variables imports this module's users: resolve lazily
        from polydist._valuetypes.variables import Variable

        _variable_type = Variable
    return cast(Any, leaf)._operand() if isinstance(leaf, _variable_type) else leaf


def _check_gather_axis(a: Any, axis: int) -> None:
    rank = len(a.shape)
    if rank == 0:
        raise InvalidArgumentError(
            "all_gather/gather need arrays of rank >= 1, got a scalar: there is no axis to "
            "concatenate along. Reshape it to shape [1] first."
        )
    if not -rank <= axis < rank:
        raise InvalidArgumentError(
            f"axis {axis} is out of range for a value of rank {rank}: expected "
            f"{-rank} <= axis < {rank}."
        )


class _DefaultReplicaContext(ReplicaContext):
    """The replica context of the default strategy: one replica, no communication."""

    def __init__(self, strategy: Strategy) -> None:
        super().__init__(strategy, 0, channel=None, replica_index=0)

    @property
    def replica_id_in_sync_group(self) -> Any:
        return np.asarray(0, dtype=np.int32)
