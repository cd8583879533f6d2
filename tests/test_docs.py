"""docs/design.md, the contributors' design, against the code it describes."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_FOLDERS = ("bubblespec", "backends", "policies", "cli")
"""The folders the distribution ships (backends/, policies/ and cli/ as bubblespec.backends, ...)."""


def _layout_section() -> str:
    text = (ROOT / "docs" / "design.md").read_text()
    start = text.index("## 7. Layout and plugins")
    return text[start : text.index("**Layers and data flow.**", start)]


def test_every_module_of_the_package_is_in_the_design_docs_layout():
    """A module added without a word in docs/design.md §7 fails here, naming it (the layout once missed errors,
    fault_gates, pytest_plugin, random_checkpoints and the task modules)."""
    layout = _layout_section()
    named = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", layout))
    modules = [
        path.relative_to(ROOT)
        for folder in PACKAGE_FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.name != "__init__.py"
    ]
    assert len(modules) > 60  # the walk found the package
    missing = [str(path) for path in modules if path.stem not in named]
    assert not missing, f"modules missing from docs/design.md §7 (Layout and plugins): {missing}"
    for sub in sorted(path.parent.name for path in (ROOT / "bubblespec").glob("*/__init__.py")):
        assert f"{sub}/" in layout, f"docs/design.md §7 does not name the subpackage {sub}/"


def test_the_package_top_holds_at_most_a_dozen_modules():
    """One role per folder: what is left at the top of bubblespec/ is the names users import and the pytest plugin."""
    top = sorted(path.name for path in (ROOT / "bubblespec").glob("*.py"))
    assert len(top) <= 12, f"{len(top)} modules at the top of bubblespec/ (at most 12): {top}"
