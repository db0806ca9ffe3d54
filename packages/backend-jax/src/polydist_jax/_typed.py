"""Typed wrappers for the few JAX functions that have no annotations (mypy --strict)."""

from __future__ import annotations

from typing import Any

import jax
from jax import lax
from jax.sharding import PartitionSpec

__all__ = ["pspec", "psum", "x64_enabled"]


def psum(x: Any, axis_name: str | tuple[str, ...]) -> Any:
    return lax.psum(x, axis_name)  # type: ignore[no-untyped-call]


def pspec(*axes: str | tuple[str, ...]) -> PartitionSpec:
    return PartitionSpec(*axes)  # type: ignore[no-untyped-call]


def x64_enabled() -> bool:
    """JAX's x64 mode, now (it changes dtypes, so it is part of a program's signature)."""
    return bool(jax.config.jax_enable_x64)  # type: ignore[attr-defined]
