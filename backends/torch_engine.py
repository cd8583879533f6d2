"""The built-in engine: batched keyed decoding with exact speculative verification, in plain torch.

Every forward pass feeds each active sequence one chunk: a new sequence its prompt, a running one its last
sampled token; either followed by up to ``max_draft_tokens_per_step`` draft tokens at the positions they
propose. The keyed samples at the chunk's last prompt/last token and at every draft position decide how many
draft tokens are accepted (:func:`bubblespec.sampling.count_accepted`); the rest are rolled back for free,
because the cache is addressed by absolute position (see :mod:`bubblespec.backends.torch_model`). Finished
sequences leave the batch at once and queued requests take their slots (continuous batching), so a shard's
long tail does not hold short requests hostage. Drafts align by position: after a mismatch the next step
proposes the draft's tokens at the following positions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from bubblespec import plugins, sampling
from bubblespec.backends.torch_model import DTYPES, DecoderModel, KVCache, read_checkpoint
from bubblespec.config import engine_config
from bubblespec.draft_sources import REQUEST_DRAFT, ProposalContext
from bubblespec.drafts import check_request, realign, stop_token_ids
from bubblespec.errors import RequestError
from bubblespec.interfaces import (
    FinishReason,
    ForwardPass,
    GenerationRequest,
    GenerationResult,
    RequestStats,
    StopSignal,
)


class TorchEngineConfig(BaseModel):
    """Settings of the built-in torch engine (``rollout.engine`` in a run config)."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model_path: str
    """A local Hugging Face model folder (config.json + *.safetensors) of a Llama, Qwen2 or Mistral model."""
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    """Weights and activations; float64 makes speculation bit-identical to plain decoding."""
    device: str = "cpu"
    """A torch device: "cpu", "cuda" or "cuda:N"."""

    @field_validator("device")
    @classmethod
    def _is_a_device(cls, device: str) -> str:
        # Only the spelling: settings are checked where the run starts, which need not be where ranks run.
        try:
            torch.device(device)
        except RuntimeError:
            raise ValueError(f"{device!r} is not a torch device; use cpu, cuda or cuda:N") from None
        return device

    max_batch_size: int = Field(64, ge=1)
    """Sequences decoded together in one forward pass; more requests wait for a free slot."""
    max_draft_tokens_per_step: int = Field(16, ge=0)
    """Draft tokens a sequence may verify in one forward pass (0 turns speculation off)."""
    verification: Literal["coupled", "one_hot"] = "coupled"
    """"coupled": keyed sampling, outputs identical with and without drafts. "one_hot": the engine's own RNG,
    outputs exact in distribution only (for comparison with engines that cannot take keyed noise)."""
    adaptive_draft_length: bool = False
    """Shrink a sequence's proposals to what its last verify step accepted (+1) and grow them again after full
    acceptance. Worth it where a forward pass costs in proportion to its tokens (this CPU engine)."""
    draft_alignment: Literal["position", "suffix"] = "suffix"
    """After a rejected draft token: keep proposing the draft at the next positions ("position"), or first
    re-align it by matching the response's latest tokens ("suffix", falling back to position)."""
    draft_chain: tuple[str, ...] = (REQUEST_DRAFT,)
    """Where proposals come from, in priority order: ``"request"`` (the request's own draft) and dynamic draft
    sources (entry point group ``bubblespec.draft_sources``, e.g. ``"group"``, ``"ngram"``). Each forward pass
    a sequence takes the first non-empty proposal; the request's draft has none when it is missing, used up or
    diverged with no suffix re-alignment (see :mod:`bubblespec.draft_sources`)."""
    draft_source_options: dict[str, dict] = {}
    """Keyword arguments of each dynamic source's constructor, by source name."""
    rank: int = Field(0, ge=0)
    """The data-parallel rank this engine serves (it seeds the one-hot RNG stream; remote backends pick a server
    by it)."""
    one_hot_seed: int = 0
    """Seed of the RNG that one-hot verification samples with (a run passes its ``seed``); every rank draws from
    its own stream, seeded by (one_hot_seed, rank), so that ranks never draw the same numbers."""
    num_threads: int | None = Field(None, ge=1)
    """torch intra-op threads; None leaves torch's setting alone."""


@dataclass
class _Sequence:
    """Decoding state of one request while it holds a batch slot."""

    index: int
    request: GenerationRequest
    max_new_tokens: int
    stop_ids: frozenset[int]
    noise_seed: tuple[int, int]  # the key's hash, computed once rather than at every forward pass
    pending: list[int]  # tokens to feed next, not yet in the cache
    cache_length: int = 0  # positions [0, cache_length) of this slot hold valid keys and values
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)

    draft_offset: int = 0  # the draft token proposed for response position i is draft[i + draft_offset]
    proposal_limit: int | None = None  # adaptive proposal length; None: max_draft_tokens_per_step
    # the other samples of the same prompt and step in this generate call (group drafting)
    siblings: list[_Sequence] = field(default_factory=list, repr=False, compare=False)
    diverged: bool = False  # the request's draft mismatched and no suffix re-alignment was found (chains only)
    proposed_by: str = REQUEST_DRAFT  # which source proposed the last chunk

    def draft_chunk(self, limit: int) -> list[int]:
        """Draft tokens proposed for the next positions."""
        draft = self.request.draft
        if draft is None or limit <= 0:
            return []
        room = self.max_new_tokens - len(self.tokens) - 1  # one sampled token always follows the draft tokens
        start = len(self.tokens) + self.draft_offset
        if start < 0:
            return []
        return list(draft.token_ids[start : start + min(limit, room)])

    def after_mismatch(self, alignment: str) -> None:
        """Positional alignment keeps proposing the draft's tokens at the following positions; suffix alignment
        first looks for where the response's latest tokens continue in the draft (falling back to position)."""
        if alignment == "suffix" and self.request.draft is not None:
            found = realign(self.tokens, self.request.draft.token_ids, self.draft_offset)
            if found is not None:
                self.draft_offset = found
            self.diverged = found is None

    def aligned_draft_chunk(self, limit: int) -> list[int]:
        """The request draft's proposal when a draft chain has other sources to fall back on: none while the
        draft has diverged, unless the response's latest tokens re-align to it now."""
        if self.diverged and self.request.draft is not None:
            found = realign(self.tokens, self.request.draft.token_ids, self.draft_offset)
            if found is None:
                return []
            self.draft_offset, self.diverged = found, False
        return self.draft_chunk(limit)

    def context(self) -> ProposalContext:
        return ProposalContext(
            key=self.request.key,
            prompt_token_ids=self.request.prompt_token_ids,
            tokens=self.tokens,
            siblings=[s.tokens for s in self.siblings],
        )


class TorchEngine:
    """A :class:`bubblespec.interfaces.GenerationEngine` on a Llama/Qwen2-family checkpoint, CPU or CUDA."""

    config_class = TorchEngineConfig
    supports_draft_chain = True
    """Runs dynamic draft sources (``ngram``, ``group``, plugins) itself: see ``TorchEngineConfig.draft_chain``."""

    def __init__(self, config: TorchEngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RequestError(f"device {config.device!r} was asked for but torch sees no CUDA device; use 'cpu'")
        self.model_config, weights = read_checkpoint(config.model_path)
        self.model = DecoderModel(self.model_config, weights, DTYPES[config.dtype], device)
        self.device = device
        self._policy_version = 0
        self._cache: KVCache | None = None
        stream = (config.one_hot_seed * 1_000_003 + config.rank) % 2**63
        self._generator = torch.Generator(device=device).manual_seed(stream)
        self.num_forward_passes = 0  # engine-wide counter, for benchmarks and metrics
        self._proposers = {
            name: _load_proposer(name, config.draft_source_options.get(name, {}))
            for name in config.draft_chain
            if name != REQUEST_DRAFT
        }

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

    def release(self) -> None:
        self._cache = None

    def resume(self) -> None:
        """Nothing to do: the cache is re-allocated by the next ``generate``."""

    def close(self) -> None:
        self._cache = None

    @torch.inference_mode()
    def generate(
        self,
        requests: Sequence[GenerationRequest],
        stop: StopSignal | None = None,
        on_forward: Callable[[ForwardPass], None] | None = None,
    ) -> list[GenerationResult]:
        sequences = [self._admit(i, request) for i, request in enumerate(requests)]
        if self._proposers:
            _link_siblings(sequences)
        results: list[GenerationResult | None] = [None] * len(sequences)
        if not sequences:
            return []
        cache = self._cache_for(sequences)
        waiting = list(reversed(sequences))
        active: list[_Sequence] = []
        while waiting or active:
            if stop is not None and stop.is_set():
                for sequence in active + waiting:
                    results[sequence.index] = _result(sequence, "preempted")
                break
            while waiting and len(active) < cache.keys.shape[1]:
                active.append(waiting.pop())
            finished = self._step(active, cache, on_forward)
            for slot in sorted(finished, reverse=True):
                sequence, reason = active[slot], finished[slot]
                results[sequence.index] = _result(sequence, reason)
                last = len(active) - 1
                if slot != last:  # keep active sequences in slots [0, len(active))
                    cache.move_slot(last, slot)
                    active[slot] = active[last]
                active.pop()
        return results  # type: ignore[return-value]

    def _admit(self, index: int, request: GenerationRequest) -> _Sequence:
        """Checks one request before any work starts; a bad one fails the whole call with a clear error."""
        check_request(index, request, self.vocab_size, self.context_length)
        params = request.sampling
        prompt = request.prompt_token_ids
        max_new = min(params.max_new_tokens, self.context_length - len(prompt))
        stop_ids = stop_token_ids(params, self.model_config.eos_token_ids)
        return _Sequence(
            index=index,
            request=request,
            max_new_tokens=max_new,
            stop_ids=stop_ids,
            noise_seed=request.key.noise_seed(),
            pending=list(prompt),
        )

    def _cache_for(self, sequences: list[_Sequence]) -> KVCache:
        num_slots = min(len(sequences), self.config.max_batch_size)
        longest_chunk = max(max(len(s.pending) for s in sequences), self.config.max_draft_tokens_per_step + 1)
        positions = max(len(s.pending) + s.max_new_tokens for s in sequences) + longest_chunk
        cache = self._cache
        if cache is None or cache.keys.shape[1] < num_slots or cache.max_positions < positions:
            cache = KVCache(self.model_config, num_slots, positions, self.model.dtype, self.device)
            self._cache = cache
        return cache

    def _step(self, active: list[_Sequence], cache: KVCache, on_forward) -> dict[int, FinishReason]:
        """One forward pass over every active sequence; returns {slot: finish reason} of those that finished."""
        batch = len(active)
        most = self.config.max_draft_tokens_per_step
        drafts = [self._propose(s, most if s.proposal_limit is None else s.proposal_limit) for s in active]
        chunks = [s.pending + d for s, d in zip(active, drafts, strict=True)]
        length = max(len(c) for c in chunks)
        width = max(len(d) for d in drafts) + 1
        tokens = torch.zeros(batch, length, dtype=torch.int64)
        draft_tokens = torch.zeros(batch, width - 1, dtype=torch.int64)
        for row, (chunk, draft) in enumerate(zip(chunks, drafts, strict=True)):
            tokens[row, : len(chunk)] = torch.tensor(chunk)
            draft_tokens[row, : len(draft)] = torch.tensor(draft, dtype=torch.int64)
        cache_lengths = torch.tensor([s.cache_length for s in active])
        offsets = torch.arange(length)
        positions = cache_lengths[:, None] + offsets
        # Sample at the last pending token (predicts the next response token) and at every draft token.
        first_sampled = torch.tensor([len(s.pending) - 1 for s in active])
        select = (first_sampled[:, None] + torch.arange(width)).clamp(max=length - 1)
        response_positions = torch.tensor([len(s.tokens) for s in active])[:, None] + torch.arange(width)
        logits = self.model.forward(tokens.to(self.device), positions.to(self.device), cache, select.to(self.device))
        self.num_forward_passes += 1
        if on_forward is not None:
            on_forward(_forward_pass(active, chunks))
        sampled, logprobs = self._sample(active, logits, response_positions)
        num_draft = torch.tensor([len(d) for d in drafts])
        accepted = sampling.count_accepted(sampled, draft_tokens.to(sampled.device), num_draft.to(sampled.device))
        return self._advance(active, drafts, sampled.tolist(), logprobs.tolist(), accepted.tolist())

    def _propose(self, sequence: _Sequence, limit: int) -> list[int]:
        """The draft tokens ``sequence`` verifies next: the first non-empty proposal of the draft chain."""
        chain = self.config.draft_chain
        if chain == (REQUEST_DRAFT,):
            return sequence.draft_chunk(limit)
        limit = min(limit, sequence.max_new_tokens - len(sequence.tokens) - 1)  # a sampled token follows
        if limit <= 0:
            return []
        for name in chain:
            if name == REQUEST_DRAFT:
                chunk = sequence.aligned_draft_chunk(limit)
            else:
                chunk = self._proposers[name].propose(sequence.context(), limit)[:limit]
            if chunk:
                sequence.proposed_by = name
                return chunk
        sequence.proposed_by = REQUEST_DRAFT  # nothing else proposes: the diverged draft, by position
        return sequence.draft_chunk(limit) if REQUEST_DRAFT in chain else []

    def _sample(self, active: list[_Sequence], logits: torch.Tensor, response_positions: torch.Tensor):
        params = [s.request.sampling for s in active]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float64, device=self.device)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=self.device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=self.device)
        if self.config.verification == "one_hot":
            return sampling.engine_sample(logits, temperature, top_k, top_p, generator=self._generator)
        seeds = torch.tensor([s.noise_seed for s in active], dtype=torch.int64)
        return sampling.keyed_sample(logits, seeds, response_positions.to(self.device), temperature, top_k, top_p)

    def _advance(self, active, drafts, sampled, logprobs, accepted) -> dict[int, FinishReason]:
        finished: dict[int, FinishReason] = {}
        for slot, sequence in enumerate(active):
            num_accepted = accepted[slot]
            emitted, emitted_logprobs = sampled[slot][: num_accepted + 1], logprobs[slot][: num_accepted + 1]
            stats = sequence.stats
            if not sequence.tokens:
                stats.prefill_tokens = len(sequence.pending)
            sequence.cache_length += len(sequence.pending) + num_accepted
            emitted, reason = _finish(sequence, emitted)
            if reason is not None:
                finished[slot] = reason
            stats.decode_steps += 1
            if drafts[slot]:
                stats.verify_steps += 1
                stats.draft_tokens_proposed += len(drafts[slot])
                # Accepted tokens after a stop token are not emitted, so they do not count.
                counted = min(num_accepted, len(emitted))
                stats.draft_tokens_accepted += counted
                stats.acceptance_lengths[counted + 1] = stats.acceptance_lengths.get(counted + 1, 0) + 1
            sequence.tokens += emitted
            sequence.logprobs += emitted_logprobs[: len(emitted)]
            sequence.pending = [emitted[-1]]
            if num_accepted < len(drafts[slot]) and sequence.proposed_by == REQUEST_DRAFT:
                sequence.after_mismatch(self.config.draft_alignment)
            if self.config.adaptive_draft_length and drafts[slot]:
                # Propose what the last verify step accepted, plus one; double after a full acceptance. Where a
                # forward pass costs in proportion to its tokens (CPUs, compute-bound GPUs) this stops paying
                # for long proposals that a diverged draft keeps failing.
                most = self.config.max_draft_tokens_per_step
                full = num_accepted == len(drafts[slot])
                sequence.proposal_limit = min(most, 2 * len(drafts[slot]) if full else num_accepted + 1)
        return finished


def _load_proposer(name: str, options: dict):
    source = plugins.load("draft_sources", name)
    if getattr(source, "kind", None) != "dynamic":
        raise RequestError(
            f"draft source {name!r} is not a dynamic source and cannot propose inside the engine; only the "
            f"request's own draft ({REQUEST_DRAFT!r}) and dynamic sources belong in draft_chain"
        )
    try:
        return source(**options)
    except (TypeError, ValueError) as error:  # an option the source does not take, or a bad value
        raise RequestError(f"draft source {name!r} with options {options}: {error}") from None


def _link_siblings(sequences: list[_Sequence]) -> None:
    """Gives each sequence the others of its prompt and step (the group drafting of dynamic sources)."""
    groups: dict[tuple[int, int, str], list[_Sequence]] = {}
    for sequence in sequences:
        key = sequence.request.key
        groups.setdefault((key.run_seed, key.step, key.prompt_uid), []).append(sequence)
    for group in groups.values():
        group.sort(key=lambda s: s.request.key.sample_index)
        for sequence in group:
            sequence.siblings = [s for s in group if s is not sequence]


def _forward_pass(active: list[_Sequence], chunks: list[list[int]]) -> ForwardPass:
    fed = [len(chunk) for chunk in chunks]
    starts = [s.cache_length for s in active]
    return ForwardPass(
        num_sequences=len(active),
        num_tokens=sum(fed),
        context_tokens=sum(start + n for start, n in zip(starts, fed, strict=True)),
        attention_pairs=sum(n * start + n * (n + 1) // 2 for start, n in zip(starts, fed, strict=True)),
    )


def _finish(sequence: _Sequence, emitted: list[int]) -> tuple[list[int], FinishReason | None]:
    """The emitted tokens to keep (up to and including a stop token) and the finish reason, if any."""
    for i, token in enumerate(emitted):
        if token in sequence.stop_ids:
            return emitted[: i + 1], "stop"
    if len(sequence.tokens) + len(emitted) >= sequence.max_new_tokens:
        return emitted, "length"
    return emitted, None


def _result(sequence: _Sequence, reason: FinishReason) -> GenerationResult:
    return GenerationResult(
        key=sequence.request.key,
        token_ids=sequence.tokens,
        logprobs=sequence.logprobs,
        finish_reason=reason,
        stats=sequence.stats,
    )
