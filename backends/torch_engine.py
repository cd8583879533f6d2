"""The built-in engine: batched keyed decoding with exact speculative verification, in plain torch.

Every forward pass feeds each active sequence one chunk: a new sequence its prompt, a running one its last
sampled token; either followed by up to ``max_draft_tokens_per_step`` draft tokens at the positions they
propose. The keyed samples at the chunk's last prompt/last token and at every draft position decide how many
draft tokens are accepted (:mod:`bubblespec.verify.sequence`); the rest are rolled back for free,
because the cache is addressed by absolute position (see :mod:`bubblespec.models.decoder`). Finished
sequences leave the batch at once and queued requests take their slots (continuous batching), so a shard's
long tail does not hold short requests hostage. Drafts align by position: after a mismatch the next step
proposes the draft's tokens at the following positions.

A draft head (:meth:`TorchEngine.set_draft_head`, :mod:`bubblespec.models.draft_head`) proposes where a sequence's
own proposal is empty (the draft chain's last source). While the engine holds one, every pass also returns the
policy's last hidden states, and each sequence keeps its latest ``window`` valid (hidden state, token) pairs: the
hidden state at a fed position whose logits emitted a token, with that token. After a pass that fed
``[last, d_1 .. d_K]`` and accepted ``a`` draft tokens, those are the fed positions 0..a, paired with ``d_1 .. d_a``
and the sample after them (a prompt's pass: from the prompt's last position on); the rest were rejected and are
dropped. Before a pass, the sequences with no proposal of their own (request draft used up or absent, no dynamic
source proposing) get the head's, in one batched call: it reads each one's pairs and drafts with the key's noise and
the request's sampling settings at the response positions the tokens take. Those tokens are verified as any draft,
so they change no output. In a token-tree pass (``draft_candidates`` > 1) the head's proposal is the first candidate
of a sequence that has none (nodes 0, 1, ... of the tree) and the pairs follow the accepted path. (The head does not
continue another source's proposal: it would read that proposal token by token, one sequential step each, before
drafting its own.) While :attr:`TorchEngine.keep_hidden` is set, every pass returns hidden states too and a sequence
keeps all its pairs, not the window's: at its end they are what :meth:`TorchEngine.learn_draft_head` learns its
response from, without a pass over it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import field_validator, model_validator

from bubblespec.core.config import DraftChainSettings, EngineSettings, engine_config
from bubblespec.core.draft_sources import REQUEST_DRAFT
from bubblespec.core.errors import RequestError
from bubblespec.core.interfaces import Engine, ForwardPass, GenerationRequest, GenerationResult, StopSignal
from bubblespec.models.decoder import (
    DTYPES,
    DecoderModel,
    KVCache,
    TokenTree,
    check_batch_invariant,
    read_checkpoint,
    read_model_config,
)
from bubblespec.models.draft_head import (
    DEFAULT_WINDOW,
    DraftHead,
    DraftHeadTrainer,
    HeadLearning,
    HeadLearningReport,
    HeadSizing,
    Sample,
    drafting_call_counts,
    learn_online,
    sample_key,
)
from bubblespec.verify.sequence import (
    ProposalSettings,
    Sequence,
    keyed_samples,
    keyed_samples_with_near_ties,
    link_siblings,
    tree_budgets,
)
from bubblespec.verify.tree import DraftTree


class TorchEngineConfig(EngineSettings, DraftChainSettings):
    """Settings of the built-in torch engine: the common ones and its device."""

    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    """Weights and activations; float64 makes speculation bit-identical to plain decoding."""
    device: str = "cpu"
    """A torch device: "cpu", "cuda" or "cuda:N"."""
    batch_invariant: bool = False
    """float32 or float64 on a CPU: compute a sequence's logits the same way in every forward pass (a chunk's
    queries attend one per head, matrix products run over a multiple of 4 rows), so rollouts with drafts are
    bit-identical to plain decoding's. Without it a float32 verify pass rounds otherwise than a decode pass and may
    rarely flip a sampling near-tie; with it a verify pass costs 1.2-1.9x as much on a CPU (docs/design.md §3.2).
    It runs on one torch thread (``num_threads`` unset pins 1; more is refused: with two, decode and verify passes
    round differently again) and verifies one candidate per pass (``draft_candidates`` > 1 is refused: a token
    tree stores a later candidate's keys after the earlier ones', and attention sums them in another order)."""

    @field_validator("device")
    @classmethod
    def _is_a_device(cls, device: str) -> str:
        # Only the spelling: settings are checked where the run starts, which need not be where ranks run.
        try:
            torch.device(device)
        except RuntimeError:
            raise ValueError(f"{device!r} is not a torch device; use cpu, cuda or cuda:N") from None
        return device

    @model_validator(mode="after")
    def _batch_invariant_where_measured(self) -> TorchEngineConfig:
        if not self.batch_invariant:
            return self
        check_batch_invariant(DTYPES[self.dtype], self.device)
        if self.num_threads is not None and self.num_threads > 1:
            raise ValueError(
                f"batch_invariant runs on one torch thread, got num_threads {self.num_threads} "
                "(rollout.threads_per_rank): with more, a verify pass rounds otherwise than a decode pass; use 1"
            )
        if self.draft_candidates > 1:
            raise ValueError(
                f"batch_invariant verifies one candidate per pass, got draft_candidates {self.draft_candidates} "
                "(speculation.draft_candidates): a token tree's later candidates round otherwise than plain "
                "decoding; use 1, or turn batch_invariant off"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _batch_invariant_pins_one_thread(cls, settings: object) -> object:
        if isinstance(settings, dict) and settings.get("batch_invariant") and settings.get("num_threads") is None:
            return settings | {"num_threads": 1}
        return settings


@dataclass
class _Slot(Sequence):
    """A sequence while it holds a batch slot: the shared decoding state, plus where it is in the cache."""

    pending: list[int] = field(default_factory=list)  # tokens to feed next, not yet in the cache
    cache_length: int = 0  # positions [0, cache_length) of this slot hold valid keys and values
    # with a draft head: the policy's last hidden states [P, H] of the latest valid pairs, and the token each emitted
    head_hidden: torch.Tensor | None = field(default=None, repr=False)
    head_tokens: list[int] = field(default_factory=list, repr=False)
    # while the engine keeps hidden states (TorchEngine.keep_hidden): the rows of every emitted token, pass by pass
    kept_hidden: list[torch.Tensor] = field(default_factory=list, repr=False)


class TorchEngine(Engine):
    """A :class:`bubblespec.core.interfaces.GenerationEngine` on a Llama/Qwen2-family checkpoint, CPU or CUDA."""

    config_class = TorchEngineConfig
    supports_draft_chain = True
    """Runs dynamic draft sources (``ngram``, ``group``, plugins) itself: see ``TorchEngineConfig.draft_chain``."""
    supports_draft_trees = True
    """Verifies ``draft_candidates`` candidates per sequence and pass as a token tree (:meth:`_tree_step`)."""
    supports_draft_tries = True
    """Reports runner-ups and margins where a request asks (:meth:`_sample`) and begins a response with a given
    prefix (its tokens are fed with the prompt)."""
    supports_draft_head = True
    """Drafts with a draft head (:meth:`set_draft_head`) and learns one online (:meth:`learn_draft_head`)."""

    def __init__(self, config: TorchEngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RequestError(f"device {config.device!r} was asked for but torch sees no CUDA device; use 'cpu'")
        self.model_config, weights = read_checkpoint(config.model_path)
        self.model = DecoderModel(
            self.model_config, weights, DTYPES[config.dtype], device, batch_invariant=config.batch_invariant
        )
        self.device = device
        self._policy_version = 0
        self._cache: KVCache | None = None
        self.num_forward_passes = 0  # engine-wide counter, for benchmarks and metrics
        self._proposal = ProposalSettings.of(config)
        self._head: DraftHead | None = None
        self._head_max_tokens = 0
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

    @classmethod
    def check_model(cls, model_path: str) -> None:
        """Raises the error this engine would raise for the folder's architecture, without loading weights."""
        read_model_config(model_path)

    @classmethod
    def from_pretrained(cls, model_path: str, **settings) -> TorchEngine:
        return cls(engine_config("torch", TorchEngineConfig, {"model_path": str(model_path), **settings}))

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def context_length(self) -> int:
        return self.model_config.max_position_embeddings

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Loads new weights (Hugging Face names; a subset is fine) and records their policy version."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise TypeError(f"policy version must be an int, got {version!r}")
        with torch.inference_mode():
            self.model.load_weights(state_dict)
        self._policy_version = version
        self._kept = {}  # another policy's hidden states

    def select_rank(self, rank: int) -> None:
        self._proposal.select_rank(rank)

    @property
    def draft_head(self) -> DraftHead | None:
        """The draft head the engine drafts with (:meth:`set_draft_head`), or None."""
        return self._head

    def set_draft_head(
        self,
        state: Mapping[str, torch.Tensor] | None,
        window: int = DEFAULT_WINDOW,
        max_tokens: int | None = None,
    ) -> None:
        """From the next ``generate`` on, drafts with a :class:`~bubblespec.models.draft_head.DraftHead` over this
        engine's model with ``state`` (its :meth:`~bubblespec.models.draft_head.DraftHead.state_dict`) attending the
        latest ``window`` pairs; None removes the head. In each pass the head proposes up to ``max_tokens`` tokens
        (default ``max_draft_tokens_per_step``) after a sequence's own proposal, within the sequence's draft room.
        The head shares the model's embedding and output head, so weight updates reach it. It drafts with the key's
        own noise under one-hot verification too (as a bubble draft is drafted)."""
        if state is None:
            self._head, self._head_trainer, self._head_max_tokens, self._head_sizing = None, None, 0, None
            return
        counted = isinstance(max_tokens, int) and not isinstance(max_tokens, bool)
        if max_tokens is not None and not (counted and max_tokens >= 1):
            raise ValueError(f"max_tokens must be a positive number of draft tokens or None, got {max_tokens!r}")
        head = DraftHead(self.model, window=window)
        head.load_state_dict(state)
        self._head, self._head_trainer, self._head_sizing = head, None, None
        self._head_max_tokens = max_tokens or self._proposal.max_draft_tokens_per_step

    def learn_draft_head(self, samples: Seq[Sample], learning: HeadLearning) -> HeadLearningReport:
        """One round of online learning (docs/design.md §14): the draft head learns from ``samples``, responses of
        the policy this engine holds ((prompt ids, response ids, temperature) each), by
        :func:`~bubblespec.models.draft_head.learn_online`, and drafts from the next ``generate`` on. The first round
        starts a head from ``learning.seed`` (as does a round after :meth:`set_draft_head`); later rounds go on
        training it, its optimizer state kept. The hidden states of the samples ``generate`` kept
        (:attr:`keep_hidden`) are not computed again; the round uses them up."""
        if self._head_trainer is None:
            if not any(len(response) for _, response, _ in samples):  # nothing to learn from: no untrained head
                self._kept = {}
                return HeadLearningReport.nothing()
            head = DraftHead(self.model, seed=learning.seed, window=learning.window)
            self._head_trainer = DraftHeadTrainer(head, learning_rate=learning.learning_rate)
        kept, self._kept = self._kept, {}
        report = learn_online(self._head_trainer, samples, learning, kept)
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

    def pause_draft_head(self) -> None:
        """Drafts without the learned head until its next round of learning (:meth:`learn_draft_head`), which it
        keeps learning from where it was (``speculation.draft_head.enabled: auto``)."""
        self._head = None

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

    def release(self) -> None:
        self._cache = None

    def resume(self) -> None:
        """Nothing to do: the cache is re-allocated by the next ``generate``."""

    def close(self) -> None:
        self._cache = None

    @torch.inference_mode()
    def generate(
        self,
        requests: Seq[GenerationRequest],
        stop: StopSignal | None = None,
        on_forward: Callable[[ForwardPass], None] | None = None,
    ) -> list[GenerationResult]:
        sequences = [self._admit(i, request) for i, request in enumerate(requests)]
        if self._proposal.proposers:
            link_siblings(sequences)
        results: list[GenerationResult | None] = [None] * len(sequences)
        if not sequences:
            return []
        for sequence in sequences:
            if sequence.finish is not None:  # its response prefix ended it: nothing to compute
                results[sequence.index] = sequence.result()
        sequences = [sequence for sequence in sequences if sequence.finish is None]
        if not sequences:
            return results  # type: ignore[return-value]
        cache = self._cache_for(sequences)
        waiting = list(reversed(sequences))
        active: list[_Slot] = []
        while waiting or active:
            if stop is not None and stop.is_set():
                for sequence in active + waiting:
                    results[sequence.index] = sequence.result("preempted")
                    self._proposal.observe(sequence)
                break
            while waiting and len(active) < cache.keys.shape[1]:
                active.append(waiting.pop())
            self._step(active, cache, on_forward)
            for slot in reversed(range(len(active))):
                sequence = active[slot]
                if sequence.finish is None:
                    continue
                results[sequence.index] = sequence.result()
                self._proposal.observe(sequence)
                self._keep(sequence)
                last = len(active) - 1
                if slot != last:  # keep active sequences in slots [0, len(active))
                    cache.move_slot(last, slot)
                    active[slot] = active[last]
                active.pop()
        return results  # type: ignore[return-value]

    def _keep(self, sequence: _Slot) -> None:
        """Keeps a finished response's hidden states (:attr:`keep_hidden`): one row per response token."""
        if not sequence.kept_hidden:
            return
        rows, sequence.kept_hidden = torch.cat(sequence.kept_hidden), []
        if len(rows) == len(sequence.tokens):
            self._kept[(tuple(sequence.request.prompt_token_ids), tuple(sequence.tokens))] = rows

    def _admit(self, index: int, request: GenerationRequest) -> _Slot:
        sequence = _Slot.admit(
            index, request, self.vocab_size, self.context_length, self.model_config.eos_token_ids, tries=True
        )
        sequence.pending = [*request.prompt_token_ids, *sequence.tokens]  # the response prefix, if any
        return sequence

    def _cache_for(self, sequences: list[_Slot]) -> KVCache:
        num_slots = min(len(sequences), self.config.max_batch_size)
        # Every row of a pass is padded to the longest chunk (a new sequence's prompt + its draft), so a sequence
        # near the end of its response writes padding up to that far past its own length.
        longest_chunk = max(len(s.pending) for s in sequences) + self._proposal.tree_budget
        positions = max(len(s.pending) + s.max_new_tokens for s in sequences) + longest_chunk
        cache = self._cache
        if cache is None or cache.keys.shape[1] < num_slots or cache.max_positions < positions:
            cache = KVCache(self.model_config, num_slots, positions, self.model.dtype, self.device)
            self._cache = cache
        return cache

    @property
    def _reads_hidden(self) -> bool:
        """Whether a pass returns the policy's last hidden states: for a draft head, or to keep them."""
        return self._head is not None or self.keep_hidden

    def _step(self, active: list[_Slot], cache: KVCache, on_forward) -> None:
        """One forward pass over every active sequence: each feeds its pending tokens and its draft chunk, and
        is sampled at its last pending token and at every draft token."""
        self._head_call = {}
        if self._proposal.draft_candidates > 1:
            return self._tree_step(active, cache, on_forward)
        batch = len(active)
        drafts = [s.propose(self._proposal) for s in active]
        own = [len(d) for d in drafts]
        if self._head is not None:
            drafts = self._head_drafts(active, drafts)
        chunks = [s.pending + d for s, d in zip(active, drafts, strict=True)]
        length = max(len(c) for c in chunks)
        width = max(len(d) for d in drafts) + 1
        tokens = torch.zeros(batch, length, dtype=torch.int64)
        for row, chunk in enumerate(chunks):
            tokens[row, : len(chunk)] = torch.tensor(chunk)
        cache_lengths = torch.tensor([s.cache_length for s in active])
        positions = cache_lengths[:, None] + torch.arange(length)
        first_sampled = torch.tensor([len(s.pending) - 1 for s in active])
        select = (first_sampled[:, None] + torch.arange(width)).clamp(max=length - 1)
        logits = self.model.forward(
            tokens.to(self.device), positions.to(self.device), cache, select.to(self.device),
            return_hidden=self._reads_hidden,
        )  # fmt: skip
        if self._reads_hidden:
            logits, hidden_BTH = logits
        self.num_forward_passes += 1
        if on_forward is not None:
            on_forward(_forward_pass(active, chunks, width * self.vocab_size, head_call=self._head_call))
        sampled, logprobs, near_ties = self._sample(active, logits, drafts)
        for row, (sequence, draft) in enumerate(zip(active, drafts, strict=True)):
            fed, before = len(sequence.pending), len(sequence.tokens)
            ties = None if near_ties is None else (near_ties[0][row], near_ties[1][row])
            accepted = sequence.record(draft, sampled[row], logprobs[row], self._proposal, near_ties=ties)
            if self._reads_hidden:
                self._after_head_pass(sequence, hidden_BTH[row], before, list(range(accepted)), own[row], len(draft))
            # Rejected draft tokens need no undo: their cache entries are overwritten before anything reads them.
            sequence.cache_length += fed + accepted
            sequence.pending = sequence.tokens[-1:]

    def _head_drafts(self, active: list[_Slot], drafts: list[list[int]]) -> list[list[int]]:
        """Each sequence's proposal, the draft head's where it has none of its own (up to the head's tokens for the
        pass, within the draft room): one head call for every such sequence that holds pairs (a sequence's first pass
        has none), each token the keyed sample of the head's logits at its response position."""
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
        contexts = [len(s.head_tokens) for s in chosen]
        self._head_call = drafting_call_counts(contexts, [0] * len(chosen), num_tokens, self._head.window,
                                               self.vocab_size)  # fmt: skip
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

    def _tree_candidates(self, active: list[_Slot]) -> tuple[list[list[tuple[str, list[int]]]], list[int]]:
        """Each sequence's candidates (:meth:`~bubblespec.verify.sequence.Sequence.propose_candidates`), the first
        the draft head's where a sequence has none (the tree stores it as nodes 0, 1, ...; a head's proposal
        alone counts as the request's, as in a linear pass), and the first candidate's own length."""
        candidates = [s.propose_candidates(self._proposal) for s in active]
        own = [len(c[0][1]) if c else 0 for c in candidates]
        if self._head is None:
            return candidates, own
        firsts = self._head_drafts(active, [c[0][1] if c else [] for c in candidates])
        extended = [
            [(c[0][0] if c else REQUEST_DRAFT, first), *c[1:]] if first else c
            for c, first in zip(candidates, firsts, strict=True)
        ]
        return extended, own

    def _tree_step(self, active: list[_Slot], cache: KVCache, on_forward) -> None:
        """One forward pass in which every sequence verifies its candidates as a token tree
        (:mod:`bubblespec.verify.tree`): the tree's nodes follow the pending tokens, stored at the next cache
        positions in node order, each at its depth's position in the sequence and seeing only its ancestors. The
        first candidate's nodes are stored where they stand, so with one candidate this is :meth:`_step`'s pass;
        the accepted path's keys and values are moved to their positions afterwards."""
        batch = len(active)
        budgets = tree_budgets(active, self._proposal)
        candidates, own = self._tree_candidates(active)
        trees = [DraftTree.of(c, b) for c, b in zip(candidates, budgets, strict=True)]
        chunks = [s.pending + t.tokens for s, t in zip(active, trees, strict=True)]
        length = max(len(c) for c in chunks)
        width = max(len(t) for t in trees) + 1
        tokens = torch.zeros(batch, length, dtype=torch.int64)
        depths = torch.arange(length)[None, :].repeat(batch, 1)  # a chunk index's position past the cache
        visible = torch.ones(length, length, dtype=torch.bool).tril()[None].repeat(batch, 1, 1)
        for row, (sequence, tree, chunk) in enumerate(zip(active, trees, chunks, strict=True)):
            tokens[row, : len(chunk)] = torch.tensor(chunk)
            fed = len(sequence.pending)
            depths[row, : len(chunk)] = torch.tensor(tree.chunk_positions(fed))
            visible[row, : len(chunk), : len(chunk)] = tree.chunk_visible(fed)
        cache_lengths = torch.tensor([s.cache_length for s in active])
        positions = cache_lengths[:, None] + torch.arange(length)
        first_sampled = torch.tensor([len(s.pending) - 1 for s in active])
        select = (first_sampled[:, None] + torch.arange(width)).clamp(max=length - 1)
        token_tree = TokenTree((cache_lengths[:, None] + depths).to(self.device), visible.to(self.device))
        logits = self.model.forward(
            tokens.to(self.device), positions.to(self.device), cache, select.to(self.device), token_tree,
            return_hidden=self._reads_hidden,
        )  # fmt: skip
        if self._reads_hidden:
            logits, hidden_BTH = logits
        self.num_forward_passes += 1
        if on_forward is not None:
            attended = [t.attention_pairs(len(s.pending), s.cache_length) for s, t in zip(active, trees, strict=True)]
            on_forward(_forward_pass(active, chunks, width * self.vocab_size, attended, self._head_call))
        # One sample per scored position, each with its own path before it (the repetition penalty sees it).
        rows = [(row, sequence, index) for row, sequence in enumerate(active) for index in range(len(trees[row]) + 1)]
        paths = [trees[row].path_tokens(index - 1) if index else [] for row, _, index in rows]
        sampled, logprobs, near_ties = self._sample(
            [sequence for _, sequence, _ in rows],
            logits[[row for row, _, _ in rows], [index for _, _, index in rows]][:, None],
            paths,
            [len(path) for path in paths],
        )
        first = 0
        for slot, (sequence, tree) in enumerate(zip(active, trees, strict=True)):
            scored = slice(first, first + len(tree) + 1)
            samples = [row[0] for row in sampled[scored]]
            row_logprobs = [row[0] for row in logprobs[scored]]
            ties = None if near_ties is None else tuple([row[0] for row in values[scored]] for values in near_ties)
            first = scored.stop
            fed, before = len(sequence.pending), len(sequence.tokens)
            path = sequence.record_tree(tree, samples, row_logprobs, self._proposal, ties)
            if self._reads_hidden:
                proposed = len(tree.candidates[0][1]) if tree.candidates else 0
                self._after_head_pass(sequence, hidden_BTH[slot], before, path, own[slot], proposed)
            moved = [(fed + node, fed + j) for j, node in enumerate(path) if node != j]
            if moved:
                base = sequence.cache_length
                cache.move_positions(slot, [base + src for src, _ in moved], [base + dst for _, dst in moved])
            sequence.cache_length += fed + len(path)
            sequence.pending = sequence.tokens[-1:]

    def _sample(self, active: list[_Slot], logits: torch.Tensor, drafts: list[list[int]], offsets=None):
        """Keyed samples [B][W] and their logprobs at every selected position, as lists, and where a request asks
        for margins (a drafting call) the runner-ups and margins there ([B][W] each; None where none asks)."""
        if self.config.verification == "one_hot":  # stream 0 is the key's own noise; version v samples stream v + 1
            stream = (self._policy_version + 1) % 2**32
            return (*keyed_samples(logits, active, drafts, offsets, stream=stream), None)
        if any(sequence.request.margins for sequence in active):
            tokens, logprobs, runner_ups, margins = keyed_samples_with_near_ties(logits, active, drafts, offsets)
            return tokens, logprobs, (runner_ups, margins)
        return (*keyed_samples(logits, active, drafts, offsets), None)


def _head_sampler(sequences: list[_Slot]):
    """The keyed sampler a draft head drafts ``sequences``' rows with: each row's key noise and sampling settings
    at the given response positions (the repetition penalty over the prompt and the response so far)."""

    def sample(logits_B1V: torch.Tensor, positions_B1: torch.Tensor) -> torch.Tensor:
        offsets = [p - len(s.tokens) for p, s in zip(positions_B1[:, 0].tolist(), sequences, strict=True)]
        tokens, _ = keyed_samples(logits_B1V, sequences, [[] for _ in sequences], offsets)
        return torch.tensor(tokens)

    return sample


def _forward_pass(
    active: list[_Slot],
    chunks: list[list[int]],
    logits_per_row: int,
    attended: list[int] | None = None,
    head_call: dict[str, int] | None = None,
) -> ForwardPass:
    """What a pass computed; ``attended``: per sequence, the (query, key) pairs its chunk attended (default: a
    causal chunk after its cache); ``head_call``: the draft-head call before it
    (:func:`~bubblespec.models.draft_head.drafting_call_counts`)."""
    fed = [len(chunk) for chunk in chunks]
    starts = [s.cache_length for s in active]
    if attended is None:
        attended = [n * start + n * (n + 1) // 2 for start, n in zip(starts, fed, strict=True)]
    contexts = [start + n for start, n in zip(starts, fed, strict=True)]
    padded = len(active) * max(fed)  # every row is padded to the longest chunk and attends the longest context
    return ForwardPass(
        num_sequences=len(active),
        num_tokens=sum(fed),
        context_tokens=sum(contexts),
        attention_pairs=sum(attended),
        sampled_logits=len(active) * logits_per_row,
        padded_tokens=padded,
        padded_attention_pairs=padded * max(contexts),
        **(head_call or {}),
    )
