"""Cluster resolvers: ``tf.distribute.cluster_resolver`` without TensorFlow.

`ClusterSpec` describes a cluster as jobs of tasks; a `ClusterResolver` tells
a strategy which cluster it runs in and which task this process is.
`TFConfigClusterResolver` reads the ``TF_CONFIG`` environment variable,
`SimpleClusterResolver` returns what it is given, `UnionResolver` merges
several, and `TPUClusterResolver` describes a SIMULATED TPU slice (see
`polydist.tpu.SIMULATED_SLICES`). `SlurmClusterResolver` reads a Slurm job
step's environment; `KubernetesClusterResolver` and `GCEClusterResolver` ask
the Kubernetes or Compute Engine API (their client packages are optional and
imported only when no client or service object is passed in).
"""

from polydist.cluster_resolver._base import (
    ClusterResolver,
    DeviceAttributes,
    DeviceLister,
    SimpleClusterResolver,
    UnionClusterResolver,
    UnionResolver,
    format_master_url,
    get_accelerator_devices,
    set_accelerator_device_lister,
)
from polydist.cluster_resolver._cluster_spec import ClusterSpec, ClusterSpecLike
from polydist.cluster_resolver._gce import GCEClusterResolver
from polydist.cluster_resolver._kubernetes import (
    KubernetesClusterResolver,
    KubernetesExecutableLocation,
)
from polydist.cluster_resolver._slurm import SlurmClusterResolver
from polydist.cluster_resolver._tfconfig import TFConfigClusterResolver
from polydist.cluster_resolver._tpu import LOCAL_TPU_ENV, TPUClusterResolver, TPUSystemMetadata

__all__ = [
    "LOCAL_TPU_ENV",
    "ClusterResolver",
    "ClusterSpec",
    "ClusterSpecLike",
    "DeviceAttributes",
    "DeviceLister",
    "GCEClusterResolver",
    "KubernetesClusterResolver",
    "KubernetesExecutableLocation",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TPUClusterResolver",
    "TPUSystemMetadata",
    "UnionClusterResolver",
    "UnionResolver",
    "format_master_url",
    "get_accelerator_devices",
    "set_accelerator_device_lister",
]
