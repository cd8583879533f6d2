"""Every snippet in the README and docs/ works as written, each checked as far as a test can:

- ``python`` runs, in a fresh folder beside the repository's ``examples/`` (a subprocess each);
- ``bash``: ``bubblespec validate``, ``plugins``, ``report``, ``model``, ``--help`` and ``python -c`` run as written
  (``model get`` converts into the session's cache, ``BUBBLESPEC_CACHE``: see conftest.py);
  ``bubblespec run`` and ``bench`` (minutes to hours) are checked by validating their config with their ``--set``
  overrides, ``run --resume`` by checking its overrides are ones a resume allows; installs (pip, apt-get) and the test
  command are what ``.ci/run`` runs on a fresh clone, so here they are only parsed (``bash -n``);
- ``yaml``: parsed, and validated as a run config where its top-level keys are a run config's;
- ``toml``: parsed.

A snippet that needs a GPU, SGLang or several machines is marked ``<!-- snippet: parse-only: REASON -->`` on the line
before its fence and only parsed. A shell command of another kind fails the test until it is handled here."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from bubblespec.core.config import RunConfig, apply_overrides, check_resumable, validate
from bubblespec.observe.run_dir import RunDirectory

ROOT = Path(__file__).parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"(?:^<!-- snippet: (?P<mark>.*?) -->\n)?^```(?P<lang>\w*)\n(?P<body>.*?)^```", re.S | re.M)
RUN_DIR = "runs/quickstart"
"""The run directory the README's and docs' resume and report commands name: made for them on the virtual clock."""


def _snippets() -> list:
    found = []
    for file in FILES:
        text = file.read_text()
        for match in FENCE.finditer(text):
            line = text[: match.start("lang")].count("\n")
            found.append(pytest.param(match["lang"], match["body"], match["mark"], id=f"{file.name}:{line}"))
    return found


SNIPPETS = _snippets()


def test_the_snippets_are_found():
    languages = {param.values[0] for param in SNIPPETS}
    assert {"python", "bash", "yaml", "toml"} <= languages and len(SNIPPETS) > 25


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder like a clone's root: examples/ (a copy: snippets write beside it), the package's shipped models
    where examples point, the random chat model docs/tasks.md makes at checkpoints/tiny-chat, and a finished 1-step
    virtual-clock run at RUN_DIR."""
    from bubblespec.testing.random_checkpoints import write_chat_model

    folder = tmp_path_factory.mktemp("snippets")
    shutil.copytree(ROOT / "examples", folder / "examples")
    (folder / "bubblespec").symlink_to(ROOT / "bubblespec")
    write_chat_model(folder / "checkpoints" / "tiny-chat")
    overrides = ["clock.kind=virtual", "num_steps=1", "eval_every=0", "metrics.enabled=false"]
    _run(folder, ["bubblespec", "run", "--quiet", "examples/quickstart.yaml", *(f"--set={o}" for o in overrides)])
    return folder


def _run(folder: Path, command: list[str], timeout: float = 600) -> None:
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{shlex.join(command)}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def _commands(body: str) -> list[list[str]]:
    """The block's shell commands as words: continuation lines joined, comments dropped, ``&&`` chains split."""
    commands = []
    for line in re.sub(r"\\\n\s*", " ", body).splitlines():
        words = shlex.split(line, comments=True)
        while words:
            end = words.index("&&") if "&&" in words else len(words)
            commands.append(words[:end])
            words = words[end + 1 :]
    return commands


def _overrides(words: list[str]) -> list[str]:
    return [words[i + 1] for i, word in enumerate(words) if word == "--set"]


def _check_command(words: list[str], folder: Path) -> None:
    command = shlex.join(words)
    if words[0] in ("pip", "apt-get", "lint-imports") or words[:3] == ["python", "-m", "pytest"]:
        _run(folder, ["bash", "-n", "-c", command])  # installs and the test command: .ci/run runs them
    elif words[:2] == ["python", "-c"]:
        _run(folder, [sys.executable, *words[1:]])
    elif words[0] != "bubblespec":
        raise AssertionError(f"a command this test does not know how to check: {command!r}")
    elif words[1] in ("validate", "plugins", "report", "model") or "--help" in words:
        _run(folder, words, timeout=300)
    elif words[1:3] == ["bench", "engine"]:  # no config; a model PATH to fill in: the parser checks the options
        _run(folder, [*words, "--help"])
    elif words[1] == "run" and "--resume" in words:
        saved = RunDirectory(folder / words[words.index("--resume") + 1]).load_config()
        check_resumable(saved, validate(apply_overrides(saved.model_dump(mode="json"), _overrides(words))))
    elif words[1] in ("run", "bench"):
        (config,) = [word for word in words[2:] if word.endswith(".yaml")]
        _run(folder, ["bubblespec", "validate", config, *(f"--set={o}" for o in _overrides(words))], timeout=300)
    else:
        raise AssertionError(f"a bubblespec command this test does not know how to check: {command!r}")


@pytest.mark.slow
@pytest.mark.parametrize(("lang", "body", "mark"), SNIPPETS)
def test_every_snippet_works_as_written(lang, body, mark, workdir):
    if mark is not None:
        assert mark.startswith("parse-only: ") and len(mark) > len("parse-only: ") + 10, f"say why: {mark!r}"
    if lang == "python":
        compile(body, "snippet", "exec")
        if mark is None:
            _run(workdir, [sys.executable, "-c", body])
    elif lang == "bash":
        _run(workdir, ["bash", "-n", "-c", body])
        if mark is None:
            for words in _commands(body):
                _check_command(words, workdir)
    elif lang == "yaml":
        data = yaml.safe_load(body)
        if mark is None and isinstance(data, dict) and set(data) <= set(RunConfig.model_fields):
            validate(data, source="snippet")
    elif lang == "toml":
        tomllib.loads(body)
