"""polydist_jax: polydist's JAX backend.

Select it with ``backend="jax"`` or ``$POLYDIST_BACKEND=jax``, or pass a
configured :class:`JaxBackend`::

    strategy = polydist.MirroredStrategy(backend="jax")

``strategy.run`` traces the replica function once and compiles it with
``jax.jit`` over ``jax.shard_map`` on a one-axis ``"replica"`` mesh.
"""

from polydist.backend.tracing import declare_internal_modules as _declare_internal_modules
from polydist_jax._api import AXIS as AXIS
from polydist_jax._api import in_compiled_run as in_compiled_run
from polydist_jax._api import replicate as replicate
from polydist_jax._api import varying as varying
from polydist_jax._backend import JaxBackend as JaxBackend
from polydist_jax._lazy import LazyPerReplica as LazyPerReplica
from polydist_jax._multi_worker import WATCHDOG_EXIT_CODE as WATCHDOG_EXIT_CODE
from polydist_jax._multi_worker import JaxProcessBackend as JaxProcessBackend
from polydist_jax._multi_worker import JaxWorkerProcesses as JaxWorkerProcesses
from polydist_jax._multi_worker import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
from polydist_jax._multi_worker import initialize as initialize_multi_worker
from polydist_jax._pytree import register as _register_pytrees
from polydist_jax._pytree import register_tree_system as _register_tree_system

# A trace's call site is the user's line, not this backend's.
_declare_internal_modules("polydist_jax")

_register_pytrees()
_register_tree_system()

__version__ = "0.1.0"

__all__ = [
    "AXIS",
    "WATCHDOG_EXIT_CODE",
    "JaxBackend",
    "JaxProcessBackend",
    "JaxWorkerProcesses",
    "LazyPerReplica",
    "MultiWorkerMirroredStrategy",
    "in_compiled_run",
    "initialize_multi_worker",
    "replicate",
    "varying",
]
