"""The synchronous RL loop with bubble-time drafting (docs/design.md §5).

    for step t:
        requests of B_t (+ drafts from the store) --shard--> ranks generate with pi_t, verifying drafts
        idle ranks draft the keys of B_t+1 (bubble policy order) with pi_t until the barrier
        train on the samples of step t (never on drafts) --> pi_t+1 --> weights to every rank

The controller is the RL loop only: prompts -> :class:`bubblespec.rollout.service.RolloutService` (ranks, draft store,
drafting plan) -> rewards -> trainer -> new weights to the service. It is the same for every clock and cluster:
the service and the trainer are passed in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from bubblespec.core.config import RunConfig
from bubblespec.core.errors import ConfigError, TrainerRestarted
from bubblespec.core.interfaces import GenerationResult, Prompt, Task, acceptance_length
from bubblespec.models.decoder import DTYPES
from bubblespec.observe.records import REWIND, PhaseSeconds, PromptSamples, SampledResponse, StepRecord
from bubblespec.observe.run_dir import RunDirectory
from bubblespec.rl.advantages import compute_advantages
from bubblespec.rl.learner import TrainSample
from bubblespec.rl.rollout_schedules import RolloutSchedule, build_rollout_schedule
from bubblespec.rl.train_batch import shaped_rewards, train_samples
from bubblespec.rollout.service import RolloutService
from bubblespec.rollout.step import RolloutOutcome, TrainingDrafting, bubble_use, rollout_digest

logger = logging.getLogger(__name__)


class Trainer(Protocol):
    def train(self, samples: list[TrainSample], step: int) -> tuple[dict, dict, float]:
        """Step ``step``'s updates on its samples (ppo_epochs x mini-batches): (metrics, new weights, seconds)."""
        ...

    def checkpoint_state(self) -> dict:
        """What a checkpoint keeps of the trainer. A ``master_weights`` entry (weights more precise than the
        run's dtype: float32 in a bfloat16 run) is saved as the checkpoint's weights."""
        ...

    def load_checkpoint_state(self, state: dict) -> None:
        """``state``: a checkpoint's trainer state plus its ``weights``."""
        ...

    def reset(self) -> dict:
        """Back to the initial model and a fresh optimizer; returns the initial weights."""
        ...

    def weights(self) -> dict:
        """The current policy's weights, copied (the virtual clock's trainer; schedules other than sync need it)."""
        ...

    def placement(self) -> list[dict]:
        """Where each worker runs (node, GPUs), for the run's summary; [] for a trainer in this process."""
        ...


@dataclass
class Components:
    """What the controller drives; built by :mod:`bubblespec.run.launch` for the configured clock and cluster."""

    task: Task
    service: RolloutService
    trainer: Trainer
    eval_task: Task | None = None
    """The task's held-out version, for RunConfig.eval_every."""


def task_peek(task, num_steps: int):
    """The service's peek for a run of ``num_steps`` on ``task``: the task's prompts of a later step, none past the
    end of the run."""
    return lambda step: [] if step >= num_steps else task.peek(step)


class Controller:
    def __init__(
        self,
        config: RunConfig,
        parts: Components,
        run_dir: RunDirectory,
        on_step: Callable[[StepRecord], None] | None = None,
        on_phase: Callable[[int, str], None] | None = None,
    ) -> None:
        self.config = config
        self.parts = parts
        self.run_dir = run_dir
        self.on_step = on_step or (lambda record: None)
        self.on_phase = on_phase or (lambda step, phase: None)
        self._evicted = 0  # drafts the store had evicted by the end of the last step
        self.schedule = self._schedule(0.0, 0)
        self._engine_version = 0  # the policy on the ranks
        self._versions: dict[int, dict] = {}  # async: the policies the ranks may still generate with
        if self.schedule.timeline.max_staleness:
            self._keep_version(0, parts.trainer.weights())

    def _schedule(self, start_seconds: float, start_step: int) -> RolloutSchedule:
        service = self.parts.service
        return build_rollout_schedule(
            self.config, self.parts.task, service.seed, service.sampling, start_seconds, start_step,
            service.ranks.context_length,
        )  # fmt: skip

    def run(self, start_step: int = 0) -> None:
        """Runs steps ``start_step`` to the end. When the trainer's workers restart after a fault, the run rewinds
        to its last checkpoint and replays the steps since: keyed sampling makes them come out the same."""
        step, first_done = start_step, None
        while step < self.config.num_steps:
            try:
                record = self.step(step)
                if (step + 1) % self.config.checkpoint_every == 0 or step == self.config.num_steps - 1:
                    self._checkpoint(step)
            except TrainerRestarted as restart:
                self.on_phase(step, REWIND)
                failed, step = step, self.restore(fresh_parts=False)
                logger.warning(
                    "%s in step %d: the run rewinds to its last checkpoint and replays from step %d",
                    restart,
                    failed,
                    step,
                )
                continue
            step += 1
            # The time left at the pace of the steps after this process's first (which also warms up the engines and
            # evaluates the initial policy); none after the first.
            now, left = time.perf_counter(), None
            if first_done is None:
                first_done, paced = now, step
            elif step > paced:
                left = (now - first_done) / (step - paced) * (self.config.num_steps - step)
            logger.info(step_line(record, self.config.num_steps, left))
            self.on_step(record)

    def restore(self, fresh_parts: bool = True) -> int:
        """Loads the latest checkpoint (weights, trainer state, pending drafts) into the parts, forgets the step
        records after it and returns the step to continue from. Without a checkpoint the run starts over: parts
        built for this run already hold the initial model (``fresh_parts``); otherwise the trainer is reset and
        the ranks get its initial weights."""
        parts, run_dir = self.parts, self.run_dir
        if self.config.schedule.kind != "sync":
            raise ConfigError(
                f"a run of schedule.kind {self.config.schedule.kind!r} cannot resume or rewind (its carried groups "
                "and older policies are not checkpointed); run it again from the start"
            )
        checkpoint = run_dir.latest_checkpoint()
        if checkpoint is None:
            if not fresh_parts:
                parts.service.update_weights(parts.trainer.reset(), version=0)
            parts.service.restore([], [], [])
            run_dir.truncate_steps(-1)
            self.schedule = self._schedule(0.0, 0)
            self._engine_version = 0
            return 0
        weights, trainer_state, drafts, state = run_dir.load_checkpoint(checkpoint)
        step = int(state["step"])
        parts.trainer.load_checkpoint_state(trainer_state | {"weights": weights})
        # The checkpoint may hold float32 master weights; engines get them rounded to the run's dtype, as the
        # trainer sends them.
        dtype = DTYPES[self.config.model.dtype]
        parts.service.update_weights({name: t.to(dtype) for name, t in weights.items()}, version=step + 1)
        parts.service.restore(
            drafts,
            run_dir.load_history(checkpoint),
            state.get("response_lengths", []),
            state.get("speculation_gate"),
            run_dir.load_draft_head(checkpoint),
            state.get("head_gate"),
        )
        run_dir.truncate_steps(step)
        self.schedule = self._schedule(finished_at(run_dir.read_steps()), step + 1)
        self._engine_version = step + 1
        return step + 1

    def step(self, step: int) -> StepRecord:
        cfg, parts, schedule = self.config, self.parts, self.schedule
        initial_eval = self._evaluate() if cfg.eval_every and step == 0 else (None, {})  # the policy before training
        step_rollout = schedule.rollout(step)
        self._rollout_policy(step_rollout.policy_version)
        self.on_phase(step, "rollout")
        outcome = parts.service.generate_requests(step_rollout.draft_step, step_rollout.requests)
        trained = schedule.collect(step, step_rollout, outcome.results)
        prompts = [group.prompt for group in trained]
        requests = [request for group in trained for request in group.requests]
        results = [result for group in trained for result in group.results]  # prompt by prompt, sample by sample
        rewards, reward_parts = self._rewards(prompts, results)
        samples = train_samples(requests, results, rewards, cfg.task.samples_per_prompt)
        logged = self._logged_samples(step, prompts, results, rewards, reward_parts, samples)
        self.run_dir.append_samples(logged)
        if logged and cfg.show_sample_every and step % cfg.show_sample_every == 0:
            logger.info(sample_lines(logged[0]))
        train_metrics, weights, train_seconds, training = self._train(samples, step)
        self.on_phase(step, "weight sync")
        sync_seconds = parts.service.update_weights(weights, version=step + 1) if samples else 0.0
        self._engine_version = step + 1
        self._keep_version(step + 1, weights)
        phases = PhaseSeconds(rollout=outcome.seconds, train=train_seconds, weight_sync=sync_seconds)
        reward_failures = self._reward_failures(step)  # the rollout's, before an evaluation calls rewards again
        store = parts.service.store.stats()
        evicted, self._evicted = store["evicted"] - self._evicted, store["evicted"]
        evaluated = cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step in (0, cfg.num_steps - 1))
        evaluation = self._evaluate() if evaluated else (None, {})
        record = _step_record(
            step,
            outcome,
            training,
            rewards,
            train_metrics,
            phases,
            **reward_failures,
            reward_means={name: sum(scores) / max(len(scores), 1) for name, scores in reward_parts.items()},
            rollout_digest=rollout_digest(results),
            draft_store=store,
            drafts_evicted=evicted,
            eval_reward=evaluation[0],
            eval_reward_before_training=initial_eval[0],
            eval_reward_means=evaluation[1],
            eval_reward_means_before_training=initial_eval[1],
            finished_at_seconds=schedule.timeline.finish(step, phases.rollout, phases.train, phases.weight_sync),
            policy_lag=step - step_rollout.policy_version,
            trained_tokens=sum(len(result.token_ids) for result in results),
            stale_tokens=sum(group.stale_tokens for group in trained),
            carried_groups=schedule.carried(),
            drafting_paused=parts.service.drafting_paused,
            draft_head=parts.service.head_record,
        )
        self.run_dir.append_step(record)
        self._latest_weights = weights
        return record

    def _train(self, samples: list[TrainSample], step: int):
        """The trainer's step on ``samples``: (metrics, new weights, seconds, what the ranks drafted meanwhile or
        None). Ranks idle while it trains (not under ``schedule.kind: async``, where they generate the next step)
        draft on (draft_during_training). A step whose every group was carried trains nothing."""
        parts = self.parts
        if not samples:
            return {"skipped": 1, "trained_tokens": 0}, self._versions.get(step) or parts.trainer.weights(), 0.0, None
        overlapped = self.schedule.timeline.max_staleness > 0
        if not overlapped:
            parts.service.training_starts()
        self.on_phase(step, "train")
        try:
            train_metrics, weights, train_seconds = parts.trainer.train(samples, step)
        except BaseException:
            if not overlapped:
                parts.service.training_ended(0.0)  # the ranks stop drafting (and resume) before the run rewinds
            raise
        training = None if overlapped else parts.service.training_ended(train_seconds)
        return train_metrics, weights, train_seconds, training

    def _rollout_policy(self, version: int) -> None:
        """Puts policy ``version`` on the ranks for the rollout, where the schedule generates with an older policy
        than the latest (async): the simulated generator kept it, so this load is not timed."""
        if version != self._engine_version:
            self.parts.service.update_weights(self._versions[version], version=version)
            self._engine_version = version

    def _keep_version(self, version: int, weights: dict) -> None:
        """Keeps the policies an async schedule may still generate with (copies: the trainer updates in place)."""
        lag = self.schedule.timeline.max_staleness
        if not lag:
            return
        self._versions[version] = {name: tensor.detach().clone() for name, tensor in weights.items()}
        for old in [v for v in self._versions if v < version - lag]:
            del self._versions[old]

    def _evaluate(self) -> tuple[float, dict[str, float]]:
        """Mean reward of the current weights (after this step's update) on the held-out prompts, and each named
        reward's mean where the task's reward has parts."""
        parts, cfg = self.parts, self.config
        held_out = parts.eval_task.batch(0)[: cfg.eval_prompts]
        requests = parts.service.requests(-1, held_out, 1)  # step -1: keys no rollout uses
        by_key = {r.key: r for r in parts.service.evaluate(requests)}
        rewards, named = parts.task.score_parts(held_out, [by_key[r.key].token_ids for r in requests])
        means = {name: sum(scores) / len(requests) for name, scores in named.items()} if len(named) > 1 else {}
        return sum(float(r) for r in rewards) / len(requests), means

    def _rewards(
        self, prompts: list[Prompt], results: list[GenerationResult]
    ) -> tuple[list[float], dict[str, list[float]]]:
        """The step's rewards in request order and, for a reward made of named ones, each one's scores."""
        by_uid = {p.uid: p for p in prompts}
        rewards, parts = self.parts.task.score_parts(
            [by_uid[r.key.prompt_uid] for r in results], [r.token_ids for r in results]
        )
        return [float(r) for r in rewards], parts

    def _logged_samples(self, step, prompts, results, rewards, reward_parts, samples) -> list[PromptSamples]:
        """The first ``logged_prompts`` prompts of the step with every response, its rewards and its advantage
        (as the learner computes it from the shaped rewards, before any group filter)."""
        cfg = self.config
        if not cfg.logged_prompts:
            return []
        loss = cfg.trainer.loss
        advantages = compute_advantages(
            shaped_rewards(samples, cfg.trainer), [s.group for s in samples], loss.advantage, loss.scale_rewards
        )
        per_prompt = cfg.task.samples_per_prompt
        logged = []
        for index, prompt in enumerate(prompts[: cfg.logged_prompts]):
            rows = range(index * per_prompt, (index + 1) * per_prompt)
            logged.append(PromptSamples(
                step=step, prompt_uid=prompt.uid, prompt=prompt.text, answer=prompt.answer,
                responses=[SampledResponse(
                    sample=results[i].key.sample_index, text=self.parts.task.decode(results[i].token_ids),
                    tokens=len(results[i].token_ids), finish_reason=results[i].finish_reason, reward=rewards[i],
                    rewards={name: scores[i] for name, scores in reward_parts.items()}, advantage=advantages[i],
                ) for i in rows],
            ))  # fmt: skip
        return logged

    def _reward_failures(self, step: int) -> dict[str, int]:
        """The step's reward calls that timed out or raised (each scored 0), as the record's fields."""
        failures = self.parts.task.take_reward_failures()
        if failures.timeouts or failures.errors:
            logger.warning(
                "step %d: %d of %d reward calls timed out and %d raised, each scored 0; the first: %s",
                step, failures.timeouts, failures.calls, failures.errors, failures.first_error,
            )  # fmt: skip
        return {
            "reward_timeouts": failures.timeouts, "reward_errors": failures.errors, "reward_calls": failures.calls
        }  # fmt: skip

    def _checkpoint(self, step: int) -> None:
        trainer_state = dict(self.parts.trainer.checkpoint_state())
        master_weights = trainer_state.pop("master_weights", None)
        drafting = self.parts.service.snapshot()
        self.run_dir.save_checkpoint(
            step,
            weights=self._latest_weights if master_weights is None else master_weights,
            trainer_state=trainer_state,
            drafts=self.parts.service.pending_drafts(step),
            state={
                "num_steps": self.config.num_steps,
                "time": time.time(),
                "response_lengths": drafting["response_lengths"],
                "speculation_gate": drafting["gate"],
                "head_gate": drafting["head_gate"],
            },  # fmt: skip
            history=drafting["history"],
            draft_head=self.parts.service.draft_head_state(),
        )


def sample_lines(logged: PromptSamples, width: int = 300) -> str:
    """What the model wrote for one prompt of a step, for the console: the prompt (its middle cut when long), the
    response with the best reward and, where the rewards differ, the one with the worst; each with its reward."""
    by_reward = sorted(logged.responses, key=lambda response: -response.reward)
    shown = by_reward[:1] + (by_reward[-1:] if by_reward[0].reward != by_reward[-1].reward else [])
    rewards = [response.reward for response in logged.responses]
    lines = [
        f"sample of step {logged.step}: {len(rewards)} responses, reward min {min(rewards):.3f} mean "
        f"{sum(rewards) / len(rewards):.3f} max {max(rewards):.3f}; reference answer {logged.answer!r}",
        f"  prompt   {_shown(logged.prompt, width)}",
    ]
    for label, response in zip(("best", "worst"), shown, strict=False):
        cut = " (cut at the token limit)" if response.finish_reason == "length" else ""
        lines.append(f"  {label:<8} {_shown(response.text, width)}  reward {response.reward:.3f}{cut}")
    return "\n".join(lines)


def _shown(text: str, width: int) -> str:
    """``text`` on one line (its line breaks as ⏎), its middle cut to fit ``width``."""
    text = text.replace("\n", "⏎")
    if len(text) > width:
        text = f"{text[: width // 2]} … {text[-(width // 2) :]}"
    return repr(text)


def step_line(record: StepRecord, num_steps: int | None = None, seconds_left: float | None = None) -> str:
    """One structured log line per step: ``key=value`` pairs (logfmt), the headline numbers of the record; with
    ``num_steps``, the steps done of the run's and the (wall) time left at the pace so far."""
    phases = record.phase_seconds
    fields: dict[str, object] = {"step": record.step}
    if num_steps is not None:
        fields["done"] = f"{record.step + 1}/{num_steps}"
    if seconds_left is not None:
        fields["left"] = _duration(seconds_left)
    fields["reward"] = f"{record.reward_mean:.4f}"
    if len(record.reward_means) > 1:
        fields |= {f"reward.{name}": f"{mean:.4f}" for name, mean in record.reward_means.items()}
    failed = record.reward_timeouts + record.reward_errors
    if failed:
        fields["reward_failed"] = f"{failed}/{record.reward_calls}"
    fields |= {
        "tokens": record.generated_tokens,
        "decode_steps": record.decode_steps,
        "steps_saved": f"{1 - record.decode_steps / record.generated_tokens:.1%}" if record.generated_tokens else "-",
        "acceptance": f"{acceptance_length(record.draft_tokens_accepted, record.verify_steps):.2f}",
        "coverage": f"{record.draft_coverage:.2f}",
        "bubble_use": f"{record.bubble_utilization:.2f}",
        "rollout_s": f"{phases.rollout:.3f}",
    }
    if record.rollout_seconds_saved is not None:
        fields["rollout_saved_s"] = f"{record.rollout_seconds_saved:+.3f}"
        fields["barrier_wait_s"] = f"{record.barrier_wait_seconds:.3f}"  # part of rollout_saved_s
    fields |= {"train_s": f"{phases.train:.3f}", "sync_s": f"{phases.weight_sync:.3f}"}
    if record.drafting_paused:
        fields["drafting"] = "paused"  # speculation.enabled: auto found that drafting did not pay
    if record.policy_lag:
        fields["policy_lag"] = record.policy_lag
    if record.stale_tokens:
        fields["stale_tokens"] = record.stale_tokens
    if record.carried_groups:
        fields["carried_groups"] = record.carried_groups
    if not record.trained:
        carried = record.carried_groups and not record.num_samples
        fields["trained"] = "no:every_group_carried" if carried else "no:equal_rewards_in_every_group"
    if "logprob_diff_mean" in record.train:
        fields["logprob_diff"] = f"{record.train['logprob_diff_mean']:.2e}"
    if record.eval_reward is not None:
        fields["eval_reward"] = f"{record.eval_reward:.4f}"
        fields |= {f"eval_reward.{name}": f"{mean:.4f}" for name, mean in record.eval_reward_means.items()}
    return " ".join(f"{key}={value}" for key, value in fields.items())


def finished_at(steps: Sequence[StepRecord]) -> float:
    """When the last of ``steps`` ended on the run's clock (the sum of their phases for records that do not say)."""
    if not steps:
        return 0.0
    if steps[-1].finished_at_seconds is not None:
        return steps[-1].finished_at_seconds
    return sum(s.phase_seconds.total for s in steps)


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def _step_record(
    step: int,
    outcome: RolloutOutcome,
    training: TrainingDrafting | None,
    rewards: list[float],
    train_metrics: dict,
    phases: PhaseSeconds,
    **more,
) -> StepRecord:
    """The step's record: the ranks' records summed, with what they drafted while the trainer trained
    (``training``) and ``more`` of :class:`StepRecord`'s fields."""
    ranks = outcome.ranks
    drafts_made = len(outcome.drafts)
    if training is not None:
        drafts_made += training.drafts_made
        ranks = [
            replace(
                rank,
                drafting_seconds_while_training=seconds,
                draft_tokens_produced_while_training=tokens,
                branch_tokens_produced=rank.branch_tokens_produced + branch_tokens,
            )
            for rank, seconds, tokens, branch_tokens in zip(
                ranks,
                training.drafting_seconds,
                training.draft_tokens_produced,
                training.branch_tokens_produced,
                strict=True,
            )
        ]
        more["training_timelines"] = training.timelines
    generated = sum(r.shard_tokens for r in ranks)
    requests = sum(r.num_requests for r in ranks)
    bubble = sum(r.bubble_seconds for r in ranks)
    return StepRecord(
        step=step,
        reward_mean=sum(rewards) / max(len(rewards), 1),
        num_samples=len(rewards),
        generated_tokens=generated,
        decode_steps=sum(r.decode_steps for r in ranks),
        verify_steps=sum(r.verify_steps for r in ranks),
        forward_passes_max_rank=max(r.forward_passes for r in ranks),
        draft_tokens_proposed=sum(r.draft_tokens_proposed for r in ranks),
        draft_tokens_accepted=sum(r.draft_tokens_accepted for r in ranks),
        draft_coverage=sum(r.requests_with_draft for r in ranks) / max(requests, 1),
        proposal_coverage=sum(r.requests_with_proposals for r in ranks) / max(requests, 1),
        bubble_seconds=bubble,
        bubble_utilization=bubble_use(ranks),
        rollout_seconds_saved=outcome.seconds_saved,
        drafts_made=drafts_made,
        rollout_tokens_per_second=generated / outcome.seconds if outcome.seconds > 0 else 0.0,
        phase_seconds=phases,
        barrier_seconds=outcome.barrier_seconds,
        barrier_wait_seconds=outcome.drafting_wait_seconds,
        train=train_metrics,
        rewards_checksum=sum(r * (i + 1) for i, r in enumerate(rewards)),
        ranks=ranks,
        timelines=outcome.timelines,
        **more,
    )
