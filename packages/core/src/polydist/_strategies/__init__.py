"""Strategies, their extended objects and the replica/cross-replica contexts.

Also the eager replica runner. The strategies that span workers or TPU hosts are in
``_distributed``; TF1's are in ``_v1``.
"""
