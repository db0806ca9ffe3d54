"""`GCEClusterResolver`: the cluster from a Google Compute Engine instance group.

Behaviour follows TensorFlow's
``tensorflow/python/distribute/cluster_resolver/gce_cluster_resolver.py``:

* Every `cluster_spec` call lists the group's RUNNING instances
  (``service.instanceGroups().listInstances(..., body={"instanceState":
  "RUNNING"}, orderBy="name")``, following ``listInstances_next`` pages),
  looks each up with ``service.instances().get(...)``, and makes
  ``"<networkInterfaces[0].networkIP>:<port>"`` a task. The addresses are
  sorted (as strings) and form the one job ``task_type``.
* ``task_type`` is fixed at construction (setting it raises
  ``RuntimeError``); ``task_id`` and ``rpc_layer`` can be set.
* `master` returns ``"<rpc_layer>://address"`` of (``task_type``,
  ``task_id``), each defaulting to the resolver's; no prefix when the RPC
  layer is empty.

``googleapiclient`` is optional: it is imported only when no ``service`` is
given (``discovery.build("compute", "v1", credentials=...)``); with a
``service`` the ``credentials`` are ignored. Differences: the instance group
is passed to ``listInstances`` as ``instanceGroup``, the Compute API's name
for it (TensorFlow passes ``instanceGroups=``, which the real client
rejects); an empty group (a response without ``"items"``) gives an empty job
instead of ``KeyError``; and ``credentials="default"`` uses
``oauth2client``'s application-default credentials when that (deprecated)
package is installed, else lets ``googleapiclient`` find the default
credentials itself (TensorFlow needs ``oauth2client``).
"""

from __future__ import annotations

import importlib
from typing import Any

from polydist.cluster_resolver._base import ClusterResolver, task_master
from polydist.cluster_resolver._cluster_spec import ClusterSpec

__all__ = ["GCEClusterResolver"]


def _default_credentials() -> Any:
    try:
        client = importlib.import_module("oauth2client.client")
    except ImportError:
        return None  # googleapiclient finds the application-default credentials itself
    return client.GoogleCredentials.get_application_default()


def _build_service(credentials: Any) -> Any:
    try:
        discovery = importlib.import_module("googleapiclient.discovery")
    except ImportError as err:
        raise ImportError(
            "googleapiclient must be installed before using the GCE cluster resolver "
            "(pip install google-api-python-client), or pass service=."
        ) from err
    if credentials == "default":
        credentials = _default_credentials()
    return discovery.build("compute", "v1", credentials=credentials)


class GCEClusterResolver(ClusterResolver):
    """ClusterResolver for Google Compute Engine: one task per instance of a group.

    Args:
      project: the GCE project.
      zone: the zone of the instance group.
      instance_group: the instance group's name.
      port: the port of the TensorFlow server on every instance.
      task_type: the job the instances form.
      task_id: this VM's index within the group (instances are ordered by
        address; each VM must be given its own index).
      rpc_layer: the protocol between tasks, prefixed by `master`.
      credentials: GCE credentials; ``"default"``: the application-default
        credentials. Ignored when ``service`` is given.
      service: the Compute API object (default
        ``googleapiclient.discovery.build("compute", "v1", ...)``), or a fake
        with the same ``instanceGroups()`` and ``instances()`` methods.

    Raises:
      ImportError: if ``googleapiclient`` is not installed and no ``service``
        is given.
    """

    def __init__(
        self,
        project: str,
        zone: str,
        instance_group: str,
        port: int,
        task_type: str = "worker",
        task_id: int = 0,
        rpc_layer: str | None = "grpc",
        credentials: Any = "default",
        service: Any = None,
    ) -> None:
        self._project = project
        self._zone = zone
        self._instance_group = instance_group
        self._port = port
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._credentials = credentials
        self._service = service if service is not None else _build_service(credentials)

    def cluster_spec(self) -> ClusterSpec:
        """Returns ``{task_type: sorted addresses}`` of the group's running instances."""
        service = self._service
        request = service.instanceGroups().listInstances(
            project=self._project,
            zone=self._zone,
            instanceGroup=self._instance_group,
            body={"instanceState": "RUNNING"},
            orderBy="name",
        )
        workers: list[str] = []
        while request is not None:
            response = request.execute()
            for item in response.get("items", []):
                name = item["instance"].split("/")[-1]
                instance_request = service.instances().get(
                    project=self._project, zone=self._zone, instance=name
                )
                if instance_request is None:
                    continue
                details = instance_request.execute()
                ip_address = details["networkInterfaces"][0]["networkIP"]
                workers.append(f"{ip_address}:{self._port}")
            request = service.instanceGroups().listInstances_next(
                previous_request=request, previous_response=response
            )
        workers.sort()
        cluster: dict[Any, list[str]] = {self._task_type: workers}
        return ClusterSpec(cluster)

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """``"<rpc_layer>://address"`` of (``task_type``, ``task_id``), default the resolver's."""
        return task_master(self, task_type, task_id, rpc_layer)

    @property
    def task_type(self) -> str | None:
        return self._task_type

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        raise RuntimeError(
            "You cannot reset the task_type of the GCEClusterResolver after it has been "
            f"created (it is {self._task_type!r}); create a new resolver with task_type="
            f"{task_type!r}."
        )

    @property
    def task_id(self) -> int | None:
        return self._task_id

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        return self._rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer
