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


# -- the backend seam: backends import only polydist and polydist.backend.* ---------------

# import-linter checks the packages themselves (pyproject.toml, `nox -s lint`); their tests
# and the examples are no importable packages, so grimp cannot see them: checked here.
_USES_ONLY_PUBLIC_NAMES = (
    "packages/sim",
    "packages/backend-jax",
    "packages/backend-torch",
    "conformance/src",
    "examples",
)


def _private_polydist_imports(path: Path, root: Path = ROOT) -> list[str]:
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "polydist" and any(p.startswith("_") for p in parts[1:]):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {name}")
    return found


def test_backends_tests_and_examples_import_no_private_polydist_module() -> None:
    found = [
        hit
        for folder in _USES_ONLY_PUBLIC_NAMES
        for path in sorted((ROOT / folder).rglob("*.py"))
        for hit in _private_polydist_imports(path)
    ]
    assert not found, (
        "These import private polydist modules; use polydist or polydist.backend.* "
        "(docs/extending.md):\n" + "\n".join(found)
    )


def test_the_private_import_check_sees_private_modules(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "import polydist.backend.tracing\nfrom polydist import _sim\n"
        "from polydist.backend._contract import Backend\nfrom polydist import Variable\n",
        encoding="utf-8",
    )
    assert _private_polydist_imports(module, tmp_path) == [
        "m.py:2: polydist._sim",
        "m.py:3: polydist.backend._contract.Backend",
    ]
