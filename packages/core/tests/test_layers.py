"""Core's layers: the context stack sits below the strategies (polydist._base.context),
which register the default strategy with it; see README's "Layout"."""

from __future__ import annotations

import subprocess
import sys

import polydist as pd
from polydist._base import context as base_context


def test_the_default_strategy_is_told_apart_from_the_others() -> None:
    default = pd.get_strategy()
    assert base_context.is_default_strategy(default)
    assert not base_context.is_default_strategy(pd.MirroredStrategy(2))
    assert not base_context.is_default_strategy(pd.OneDeviceStrategy("/cpu:0"))
    with pd.MirroredStrategy(2).scope():
        assert not base_context.is_default_strategy(pd.get_strategy())


def test_the_default_strategy_is_registered_whatever_module_comes_first() -> None:
    # The context stack knows no strategy class: importing it first must still give the
    # default strategy (polydist's __init__ registers it on the way).
    code = (
        "from polydist._base import context\n"
        "s = context.get_strategy()\n"
        "print(repr(s), context.is_default_strategy(s), context.get_replica_context() is not None)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert out.strip() == "<default polydist strategy> True True"
