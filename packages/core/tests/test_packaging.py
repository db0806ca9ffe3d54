"""Every distribution ships the repository's Apache-2.0 LICENSE and index-page metadata.

hatchling packs no file from outside a package's folder, so each folder holds a copy
of the root LICENSE; this keeps the copies identical to it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ["packages/core", "packages/sim", "packages/backend-jax", "packages/backend-torch"]
PACKAGES.append("conformance")

pytestmark = pytest.mark.skipif(
    not (ROOT / "LICENSE").is_file(), reason="needs the polydist checkout (its root LICENSE)"
)


def test_the_root_license_is_apache_2() -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


@pytest.mark.parametrize("folder", PACKAGES)
def test_each_package_ships_the_root_license(folder: str) -> None:
    copy = ROOT / folder / "LICENSE"
    assert copy.read_bytes() == (ROOT / "LICENSE").read_bytes(), (
        f"{copy} differs from the root LICENSE: copy it again (cp LICENSE {folder}/LICENSE)"
    )
    project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text(encoding="utf-8"))
    meta = project["project"]
    assert meta["license"] == "Apache-2.0"
    assert meta["license-files"] == ["LICENSE"]
    assert meta["authors"] and all(a.get("name") for a in meta["authors"])
    assert meta["keywords"] and "tf.distribute" in meta["keywords"]
    classifiers = meta["classifiers"]
    assert "Typing :: Typed" in classifiers  # each package has py.typed
    assert not [c for c in classifiers if c.startswith("License ::")]  # PEP 639: use license
    assert classifiers == sorted(classifiers)
    requires = project["build-system"]["requires"]
    assert requires == ["hatchling>=1.27"]  # the first hatchling with PEP 639 license-files
