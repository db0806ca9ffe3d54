"""``polydist.config``: the ``tf.config`` calls that TF code ported to polydist makes.

``experimental_connect_to_cluster`` checks its arguments as TensorFlow does and
records the cluster; polydist has no remote eager context to connect (strategies
reach their workers through their backends).
"""

from __future__ import annotations

from polydist.cluster_resolver._connect import experimental_connect_to_cluster

__all__ = ["experimental_connect_to_cluster"]
