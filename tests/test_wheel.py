"""The distribution as pip installs it: a wheel built from this checkout holds every module of the package (the
layers' subpackages, and backends/, policies/ and cli/ under bubblespec), each imports from the wheel alone, and the
names users and plugins imported before the layers keep working."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "bubblespec", "backends", "policies", "cli")
PUBLIC_NAMES = {
    "bubblespec.config": "bubblespec.core.config",
    "bubblespec.errors": "bubblespec.core.errors",
    "bubblespec.interfaces": "bubblespec.core.interfaces",
    "bubblespec.assembly": "bubblespec.run.assembly",
    "bubblespec.random_checkpoints": "bubblespec.testing.random_checkpoints",
}

IMPORT_ALL = """
import importlib, json, sys
names, site = json.loads(sys.argv[1]), sys.argv[2]
outside = {}
for name in names:
    module = importlib.import_module(name)
    if not module.__file__.startswith(site):
        outside[name] = module.__file__
import bubblespec
from bubblespec.testing import EngineConformance
from bubblespec.assembly import start_service
pairs = json.loads(sys.argv[3]).items()
same = {old: importlib.import_module(old) is importlib.import_module(new) for old, new in pairs}
print(json.dumps({"outside": outside, "same": same, "service": bubblespec.RolloutService.__module__}))
"""


@pytest.mark.slow
def test_the_wheel_holds_every_module_and_each_imports_from_it(tmp_path):
    source = tmp_path / "source"  # a copy: the build writes build/ and egg-info beside its sources
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    built = subprocess.run([*pip_wheel, str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = tmp_path.glob("bubblespec-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
        files = [name for name in archive.namelist() if name.endswith(".py")]

    in_tree = {
        str(Path("bubblespec", *path.relative_to(ROOT / folder).parts) if folder == "bubblespec"
            else Path("bubblespec", folder, *path.relative_to(ROOT / folder).parts))
        for folder in ("bubblespec", "backends", "policies", "cli")
        for path in (ROOT / folder).rglob("*.py")
    }  # fmt: skip
    assert set(files) == in_tree, f"in the tree, not the wheel: {sorted(in_tree - set(files))}"
    names = sorted(name.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for name in files)
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    imported = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, json.dumps(names), str(site), json.dumps(PUBLIC_NAMES)],
        capture_output=True, text=True, timeout=600, env=environment, cwd=tmp_path,
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr[-3000:]
    report = json.loads(imported.stdout.strip().splitlines()[-1])
    assert report["outside"] == {}, f"imported from outside the wheel: {report['outside']}"
    assert report["same"] == dict.fromkeys(PUBLIC_NAMES, True)
    assert report["service"] == "bubblespec.rollout.service"
