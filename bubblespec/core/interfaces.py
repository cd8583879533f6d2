"""The contracts between bubblespec's parts, and the data they exchange.

Everything a plugin author implements is declared here. What every part of a kind must do is a ``typing.Protocol``
(:class:`GenerationEngine`, :class:`DraftStore`, :class:`BubblePolicy`, :class:`PromptSource`, :class:`RewardFn`);
a plugin subclasses the base class of its kind (:class:`Engine`, :class:`DraftStoreBase`, :class:`Task`), which
declares every optional ability with its default, so that callers never probe for one by name. Plugins are found
through entry points (see :mod:`bubblespec.core.plugins`); nothing here imports an engine. Draft sources have their
bases in :mod:`bubblespec.core.draft_sources`, rank pools in :mod:`bubblespec.rollout.bubble_scheduler`.

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
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple, Protocol, runtime_checkable

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
    """How to sample one response. ``temperature == 0`` is greedy; ``top_k == 0``, ``top_p == 1``, ``min_p == 0``
    and ``repetition_penalty == 1`` disable those. Applied in transformers' order (:func:`bubblespec.verify.sampling.
    mask_logits`): the repetition penalty on the raw logits (every token of the prompt and of the response so far),
    the temperature, the suppressed tokens, then top-k, top-p and min-p."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    """Keep the tokens whose probability is at least this share of the most likely one's."""
    repetition_penalty: float = 1.0
    """Divide the logit of every token already in the sequence by this where it is positive, multiply it where not."""
    suppressed_token_ids: tuple[int, ...] = ()
    """Tokens never sampled (probability 0, greedy too), e.g. a pad token that ends nothing; the trainer scores
    responses under the same distribution."""

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
        if not isinstance(self.min_p, int | float) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p!r}")
        penalty = self.repetition_penalty
        if not (isinstance(penalty, int | float) and math.isfinite(penalty)) or penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 disables it), got {penalty!r}")
        for name in ("stop_token_ids", "suppressed_token_ids"):
            ids = getattr(self, name)
            if any(not isinstance(t, int) or t < 0 for t in ids):
                raise ValueError(f"{name} must be non-negative integers, got {ids!r}")
        stopping = sorted(set(self.suppressed_token_ids) & set(self.stop_token_ids))
        if stopping:
            raise ValueError(
                f"suppressed_token_ids {stopping} are also stop tokens: a response could never end on them; "
                "suppress tokens that end nothing"
            )

    def settings_of(self, names: Sequence[str]) -> list[str]:
        """``name=value`` for each of ``names`` this sets to other than its default: what a backend that cannot apply
        those settings (:attr:`Engine.unsupported_sampling`) refuses."""
        return [f"{name}={getattr(self, name)}" for name in names if getattr(self, name) != _DEFAULT_FIELDS[name]]


_DEFAULT_FIELDS = {f.name: f.default for f in fields(SamplingParams)}


class NearTie(NamedTuple):
    """A drafted position where a newer policy may take another token (docs/design.md §12): at draft index
    ``index`` the drafting policy's runner-up ``token``, ``margin`` below its sample in perturbed score
    (``z / T + G``, the same noise for every policy, so a small update flips a sample only near such a tie)."""

    index: int
    token: int
    margin: float


@dataclass(frozen=True, slots=True)
class DraftBranch:
    """Where a draft's path may go instead: from draft index ``index`` on, ``token_ids`` (the near-tie's runner-up
    first, then the drafting policy's keyed continuation after it), with near-ties and branches of its own, indexed
    like the draft's (response positions). A verifier that emits ``token_ids[0]`` at ``index`` follows it."""

    index: int
    token_ids: tuple[int, ...]
    finished: bool = False
    """As :attr:`Draft.finished`, for this branch's continuation."""
    near_ties: tuple[NearTie, ...] = ()
    branches: tuple[DraftBranch, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens in the branch and in every branch under it."""
        return len(self.token_ids) + sum(branch.num_tokens for branch in self.branches)


@dataclass(frozen=True, slots=True)
class Draft:
    """Tokens proposed for a future rollout key, produced by policy version ``policy_version``.

    Only token ids are stored, never the producing policy's probabilities: verification needs none of them and
    using a stale distribution is the classic way to lose exactness. A draft may be a trie (draft tries,
    docs/design.md §12): ``near_ties`` says where the drafting policy nearly sampled another token, ``branches``
    where the path continues after such a token; a verifier follows the branch whose first token it emits.
    """

    key: RolloutKey
    token_ids: tuple[int, ...]
    policy_version: int
    finished: bool = False
    """True when the drafting policy ended the response (a stop token or the length limit); False when a barrier
    cut it off, so that a later bubble may continue it from where it stopped."""
    near_ties: tuple[NearTie, ...] = ()
    """The drafted positions whose margin was within the drafting engine's limit, by index (none where the engine
    reports no margins)."""
    branches: tuple[DraftBranch, ...] = ()
    """Other paths from this draft's positions, by index."""

    def __post_init__(self) -> None:
        if not isinstance(self.key, RolloutKey):
            raise TypeError(f"Draft.key must be a RolloutKey, got {type(self.key).__name__}")

    @property
    def num_tokens(self) -> int:
        """Tokens held: the draft's and every branch's (what a draft store counts against its cap)."""
        return len(self.token_ids) + sum(branch.num_tokens for branch in self.branches)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One response to generate. A draft, if any, may only make generation faster, never change its output."""

    prompt_token_ids: tuple[int, ...]
    key: RolloutKey
    sampling: SamplingParams = field(default_factory=SamplingParams)
    draft: Draft | None = None
    response_prefix: tuple[int, ...] = ()
    """The response's first tokens, given rather than sampled (drafting a branch: the draft's path up to a near-tie
    and the runner-up there); sampling starts after them, at their keyed positions. The result's tokens begin with
    them (logprob 0 each). Engines with :attr:`Engine.supports_draft_tries` only; others refuse it."""
    margins: bool = False
    """Also report each sampled token's runner-up and Gumbel-max margin (:attr:`GenerationResult.margins`): a
    drafting call whose draft may grow branches. Engines with :attr:`Engine.supports_draft_tries` only; others
    ignore it (their results carry no margins)."""


@dataclass(slots=True)
class RequestStats:
    """What generating one response cost.

    ``decode_steps`` counts the forward passes in which this request emitted tokens, its prefill pass included
    (a response of N tokens without drafts costs N);
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
    branches_followed: int = 0
    """Times the response left its draft's path onto one of the draft's branches (draft tries)."""
    given_tokens: int = 0
    """Response tokens the request gave rather than sampled (:attr:`GenerationRequest.response_prefix`)."""
    head_tokens_proposed: int = 0
    """Draft tokens an engine's draft head proposed after the sequence's own proposal, in the passes where that left
    room (counted in :attr:`draft_tokens_proposed` too)."""
    head_tokens_accepted: int = 0
    """Of :attr:`head_tokens_proposed`, those verification accepted and the response kept (counted in
    :attr:`draft_tokens_accepted` too)."""
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    """:attr:`draft_tokens_accepted` by the draft-chain source that proposed them: ``request`` (the request's draft,
    its branches included), a dynamic source's name (``ngram``, ``suffix``, ...), ``head`` (an engine's draft head).
    In a token tree a pass's accepted tokens go to the candidate that holds the accepted path, the first in priority
    order where several do (a head's tokens on a prefix another candidate shares and continues are that one's)."""

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
    runner_up_ids: list[int] = field(default_factory=list)
    """Where the request asked for margins: the runner-up at each of ``token_ids``' positions, -1 where the margin
    was above the engine's limit, the row greedy, or the token given (a response prefix); empty otherwise."""
    margins: list[float] = field(default_factory=list)
    """Alongside :attr:`runner_up_ids`: each token's Gumbel-max margin (its perturbed score less the runner-up's),
    ``inf`` where no runner-up is reported."""

    def near_ties(self, margin_limit: float = float("inf")) -> tuple[NearTie, ...]:
        """The positions with a runner-up within ``margin_limit``, as a draft holds them."""
        return tuple(
            NearTie(index, token, margin)
            for index, (token, margin) in enumerate(zip(self.runner_up_ids, self.margins, strict=True))
            if token >= 0 and margin <= margin_limit
        )


@dataclass(frozen=True, slots=True)
class ForwardPass:
    """What one engine forward pass computed, for cost models and metrics (see :mod:`bubblespec.rollout.clocks`)."""

    num_sequences: int
    num_tokens: int
    """Tokens fed (prompt, last sampled token and draft tokens), padding excluded."""
    context_tokens: int
    """Cache positions read, summed over sequences (each sequence's context after this pass)."""
    attention_pairs: int
    """(query, context position) pairs attended, summed over sequences."""
    sampled_logits: int = 0
    """Logits sampled from after the pass: rows x positions x vocabulary (0 where an engine does not say)."""
    padded_tokens: int = 0
    """Positions computed, padding included, where the engine pads its batch to the longest chunk (rows x that
    chunk's length); 0 where it does not pad (then :attr:`computed_tokens` is :attr:`num_tokens`)."""
    padded_attention_pairs: int = 0
    """(query, key) pairs computed, padding and masked pairs included, where the engine pads (every row's padded
    chunk over the longest context); 0 where it does not pad."""
    head_steps: int = 0
    """Sequential steps of the draft-head call that ran just before this pass to extend its proposals (one
    :meth:`~bubblespec.models.draft_head.DraftHead.draft` call per pass at most: its ``num_tokens``); 0: no head
    call."""
    head_tokens: int = 0
    """Draft tokens the head computed, summed over its rows (rows x steps: given tokens included, the layer still
    runs for them)."""
    head_context_pairs: int = 0
    """Context pairs the head call fed through fc and the key/value projections, summed over rows (each row's
    ``min(window, pairs) - 1``)."""
    head_attention_pairs: int = 0
    """(query, key) pairs the head call's steps attended, summed over rows."""
    head_sampled_logits: int = 0
    """Logits the head call's output head computed and keyed sampling drew from: rows x vocabulary per step where
    they ran, summed over steps."""

    @property
    def computed_tokens(self) -> int:
        """Positions the pass computed: :attr:`padded_tokens` where the engine pads, else :attr:`num_tokens`."""
        return self.padded_tokens or self.num_tokens

    @property
    def computed_attention_pairs(self) -> int:
        """Attention pairs the pass computed: :attr:`padded_attention_pairs` where the engine pads, else
        :attr:`attention_pairs`."""
        return self.padded_attention_pairs or self.attention_pairs


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


class Engine:
    """The base class of engine backends (plugin group ``bubblespec.backends``): a :class:`GenerationEngine` with
    every optional ability declared and its default. A backend overrides what it has."""

    config_class: ClassVar[type | None] = None
    """The pydantic model of the backend's settings (``from_pretrained``'s keyword arguments), a subclass of
    ``bubblespec.core.config.EngineSettings``: a run and ``bubblespec validate`` check them before anything starts.
    None: ``EngineSettings`` itself (the common settings only; any ``rollout.engine_options`` is refused)."""
    supports_draft_chain: ClassVar[bool] = False
    """Whether the engine runs dynamic draft sources inside itself (takes the ``draft_chain`` and
    ``draft_source_options`` settings)."""
    supports_draft_trees: ClassVar[bool] = False
    """Whether the engine verifies several candidates per sequence and forward pass as a token tree
    (``draft_candidates`` > 1); an engine without it verifies the first candidate only."""
    supports_draft_tries: ClassVar[bool] = False
    """Whether the engine reports margins (:attr:`GenerationRequest.margins`) and takes a
    :attr:`GenerationRequest.response_prefix`, so that the bubble can draft a trie's branches on it. Following a
    draft's branches needs neither: every engine on :class:`bubblespec.verify.sequence.Sequence` follows them."""
    supports_draft_head: ClassVar[bool] = False
    """Whether the engine drafts with a draft head it learns online (``speculation.draft_head``, docs/design.md §14):
    it has ``learn_draft_head(samples, learning)``, ``draft_head_state()``, ``load_draft_head_state(state,
    learning)``, ``pause_draft_head()``, a ``keep_hidden`` flag and ``hidden_kept(samples)`` (the torch engine's;
    docs/plugins.md)."""
    unsupported_sampling: ClassVar[tuple[str, ...]] = ()
    """:class:`SamplingParams` fields the engine refuses where they are not at their defaults (a ``RequestError``
    naming them) rather than applies; a run refuses them before anything starts."""

    @classmethod
    def from_pretrained(cls, model_path: str, **settings: Any) -> Engine:
        """An engine on the Hugging Face model folder ``model_path`` (weights loaded), with the run's settings."""
        raise NotImplementedError

    @classmethod
    def check_model(cls, model_path: str) -> None:
        """Raises the error loading ``model_path`` would raise for its architecture, without loading weights; the
        default checks nothing."""

    context_length: int | None = None
    """The most prompt + response tokens one sequence may hold: a response that fills it ends ``"length"`` before
    its ``max_new_tokens``. None: the engine does not say (a schedule that cuts responses then cannot tell a response
    the context ended from one its budget cut where the two limits are equal)."""

    def select_rank(self, rank: int) -> None:
        """The virtual clock's one engine serves every data-parallel rank in turn and calls this before each of
        rank ``rank``'s calls, so that what an engine keeps per rank (the memory of a draft source that learns from
        responses, ``suffix``) is that rank's alone. A rank's own engine is never told; the default keeps nothing."""

    def release(self) -> None:
        """Free memory held for generation (KV cache) while weights stay loaded; the default frees nothing."""

    def resume(self) -> None:
        """Undo ``release``."""

    def close(self) -> None:
        """Free everything; the default holds nothing to free."""


@runtime_checkable
class DraftStore(Protocol):
    """Keeps drafts by rollout key. Refuses malformed drafts (ids outside the vocabulary) with ``ValueError``."""

    def put(self, drafts: Sequence[Draft]) -> None: ...

    def get(self, keys: Sequence[RolloutKey]) -> dict[RolloutKey, Draft]: ...

    def drop(self, keys: Sequence[RolloutKey]) -> None: ...

    def drop_steps_before(self, step: int) -> None: ...

    def __len__(self) -> int: ...


class DraftStoreBase:
    """The base class of draft stores (plugin group ``bubblespec.draft_stores``): a :class:`DraftStore` with its
    optional abilities declared. Built as ``Store(vocab_size=..., max_tokens=..., **draft_store_options)``."""

    def __len__(self) -> int:
        raise NotImplementedError

    def stats(self) -> dict[str, int]:
        """``{"drafts", "tokens", "evicted"}``: the store's size and the drafts evicted so far, for each step's
        record and the metrics. The default knows only the number of drafts."""
        return {"drafts": len(self), "tokens": 0, "evicted": 0}


@runtime_checkable
class BubblePolicy(Protocol):
    """Orders the keys a rank drafts in its bubble; keys first in the list are drafted first."""

    def order(self, keys: Sequence[RolloutKey], predicted_lengths: Mapping[RolloutKey, int]) -> list[RolloutKey]: ...


class Policy:
    """The base class of policies (plugin group ``bubblespec.policies``): a :class:`BubblePolicyBase`, a
    :class:`ShardingPolicyBase` or a :class:`TriesPolicyBase`, told apart by ``role``."""

    role: ClassVar[Literal["bubble", "sharding", "tries"]]


class BubblePolicyBase(Policy):
    """A :class:`BubblePolicy`: which keys idle ranks draft first."""

    role: ClassVar[Literal["bubble", "sharding", "tries"]] = "bubble"

    def order(self, keys: Sequence[RolloutKey], predicted_lengths: Mapping[RolloutKey, int]) -> list[RolloutKey]:
        raise NotImplementedError


class ShardingPolicyBase(Policy):
    """How a step's requests are split across ranks (speed only: keyed sampling makes any split give the same
    tokens)."""

    role: ClassVar[Literal["bubble", "sharding", "tries"]] = "sharding"

    def shard(
        self, requests: Sequence[GenerationRequest], num_ranks: int, predicted_lengths: Mapping[RolloutKey, int]
    ) -> list[list[GenerationRequest]]:
        """One list of requests per rank."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class OpenNearTie:
    """A near-tie of a key's draft trie that has no branch yet, as a :class:`TriesPolicyBase` ranks them."""

    key: RolloutKey
    route: tuple[int, ...]
    """Where in the trie (the indices its branches start at; ``()``: the draft's own path)."""
    tie: NearTie
    path_length: int
    """Tokens of the path the near-tie is on: the response predicted through it."""


class TriesPolicyBase(Policy):
    """Which near-ties idle ranks draft branches from first, once a step's keys are drafted (draft tries,
    docs/design.md §13). Branch tokens cost drafting time and store memory (``speculation.tries_max_tokens_per_rank``
    bounds them), and a branch pays only if the newer policy takes its first token."""

    role: ClassVar[Literal["bubble", "sharding", "tries"]] = "tries"

    def order(self, ties: Sequence[OpenNearTie]) -> list[OpenNearTie]:
        """The near-ties to branch from, best first (leaving some out is allowed: they are not drafted)."""
        raise NotImplementedError


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


class Task:
    """The base class of tasks (plugin group ``bubblespec.tasks``): a :class:`PromptSource` and its
    :class:`RewardFn`, with every optional ability declared and its default.

    Built as ``Task(seed=..., prompts_per_step=..., **task.options)``, plus ``split="train"/"eval"`` if the
    constructor takes ``split`` (the task holds out its own prompts) and ``model_path=...`` if it takes that.
    A subclass implements :meth:`batch`, :meth:`__call__` and :attr:`max_new_tokens`.
    """

    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response besides the model's end of sequence."""
    suppressed_token_ids: tuple[int, ...] = ()
    """Token ids the policy never samples (``rollout.sampling.suppressed_token_ids`` where the config leaves it
    unset), e.g. a pad token that ends nothing."""
    path_options: ClassVar[tuple[str, ...]] = ()
    """Options that are input paths: a config file's relative ones are read from the config file's folder."""
    prompts: Sequence[Prompt] | None = None
    """Every prompt of the task's split, for a task over rows (a dataset); None where prompts are made step by step."""
    num_dropped_prompts: int = 0
    """Rows left out when the task was built (a prompt too long for the model's context)."""
    unknown_token_share: float | None = None
    """Share of prompt tokens that are the tokenizer's unknown token; None where the task has no tokenizer."""
    own_system_prompts: int = 0
    """Rows that bring their own system message (so ``system_prompt`` is not added to them)."""

    @classmethod
    def model_path(cls) -> Path | None:
        """The model folder the task ships (its tokenizer and a trained model), or None: ``model.path`` is needed."""
        return None

    @property
    def max_new_tokens(self) -> int:
        """Response length limit when ``rollout.sampling.max_new_tokens`` is unset."""
        raise NotImplementedError

    def batch(self, step: int) -> list[Prompt]:
        """The prompts of ``step``: a pure function of the task's seed and ``step``."""
        raise NotImplementedError

    def peek(self, step: int) -> list[Prompt] | None:
        """The prompts of a later step, known in advance (the bubble drafts them); None if they cannot be known.
        The default: :meth:`batch`, which is deterministic."""
        return self.batch(step)

    def __call__(self, prompt: Prompt, response_token_ids: Sequence[int]) -> float:
        """The reward of one response."""
        raise NotImplementedError

    def score(self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]) -> list[float]:
        """The rewards of a step's responses; the default calls :meth:`__call__` on each."""
        return [float(self(prompt, response)) for prompt, response in zip(prompts, responses, strict=True)]

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of token ids (for samples.jsonl and the report); the default shows the ids."""
        return " ".join(map(str, token_ids))

    def score_parts(
        self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]
    ) -> tuple[list[float], dict[str, list[float]]]:
        """:meth:`score`'s rewards and, for a reward made of named parts (a weighted sum), each part's own scores
        by its name; the default: no parts."""
        return self.score(prompts, responses), {}

    def reward_names(self) -> list[str]:
        """The rewards the task scores with, as ``bubblespec validate`` shows them; the default: none named."""
        return []

    def unknown_tokens_warning(self) -> str | None:
        """A warning when :attr:`unknown_token_share` says the tokenizer does not fit the data; the default: none."""
        return None

    def take_reward_failures(self) -> RewardFailures:
        """Reward calls that timed out or raised (each scored 0) since the last call; the default has none."""
        return RewardFailures()

    def close(self) -> None:
        """Stop what the task started (a reward worker pool)."""


@dataclass(slots=True)
class RewardFailures:
    """Calls that scored 0 because they timed out or raised, since the last :meth:`Task.take_reward_failures`."""

    timeouts: int = 0
    errors: int = 0
    first_error: str | None = None
    calls: int = 0
    """Reward calls made (failed or not)."""
