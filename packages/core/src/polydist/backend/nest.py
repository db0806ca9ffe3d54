"""Nests (pytrees) as core sees them: dicts, lists, tuples, namedtuples, dataclasses
registered with optree, and the node types of registered frameworks.

A backend flattens a replica's arguments or results with the same rules as core, so
that leaves line up across the seam (``flatten`` returns ``(leaves, spec)``;
``unflatten(spec, leaves)`` rebuilds). A backend whose framework has its own tree
types (flax's ``nnx.State``, a torch module's state) registers them once with
:func:`register_tree_system`.
"""

from polydist._valuetypes.nest import flatten as flatten
from polydist._valuetypes.nest import flatten_one_level as flatten_one_level
from polydist._valuetypes.nest import flatten_with_path as flatten_with_path
from polydist._valuetypes.nest import is_nested as is_nested
from polydist._valuetypes.nest import map_structure as map_structure
from polydist._valuetypes.nest import register_tree_system as register_tree_system
from polydist._valuetypes.nest import unflatten as unflatten

__all__ = [
    "flatten",
    "flatten_one_level",
    "flatten_with_path",
    "is_nested",
    "map_structure",
    "register_tree_system",
    "unflatten",
]
