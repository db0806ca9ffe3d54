"""Error classes, named as TensorFlow names them.

TF raises ``tf.errors.*`` classes from its runtime; polydist raises the same
names so that ``except`` clauses ported from TF keep working. Each also
derives from the closest Python built-in, so idiomatic ``except ValueError``
works too.
"""

from __future__ import annotations

__all__ = [
    "BackendNotFoundError",
    "CancelledError",
    "CollectiveMismatchError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "OpError",
    "OutOfRangeError",
    "UnavailableError",
]


class OpError(Exception):
    """Base class of the runtime errors TF reports as ``tf.errors.OpError``."""


class InvalidArgumentError(OpError, ValueError):
    """An operation received an invalid argument (TF: ``InvalidArgumentError``)."""


class OutOfRangeError(OpError, IndexError):
    """Iteration went past the end of the input (TF: ``OutOfRangeError``)."""


class DeadlineExceededError(OpError, TimeoutError):
    """A collective or replica did not finish within its timeout (TF: ``DeadlineExceededError``)."""


class UnavailableError(OpError, ConnectionError):
    """A peer worker or service is unavailable (TF: ``UnavailableError``)."""


class FailedPreconditionError(OpError, RuntimeError):
    """The system is not in a state to run the operation (TF: ``FailedPreconditionError``),
    e.g. ``TPUStrategy.run`` on a TPU system shut down with
    ``polydist.tpu.shutdown_tpu_system``."""


class CancelledError(OpError):
    """An operation was cancelled, e.g. because another replica failed."""


class CollectiveMismatchError(RuntimeError):
    """Replicas disagreed on a collective; on real hardware the program would hang.

    Raised when one replica reaches ``all_reduce``, ``all_gather`` or
    ``merge_call`` while another returns, or when replicas call different
    collectives, or the same one with different shapes or dtypes. The message
    names every replica, what it reached, and the user's source line. The
    multi-process ``MultiWorkerMirroredStrategy`` of torch and JAX raises it on
    every worker when workers disagree, naming each worker instead.
    """


class BackendNotFoundError(ValueError):
    """No backend with the requested name is installed."""
