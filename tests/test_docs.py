"""The docs against the code they describe: docs/design.md's layout, and the config keys every doc names."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from pydantic import BaseModel

from bubblespec.core.config import RunConfig

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


def _models_in(annotation) -> list:
    """The pydantic models (and ``dict`` for free-form fields) that a field's annotation admits: unions, Optional
    and Annotated (the trainer model's tagged union) unpacked."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if annotation is dict or typing.get_origin(annotation) is dict:
        return [dict]
    return [model for argument in typing.get_args(annotation) for model in _models_in(argument)]


CONFIG_KEY_FILES = ("README.md", "docs/*.md", "BENCHMARKS.md")
"""Where users read config keys (and pyproject.toml's comments: the extras say which keys need them)."""
SECTIONS = [name for name, info in RunConfig.model_fields.items() if _models_in(info.annotation)]
DOTTED_KEY = re.compile(
    rf"(?<![\w./-])(?P<key>(?:{'|'.join(SECTIONS)})(?:\.[a-z][a-z0-9_]*)+)(?![\w(-])(?P<value>\s*[:=]\s*\w)?"
)
NOT_CONFIG_KEYS = {
    "trainer.learning_rate": "docs/running.md's example of a flat key of earlier versions, refused with its new place",
    "trainer.use_v1": "verl's config",
    "trainer.n_gpus_per_node": "verl's config",
    "rollout.n": "verl's config",
    "rollout.name": "verl's config",
    "rollout.prompt_length": "verl's config",
    "rollout.calculate_log_probs": "verl's config",
    "rollout.temperature": "verl's config",
    "model.lora.merge": "verl's config",
    "trainer.state.global_step": "TRL's GRPOTrainer",
    "trainer.model.training": "TRL's GRPOTrainer",
    "rollout.steps": "the TRL integration's rollout function",
    "rollout.evaluations": "the TRL integration's rollout function",
    "rollout.step_requests": "a function of bubblespec.rollout",
    "rollout.bubble_use": "a function of bubblespec.rollout",
    "rollout.drafts_from": "a function of bubblespec.rollout",
    "ray.put": "Ray's API",
    "ray.util.metrics": "Ray's API",
    "ray.cluster_utils": "Ray's API",
    "model.embed_tokens.weight": "a weight's Hugging Face name",
}
"""Dotted names in the docs that start like a config key and are something else."""


def _config_key_kind(key: str) -> str | None:
    """What ``key`` names in RunConfig: "section", "setting", "free" (inside a free-form dict such as
    task.options), or None when no field has that path."""
    models = [RunConfig]
    for part in key.split("."):
        if not models:  # a setting has no fields
            return None
        if dict in models:
            return "free"
        fields = [model.model_fields[part] for model in models if part in model.model_fields]
        if not fields:
            return None
        models = [model for info in fields for model in _models_in(info.annotation)]
    return "free" if dict in models else "section" if models else "setting"


def _written_config_keys() -> list[tuple[str, str, bool]]:
    """(where, key, whether a value follows it) for each dotted config key in backticks in the docs' prose, in
    comments of their code blocks, and in pyproject.toml's comments."""
    texts = {}
    for pattern in CONFIG_KEY_FILES:
        for path in sorted(ROOT.glob(pattern)):
            text = path.read_text()
            code = re.findall(r"^```\w*\n(.*?)^```", text, re.S | re.M)
            prose = re.sub(r"^```\w*\n.*?^```", "", text, flags=re.S | re.M)
            texts[path.name] = re.findall(r"`([^`\n]+)`", prose) + re.findall(r"#(.*)", "\n".join(code))
    texts["pyproject.toml"] = re.findall(r"#(.*)", (ROOT / "pyproject.toml").read_text())
    return [
        (name, match["key"], bool(match["value"]))
        for name, spans in texts.items()
        for span in spans
        for match in DOTTED_KEY.finditer(span)
        if not any(match["key"] == other or match["key"].startswith(f"{other}.") for other in NOT_CONFIG_KEYS)
    ]


def test_every_config_key_the_docs_name_is_a_field_of_the_run_config():
    """`trainer.model: transformers` and `trainer.lora` stayed in BENCHMARKS.md and pyproject.toml after the trainer's
    model became a section, and `bubblespec validate` refused both: a key named in the docs must be a field's path,
    and one given a value a setting, not a section."""
    assert {"trainer", "speculation", "rollout", "task"} <= set(SECTIONS)
    written = _written_config_keys()
    assert len(written) > 100  # the scan found the docs' keys
    wrong = sorted(
        f"{where}: {key}" + (" (a section, given a value)" if kind == "section" else "")
        for where, key, valued in written
        if (kind := _config_key_kind(key)) is None or (valued and kind == "section")
    )
    assert not wrong, (
        f"config keys that are not RunConfig fields (bubblespec/core/config.py): {wrong}; a name of another tool "
        "that starts like one goes in NOT_CONFIG_KEYS, saying whose it is"
    )
    assert _config_key_kind("trainer.lora") is None and _config_key_kind("trainer.model") == "section"
    assert _config_key_kind("trainer.model.lora.rank") == "setting"
    assert _config_key_kind("rollout.engine_options.batch_invariant") == "free"


FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(x|%)(?![\w])")
STATED_WHERE_MEASURED = {
    # figures a doc states beside the command that measured them, not repeated from BENCHMARKS.md
    ("docs/integrations.md", "44%"),  # examples/trl_grpo.py --clock wall, the command in the same paragraph
    ("docs/running.md", "98%"),  # the share of stale tokens async trained on, a property of the schedule
}


def _figures(text: str) -> set[tuple[float, int, str, str]]:
    """Speed-ups (``2.05x``) and percentages (``92%``) outside code blocks: (value, decimals, unit, as written)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {
        (float(number), len(number.partition(".")[2]), unit, number + unit) for number, unit in FIGURE.findall(text)
    }


def test_every_figure_the_readme_and_docs_repeat_is_one_benchmarks_md_has():
    """A speed-up or percentage in the README or docs/ is one BENCHMARKS.md states (to the precision written: 92%
    is BENCHMARKS.md's 92.5%), so a figure re-measured there cannot stay behind elsewhere. It checks the numbers,
    not what they are of: the sentence around each one names its workload and clock."""
    measured = _figures((ROOT / "BENCHMARKS.md").read_text())
    stale = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        name = str(path.relative_to(ROOT))
        for value, decimals, unit, written in sorted(_figures(path.read_text())):
            if (name, written) in STATED_WHERE_MEASURED:
                continue
            if not any(u == unit and abs(v - value) <= 0.5 * 10**-decimals + 1e-9 for v, _, u, _ in measured):
                stale.append(f"{name}: {written}")
    assert not stale, f"figures BENCHMARKS.md does not state: {stale}"


HEADLINE_SECTIONS = {
    # a workload the README's headline names -> the BENCHMARKS.md section that measured it
    "smollm2-gsm8k": "## A real model",
    "bench-long": "## Long responses",
    "bench-virtual": "## A whole run, speculation off vs on",
    "the main job": "## The README's main job",
    "bench-wall": "### The wall clock on this machine",
    "arithmetic": "### The arithmetic example",
}


def _section(text: str, heading: str) -> str:
    """The section of ``text`` under ``heading`` (its subsections included)."""
    start = text.index("\n" + heading) + 1
    level = len(heading) - len(heading.lstrip("#"))
    end = re.compile(rf"\n#{{1,{level}}} ").search(text, start + 1)
    return text[start : end.start() if end else len(text)]


def test_the_readme_headline_states_each_workloads_figures_as_its_benchmarks_md_section_does():
    """Each figure of the README's "What it gives today" belongs to the workload named last before it, and the
    BENCHMARKS.md section that measured that workload states it (to the precision written)."""
    readme = (ROOT / "README.md").read_text()
    headline = readme[readme.index("**What it gives today**") : readme.index("Rollouts and weights are identical")]
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    workload = re.compile(r"`examples/([\w-]+)\.yaml`|(the main job)")
    marks = [(m.start(), "workload", m.group(1) or m.group(2)) for m in workload.finditer(headline)]
    marks += [(m.start(), "figure", m.group(0)) for m in FIGURE.finditer(headline)]
    current, checked, missing = None, 0, []
    for _, kind, text in sorted(marks):
        if kind == "workload":
            current = text
            continue
        assert current in HEADLINE_SECTIONS, f"{text} follows {current!r}, which HEADLINE_SECTIONS does not map"
        ((value, decimals, unit, _),) = _figures(text)
        section = _figures(_section(benchmarks, HEADLINE_SECTIONS[current]))
        checked += 1
        if not any(u == unit and abs(v - value) <= 0.5 * 10**-decimals + 1e-9 for v, _, u, _ in section):
            missing.append(f"{current}: {text}")
    assert checked >= 15 and not missing, f"not in their workload's BENCHMARKS.md section: {missing}"
