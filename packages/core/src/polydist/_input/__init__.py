"""Distributed datasets and iterators."""
