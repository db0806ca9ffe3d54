"""Collective communication options (``tf.distribute.experimental.CommunicationOptions``).

On the simulator these are accepted and kept but change nothing: replicas
rendezvous instantly, so a collective never waits and ``timeout_seconds``
never fires. A disagreement between replicas (the situation a timeout is
meant to diagnose) raises ``CollectiveMismatchError`` at once instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import enum
import math
from collections.abc import Iterator
from typing import Any

__all__ = [
    "CollectiveCommunication",
    "CollectiveHints",
    "CommunicationImplementation",
    "CommunicationOptions",
]


class CommunicationImplementation(enum.Enum):
    """Which collective implementation to prefer (``tf.distribute.experimental``).

    ``AUTO`` lets the runtime choose; ``RING`` is ring-based collectives over
    the network (TF's gRPC/CPU path); ``NCCL`` is NVIDIA's library (GPUs only).
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


#: Deprecated alias of `CommunicationImplementation` (TF keeps both names).
CollectiveCommunication = CommunicationImplementation


class CommunicationOptions:
    """Options for cross-replica collectives.

    Args:
        bytes_per_pack: split collectives into packs of about this many bytes;
            0 (default) lets the runtime decide. Ignored by TPUStrategy.
        timeout_seconds: on real multi-worker engines a collective that takes
            longer raises ``DeadlineExceededError`` (a hang-debugging aid);
            ``None`` or 0 disables it. The simulator never waits (see module doc).
        implementation: a `CommunicationImplementation` or its name
            (``"ring"``, ``"NCCL"``, ...).

    Raises:
        ValueError: if ``bytes_per_pack`` is negative, ``timeout_seconds`` is
            negative or ``implementation`` is not a known implementation.
    """

    def __init__(
        self,
        bytes_per_pack: int = 0,
        timeout_seconds: float | None = None,
        implementation: CommunicationImplementation | str = CommunicationImplementation.AUTO,
    ) -> None:
        if isinstance(bytes_per_pack, bool) or not isinstance(bytes_per_pack, int):
            raise ValueError(
                f"Argument `bytes_per_pack` must be a non-negative integer, got "
                f"{type(bytes_per_pack).__name__} {bytes_per_pack!r}."
            )
        if bytes_per_pack < 0:
            raise ValueError(
                f"Argument `bytes_per_pack` must be >=0, Received {bytes_per_pack}. "
                "Pass 0 to let the runtime choose."
            )
        if timeout_seconds is not None:
            ok = isinstance(timeout_seconds, int | float) and not isinstance(timeout_seconds, bool)
            if not ok or math.isnan(timeout_seconds) or timeout_seconds < 0:
                raise ValueError(
                    f"Argument `timeout_seconds` must be None or a number >= 0 (0 disables the "
                    f"timeout), got {timeout_seconds!r}."
                )
        self.bytes_per_pack = bytes_per_pack
        self.timeout_seconds = timeout_seconds
        self.implementation = _as_implementation(implementation)

    def merge(self, options: CommunicationOptions | None) -> CommunicationOptions:
        """A copy of these options overridden by the non-default values of ``options``."""
        merged = copy.deepcopy(self)
        if options is None:
            return merged
        if options.bytes_per_pack != 0:
            merged.bytes_per_pack = options.bytes_per_pack
        if options.timeout_seconds is not None:
            merged.timeout_seconds = options.timeout_seconds
        if options.implementation is not CommunicationImplementation.AUTO:
            merged.implementation = options.implementation
        return merged

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CommunicationOptions):
            return NotImplemented
        return (self.bytes_per_pack, self.timeout_seconds, self.implementation) == (
            other.bytes_per_pack,
            other.timeout_seconds,
            other.implementation,
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"CommunicationOptions(bytes_per_pack={self.bytes_per_pack}, "
            f"timeout_seconds={self.timeout_seconds}, implementation={self.implementation})"
        )


def _as_implementation(value: Any) -> CommunicationImplementation:
    if isinstance(value, CommunicationImplementation):
        return value
    if isinstance(value, str):
        try:
            return CommunicationImplementation(value.upper())
        except ValueError:
            pass
    names = ", ".join(m.name for m in CommunicationImplementation)
    raise ValueError(
        "Argument `implementation` must be a CommunicationImplementation (or one of the names "
        f"{names}), got {type(value).__name__} {value!r}."
    )


def CollectiveHints(
    bytes_per_pack: int = 0, timeout_seconds: float | None = None
) -> CommunicationOptions:
    """Deprecated: use `CommunicationOptions` (which this returns, as TF does)."""
    return CommunicationOptions(bytes_per_pack=bytes_per_pack, timeout_seconds=timeout_seconds)


# The options of the collective being issued on this thread (or greenlet), as passed to
# ReplicaContext.all_reduce / reduce_to / batch_reduce_to: read where it is packed.
_CALL_OPTIONS: contextvars.ContextVar[CommunicationOptions | None] = contextvars.ContextVar(
    "polydist_call_options", default=None
)


def check_call_options(options: Any) -> CommunicationOptions | None:
    """A collective's ``options`` argument: None or ``CommunicationOptions``."""
    if options is None or isinstance(options, CommunicationOptions):
        return options
    raise TypeError(
        "options must be a polydist.experimental.CommunicationOptions or None, got "
        f"{type(options).__name__} {options!r}. Pass "
        "options=CommunicationOptions(bytes_per_pack=...), or leave it out."
    )


@contextlib.contextmanager
def call_options(options: Any) -> Iterator[None]:
    """Makes ``options`` (checked) the options of the collectives issued inside."""
    checked = check_call_options(options)
    if checked is None:
        yield
        return
    token = _CALL_OPTIONS.set(checked)
    try:
        yield
    finally:
        _CALL_OPTIONS.reset(token)


def current_call_options() -> CommunicationOptions | None:
    """The options of the collective being issued here (None: the call passed none)."""
    return _CALL_OPTIONS.get()


def bytes_per_pack(
    strategy_options: CommunicationOptions | None, call: CommunicationOptions | None
) -> int:
    """A collective's pack size: the ``call``'s options merged over the strategy's, as
    TF merges them (a non-default value of the call's wins)."""
    if call is not None and call.bytes_per_pack:
        return call.bytes_per_pack
    return strategy_options.bytes_per_pack if strategy_options is not None else 0
