"""Clusters, multi-worker strategies, the multi-process kit and the local launcher."""
