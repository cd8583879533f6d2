"""The built-in engine: batched keyed decoding with exact speculative verification, in plain torch.

Every forward pass feeds each active sequence one chunk: a new sequence its prompt, a running one its last
sampled token; either followed by up to ``max_draft_tokens_per_step`` draft tokens at the positions they
propose. The keyed samples at the chunk's last prompt/last token and at every draft position decide how many
draft tokens are accepted (:mod:`bubblespec.verify.sequence`); the rest are rolled back for free,
because the cache is addressed by absolute position (see :mod:`bubblespec.models.decoder`). Finished
sequences leave the batch at once and queued requests take their slots (continuous batching), so a shard's
long tail does not hold short requests hostage. Drafts align by position: after a mismatch the next step
proposes the draft's tokens at the following positions.

A draft head (:mod:`bubblespec.backends.torch_engine_head`) proposes where a sequence's own proposal is empty
(the draft chain's last source), or where its request's draft has nothing, before the dynamic sources.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import field_validator, model_validator

from bubblespec.backends.torch_engine_head import HeadDrafting
from bubblespec.core.config import DraftChainSettings, EngineSettings, engine_config
from bubblespec.core.draft_sources import HEAD_DRAFT, REQUEST_DRAFT
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


class TorchEngine(HeadDrafting, Engine):
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
        self._init_head()

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

    def release(self) -> None:
        self._cache, self._kept = None, {}  # the trainer gets the memory (kept hidden states not learned from go)

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

    def _step(self, active: list[_Slot], cache: KVCache, on_forward) -> None:
        """One forward pass over every active sequence: each feeds its pending tokens and its draft chunk, and
        is sampled at its last pending token and at every draft token."""
        self._head_call = {}
        if self._proposal.draft_candidates > 1:
            return self._tree_step(active, cache, on_forward)
        batch = len(active)
        early = self._head is not None and self._head_early  # the head before the dynamic sources
        drafts = [s.propose(self._proposal, request_only=early) for s in active]
        own = [len(d) for d in drafts]
        if self._head is not None:
            drafts = self._head_drafts(active, drafts)
        for row, sequence in enumerate(active):
            if early and not drafts[row]:  # neither the request's draft nor the head: the dynamic sources
                drafts[row] = sequence.propose(self._proposal)
                own[row] = len(drafts[row])
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

    def _tree_candidates(self, active: list[_Slot]) -> tuple[list[list[tuple[str, list[int]]]], list[int]]:
        """Each sequence's candidates (:meth:`~bubblespec.verify.sequence.Sequence.propose_candidates`), the first
        the draft head's where a sequence has none (the tree stores it as nodes 0, 1, ..., its source
        :data:`~bubblespec.core.draft_sources.HEAD_DRAFT`; with the head after the request's draft, where it has no
        candidate from the request's draft, the dynamic sources' after the head's), and the first candidate's own
        length (0 for the head's)."""
        candidates = [s.propose_candidates(self._proposal) for s in active]
        own = [len(c[0][1]) if c else 0 for c in candidates]
        if self._head is None:
            return candidates, own
        early = self._head_early
        # after the request's draft: its aligned candidate goes first, not a diverged one's by position (the last)
        ahead = [bool(c) and (not early or (c[0][0] == REQUEST_DRAFT and not s.diverged)) for s, c in
                 zip(active, candidates, strict=True)]  # fmt: skip
        base = [c[0][1] if first else [] for c, first in zip(candidates, ahead, strict=True)]
        firsts = self._head_drafts(active, base)
        for row, (c, first) in enumerate(zip(candidates, firsts, strict=True)):
            if first and not base[row]:
                candidates[row] = [(HEAD_DRAFT, first), *c][: self._proposal.draft_candidates]
                own[row] = 0
        return candidates, own

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
