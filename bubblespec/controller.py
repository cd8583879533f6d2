"""The synchronous RL loop with bubble-time drafting (DESIGN.md §5).

    for step t:
        requests of B_t (+ drafts from the store) --shard--> ranks generate with pi_t, verifying drafts
        idle ranks draft the keys of B_t+1 (bubble policy order) with pi_t until the barrier
        train on the samples of step t (never on drafts) --> pi_t+1 --> weights to every rank

The controller is the same for every clock and cluster: rank pools and trainers are passed in.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from bubblespec.backends.torch_model import DTYPES
from bubblespec.config import RunConfig
from bubblespec.draft_sources import HistoryDrafts
from bubblespec.errors import TrainerRestarted
from bubblespec.interfaces import (
    BubblePolicy,
    Draft,
    DraftStore,
    GenerationResult,
    Prompt,
    SamplingParams,
    acceptance_length,
)
from bubblespec.predictions import ResponseLengths, predicted_lengths
from bubblespec.rollout import DraftPlan, RolloutOutcome, attach_drafts, step_requests
from bubblespec.run_dir import RunDirectory
from bubblespec.trainer import TrainSample

logger = logging.getLogger(__name__)


def score_responses(task, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]) -> list[float]:
    """The task's rewards of responses to prompts: its batched ``score`` where it has one, else one call each."""
    score = getattr(task, "score", None)
    if score is not None:
        return [float(reward) for reward in score(prompts, responses)]
    return [float(task(prompt, response)) for prompt, response in zip(prompts, responses, strict=True)]


class RankPool(Protocol):
    num_ranks: int

    def rollout(self, shards, plan: DraftPlan) -> RolloutOutcome: ...

    def update_weights(self, state_dict, version: int) -> float:
        """Sends weights to every rank; returns the seconds it took (virtual or wall)."""
        ...

    def start_drafting(self, plan: DraftPlan) -> None:
        """Ranks draft the rest of ``plan`` while the trainer runs (ranks and trainer on separate hardware)."""
        ...

    def stop_drafting(self, train_seconds: float) -> RolloutOutcome:
        """Stops that drafting (the virtual clock budgets it by ``train_seconds``); returns the drafts made, with
        per-rank records and timelines (seconds from the start of training) and no results."""
        ...

    def evaluate(self, requests) -> list[GenerationResult]:
        """Generates held-out requests with the current weights (no drafts, not timed)."""
        ...


class Trainer(Protocol):
    def train(self, samples: list[TrainSample]) -> tuple[dict, dict, float]:
        """One optimizer step: (metrics, new weights, seconds it took)."""
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


@dataclass
class Components:
    """What the controller drives; built by :mod:`bubblespec.launch` for the configured clock and cluster."""

    task: object  # PromptSource + RewardFn
    ranks: RankPool
    trainer: Trainer
    store: DraftStore
    bubble_policy: BubblePolicy
    sharding_policy: object
    sampling: SamplingParams
    eval_task: object = None  # the task with a held-out seed, for RunConfig.eval_every
    history: HistoryDrafts | None = None  # the history draft source, when speculation.draft_sources names it


class Controller:
    def __init__(
        self,
        config: RunConfig,
        parts: Components,
        run_dir: RunDirectory,
        on_step: Callable[[dict], None] | None = None,
        on_phase: Callable[[int, str], None] | None = None,
    ) -> None:
        self.config = config
        self.parts = parts
        self.run_dir = run_dir
        self.on_step = on_step or (lambda record: None)
        self.on_phase = on_phase or (lambda step, phase: None)
        self._warned_unpeekable = False
        self._evicted = 0  # drafts the store had evicted by the end of the last step
        self.response_lengths = ResponseLengths()
        """Each prompt's last mean response length: the bubble policy's predictions for keys without a draft."""

    def run(self, start_step: int = 0) -> None:
        """Runs steps ``start_step`` to the end. When the trainer's workers restart after a fault, the run rewinds
        to its last checkpoint and replays the steps since: keyed sampling makes them come out the same."""
        step = start_step
        while step < self.config.num_steps:
            try:
                record = self.step(step)
                if (step + 1) % self.config.checkpoint_every == 0 or step == self.config.num_steps - 1:
                    self._checkpoint(step)
            except TrainerRestarted as restart:
                failed, step = step, self.restore(fresh_parts=False)
                logger.warning(
                    "%s in step %d: the run rewinds to its last checkpoint and replays from step %d",
                    restart,
                    failed,
                    step,
                )
                continue
            logger.info(step_line(record))
            self.on_step(record)
            step += 1

    def restore(self, fresh_parts: bool = True) -> int:
        """Loads the latest checkpoint (weights, trainer state, pending drafts) into the parts, forgets the step
        records after it and returns the step to continue from. Without a checkpoint the run starts over: parts
        built for this run already hold the initial model (``fresh_parts``); otherwise the trainer is reset and
        the ranks get its initial weights."""
        parts, run_dir = self.parts, self.run_dir
        checkpoint = run_dir.latest_checkpoint()
        if checkpoint is None:
            if not fresh_parts:
                parts.ranks.update_weights(parts.trainer.reset(), version=0)
                if parts.history is not None:
                    parts.history.restore([])
            self.response_lengths.restore([])
            run_dir.truncate_steps(-1)
            return 0
        weights, trainer_state, drafts, state = run_dir.load_checkpoint(checkpoint)
        step = int(state["step"])
        parts.trainer.load_checkpoint_state(trainer_state | {"weights": weights})
        # The checkpoint may hold float32 master weights; engines get them rounded to the run's dtype, as the
        # trainer sends them.
        dtype = DTYPES[self.config.model.dtype]
        parts.ranks.update_weights({name: t.to(dtype) for name, t in weights.items()}, version=step + 1)
        self.response_lengths.restore(state.get("response_lengths", []))
        parts.store.drop_steps_before(2**62)  # a rewind forgets drafts made after the checkpoint
        parts.store.put(drafts)
        if parts.history is not None:
            parts.history.restore(run_dir.load_history(checkpoint))
        run_dir.truncate_steps(step)
        return step + 1

    def step(self, step: int) -> dict:
        cfg, parts = self.config, self.parts
        initial_eval = self._evaluate() if cfg.eval_every and step == 0 else None  # the policy before training
        prompts = parts.task.batch(step)
        requests = step_requests(prompts, cfg.seed, step, cfg.task.samples_per_prompt, parts.sampling)
        speculate = cfg.speculation.uses_bubble
        drafts = self._static_drafts([r.key for r in requests])
        requests = attach_drafts(requests, drafts)
        predicted = {key: len(draft.token_ids) for key, draft in drafts.items()}
        shards = parts.sharding_policy.shard(requests, parts.ranks.num_ranks, predicted)
        plan = self._plan(step) if speculate else DraftPlan([])

        self.on_phase(step, "rollout")
        outcome = parts.ranks.rollout(shards, plan)
        if speculate:
            self._store(outcome.drafts)
            parts.store.drop_steps_before(step + 1)  # this step's drafts are used up
            plan.requeue(outcome.drafts)  # drafts the barrier cut off go on while the trainer runs

        by_key = {result.key: result for result in outcome.results}
        results = [by_key[r.key] for r in requests]  # request order, whatever the sharding
        if parts.history is not None:
            parts.history.observe(results)
        self.response_lengths.observe(results)
        rewards = self._rewards(prompts, results)
        samples = [
            TrainSample(
                tuple(req.prompt_token_ids),
                tuple(res.token_ids),
                i // cfg.task.samples_per_prompt,
                reward,
                engine_logprobs=tuple(res.logprobs),
                truncated=res.finish_reason == "length",
                max_response_tokens=req.sampling.max_new_tokens,
            )
            for i, (req, res, reward) in enumerate(zip(requests, results, rewards, strict=True))
        ]
        drafting_while_training = speculate and cfg.speculation.draft_during_training and bool(plan)
        if drafting_while_training:
            parts.ranks.start_drafting(plan)
        self.on_phase(step, "train")
        try:
            train_metrics, weights, train_seconds = parts.trainer.train(samples)
        except TrainerRestarted:
            if drafting_while_training:
                parts.ranks.stop_drafting(0.0)  # the ranks stop before the run rewinds
            raise
        if drafting_while_training:
            training = parts.ranks.stop_drafting(train_seconds)
            self._store(training.drafts)
            outcome.drafts += training.drafts
        self.on_phase(step, "weight sync")
        sync_seconds = parts.ranks.update_weights(weights, version=step + 1)
        record = _step_record(step, outcome, rewards, train_metrics, train_seconds, sync_seconds)
        record |= self._reward_failures(step)
        if drafting_while_training:
            for rank_record, drafted in zip(record["ranks"], training.ranks, strict=True):
                rank_record["drafting_seconds_while_training"] = drafted.drafting_seconds
                rank_record["draft_tokens_produced_while_training"] = drafted.draft_tokens_produced
            record["training_timelines"] = training.timelines
        record["rollout_digest"] = rollout_digest(results)
        store = parts.store.stats() if hasattr(parts.store, "stats") else {}
        if store:
            record["draft_store"] = store
            record["drafts_evicted"] = store["evicted"] - self._evicted
            self._evicted = store["evicted"]
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step == cfg.num_steps - 1 or step == 0):
            record["eval_reward"] = self._evaluate()
        if initial_eval is not None:
            record["eval_reward_before_training"] = initial_eval
        self.run_dir.append_step(record)
        self._latest_weights = weights
        return record

    def _static_drafts(self, keys: list) -> dict:
        """Each key's draft from the first static source (``speculation.draft_sources`` order) that has one."""
        speculation, parts = self.config.speculation, self.parts
        drafts: dict = {}
        if not speculation.enabled:
            return drafts
        for name in speculation.draft_sources:
            if name == "bubble":
                found = parts.store.get(keys)
            elif name == "history" and parts.history is not None:
                found = parts.history.drafts(keys)
            else:
                continue
            drafts = found | drafts  # earlier sources win
        return drafts

    def _plan(self, step: int) -> DraftPlan:
        """The keys to draft during step ``step``: those of the next ``speculation.lookahead_steps`` steps,
        the nearest step first. Within a step, keys without a draft or with an unfinished one come first (in
        bubble-policy order) and go on from their draft; then finished drafts of an older policy, to be
        re-verified and refreshed by the current one."""
        cfg, parts = self.config, self.parts
        ordered = []
        for future_step in range(step + 1, step + 1 + cfg.speculation.lookahead_steps):
            requests = self._future_requests(future_step)
            stored = parts.store.get([r.key for r in requests])
            predicted = predicted_lengths([r.key for r in requests], stored, self.response_lengths)
            by_key = {r.key: r for r in attach_drafts(requests, stored)}
            in_order = [by_key[k] for k in parts.bubble_policy.order(list(by_key), predicted)]
            ordered += [r for r in in_order if r.draft is None or not r.draft.finished]
            ordered += [r for r in in_order if r.draft is not None and r.draft.finished]
        return DraftPlan(ordered, parts.ranks.num_ranks, cfg.rollout.max_batch_size)

    def _store(self, drafts: list[Draft]) -> None:
        """Stores new drafts, except an unfinished one shorter than the draft it would replace: stopped while
        re-verifying an older draft, it would throw away that draft's tail."""
        stored = self.parts.store.get([d.key for d in drafts])
        self.parts.store.put(
            [d for d in drafts if d.finished or d.key not in stored or len(d.token_ids) >= len(stored[d.key].token_ids)]
        )

    def _future_requests(self, future_step: int) -> list:
        """The requests of a later step, or none if the run ends first or the task cannot say its prompts."""
        cfg, parts = self.config, self.parts
        if future_step >= cfg.num_steps:
            return []
        prompts = parts.task.peek(future_step)
        if prompts is None:
            if not self._warned_unpeekable:
                logger.warning(
                    "task %r cannot say the prompts of step %d in advance (peek returned None): the bubble "
                    "stays idle and steps run without drafts",
                    cfg.task.name,
                    future_step,
                )
                self._warned_unpeekable = True
            return []
        return step_requests(prompts, cfg.seed, future_step, cfg.task.samples_per_prompt, parts.sampling)

    def _evaluate(self) -> float:
        """Mean reward of the current weights (after this step's update) on the held-out prompts."""
        parts, cfg = self.parts, self.config
        held_out = parts.eval_task.batch(0)[: cfg.eval_prompts]
        requests = step_requests(held_out, cfg.seed, -1, 1, parts.sampling)  # step -1: keys no rollout uses
        by_key = {r.key: r for r in parts.ranks.evaluate(requests)}
        rewards = score_responses(parts.task, held_out, [by_key[r.key].token_ids for r in requests])
        return sum(rewards) / len(requests)

    def _rewards(self, prompts: list[Prompt], results: list[GenerationResult]) -> list[float]:
        by_uid = {p.uid: p for p in prompts}
        return score_responses(
            self.parts.task, [by_uid[r.key.prompt_uid] for r in results], [r.token_ids for r in results]
        )

    def _reward_failures(self, step: int) -> dict:
        """The step's reward calls that timed out or raised (scored 0), for tasks that run rewards in a pool."""
        take = getattr(self.parts.task, "take_reward_failures", None)
        if take is None:
            return {}
        failures = take()
        if failures.timeouts or failures.errors:
            logger.warning(
                "step %d: %d reward calls timed out and %d raised, each scored 0; the first: %s",
                step, failures.timeouts, failures.errors, failures.first_error,
            )  # fmt: skip
        return {"reward_timeouts": failures.timeouts, "reward_errors": failures.errors}

    def _checkpoint(self, step: int) -> None:
        store = self.parts.store
        future_keys = [
            r.key
            for future_step in range(step + 1, step + 1 + self.config.speculation.lookahead_steps)
            for r in self._future_requests(future_step)
        ]
        pending = list(store.get(future_keys).values()) if self.config.speculation.uses_bubble else []
        trainer_state = dict(self.parts.trainer.checkpoint_state())
        master_weights = trainer_state.pop("master_weights", None)
        self.run_dir.save_checkpoint(
            step,
            weights=self._latest_weights if master_weights is None else master_weights,
            trainer_state=trainer_state,
            drafts=pending,
            state={
                "num_steps": self.config.num_steps,
                "time": time.time(),
                "response_lengths": self.response_lengths.snapshot(),
            },
            history=None if self.parts.history is None else self.parts.history.snapshot(),
        )


def step_line(record: dict) -> str:
    """One structured log line per step: ``key=value`` pairs (logfmt), the headline numbers of the record."""
    phases = record["phase_seconds"]
    fields = {
        "step": record["step"],
        "reward": f"{record['reward_mean']:.4f}",
        "tokens": record["generated_tokens"],
        "decode_steps": record["decode_steps"],
        "acceptance": f"{acceptance_length(record['draft_tokens_accepted'], record['verify_steps']):.2f}",
        "coverage": f"{record['draft_coverage']:.2f}",
        "bubble_use": f"{record['bubble_utilization']:.2f}",
        "rollout_s": f"{phases['rollout']:.3f}",
        "train_s": f"{phases['train']:.3f}",
        "sync_s": f"{phases['weight_sync']:.3f}",
    }
    if "logprob_diff_mean" in record["train"]:
        fields["logprob_diff"] = f"{record['train']['logprob_diff_mean']:.2e}"
    if "eval_reward" in record:
        fields["eval_reward"] = f"{record['eval_reward']:.4f}"
    return " ".join(f"{key}={value}" for key, value in fields.items())


def rollout_digest(results: list[GenerationResult]) -> str:
    """A fingerprint of a step's rollouts (keys and tokens, in request order): equal digests, equal rollouts."""
    digest = hashlib.sha256()
    for result in results:
        key = result.key
        digest.update(f"{key.run_seed}/{key.step}/{key.prompt_uid}/{key.sample_index}:".encode())
        digest.update(",".join(map(str, result.token_ids)).encode() + b";")
    return digest.hexdigest()


def _step_record(step, outcome: RolloutOutcome, rewards, train_metrics, train_seconds, sync_seconds) -> dict:
    ranks = [r.as_dict() for r in outcome.ranks]
    generated = sum(r["shard_tokens"] for r in ranks)
    bubble = sum(r["bubble_seconds"] for r in ranks)
    return {
        "step": step,
        "reward_mean": sum(rewards) / max(len(rewards), 1),
        "num_samples": len(rewards),
        "generated_tokens": generated,
        "decode_steps": sum(r["decode_steps"] for r in ranks),
        "verify_steps": sum(r["verify_steps"] for r in ranks),
        "forward_passes_max_rank": max(r["forward_passes"] for r in ranks),
        "draft_tokens_proposed": sum(r["draft_tokens_proposed"] for r in ranks),
        "draft_tokens_accepted": sum(r["draft_tokens_accepted"] for r in ranks),
        "draft_coverage": sum(r["requests_with_draft"] for r in ranks) / max(len(rewards), 1),
        "proposal_coverage": sum(r["requests_with_proposals"] for r in ranks) / max(len(rewards), 1),
        "bubble_seconds": bubble,
        "bubble_utilization": sum(r["drafting_seconds"] for r in ranks) / bubble if bubble > 0 else 0.0,
        "drafts_made": len(outcome.drafts),
        "rollout_tokens_per_second": generated / outcome.seconds if outcome.seconds > 0 else 0.0,
        "phase_seconds": {"rollout": outcome.seconds, "train": train_seconds, "weight_sync": sync_seconds},
        "barrier_seconds": outcome.barrier_seconds,
        "train": train_metrics,
        "rewards_checksum": sum(r * (i + 1) for i, r in enumerate(rewards)),
        "ranks": ranks,
        "timelines": outcome.timelines,
    }
