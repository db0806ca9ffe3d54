"""polydist_torch: polydist's PyTorch backend.

Select it with ``backend="torch"`` or pass a configured ``TorchBackend``::

    import polydist as pd

    strategy = pd.MirroredStrategy(4, backend="torch")  # 4 GPUs, or 4 virtual CPU replicas

``distribute_module(module)`` and ``distribute_optimizer(optimizer)`` make an
``nn.Module`` and one ``torch.optim`` optimizer train inside ``strategy.run``
(see docs/frameworks/torch.md).

``parameters(strategy_or_variables)`` turns polydist variables into the
``torch.nn.Parameter`` objects of each replica, for ``torch.optim``.

``XlaSpmdBackend`` runs strategies over torch-xla devices as one SPMD program; it
(and torch-xla) is imported only when first used. It is also registered as the
backend ``"torch_xla"`` (``pip install 'polydist-torch[xla]'``).
"""

from typing import TYPE_CHECKING, Any

from polydist.backend.tracing import declare_internal_modules as _declare_internal_modules
from polydist_torch._autograd import TorchReplicaChannel as TorchReplicaChannel
from polydist_torch._backend import Reduction as Reduction
from polydist_torch._backend import TorchBackend as TorchBackend
from polydist_torch._devices import MAX_VIRTUAL_CPU_REPLICAS as MAX_VIRTUAL_CPU_REPLICAS
from polydist_torch._devices import torch_device as torch_device
from polydist_torch._grad_scaler import DistributedGradScaler as DistributedGradScaler
from polydist_torch._grad_scaler import distribute_grad_scaler as distribute_grad_scaler
from polydist_torch._modules import DistributedModule as DistributedModule
from polydist_torch._modules import DistributedOptimizer as DistributedOptimizer
from polydist_torch._modules import LocalGradientWarning as LocalGradientWarning
from polydist_torch._modules import distribute_module as distribute_module
from polydist_torch._modules import distribute_optimizer as distribute_optimizer
from polydist_torch._multi_worker import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
from polydist_torch._multi_worker import TorchProcessGroupBackend as TorchProcessGroupBackend
from polydist_torch._multi_worker import TorchWorkerProcesses as TorchWorkerProcesses
from polydist_torch._multi_worker import shutdown as shutdown_multi_worker
from polydist_torch._parameters import parameters as parameters
from polydist_torch._pytree import register_tree_system as _register_tree_system

# Collectives (and, on torch, their gradients inside autograd) run in these packages:
# a trace's call site is the user's line beyond them.
_declare_internal_modules("polydist_torch", "torch", "torch_xla")

if TYPE_CHECKING:
    from polydist_torch._xla import UNSUPPORTED as XLA_UNSUPPORTED
    from polydist_torch._xla import XlaSpmdBackend as XlaSpmdBackend

__version__ = "0.1.0"

_register_tree_system()


def __getattr__(name: str) -> Any:
    # torch-xla is heavy and optional: import it only when its backend is asked for.
    if name == "XlaSpmdBackend":
        from polydist_torch._xla import XlaSpmdBackend

        return XlaSpmdBackend
    if name == "XLA_UNSUPPORTED":
        from polydist_torch._xla import UNSUPPORTED

        return UNSUPPORTED
    raise AttributeError(f"module 'polydist_torch' has no attribute {name!r}")


__all__ = [
    "DistributedGradScaler",
    "DistributedModule",
    "DistributedOptimizer",
    "LocalGradientWarning",
    "MAX_VIRTUAL_CPU_REPLICAS",
    "MultiWorkerMirroredStrategy",
    "Reduction",
    "TorchBackend",
    "TorchProcessGroupBackend",
    "TorchWorkerProcesses",
    "TorchReplicaChannel",
    "XLA_UNSUPPORTED",
    "XlaSpmdBackend",
    "distribute_grad_scaler",
    "distribute_module",
    "distribute_optimizer",
    "parameters",
    "shutdown_multi_worker",
    "torch_device",
]
