"""Every package a test module imports is declared: it comes from the ``dev`` extra or from the README's test command,
not from what another extra (vLLM's dependencies) happens to bring along.

A test module that imported ``verl`` failed in an environment built without the ``vllm`` extra (``No module named
'cachetools'``: verl is installed without its dependencies, and only vLLM's brought it). This test computes the
distributions that ``pip install -e ".[dev]"`` plus the README's ``--no-deps`` installs would give (from the installed
packages' own metadata), and imports every test module in a fresh interpreter in which any other installed
distribution's modules cannot be imported. vLLM's own tests need the ``vllm`` extra and skip without it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "bubblespec"
TESTED_EXTRAS = ("dev",)
"""The extras the README's test command installs besides ``vllm`` (whose tests skip without it)."""
OPTIONAL_EXTRA = "vllm"


def _readme_no_deps_installs() -> list[str]:
    """The distributions the README's test command installs with ``pip install --no-deps`` (their own dependencies
    are not installed by it: the ``dev`` extra has to bring what their imports need)."""
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"pip install --no-deps ([^&\n]+)", readme)
    assert found, "the README's test command no longer installs anything with --no-deps: update this test"
    return [canonicalize_name(Requirement(word).name) for word in found.group(1).split()]


def _closure(roots: list[tuple[str, set[str]]]) -> set[str]:
    """Distributions reached from ``roots`` ((name, extras)) through the installed packages' requirements."""
    seen: dict[str, set[str]] = {}
    stack = list(roots)
    while stack:
        name, extras = stack.pop()
        name = canonicalize_name(name)
        if name in seen and extras <= seen[name]:
            continue
        seen[name] = seen.get(name, set()) | extras
        try:
            requirements = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed: its modules cannot be imported anyway
        for line in requirements:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": extra}) for extra in extras | {""}):
                stack.append((requirement.name, set(requirement.extras)))
    return set(seen)


def declared_distributions() -> set[str]:
    extras = set(TESTED_EXTRAS)
    declared = _closure([(PROJECT, extras)])
    no_deps = _readme_no_deps_installs()
    assert canonicalize_name(OPTIONAL_EXTRA) not in declared
    return declared | set(no_deps)


IMPORT_EVERY_TEST_MODULE = r"""
import importlib, importlib.machinery, importlib.metadata, json, os, sys, traceback
allowed, modules = set(json.loads(sys.argv[1])), json.loads(sys.argv[2])
owners = importlib.metadata.packages_distributions()

def canonical(name):
    return name.lower().replace("_", "-").replace(".", "-")

def undeclared_sites(top):
    # Where only undeclared distributions install the top-level module ``top`` (none where a declared one does).
    dists = {canonical(d) for d in owners.get(top, ())}
    if not dists or dists & allowed:
        return set()
    return {os.path.normpath(str(importlib.metadata.distribution(d).locate_file(""))) for d in owners[top]}

class DeclaredOnly(importlib.machinery.PathFinder):
    # The path finder, blind to the modules of undeclared distributions where they installed them: they are as good
    # as not installed (importlib.util.find_spec, which libraries use to look for optional packages, says None too).
    # A copy that a declared package vendors on a path of its own (Ray's colorama) is found there.
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        sites = undeclared_sites(fullname) if "." not in fullname else set()
        if sites:
            path = [p for p in (path or sys.path) if os.path.normpath(os.path.abspath(p or ".")) not in sites]
        return super().find_spec(fullname, path, target)

sys.meta_path[:] = [DeclaredOnly if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
failures = {}
for module in modules:
    try:
        importlib.import_module(module)
    except BaseException as error:  # pytest.importorskip raises Skipped, a BaseException
        if type(error).__name__ == "Skipped" and "vllm" in str(error).lower():
            continue  # the vllm extra's own tests, told to skip (BUBBLESPEC_SKIP_VLLM=1)
        failures[module] = "".join(traceback.format_exception(error)[-6:]).strip()
print(json.dumps(failures))
"""


def test_every_test_module_imports_with_only_the_declared_packages():
    allowed = sorted(canonicalize_name(name) for name in declared_distributions() | {PROJECT})
    modules = [f"tests.{path.stem}" for path in sorted((ROOT / "tests").glob("*.py")) if path.stem != "__init__"]
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERY_TEST_MODULE, json.dumps(allowed), json.dumps(modules)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=os.environ | {"BUBBLESPEC_SKIP_VLLM": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    failures = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failures, (
        "test modules import packages that neither the dev extra nor the README's test command installs (declare "
        f"them in pyproject.toml): {json.dumps(failures, indent=1)}"
    )
