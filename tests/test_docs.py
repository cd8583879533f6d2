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
