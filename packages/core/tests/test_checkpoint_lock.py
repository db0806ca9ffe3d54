"""The checkpoint writers' lock file is never followed through a symlink."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import polydist as pd

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the lock is POSIX only")


def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    strategy = pd.MirroredStrategy(2)
    with strategy.scope():
        v = pd.Variable(np.float32(1.5), name="v")
    root = tmp_path / "ckpt"
    root.mkdir()
    target = tmp_path / "elsewhere" / "victim"
    target.parent.mkdir()
    (root / ".polydist-lock").symlink_to(target)
    with pytest.raises(OSError, match="lock file is a symlink"):
        pd.checkpoint.save(root, {"v": v})
    assert not target.exists()  # O_CREAT through the link would have created it
