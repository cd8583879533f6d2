"""What a run records: one :class:`StepRecord` per RL step (a line of RUN_DIR/steps.jsonl), a few prompts of each
step with their responses, rewards and advantages (:class:`PromptSamples`, lines of RUN_DIR/samples.jsonl), and one
:class:`GenerationRecord` per generation batch of a trainer of another framework (``bubblespec.integrations``).

Records are read by attribute; the JSON on disk is written and read here only (:meth:`StepRecord.to_json`,
:func:`read_step_lines`), so a field is named once. Reading validates every line: a record that is not one is an
error naming its file and line, never a ``KeyError`` somewhere later.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from bubblespec.core.errors import CheckpointError
from bubblespec.rollout.step import HeadLearningRecord, RankRecord

Timeline = list[tuple[str, float, float]]
"""One rank's (activity, start, end): activity in generate, draft, idle; seconds from the phase's start."""


REWIND = "rewind"
"""The phase the RL loop reports (``on_phase``) when the trainer restarted and the run rewinds to its last
checkpoint."""


class PhaseSeconds(BaseModel):
    """A step's phases, one after another: rollout, train, weight sync."""

    model_config = ConfigDict(frozen=True)

    rollout: float
    train: float
    weight_sync: float

    @property
    def total(self) -> float:
        return self.rollout + self.train + self.weight_sync


class StepRecord(BaseModel):
    """One RL step: rewards, tokens, speculation and bubbles summed over ranks, the phases' lengths, the learner's
    metrics and every rank's own record. docs/design.md §8 names what each number means."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    step: int
    reward_mean: float
    num_samples: int
    generated_tokens: int
    decode_steps: int
    verify_steps: int
    forward_passes_max_rank: int
    draft_tokens_proposed: int
    draft_tokens_accepted: int
    draft_coverage: float
    """Share of requests that had a stored draft."""
    proposal_coverage: float
    """Share of requests that verified at least one proposed token (a stored draft or a dynamic source's)."""
    bubble_seconds: float
    bubble_utilization: float
    drafts_made: int
    rollout_tokens_per_second: float
    phase_seconds: PhaseSeconds
    barrier_seconds: float
    train: dict[str, int | float]
    """The learner's metrics (loss, grad_norm, ...; kl with a reference model, logprob_diff_* with engine
    logprobs; skipped=1 for a step without reward signal)."""
    rewards_checksum: float
    ranks: list[RankRecord]
    timelines: list[Timeline]
    """Per rank, its rollout phase."""
    training_timelines: list[Timeline] | None = None
    """Per rank, its drafting while the trainer ran (speculation.draft_during_training only)."""
    reward_timeouts: int = 0
    reward_errors: int = 0
    reward_calls: int = 0
    """Reward calls of the step's scoring; ``reward_timeouts`` and ``reward_errors`` of them failed (scored 0)."""
    reward_means: dict[str, float] = {}
    """Each named reward's mean score (unweighted) where the task's reward is a sum of named ones."""
    rollout_seconds_saved: float | None = None
    """Rollout seconds the drafts saved (negative: cost): the rollout replayed without drafts, estimated from this
    run's own forward passes (docs/design.md §8), minus the rollout phase; None where not estimated."""
    barrier_wait_seconds: float = 0.0
    """Seconds the step waited for drafting passes in flight: from the barrier until its rollout phase ended, and
    before its weight sync for passes still running then (part of ``rollout_seconds_saved`` when that is a cost).
    A rank's pass past the barrier runs while the trainer trains: its ``preemption_latency_seconds`` counts here
    only where the step waited for it."""
    rollout_digest: str = ""
    """A fingerprint of the step's rollouts: equal digests, equal rollouts."""
    draft_store: dict[str, int] | None = None
    """The draft store's stats after the step: drafts, tokens, evicted (so far)."""
    drafts_evicted: int = 0
    """Drafts the store's cap evicted during this step."""
    eval_reward: float | None = None
    """Mean reward on the held-out prompts after this step's update (steps eval_every names)."""
    eval_reward_before_training: float | None = None
    """The same for the initial policy (step 0 only)."""
    eval_reward_means: dict[str, float] = {}
    """With ``eval_reward``, each named reward's mean on the held-out prompts (a task whose reward is a sum of named
    ones): the answer accuracy apart from a format reward."""
    eval_reward_means_before_training: dict[str, float] = {}
    """The same for the initial policy (step 0 only)."""
    finished_at_seconds: float | None = None
    """When the step's new policy was on the ranks, in seconds of the run's clock from the start of the run: the sum
    of the steps' phases, except where generation overlaps training (``schedule.kind: async``, docs/design.md §12)."""
    policy_lag: int = 0
    """Policy updates between the policy that generated the step's fresh samples and the one trained on them."""
    trained_tokens: int | None = None
    """Response tokens of the samples the step trained on."""
    stale_tokens: int = 0
    """Of ``trained_tokens``, those a policy older than the trained one generated: 0 under every exact schedule."""
    drafting_paused: bool = False
    """``speculation.enabled: auto`` kept the idle ranks from drafting in this step's bubble (and while the trainer
    trained): the drafts of earlier steps had not paid (:mod:`bubblespec.rollout.speculation_gate`)."""
    carried_groups: int = 0
    """Prompts (groups of samples) cut short in this step and carried to a later one (``schedule.cut_*``)."""
    draft_head: HeadLearningRecord | None = None
    """The draft head's learning on this step's responses (``speculation.draft_head``); None without a head."""

    @property
    def rollout_seconds_without_drafts(self) -> float | None:
        if self.rollout_seconds_saved is None:
            return None
        return self.phase_seconds.rollout + self.rollout_seconds_saved

    @property
    def trained(self) -> bool:
        """Whether the learner updated the policy (not a step whose loss had no gradient)."""
        return not self.train.get("skipped")

    def to_json(self) -> str:
        """One line of steps.jsonl. Fields without a value (an evaluation that did not run) are left out."""
        return json.dumps(self.model_dump(exclude_none=True))

    @classmethod
    def from_json(cls, line: str) -> StepRecord:
        """Raises ``ValueError`` (a ``json.JSONDecodeError`` or pydantic's ``ValidationError``) for a line that is
        not a step record."""
        return cls.model_validate(json.loads(line))


class SampledResponse(BaseModel):
    """One response of :class:`PromptSamples`: what the model wrote and what the reward and the learner made of it."""

    model_config = ConfigDict(frozen=True)

    sample: int
    text: str
    tokens: int
    finish_reason: str
    reward: float
    rewards: dict[str, float] = {}
    """Each named reward's own score, where the task's reward is a sum of named ones."""
    advantage: float


class PromptSamples(BaseModel):
    """A line of RUN_DIR/samples.jsonl: one prompt of a step, as the model saw it, with all its responses."""

    model_config = ConfigDict(frozen=True)

    step: int
    prompt_uid: str
    prompt: str
    """The prompt's text as the model read it (chat template and system prompt applied)."""
    answer: str
    """The reference answer as the rewards got it."""
    responses: list[SampledResponse]


class GenerationRecord(BaseModel):
    """One generation batch of a trainer of another framework (TRL's ``rollout_func``): what the ranks did."""

    model_config = ConfigDict(frozen=True)

    generation: int
    global_step: int
    generated_tokens: int
    decode_steps: int
    draft_tokens_accepted: int
    draft_coverage: float
    rollout_seconds: float
    bubble_seconds: float
    completions_digest: str
    ranks: list[RankRecord]
    peek_matched: bool | None = None
    """Whether the prompts peeked for drafting were the ones the trainer then sent (None: nothing peeked)."""

    @property
    def decode_steps_saved(self) -> float:
        """The share of generated tokens that took no decode step of their own (accepted draft tokens)."""
        return 1 - self.decode_steps / self.generated_tokens if self.generated_tokens else 0.0


def read_step_lines(path: Path) -> tuple[list[StepRecord], int | None]:
    """The records of a steps.jsonl file and the number of a last line cut off by a crash in the middle of writing
    it (None when there is none); that line is left out. Any other line that is not a step record raises
    :class:`~bubblespec.core.errors.CheckpointError` naming the file, the line and what is wrong."""
    text = path.read_text()
    lines = [(number, line) for number, line in enumerate(text.split("\n"), 1) if line.strip()]
    torn = None if text.endswith("\n") or not lines else lines[-1][0]
    records = []
    for number, line in lines:
        try:
            records.append(StepRecord.from_json(line))
        except json.JSONDecodeError as error:
            if number == torn:  # no newline after it: the process was killed while it wrote the line
                return records, torn
            raise CheckpointError(f"{path} line {number} is not JSON ({error}); it is not a step record") from None
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()[:5])
            raise CheckpointError(f"{path} line {number} is not a step record: {problems}") from None
    return records, None
