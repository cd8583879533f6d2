"""``speculation.enabled: auto``: the run stops drafting where drafting does not pay, and tries again now and then
(docs/design.md §8).

A step's drafts are judged by the run's own estimate of the rollout seconds they saved
(:attr:`~bubblespec.rollout.step.RolloutOutcome.seconds_saved`: decode passes saved net of verifying them, less
the waits for drafting passes in flight). Over the last :attr:`SpeculationGate.window` steps that verified drafts,
a saving under :attr:`SpeculationGate.min_saving` of what their rollouts would have taken without drafts pauses
drafting: idle ranks draft nothing, in the bubble or while the trainer trains, and steps decode without drafts.
The margin stands for what the estimate cannot see: ranks that share cores slow each other while one drafts
(BENCHMARKS.md measures it on the main job). Every :attr:`SpeculationGate.probe_every` paused steps the ranks draft
in one bubble again, and the next step's saving decides: drafting resumes where it pays.

``enabled: true`` drafts in every step whatever it saves (``bubblespec bench`` measures drafting itself that way);
``false`` never drafts. Outputs never depend on it: a draft changes only how fast a response is produced.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bubblespec.rollout.step import RolloutOutcome


@dataclass
class SpeculationGate:
    """Whether ranks draft in the coming bubble, from what the drafts of earlier steps saved."""

    auto: bool = True
    """False: always draft (``speculation.enabled: true``)."""
    window: int = 3
    min_saving: float = 0.02
    probe_every: int = 10
    paused: bool = False
    """Drafting is paused (``auto`` only)."""
    _judged: list[tuple[float, float]] = field(default_factory=list)
    """(seconds saved, rollout seconds without drafts) of the latest steps that verified drafts."""
    _paused_steps: int = 0
    _probe_step: int | None = None
    """The paused step whose bubble the ranks drafted in, to measure again."""

    def drafting(self, step: int) -> bool:
        """Whether the ranks draft in the bubble of step ``step``, about to run (and while the trainer then trains)."""
        if not self.paused:
            return True
        self._paused_steps += 1
        if self._paused_steps % self.probe_every:
            return False
        self._probe_step = step
        return True

    def will_draft(self) -> bool:
        """What the next :meth:`drafting` call will answer, without counting a paused step."""
        return not self.paused or (self._paused_steps + 1) % self.probe_every == 0

    def observe(self, step: int, outcome: RolloutOutcome) -> str | None:
        """Judges step ``step``'s drafts (its outcome complete, late drafting passes included); returns a line for the
        log when drafting pauses or resumes."""
        saved = outcome.seconds_saved
        verified = any(rank.requests_with_draft for rank in outcome.ranks)
        if saved is None or not verified:
            return None
        return self.judge(step, saved, outcome.seconds_without_drafts)

    def judge(self, step: int, saved: float, without: float) -> str | None:
        """Judges step ``step``: ``saved`` of the ``without`` seconds its rollout would have taken without what the
        gate decides on; returns a line for the log when that pauses or resumes."""
        if not self.auto:
            return None
        judged = (saved, without)
        if self.paused:  # only the step after a probe is judged: it verified what the probe's bubble drafted
            if self._probe_step is None or step != self._probe_step + 1 or not self._pays([judged]):
                return None
            self.paused, self._judged = False, [judged]
            return self._resumes(step, self._share([judged]))
        self._judged = [*self._judged, judged][-self.window :]
        if len(self._judged) < self.window or self._pays(self._judged):
            return None
        share = self._share(self._judged)
        self.paused, self._judged, self._paused_steps, self._probe_step = True, [], 0, None
        return self._pauses(step, share)

    def _resumes(self, step: int, share: float) -> str:
        return f"step {step}: drafts saved {share:.1%} of the rollout: drafting resumes"

    def _pauses(self, step: int, share: float) -> str:
        return (
            f"step {step}: over the last {self.window} steps with drafts they saved {share:.1%} of the rollout (less "
            f"than {self.min_saving:.0%}, which covers what the estimate cannot see): drafting pauses, and the ranks "
            f"draft one bubble in {self.probe_every} to measure again (speculation.enabled: auto; true drafts always)"
        )

    def snapshot(self) -> dict:
        """The gate's state, for a checkpoint: a resumed run decides as an uninterrupted one."""
        return {"paused": self.paused, "judged": [list(j) for j in self._judged], "paused_steps": self._paused_steps,
                "probe_step": self._probe_step}  # fmt: skip

    def restore(self, state: dict) -> None:
        """Back to a :meth:`snapshot` ({}: the state of a new run)."""
        self.paused = state.get("paused", False)
        self._judged = [tuple(j) for j in state.get("judged", [])]
        self._paused_steps = state.get("paused_steps", 0)
        self._probe_step = state.get("probe_step")

    def _pays(self, judged: list[tuple[float, float]]) -> bool:
        return self._share(judged) >= self.min_saving

    @staticmethod
    def _share(judged: list[tuple[float, float]]) -> float:
        without = sum(seconds for _, seconds in judged)
        return sum(saved for saved, _ in judged) / without if without > 0 else 0.0


@dataclass
class HeadGate(SpeculationGate):
    """``speculation.draft_head.enabled: auto``: the run stops learning and drafting with the draft head where it
    does not pay for itself, and tries again now and then (docs/design.md §14). A step whose rollout the head drafted
    in is judged by :func:`head_saving`; over the last :attr:`window` such steps, a saving under :attr:`min_saving`
    (none: the head must at least pay for its learning and sync) pauses it: the head neither learns after a rollout
    nor drafts in the next. Every :attr:`probe_every` paused steps it learns once again, and the rollout after that
    round decides."""

    min_saving: float = 0.0

    def _pays(self, judged: list[tuple[float, float]]) -> bool:
        """More than :attr:`min_saving`: a head that saves nothing, even at no cost, pauses (it learns for nothing)."""
        return self._share(judged) > self.min_saving

    def _resumes(self, step: int, share: float) -> str:
        return f"step {step}: the draft head saved {share:.1%} of the rollout, its learning and sync paid: it resumes"

    def _pauses(self, step: int, share: float) -> str:
        return (
            f"step {step}: over the last {self.window} steps the draft head saved {share:.1%} of the rollout net of "
            "its calls, learning and sync: it pauses (no learning, no drafting), and learns once in "
            f"{self.probe_every} steps to measure again (speculation.draft_head.enabled: auto; true keeps it always)"
        )


def head_saving(outcome: RolloutOutcome, round_cost: float) -> float | None:
    """The seconds the draft head saved in ``outcome``'s rollout, net of its calls and of ``round_cost`` (the seconds
    its last round of learning cost the step before, the step's wait for it and the weight sync's for its
    parameters): of the drafts' saving before the head's calls (:attr:`RolloutOutcome.seconds_saved` plus the calls'
    seconds on the rank that set the barrier), the share of the accepted draft tokens that were the head's, an
    estimate (what the other sources would have drafted in its place is not known); less those calls, in full. None
    where the saving was not estimated."""
    saved = outcome.seconds_saved
    if saved is None:
        return None
    barrier_rank = max(outcome.ranks, key=lambda rank: rank.generation_seconds)
    calls = barrier_rank.head_call_seconds or 0.0
    accepted = sum(rank.draft_tokens_accepted for rank in outcome.ranks)
    head = sum(rank.head_tokens_accepted for rank in outcome.ranks)
    return ((saved + calls) * head / accepted if accepted else 0.0) - calls - round_cost
