"""The layer order of docs/design.md §7: `lint-imports` checks it (the contract in pyproject.toml, run by .ci/run),
and what import-linter cannot see (backends/, policies/ and cli/ ship from folders outside bubblespec/) is checked
here from the modules' own import statements."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CORE_LAYERS = ("core", "models", "tasks", "verify", "rollout", "observe", "rl", "run")
BACKEND_MAY_IMPORT = ("bubblespec.core", "bubblespec.models", "bubblespec.verify", "bubblespec.backends")


def _lint_imports(package_parent: Path) -> subprocess.CompletedProcess:
    """lint-imports with this repository's contract, on the bubblespec package found in ``package_parent``."""
    environment = os.environ | {"PYTHONPATH": str(package_parent)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=package_parent,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_layer_contract_holds_and_fails_on_a_planted_forbidden_import(tmp_path):
    kept = _lint_imports(ROOT)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert "0 broken" in kept.stdout or "broken" not in kept.stdout.lower(), kept.stdout

    # The same package with one forbidden import, in a function as a lazy import would be: the bottom layer
    # reaching up into the RL loop.
    shutil.copytree(ROOT / "bubblespec", tmp_path / "bubblespec", ignore=shutil.ignore_patterns("__pycache__"))
    errors = tmp_path / "bubblespec" / "core" / "errors.py"
    errors.write_text(errors.read_text() + "\n\ndef _planted():\n    from bubblespec.rl import loop  # noqa: F401\n")
    broken = _lint_imports(tmp_path)
    assert broken.returncode != 0, broken.stdout
    assert "bubblespec.core is not allowed to import bubblespec.rl" in broken.stdout, broken.stdout
    assert "bubblespec.core.errors -> bubblespec.rl.loop" in broken.stdout, broken.stdout


def _bubblespec_imports(path: Path) -> list[str]:
    """Every bubblespec module a file imports, at its top or inside a function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "bubblespec":
                found += [f"bubblespec.{alias.name}" for alias in node.names]
            elif node.module.startswith("bubblespec."):
                found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("bubblespec.")]
    return found


def _imports_under(folder: Path) -> dict[str, list[str]]:
    return {str(path.relative_to(ROOT)): _bubblespec_imports(path) for path in sorted(folder.rglob("*.py"))}


def test_no_core_layer_imports_a_backend_a_policy_or_the_cli():
    outside = ("bubblespec.backends", "bubblespec.policies", "bubblespec.cli")
    found = {
        path: [name for name in names if name.startswith(outside)]
        for layer in CORE_LAYERS
        for path, names in _imports_under(ROOT / "bubblespec" / layer).items()
    }
    assert len(found) > 40  # the walk found the layers
    wrong = {path: names for path, names in found.items() if names}
    assert not wrong, f"core layers import backends/, policies/ or cli/: {wrong}"


def test_backends_and_policies_import_only_the_layers_below_the_rollout():
    """An engine samples and verifies with core/, models/ and verify/; it never reaches the rollout, the loop or a
    run. Policies see only core/ (the interfaces)."""
    wrong = {}
    for folder, allowed in (("backends", BACKEND_MAY_IMPORT), ("policies", ("bubblespec.core",))):
        for path, names in _imports_under(ROOT / folder).items():
            bad = [name for name in names if not name.startswith(allowed)]
            if bad:
                wrong[path] = bad
    assert not wrong, f"imports above their layer: {wrong}"


def test_the_check_sees_a_lazy_import_of_a_backend(tmp_path):
    """The AST walk above finds imports inside functions (the way a backend would be imported lazily)."""
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from bubblespec.backends import torch_engine\n    import bubblespec.cli.main\n")
    assert _bubblespec_imports(planted) == ["bubblespec.backends", "bubblespec.cli.main"]
