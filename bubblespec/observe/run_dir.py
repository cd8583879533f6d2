"""The run directory: resolved config, per-step JSONL, checkpoints and the summary.

Everything is written so that a crash leaves nothing ``--resume`` would trip over: checkpoints are written to
a temporary folder and renamed into place, and resuming discards JSONL lines of steps after the checkpoint.

    RUN_DIR/config.yaml                  the resolved config
    RUN_DIR/steps.jsonl                  one JSON object per step
    RUN_DIR/checkpoints/step-000004/     weights.safetensors, trainer.pt, drafts.json, state.json
                                         (+ history.json with the history draft source)
    RUN_DIR/wall.json                    the wall seconds of each part of the run (a resume starts a part)
    RUN_DIR/summary.json                 written at the end

Beside it, OUTPUT_DIR/prometheus-targets/RUN.json names the run's metrics endpoint while it runs
(bubblespec.observe.metrics).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import torch
import yaml

from bubblespec.core.config import RunConfig, validate
from bubblespec.core.errors import CheckpointError, ConfigError
from bubblespec.core.interfaces import Draft, DraftBranch, NearTie, RolloutKey
from bubblespec.observe.records import PromptSamples, StepRecord, read_step_lines

CHECKPOINT_FILES = ("weights.safetensors", "trainer.pt", "drafts.json", "state.json")
DRAFT_HEAD_FILE = "draft_head.pt"
"""A checkpoint's draft head (``speculation.draft_head``), where one has learned."""


class RunDirectory:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._made: list[Path] = []

    @property
    def steps_file(self) -> Path:
        return self.path / "steps.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def create(self, config: RunConfig) -> None:
        """Claims the directory for a new run by writing its config.yaml, in one step that a second run of the same
        name, started at the same moment, cannot also take."""
        missing = [folder for folder in (self.path, *self.path.parents) if not folder.exists()]
        self.path.mkdir(parents=True, exist_ok=True)
        self._made = missing[1:]  # the folders above it this call made: removed again with it
        try:
            if any(child.name != "config.yaml" for child in self.path.iterdir()):
                raise FileExistsError
            with (self.path / "config.yaml").open("x") as out:
                out.write(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
        except FileExistsError:
            raise ConfigError(
                f"run directory {str(self.path)!r} already exists; resume it with `bubblespec run --resume "
                f"{self.path}`, or give this run another name: --set name={config.name}-2 (or another output_dir)"
            ) from None

    def remove_if_unused(self) -> None:
        """Removes a directory that :meth:`create` claimed and no step was written to (the run failed or was stopped
        while starting), so that the same command can simply be run again."""
        if self.path.is_dir() and {child.name for child in self.path.iterdir()} <= {"config.yaml"}:
            shutil.rmtree(self.path)
            for folder in self._made:  # nearest first; only while empty
                with contextlib.suppress(OSError):
                    folder.rmdir()

    @property
    def wall_file(self) -> Path:
        return self.path / "wall.json"

    def read_wall_seconds(self) -> list[float]:
        """The wall seconds of each part of the run so far (one per start or resume; the time from its first step
        to its last step or its end, whatever of it a crash left unrecorded excepted)."""
        return json.loads(self.wall_file.read_text()) if self.wall_file.is_file() else []

    def write_wall_seconds(self, parts: list[float]) -> None:
        partial = self.path / ".wall.json.partial"
        partial.write_text(json.dumps(parts))
        partial.replace(self.wall_file)

    def save_config(self, config: RunConfig) -> None:
        """Replaces config.yaml in one rename (a resumed run with overrides of what does not change its results)."""
        partial = self.path / ".config.yaml.partial"
        partial.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
        partial.replace(self.path / "config.yaml")

    def load_config(self) -> RunConfig:
        file = self.path / "config.yaml"
        if not file.is_file():
            raise ConfigError(f"{str(self.path)!r} is not a run directory: it has no config.yaml")
        return validate(yaml.safe_load(file.read_text()) or {}, source=str(file))

    def append_step(self, record: StepRecord) -> None:
        with self.steps_file.open("a") as out:
            out.write(record.to_json() + "\n")

    @property
    def samples_file(self) -> Path:
        return self.path / "samples.jsonl"

    def append_samples(self, samples: list[PromptSamples]) -> None:
        if samples:
            with self.samples_file.open("a") as out:
                out.write("".join(s.model_dump_json() + "\n" for s in samples))

    def read_samples(self) -> list[PromptSamples]:
        """The logged samples; a last line a crash cut off is left out."""
        if not self.samples_file.exists():
            return []
        lines = self.samples_file.read_text().split("\n")
        return [PromptSamples.model_validate_json(line) for line in lines[:-1] if line.strip()]

    def read_steps(self) -> list[StepRecord]:
        """The step records. A last line without its newline is a write the process did not finish (it was
        killed): it is left out. Any other line that is not a step record is an error naming the file and line."""
        if not self.steps_file.exists():
            return []
        return read_step_lines(self.steps_file)[0]

    def truncate_steps(self, last_step: int) -> None:
        """Keeps the JSONL lines of steps <= last_step (resume from the checkpoint after last_step). The file is
        replaced in one rename, so a crash leaves the old or the new one, never half of either."""
        kept = [r for r in self.read_steps() if r.step <= last_step]
        partial = self.steps_file.with_name(".steps.jsonl.partial")
        partial.write_text("".join(r.to_json() + "\n" for r in kept))
        partial.replace(self.steps_file)
        samples = [s for s in self.read_samples() if s.step <= last_step]
        partial = self.samples_file.with_name(".samples.jsonl.partial")
        partial.write_text("".join(s.model_dump_json() + "\n" for s in samples))
        partial.replace(self.samples_file)

    def save_checkpoint(
        self,
        step: int,
        weights: dict,
        trainer_state: dict,
        drafts: list[Draft],
        state: dict,
        history: list[Draft] | None = None,
        draft_head: dict | None = None,
    ) -> Path:
        """Writes the checkpoint of ``step``: weights, trainer state, the drafts pending for later steps, the run
        state, with the history draft source the responses it remembers (as drafts of their own keys) and with a
        draft head its parameters and optimizer state (``draft_head.pt``)."""
        from safetensors.torch import save_file

        final = self.checkpoints / f"step-{step:06d}"
        partial = self.checkpoints / f".partial-step-{step:06d}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(partial / "weights.safetensors"))
        torch.save(trainer_state, partial / "trainer.pt")
        (partial / "drafts.json").write_text(json.dumps([_draft_to_json(d) for d in drafts]))
        (partial / "state.json").write_text(json.dumps(state | {"step": step}))
        if history is not None:
            (partial / "history.json").write_text(json.dumps([_draft_to_json(d) for d in history]))
        if draft_head is not None:
            torch.save(draft_head, partial / DRAFT_HEAD_FILE)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        return final

    def checkpointed_steps(self) -> list[StepRecord]:
        """The step records a resume keeps: those up to the latest checkpoint (none without one)."""
        checkpoint = self.latest_checkpoint()
        last = -1 if checkpoint is None else int(checkpoint.name.removeprefix("step-"))
        return [record for record in self.read_steps() if record.step <= last]

    def latest_checkpoint(self) -> Path | None:
        if not self.checkpoints.is_dir():
            return None
        done = sorted(p for p in self.checkpoints.iterdir() if p.name.startswith("step-"))
        return done[-1] if done else None

    def load_checkpoint(self, folder: Path) -> tuple[dict, dict, list[Draft], dict]:
        """Weights, trainer state, drafts and state of a checkpoint; a clear error names a bad file."""
        from safetensors.torch import load_file

        for name in CHECKPOINT_FILES:
            if not (folder / name).is_file():
                raise CheckpointError(f"checkpoint {folder} is missing {name}; it cannot be resumed from")
        try:
            weights = load_file(str(folder / "weights.safetensors"))
        except Exception as error:  # safetensors raises several types for corrupt files
            raise CheckpointError(f"cannot read {folder / 'weights.safetensors'}: {error}") from None
        try:
            trainer_state = torch.load(folder / "trainer.pt", weights_only=True)
        except Exception as error:
            raise CheckpointError(f"cannot read {folder / 'trainer.pt'}: {error}") from None
        try:
            drafts = [_draft_from_json(d) for d in json.loads((folder / "drafts.json").read_text())]
            state = json.loads((folder / "state.json").read_text())
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise CheckpointError(f"cannot read the drafts or state of checkpoint {folder}: {error}") from None
        return weights, trainer_state, drafts, state

    def load_history(self, folder: Path) -> list[Draft]:
        """The history draft source's responses saved with a checkpoint; none if it was not saved."""
        file = folder / "history.json"
        if not file.is_file():
            return []
        try:
            return [_draft_from_json(d) for d in json.loads(file.read_text())]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise CheckpointError(f"cannot read {file}: {error}") from None

    def load_draft_head(self, folder: Path) -> dict | None:
        """The draft head's state saved with a checkpoint; None if none was (no head, or none learned yet)."""
        file = folder / DRAFT_HEAD_FILE
        if not file.is_file():
            return None
        try:
            return torch.load(file, weights_only=True)
        except Exception as error:
            raise CheckpointError(f"cannot read {file}: {error}") from None

    def write_summary(self, summary: dict) -> None:
        (self.path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def _draft_to_json(draft: Draft) -> dict:
    key = draft.key
    return {
        "key": [key.run_seed, key.step, key.prompt_uid, key.sample_index],
        "tokens": list(draft.token_ids),
        "version": draft.policy_version,
        "finished": draft.finished,
        **_trie_to_json(draft),
    }


def _trie_to_json(node: Draft | DraftBranch) -> dict:
    """A draft's or branch's near-ties and branches (draft tries), omitted where it has none. Margins are written
    with ``repr``'s shortest round-trip digits, so a resumed run branches where the original would have."""
    found: dict = {}
    if node.near_ties:
        found["near_ties"] = [[t.index, t.token, t.margin] for t in node.near_ties]
    if node.branches:
        found["branches"] = [
            {"index": b.index, "tokens": list(b.token_ids), "finished": b.finished, **_trie_to_json(b)}
            for b in node.branches
        ]
    return found


def _trie_from_json(data: dict) -> dict:
    return {
        "near_ties": tuple(NearTie(int(i), int(t), float(m)) for i, t, m in data.get("near_ties", ())),
        "branches": tuple(
            DraftBranch(b["index"], tuple(b["tokens"]), b["finished"], **_trie_from_json(b))
            for b in data.get("branches", ())
        ),
    }


def _draft_from_json(data: dict) -> Draft:
    run_seed, step, uid, sample = data["key"]
    return Draft(
        RolloutKey(run_seed, step, uid, sample),
        tuple(data["tokens"]),
        data["version"],
        data.get("finished", False),
        **_trie_from_json(data),
    )
