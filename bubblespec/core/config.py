"""The run configuration: one pydantic model loaded from YAML, each component taking its own section.

Every field has a type with its constraints and a docstring; unknown keys are errors. Plugin names (backend,
draft store, policies, task) are checked against what is installed. ``bubblespec validate config.yaml`` prints
the resolved config or every error with its field path.
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from bubblespec.core.draft_sources import REQUEST_DRAFT
from bubblespec.core.errors import ConfigError, did_you_mean


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def _installed(kind: str, name: str, role: str | None = None) -> str:
    """Validator helper: ``name`` must be an installed plugin of ``kind`` (and of ``role``, for policies)."""
    from bubblespec.core import plugins

    found = plugins.available(kind)
    if role is not None:
        from bubblespec.core.interfaces import Policy

        found = {n: ep for n, ep in found.items() if plugins.load_subclass(kind, n, Policy).role == role}
    if name not in found:
        label = f"{role} policy" if role else kind.rstrip("s").replace("_", " ")
        raise ValueError(f"unknown {label} {name!r}; available: {', '.join(found) or 'none installed'}")
    return name


class TaskConfig(Section):
    name: str = "arithmetic"
    """Task plugin (entry point group ``bubblespec.tasks``): the prompt source and reward function."""
    prompts_per_step: int = Field(16, ge=1)
    """Distinct prompts in each step's rollout batch."""
    samples_per_prompt: int = Field(4, ge=1)
    """Responses per prompt (the GRPO group size)."""
    seed: int = 0
    """Seed of the task's prompt stream; batch(step) is a pure function of it."""
    options: dict[str, Any] = {}
    """Task-specific keyword arguments for the task's constructor (also for the held-out eval task), e.g. for
    arithmetic ``{reward: digits, max_digits: 8}``; empty keeps the task's defaults."""

    @field_validator("name")
    @classmethod
    def _task_installed(cls, name: str) -> str:
        return _installed("tasks", name)


class ModelConfig(Section):
    path: str | None = None
    """A local Hugging Face model folder; empty means the model the task ships with."""
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    """Weights and activations of rollout engines and trainer (float64: bit-identical speculation)."""


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature; 0 is greedy."""
    top_k: int = Field(0, ge=0)
    """Keep the k most likely tokens; 0 keeps all."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Keep the smallest set of tokens with this much probability; 1 keeps all."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Longest response; empty means the task's recommendation."""
    suppressed_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    """Token ids never sampled (a pad token that ends nothing); the trainer scores without them too. Empty means
    the task's (the shipped tasks: ``<pad>``, ``<bos>``, ``<unk>``; a dataset task: the tokenizer's pad token where
    it is not a stop token); ``[]`` suppresses nothing."""


class RolloutConfig(Section):
    backend: str = "torch"
    """Engine backend plugin (entry point group ``bubblespec.backends``)."""
    num_ranks: int = Field(2, ge=1)
    """Data-parallel rollout ranks (one engine each)."""
    threads_per_rank: int = Field(1, ge=1)
    """torch threads per rank; more than cores / ranks oversubscribes the CPU and is much slower. On Ray each rank
    reserves this many CPUs."""
    gpus_per_rank: float = Field(0.0, ge=0)
    """GPUs each rank reserves on Ray (``num_gpus`` of its replica; a fraction shares a GPU, e.g. 0.5 with a
    trainer worker of 0.5 when ``ray.colocated``); 0 on CPU engines."""
    max_batch_size: int = Field(64, ge=1)
    """Sequences one engine decodes together."""
    max_draft_tokens_per_step: int = Field(16, ge=0)
    """Draft tokens one sequence verifies per forward pass (0: none)."""
    adaptive_draft_length: bool = False
    """Shrink a sequence's draft proposals after a rejection and grow them after full acceptance; worth it when
    a forward pass costs in proportion to its tokens (CPU engines), not on memory-bound GPUs."""
    verification: Literal["coupled", "one_hot"] = "coupled"
    """coupled: drafts share the keyed noise of the policy that verifies them. one_hot: each policy version samples
    with its own independent noise stream of the key, so drafts agree only as often as independent samples (as
    with engines that cannot take keyed noise). Outputs are identical with and without drafts either way."""
    engine_options: dict[str, Any] = {}
    """Settings only the chosen backend knows, passed to its ``from_pretrained`` with the common ones (e.g. the
    server URLs of the sglang backend); the backend refuses what it does not know."""
    sampling: SamplingConfig = SamplingConfig()

    @field_validator("backend")
    @classmethod
    def _backend_installed(cls, name: str) -> str:
        return _installed("backends", name)


SPECULATION_PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {
        "bubble_policy": "longest-first",
        "sharding_policy": "length-balanced",
        "lookahead_steps": 2,
        "draft_sources": ["bubble", "suffix"],
        "draft_candidates": 1,
    },
    "gpu": {
        "bubble_policy": "longest-first",
        "sharding_policy": "length-balanced",
        "lookahead_steps": 2,
        "draft_sources": ["bubble", "suffix", "ngram"],
        "draft_candidates": 4,
    },
}
"""``speculation.preset``: the settings measured best (BENCHMARKS.md), by where they were measured. ``cpu``: the
README's main job and ``examples/bench-wall.yaml`` on the wall clock of 2 CPU cores (a verify pass costs in proportion
to its tokens there, so one candidate a pass). ``gpu``: ``examples/bench-long.yaml`` on the virtual clock's
``h100-7b`` profile (verifying tens of tokens costs about one decode pass there: token trees of 4 candidates); never
measured on a real GPU."""


HeadPosition = Literal["last", "after-request"]
"""Where a draft head proposes in an engine's draft chain: ``last``, where no source of the chain proposes anything;
``after-request``, where the request's own draft (the bubble's) has no aligned proposal, before the dynamic sources and
a diverged draft's tokens by position (in a token-tree pass its proposal is the first candidate, theirs after it)."""


class DraftHeadConfig(Section):
    """``speculation.draft_head``: a draft head learned online (docs/design.md §14). After each rollout the last
    rank learns from the step's responses (the policy's hidden states along them, one pass per 4 responses, then
    AdamW steps) while the trainer trains, and drafts with it from the next rollout on, after every other source of a
    pass (its proposals extend what the others leave of a pass's draft room). Its learning costs the step nothing
    where the ranks draft while the trainer trains (``draft_during_training``) and it ends before the trainer; the
    rest is charged on the step. Every rank drafts with it (the next weight sync sends it). Measured on bench-virtual,
    bench-long and SmolLM2 on the virtual clock, and on the README's main job and bench-wall on the wall clock of 2 CPU
    cores (BENCHMARKS.md, *A keyed draft head*), where it does not pay yet: off by default."""

    enabled: bool | Literal["auto"] = False
    """``auto`` learns and drafts like true, but pauses the head (no learning, no drafting) where the run's own
    estimate says that over the last 3 steps it drafted in, it saved no more than its calls, learning and sync cost;
    it learns once in 10 paused steps to measure again, and resumes where that pays
    (``rollout.speculation_gate.HeadGate``)."""
    window: int = Field(64, ge=1)
    """(hidden state, token) pairs the head attends, in learning as in drafting (capped by a family's sliding
    window)."""
    max_tokens: int | None = Field(None, ge=1)
    """Tokens the head proposes a pass at most, after a sequence's own proposal; None: up to
    ``rollout.max_draft_tokens_per_step``."""
    learning_rate: float = Field(3e-3, gt=0)
    """AdamW's, on the head's own parameters (float32)."""
    steps_per_rollout: int = Field(32, ge=1)
    """AdamW steps after each rollout at most: fewer where the clock says they (and the hidden-state passes) would
    take longer than the last training phase, and from fewer responses where not one step fits beside the passes over
    all of them (the first round, before any training phase, takes them all)."""
    responses_per_step: int = Field(8, ge=1)
    """Responses an AdamW step learns from (the rollout's responses in turn)."""
    seed: int = Field(0, ge=0)
    """The head's initialisation."""
    position: HeadPosition = "last"
    """Where in a pass's draft chain the head proposes: ``last``, where no source proposes anything (the bubble's
    draft, then ``suffix``, ``ngram`` and the other dynamic sources first); ``after-request``, where the request's
    own draft (the bubble's) proposes nothing, before the dynamic sources (in a token tree its proposal is the first
    candidate, theirs after it)."""
    max_live_sequences: int | None = Field(None, ge=1)
    """The head proposes only in a rank's passes of at most this many sequences: its tail, where the few responses
    left are the long ones that set the step's end (TLT drafts only there); None: in every pass. Its calls cost the
    same for one sequence as for many, so in a full batch they are paid where most of the sequences it drafts for are
    not the slowest."""
    sizing: Literal["acceptance", "fixed"] = "acceptance"
    """How many tokens it proposes a pass: ``acceptance``, as many as its measured acceptance pays for at the clock's
    cost of a head step against a decode pass (none where one token does not pay, but one every 16 passes to measure
    it again; ``models.draft_head.HeadSizing``); ``fixed``: ``max_tokens`` every pass."""


class SpeculationConfig(Section):
    preset: Literal["cpu", "gpu"] | None = None
    """Sets the speculation settings measured best where the run's hardware is like the benchmark's
    (:data:`SPECULATION_PRESETS`: ``cpu`` or ``gpu``); a setting given beside it wins. ``bubblespec validate`` shows
    what it resolved to. None: the defaults below, which no benchmark uses."""
    enabled: bool | Literal["auto"] = "auto"
    """Draft the next step in the bubble and verify those drafts; false gives plain synchronous RL. ``auto`` (the
    default) drafts like true, but pauses drafting where the run's own estimate says the drafts of the last few
    steps saved under 2% of the rollout, drafts one bubble in ten to measure again, and resumes where that pays
    (:mod:`bubblespec.rollout.speculation_gate`); true drafts in every step whatever it saves."""
    draft_store: str = "memory"
    """Draft store plugin (entry point group ``bubblespec.draft_stores``)."""
    draft_store_options: dict[str, Any] = {}
    """Settings only the chosen draft store knows, passed to its constructor (``ray``: ``label_selector``, the
    Ray label selector of the nodes its actor may run on; empty: Ray's choice, usually the driver's node)."""
    draft_store_max_tokens: int = Field(50_000_000, ge=1)
    """Cap on the draft tokens the store holds; past it the drafts of the step farthest ahead are evicted first, the
    newest of them (the last put) first, so the next step's drafts, the ones used next, stay longest (each step's
    record counts them: ``drafts_evicted``). A step's drafts are dropped once the step has used them."""
    bubble_policy: str = "coverage-first"
    """Which keys an idle rank drafts first (a bubble policy plugin)."""
    sharding_policy: str = "round-robin"
    """How a step's requests are split across ranks (a sharding policy plugin)."""
    lookahead_steps: int = Field(1, ge=1, le=4)
    """Steps ahead to draft for: 1 drafts step t+1 only; 2 also drafts step t+2 (with the same, older policy,
    so with lower acceptance) once every key of step t+1 has been handed out, so idle ranks keep working."""
    draft_during_training: bool | Annotated[int, Field(ge=0)] | Literal["auto"] = "auto"
    """Also draft while the trainer runs: right only where rollout ranks use hardware the trainer does not, where
    the training phase is a bubble for the ranks too. ``auto`` decides it from the placement
    (:meth:`ServiceConfig.training_drafting`): every rank where the ranks have hardware of their own (GPUs they
    reserve, nodes of their own); none where they share the trainer's devices or cores (``ray.colocated``, ranks on
    the CPU beside the trainer) and on the virtual clock, whose simulated cluster drafts while training only when
    told to. ``true``: every rank; a number: that many (the first ranks), e.g. the one rank of two for which a
    2-core machine has a core beside the trainer's. The run says what it chose and why."""
    draft_sources: list[str] = ["bubble"]
    """Where drafts come from, in priority order (entry point group ``bubblespec.draft_sources``): ``bubble``
    (drafts of the next step made in the bubble), ``history`` (the last response to the same prompt, from an
    earlier epoch), ``group`` (sibling samples of the same prompt on the same rank), ``ngram`` (prompt lookup),
    ``suffix`` (continuations of the response's latest tokens in the responses and drafts its rank made before),
    or ``none``. A request carries the draft of the first static source (bubble, history) that has one; dynamic
    sources (group, ngram, suffix) propose whenever that draft has nothing to propose (none, used up, diverged), or
    beside it with ``draft_candidates`` > 1."""
    draft_source_options: dict[str, dict[str, Any]] = {}
    """Constructor arguments of sources by name, e.g. ``{ngram: {max_n: 4, min_n: 2, num_tokens: 8}}`` (the
    ``bubble`` source takes none: it reads the draft store)."""
    draft_candidates: int = Field(1, ge=1, le=16)
    """Candidate continuations each sequence verifies per forward pass. 1: the first source in ``draft_sources``
    order that proposes (a chain). More: the proposals of several sources (the request's draft, each sibling's for
    ``group``, ``suffix``'s best matches, ``ngram``'s), verified at once as a token tree of at most this many times
    ``rollout.max_draft_tokens_per_step`` tokens for the sequence of a pass predicted longest (the others verify one
    proposal), so the longest agreeing one wins wherever the first has left the new policy. The torch backend
    builds trees; vllm verifies the first candidate only, and sglang (no dynamic sources) refuses more than one."""
    tries_max_tokens_per_rank: int = Field(0, ge=0)
    """Draft tries (docs/design.md §13): once the next step's keys are drafted, idle ranks draft branches from the
    drafts' near-ties (where the drafting policy nearly sampled another token; a newer policy's sample most often
    differs there, to that token), about this many branch tokens per rank and step at most; a response that takes a
    branch's first token goes on from the branch instead of decoding one token a pass. 0: single-path drafts
    (drafting passes then report no margins). Needs the bubble source and a backend that drafts tries (torch); with
    ``draft_candidates`` > 1 the branches ahead are verified beside the draft as one token tree."""
    tries_policy: str = "tail-margin"
    """Which near-ties get a branch first (a tries policy plugin; ``tail-margin``: the smallest margins on the
    longest responses, :mod:`bubblespec.policies.tries`)."""
    draft_head: DraftHeadConfig = DraftHeadConfig()
    """A draft head learned online (:class:`DraftHeadConfig`); needs a backend that drafts with one (torch)."""

    @model_validator(mode="before")
    @classmethod
    def _preset_fills_what_is_not_set(cls, settings: Any) -> Any:
        preset = settings.get("preset") if isinstance(settings, dict) else None
        if not (isinstance(preset, str) and preset in SPECULATION_PRESETS):  # anything else: the field's own error
            return settings
        preset = dict(SPECULATION_PRESETS[settings["preset"]])
        if settings.get("enabled") is False or settings.get("draft_sources") == ["none"]:
            preset.pop("draft_candidates")  # nothing drafts: several candidates would be refused
        return preset | settings

    @field_validator("draft_store")
    @classmethod
    def _store_installed(cls, name: str) -> str:
        return _installed("draft_stores", name)

    @field_validator("draft_sources")
    @classmethod
    def _sources_installed_once(cls, names: list[str]) -> list[str]:
        if not names:
            raise ValueError("name at least one draft source (none for plain decoding)")
        from bubblespec.core.draft_sources import source_class

        for name in names:
            _installed("draft_sources", name)
            source_class(name)
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"draft source(s) {', '.join(map(repr, repeated))} named more than once in {names}")
        if "none" in names and len(names) > 1:
            raise ValueError(f"draft source 'none' cannot be combined with others, got {names}")
        return names

    @model_validator(mode="after")
    def _options_for_named_sources(self) -> SpeculationConfig:
        unused = sorted(set(self.draft_source_options) - set(self.draft_sources))
        if unused:
            raise ValueError(
                f"draft_source_options for {unused} but draft_sources is {self.draft_sources}; options are only "
                "for sources in use"
            )
        from bubblespec.core.draft_sources import BubbleDrafts, NoDrafts, source_class

        for name in self.draft_sources:  # a source's options must suit its constructor
            source = source_class(name)
            if issubclass(source, BubbleDrafts | NoDrafts):
                continue
            options = self.draft_source_options.get(name, {})
            try:
                source(**options)
            except (TypeError, ValueError) as error:
                raise ValueError(f"draft_source_options.{name} {options}: {error}") from None
        return self

    @model_validator(mode="after")
    def _candidates_where_something_drafts(self) -> SpeculationConfig:
        if self.draft_candidates > 1 and (self.enabled is False or self.draft_sources == ["none"]):
            why = "enabled is false" if self.enabled is False else "draft_sources is ['none']"
            raise ValueError(
                f"draft_candidates {self.draft_candidates} verifies several drafts per pass, but nothing drafts "
                f"({why}); use 1, or name draft sources with speculation on"
            )
        return self

    @model_validator(mode="after")
    def _tries_where_the_bubble_drafts(self) -> SpeculationConfig:
        if self.tries_max_tokens_per_rank and not self.uses_bubble:
            why = "enabled is false" if self.enabled is False else f"draft_sources {self.draft_sources} has no bubble"
            raise ValueError(
                f"tries_max_tokens_per_rank {self.tries_max_tokens_per_rank} branches the bubble's drafts, but the "
                f"bubble drafts nothing ({why}); use 0, or draft in the bubble"
            )
        return self

    @property
    def uses_draft_head(self) -> bool:
        """Whether a draft head learns online and drafts (speculation enabled and ``draft_head.enabled``)."""
        return bool(self.enabled) and bool(self.draft_head.enabled)

    @property
    def uses_tries(self) -> bool:
        """Whether idle ranks draft branches of the bubble's drafts (draft tries)."""
        return self.uses_bubble and self.tries_max_tokens_per_rank > 0

    @property
    def uses_bubble(self) -> bool:
        """Whether idle ranks draft the next step (the bubble source is on and speculation enabled)."""
        return self.enabled and "bubble" in self.draft_sources

    @field_validator("bubble_policy")
    @classmethod
    def _bubble_policy_installed(cls, name: str) -> str:
        return _installed("policies", name, role="bubble")

    @field_validator("sharding_policy")
    @classmethod
    def _sharding_policy_installed(cls, name: str) -> str:
        return _installed("policies", name, role="sharding")

    @field_validator("tries_policy")
    @classmethod
    def _tries_policy_installed(cls, name: str) -> str:
        return _installed("policies", name, role="tries")


class LoraSettings(Section):
    rank: int = Field(16, ge=1)
    """LoRA rank r."""
    alpha: float = Field(32.0, gt=0)
    """LoRA scale numerator: adapters add (alpha / r) * B @ A to each target weight."""
    init_seed: int = 0
    """Seed of the adapters' random initialisation (B starts at zero, A random), so that runs are reproducible."""
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    """Names of the linear layers that get adapters."""


class ConstantLR(Section):
    kind: Literal["constant"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    """RL steps of linear warm-up from learning_rate / warmup_steps to learning_rate, then constant. The schedule
    counts RL steps (as verl's does), not optimizer steps: every optimizer step of an RL step (ppo_epochs x
    mini-batches) has that step's learning rate, and a step that trains nothing (no reward signal) counts too."""


class CosineLR(Section):
    kind: Literal["cosine"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    """RL steps of linear warm-up, as with the constant schedule; then a cosine decay."""
    decay_steps: int = Field(ge=1)
    """RL step at which the learning rate reaches 0 (typically num_steps), above warmup_steps."""

    @model_validator(mode="after")
    def _decays_after_warmup(self) -> CosineLR:
        if self.decay_steps <= self.warmup_steps:
            raise ValueError(f"decay_steps {self.decay_steps} must be above warmup_steps {self.warmup_steps}")
        return self


def _kind_or(default: str, *others: str) -> Discriminator:
    """Discriminator of a union by ``kind``, which may be left out (then ``default``)."""

    def kind(value: Any) -> str | None:
        return value.get("kind", default) if isinstance(value, dict) else getattr(value, "kind", None)

    allowed = ", ".join((default, *others))
    return Discriminator(kind, custom_error_type="kind", custom_error_message=f"kind must be one of {allowed}")


LRSchedule = Annotated[
    Annotated[ConstantLR, Tag("constant")] | Annotated[CosineLR, Tag("cosine")],
    _kind_or("constant", "cosine"),
]


class OptimizerConfig(Section):
    learning_rate: float = Field(3e-4, gt=0)
    """AdamW learning rate (the peak, with a schedule)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's decoupled weight decay."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Gradient-norm clipping; empty disables it."""
    schedule: LRSchedule = ConstantLR()
    """The learning rate over RL steps: ``kind: constant`` (after an optional warm-up) or ``kind: cosine``
    (warm-up, then a cosine decay to 0 at ``decay_steps``)."""


class ClipLoss(Section):
    """PPO's clipped surrogate (``bubblespec/rl/policy_loss.py``)."""

    kind: Literal["clip"] = "clip"
    importance_ratio: Literal["token", "sequence"] = "token"
    """The ratio pi / pi_old per token, or per response as the geometric mean of its tokens' (GSPO)."""
    clip_epsilon: float = Field(0.2, gt=0)
    """Ratio clipping to [1 - clip_epsilon, 1 + clip_epsilon]; clip_ratio_low / clip_ratio_high override a side."""
    clip_ratio_low: float | None = Field(None, gt=0, lt=1)
    """The clip's lower side, 1 - this; empty: clip_epsilon."""
    clip_ratio_high: float | None = Field(None, gt=0)
    """The clip's upper side, 1 + this (DAPO's clip-higher: 0.28 with a low side of 0.2); empty: clip_epsilon."""

    @property
    def low(self) -> float:
        return self.clip_epsilon if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_epsilon if self.clip_ratio_high is None else self.clip_ratio_high


class CispoLoss(Section):
    """CISPO: every token's log-probability gradient weighted by its clipped, detached importance ratio; the
    ratio is per token."""

    kind: Literal["cispo"] = "cispo"
    clip_ratio_high: float = Field(0.2, gt=0)
    """The weight's cap, 1 + this."""


PolicyLoss = Annotated[Annotated[ClipLoss, Tag("clip")] | Annotated[CispoLoss, Tag("cispo")], _kind_or("clip", "cispo")]


class LossConfig(Section):
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"] = "grpo"
    """Advantage estimator (``bubblespec/rl/advantages.py``): GRPO's group-normalised rewards, Dr. GRPO's without the
    std, RLOO's leave-one-out baseline, or REINFORCE++'s batch-normalised one."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """GRPO only: divide by the group's reward std, the batch's, or nothing."""
    policy: PolicyLoss = ClipLoss()
    """The policy-gradient surrogate: ``kind: clip`` (PPO) or ``kind: cispo``, each with its own settings."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "seq-mean-token-mean"
    """How per-token losses become a mini-batch's loss: the mean over all its tokens (DAPO), the mean over
    responses of each response's token mean (GRPO), or of its token sum over a constant (Dr. GRPO)."""
    norm_tokens: int | None = Field(None, ge=1)
    """The constant of seq-mean-token-sum-norm; empty: the rollout's max_new_tokens."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss minus entropy_coef times the mean per-token entropy."""
    old_logprobs: Literal["trainer", "engine"] = "trainer"
    """The old policy's log-probabilities: recomputed by the trainer before the first update, or the rollout
    engine's as sampled (no extra forward pass; the ratio then also corrects engine-trainer mismatch)."""
    tis_cap: float | None = Field(None, gt=0)
    """Truncated importance sampling: weight each token's loss by min(pi_old / pi_engine, tis_cap), correcting the
    mismatch between the engine's and the trainer's numerics; empty: off."""
    sampling_filters: bool = False
    """Score responses under the distribution the rollout sampled from: its temperature and also its top_k / top_p
    (tokens outside them get probability 0), so that the trainer's logprobs are the engine's. The sampled token
    itself always stays in (the engine's filter kept it): once the policy has moved (a second epoch, a later
    mini-batch) it may fall outside the current top-k, and it keeps a finite log-probability instead of -inf. Off:
    temperature only, as TRL and verl do."""

    @model_validator(mode="after")
    def _old_logprobs_once(self) -> LossConfig:
        if self.tis_cap is not None and self.old_logprobs == "engine":
            raise ValueError("tis_cap corrects trainer old logprobs toward the engine's; with old_logprobs: engine "
                             "the ratio already is pi / pi_engine: leave tis_cap empty")  # fmt: skip
        return self


class KLConfig(Section):
    coef: float = Field(0.0, ge=0)
    """Weight of KL(pi || pi_ref) to the initial policy (a frozen copy); 0: no reference model."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator: log ratio (k1), half its square (k2), or exp(-log ratio) + log ratio - 1 (k3)."""
    penalty: Literal["loss", "reward"] = "loss"
    """Where the KL acts: a term of the loss (GRPO), or subtracted from each response's reward before advantages
    (PPO/RLHF style; the old policy's KL, summed over the response's tokens)."""


class DapoConfig(Section):
    """DAPO's (Yu et al. 2025) changes to what a step trains on."""

    mask_truncated: bool = False
    """Responses that reached max_new_tokens without stopping are left out of the loss."""
    overlong_buffer: int = Field(0, ge=0)
    """Soft overlong punishment: a response longer than max_new_tokens - overlong_buffer loses up to
    overlong_penalty of reward, in proportion to how far into the buffer it went; 0: off."""
    overlong_penalty: float = Field(1.0, ge=0)
    """The reward a response of max_new_tokens loses under overlong_buffer."""
    filter_groups: bool = False
    """Dynamic sampling: train only on groups whose rewards are not all equal (they carry no signal), at most
    ``train_prompts`` of them, in prompt order. Over-provision ``task.prompts_per_step`` above train_prompts:
    every prompt is generated (no extra rounds), so the next step's prompts stay known for bubble drafting."""
    train_prompts: int | None = Field(None, ge=1)
    """With filter_groups: the most groups a step trains on; empty: every group with signal."""

    @model_validator(mode="after")
    def _train_prompts_with_filter(self) -> DapoConfig:
        if self.train_prompts is not None and not self.filter_groups:
            raise ValueError("train_prompts caps the groups filter_groups keeps: set filter_groups: true")
        return self


class BuiltinModel(Section):
    """bubblespec's built-in decoder (Llama, Llama 3.x, Qwen2, Qwen3, Mistral), the one the torch engine runs."""

    kind: Literal["builtin"] = "builtin"


class TransformersModel(Section):
    """The folder's model as transformers' ``AutoModelForCausalLM`` loads it (any causal LM; engines still need to
    run the architecture: weights travel by Hugging Face name)."""

    kind: Literal["transformers"] = "transformers"
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    lora: LoraSettings | None = None
    """Train LoRA adapters (peft) instead of the weights; engines get the merged weights."""


TrainerModel = Annotated[
    Annotated[BuiltinModel, Tag("builtin")] | Annotated[TransformersModel, Tag("transformers")],
    _kind_or("builtin", "transformers"),
]

MOVED_TRAINER_KEYS = {
    "learning_rate": "optimizer.learning_rate",
    "weight_decay": "optimizer.weight_decay",
    "max_grad_norm": "optimizer.max_grad_norm",
    "lr_schedule": "optimizer.schedule.kind",
    "warmup_steps": "optimizer.schedule.warmup_steps",
    "decay_steps": "optimizer.schedule.decay_steps",
    "advantage": "loss.advantage",
    "scale_rewards": "loss.scale_rewards",
    "policy_loss": "loss.policy.kind",
    "importance_ratio": "loss.policy.importance_ratio",
    "clip_epsilon": "loss.policy.clip_epsilon",
    "clip_ratio_low": "loss.policy.clip_ratio_low",
    "clip_ratio_high": "loss.policy.clip_ratio_high",
    "loss_aggregation": "loss.aggregation",
    "loss_norm_tokens": "loss.norm_tokens",
    "entropy_coef": "loss.entropy_coef",
    "old_logprobs": "loss.old_logprobs",
    "tis_cap": "loss.tis_cap",
    "sampling_filters": "loss.sampling_filters",
    "kl_coef": "kl.coef",
    "kl_estimator": "kl.estimator",
    "kl_penalty": "kl.penalty",
    "mask_truncated": "dapo.mask_truncated",
    "overlong_buffer": "dapo.overlong_buffer",
    "overlong_penalty": "dapo.overlong_penalty",
    "filter_groups": "dapo.filter_groups",
    "train_prompts": "dapo.train_prompts",
    "gradient_checkpointing": "model.gradient_checkpointing (with model.kind: transformers)",
    "lora": "model.lora (with model.kind: transformers)",
}
"""Flat trainer keys of earlier versions and where each lives now."""


class TrainerConfig(Section):
    optimizer: OptimizerConfig = OptimizerConfig()
    loss: LossConfig = LossConfig()
    kl: KLConfig = KLConfig()
    dapo: DapoConfig = DapoConfig()
    model: TrainerModel = BuiltinModel()
    """What the trainer trains: ``kind: builtin`` (the engine's own decoder) or ``kind: transformers``."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each step's batch; with more than one (or several mini-batches) the ratio and clip act."""
    mini_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer step (several optimizer steps per RL step); empty: the whole batch, one step."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Samples per forward/backward pass, gradients accumulated over a step's micro-batches; empty: all at once."""
    micro_batch_tokens: int | None = Field(None, ge=1)
    """Padded tokens per forward/backward pass (its samples times the longest prompt + response among them): the
    samples are taken longest first and packed up to this many, so that long and short responses do not share a
    padded pass (verl's dynamic batch size); a sample longer than it is a pass alone. With ``micro_batch_size``,
    both bound a pass; empty: no token bound, the samples in their order."""
    num_workers: int = Field(1, ge=1)
    """Ray Train workers (data-parallel; gloo on CPU, nccl on GPU)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the trainer runs."""
    gpus_per_worker: float | None = Field(None, ge=0)
    """GPUs each Ray Train worker reserves; empty: 1 with device cuda, 0 with cpu."""
    max_restarts: int = Field(3, ge=0)
    """Wall clock: how often Ray Train may restart a failed worker group; each restart rewinds the run to its
    last checkpoint (or its start) and replays the steps since, with identical results."""

    @model_validator(mode="before")
    @classmethod
    def _no_flat_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        moved = [f"trainer.{key} is now trainer.{MOVED_TRAINER_KEYS[key]}" for key in data if key in MOVED_TRAINER_KEYS]
        if isinstance(data.get("model"), str):
            moved.append(f"trainer.model is a section now: trainer.model.kind: {data['model']}")
        if moved:
            raise ValueError("; ".join(moved))
        return data

    @model_validator(mode="after")
    def _across_subsections(self) -> TrainerConfig:
        if self.device == "cuda" and self.gpus_per_worker == 0:
            raise ValueError("trainer.device cuda needs a GPU per worker: gpus_per_worker above 0 (or empty: 1)")
        return self

    @property
    def lora(self) -> LoraSettings | None:
        """The LoRA settings of a transformers model, None otherwise."""
        return self.model.lora if isinstance(self.model, TransformersModel) else None

    @property
    def worker_gpus(self) -> float:
        """The GPUs a Ray Train worker reserves."""
        if self.gpus_per_worker is not None:
            return self.gpus_per_worker
        return 1.0 if self.device == "cuda" else 0.0


class ClockConfig(Section):
    kind: Literal["wall", "virtual"] = "wall"
    """wall: real time and real concurrency. virtual: every forward pass is charged by a cost model and the
    cluster is simulated deterministically (tokens, acceptance and decode steps stay real)."""
    profile: Literal["cpu-tiny", "h100-7b"] = "cpu-tiny"
    """Cost model of the virtual clock: calibrated on this CPU engine, or a 7B model on one H100-class GPU."""


class RayConfig(Section):
    address: str | None = None
    """An existing Ray cluster to join: "auto" (the one started on this machine with ``ray start``), "host:port" or
    "ray://host:port". Empty: the ``RAY_ADDRESS`` environment variable if set (``ray job submit`` sets it), else a
    local Ray of the run's own, started and stopped with it, even where another Ray runs on the machine."""
    http_proxy: bool = False
    """Start Ray Serve's HTTP proxy (only needed to reach ranks over HTTP)."""
    colocated: bool = False
    """Rollout ranks and trainer workers share hardware (the same GPUs, e.g. 0.5 GPU each): engines ``release()``
    their generation memory before each training phase and ``resume()`` after it, and nothing drafts while the
    trainer runs. false: separate hardware (``rollout_nodes`` / ``trainer_nodes``)."""
    rollout_nodes: dict[str, str] = {}
    """Ray label selector of the nodes rollout ranks may run on, e.g. ``{bubblespec-role: rollout}`` for nodes
    started with ``ray start --labels bubblespec-role=rollout``; empty: any node with the resources."""
    trainer_nodes: dict[str, str] = {}
    """Ray label selector of the nodes trainer workers may run on; empty: any node with the resources."""


class MetricsConfig(Section):
    enabled: bool = True
    """Serve Prometheus metrics (``bubblespec_*``, label ``rank``) while the run runs."""
    host: str = "127.0.0.1"
    """Address the metrics endpoint binds to: loopback unless you say otherwise (e.g. "0.0.0.0")."""
    port: int | None = Field(None, ge=0, le=65535)
    """Port of ``http://host:port/metrics``. Empty: 9464 when it is free, else a free one; 0: a free one; a number:
    that port, or an error when it is taken. The URL is printed at the start and written to the run's
    service-discovery file (docs/cluster.md)."""


class RolloutScheduleConfig(Section):
    """Which rollout schedule the RL loop runs (docs/design.md §12). ``sync`` is bubblespec's: every step trains on
    the step's own prompts, generated by the policy that trains on them. The others are what users pick instead
    against the long tail, run as real schedules on the virtual clock so that ``bubblespec bench peers-async`` can
    set them side by side; ``exact-partial`` is bubblespec's early step end without their staleness."""

    kind: Literal["sync", "async", "partial", "exact-partial", "tail-batching"] = "sync"
    """sync: the step's prompts, all responses, one policy. async: generation of later steps overlaps training on
    separate hardware, with policies up to ``max_staleness`` updates old. partial: a response longer than the
    step's token budget is cut and continued next step under the new policy (a prefix of an older policy).
    exact-partial: the same early end, but a cut group is generated again next step by the new policy with its cut
    responses as drafts (verified exactly: staleness 0). tail-batching: a group cut in a short step waits for a
    long step that generates only such groups, from scratch (with drafts from their cut responses when speculation
    is on)."""
    max_staleness: int | None = Field(None, ge=0)
    """async: the most policy updates a generating policy may be behind the one that trains on its samples (empty:
    1, one-step-off-policy; 0 is synchronous)."""
    cut_tokens: int | None = Field(None, ge=1)
    """partial, exact-partial, tail-batching: each response's token budget in its step (a group with a response
    over it is carried)."""
    cut_quantile: float | None = Field(None, gt=0, le=1)
    """Instead of ``cut_tokens``: the budget is this quantile of the lengths of the previous step's fresh responses
    (0.9: about one response in ten is cut); step 0 has none."""

    @property
    def policy_lag(self) -> int:
        """The most updates a generating policy may be behind: ``max_staleness`` under async, else 0."""
        return (1 if self.max_staleness is None else self.max_staleness) if self.kind == "async" else 0

    @property
    def cuts(self) -> bool:
        return self.kind in ("partial", "exact-partial", "tail-batching")

    @model_validator(mode="after")
    def _settings_of_its_kind(self) -> RolloutScheduleConfig:
        if self.cuts and (self.cut_tokens is None) == (self.cut_quantile is None):
            raise ValueError(
                f"schedule.kind {self.kind!r} ends a step early: set exactly one of schedule.cut_tokens (a token "
                "budget per response) and schedule.cut_quantile (a quantile of the previous step's response lengths)"
            )
        if not self.cuts and (self.cut_tokens is not None or self.cut_quantile is not None):
            raise ValueError(
                f"schedule.cut_tokens / cut_quantile are for kinds partial, exact-partial and tail-batching, not "
                f"{self.kind!r}"
            )
        if self.kind != "async" and self.max_staleness is not None:
            raise ValueError(f"schedule.max_staleness is for kind 'async', not {self.kind!r}")
        return self


class ServiceConfig(Section):
    """The sections a rollout service needs (:func:`bubblespec.run.assembly.start_service`): a run config's, or those of
    a trainer of another framework that calls the service (``bubblespec.integrations``)."""

    seed: int = 0
    """Run seed: part of every rollout key, so it fixes every sample."""
    model: ModelConfig = ModelConfig()
    rollout: RolloutConfig = RolloutConfig()
    speculation: SpeculationConfig = SpeculationConfig()
    clock: ClockConfig = ClockConfig()
    ray: RayConfig = RayConfig()
    metrics: MetricsConfig = MetricsConfig()

    @model_validator(mode="after")
    def _training_hardware(self) -> ServiceConfig:
        setting = self.speculation.draft_during_training
        if self.ray.colocated and setting != "auto" and setting:  # true, or a number of ranks
            raise ValueError(
                "speculation.draft_during_training needs ranks on hardware of their own; with ray.colocated the "
                "engines release their memory to the trainer while it trains: turn one of the two off"
            )
        return self

    def training_drafting(self) -> tuple[int, str]:
        """How many ranks draft while the trainer trains (the first ones; 0: none), and why:
        ``speculation.draft_during_training`` where it is set (true: every rank; a number: that many), else decided
        from where the ranks run against the trainer. Drafting on cores the trainer uses slows the trainer by more
        than the drafts save (BENCHMARKS.md: on 2 CPU cores the main job's training 6-13% slower with one rank
        drafting, bench-wall's whole steps 0.89x with both)."""
        setting = self.speculation.draft_during_training
        ranks = self.rollout.num_ranks
        if isinstance(setting, bool):
            return ranks if setting else 0, f"speculation.draft_during_training: {str(setting).lower()}"
        if setting != "auto":
            return min(setting, ranks), f"speculation.draft_during_training: {setting} (the first ranks)"
        if not self.speculation.uses_bubble:
            return 0, "auto: nothing drafts in the bubble (speculation off, or no bubble draft source)"
        if self.ray.colocated:
            return 0, "auto: ray.colocated, the ranks share the trainer's hardware and release it while it trains"
        if self.clock.kind == "virtual":  # a simulated cluster: its placement is the config's to say
            return 0, "auto: on the virtual clock set it true to simulate ranks with hardware of their own"
        if self.rollout.gpus_per_rank > 0:
            return ranks, "auto: the ranks reserve GPUs of their own (rollout.gpus_per_rank, ray.colocated false)"
        if self._ranks_on_nodes_of_their_own:
            return ranks, "auto: the ranks run on nodes of their own (ray.rollout_nodes, ray.trainer_nodes)"
        return 0, "auto: the ranks run on CPU cores the trainer may use; set it true where they have their own"

    @property
    def drafting_shares_trainer_hardware(self) -> bool:
        """Whether ranks drafting while the trainer trains run on hardware the trainer uses (CPU cores of the same
        machine, on the wall clock): a cost to the trainer that a run cannot see from its own records."""
        return self.clock.kind == "wall" and self.rollout.gpus_per_rank == 0 and not self._ranks_on_nodes_of_their_own

    @property
    def _ranks_on_nodes_of_their_own(self) -> bool:
        ray = self.ray
        return bool(ray.rollout_nodes and ray.trainer_nodes) and ray.rollout_nodes != ray.trainer_nodes

    @classmethod
    def of_run(cls, config: RunConfig) -> ServiceConfig:
        """The service's sections of a run config."""
        return cls(**{name: getattr(config, name) for name in cls.model_fields})


class RunConfig(ServiceConfig):
    """A whole run: the service's sections, and the task, the trainer and the run's own settings."""

    name: str = Field("run", pattern=r"^[A-Za-z0-9_.-]+$")
    """Name of the run; its directory is ``output_dir/name``."""
    output_dir: str = "runs"
    """Parent folder of run directories."""
    num_steps: int = Field(10, ge=1)
    """Synchronous RL steps."""
    checkpoint_every: int = Field(5, ge=1)
    """Write a checkpoint every N steps (and after the last)."""
    eval_every: int = Field(0, ge=0)
    """Score the policy on a fixed held-out prompt set every N steps (and after the last); 0 turns it off. The
    training reward of a step depends on which prompts the step drew, so this is the curve to read."""
    eval_prompts: int = Field(128, ge=1)
    """Held-out prompts (from the task with another seed), one keyed sample each, the same keys every time."""
    logged_prompts: int = Field(2, ge=0)
    """Prompts per step whose responses (every sample), rewards and advantages go to ``samples.jsonl``; 0: none."""
    show_sample_every: int = Field(10, ge=0)
    """Every N steps (and at the first) the console shows the step's first logged prompt, one of its responses and
    its reward: what the model writes, as it learns. 0 (or ``logged_prompts: 0``, or ``--quiet``): never."""
    task: TaskConfig = TaskConfig()
    trainer: TrainerConfig = TrainerConfig()
    schedule: RolloutScheduleConfig = RolloutScheduleConfig()

    @model_validator(mode="after")
    def _across_sections(self) -> RunConfig:
        if self.schedule.kind != "sync" and self.clock.kind != "virtual":
            raise ValueError(
                f"schedule.kind {self.schedule.kind!r} runs on the virtual clock only (it is there to be compared "
                "with, on the same simulated cluster); use clock.kind: virtual or schedule.kind: sync"
            )
        if self.schedule.kind == "async" and self.ray.colocated:
            raise ValueError("schedule.kind 'async' generates while the trainer trains: it needs ray.colocated false")
        if self.schedule.kind == "async" and self.speculation.enabled and "suffix" in self.speculation.draft_sources:
            raise ValueError(
                "speculation.draft_sources 'suffix' with schedule.kind 'async': async picks the generating policy by "
                "how long steps take, and suffix's memory is not in checkpoints, so a resumed run could train on "
                "other samples; use another source with async"
            )
        if self.schedule.kind == "async" and self.speculation.uses_draft_head:
            raise ValueError(
                "speculation.draft_head with schedule.kind 'async': the head learns while the trainer trains, and "
                "under async the ranks generate then; use schedule.kind sync or partial, or draft_head.enabled: false"
            )
        if self.trainer.dapo.filter_groups and self.task.samples_per_prompt < 2:
            raise ValueError(
                "trainer.dapo.filter_groups keeps groups whose rewards differ: it needs task.samples_per_prompt >= 2 "
                f"(got {self.task.samples_per_prompt}), or every step trains nothing"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


RESUMABLE = ("metrics", "ray", "checkpoint_every", "logged_prompts", "show_sample_every", "num_steps")
"""What a resumed run may change (``bubblespec run --resume DIR --set ...``): where it serves metrics and finds Ray,
how often it checkpoints, what it logs, and (growing only) how many steps it runs. Nothing here changes a step's
rollouts or weights; everything else might, and is refused."""


def check_resumable(saved: RunConfig, config: RunConfig) -> None:
    """Refuses, by key, a resumed run's config that differs from the one ``saved`` in its run directory in what
    could change its results (anything outside :data:`RESUMABLE`), or that shrinks ``num_steps``."""

    def flat(data: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(data, dict):
            return {prefix: data}
        return {k: v for key, value in data.items() for k, v in flat(value, f"{prefix}{key}.").items()}

    before, after = flat(saved.model_dump(mode="json")), flat(config.model_dump(mode="json"))
    changed = sorted(key.rstrip(".") for key in before.keys() | after.keys() if before.get(key) != after.get(key))
    refused = [key for key in changed if key.split(".")[0] not in RESUMABLE]
    if refused:
        raise ConfigError(
            f"a resumed run keeps the settings that decide its results; {', '.join(refused)} would change them. A "
            f"resume may change {', '.join(RESUMABLE[:-1])} and {RESUMABLE[-1]} (upward); start a new run for the "
            "others"
        )
    if config.num_steps < saved.num_steps:
        raise ConfigError(
            f"num_steps {config.num_steps} is below the run's {saved.num_steps}: a resume may only extend a run"
        )
    if config.num_steps != saved.num_steps and saved.schedule.cuts:
        raise ConfigError(
            f"num_steps: schedule.kind {saved.schedule.kind!r} ends its last step differently (nothing is carried "
            "past it), so this run cannot be extended; start a new run"
        )


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Applies ``a.b=c`` overrides (values parsed as YAML scalars) to a nested dict."""
    for override in overrides:
        path, sep, raw = override.partition("=")
        if not sep or not path:
            raise ConfigError(f"override {override!r} must look like section.field=value")
        node = data
        parts = path.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {override!r}: {part!r} is not a section")
            node = child
        try:
            node[parts[-1]] = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError as error:
            problem = getattr(error, "problem", None) or error
            raise ConfigError(
                f"override {override!r}: the value {raw!r} is not a YAML scalar ({problem}); quote strings, e.g. "
                f"{path}='\"text\"'"
            ) from None
    return data


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Reads a YAML config (safely), applies overrides and validates; every problem becomes a ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return validate(apply_overrides(resolve_paths(data, path.parent), overrides or []), source=str(path))


def resolve_paths(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The config file's input paths made absolute from ``folder`` (the config file's): ``model.path`` and the task
    options its task names in ``path_options`` (the dataset task's ``path`` and ``eval_path``). A path given with
    ``--set``, an absolute one and ``~/...`` are left as they are; ``output_dir`` (where runs are written) stays
    relative to the current directory."""

    def resolved(value: Any) -> Any:
        if isinstance(value, list):
            return [resolved(v) for v in value]
        if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute() or value.startswith("~"):
            return value
        return os.path.normpath(folder.resolve() / value)

    model = data.get("model")
    if isinstance(model, dict) and model.get("path"):
        data["model"] = model | {"path": resolved(model["path"])}
    task = data.get("task")
    if isinstance(task, dict) and isinstance(task.get("options"), dict):
        options = task["options"]
        names = _task_path_options(task.get("name", TaskConfig().name))
        task["options"] = options | {name: resolved(options[name]) for name in names if name in options}
    return data


def _task_path_options(name: Any) -> tuple[str, ...]:
    """The options of task ``name`` that are input paths (its class's ``path_options``); none for a task that is
    not installed (validation reports it)."""
    from bubblespec.core import plugins
    from bubblespec.core.errors import PluginNotFoundError
    from bubblespec.core.interfaces import Task

    try:
        return tuple(plugins.load_subclass("tasks", name, Task).path_options)
    except (PluginNotFoundError, TypeError):
        return ()


def validate(data: dict[str, Any], source: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, source)) from None


def format_validation_error(error: ValidationError, source: str, model: type[BaseModel] = RunConfig) -> str:
    """Every problem of ``error`` on a line with its field path; a misspelled key of ``model`` (or of one of its
    sections) gets the closest allowed name."""
    lines = [f"{source}: {error.error_count()} error(s)"]
    for problem in error.errors():
        where = ".".join(str(part) for part in problem["loc"]) or "(top level)"
        given = problem.get("input")
        shown = "" if isinstance(given, dict) else f" (got {given!r})"
        hint = ""
        if problem["type"] == "extra_forbidden" and problem["loc"]:
            hint = did_you_mean(problem["loc"][-1], _field_names(model, problem["loc"][:-1]))
        lines.append(f"  {where}: {problem['msg']}{shown}{hint}")
    return "\n".join(lines)


def _field_names(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names of the section of ``model`` at ``loc`` (a tagged union's tag in ``loc`` picks its member);
    none where ``loc`` leads elsewhere (a list, a mapping of free keys)."""
    parts = list(loc)
    while parts:
        field = model.model_fields.get(parts.pop(0))
        members = [] if field is None else _models_in(field.annotation)
        if len(members) > 1 and parts:  # a tagged union: the next part is the member's kind
            tag = parts.pop(0)
            members = [m for m in members if "kind" in m.model_fields and m.model_fields["kind"].default == tag]
        if len(members) != 1:
            return []
        model = members[0]
    return list(model.model_fields)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


class EngineSettings(BaseModel):
    """The settings every engine backend takes (:func:`bubblespec.run.assembly.engine_settings` fills them from the run
    config). A backend's ``config_class`` subclasses this, adds its own settings and may narrow these (a dtype it
    cannot run, a verification it cannot do)."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=(), use_attribute_docstrings=True)

    model_path: str
    """A local Hugging Face model folder (config.json + *.safetensors)."""
    dtype: str = "float32"
    """Weights and activations (``model.dtype``)."""
    max_batch_size: int = Field(64, ge=1)
    """Sequences decoded together; more requests wait for a free slot (``rollout.max_batch_size``)."""
    max_draft_tokens_per_step: int = Field(16, ge=0)
    """Draft tokens a sequence may verify in one forward pass; 0: none (``rollout.max_draft_tokens_per_step``)."""
    verification: Literal["coupled", "one_hot"] = "coupled"
    """"coupled": keyed sampling, drafts made with the same noise. "one_hot": every policy version samples with its
    own independent noise stream of the key, so a draft of an older version agrees only as often as two
    independent samples do (``rollout.verification``)."""
    adaptive_draft_length: bool = False
    """Shrink a sequence's proposals to what its last verify step accepted (+1) and grow them again after full
    acceptance (``rollout.adaptive_draft_length``)."""
    draft_alignment: Literal["position", "suffix"] = "suffix"
    """After a rejected draft token: keep proposing the draft at the next positions ("position"), or first re-align
    it by matching the response's latest tokens ("suffix", falling back to position)."""
    rank: int = Field(0, ge=0)
    """The data-parallel rank this engine serves (remote backends pick a server by it)."""
    num_threads: int | None = Field(None, ge=1)
    """torch intra-op threads (``rollout.threads_per_rank``); None leaves torch's setting alone."""
    colocated: bool = False
    """The rank shares its hardware with the trainer (``ray.colocated``): ``release()`` is called before each training
    phase and must free what the engine can (a backend that cannot free memory where it runs refuses this)."""


class DraftChainSettings(BaseModel):
    """The settings of an engine that runs dynamic draft sources (``supports_draft_chain``); mixed into its
    ``config_class`` beside :class:`EngineSettings`."""

    draft_chain: tuple[str, ...] = (REQUEST_DRAFT,)
    """Where proposals come from, in priority order: ``"request"`` (the request's own draft) and dynamic draft
    sources (entry point group ``bubblespec.draft_sources``, e.g. ``"group"``, ``"ngram"``). Each forward pass a
    sequence takes the first non-empty proposal (see :mod:`bubblespec.core.draft_sources`)."""
    draft_source_options: dict[str, dict] = {}
    """Keyword arguments of each dynamic source's constructor, by source name."""
    draft_candidates: int = Field(1, ge=1)
    """Candidate continuations a sequence verifies per forward pass (``speculation.draft_candidates``): 1 takes the
    chain's first proposal; more verify several at once as a token tree where the engine can
    (``supports_draft_trees``), and the first elsewhere."""


def engine_config(backend: str, model: type[BaseModel], settings: dict[str, Any]) -> BaseModel:
    """``model(**settings)``: a backend's settings (the common ones plus ``rollout.engine_options``); a bad one is
    a :class:`ConfigError` that names it and lists the backend's valid settings."""
    try:
        return model(**settings)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in error.errors())
        valid = ", ".join(sorted(model.model_fields))
        raise ConfigError(
            f"{backend} backend settings (rollout.engine_options and the rollout fields it gets): {problems} "
            f"(valid settings: {valid})"
        ) from None
