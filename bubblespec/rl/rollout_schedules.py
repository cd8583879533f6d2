"""Rollout schedules (docs/design.md §12): which requests a step generates, with which policy, and which samples it
trains on.

``sync`` is bubblespec's RL loop: step t generates its own prompts with policy t and trains on all of them. The
others are the answers to the long tail that users pick instead, run for real on the virtual clock so that they can
be set side by side on the same workload and keys (``bubblespec bench peers-async``):

- ``async``: generation overlaps training on separate hardware; step t's samples come from the newest policy the
  ranks have when its generation starts, at most ``max_staleness`` updates behind policy t (:class:`StepClock`).
- ``partial``: a response longer than the step's token budget is cut; its group trains next step, the response
  continued by the new policy from the older policy's prefix (two policies in one sample).
- ``exact-partial``: the same early end, but next step the new policy generates the cut group again under the same
  keys, its responses as drafts: verified exactly, every trained sample is the trained policy's own.
- ``tail-batching``: a group cut in a short step waits in a pool; once a step's worth of groups waits, a long step
  generates only them, from scratch (drafted from their cut responses when speculation is on).

Every trained sample keeps the key and the full sampling settings of its request; a cut changes only when (and, for
``partial``, by which policies) it is generated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from bubblespec.core.config import RolloutScheduleConfig, RunConfig
from bubblespec.core.interfaces import Draft, GenerationRequest, GenerationResult, Prompt, SamplingParams, Task
from bubblespec.rollout.step import step_requests


@dataclass
class Group:
    """One prompt's samples in a step. ``requests`` are the samples as trained (key, full sampling settings);
    ``generate[i]`` is what this step generates for sample i (a capped request, a continuation, a request with a
    draft) or None when an earlier step's response is kept as it is; ``kept[i]`` is what an older policy already
    generated of sample i (a whole response or the prefix a continuation goes on from; ``partial`` only)."""

    prompt: Prompt
    requests: list[GenerationRequest]
    generate: list[GenerationRequest | None]
    kept: list[GenerationResult | None] = field(default_factory=list)
    fresh: bool = False
    """The step's own prompts (not a carried group): their lengths set the next budget."""

    def __post_init__(self) -> None:
        self.kept = self.kept or [None] * len(self.requests)


@dataclass(frozen=True)
class FreshGroups:
    """Where a step's fresh groups come from: the task's batch of prompts, ``samples_per_prompt`` keys each under
    the run's seed, sampled with ``sampling``."""

    task: Task
    run_seed: int
    sampling: SamplingParams
    samples_per_prompt: int


@dataclass
class StepRollout:
    """What a step's rollout generates: its groups' requests, with policy ``policy_version``; idle ranks draft the
    keys of the steps after ``draft_step``."""

    groups: list[Group]
    policy_version: int
    draft_step: int

    @property
    def requests(self) -> list[GenerationRequest]:
        return [r for g in self.groups for r in g.generate if r is not None]


@dataclass
class TrainedGroup:
    prompt: Prompt
    requests: list[GenerationRequest]
    results: list[GenerationResult]
    """Whole responses, keyed by the trained requests' keys."""
    stale_tokens: int
    version: int = 0
    """The policy that generated ``results`` (for a carried group: its drafts' version)."""


class StepClock:
    """When each step ends on the run's clock, and which policy generates it.

    Generation and training are two resources. Step t's generation starts once the last one ended and policy
    ``t - max_staleness`` is on the ranks, with the newest policy the ranks have then; its training starts once its
    samples are there and the last training and weight sync ended; the new policy reaches the ranks after the weight
    sync. With ``max_staleness`` 0 every step is rollout + train + weight sync after the last: the synchronous loop.
    A policy that arrives while the ranks generate is taken at their next start (the sync itself does not stall
    generation: in async's favour)."""

    def __init__(self, max_staleness: int = 0, start: float = 0.0, version: int = 0) -> None:
        """A timeline from ``start`` seconds, when policy ``version`` is on the ranks (a resumed run's first step)."""
        self.max_staleness = max_staleness
        self._generation_free = self._training_free = start
        self._available = {version: start}  # policy version -> when the ranks have it
        self._start = start

    def rollout_version(self, step: int) -> int:
        """The policy that generates step ``step`` (call once per step, before :meth:`finish`)."""
        needed = max(0, step - self.max_staleness)
        self._start = max(self._generation_free, self._available.get(needed, self._training_free))
        return max(v for v, at in self._available.items() if at <= self._start and v <= step)

    def finish(self, step: int, rollout: float, train: float, weight_sync: float) -> float:
        """Books step ``step``'s phases; returns when its new policy is on the ranks."""
        self._generation_free = self._start + rollout
        train_start = max(self._generation_free, self._training_free)
        self._training_free = train_start + train + weight_sync
        self._available[step + 1] = self._training_free
        for version in [v for v in self._available if v < step + 1 - self.max_staleness]:
            del self._available[version]
        return self._training_free


class RolloutSchedule:
    """``sync`` (``max_staleness`` 0) and ``async``: every step generates its own prompts and trains on all of
    them, with the policy :class:`StepClock` says."""

    def __init__(
        self, section: RolloutScheduleConfig, fresh: FreshGroups, start_seconds: float = 0.0, start_step: int = 0
    ) -> None:
        self.section = section
        """The run's ``schedule`` section: the kind and its settings."""
        self.fresh = fresh
        self.timeline = StepClock(section.policy_lag, start_seconds, start_step)

    def rollout(self, step: int) -> StepRollout:
        version = self.timeline.rollout_version(step)
        return StepRollout(self._fresh_groups(step, self.fresh.sampling), version, step)

    def collect(self, step: int, step_rollout: StepRollout, results: Sequence[GenerationResult]) -> list[TrainedGroup]:
        """The groups step ``step`` trains on, from its rollout's ``results``."""
        by_key = {r.key: r for r in results}
        stale = step_rollout.policy_version < step
        return [
            TrainedGroup(
                g.prompt,
                g.requests,
                rs := [by_key[r.key] for r in g.requests],
                sum(len(r.token_ids) for r in rs) if stale else 0,
            )
            for g in step_rollout.groups
        ]

    def carried(self) -> int:
        """Groups generated so far whose training waits for a later step."""
        return 0

    def _fresh_groups(self, batch: int, sampling) -> list[Group]:
        """The task's prompts of batch ``batch`` (step ``batch`` of a sync run: its keys, peek and drafts name it),
        generated with ``sampling``."""
        groups = []
        fresh = self.fresh
        for prompt in fresh.task.batch(batch):
            full = step_requests([prompt], fresh.run_seed, batch, fresh.samples_per_prompt, fresh.sampling)
            generate = full if sampling == fresh.sampling else [replace(r, sampling=sampling) for r in full]
            groups.append(Group(prompt, full, list(generate), fresh=True))
        return groups


class CutRolloutSchedule(RolloutSchedule):
    """``partial``, ``exact-partial`` and ``tail-batching``: fresh responses get a token budget; a group with a
    response over it is carried (see the module's docstring for what each kind does with it). The last step has no
    budget, so that it leaves nothing behind but a tail-batching pool."""

    def __init__(
        self,
        section: RolloutScheduleConfig,
        fresh: FreshGroups,
        *,
        prompts_per_step: int,
        num_steps: int,
        drafts: bool,
        start_seconds: float = 0.0,
        context_length: int | None = None,
    ) -> None:
        super().__init__(section, fresh, start_seconds)  # never resumed: starts at step 0
        self.prompts_per_step = prompts_per_step
        self.num_steps = num_steps
        """The run's last step has no budget: it leaves nothing behind but a tail-batching pool."""
        self.context_length = context_length
        """The engines' context (prompt + response tokens; None: unknown): a budget at or above the room a prompt
        leaves cuts nothing, since the context ends that response first."""
        self.kind = section.kind
        self.drafts = drafts
        """Whether a carried group's cut responses are drafts for its generation again (exact kinds)."""
        self._carried: list[TrainedGroup] = []  # cut groups with their responses so far
        self._last_lengths: list[int] = []
        self._batches = 0  # tail-batching: fresh batches taken so far

    def carried(self) -> int:
        return len(self._carried)

    def budget(self, step: int) -> int | None:
        """The step's token budget per fresh response (None: none): ``cut_tokens``, or the ``cut_quantile`` of the
        lengths of the last step's fresh responses, a cut one counted at its cut length (so the quantile is exact
        while fewer than 1 - q of them are cut, and the budget cannot shrink step after step)."""
        schedule = self.section
        if step == self.num_steps - 1:
            return None
        if schedule.cut_tokens is not None:
            return schedule.cut_tokens
        if not self._last_lengths:
            return None
        lengths = sorted(self._last_lengths)
        return max(1, lengths[max(0, math.ceil(schedule.cut_quantile * len(lengths)) - 1)])

    def rollout(self, step: int) -> StepRollout:
        version = self.timeline.rollout_version(step)
        if self.kind == "tail-batching":
            if len(self._carried) >= self.prompts_per_step or (
                self._carried and step == self.num_steps - 1
            ):  # a long step: only pooled groups, whole
                size = self.prompts_per_step
                pooled, self._carried = self._carried[:size], self._carried[size:]
                groups = [self._again(g) for g in pooled]
                return StepRollout(groups, version, self._batches - 1)
            batch = self._batches
            self._batches += 1
            return StepRollout(self._fresh_groups(batch, self.budget(step)), version, batch)
        carried = [self._again(g) for g in self._carried]
        self._carried = []
        return StepRollout(self._fresh_groups(step, self.budget(step)) + carried, version, step)

    def collect(self, step: int, step_rollout: StepRollout, results: Sequence[GenerationResult]) -> list[TrainedGroup]:
        by_key = {r.key: r for r in results}
        trained, lengths = [], []
        for group in step_rollout.groups:
            whole, cut, stale = [], False, 0
            for request, generated, kept in zip(group.requests, group.generate, group.kept, strict=True):
                result = _joined(request, generated, kept, None if generated is None else by_key[generated.key])
                cut |= result.finish_reason == "preempted"  # the step's budget stopped it: it goes on
                stale += 0 if kept is None else len(kept.token_ids)
                whole.append(result)
            done = TrainedGroup(group.prompt, group.requests, whole, stale, step_rollout.policy_version)
            if cut:
                self._carried.append(done)
            else:
                trained.append(done)
            if group.fresh:  # a cut response counts at its cut length: a lower bound, and the budget's own value
                lengths += [len(r.token_ids) for r in whole]
        self._last_lengths = lengths or self._last_lengths  # a long tail-batching step has no fresh groups
        return trained

    def _fresh_groups(self, batch: int, budget: int | None) -> list[Group]:
        """The batch's groups, each response capped at ``budget`` where that is less than the room it has (its
        ``max_new_tokens``, and the context its prompt leaves): only a response the budget stops is cut."""
        groups = super()._fresh_groups(batch, self.fresh.sampling)
        for group in groups:
            room = self.fresh.sampling.max_new_tokens
            if self.context_length is not None:
                room = min(room, self.context_length - len(group.prompt.token_ids))
            if budget is not None and budget < room:
                group.generate = [
                    replace(r, sampling=replace(r.sampling, max_new_tokens=budget)) for r in group.generate
                ]
        return groups

    def _again(self, group: TrainedGroup) -> Group:
        """A carried group as this step generates it."""
        requests, results = group.requests, group.results
        if self.kind == "partial":  # finished responses are kept; cut ones are continued by the new policy
            generate, kept = [], []
            for request, result in zip(requests, results, strict=True):
                if result.finish_reason == "preempted":
                    prefix = tuple(result.token_ids)
                    key = replace(request.key, prompt_uid=f"{request.key.prompt_uid}/continued")
                    sampling = replace(request.sampling, max_new_tokens=request.sampling.max_new_tokens - len(prefix))
                    generate.append(GenerationRequest(request.prompt_token_ids + prefix, key, sampling))
                else:
                    generate.append(None)
                kept.append(result)
            return Group(group.prompt, requests, generate, kept)
        generate = [
            replace(
                r, draft=Draft(r.key, tuple(res.token_ids), group.version, finished=res.finish_reason != "preempted")
            )
            if self.drafts and res.token_ids
            else r
            for r, res in zip(requests, results, strict=True)
        ]  # exact-partial, tail-batching: generated again by the new policy, with the cut responses as drafts
        return Group(group.prompt, requests, generate)


def _joined(
    request: GenerationRequest,
    asked: GenerationRequest | None,
    kept: GenerationResult | None,
    generated: GenerationResult | None,
) -> GenerationResult:
    """Sample ``request``'s response: what an older policy generated (``kept``), followed by what this step
    generated for ``asked``. A response stopped by the step's budget (``asked`` capped below what ``request`` still
    allows, and filled) is marked ``preempted``: it will go on. One that reached its request's own limit or the
    model's context stays ``length``: it is finished, as it is under ``sync``."""
    if generated is None or asked is None:
        return kept
    tokens = (list(kept.token_ids) if kept else []) + list(generated.token_ids)
    logprobs = (list(kept.logprobs) if kept else []) + list(generated.logprobs)
    reason = generated.finish_reason
    allowed = request.sampling.max_new_tokens - (len(kept.token_ids) if kept else 0)
    budgeted = asked.sampling.max_new_tokens < allowed
    if reason == "length" and budgeted and len(generated.token_ids) >= asked.sampling.max_new_tokens:
        reason = "preempted"
    return GenerationResult(request.key, tokens, logprobs, reason, generated.stats)


def build_rollout_schedule(
    config: RunConfig,
    task: Task,
    run_seed: int,
    sampling,
    start_seconds: float = 0.0,
    start_step: int = 0,
    context_length: int | None = None,
) -> RolloutSchedule:
    """The schedule ``config.schedule`` names, for a run that starts (or resumes) at ``start_step``, ``start_seconds``
    into its timeline, on engines of ``context_length``. Only ``sync`` runs resume (the controller refuses the
    others)."""
    section, fresh = config.schedule, FreshGroups(task, run_seed, sampling, config.task.samples_per_prompt)
    if section.cuts:
        return CutRolloutSchedule(
            section, fresh, prompts_per_step=config.task.prompts_per_step, num_steps=config.num_steps,
            drafts=config.speculation.enabled is not False, start_seconds=start_seconds, context_length=context_length,
        )  # fmt: skip
    return RolloutSchedule(section, fresh, start_seconds, start_step)
