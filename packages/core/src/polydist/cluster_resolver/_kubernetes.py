"""`KubernetesClusterResolver`: the cluster from the pods that match label selectors.

Behaviour follows TensorFlow's
``tensorflow/python/distribute/cluster_resolver/kubernetes_cluster_resolver.py``:

* ``job_to_label_mapping`` maps each job to label selectors (default
  ``{"worker": ["job-name=tensorflow"]}``). For each selector, in order, the
  pods of ``client.list_pod_for_all_namespaces(label_selector=...)`` are
  sorted by ``metadata.name`` and each becomes the task
  ``"<status.host_ip>:<tf_server_port>"`` (TensorFlow uses the *host* IP, not
  ``status.pod_ip``).
* A pod whose ``status.phase`` is not ``"Running"`` raises ``RuntimeError``
  (``Pod "<name>" is not running; phase: "<phase>"``).
* The cluster is read from the API server on every `cluster_spec` call.
* ``task_type`` and ``task_id`` start as None: set them (or pass them to
  `master`) before using the resolver with a multi-worker strategy.

The ``kubernetes`` package is optional: it is imported only when no
``override_client`` is given, and then loads the cluster configuration in the
constructor (``load_incluster_config()`` for
``KubernetesExecutableLocation.WITHIN_CLUSTER``, ``load_kube_config()`` for
``OFF_CLUSTER``). Differences: `cluster_spec` does not load the kube config
again (TensorFlow calls ``load_kube_config()`` there, which fails inside a pod
that has no kubeconfig file), and a single selector string is accepted in
place of a list of selectors.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

from polydist.cluster_resolver._base import ClusterResolver, task_master
from polydist.cluster_resolver._cluster_spec import ClusterSpec

__all__ = ["ExecutableLocation", "KubernetesClusterResolver", "KubernetesExecutableLocation"]

_MISSING_CLIENT = (
    "The Kubernetes Python client must be installed before using the Kubernetes Cluster "
    "Resolver. To install the Kubernetes Python client, run `pip install kubernetes` on "
    "your command line."
)


class ExecutableLocation(enum.Enum):
    """Where the program runs, which decides how to reach the Kubernetes API server.

    ``WITHIN_CLUSTER``: in a pod of the cluster. ``OFF_CLUSTER``: anywhere
    else (the kubeconfig file is used). Exported as
    ``polydist.cluster_resolver.KubernetesExecutableLocation``.
    """

    WITHIN_CLUSTER = 0
    OFF_CLUSTER = 1


KubernetesExecutableLocation = ExecutableLocation


def _import_kubernetes(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(f"kubernetes.{module}")
    except ImportError as err:
        raise ImportError(_MISSING_CLIENT) from err


class KubernetesClusterResolver(ClusterResolver):
    """ClusterResolver for Kubernetes: one task per running pod matching a selector.

    Args:
      job_to_label_mapping: ``{job name: [label selector, ...]}``, e.g.
        ``{"worker": ["job-name=worker-a", "job-name=worker-b"], "ps":
        ["job-name=ps"]}``. Default: ``{"worker": ["job-name=tensorflow"]}``.
      tf_server_port: the port every task's server listens on.
      rpc_layer: the protocol between tasks, prefixed by `master`.
      override_client: an object with ``list_pod_for_all_namespaces(
        label_selector=...)`` (a ``kubernetes.client.CoreV1Api``, or a fake for
        tests). With it, the ``kubernetes`` package is not imported and no
        configuration is loaded: that is the caller's job.
      executable_location: a `KubernetesExecutableLocation`, for loading the
        configuration when no ``override_client`` is given.

    Raises:
      ImportError: if ``kubernetes`` is not installed and no
        ``override_client`` is given.
      ValueError: if ``executable_location`` is not a
        `KubernetesExecutableLocation` (checked only without ``override_client``).
    """

    def __init__(
        self,
        job_to_label_mapping: Mapping[str, Sequence[str] | str] | None = None,
        tf_server_port: int = 8470,
        rpc_layer: str | None = "grpc",
        override_client: Any = None,
        executable_location: ExecutableLocation = ExecutableLocation.WITHIN_CLUSTER,
    ) -> None:
        if override_client is None:
            config = _import_kubernetes("config")
            if executable_location == ExecutableLocation.OFF_CLUSTER:
                config.load_kube_config()
            elif executable_location == ExecutableLocation.WITHIN_CLUSTER:
                config.load_incluster_config()
            else:
                raise ValueError(
                    "The executable location provided is invalid. Got "
                    f"{executable_location!r}; use KubernetesExecutableLocation.WITHIN_CLUSTER "
                    "or KubernetesExecutableLocation.OFF_CLUSTER."
                )
        if not job_to_label_mapping:
            job_to_label_mapping = {"worker": ["job-name=tensorflow"]}
        self._job_to_label_mapping: dict[str, list[str]] = {
            str(job): [selectors] if isinstance(selectors, str) else list(selectors)
            for job, selectors in job_to_label_mapping.items()
        }
        self._tf_server_port = tf_server_port
        self._override_client = override_client
        self.task_type = None
        self.task_id = None
        self.rpc_layer = rpc_layer

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """``"<rpc_layer>://host_ip:port"`` of a task (default: `task_type`/`task_id`).

        Returns ``""`` when no task is given and none is set on the resolver.
        """
        return task_master(self, task_type, task_id, rpc_layer)

    def _client(self) -> Any:
        if self._override_client is not None:
            return self._override_client
        return _import_kubernetes("client").CoreV1Api()

    def cluster_spec(self) -> ClusterSpec:
        """Returns the cluster from the API server's current pod list.

        Raises:
          RuntimeError: if a matching pod is not in the ``Running`` phase.
        """
        client = self._client()
        cluster: dict[str, list[str]] = {}
        for job, selectors in self._job_to_label_mapping.items():
            tasks: list[str] = []
            for selector in selectors:
                pods = client.list_pod_for_all_namespaces(label_selector=selector).items
                for pod in sorted(pods, key=lambda p: p.metadata.name):
                    if pod.status.phase != "Running":
                        raise RuntimeError(
                            f'Pod "{pod.metadata.name}" is not running; phase: "{pod.status.phase}"'
                        )
                    tasks.append(f"{pod.status.host_ip}:{self._tf_server_port}")
            cluster[job] = tasks
        return ClusterSpec(cluster)
