"""Iterators that a ``polydist.train.Checkpoint`` can save (TF's iterator checkpoints).

An iterator's saved state is its *position* (elements handed out so far) plus the
state its pipelines started from: every ``shuffle``'s seed and count of passes. Restore
puts a fresh iterator of the same pipeline at that start and reads ``position``
elements again (replay), so it is exact for deterministic pipelines; TF saves every
op's internal state instead (buffers, RNG), which polydist's Python generators do not
expose. A pipeline is described by its ops and their arguments (its "fingerprint"), so
that restoring into a different pipeline is refused.

The protocol ``polydist.train.Checkpoint`` looks for (duck-typed, so that ``data``
needs nothing from ``train``):

* ``_checkpoint_state()``: the state as JSON; ValueError if it cannot be replayed;
* ``_checkpoint_problems(state)``: why ``state`` does not fit this iterator, if it does not;
* ``_checkpoint_restore(state)``: replays now (a failure changes nothing) and returns
  what moves this iterator to the restored position.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from polydist.data._elements import _SpecInferenceError
from polydist.data._nest import Nest

if TYPE_CHECKING:
    from polydist.data._dataset import Dataset

__all__ = ["OwnedIterator"]

STATE_VERSION: Final = 1
_WHAT_TO_DO: Final = (
    "Restore into an iterator of the same pipeline (the same dataset, transformations, "
    "batch size and distribution) that the checkpoint was saved from, or leave the "
    "iterator out of the Checkpoint to start the input over."
)


def nodes(roots: Sequence[Dataset]) -> list[Dataset]:
    """Every node of the pipelines, depth first from the outputs, each once."""
    seen: set[int] = set()
    out: list[Dataset] = []
    stack = list(reversed(roots))
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        stack.extend(reversed(node._inputs))
    return out


def _shuffles(roots: Sequence[Dataset]) -> list[Any]:
    from polydist.data._dataset import _ShuffleDataset  # _dataset imports this module

    return [node for node in nodes(roots) if isinstance(node, _ShuffleDataset)]


def shuffle_states(roots: Sequence[Dataset]) -> list[list[int]]:
    """Each ``shuffle``'s ``[seed, passes so far]``: what its next pass draws from."""
    return [[node._seed, node._epoch] for node in _shuffles(roots)]


def set_shuffle_states(roots: Sequence[Dataset], states: Sequence[Sequence[int]]) -> None:
    """Puts saved shuffle states back. An unseeded shuffle takes the saved seed (the
    one it drew in the saved run), so its order is replayed exactly too."""
    for node, (seed, epoch) in zip(_shuffles(roots), states, strict=True):
        node._seed = int(seed)
        node._epoch = int(epoch)


def unreplayable(roots: Sequence[Dataset]) -> Dataset | None:
    """A source that cannot be read again (a one-shot iterator), if the pipelines have one."""
    return next((node for node in nodes(roots) if not node._replayable), None)


def fingerprint(root: Dataset) -> list[str]:
    """One pipeline's ops with their arguments, from the output to the source."""
    return [d for node in nodes([root]) if (d := node._describe())]


def spec_text(root: Dataset) -> str | None:
    """``repr(root.element_spec)`` when it can be known without side effects, else None.

    Inferring a spec may read data (a ``map`` whose function fails on synthetic input),
    which begins a ``shuffle`` pass: the shuffles' states are put back after it.
    """
    from polydist.data._sources import _IterableDataset  # the sources subclass Dataset

    if any(isinstance(n, _IterableDataset) and n.peek_begins_a_pass for n in nodes([root])):
        return None  # peeking would begin a pass of a DataLoader
    before = shuffle_states([root])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return repr(root.element_spec)
    except _SpecInferenceError:
        return None
    finally:
        set_shuffle_states([root], before)


def skip(elements: Iterator[Any], count: int, what: str) -> None:
    """Reads ``count`` elements of ``elements``; ValueError if it has fewer."""
    for done in range(count):
        if next(elements, _MISSING) is _MISSING:
            raise ValueError(
                f"Checkpoint: restoring {what} replays its input up to the saved position, "
                f"{count} element(s), but the input ended after {done}. The input does not "
                "give the same elements on every pass (a generator function that reads a "
                "shared iterator, a source whose data changed, a random pipeline without "
                "seeds). Make the input deterministic, or leave the iterator out of the "
                "Checkpoint."
            )


_MISSING: Final = object()


def unreplayable_error(node: Dataset, what: str) -> ValueError:
    return ValueError(
        f"Checkpoint: cannot save the position of {what}: its input reads a one-shot "
        f"Python iterator ({node._op_name} over an iterator such as a generator object), "
        "which cannot be read again, so a restore could not find the position. Pass a "
        "re-iterable instead: a polydist.data.Dataset, a list, or the generator function "
        "itself (Dataset.from_generator(gen_fn), experimental_distribute_dataset(gen_fn)); "
        "or leave the iterator out of the Checkpoint."
    )


def problems(state: Mapping[str, Any], mine: Mapping[str, Any], what: str) -> list[str]:
    """Why the saved ``state`` does not fit an iterator whose state is ``mine``."""
    if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
        return [
            f"{what} expected an input iterator's state (version {STATE_VERSION}), but the "
            f"checkpoint holds {str(state)[:80]}. {_WHAT_TO_DO}"
        ]
    if not isinstance(state.get("position"), int) or state["position"] < 0:
        return [f"{what}: the checkpoint's position {state.get('position')!r} is not valid"]
    for key, name in (
        ("kind", "an iterator of"),
        ("layout", "input layout"),
        ("spec", "element_spec"),
        ("pipelines", "pipeline"),
    ):
        saved, have = state.get(key), mine.get(key)
        if key == "spec" and (saved is None or have is None):
            continue  # not known without reading data on one side
        if saved != have:
            if key == "pipelines":
                saved, have = _first_difference(saved, have)
            return [
                f"{what} was saved over a different input: its {name} was {_show(saved)} "
                f"but this iterator's is {_show(have)}. {_WHAT_TO_DO}"
            ]
    saved_shuffles = state.get("shuffles")
    if not isinstance(saved_shuffles, list) or len(saved_shuffles) != len(mine["shuffles"]):
        return [f"{what}: the checkpoint's shuffle states do not fit this pipeline. {_WHAT_TO_DO}"]
    return []


def _first_difference(saved: Any, have: Any) -> tuple[Any, Any]:
    """The first op where two pipelines differ, with the ops below it (their sources)."""
    if not isinstance(saved, list) or len(saved) != len(have):
        n = len(saved) if isinstance(saved, list) else "?"
        return f"{n} pipeline(s)", f"{len(have)} pipeline(s)"
    for a, b in zip(saved, have):
        if a != b:
            if not isinstance(a, list):
                return a, b
            top = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return a[top:] or "(ends)", b[top:] or "(ends)"
    return saved, have


def _show(value: Any) -> str:
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return " | ".join(" <- ".join(map(str, p)) for p in value)  # pipelines
    if isinstance(value, list):
        return " <- ".join(map(str, value))
    return str(value)


class OwnedIterator(Iterator[Nest]):
    """An iterator over a ``Dataset`` (``iter(dataset)``), as TF's ``OwnedIterator``.

    ``polydist.train.Checkpoint(iterator=it)`` saves its position; restore puts a fresh
    ``iter(dataset)`` of the same pipeline at that position (see this module's doc).
    """

    __slots__ = ("_convert", "_dataset", "_elements", "_position", "_start")

    def __init__(self, dataset: Dataset, convert: Callable[[Nest], Nest] | None = None) -> None:
        self._dataset = dataset
        self._convert = convert
        self._start = shuffle_states([dataset])  # before _iterate begins a shuffle pass
        self._elements: Iterator[Nest] = dataset._iterate()
        self._position = 0

    def __iter__(self) -> OwnedIterator:
        return self

    def __next__(self) -> Nest:
        element = next(self._elements)
        self._position += 1
        return element if self._convert is None else self._convert(element)

    @property
    def element_spec(self) -> Nest:
        """The spec of one element (the dataset's ``element_spec``)."""
        return self._dataset.element_spec

    def __repr__(self) -> str:
        return f"<OwnedIterator over {self._dataset!r}, at element {self._position}>"

    # -- polydist.train.Checkpoint ------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "kind": "iter(polydist.data.Dataset)",
            "layout": None,
            "spec": spec_text(self._dataset),
            "pipelines": [fingerprint(self._dataset)],
            "shuffles": self._start,
        }

    def _checkpoint_state(self) -> dict[str, Any]:
        bad = unreplayable([self._dataset])
        if bad is not None:
            raise unreplayable_error(bad, "an iterator of a polydist.data.Dataset")
        return {**self._identity(), "position": self._position}

    def _checkpoint_problems(self, state: Mapping[str, Any]) -> list[str]:
        return problems(state, self._identity(), "an iterator of a polydist.data.Dataset")

    def _checkpoint_restore(self, state: Mapping[str, Any]) -> Callable[[], None]:
        roots = [self._dataset]
        now = shuffle_states(roots)
        start: list[list[int]] = [list(s) for s in state["shuffles"]]
        position = int(state["position"])
        set_shuffle_states(roots, start)
        try:
            elements = self._dataset._iterate()
            skip(elements, position, "an iterator of a polydist.data.Dataset")
        except BaseException:
            set_shuffle_states(roots, now)
            raise

        def commit() -> None:
            self._start, self._elements, self._position = start, elements, position

        return commit
