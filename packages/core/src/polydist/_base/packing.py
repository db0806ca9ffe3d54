"""How a nest's arrays are packed into collectives, as TF packs them (``group_by_size``)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["pack_by_dtype", "pack_by_size"]


def pack_by_size(nbytes: Sequence[int], bytes_per_pack: int) -> list[list[int]]:
    """The indices ``0..len(nbytes)-1`` in order, split into packs as TF's
    ``group_by_size`` does: everything in one pack when ``bytes_per_pack`` is 0, else a
    new pack starts once the last one holds more than ``bytes_per_pack`` bytes."""
    if bytes_per_pack < 0:
        raise ValueError(f"bytes_per_pack must be >= 0, got {bytes_per_pack}.")
    if bytes_per_pack == 0:
        return [list(range(len(nbytes)))] if nbytes else []
    packs: list[list[int]] = []
    last = 0
    for i, size in enumerate(nbytes):
        if not packs or last > bytes_per_pack:
            packs.append([])
            last = 0
        packs[-1].append(i)
        last += size
    return packs


def pack_by_dtype(
    dtypes: Sequence[Hashable], nbytes: Sequence[int], bytes_per_pack: int
) -> list[list[int]]:
    """The packs a nest's arrays cross the workers in, as TF packs them: the indices of
    each dtype (in order of first appearance), split by `pack_by_size`. An array whose
    dtype is given as ``None`` is never packed (a pack of its own, where it stands).
    Every worker with the same nest gets the same packs, in the same order."""
    if len(dtypes) != len(nbytes):
        raise ValueError(
            f"pack_by_dtype got {len(dtypes)} dtypes and {len(nbytes)} sizes; pass one of "
            "each per array."
        )
    groups: dict[Hashable, list[int]] = {}
    for i, dtype in enumerate(dtypes):
        groups.setdefault(("alone", i) if dtype is None else dtype, []).append(i)
    packs: list[list[int]] = []
    for indices in groups.values():
        sizes = [nbytes[i] for i in indices]
        packs += [[indices[k] for k in pack] for pack in pack_by_size(sizes, bytes_per_pack)]
    return packs
