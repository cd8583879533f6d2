"""The rollout service (docs/design.md §11): generation with bubble-time drafting for any synchronous trainer.

    service.generate(step, prompts, samples_per_prompt)   the step's responses, sharded over the ranks; while the
                                                           slow ranks finish, idle ranks draft the prompts of the
                                                           next steps (``peek``) with the policy they hold
    service.training_starts() / training_ended(seconds)    around the trainer's step: ranks on hardware of their
                                                           own draft on (draft_during_training); colocated ranks
                                                           release their memory to the trainer and resume after
    service.update_weights(state_dict, version)            the new policy to every rank
    service.evaluate(requests)                             held-out generation, no drafts
    service.close()

The service owns the ranks, the draft store, the drafting plan and what drafting learns across steps (response
lengths, the history draft source); the caller owns prompts, rewards and training. bubblespec's own RL loop
(:mod:`bubblespec.rl.loop`) and the TRL integration (:mod:`bubblespec.integrations.trl`) both go through it.

Every response is a pure function of its rollout key (run seed, step, prompt uid, sample index) and the policy
version: where and whether a draft was used changes only the time it took (invariant 2).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence

from bubblespec.core.config import RolloutConfig, SpeculationConfig
from bubblespec.core.draft_sources import BubbleDrafts, HistoryDrafts, StaticDraftSource, source_class
from bubblespec.core.errors import ConfigError
from bubblespec.core.interfaces import (
    BubblePolicy,
    BubblePolicyBase,
    Draft,
    DraftStore,
    DraftStoreBase,
    GenerationRequest,
    GenerationResult,
    Prompt,
    SamplingParams,
    ShardingPolicyBase,
    TriesPolicyBase,
)
from bubblespec.models.draft_head import HeadLearning, Sample
from bubblespec.rollout.bubble_scheduler import RankPool
from bubblespec.rollout.predictions import ResponseLengths, predicted_lengths
from bubblespec.rollout.speculation_gate import HeadGate, SpeculationGate, head_saving
from bubblespec.rollout.step import (
    DraftPlan,
    HeadLearningRecord,
    RolloutOutcome,
    TrainingDrafting,
    attach_drafts,
    step_requests,
)
from bubblespec.rollout.tries_plan import TriesPlan

logger = logging.getLogger(__name__)


Peek = Callable[[int], Sequence[Prompt] | None]
"""The prompts of a later step (``peek(step)``), or None when they cannot be known in advance; [] past the end."""


class RolloutService:
    """Rollout ranks plus everything bubble drafting needs, behind generate / update_weights.

    ``ranks`` is a rank pool (:class:`bubblespec.rollout.virtual_ranks.VirtualRankPool` on the virtual clock,
    :class:`bubblespec.rollout.serve_ranks.ServeRankPool` on Ray Serve); ``peek`` says which prompts later steps will
    ask for, with ``samples_per_prompt`` samples each (a step's own count is given to :meth:`generate`).
    """

    def __init__(
        self,
        ranks: RankPool,
        store: DraftStore,
        bubble_policy: BubblePolicy,
        sharding_policy: ShardingPolicyBase,
        sampling: SamplingParams,
        speculation: SpeculationConfig,
        seed: int,
        max_batch_size: int,
        peek: Peek | None = None,
        samples_per_prompt: int = 1,
        static_sources: Sequence[tuple[str, StaticDraftSource]] = (),
        colocated: bool = False,
        draft_during_training: int | bool = 0,
        tries_policy: TriesPolicyBase | None = None,
    ) -> None:
        self.ranks = ranks
        self.store = store
        self.bubble_policy = bubble_policy
        self.sharding_policy = sharding_policy
        self.sampling = sampling
        self.speculation = speculation
        self.seed = seed
        self.max_batch_size = max_batch_size
        self.peek = peek or (lambda step: None)
        self.samples_per_prompt = samples_per_prompt
        self.static_sources = list(static_sources)
        """The static draft sources in priority order, by name; the first with a key's draft gives it."""
        self.history = next((s for _, s in self.static_sources if isinstance(s, HistoryDrafts)), None)
        """The ``history`` source, whose memory checkpoints keep."""
        self.colocated = colocated
        """Ranks share the trainer's hardware: they release their memory while it trains."""
        self.draft_during_training = ranks.num_ranks if draft_during_training is True else int(draft_during_training)
        """How many ranks (the first ones) draft while the trainer trains: every rank on hardware of its own, or
        the number ``speculation.draft_during_training`` names (:meth:`ServiceConfig.training_drafting` decides
        it); 0: none."""
        self.tries_policy = tries_policy
        """Which near-ties get branches first (``speculation.tries_policy``; loaded when first needed if None)."""
        self.response_lengths = ResponseLengths()
        """Each prompt's last mean response length: the bubble policy's predictions for keys without a draft."""
        self._plan, self._late_chunks = DraftPlan([]), 0
        self._warned_unpeekable = False
        self._drafting = self._released = False
        self._outcome: RolloutOutcome | None = None
        self._outcome_step = 0
        self._judged = True
        """The last rollout's outcome and step: a wait for its late drafting passes is recorded on it, and the gate
        judges its drafts once it is complete."""
        self.gate = SpeculationGate(auto=speculation.enabled == "auto")
        """Whether idle ranks draft in the coming bubble (``speculation.enabled: auto`` pauses drafting that does
        not pay)."""
        self.drafting_paused = False
        """Whether the gate kept the last rollout's idle ranks from drafting."""
        self._since_phase_end = 0.0
        """Seconds since the ranks' last phase ended (the trainer's, while ranks did not draft): how long late
        drafting passes have had to finish on the virtual clock."""
        self.head_learning = head_learning(speculation, ranks)
        """How the draft head learns online (``speculation.draft_head``); None: no head."""
        self.head_record: HeadLearningRecord | None = None
        """The draft head's last round of learning (the last step's), for the step record."""
        self._head_samples: list[Sample] = []
        self._head_learning = False
        """Whether the ranks learn the head while the trainer trains (:meth:`training_starts` started a round)."""
        self._head_wait = 0.0
        self.head_gate = HeadGate(auto=speculation.draft_head.enabled == "auto")
        """Whether the head learns after a rollout and drafts in the next (``draft_head.enabled: auto`` pauses a head
        that does not pay)."""
        self._head_active = False
        """Whether the head drafts in the next rollout (a round of learning installed it, no pause since)."""
        self._head_round_cost = 0.0
        """What the head's last round of learning cost its step (the wait for it and its sync), judged with the
        rollout after it."""
        self._rollout_head: tuple[bool, float] = (False, 0.0)
        """For the last rollout: whether the head drafted in it, and what the round before it cost."""
        self._last_train_seconds: float | None = None
        """The last training phase's seconds: the head's learning budget (None before the first)."""

    @classmethod
    def build(
        cls,
        ranks: RankPool,
        vocab_size: int,
        speculation: SpeculationConfig,
        rollout: RolloutConfig,
        sampling: SamplingParams,
        seed: int,
        samples_per_prompt: int,
        peek: Peek | None,
        colocated: bool = False,
        draft_during_training: int | bool = 0,
    ) -> RolloutService:
        """A service on ``ranks`` with the draft store, policies and draft sources ``speculation`` names;
        ``colocated``: the ranks share the trainer's hardware (``ray.colocated``); ``draft_during_training``: how many
        of them draft while it trains (True: all; :meth:`ServiceConfig.training_drafting`)."""
        from bubblespec.core import plugins
        from bubblespec.rollout.draft_store import TolerantDraftStore

        store_class = plugins.load_subclass("draft_stores", speculation.draft_store, DraftStoreBase)
        try:
            store = store_class(vocab_size=vocab_size, max_tokens=speculation.draft_store_max_tokens,
                                **speculation.draft_store_options)  # fmt: skip
        except TypeError as error:
            raise ConfigError(
                f"speculation.draft_store_options {speculation.draft_store_options} do not suit the "
                f"{speculation.draft_store!r} draft store: {error}"
            ) from None
        store = TolerantDraftStore(store)
        return cls(
            ranks,
            store,
            plugins.load_subclass("policies", speculation.bubble_policy, BubblePolicyBase)(),
            plugins.load_subclass("policies", speculation.sharding_policy, ShardingPolicyBase)(),
            sampling,
            speculation,
            seed,
            rollout.max_batch_size,
            peek,
            samples_per_prompt,
            static_sources(speculation, store),
            colocated,
            draft_during_training,
            plugins.load_subclass("policies", speculation.tries_policy, TriesPolicyBase)(),
        )

    @property
    def num_ranks(self) -> int:
        return self.ranks.num_ranks

    def requests(self, step: int, prompts: Sequence[Prompt], samples_per_prompt: int) -> list[GenerationRequest]:
        """The step's requests in order (prompt by prompt, sample by sample), keyed by this service's seed."""
        return step_requests(prompts, self.seed, step, samples_per_prompt, self.sampling)

    def generate(self, step: int, prompts: Sequence[Prompt], samples_per_prompt: int) -> RolloutOutcome:
        """The responses of step ``step`` (``outcome.results`` in request order) and what each rank did. Drafts
        of earlier bubbles are verified; idle ranks draft the next steps' keys."""
        return self.generate_requests(step, self.requests(step, prompts, samples_per_prompt))

    def generate_requests(self, step: int, requests: Sequence[GenerationRequest]) -> RolloutOutcome:
        """:meth:`generate` of explicit requests: a schedule's (:mod:`bubblespec.rl.rollout_schedules`) mix of step
        ``step``'s own requests and earlier steps' carried ones. A request that brings its own draft keeps it; the
        others get the static sources' drafts. Idle ranks draft the keys of the steps after ``step``."""
        waited = self._settle()  # late drafts not collected by a weight sync (no update since the last step)
        self._judge()
        self._rollout_head, self._head_round_cost = (self._head_active, self._head_round_cost), 0.0
        if self.head_learning is not None:  # the learning rank's own responses need no pass again
            self.ranks.keep_hidden_states(self.head_gate.will_draft())
        speculate = self.speculation.uses_bubble
        self.drafting_paused = speculate and not self.gate.drafting(step)
        drafts = self._static_drafts([r.key for r in requests if r.draft is None])
        requests = [r if r.draft is not None else attach_drafts([r], drafts)[0] for r in requests]
        predicted = {r.key: len(r.draft.token_ids) for r in requests if r.draft is not None}
        shards = self.sharding_policy.shard(requests, self.num_ranks, predicted)
        plan = self._next_plan(step) if speculate and not self.drafting_paused else DraftPlan([])
        outcome = self.ranks.rollout(shards, plan)
        self._since_phase_end = 0.0
        if self.colocated:  # the ranks release their memory to the trainer next: their drafting passes end first
            waited += self._settle()
        outcome.seconds += waited
        if speculate:
            self._store(outcome.drafts)
            self.store.drop_steps_before(step + 1)  # this step's drafts are used up
            plan.requeue(outcome.drafts)  # drafts the barrier cut off go on while the trainer runs
        self._plan, self._late_chunks = plan, outcome.late_chunks  # the keys late chunks leave go back to the plan
        self._outcome, self._outcome_step, self._judged = outcome, step, False
        by_key = {result.key: result for result in outcome.results}
        outcome.results = [by_key[r.key] for r in requests]
        for _, source in self.static_sources:
            source.observe(outcome.results)
        self.response_lengths.observe(outcome.results)
        if self.head_learning is not None:  # the head learns from them while the trainer trains
            self._head_samples = [
                (r.prompt_token_ids, x.token_ids, r.sampling.temperature)
                for r, x in zip(requests, outcome.results, strict=True)
            ]
        return outcome

    def training_starts(self) -> None:
        """The trainer is about to train. Colocated ranks release their generation memory to it; ranks on
        hardware of their own go on drafting the rest of the last step's plan (``draft_during_training``). The draft
        head (``speculation.draft_head``) learns from the last rollout's responses on the last rank first."""
        self._drafting = False
        self.head_record, self._head_learning = None, False
        if self._head_samples and self.head_gate.drafting(self._outcome_step):
            beside = self.draft_during_training > 0 and not self.colocated
            self.ranks.learn_head(self._head_samples, self.head_learning, beside, self._last_train_seconds)
            self._head_learning = True
        elif self._head_samples:  # paused: it neither learns nor drafts in the next rollout
            self.ranks.pause_head()
            self._head_active = False
        self._head_samples = []
        if self.colocated:
            self.ranks.release()
            self._released = True
        elif (
            self.speculation.uses_bubble and self.draft_during_training and (self._plan.has_work() or self._late_chunks)
        ):
            self.ranks.start_drafting(self._plan, self.draft_during_training)
            self._drafting = True

    def training_ended(self, train_seconds: float) -> TrainingDrafting | None:
        """The trainer is done (or failed: ``train_seconds`` 0). Colocated ranks resume; drafting stops (the
        virtual clock budgets it by ``train_seconds``), its drafts are stored, and what the ranks drafted is
        returned; None when the ranks did not draft."""
        if self._released:
            self.ranks.resume()
            self._released = False
        outcome = None
        if self._drafting:  # first: the ranks draft no longer than the trainer trained, nor wait for the head
            self._drafting = False
            with _unless_the_trainer_failed(train_seconds, "drafting while the trainer trained"):
                outcome = self.ranks.stop_drafting(train_seconds)  # at once: passes in flight end late
                self._since_phase_end = 0.0
                self._store(outcome.drafts)
        else:
            self._since_phase_end += train_seconds
        if self._head_learning:
            with _unless_the_trainer_failed(train_seconds, "the draft head's learning"):
                self._record_head_learning(train_seconds)
        if train_seconds > 0:  # not a failed trainer's
            self._last_train_seconds = train_seconds
        return None if outcome is None else TrainingDrafting(outcome)

    def update_weights(self, state_dict, version: int) -> float:
        """The new policy to every rank, once their late drafting passes have ended; returns the seconds it took,
        that wait included (also recorded as the last rollout's ``late_wait_seconds``, less what of it was the draft
        head's learning: the head's own cost, in its record, judged with the rollout it drafts in)."""
        waited = self._settle()
        head = self.ranks.head_wait_seconds  # beside the trainer, what of that wait its learning added
        if self._outcome is not None:
            self._outcome.late_wait_seconds += waited - head
        if self.head_record is not None and not self._head_wait:
            self.head_record = dataclasses.replace(self.head_record, wait_seconds=head)
            self._head_round_cost = head + self.head_record.sync_seconds
        self._judge()  # the last rollout's outcome is complete: the gate judges it before a checkpoint keeps its state
        waited, self._head_wait = waited + self._head_wait, 0.0
        seconds = waited + self.ranks.update_weights(state_dict, version=version)
        synced = self.ranks.head_synced_seconds
        if synced is not None and self.head_record is not None:  # measured in the sync (the wall clock)
            self.head_record = dataclasses.replace(self.head_record, sync_seconds=synced)
            self._head_round_cost = self.head_record.wait_seconds + synced
        return seconds

    def _record_head_learning(self, train_seconds: float) -> None:
        """The head's round of learning, once the trainer is done. Where it ran on hardware the trainer used (ranks
        that do not draft while it trains share it, :meth:`ServiceConfig.training_drafting`), the weight sync
        (:meth:`update_weights`) waits for all of it after the trainer; beside the trainer, the rank pool's
        ``settle`` waits for what of it outlasted the trainer, as for a late drafting pass (the record says how much of
        that wait was the head's: beyond the other ranks' late passes, once :meth:`update_weights` has waited). A pool
        that waited for it itself (the wall clock's: before the trainer, or once it was done) says how long: that wait
        is charged with the weight sync's, and so is the head's sync, which such a pool measures in it."""
        self._head_learning = False
        learned = self.ranks.learned_head()
        seconds, started, report = learned.seconds, learned.started, learned.report
        self._head_active = self._head_active or report.steps > 0
        if learned.waited is not None:  # the pool waited for it itself (before or after the trainer): measured
            self._head_wait = waited = learned.waited
        elif self.draft_during_training == 0 or self.colocated:
            self._head_wait = waited = seconds
        else:  # beside the trainer: an estimate until the sync's wait says what it added (update_weights)
            waited = max(started + seconds - train_seconds, 0.0) - max(started - train_seconds, 0.0)
        sync = self.ranks.head_sync_seconds()
        self._head_round_cost = waited + sync
        self.head_record = HeadLearningRecord(
            self.num_ranks - 1, report.responses, report.pairs, report.steps, report.first_loss, report.final_loss,
            seconds, waited, report.kept_responses, sync,
        )  # fmt: skip

    def evaluate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Generates held-out requests with the current weights (no drafts, not timed)."""
        return self.ranks.evaluate(requests)

    def restore(
        self,
        drafts: Sequence[Draft],
        history: list,
        response_lengths: list,
        gate: dict | None = None,
        draft_head: dict | None = None,
        head_gate: dict | None = None,
    ) -> None:
        """Back to a checkpoint's drafting state: its pending drafts, history, response lengths, the gate's state
        (None: a new run's), the draft head's (:meth:`draft_head_state`; None: no head learned yet) and its gate's
        (:meth:`snapshot`'s ``head_gate``; None: a new run's)."""
        try:
            self.ranks.settle()  # late drafting passes end before the rewind, and their drafts are forgotten
        except Exception as error:  # a rewind follows a failure; what the late passes raised is logged, not raised
            logger.warning("a drafting pass failed before the rewind: %s: %s", type(error).__name__, error)
        self.store.drop_steps_before(2**62)  # a rewind forgets drafts made after the checkpoint
        self.store.put(list(drafts))
        if self.history is not None:
            self.history.restore(history)
        self.response_lengths.restore(response_lengths)
        self.gate.restore(gate or {})
        self._outcome, self._judged = None, True
        if self.head_learning is not None:
            self.ranks.load_draft_head_state(draft_head, self.head_learning)
        self._head_samples, self._head_learning, self._head_wait, self.head_record = [], False, 0.0, None
        head_gate = head_gate or {}
        self.head_gate.restore(head_gate)
        self._head_active = head_gate.get("active", draft_head is not None and not draft_head.get("paused", False))
        self._head_round_cost = head_gate.get("round_cost", 0.0)
        self._last_train_seconds = head_gate.get("budget")

    def draft_head_state(self) -> dict | None:
        """What resumes the draft head's online learning exactly (a checkpoint's): its parameters and optimizer
        state; None without a head or before its first round."""
        return None if self.head_learning is None else self.ranks.draft_head_state()

    def pending_drafts(self, step: int) -> list[Draft]:
        """The stored drafts of the keys the steps after ``step`` will ask for (what a checkpoint keeps)."""
        if not self.speculation.uses_bubble:
            return []
        keys = [
            r.key
            for future_step in range(step + 1, step + 1 + self.speculation.lookahead_steps)
            for r in self._future_requests(future_step)
        ]
        return list(self.store.get(keys).values())

    def snapshot(self) -> dict:
        """What drafting learned across steps, for a checkpoint: response lengths, the history source, the
        speculation gate and the draft head's gate (with whether the head drafts in the next rollout and what its last
        round cost)."""
        return {
            "response_lengths": self.response_lengths.snapshot(),
            "history": None if self.history is None else self.history.snapshot(),
            "gate": self.gate.snapshot(),
            "head_gate": self.head_gate.snapshot()
            | {"active": self._head_active, "round_cost": self._head_round_cost, "budget": self._last_train_seconds},
        }

    def close(self) -> None:
        """Stops drafting; the ranks themselves belong to whoever started them (a Ray session, this process)."""
        self._plan, self._late_chunks = DraftPlan([]), 0

    def _static_drafts(self, keys: list) -> dict:
        """Each key's draft from the first static source (``speculation.draft_sources`` order) that has one."""
        drafts: dict = {}
        if not self.speculation.enabled:
            return drafts
        for _, source in self.static_sources:
            drafts = source.drafts(keys) | drafts  # earlier sources win
        return drafts

    def _next_plan(self, step: int) -> DraftPlan:
        """The keys to draft during step ``step``: those of the next ``speculation.lookahead_steps`` steps,
        the nearest step first. Within a step, keys without a draft or with an unfinished one come first (in
        bubble-policy order) and go on from their draft; then finished drafts of an older policy, to be
        re-verified and refreshed by the current one."""
        ordered, tries = [], None
        for future_step in range(step + 1, step + 1 + self.speculation.lookahead_steps):
            requests = self._future_requests(future_step)
            if self.speculation.uses_tries:  # drafting passes report near-ties, for branches
                requests = [dataclasses.replace(r, margins=True) for r in requests]
            stored = self.store.get([r.key for r in requests])
            predicted = predicted_lengths([r.key for r in requests], stored, self.response_lengths)
            by_key = {r.key: r for r in attach_drafts(requests, stored)}
            in_order = [by_key[k] for k in self.bubble_policy.order(list(by_key), predicted)]
            ordered += [r for r in in_order if r.draft is None or not r.draft.finished]
            ordered += [r for r in in_order if r.draft is not None and r.draft.finished]
            if self.speculation.uses_tries and future_step == step + 1:  # the next step's drafts branch
                tries = TriesPlan(
                    self._tries_policy(),
                    requests,
                    self.speculation.tries_max_tokens_per_rank * self.num_ranks,
                    stored.values(),
                )
        return DraftPlan(ordered, self.num_ranks, self.max_batch_size, tries)

    def _tries_policy(self) -> TriesPolicyBase:
        if self.tries_policy is None:
            from bubblespec.core import plugins

            self.tries_policy = plugins.load_subclass("policies", self.speculation.tries_policy, TriesPolicyBase)()
        return self.tries_policy

    def _future_requests(self, future_step: int) -> list[GenerationRequest]:
        """The requests of a later step, or none if the caller cannot say its prompts."""
        prompts = self.peek(future_step)
        if prompts is None:
            if not self._warned_unpeekable:
                logger.warning(
                    "the prompt source cannot say the prompts of step %d in advance (peek returned None): the "
                    "bubble stays idle and steps run without drafts",
                    future_step,
                )
                self._warned_unpeekable = True
            return []
        return self.requests(future_step, prompts, self.samples_per_prompt)

    def _judge(self) -> None:
        """The gate judges the last rollout's drafts, once (:mod:`bubblespec.rollout.speculation_gate`)."""
        if self._outcome is not None and not self._judged:
            self._judged = True
            if line := self.gate.observe(self._outcome_step, self._outcome):
                logger.info("%s", line)
            drafted, cost = self._rollout_head
            saved = head_saving(self._outcome, cost) if drafted else None
            if saved is not None:
                without = self._outcome.seconds_without_drafts
                if line := self.head_gate.judge(self._outcome_step, saved, without):
                    logger.info("%s", line)
                if self.head_gate.paused and self._head_active:  # at once: the round just learned is not synced
                    self.ranks.pause_head()
                    self._head_active = False
                    if self.head_record is not None:
                        self.head_record = dataclasses.replace(self.head_record, sync_seconds=0.0)

    def _settle(self) -> float:
        """Collects the ranks' late drafting passes (:meth:`RankPool.settle`) and stores their drafts; returns the
        seconds that waited for them."""
        drafts, waited = self.ranks.settle(self._since_phase_end)
        self._since_phase_end += waited
        if drafts and self.speculation.uses_bubble:
            self._store(drafts)
        return waited

    def _store(self, drafts: list[Draft]) -> None:
        """Stores new drafts, except an unfinished one shorter than the draft it would replace: stopped while
        re-verifying an older draft, it would throw away that draft's tail."""
        stored = self.store.get([d.key for d in drafts])
        self.store.put(
            [d for d in drafts if d.finished or d.key not in stored or len(d.token_ids) >= len(stored[d.key].token_ids)]
        )


@contextlib.contextmanager
def _unless_the_trainer_failed(train_seconds: float, what: str):
    """Raises an error of the block, unless the trainer failed (``train_seconds`` 0): its error is the one the run
    raises (and rewinds from), so this one is logged."""
    try:
        yield
    except Exception as error:
        if train_seconds > 0:
            raise
        logger.warning("%s failed too: %s: %s", what, type(error).__name__, error)


def head_learning(speculation: SpeculationConfig, ranks: RankPool) -> HeadLearning | None:
    """``speculation.draft_head`` as the engine takes it, a head step's cost from ``ranks``' clock where the head
    is sized by its acceptance; None where no head learns."""
    if not speculation.uses_draft_head:
        return None
    head = speculation.draft_head
    step_cost = ranks.head_step_cost(head.window) if head.sizing == "acceptance" else None
    return HeadLearning(
        window=head.window,
        max_tokens=head.max_tokens,
        learning_rate=head.learning_rate,
        steps=head.steps_per_rollout,
        rows_per_step=head.responses_per_step,
        seed=head.seed,
        step_cost=step_cost,
        position=head.position,
        max_live_sequences=head.max_live_sequences,
    )


def static_sources(speculation: SpeculationConfig, store: DraftStore) -> list[tuple[str, StaticDraftSource]]:
    """The static draft sources ``speculation.draft_sources`` names, in its order, built with their
    ``draft_source_options``; the ``bubble`` source reads ``store``."""
    built = []
    for name in speculation.draft_sources:
        source = source_class(name)
        if not issubclass(source, StaticDraftSource):
            continue  # dynamic ones run inside the engine
        if issubclass(source, BubbleDrafts):
            built.append((name, source(store)))
            continue
        built.append((name, source(**speculation.draft_source_options.get(name, {}))))  # options checked by the config
    return built
