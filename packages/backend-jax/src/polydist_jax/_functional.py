"""Variables inside a compiled ``run``: passed in as traced values, new values out.

A compiled run is one trace for all replicas, and the trace must not change
Python state. So every variable the replica function can touch (see
:func:`collect`) is *functionalized*: the program takes each variable's
per-device copies as an input sharded over the replica mesh, so every
replica gets its own copy, and returns the new copy of each variable it
wrote. While ``fn`` is traced, each copy's storage (core's
``_read_storage``/``_write_storage`` hook, reached through
``polydist.backend.tracing.swap_storage``) holds traced values, and core's
variable code runs unchanged on them; afterwards the concrete arrays are put
back (also when tracing fails), and the program's outputs replace the copies
that were written.

Inside the trace one replica's program stands for every replica, so a
distributed variable's copies are shown in two *views*:

* **replica view** (``fn`` in replica context): every component holds this
  replica's own copy, and core addresses component 0 (it enters
  ``traced_replica_scope(0)``): reads and replica-context writes (NONE
  aggregation, ``ON_READ``) act on the replica's own copy.
* **merge view** (``merge_fn``, cross-replica context): component ``k``
  holds copy ``k`` as every replica sees it (one ``all_gather``, which XLA
  drops when nothing reads it; reductions of the copies find it and become
  one ``psum``). So reads are exactly the sim's: replica 0's copy, the
  SUM/MEAN of the copies. An update of copy ``k`` (``extended.update``,
  ``update_non_slot``: core runs it under ``update_context(k)`` and the
  backend's ``device_scope``) is computed from the own copy, because only
  replica ``k`` keeps it: leaving ``merge_fn``, each replica takes its own
  index's result. When all copies got the same update (the common case:
  an aggregated update of a ``MirroredVariable``) the programs are identical
  and XLA keeps one. The results of such an update (``extended.update``
  returns them) become copy ``k``'s result as every replica sees it (a
  gather, dropped when unused), except where each replica takes its own
  index's result, which uses the result directly.
"""

from __future__ import annotations

import functools
import inspect
import operator
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import jax.numpy as jnp
from jax import lax

from polydist import Variable
from polydist.backend import nest as _nest
from polydist.backend import tracing as _tracing
from polydist.backend.context import container_strategy
from polydist.backend.tracing import (
    deferred_storage,
    storage_arrays,
    swap_storage,
    tracked_variables,
)
from polydist.backend.values import DistributedVariable, variable_backend
from polydist_jax._lazy import AXIS, LazyPerReplica, is_tracer, is_varying, varies_locally, vary

__all__ = [
    "COMPONENT",
    "fingerprint",
    "TracedVariables",
    "active",
    "collect",
    "is_jax_variable",
    "pick_local",
]

#: The component a distributed variable acts as in the replica view.
COMPONENT = 0

_CREATED_TRACED = (
    "polydist (jax backend): merge_fn created {name!r} from traced values inside a compiled "
    "strategy.run. Create variables under strategy.scope() before calling run, create "
    "them in fn (replica context) from concrete initial values, or run eagerly with "
    "JaxBackend(jit=False)."
)


def is_jax_variable(x: object) -> bool:
    """A ``polydist.Variable`` (plain or distributed) that holds jax arrays."""
    return isinstance(x, Variable) and getattr(variable_backend(x), "name", None) == "jax"


def owner(extended: Any) -> Any:
    """The strategy's own ``StrategyExtended`` (a runner view, e.g. a simulated
    multi-worker strategy's, is another object with the same state)."""
    return container_strategy(extended).extended


def collect(
    extended: Any, n: int, fn: Callable[..., Any], arg_leaves: Sequence[Any]
) -> list[Variable]:
    """The variables a compiled run of ``fn`` functionalizes, in a stable order.

    Every live distributed variable the strategy created (``tracked_variables``:
    variables captured by ``fn``'s closure, or reached through any object, are
    found this way), then plain jax variables passed as arguments or captured
    directly by ``fn``'s closure (inputs that fn may read but not write).
    """
    found: list[Variable] = []
    seen: set[int] = set()
    for v in tracked_variables(owner(extended)):
        if isinstance(v, DistributedVariable) and len(v.values) == n:
            found.append(v)
            seen.add(id(v))
    captured = []
    # unwrap: a strategy's wrapper (TPUStrategy's InReplicaContext) has no closure itself.
    for cell in getattr(inspect.unwrap(fn), "__closure__", None) or ():
        try:
            captured.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    for x in [*arg_leaves, *captured]:
        if not isinstance(x, Variable) or isinstance(x, DistributedVariable) or id(x) in seen:
            continue
        if not is_jax_variable(x):
            raise NotImplementedError(
                f"fn uses {x!r}, a plain variable of the {variable_backend(x).name!r} "
                "backend, which a compiled jax run cannot read. Create it under the strategy's "
                "scope (or with the jax backend), or pass its value as an array."
            )
        found.append(x)
        seen.add(id(x))
    return found


def pick_local(values: Sequence[Any]) -> Any:
    """``values[r]`` on replica ``r``: one value per replica, each meaningful on its own.

    A chain of selects on the replica index rather than ``stack(values)[r]``: where
    the values are computed the same way, XLA merges them and the selects vanish.
    """
    traced = active()
    if traced is not None:
        values = [traced.raw(v) for v in values]
    first = values[0]
    if all(v is first for v in values[1:]):
        return first
    r = lax.axis_index(AXIS)
    arrays = [jnp.asarray(v) for v in values]
    out = arrays[-1]
    for k in range(len(arrays) - 2, -1, -1):
        out = jnp.where(r == k, arrays[k], out)
    return out


def fingerprint(x: Any) -> Any:
    """Two uint32 hashes of ``x``'s bits (shape ``[2]``): equal copies give equal
    fingerprints on every device (integer sums wrap, in any order), and copies that
    differ in one element always differ in the first hash."""
    x = jnp.ravel(x)
    if jnp.iscomplexobj(x):
        x = jnp.concatenate([jnp.real(x), jnp.imag(x)])
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    elif x.dtype.itemsize >= 4:
        bits = jnp.ravel(lax.bitcast_convert_type(x, jnp.uint32))
    else:
        unsigned = jnp.uint8 if x.dtype.itemsize == 1 else jnp.uint16
        bits = lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    i = lax.iota(jnp.uint32, bits.shape[0])
    first = jnp.sum(bits * (2 * i + 1), dtype=jnp.uint32)  # odd weights: invertible
    mixed = (bits ^ (i * jnp.uint32(0x9E3779B9))) * jnp.uint32(0x85EBCA6B)
    second = jnp.sum(mixed ^ (mixed >> 13), dtype=jnp.uint32)
    return jnp.stack([first, second])


def _as_varying(x: Any) -> Any:
    return vary(x)


@dataclass(eq=False)
class _Slot:
    """One variable while a program is traced."""

    var: Variable
    distributed: bool
    n: int
    entry: Any  # the traced input: this replica's copy as the run began
    own: Any = None  # this replica's copy now (replica view)
    # Merge view. local[k]: copy k as replica k computes it (only meaningful there);
    # view[k]: what component k holds, copy k as every replica sees it.
    local: list[Any] = field(default_factory=list)
    view: list[Any] = field(default_factory=list)
    merging: bool = False

    @staticmethod
    def created(var: Variable, n: int) -> _Slot:
        """A variable merge_fn just created (concrete, identical copies), in the merge view."""
        held = storage_arrays(var)
        slot = _Slot(var=var, distributed=True, n=n, entry=held[0], own=held[0])
        slot.local = [held[0]] * n
        slot.view = list(held)
        slot.merging = True
        return slot

    def storage(self) -> list[Any]:
        return storage_arrays(self.var)

    # -- replica view ---------------------------------------------------------------
    def show_own(self, own: Any) -> None:
        self.own = own
        if self.distributed:
            swap_storage(self.var, [own] * self.n)
        else:
            swap_storage(self.var, [own])

    def own_now(self) -> Any:
        """This replica's copy at the end of a replica-context stretch of ``fn``."""
        held = self.storage()
        for k, h in enumerate(held):
            if k != COMPONENT and h is not self.own:
                raise NotImplementedError(
                    f"Replica code wrote copy {k} of {self.var.name!r} directly (through "
                    "var.values[k]). In a compiled run each replica holds only its own copy, so "
                    "it cannot write another replica's; update the variable itself "
                    "(var.assign...) or use strategy.extended.update."
                )
        return held[COMPONENT]

    # -- merge view -----------------------------------------------------------------
    def enter_merge(self) -> None:
        own = self.own_now()
        self.own = own
        self.local = [own] * self.n
        if is_tracer(own) and is_varying(own):
            # Registered, so a reduction of the copies finds it and becomes one psum.
            self.view = list(LazyPerReplica(own, self.n).values)
        else:
            self.view = [own] * self.n  # the same on every replica
        swap_storage(self.var, self.view)
        self.merging = True

    def _sync(self, k: int, held: Any) -> None:
        # Component k was written outside an update of replica k (e.g. a SyncOnRead
        # variable's cross-replica assign): the value is copy k as every replica sees it,
        # so it is also what replica k has.
        if held is not self.view[k]:
            self.local[k] = self.view[k] = held

    def begin_update(self, k: int) -> Any:
        """Shows replica k's own copy in component k while copy k is updated."""
        held = self.storage()
        self._sync(k, held[k])
        held[k] = self.local[k]
        swap_storage(self.var, held)
        return self.local[k]

    def end_update(self, k: int, shown: Any) -> None:
        held = self.storage()
        new = held[k]
        if new is not shown:
            self.local[k] = new
            # Copy k as every replica sees it: replica k's value, gathered (unused, XLA
            # drops the gather).
            self.view[k] = as_seen_by_all(new, k)
        held[k] = self.view[k]
        swap_storage(self.var, held)

    def leave_merge(self) -> None:
        held = self.storage()
        for k, h in enumerate(held):
            self._sync(k, h)
        self.merging = False
        self.show_own(pick_local(self.local))


def as_seen_by_all(x: Any, k: int) -> Any:
    """Replica ``k``'s value of ``x`` on every replica (``x`` itself if JAX knows it is
    the same everywhere). Remembered, so that :func:`pick_local` uses ``x`` itself.
    Across processes, replica ``k`` is this worker's ``k``-th (the copies are local)."""
    if not (is_tracer(x) and varies_locally(x)):
        return x
    seen = lax.all_gather(x, AXIS, tiled=False)[k]
    traced = active()
    if traced is not None:
        traced.diagonal[id(seen)] = (seen, x)
    return seen


class _Active(threading.local):
    def __init__(self) -> None:
        self.traced: TracedVariables | None = None


_active = _Active()

#: Context managers entered around each trace of ``fn`` (inside the compiled program's
#: trace, after the variables show their traced copies). ``polydist_jax.nnx`` adds one that
#: lets ``fn`` update the Flax objects it bound to variables at that trace level.
trace_hooks: list[Callable[[], AbstractContextManager[object]]] = []


def active() -> TracedVariables | None:
    """The variables functionalized by the trace running on this thread, if any."""
    return _active.traced


class TracedVariables:
    """The functionalized variables of one trace: swaps storage in, takes new values out."""

    def __init__(self, variables: Sequence[Variable], blocks: Sequence[Any], n: int) -> None:
        self._slots = [
            _Slot(var=v, distributed=isinstance(v, DistributedVariable), n=n, entry=b)
            for v, b in zip(variables, blocks, strict=True)
        ]
        self._n = n
        self._saved: list[list[Any]] = []
        self._extended: Any = None
        self._known: set[int] = set()  # ids of the variables the strategy had
        self._dirty_before: set[int] = set()
        #: Variables fn created while it was traced (a program that creates variables
        #: runs once: every call traces again and creates new ones, as eager runs do).
        self.created: list[Variable] = []
        self.dirty: list[int] = []  # positions of NONE variables written in replica context
        self.final: list[Any] = []  # each variable's copy at the end of fn (this replica's)
        # id(replica k's value as every replica sees it) -> (that value, the value itself)
        self.diagonal: dict[int, tuple[Any, Any]] = {}

    def variables(self) -> list[Variable]:
        """Every functionalized variable: the call's, then those fn created."""
        return [s.var for s in self._slots]

    def raw(self, x: Any) -> Any:
        """``x``, or the value replica ``k`` computed if ``x`` is that value gathered."""
        hit = self.diagonal.get(id(x))
        return x if hit is None or hit[0] is not x else hit[1]

    def update_results(self, results: list[Any]) -> list[Any]:
        """Core's hook for ``StrategyExtended.update`` results: result ``k`` was computed
        from replica ``k``'s own copy, so each replica reads replica ``k``'s value of it."""
        if not any(s.merging for s in self._slots):
            return results
        counts: dict[int, int] = {}
        for r in results:
            for x in _nest.flatten(r)[0]:
                counts[id(x)] = counts.get(id(x), 0) + 1

        def fix(k: int, x: Any) -> Any:
            # A value returned for several copies was not computed from one of them.
            return as_seen_by_all(x, k) if counts.get(id(x), 0) == 1 else x

        return [_nest.map_structure(lambda x, k=k: fix(k, x), r) for k, r in enumerate(results)]

    @contextmanager
    def tracing(self, extended: Any) -> Iterator[TracedVariables]:
        """Shows the traced copies while ``fn`` is traced; always restores the arrays."""
        extended = self._extended = owner(extended)
        self._dirty_before = set(_tracing.replica_writes(extended))
        tracked = tracked_variables(extended)
        self._known = {id(v) for v in tracked}
        mine = {id(s.var) for s in self._slots}
        watched = [v for v in tracked if id(v) not in mine]
        before = [(v, storage_arrays(v)) for v in watched]
        self._saved = [storage_arrays(s.var) for s in self._slots]
        outer, _active.traced = _active.traced, self
        try:
            for s in self._slots:
                s.show_own(s.entry)
            with (
                _tracing.traced_replica_scope(COMPONENT, self.update_results),
                ExitStack() as hooks,
            ):
                for hook in trace_hooks:
                    hooks.enter_context(hook())
                yield self
        finally:
            _active.traced = outer
            for s, saved in zip(self._slots, self._saved, strict=True):
                swap_storage(s.var, saved)
            leaked = [v for v, arrays in before if _has_new_tracer(v, arrays)]
            for v, arrays in before:
                swap_storage(v, arrays)
        if leaked:
            raise NotImplementedError(
                f"strategy.run wrote {leaked[0].name!r}, a variable the jax backend does not "
                "pass into compiled runs (its copies are not one per replica of this strategy). "
                "Create the variables fn updates under this strategy's scope."
            )

    def outputs(self) -> list[tuple[int, Any]]:
        """(position, new copy) of every variable ``fn`` wrote; call at the end of ``fn``."""
        extended = self._extended
        positions = {id(s.var): i for i, s in enumerate(self._slots)}
        written = _tracing.replica_writes(extended)
        self.dirty = [positions[k] for k in written if k not in self._dirty_before]
        out: list[tuple[int, Any]] = []
        self.final = [s.own_now() for s in self._slots]
        for i, s in enumerate(self._slots):
            new = self.final[i]
            if new is s.entry:
                continue
            if not s.distributed:
                raise NotImplementedError(
                    f"strategy.run wrote the plain variable {s.var.name!r}. A plain "
                    "polydist.Variable (created outside any strategy scope) is one copy shared "
                    "by every replica: a compiled run may read it but not write it. Create it "
                    "under strategy.scope() (a MirroredVariable, or a SyncOnReadVariable for "
                    "per-replica state), or write it after run returns."
                )
            out.append((i, _as_varying(new)))
        return out

    # -- hooks: merge_call and the per-replica updates inside it ----------------------
    @contextmanager
    def merge_view(self) -> Iterator[None]:
        """Around ``merge_fn``: the copies as cross-replica code sees them."""
        slots = [s for s in self._slots if s.distributed]
        for s in slots:
            s.enter_merge()
        yield
        slots += self._adopt_created()
        for s in slots:
            s.leave_merge()

    def _adopt_created(self) -> list[_Slot]:
        """Variables merge_fn created (``Variable(...)`` in fn goes through merge_call):
        functionalized from here on; the copies they were created with are constants."""
        new: list[_Slot] = []
        for v in tracked_variables(self._extended):
            if id(v) in self._known:
                continue
            self._known.add(id(v))
            arrays = storage_arrays(v)
            if any(is_tracer(a) for a in arrays) or not isinstance(v, DistributedVariable):
                raise NotImplementedError(_CREATED_TRACED.format(name=v.name))
            slot = _Slot.created(v, self._n)
            self._slots.append(slot)
            self._saved.append(arrays)
            self.created.append(v)
            new.append(slot)
        return new

    @contextmanager
    def update_scope(self, k: int) -> Iterator[None]:
        """Around an update of replica ``k``'s copies (core's ``update_context(k)``)."""
        slots = [s for s in self._slots if s.distributed and s.merging]
        shown = [s.begin_update(k) for s in slots]
        yield
        for s, own in zip(slots, shown, strict=True):
            s.end_update(k, own)


def _has_new_tracer(v: Variable, before: list[Any]) -> bool:
    return any(a is not b and is_tracer(a) for a, b in zip(storage_arrays(v), before, strict=True))


# --------------------------------------------------------------------------- inputs


class InputCache:
    """The global input array of each variable, reused while its copies are unchanged.

    After a run the new copies are the shards of the program's output, so the
    next step's input is that output array again: no reassembly. Each entry also
    remembers how many references its copies had when they were stored (``owned``:
    the program's fresh outputs, which nobody else can hold yet), so that a later
    call can tell whether someone else took a reference since (`exclusive`).
    """

    def __init__(self) -> None:
        # id(var) -> (its copies, global array, their references when stored or None),
        # or (DeferredCopies, global array, _DEFERRED); while var lives (`_refs`). By id,
        # not a WeakKeyDictionary: a step looks up and stores every variable it takes.
        self._cache: dict[int, tuple[Any, Any, Any]] = {}
        self._refs: dict[int, weakref.ref[Variable]] = {}

    def _set(self, var: Variable, entry: tuple[Any, Any, Any]) -> None:
        key = id(var)
        if key not in self._refs:
            self._refs[key] = weakref.ref(var, functools.partial(self._drop, key))
        self._cache[key] = entry

    def _drop(self, key: int, ref: weakref.ref[Variable]) -> None:
        # The variable is gone (its id may be reused from now on).
        if self._refs.get(key) is ref:
            del self._refs[key]
            self._cache.pop(key, None)

    def get(self, var: Variable, arrays: Sequence[Any]) -> Any:
        hit = self._cache.get(id(var))
        if hit is None:
            return None
        held, global_array, baseline = hit
        if baseline is _DEFERRED:
            return global_array if _deferred_copies(var, held) is not None else None
        if len(held) != len(arrays) or any(a is not b for a, b in zip(held, arrays, strict=True)):
            return None
        return global_array

    def put(self, var: Variable, arrays: Sequence[Any], global_array: Any) -> None:
        self._set(var, (tuple(arrays), global_array, None))

    def put_deferred(self, var: Variable, source: DeferredCopies, global_array: Any) -> None:
        """Records ``global_array`` as ``var``'s input while its copies are still
        ``source``'s (`polydist.backend.tracing.defer_storage`)."""
        self._set(var, (source, global_array, _DEFERRED))

    def renew_deferred(
        self, var: Variable, global_array: Any, aval: Any, mesh: Any, scalar: bool
    ) -> bool:
        """Makes ``global_array`` the copies of ``var``'s deferred source in place, where
        none of them was read since it was recorded and the variable's storage still
        comes from it (copies of the same ``aval``, ``mesh`` and ``scalar``-ness, as the
        source was made with); False otherwise (the caller then defers a new source).
        A training step writes its variables every step: this is one call instead of a
        new source, its deferral and its record."""
        key = id(var)
        hit = self._cache.get(key)
        if hit is None or hit[2] is not _DEFERRED:
            return False
        source = hit[0]
        if (
            source.read
            or source.mesh is not mesh
            or source.scalar is not scalar
            or source.aval != aval
            or deferred_storage(var, source) is None
        ):
            return False
        source.array = global_array
        self._cache[key] = (source, global_array, _DEFERRED)
        return True

    def deferred(self, var: Variable) -> tuple[Any, Any] | None:
        """``(global array, a copy's (shape, dtype))`` while ``var``'s copies are still
        the deferred ones recorded (read or not), else None."""
        hit = self._cache.get(id(var))
        if hit is None or hit[2] is not _DEFERRED:
            return None
        source = hit[0]
        if _deferred_copies(var, source) is None:
            return None
        return hit[1], source.aval

    def seal(self, var: Variable) -> None:
        """Records the references ``var``'s copies have now, as the ones of a copy only
        the runner holds: call it right after storing a program's fresh outputs, once
        the caller's own references to them are gone."""
        hit = self._cache.get(id(var))
        if hit is not None and hit[2] is not _DEFERRED:
            # The copies ``put`` just recorded (a new list: counted as `exclusive` counts).
            self._cache[id(var)] = (hit[0], hit[1], _refcounts(list(hit[0])))

    def exclusive(self, var: Variable) -> bool:
        """Whether only the variable and this cache hold ``var``'s stored copies (no
        array a user took from it, no other variable storing the same array)."""
        return self.lookup(var)[1]

    def lookup(self, var: Variable) -> tuple[Any, bool]:
        """``get`` with ``var``'s stored copies and whether they are `exclusive`, from
        one read of them (the direct path asks both each step)."""
        hit = self._cache.get(id(var))
        if hit is None:
            return None, False
        held, global_array, baseline = hit
        if baseline is _DEFERRED:
            if not held.read:  # no copy split out yet: none can be held elsewhere
                return global_array, deferred_storage(var, held) is not None
            copies = _deferred_copies(var, held)
            if copies is None:
                return None, False  # written since
            # A copy never read exists only inside the output array; one read since is
            # ours while it has the references it had when read (`DeferredCopies`).
            counts = _refcounts(copies)
            expected = held.expected
            return global_array, all(
                a is None or c <= e for a, c, e in zip(copies, counts, expected, strict=True)
            )
        arrays = storage_arrays(var)
        if len(held) != len(arrays) or not all(map(operator.is_, held, arrays)):
            return None, False
        counts = _refcounts(arrays)
        if baseline is None:
            # Stored by someone else (creation, an assign outside run): each copy held by
            # its component, this cache's key and ``arrays`` only. A copy stored by
            # several components counts once per component: more than expected, not ours.
            return global_array, max(counts) <= _ALONE + 2
        return global_array, all(map(operator.le, counts, baseline))

    def clear(self) -> None:
        self._cache.clear()
        self._refs.clear()


def _refcounts(arrays: list[Any]) -> tuple[int, ...]:
    # Each count includes the references this call makes; every count compared with
    # another comes from here.
    return tuple(map(sys.getrefcount, arrays))


#: An `InputCache` entry whose copies are deferred (`put_deferred`).
_DEFERRED: Any = object()


def _deferred_copies(var: Variable, source: DeferredCopies) -> list[Any] | None:
    """``var``'s copies while they are ``source``'s (None: a copy not read yet), else
    None. Also after a trace swapped them out and back (which forgets the deferral):
    then each is the very copy ``source`` made."""
    copies = deferred_storage(var, source)
    if copies is not None:
        return copies
    made = source.copies
    if any(m is None for m in made):
        return None  # not every copy was read: the trace swapped others in
    arrays = storage_arrays(var)
    if len(arrays) != len(made) or any(a is not m for a, m in zip(arrays, made, strict=False)):
        return None
    return arrays


class DeferredCopies(Protocol):
    """A variable's deferred copies as `InputCache` needs them (``_spmd._Stored``)."""

    array: Any
    """The program output that holds every copy (`InputCache.renew_deferred` replaces
    it while no copy was read)."""
    mesh: Any
    scalar: bool

    @property
    def aval(self) -> Any:
        """A copy's ``(shape, (dtype, weak_type))``."""
        ...

    @property
    def expected(self) -> list[int]:
        """Per copy read so far, its `_refcounts` when it was read (its own only)."""
        ...

    @property
    def read(self) -> bool:
        """Whether any copy was read (made) yet."""
        ...

    @property
    def copies(self) -> list[Any]:
        """Per copy: the array made when it was read, else None."""
        ...

    def component(self, index: int) -> Any: ...


#: What `_refcounts` gives for an object held by its list alone.
_ALONE = _refcounts([object()])[0]
