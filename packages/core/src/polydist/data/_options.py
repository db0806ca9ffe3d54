"""``Options`` and ``AutoShardPolicy``, as ``tf.data.Options`` / ``tf.data.experimental``."""

from __future__ import annotations

import enum

__all__ = ["AutoShardPolicy", "DistributeOptions", "Options"]


class AutoShardPolicy(enum.IntEnum):
    """How a dataset is split across workers (``tf.data.experimental.AutoShardPolicy``).

    Values are TF's: OFF=-1, AUTO=0, FILE=1, DATA=2, HINT=3.
    """

    OFF = -1
    """No sharding: every worker reads the whole dataset."""
    AUTO = 0
    """FILE if the pipeline reads from files, else DATA (``AutoShardWarning`` if W > 1)."""
    FILE = 1
    """Each worker reads every W-th file of the pipeline's file source."""
    DATA = 2
    """Each worker reads every element but keeps every W-th (after rebatching)."""
    HINT = 3
    """Only ``shard(SHARD_HINT, SHARD_HINT)`` placeholders are filled in."""


class DistributeOptions:
    """``options.experimental_distribute``: how a dataset is distributed."""

    __slots__ = ("_auto_shard_policy",)

    def __init__(self) -> None:
        self._auto_shard_policy: AutoShardPolicy | None = None  # None: not set

    @property
    def auto_shard_policy(self) -> AutoShardPolicy:
        """The auto-shard policy; ``AutoShardPolicy.AUTO`` unless set."""
        return AutoShardPolicy.AUTO if self._auto_shard_policy is None else self._auto_shard_policy

    @auto_shard_policy.setter
    def auto_shard_policy(self, policy: AutoShardPolicy) -> None:
        if not isinstance(policy, AutoShardPolicy):
            raise TypeError(
                f"auto_shard_policy must be an AutoShardPolicy (AUTO, FILE, DATA, OFF or HINT), "
                f"got {policy!r}."
            )
        self._auto_shard_policy = policy

    def _merged(self, newer: DistributeOptions) -> DistributeOptions:
        merged = DistributeOptions()
        merged._auto_shard_policy = (
            newer._auto_shard_policy
            if newer._auto_shard_policy is not None
            else self._auto_shard_policy
        )
        return merged

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DistributeOptions):
            return NotImplemented
        return self.auto_shard_policy == other.auto_shard_policy

    def __repr__(self) -> str:
        return f"DistributeOptions(auto_shard_policy={self.auto_shard_policy!r})"


class Options:
    """Dataset options, like ``tf.data.Options`` (only the distribute group).

    Attach with ``dataset.with_options(options)``; options apply to the whole
    pipeline and are read back with ``dataset.options()``. When options are
    attached twice, values set in the later ``Options`` win, as in TF 2.
    """

    __slots__ = ("_experimental_distribute",)

    def __init__(self) -> None:
        self._experimental_distribute = DistributeOptions()

    @property
    def experimental_distribute(self) -> DistributeOptions:
        return self._experimental_distribute

    def merge(self, options: Options) -> Options:
        """New options: these, overridden by every value set in ``options``."""
        if not isinstance(options, Options):
            raise TypeError(f"Options.merge expects an Options, got {type(options).__name__}.")
        merged = Options()
        merged._experimental_distribute = self._experimental_distribute._merged(
            options._experimental_distribute
        )
        return merged

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Options):
            return NotImplemented
        return self._experimental_distribute == other._experimental_distribute

    def __repr__(self) -> str:
        return f"Options(experimental_distribute={self._experimental_distribute!r})"
