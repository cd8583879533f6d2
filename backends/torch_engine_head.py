"""The torch engine's draft head (docs/design.md §14): drafting with one, learning one online, its state.

A draft head (:meth:`TorchEngine.set_draft_head`, :mod:`bubblespec.models.draft_head`) proposes where a sequence's
own proposal is empty (the draft chain's last source; with ``position`` ``after-request``, where its request's draft
has no aligned proposal, before the dynamic sources). While the engine holds one, every pass also returns the
policy's last hidden states, and each sequence keeps its latest ``window`` valid (hidden state, token) pairs: the
hidden state at a fed position whose logits emitted a token, with that token. After a pass that fed ``[last, d_1 ..
d_K]`` and accepted ``a`` draft tokens, those are the fed positions 0..a, paired with ``d_1 .. d_a`` and the sample
after them (a prompt's pass: from the prompt's last position on); the rest were rejected and are dropped. Before a
pass, the sequences with no proposal of their own (request draft used up or absent, no dynamic source proposing; or
only the first, ``after-request``) get the head's, in one batched call: it reads each one's pairs and drafts with
the key's noise and the request's sampling settings at the response positions the tokens take. Those tokens are
verified as any draft, so they change no output. In a token-tree pass (``draft_candidates`` > 1) the head's proposal
is the first candidate of a sequence that has none (nodes 0, 1, ... of the tree) and the pairs follow the accepted
path. (The head does not continue another source's proposal: it would read that proposal token by token, one
sequential step each, before drafting its own.) While :attr:`TorchEngine.keep_hidden` is set, every pass returns
hidden states too and a sequence keeps all its pairs, not the window's: at its end they are what
:meth:`TorchEngine.learn_draft_head` learns its response from, without a pass over it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, get_args

import torch

from bubblespec.core.draft_sources import HEAD_DRAFT
from bubblespec.models.draft_head import (
    DEFAULT_WINDOW,
    DraftHead,
    DraftHeadTrainer,
    HeadLearning,
    HeadLearningReport,
    HeadPosition,
    HeadSizing,
    Sample,
    drafting_call_counts,
    learn_online,
    sample_key,
)
from bubblespec.verify.sampling import keyed_sample
from bubblespec.verify.sequence import keyed_samples

if TYPE_CHECKING:
    from bubblespec.backends.torch_engine import _Slot

logger = logging.getLogger(__name__)


class HeadDrafting:
    """The draft-head part of :class:`~bubblespec.backends.torch_engine.TorchEngine`: it needs the engine's
    ``model``, ``vocab_size`` and ``_proposal``; the engine's passes call :meth:`_head_drafts` before and
    :meth:`_after_head_pass` after each pass where :attr:`_reads_hidden`."""

    def _init_head(self) -> None:
        self._head: DraftHead | None = None
        self._head_max_tokens = 0
        self._head_max_live: int | None = None
        """The head drafts only in passes of at most this many sequences (the tail); None: in every pass."""
        self._head_early = False
        """Whether the head proposes where the request's draft has nothing, before the dynamic sources
        (:data:`~bubblespec.models.draft_head.HeadPosition` ``after-request``); else where the chain has nothing."""
        self._head_trainer: DraftHeadTrainer | None = None
        """The head learned online (:meth:`learn_draft_head`) and its optimizer; None until the first round."""
        self._head_call: dict[str, int] = {}
        """The draft-head call before the current pass, for its ForwardPass (what a cost model charges)."""
        self._head_sizing: HeadSizing | None = None
        """How many tokens the learned head proposes a pass (:meth:`learn_draft_head`'s ``learning.step_cost``)."""
        self.keep_hidden = False
        """While True, ``generate`` keeps each response it finishes with its hidden states (the pairs
        :meth:`learn_draft_head` learns from), until the next weight update or round of learning: the rollout has
        computed them, so learning from them costs no pass of the policy again. They take H values of the model's
        dtype per response token."""
        self._kept: dict[tuple[tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
        self.head_call_seconds = 0.0
        """Wall seconds of every draft-head call so far, summed: a wall-clock rank reads it around its passes (the
        head's share of a pass's time, ``rollout.speculation_effect.TimedPasses``)."""

    @property
    def draft_head(self) -> DraftHead | None:
        """The draft head the engine drafts with (:meth:`set_draft_head`), or None."""
        return self._head

    def set_draft_head(
        self,
        state: Mapping[str, torch.Tensor] | None,
        window: int = DEFAULT_WINDOW,
        max_tokens: int | None = None,
        position: HeadPosition = "last",
    ) -> None:
        """From the next ``generate`` on, drafts with a :class:`~bubblespec.models.draft_head.DraftHead` over this
        engine's model with ``state`` (its :meth:`~bubblespec.models.draft_head.DraftHead.state_dict`) attending the
        latest ``window`` pairs; None removes the head. In each pass the head proposes up to ``max_tokens`` tokens
        (default ``max_draft_tokens_per_step``) where the draft chain has no proposal (``position``:
        :data:`~bubblespec.models.draft_head.HeadPosition`), within the sequence's draft room.
        The head shares the model's embedding and output head, so weight updates reach it. It drafts with the key's
        own noise under one-hot verification too (as a bubble draft is drafted)."""
        if state is None:
            self._head, self._head_trainer, self._head_max_tokens, self._head_sizing = None, None, 0, None
            return
        counted = isinstance(max_tokens, int) and not isinstance(max_tokens, bool)
        if max_tokens is not None and not (counted and max_tokens >= 1):
            raise ValueError(f"max_tokens must be a positive number of draft tokens or None, got {max_tokens!r}")
        if position not in get_args(HeadPosition):
            raise ValueError(f"position must be 'last' or 'after-request', got {position!r}")
        head = DraftHead(self.model, window=window)
        head.load_state_dict(state)
        self._head, self._head_trainer, self._head_sizing, self._head_max_live = head, None, None, None
        self._head_max_tokens = max_tokens or self._proposal.max_draft_tokens_per_step
        self._head_early = position == "after-request"

    def learn_draft_head(
        self, samples: Seq[Sample], learning: HeadLearning, until: float | None = None
    ) -> HeadLearningReport:
        """One round of online learning (docs/design.md §14): the draft head learns from ``samples``, responses of
        the policy this engine holds ((prompt ids, response ids, temperature) each), by
        :func:`~bubblespec.models.draft_head.learn_online`, and drafts from the next ``generate`` on. The first round
        starts a head from ``learning.seed`` (as does a round after :meth:`set_draft_head`); later rounds go on
        training it, its optimizer state kept. The hidden states of the samples ``generate`` kept
        (:attr:`keep_hidden`) are not computed again; the round uses them up. ``until``: a ``time.perf_counter()``
        reading after which it starts no further AdamW step (the wall clock's budget; the first step always runs)."""
        if self._head_trainer is None:
            if not any(len(response) for _, response, _ in samples):  # nothing to learn from: no untrained head
                self._kept = {}
                return HeadLearningReport.nothing()
            head = DraftHead(self.model, seed=learning.seed, window=learning.window)
            self._head_trainer = DraftHeadTrainer(head, learning_rate=learning.learning_rate)
        kept, self._kept = self._kept, {}
        report = learn_online(self._head_trainer, samples, learning, kept, until)
        self._install_learned(self._head_trainer, learning)
        return report

    def hidden_kept(self, samples: Seq[Sample]) -> list[bool]:
        """Whether ``generate`` kept each sample's hidden states (:attr:`keep_hidden`): learning from those runs no
        pass of the policy."""
        return [sample_key(sample) in self._kept for sample in samples]

    def _install_learned(self, trainer: DraftHeadTrainer, learning: HeadLearning) -> None:
        """Drafts with ``trainer``'s head from the next ``generate`` on, sized by its acceptance (a new round of an
        installed head's learning keeps its measured acceptance, halved; :class:`HeadSizing`)."""
        max_tokens = learning.max_tokens or self._proposal.max_draft_tokens_per_step
        if self._head_sizing is None or self._head is not trainer.head:
            self._head_sizing = HeadSizing(max_tokens, learning.step_cost)
        else:
            self._head_sizing.new_round()
        self._head_trainer, self._head, self._head_max_tokens = trainer, trainer.head, max_tokens
        self._head_early = learning.position == "after-request"
        self._head_max_live = learning.max_live_sequences

    def measure_head_step_cost(self, window: int, context_tokens: int = 1024, repeats: int = 5) -> float:
        """A draft-head step's measured seconds over a decode pass's on this engine's device: one row, a head of the
        run's ``window`` (untrained: the cost does not depend on what it learned) drafting 4 tokens against one
        token fed at ``context_tokens`` cached positions, each with its keyed sample (medians of ``repeats``, after a
        warm-up). What sizes a head's proposals on the wall clock (:class:`HeadSizing`), where no cost model
        charges them."""
        from bubblespec.models.decoder import KVCache

        config, dtype, steps = self.model_config, self.model.dtype, 4
        context_tokens = min(context_tokens, self.context_length - 1)
        head = DraftHead(self.model, window=window)
        seeds_B2 = torch.zeros(1, 2, dtype=torch.int64, device=self.device)
        ones = torch.ones(1, dtype=torch.float64, device=self.device)
        settings = (ones, torch.zeros(1, dtype=torch.int64, device=self.device), ones)

        def sample(logits_B1V: torch.Tensor, positions_B1: torch.Tensor) -> torch.Tensor:
            return keyed_sample(logits_B1V.float(), seeds_B2, positions_B1, *settings)[0]

        cache = KVCache(config, 1, context_tokens + 1, dtype, self.device)
        token_B1 = torch.full((1, 1), 3, device=self.device)
        position_B1 = torch.full((1, 1), context_tokens, device=self.device)
        hidden_BTH = torch.zeros(1, window, config.hidden_size, dtype=dtype, device=self.device)
        tokens_BT = torch.full((1, window), 3, device=self.device)
        length_B, first_B = torch.tensor([window]), torch.tensor([context_tokens])

        def synchronized(call) -> None:
            call()
            if self.device.type == "cuda":  # the decode pass syncs nowhere: its kernels may still run
                torch.cuda.synchronize(self.device)

        def timed(call) -> float:
            synchronized(call)  # warm-up
            seconds = []
            for _ in range(repeats):
                start = time.perf_counter()
                synchronized(call)
                seconds.append(time.perf_counter() - start)
            return sorted(seconds)[len(seconds) // 2]

        with torch.inference_mode():
            decode = timed(lambda: sample(self.model.forward(token_B1, position_B1, cache), position_B1))
            drafting = timed(lambda: head.draft(hidden_BTH, tokens_BT, length_B, first_B, steps, sample))
        return drafting / steps / decode

    def pause_draft_head(self) -> None:
        """Drafts without the learned head until its next round of learning (:meth:`learn_draft_head`), which it
        keeps learning from where it was (``speculation.draft_head.enabled: auto``); the hidden states it kept go."""
        self._head, self._kept = None, {}

    def draft_head_state(self) -> dict | None:
        """What resumes online learning exactly (a checkpoint's): the learned head's parameters and its optimizer's
        state (:meth:`DraftHead.state_dict`, :meth:`DraftHeadTrainer.state_dict`), its sizing and whether it is paused
        (:meth:`pause_draft_head`); None before the first round."""
        if self._head_trainer is None:
            return None
        sizing = self._head_sizing
        return {
            "head": self._head_trainer.head.state_dict(),
            "optimizer": self._head_trainer.state_dict(),
            "sizing": sizing.state(),
            "paused": self._head is None,
        }

    def load_draft_head_state(self, state: Mapping | None, learning: HeadLearning) -> None:
        """Back to :meth:`draft_head_state`'s ``state`` (None: no head, learning starts from nothing again)."""
        if state is None:
            self._head, self._head_trainer, self._head_max_tokens, self._head_sizing = None, None, 0, None
            return
        head = DraftHead(self.model, seed=learning.seed, window=learning.window)
        head.load_state_dict(state["head"])
        trainer = DraftHeadTrainer(head, learning_rate=learning.learning_rate)
        trainer.load_state_dict(state["optimizer"])
        self._install_learned(trainer, learning)
        for group in trainer.optimizer.param_groups:  # the run's learning rate, not the checkpoint's
            group["lr"] = learning.learning_rate
        self._head_sizing.load_state(state["sizing"])
        if state.get("paused", False):
            self.pause_draft_head()

    def _keep(self, sequence: _Slot) -> None:
        """Keeps a finished response's hidden states (:attr:`keep_hidden`): one row per response token."""
        if not sequence.kept_hidden:
            return
        rows, sequence.kept_hidden = torch.cat(sequence.kept_hidden), []
        if len(rows) != len(sequence.tokens):  # not one row per token: learning computes them again
            logger.warning(
                "kept %d hidden states for a response of %d tokens: not kept", len(rows), len(sequence.tokens)
            )
            return
        self._kept[(tuple(sequence.request.prompt_token_ids), tuple(sequence.tokens))] = rows

    @property
    def _reads_hidden(self) -> bool:
        """Whether a pass returns the policy's last hidden states: for a draft head, or to keep them."""
        return self._head is not None or self.keep_hidden

    def _head_drafts(self, active: list[_Slot], drafts: list[list[int]]) -> list[list[int]]:
        """Each sequence's proposal, the draft head's where it has none of its own (up to the head's tokens for the
        pass, within the draft room): one head call for every such sequence that holds pairs (a sequence's first pass
        has none), each token the keyed sample of the head's logits at its response position; none in a pass of more
        sequences than the head's ``max_live_sequences`` (it drafts the tail only)."""
        if self._head_max_live is not None and len(active) > self._head_max_live:
            return drafts
        budget = self._head_max_tokens if self._head_sizing is None else self._head_sizing.tokens()
        room = [min(budget, s.proposal_length(self._proposal) - len(d)) for s, d in
                zip(active, drafts, strict=True)]  # fmt: skip
        rows = [
            row
            for row, sequence in enumerate(active)
            if room[row] > 0 and not drafts[row] and sequence.head_hidden is not None
        ]
        if not rows:
            return drafts
        started = time.perf_counter()
        chosen = [active[row] for row in rows]
        num_tokens = max(room[row] for row in rows)
        drafted_BN = self._head.draft(
            torch.nn.utils.rnn.pad_sequence([s.head_hidden for s in chosen], batch_first=True),
            torch.nn.utils.rnn.pad_sequence([torch.tensor(s.head_tokens) for s in chosen], batch_first=True),
            torch.tensor([len(s.head_tokens) for s in chosen]),
            torch.tensor([len(s.tokens) for s in chosen]),
            num_tokens,
            _head_sampler(chosen),
        ).tolist()
        proposed = list(drafts)
        for row, tokens in zip(rows, drafted_BN, strict=True):
            proposed[row] = tokens[: room[row]]
            active[row].proposed_by = HEAD_DRAFT
        contexts = [len(s.head_tokens) for s in chosen]
        self._head_call = drafting_call_counts(contexts, [0] * len(chosen), num_tokens, self._head.window,
                                               self.vocab_size)  # fmt: skip
        self.head_call_seconds += time.perf_counter() - started
        return proposed

    def _after_head_pass(
        self, sequence: _Slot, hidden_TH: torch.Tensor, before: int, path: list[int], own: int, proposed: int
    ) -> None:
        """After a pass that fed ``sequence``'s chunk (its hidden states ``hidden_TH``), accepted the draft nodes
        ``path`` (a linear chunk's: ``0 .. a-1``; a tree's first candidate holds nodes ``0, 1, ...``) and emitted the
        tokens from response position ``before`` on: counts the head's tokens (nodes ``own`` to ``proposed - 1``
        of the first candidate) and keeps the valid pairs: each fed position whose logits emitted a token, with it
        (the pending token's, then each accepted node's), within the head's window, and all of them where the engine
        keeps hidden states (:attr:`keep_hidden`). A prompt's pass pairs from the prompt's last position on (its
        response prefix, if any, then the emitted tokens)."""
        kept = len(sequence.tokens) - before
        if self._head is not None:
            self._count_head_tokens(sequence, path[:kept], own, proposed, kept)
        fed = len(sequence.pending)
        emitted_at = [fed - 1, *(fed + node for node in path)][:kept]  # chunk indices whose logits emitted a token
        first_pass = sequence.cache_length == 0
        if first_pass:
            emitted_at = [*range(len(sequence.request.prompt_token_ids) - 1, fed - 1), *emitted_at]
        hidden, tokens = hidden_TH[emitted_at], sequence.tokens if first_pass else sequence.tokens[before:]
        if self.keep_hidden:
            sequence.kept_hidden.append(hidden)
        if self._head is None or sequence.finish is not None:
            return
        if sequence.head_hidden is not None:
            hidden = torch.cat([sequence.head_hidden, hidden])
        window = self._head.window
        sequence.head_hidden = hidden[-window:]
        sequence.head_tokens = [*sequence.head_tokens, *tokens][-window:]

    def _count_head_tokens(self, sequence: _Slot, path: list[int], own: int, proposed: int, kept: int) -> None:
        """The head's tokens in a pass (nodes ``own`` to ``proposed - 1`` of the first candidate) that verification
        reached and accepted (``path``: the accepted nodes that emitted a token): the sequence's counts and the
        head's sizing."""
        stats = sequence.stats
        along = next((j for j, node in enumerate(path) if node != j), len(path))  # first candidate's
        accepted = max(min(along, proposed) - own, 0)
        stats.head_tokens_proposed += proposed - own
        stats.head_tokens_accepted += accepted
        if self._head_sizing is not None and proposed > own and along >= own:  # verification reached the head's
            # rejected: the head's token at ``along`` was scored and another emitted there (a stop token too)
            self._head_sizing.observe(accepted, rejected=along < min(proposed, kept))


def _head_sampler(sequences: list[_Slot]):
    """The keyed sampler a draft head drafts ``sequences``' rows with: each row's key noise and sampling settings
    at the given response positions (the repetition penalty over the prompt and the response so far)."""

    def sample(logits_B1V: torch.Tensor, positions_B1: torch.Tensor) -> torch.Tensor:
        offsets = [p - len(s.tokens) for p, s in zip(positions_B1[:, 0].tolist(), sequences, strict=True)]
        tokens, _ = keyed_samples(logits_B1V, sequences, [[] for _ in sequences], offsets)
        return torch.tensor(tokens)

    return sample
