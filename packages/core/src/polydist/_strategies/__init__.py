"""Strategies, their extended objects and the replica/cross-replica contexts.

Also the eager replica runner.
"""
