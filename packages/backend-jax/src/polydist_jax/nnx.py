"""Flax nnx modules, ``nnx.Optimizer`` and optax states as polydist distributed variables.

``distribute(model)`` under ``strategy.scope()`` is what building a Keras model
under the scope is in TF: every array in the model becomes a
``MirroredVariable`` of the strategy (one per leaf, named by its path in the
model: ``"layers/0/kernel"``), with a copy on every replica's device. The
model stays the same Python object, with the same ``nnx.Variable`` objects:

* each bound ``nnx.Variable`` keeps no array of its own; reading it reads the
  polydist variable (in ``strategy.run``: this replica's copy; outside:
  replica 0's), and writing it (``v[...] = x``, ``nnx.update``,
  ``nnx.Optimizer.update``) assigns the polydist variable (in ``run``: this
  replica's copy, TF's rule for a variable with ``aggregation=NONE``; outside:
  every copy);
* so ``strategy.run`` needs nothing more: a compiled run passes the copies in
  and takes the new ones out (as for any polydist variable), and an eager run
  reads and writes each replica's own copy;
* while ``run`` traces the step, the objects bound here may be used with nnx's
  transforms and updated in place (nnx refuses that for objects created outside
  the trace: "Cannot extract graph node from different trace level").

``distribute(pytree)`` of any other JAX pytree (an optax state, a parameter
dict) returns an ``nnx.Variable`` holding it, bound the same way (one polydist
variable per array leaf): read it with ``get_value()``, write it with
``set_value(new)``.

The gradients are the user's to all-reduce, in one call, as in TF's custom
training loops: ``ctx.all_reduce("SUM", grads)`` with a per-example loss
averaged by ``polydist.nn.compute_average_loss``. Each replica then computes
the same update from the same values, so the copies stay bitwise identical;
a step that forgets the all-reduce makes them diverge, and polydist warns
(``ReplicaDivergenceWarning``) after that ``run``.

Which polydist variable each ``nnx.Variable`` becomes:

* ``nnx.BatchStat``: ``synchronization=ON_READ, aggregation=MEAN`` (each
  replica keeps its own batch statistics; reading them outside ``run`` gives
  their mean), as Keras' ``BatchNormalization`` under a TF strategy;
* the ``total`` and ``count`` of an ``nnx.metrics.Average`` (``Accuracy``):
  ``synchronization=ON_READ, aggregation=SUM``, as a Keras metric's: each
  replica adds its own examples, and ``compute()`` outside ``run`` sees them all;
* every other type (``nnx.Param``, optimizer state, counters, RNG state): a
  ``MirroredVariable`` with ``aggregation=NONE``; ``trainable`` is True for
  ``nnx.Param`` only. Inside ``run`` with more than one replica, an
  ``nnx.RngKey`` reads as ``jax.random.fold_in(key, replica_id_in_sync_group)``:
  each replica draws its own random numbers (TF's rule), while the stored key
  and count stay mirrored.

``SyncBatchNorm`` is ``nnx.BatchNorm`` with the batch statistics of the global
batch (``polydist.nn.synchronized_moments``), Keras'
``BatchNormalization(synchronized=True)``.

Array leaves become variables, Python numbers become arrays of JAX's dtype
(``jnp.asarray``'s: float32 and int32 unless ``jax_enable_x64``; a plain model's
checkpoint saves them with the same dtype), PRNG keys are stored as their key
data (and come back as keys), and other leaves (``None``, strings) stay as they
are.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

try:
    from flax import nnx
    from flax.nnx import graphlib as _graphlib
    from flax.nnx import tracers as _nnx_tracers
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "polydist_jax.nnx needs Flax: pip install 'polydist-jax[flax]' (or flax and optax)."
    ) from error

import polydist as pd
from polydist import Variable as _PdVariable
from polydist_jax import _functional
from polydist_jax._nnx_batch_norm import SyncBatchNorm

__all__ = ["SyncBatchNorm", "distribute", "is_distributed", "variables"]

# The slot that holds an nnx.Variable's value. A bound variable's slot holds its
# _Binding instead, and its class (a subclass of its own class) reads and writes the
# value through the binding.
_SLOT: Any = nnx.Variable.__dict__["_raw_value"]


def _replica_id() -> Any:
    """This replica's global id inside a ``run`` of more than one replica, else None."""
    if not pd.has_strategy():
        return None
    ctx = pd.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync <= 1:
        return None
    return ctx.replica_id_in_sync_group


class _Leaf:
    """One leaf of a bound variable's value: a polydist variable, or a static object."""

    __slots__ = ("fold", "impl", "obj", "var")

    def __init__(
        self, var: _PdVariable | None, obj: Any = None, impl: Any = None, fold: bool = False
    ) -> None:
        self.var = var  # None: a static leaf (obj)
        self.obj = obj
        self.impl = impl  # a PRNG key's implementation: the variable holds its key data
        # An nnx.RngKey: inside run each replica reads fold_in(key, replica id), so that
        # each draws its own numbers (TF's rule); the stored key stays mirrored.
        self.fold = fold

    def read(self) -> Any:
        if self.var is None:
            return self.obj
        value = self.var.value()
        if self.impl is not None:
            key = jax.random.wrap_key_data(value, impl=self.impl)
            if self.fold and (replica := _replica_id()) is not None:
                key = _fold(key, replica)
            return key
        return value

    def write(self, new: Any, name: str) -> None:
        if self.var is None:
            if new is not self.obj and not _same_static(new, self.obj):
                raise NotImplementedError(
                    f"polydist_jax.nnx: {name!r} holds {self.obj!r}, which is not an array and "
                    f"so not a distributed variable; it cannot be set to {new!r}. Keep arrays "
                    "in variables that change."
                )
            return
        if self.impl is not None:
            new = jax.random.key_data(new)
            if self.fold and jnp.shape(new) != tuple(self.var.shape):
                raise NotImplementedError(
                    f"polydist_jax.nnx: {name!r} is a distributed nnx.RngKey (key data of "
                    f"shape {tuple(self.var.shape)}); it cannot hold keys of another shape "
                    "(nnx.split_rngs on a distributed model). Split a fork instead: "
                    "nnx.split_rngs(rngs.fork(), splits=n) (inside strategy.run the fork "
                    "holds this replica's own keys)."
                )
            if self.fold and (replica := _replica_id()) is not None:
                new = self._unfold(new, replica)
        self.var.assign(new, read_value=False)

    def _unfold(self, new: Any, replica: Any) -> Any:
        """The stored key where ``new`` is what this replica reads of it: nnx writes back
        the keys it read (``nnx.grad``, ``nnx.jit``, ``restore_rngs``), and storing a
        folded key would make the copies diverge."""
        assert self.var is not None
        stored = self.var.value()
        read = jax.random.key_data(_fold(jax.random.wrap_key_data(stored, impl=self.impl), replica))
        return jnp.where(jnp.all(new == read), stored, new)


def _fold(key: Any, replica: Any) -> Any:
    # fold_in takes one key; a stream built from a key array folds each key alike.
    if key.ndim == 0:
        return jax.random.fold_in(key, replica)
    flat = key.reshape(-1)
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(flat, replica).reshape(key.shape)


def _same_static(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


class _Binding:
    """What a bound ``nnx.Variable`` holds instead of its value."""

    __slots__ = ("leaves", "name", "treedef")

    def __init__(self, name: str, treedef: Any, leaves: list[_Leaf]) -> None:
        self.name = name
        self.treedef = treedef
        self.leaves = leaves

    def read(self) -> Any:
        return jax.tree.unflatten(self.treedef, [leaf.read() for leaf in self.leaves])

    def write(self, value: Any) -> None:
        new, treedef = jax.tree.flatten(value)
        # Trees made before and after distribute hold nnx Variables of the base and of the
        # bound class: the same structure once the Variables are taken out (nnx.as_pure).
        if treedef != self.treedef and _pure_structure(value) != _pure_structure(self.read()):
            raise ValueError(
                f"polydist_jax.nnx: {self.name!r} is distributed with the structure "
                f"{self.treedef}; it cannot be set to a value of structure {treedef}. A "
                "distributed nnx.Variable keeps its structure, shape and dtype."
            )
        for leaf, x in zip(self.leaves, new, strict=True):
            leaf.write(x, self.name)

    def variables(self) -> list[_PdVariable]:
        return [leaf.var for leaf in self.leaves if leaf.var is not None]


def _pure_structure(tree: Any) -> Any:
    return jax.tree.structure(nnx.as_pure(tree))


def _binding(var: Any) -> _Binding | None:
    raw = _SLOT.__get__(var)
    return raw if isinstance(raw, _Binding) else None


# -- the trace a compiled strategy.run is tracing ---------------------------------------


class _RunTrace(threading.local):
    def __init__(self) -> None:
        self.state: Any = None  # nnx's TraceState of the trace of fn, while it is traced


_run_trace = _RunTrace()

# The objects passed to distribute (weakly): while a compiled run traces fn, every nnx
# object reachable from them may be used at that trace level.
_roots: list[weakref.ref[Any]] = []
_roots_lock = threading.Lock()


def _live_roots() -> list[Any]:
    with _roots_lock:
        alive = [(r, obj) for r in _roots if (obj := r()) is not None]
        _roots[:] = [r for r, _ in alive]
    return [obj for _, obj in alive]


@contextmanager
def _revalidate() -> Iterator[None]:
    """While fn is traced: the bound objects' nnx trace state is this trace's.

    Afterwards each object gets its own trace state back, so that eager runs and nnx's
    transforms outside ``run`` accept it again. It is put back on the object's current
    ``_pytree__state``: nnx's transforms (``nnx.value_and_grad``, ``nnx.update``)
    replace that state object while fn is traced, with one made at the trace's level.
    """
    state: Any = _nnx_tracers.TraceState()  # type: ignore[no-untyped-call]
    saved: list[tuple[Any, Any]] = []
    seen: set[int] = set()
    for root in _live_roots():
        for _, node in nnx.iter_graph(root):
            if isinstance(node, nnx.Pytree) and id(node) not in seen:
                seen.add(id(node))
                pytree_state = node._pytree__state
                saved.append((node, pytree_state._trace_state))
                pytree_state._trace_state = state
    outer, _run_trace.state = _run_trace.state, state
    try:
        yield
    finally:
        _run_trace.state = outer
        for node, old in saved:
            node._pytree__state._trace_state = old


def _run_trace_valid() -> bool:
    state = _run_trace.state
    return state is not None and bool(state.is_valid())


_hook_lock = threading.Lock()


def _install_hook() -> None:
    with _hook_lock:
        if _revalidate not in _functional.trace_hooks:
            _functional.trace_hooks.append(_revalidate)


# -- bound classes -------------------------------------------------------------------------

_BOUND_CLASSES: dict[type, type] = {}


def _bound_class(base: type) -> type:
    """``base`` with its value read and written through the binding (when it has one).

    Copies of a bound variable (``jax.tree.map``, ``jax.grad``, ``nnx.clone``) are of
    this class too, so that trees made from the model keep one structure (optax maps
    gradients and parameters together), but hold their own value like ``base``.
    """
    cls = _BOUND_CLASSES.get(base)
    if cls is not None:
        return cls
    base_any: Any = base

    def get_raw(self: Any) -> Any:
        raw = _SLOT.__get__(self)
        return raw.read() if isinstance(raw, _Binding) else raw

    def set_raw(self: Any, value: Any) -> None:
        try:
            raw = _SLOT.__get__(self)
        except AttributeError:  # being created
            raw = None
        if isinstance(raw, _Binding):
            raw.write(value)
        else:
            _SLOT.__set__(self, value)

    def can_update(self: Any) -> bool:
        if _binding(self) is not None and _run_trace_valid():
            return True
        return bool(base_any._can_update.fget(self))

    def check_can_update(self: Any) -> None:
        if _binding(self) is not None and _run_trace_valid():
            return
        base_any._check_can_update(self)

    def reduce(self: Any) -> tuple[Any, ...]:
        # Pickled as the base type holding the value (the class itself is not importable).
        return (_unpickle, (base, self.get_raw_value(), dict(self._var_metadata)))

    namespace: dict[str, Any] = {
        "__slots__": (),
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
        "_raw_value": property(get_raw, set_raw),
        "_can_update": property(can_update),
        "_check_can_update": check_can_update,
        "__reduce__": reduce,
    }
    cls = type(base)(base.__name__, (base,), namespace)
    _BOUND_CLASSES[base] = cls
    return cls


def _unpickle(base: Any, value: Any, metadata: dict[str, Any]) -> Any:
    return base._new(value, metadata)


# -- distribute ------------------------------------------------------------------------------


def _key_part(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _is_value_attr(key: Any) -> bool:
    return isinstance(key, jax.tree_util.GetAttrKey) and key.name == "value"


def _join(*parts: Any) -> str:
    return "/".join(str(p) for p in parts if p != "")


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _synchronization(
    var: Any, summed: bool
) -> tuple[pd.VariableSynchronization, pd.VariableAggregation]:
    if isinstance(var, nnx.BatchStat):
        return pd.VariableSynchronization.ON_READ, pd.VariableAggregation.MEAN
    if summed:
        return pd.VariableSynchronization.ON_READ, pd.VariableAggregation.SUM
    return pd.VariableSynchronization.AUTO, pd.VariableAggregation.NONE


def _summed_metric_states(nodes: list[Any]) -> set[int]:
    """The ids of the ``total`` and ``count`` of every ``nnx.metrics.Average`` (and
    ``Accuracy``) among ``nodes``: sums, which each replica adds to on its own and a read
    outside ``run`` adds up, as a Keras metric's ``SUM`` variables under a TF strategy."""
    found: set[int] = set()
    for node in nodes:
        if isinstance(node, nnx.metrics.Average):
            for attr in ("total", "count"):
                state = getattr(node, attr, None)
                if isinstance(state, nnx.metrics.MetricState):
                    found.add(id(state))
    return found


def _bind(var: Any, name: str, summed: bool = False) -> None:
    """Replaces ``var``'s value by polydist variables (in the current strategy scope)."""
    binding = _binding(var)
    if binding is not None:
        strategy = pd.get_strategy()
        other = [v for v in binding.variables() if v.distribute_strategy is not strategy]
        if other:
            raise ValueError(
                f"polydist_jax.nnx.distribute: {name or binding.name!r} is already distributed "
                f"by another strategy ({other[0].distribute_strategy!r}). An nnx object belongs "
                "to one strategy: build a new one (or nnx.clone it) for this strategy."
            )
        return
    if var.hijax or var.ref:
        raise NotImplementedError(
            f"polydist_jax.nnx: {name!r} is an nnx.Variable with hijax={var.hijax}, "
            f"ref={var.ref}; distribute supports plain nnx Variables (the default)."
        )
    sync, aggregation = _synchronization(var, summed)
    flat, treedef = jax.tree_util.tree_flatten_with_path(_SLOT.__get__(var))
    leaves: list[_Leaf] = []
    for path, x in flat:
        # An nnx.Variable inside the value (an optax state of nnx.State) adds `.value`.
        parts = [_key_part(k) for k in path if not _is_value_attr(k)]
        leaf_name = _join(name, *parts) or "Variable"
        value, impl = x, None
        if _is_key(x):
            value, impl = jax.random.key_data(x), jax.random.key_impl(x)
        elif isinstance(x, bool | int | float | complex | np.generic):
            value = _host_array(x)
        elif not isinstance(x, jax.Array | np.ndarray):
            leaves.append(_Leaf(None, obj=x))
            continue
        pd_var = pd.Variable(
            value,
            name=leaf_name,
            trainable=isinstance(var, nnx.Param) and impl is None,
            synchronization=sync,
            aggregation=aggregation,
        )
        leaves.append(_Leaf(pd_var, impl=impl, fold=isinstance(var, nnx.RngKey)))
    binding = _Binding(name or "Variable", treedef, leaves)
    object.__setattr__(var, "__class__", _bound_class(type(var)))
    _SLOT.__set__(var, binding)


def _host_array(x: Any) -> np.ndarray:
    """``x`` (an array, a NumPy value or a Python number) as a NumPy array of the dtype
    JAX gives it (``jnp.asarray``'s: ``nnx.Param(1.0)`` is float32 and ``nnx.Variable(0)``
    int32, unless ``jax_enable_x64``), so that a distributed object (whose variables hold
    what ``jnp.asarray`` makes) and a plain one save and expect the same dtypes."""
    return np.asarray(x, dtype=jnp.result_type(x))


def _strategy_scope(strategy: pd.Strategy | None) -> Any:
    if strategy is None:
        if not pd.has_strategy():
            raise ValueError(
                "polydist_jax.nnx.distribute needs a strategy: call it under "
                "`with strategy.scope():`, or pass strategy=."
            )
        strategy = pd.get_strategy()
        scope: Any = ExitStack()
    elif pd.has_strategy():
        current = pd.get_strategy()
        if current is not strategy:
            raise ValueError(
                f"polydist_jax.nnx.distribute(strategy={strategy!r}) was called under the scope "
                f"of another strategy ({current!r}); call it under the strategy's own scope."
            )
        scope = ExitStack()
    else:
        scope = strategy.scope()
    backend = strategy.extended.backend
    if getattr(backend, "name", None) != "jax":
        raise ValueError(
            f"polydist_jax.nnx.distribute needs a strategy on the jax backend, got {strategy!r} "
            f"on {getattr(backend, 'name', backend)!r}. Create it with backend='jax'."
        )
    if pd.has_strategy() and pd.get_replica_context() is not None:
        raise RuntimeError(
            "polydist_jax.nnx.distribute was called inside strategy.run; call it once, before "
            "the training loop, under strategy.scope()."
        )
    return scope


def distribute(obj: Any, *, strategy: pd.Strategy | None = None, name: str = "") -> Any:
    """Makes every array in a Flax nnx object (or a JAX pytree) a distributed variable.

    Call it under ``strategy.scope()`` (or pass ``strategy=``), once, before the
    training loop, on the model and on the optimizer::

        with strategy.scope():
            model = polydist_jax.nnx.distribute(MLP(rngs=nnx.Rngs(0)))
            optimizer = polydist_jax.nnx.distribute(
                nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param))

    Args:
        obj: an nnx graph node (a ``Module``, an ``nnx.Optimizer``, any
            ``nnx.Pytree`` or ``nnx.Variable``), bound in place and returned;
            or any other JAX pytree (an optax state, a dict of arrays), for which
            a new ``nnx.Variable`` holding it is returned, bound the same way.
            Variables already bound (a model reached again through its optimizer)
            are left as they are.
        strategy: the strategy; default: the one whose scope is active.
        name: a prefix for the variables' names (``name/path/of/leaf``).

    Returns:
        ``obj`` itself for an nnx object, else the new ``nnx.Variable``.
    """
    scope = _strategy_scope(strategy)
    _install_hook()
    with scope:
        if isinstance(obj, nnx.Variable):
            _bind(obj, name)
            root = obj
        elif _graphlib.is_graph_node(obj):
            nodes = list(nnx.iter_graph(obj))
            summed = _summed_metric_states([node for _, node in nodes])
            for path, node in nodes:
                if isinstance(node, nnx.Variable):
                    _bind(node, _join(name, *path), summed=id(node) in summed)
            root = obj
        else:
            root = nnx.Variable(obj)
            _bind(root, name)
    if isinstance(root, nnx.Pytree):  # (a Variable needs no trace state: its class allows it)
        with _roots_lock:
            if not any(r() is root for r in _roots):
                _roots.append(weakref.ref(root))
    return root


def is_distributed(var: Any) -> bool:
    """True for an ``nnx.Variable`` that :func:`distribute` bound to polydist variables."""
    return isinstance(var, nnx.Variable) and _binding(var) is not None


def variables(obj: Any) -> dict[str, _PdVariable]:
    """The polydist variables behind a distributed nnx object, by name (``"l1/kernel"``).

    Pass them to ``polydist.checkpoint.save``/``restore``, or to
    ``polydist.debugging.check_replicas_identical``.
    """
    nodes = [obj] if isinstance(obj, nnx.Variable) else [n for _, n in nnx.iter_graph(obj)]
    found: dict[str, _PdVariable] = {}
    for node in nodes:
        binding = _binding(node) if isinstance(node, nnx.Variable) else None
        if binding is None:
            continue
        for v in binding.variables():
            found[v.name.removesuffix(":0")] = v
    if not found:
        raise ValueError(
            f"polydist_jax.nnx.variables: {type(obj).__name__} holds no distributed "
            "variables; call polydist_jax.nnx.distribute on it first."
        )
    return found


# -- polydist.train.Checkpoint ----------------------------------------------------------------


def _leaf_slots(obj: Any) -> list[tuple[tuple[str, ...], Any, int]]:
    """(key path, nnx.Variable, leaf index) of every array leaf in ``obj``, in graph order.

    The key path is the variable's path in ``obj`` and the leaf's path in its value
    (relative to ``obj``, without ``distribute``'s name prefix)."""
    nodes = [((), obj)] if isinstance(obj, nnx.Variable) else list(nnx.iter_graph(obj))
    slots: list[tuple[tuple[str, ...], Any, int]] = []
    for path, var in nodes:
        if not isinstance(var, nnx.Variable):
            continue
        binding = _binding(var)
        flat = jax.tree_util.tree_flatten_with_path(
            binding.read() if binding is not None else _SLOT.__get__(var)
        )[0]
        for index, (leaf_path, x) in enumerate(flat):
            if binding is not None and binding.leaves[index].var is None:
                continue  # a static leaf: not state
            if binding is None and not _is_array_leaf(x):
                continue
            parts = (*map(str, path), *(_key_part(k) for k in leaf_path if not _is_value_attr(k)))
            slots.append((parts or ("value",), var, index))
    return slots


def _is_array_leaf(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic | bool | int | float | complex)


def _nested(items: list[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for parts, value in items:
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def _lookup(nest: dict[str, Any], parts: tuple[str, ...]) -> Any:
    node: Any = nest
    for part in parts:
        node = node[part]
    return node


def _to_nest(obj: Any) -> dict[str, Any]:
    """What ``Checkpoint`` saves of an nnx object: its polydist variables where it is
    distributed, else its arrays (PRNG keys as their key data), by path."""
    items: list[tuple[tuple[str, ...], Any]] = []
    for parts, var, index in _leaf_slots(obj):
        binding = _binding(var)
        if binding is not None:
            pd_var = binding.leaves[index].var
            assert pd_var is not None
            items.append((parts, pd_var))
        else:
            x = jax.tree.leaves(_SLOT.__get__(var))[index]
            items.append((parts, jax.random.key_data(x) if _is_key(x) else _host_array(x)))
    return _nested(items)


def _from_nest(obj: Any, nest: dict[str, Any]) -> None:
    """Writes restored arrays back: into the polydist variables of a distributed
    object (every copy), or into the nnx variables of a plain one."""
    by_var: dict[int, tuple[Any, dict[int, Any]]] = {}
    for parts, var, index in _leaf_slots(obj):
        by_var.setdefault(id(var), (var, {}))[1][index] = _lookup(nest, parts)
    for var, values in by_var.values():
        binding = _binding(var)
        if binding is not None:
            for index, value in values.items():
                pd_var = binding.leaves[index].var
                assert pd_var is not None
                pd_var.assign(value, read_value=False)
            continue
        leaves, treedef = jax.tree.flatten(_SLOT.__get__(var))
        for index, value in values.items():
            old = leaves[index]
            if _is_key(old):
                leaves[index] = jax.random.wrap_key_data(value, impl=jax.random.key_impl(old))
            else:
                leaves[index] = jnp.asarray(value, dtype=jnp.result_type(old))
        var.set_value(jax.tree.unflatten(treedef, leaves))


def _register_checkpointable() -> None:
    try:
        from polydist.train import register_checkpointable
    except ImportError:  # a polydist without polydist.train
        return
    for cls in (nnx.Pytree, nnx.Variable):
        register_checkpointable(cls, to_nest=_to_nest, from_nest=_from_nest)


_register_checkpointable()
