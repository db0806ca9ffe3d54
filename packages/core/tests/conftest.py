from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from polydist.backend import busy_workers
from polydist.cluster_resolver import _connect
from polydist.tpu import _system as _tpu_system


@pytest.fixture(autouse=True)
def _fresh_tpu_systems() -> Iterator[None]:
    """initialize/shutdown_tpu_system and connect_to_cluster keep process-wide records
    (as TF does); each test starts without any."""
    yield
    _tpu_system._initialized.clear()
    _tpu_system._shut_down.clear()
    _connect._connection = None


@pytest.fixture(autouse=True)
def _no_busy_replica_threads() -> Iterator[None]:
    """Every test must leave no replica thread running replica code."""
    yield
    assert busy_workers() == 0, f"{busy_workers()} replica threads still busy after the test"


# --------------------------------------------------------------------------- checkpoints


def _write_legacy(
    root: Path,
    arrays: dict[str, Any],
    *,
    step: int = 1,
    metadata: dict[str, Any] | None = None,
    pointer: bool = True,
) -> Path:
    """``root/ckpt-<step>`` in format 1 (NumPy dtypes) or 2 (an ml_dtypes float, by its bits)."""
    ckpt = root / f"ckpt-{step}"
    ckpt.mkdir(parents=True)
    items = []
    has_ml = False
    for i, (name, value) in enumerate(arrays.items()):
        arr = np.asarray(value)
        file = f"{i:06d}.npy"
        item: dict[str, Any] = {"name": name, "file": file, "shape": list(arr.shape)}
        if arr.dtype.isbuiltin == 2:  # ml_dtypes: stored by its bits
            has_ml = True
            bits = arr.view(f"u{arr.dtype.itemsize}")
            item.update(dtype=arr.dtype.name, storage_dtype=bits.dtype.str)
        else:
            bits = arr
            item["dtype"] = arr.dtype.str
        data = np.ascontiguousarray(bits).tobytes()
        with open(ckpt / file, "wb") as f:
            header = {"descr": bits.dtype.str, "fortran_order": False, "shape": arr.shape}
            np.lib.format.write_array_header_1_0(f, header)
            f.write(data)
        item.update(nbytes=arr.nbytes, sha256=hashlib.sha256(data).hexdigest())
        items.append(item)
    doc = {
        "format": "polydist.checkpoint",
        "format_version": 2 if has_ml else 1,
        "step": step,
        "created_unix": time.time(),
        "metadata": metadata or {},
        "arrays": items,
    }
    (ckpt / "manifest.json").write_text(json.dumps(doc, indent=1) + "\n")
    if pointer:
        ptr = {"format": "polydist.checkpoint.pointer", "format_version": 1, "latest": ckpt.name}
        (root / "checkpoint").write_text(json.dumps(ptr, indent=1) + "\n")
    return ckpt


@pytest.fixture
def write_legacy() -> Callable[..., Path]:
    """Writes a checkpoint in the layout of format versions 1 and 2 (a .npy file per
    array), as polydist wrote them before format 3 (safetensors), so that tests can check
    they still restore. Only the layout, without atomicity."""
    return _write_legacy
