"""The contracts between bubblespec's parts, and the data they exchange.

Everything a plugin author implements is declared here as a ``typing.Protocol``: an engine backend
(:class:`GenerationEngine`), a draft store (:class:`DraftStore`), a bubble policy (:class:`BubblePolicy`), a
prompt source (:class:`PromptSource`) and a reward function (:class:`RewardFn`). Plugins are found through
entry points (see :mod:`bubblespec.plugins`); nothing here imports an engine.

Engine lifecycle (one rollout rank). A backend plugin is a class with a ``from_pretrained(model_path=...,
**settings)`` classmethod; the settings are those of the run config's ``rollout`` section (dtype,
max_batch_size, max_draft_tokens_per_step, verification, adaptive_draft_length, num_threads):

    engine = Backend.from_pretrained(model_path=..., **settings)   # loads weights
    results = engine.generate(requests, stop=event)   # a whole shard, or until ``event`` is set
    engine.release()                         # optional: free cache memory while the trainer runs
    engine.update_weights(state_dict, version=t + 1)
    engine.resume()                          # re-allocate what release() freed
    ...
    engine.close()
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "preempted"]


@dataclass(frozen=True, slots=True, order=True)
class RolloutKey:
    """Identifies one requested response: the ``sample_index``-th sample for prompt ``prompt_uid`` at ``step``.

    The keyed sampling noise of a response is a function of this key alone, so the same key gives the same
    tokens whichever rank, batch or step of drafting it is generated in.
    """

    run_seed: int
    step: int
    prompt_uid: str
    sample_index: int

    def noise_seed(self) -> tuple[int, int]:
        """Two 32-bit words that seed the keyed noise of this key (stable across processes and platforms)."""
        text = f"{self.run_seed}\x1f{self.step}\x1f{self.prompt_uid}\x1f{self.sample_index}"
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one response. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable
    those filters."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)) or (
            self.temperature < 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, int | float) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")


@dataclass(frozen=True, slots=True)
class Draft:
    """Tokens proposed for a future rollout key, produced by policy version ``policy_version``.

    Only token ids are stored, never the producing policy's probabilities: verification needs none of them and
    using a stale distribution is the classic way to lose exactness.
    """

    key: RolloutKey
    token_ids: tuple[int, ...]
    policy_version: int
    finished: bool = False
    """True when the drafting policy ended the response (a stop token or the length limit); False when a barrier
    cut it off, so that a later bubble may continue it from where it stopped."""

    def __post_init__(self) -> None:
        if not isinstance(self.key, RolloutKey):
            raise TypeError(f"Draft.key must be a RolloutKey, got {type(self.key).__name__}")


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One response to generate. A draft, if any, may only make generation faster, never change its output."""

    prompt_token_ids: tuple[int, ...]
    key: RolloutKey
    sampling: SamplingParams = field(default_factory=SamplingParams)
    draft: Draft | None = None


@dataclass(slots=True)
class RequestStats:
    """What generating one response cost.

    ``decode_steps`` counts the forward passes after prefill in which this request emitted tokens;
    ``verify_steps`` counts those of them that scored at least one draft token. The acceptance length of a
    verify step is its accepted draft tokens + 1 (the token sampled after them).
    """

    decode_steps: int = 0
    verify_steps: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    prefill_tokens: int = 0
    undecided_steps: int = 0
    """Verify steps that stopped at a position the engine's top-K log-probabilities could not decide: they emit
    their accepted tokens only, and the next step decodes that position plainly."""
    acceptance_lengths: dict[int, int] = field(default_factory=dict)
    """Verify steps by their acceptance length: the distribution behind the mean (and the metrics histogram)."""

    @property
    def acceptance_length_mean(self) -> float:
        return acceptance_length(self.draft_tokens_accepted, self.verify_steps)


def acceptance_length(draft_tokens_accepted: int, verify_steps: int) -> float:
    """Mean tokens emitted per verify step: accepted draft tokens + one sampled token each (0 without any)."""
    return (draft_tokens_accepted + verify_steps) / verify_steps if verify_steps else 0.0


@dataclass(slots=True)
class GenerationResult:
    """The response to one request. ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the
    sampling distribution (temperature, top-k and top-p applied; the raw model distribution when greedy)."""

    key: RolloutKey
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    stats: RequestStats


@dataclass(frozen=True, slots=True)
class ForwardPass:
    """What one engine forward pass computed, for cost models and metrics (see :mod:`bubblespec.clocks`)."""

    num_sequences: int
    num_tokens: int
    """Tokens fed (prompt, last sampled token and draft tokens), padding excluded."""
    context_tokens: int
    """Cache positions read, summed over sequences (each sequence's context after this pass)."""
    attention_pairs: int
    """(query, context position) pairs attended, summed over sequences."""
    sampled_logits: int = 0
    """Logits sampled from after the pass: rows x positions x vocabulary (0 where an engine does not say)."""


@runtime_checkable
class StopSignal(Protocol):
    """Anything with ``is_set()``, e.g. ``threading.Event``: checked before every forward pass."""

    def is_set(self) -> bool: ...


@runtime_checkable
class GenerationEngine(Protocol):
    """One rollout engine (one data-parallel rank).

    ``generate`` must be a pure function of (weights, prompt, key, sampling params) per request: batch
    composition and drafts change its speed only. When ``stop`` becomes set it returns within one forward pass,
    with finish reason ``"preempted"`` for unfinished requests and the tokens they had so far.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def policy_version(self) -> int: ...

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        stop: StopSignal | None = None,
        on_forward: Callable[[ForwardPass], None] | None = None,
    ) -> list[GenerationResult]:
        """Generates every request. ``stop`` is checked before each forward pass; ``on_forward`` is called after
        each one (virtual clocks and metrics use it)."""
        ...

    def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None: ...

    def release(self) -> None:
        """Free memory held for generation (KV cache) while weights stay loaded."""
        ...

    def resume(self) -> None:
        """Undo ``release``; a no-op if nothing was released."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class DraftStore(Protocol):
    """Keeps drafts by rollout key. Refuses malformed drafts (ids outside the vocabulary) with ``ValueError``."""

    def put(self, drafts: Sequence[Draft]) -> None: ...

    def get(self, keys: Sequence[RolloutKey]) -> dict[RolloutKey, Draft]: ...

    def drop(self, keys: Sequence[RolloutKey]) -> None: ...

    def drop_steps_before(self, step: int) -> None: ...

    def __len__(self) -> int: ...


@runtime_checkable
class BubblePolicy(Protocol):
    """Orders the keys a rank drafts in its bubble; keys first in the list are drafted first."""

    def order(self, keys: Sequence[RolloutKey], predicted_lengths: Mapping[RolloutKey, int]) -> list[RolloutKey]: ...


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of a task, with what its reward function needs to score a response."""

    uid: str
    token_ids: tuple[int, ...]
    text: str
    answer: str
    columns: Mapping[str, Any] = field(default_factory=dict, compare=False)
    """The prompt's dataset row, every column (tasks that read a dataset; empty otherwise)."""


@runtime_checkable
class PromptSource(Protocol):
    """Yields each step's prompts. ``batch(step)`` must be deterministic so that step t+1's prompts are known
    during step t (the source is *peekable*); a source that cannot say returns ``None`` from ``peek``."""

    def batch(self, step: int) -> list[Prompt]: ...

    def peek(self, step: int) -> list[Prompt] | None: ...


@runtime_checkable
class RewardFn(Protocol):
    """Scores one response to one prompt."""

    def __call__(self, prompt: Prompt, response_token_ids: Sequence[int]) -> float: ...
