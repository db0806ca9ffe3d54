"""Distributed values, variables, nests and IndexedSlices."""
