"""What the ``polydist`` command's subcommands share: the usage error and text tables."""

from __future__ import annotations

from collections.abc import Sequence


class _UsageError(Exception):
    """A runtime problem the user can fix: reported in one line, exit code 2."""


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        ]
        return "  ".join(cells).rstrip()

    return [fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]
