"""Leaf helpers with no polydist dependencies.

Arrays, ReduceOp, device strings, communication options and scatter.
"""
