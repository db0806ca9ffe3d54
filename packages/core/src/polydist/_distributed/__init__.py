"""Strategies that span workers or TPU hosts (MultiWorkerMirroredStrategy, TPUStrategy),
the cluster rules they share, the multi-process kit and the local launcher."""
