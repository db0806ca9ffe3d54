"""``polydist checkpoint inspect|convert``: what a checkpoint holds, and old ones rewritten.

Added to the ``polydist`` command by :mod:`polydist._tools.cli` (``_add_checkpoint``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from polydist._base.arrays import dtype_name
from polydist.checkpoint._format import _POINTER_NAME
from polydist.checkpoint._io import (
    FORMAT_VERSION,
    CheckpointError,
    CheckpointNotFoundError,
    Manifest,
    latest_checkpoint,
    list_checkpoints,
    read_arrays,
    read_manifest,
    read_pointer,
    write_checkpoint,
)

__all__ = ["add_parser"]

_VARIABLES_KEY = "polydist_variables"  # what checkpoint.save records per variable
_OBJECTS_KEY = "polydist_objects"  # what polydist.train.Checkpoint records per entry
_TRAIN_KEY = "polydist_checkpoint"  # polydist.train.Checkpoint's state dicts (JSON)
# The pointer file's own entries (written anew by each write); the rest is the writer's.
_POINTER_OWN = frozenset({"format", "format_version", "latest", "updated_unix"})


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "checkpoint",
        help="inspect or convert polydist checkpoints",
        description="Inspect a checkpoint (its variables, shapes, dtypes and step), or "
        "rewrite checkpoints of an older format in the current one.",
    )
    p.set_defaults(parser=p, handler=lambda args: _missing(p))
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    ins = actions.add_parser(
        "inspect",
        help="list a checkpoint's variables, shapes, dtypes and step",
        description="Lists the variables of a checkpoint (DIR is a checkpoint directory, "
        "ckpt-<step>, or a directory holding them: its latest one is shown, and the "
        "others listed), with their shapes, dtypes and synchronization/aggregation, and "
        "the step. No array data is read unless --verify is given.",
    )
    ins.add_argument("directory", metavar="DIR")
    ins.add_argument(
        "--verify", action="store_true", help="also read every array and check its checksum"
    )
    ins.set_defaults(handler=_cmd_inspect, parser=ins)
    conv = actions.add_parser(
        "convert",
        help="rewrite checkpoints in the current format (safetensors)",
        description="Reads every checkpoint in SRC (a checkpoint directory or a directory "
        "holding them, of any format polydist reads) and writes each, under its own name "
        "(ckpt-<step>, or a CheckpointManager's <checkpoint_name>-<n>) with its step and "
        f"metadata, into the directory DST in the current format ({FORMAT_VERSION}): "
        "tensors in a safetensors file beside a JSON manifest. SRC's latest is DST's, and "
        "what SRC's pointer file records (a CheckpointManager's managed checkpoints) is "
        "kept. SRC is not changed.",
    )
    conv.add_argument("source", metavar="SRC")
    conv.add_argument("destination", metavar="DST")
    conv.set_defaults(handler=_cmd_convert, parser=conv)


def _missing(parser: argparse.ArgumentParser) -> int:
    parser.print_usage(sys.stderr)
    print("polydist checkpoint: error: choose an action: inspect or convert", file=sys.stderr)
    return 2


def _fail(args: argparse.Namespace, e: CheckpointError) -> int:
    print(f"polydist checkpoint {args.action}: error: {e}", file=sys.stderr)
    return 2 if isinstance(e, CheckpointNotFoundError) else 1


def _describe(manifest: Manifest, name: str) -> str:
    """``ON_READ/SUM (SyncOnReadVariable)``, or what else the manifest says about ``name``."""
    variables = manifest.metadata.get(_VARIABLES_KEY)
    if isinstance(variables, dict) and isinstance(info := variables.get(name), dict):
        sync, agg, cls = info.get("synchronization"), info.get("aggregation"), info.get("class")
        return f"{sync}/{agg} ({cls})"
    objects = manifest.metadata.get(_OBJECTS_KEY)
    if isinstance(objects, dict) and isinstance(info := objects.get(name), dict):
        return str(info.get("describe", ""))
    return ""


def _cmd_inspect(args: argparse.Namespace) -> int:
    try:
        manifest = read_manifest(args.directory)
        verified = read_arrays(manifest.path) if args.verify else None
    except CheckpointError as e:
        return _fail(args, e)
    root = Path(args.directory)
    print(f"checkpoint {manifest.path}")
    print(f"  step {manifest.step}, format version {manifest.format_version}")
    if manifest.path != root:
        try:
            latest = latest_checkpoint(root)
        except CheckpointError:
            latest = None
        others = [p.name for p in list_checkpoints(root)]
        mark = " (the latest)" if latest == manifest.path else ""
        print(f"  in {root}{mark}; its checkpoints: {', '.join(others) or '(none)'}")
    rows = [("name", "shape", "dtype", "synchronization/aggregation")]
    total = 0
    for name, spec in manifest.arrays.items():
        rows.append(
            (
                name or "''",
                str(tuple(spec.shape)),
                dtype_name(spec.dtype),
                _describe(manifest, name),
            )
        )
        total += spec.nbytes
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3])
    print(f"  {len(manifest.arrays)} variable(s), {total} bytes")
    ours = (_VARIABLES_KEY, _OBJECTS_KEY, _TRAIN_KEY)
    extra = {k: v for k, v in manifest.metadata.items() if k not in ours}
    if extra:
        print(f"  metadata: {extra}")
    if verified is not None:
        print(f"  verified: every array matches its checksum ({len(verified)} read)")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    source = Path(args.source)
    destination = Path(args.destination)
    try:
        latest = read_manifest(source).path
        found = list_checkpoints(source) if latest != source else [latest]
        order = [p for p in found if p != latest] + [latest]  # the latest last: it stays latest
        # What the source's pointer file adds to "latest" (a CheckpointManager's managed
        # checkpoints, their timestamps): kept, so that a manager goes on managing them.
        pointer = read_pointer(source) if latest != source else None
        kept = {k: v for k, v in (pointer or {}).items() if k not in _POINTER_OWN}
        for path in order:
            manifest = read_manifest(path)
            arrays: dict[str, np.ndarray] = read_arrays(path)
            name = path.resolve().name  # its own name: ckpt-<step>, model-<n>, ...
            if not name or name.startswith(".") or name == _POINTER_NAME:
                name = f"ckpt-{manifest.step}"  # (SRC given as '.', say)
            out = write_checkpoint(
                destination / name,
                arrays,
                step=manifest.step,
                metadata=dict(manifest.metadata),
                pointer=kept if path == latest else {},
            )
            print(f"{path} (format {manifest.format_version}) -> {out}")
    except CheckpointError as e:
        return _fail(args, e)
    return 0
