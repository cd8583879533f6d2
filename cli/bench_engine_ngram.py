"""``bubblespec bench engine --vllm-ngram``: vLLM's own n-gram speculative decoding (prompt lookup) as a baseline
beside bubble drafts, on the same requests and model (pi_t+1).

Two plain vLLM engines are built beside the vLLM backend's, from the same arguments
(:func:`bubblespec.backends.vllm_engine.llm_arguments`) except ``speculative_config``: one with vLLM's ``ngram``
method (:data:`NGRAM_SPECULATIVE_CONFIG`), one without speculative decoding. Both sample with vLLM's own sampler and
its engine-wide RNG, as a vLLM user runs them (a seed per request breaks vLLM 0.32 on the CPU wherever a prefill is
split across steps: its CPU generators have no offset to rewind), so their responses are other samples of the same
distribution than bubblespec's keyed ones, and other samples in each repetition: compare tokens/s, engine steps and
decode steps, never outputs. Speedups are against the vLLM backend's run without drafts (the plain run bubble drafts
are measured against); vLLM's own plain run says how far that run is from vLLM's own sampler.

Why not vLLM's n-gram drafts *and* bubble drafts at once: a vLLM engine has one ``speculative_config``, and the
backend's ``custom_class`` proposer takes it. The backend's ``ngram`` draft source (``speculation.draft_sources``)
proposes prompt lookup from inside that proposer instead, verified by keyed sampling.

vLLM's ``suffix`` method needs ``arctic-inference``, which bubblespec does not install; it is not measured here.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import replace

import torch

from bubblespec.core.errors import ConfigError, EngineError, ModelLoadError
from bubblespec.core.interfaces import GenerationRequest

NGRAM_SPECULATIVE_CONFIG = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
"""vLLM's n-gram drafts as measured: the longest of the sequence's last 2-4 tokens that occurred before in the prompt or
the response, and up to 4 tokens that followed its earliest occurrence (vLLM 0.32's ``ngram_proposer.py``; its
documented example proposes 5 after 4-grams; 4 keeps rejected rows, which cost in proportion on a CPU, fewer)."""
BASELINE_GPU_MEMORY_SHARE = 0.15
"""GPU memory each baseline engine may take, beside the backend's 0.3 and the exactness table's (ignored on CPU)."""
RUNS = ("vllm-sampler", "vllm-ngram")
"""The runs the baseline adds to each batch size: vLLM on its own sampler without drafts, and with n-gram drafts."""


def start_baselines(settings, timed: list[GenerationRequest], new_state: dict) -> VLLMBaselines:
    """vLLM's n-gram engine and its plain one holding pi_t+1 (``new_state``), with the settings of the benchmark's
    vLLM engines (an ``EngineBenchSettings``), warmed up on the first of the ``timed`` requests."""
    from bubblespec.cli.bench_engine_measures import vllm_engine_settings

    check_no_min_p(timed)
    baselines = VLLMBaselines(
        settings.model_path, settings.dtype, vllm_engine_settings(settings), new_state, settings.threads
    )
    baselines.warm_up(timed[0])
    return baselines


def check_no_min_p(requests: list[GenerationRequest]) -> None:
    """vLLM 0.32 refuses ``min_p`` with speculative decoding: one clear error before any engine is built."""
    if any(r.sampling.min_p > 0 for r in requests):
        raise ConfigError(
            "--vllm-ngram: vLLM 0.32 refuses min_p with speculative decoding, and these requests sample with min_p "
            f"{max(r.sampling.min_p for r in requests)} (the task's sampling); leave out --vllm-ngram with them"
        )


class VLLMBaselines:
    """vLLM's n-gram engine and its plain engine on ``model_path`` holding ``state`` (pi_t+1), built once."""

    def __init__(self, model_path: str, dtype: str, engine_settings: dict, state: dict, threads: int) -> None:
        from bubblespec.backends.vllm_engine import VLLMEngineConfig, llm_arguments, reload_weights
        from bubblespec.backends.vllm_glue import VLLM_ENVIRONMENT, filter_weightless_layer_warnings
        from bubblespec.core.config import engine_config

        for name, value in VLLM_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
        import vllm

        _let_vllm_engines_start_beside_numba()
        settings = {**engine_settings, "gpu_memory_utilization": BASELINE_GPU_MEMORY_SHARE}
        config = engine_config("vllm", VLLMEngineConfig, {"model_path": model_path, "dtype": dtype, **settings})
        self.threads = threads
        self.vllm = vllm
        ngram = llm_arguments(config, dict(NGRAM_SPECULATIVE_CONFIG))
        self.llms = {
            "vllm-sampler": _llm(vllm, llm_arguments(config, None)),
            "vllm-ngram": _llm(vllm, {**ngram, "per_request_spec_decode_metrics": "summary"}),  # acceptance per request
        }
        torch._C.set_num_threads(threads)  # vLLM's CPU worker lowers torch's threads (and makes the setter a no-op)
        for llm in self.llms.values():  # pi_t+1, as the backend's engine holds it
            llm.collective_rpc(filter_weightless_layer_warnings)
            if not reload_weights(llm, state):
                raise EngineError("vLLM did not drop its prefix cache after pi_t+1's weights were loaded")
        eos = self.llms["vllm-ngram"].llm_engine.vllm_config.model_config.hf_config.eos_token_id
        self.eos_ids = tuple(e for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
        self.vocab_size = self.llms["vllm-ngram"].llm_engine.vllm_config.model_config.get_vocab_size()

    def warm_up(self, request: GenerationRequest) -> None:
        """One short response from each engine: the n-gram proposer's kernels compile (numba) on their first call,
        seconds that no timed run should hold."""
        short = replace(
            request, sampling=replace(request.sampling, max_new_tokens=min(16, request.sampling.max_new_tokens))
        )
        for llm in self.llms.values():
            VLLMRun(self, llm, [short], 1)()

    def run(self, name: str, requests: list[GenerationRequest], batch_size: int) -> VLLMRun:
        return VLLMRun(self, self.llms[name], requests, batch_size)

    def sampling_params(self, request: GenerationRequest):
        """vLLM's sampling parameters for ``request``: its temperature, top-k, top-p, repetition penalty, length,
        stops (EOS as the vLLM backend reads it) and suppressed tokens; tokens reported as they come, one engine step
        at a time."""
        from vllm.sampling_params import RequestOutputKind

        from bubblespec.verify.drafts import stop_token_ids

        sampling = request.sampling
        suppressed = set(sampling.suppressed_token_ids)
        allowed = [t for t in range(self.vocab_size) if t not in suppressed] if suppressed else None
        return self.vllm.SamplingParams(
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            repetition_penalty=sampling.repetition_penalty,
            max_tokens=sampling.max_new_tokens,
            ignore_eos=True,  # the stops are the ones below
            stop_token_ids=sorted(stop_token_ids(sampling, self.eos_ids)),
            allowed_token_ids=allowed,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )


def _let_vllm_engines_start_beside_numba() -> None:
    """vLLM 0.32 starts every engine by rebinding its kernels wherever a loaded module holds them, reading
    ``vars(value)`` of each module attribute that has a ``__dict__`` (``vllm/triton_utils/dispatcher.py``,
    ``_rebind_kernels``). The n-gram proposer imports numba, and numba llvmlite, whose ``llvmlite.binding.ffi.lib``
    answers every attribute, ``__dict__`` too, with a function wrapper (llvmlite 0.47): from then on no vLLM engine
    could start in the process ("'_lib_fn_wrapper' object has no attribute 'get'"), the exactness table's nor a
    later test's. The wrapper's attribute cache, read first, answers ``__dict__`` with an empty dict instead."""
    from llvmlite.binding import ffi

    ffi.lib._fntab["__dict__"] = {}


def _llm(vllm, arguments: dict):
    try:
        return vllm.LLM(**arguments)
    except Exception as error:  # vLLM raises many types for a model or setting it cannot take
        method = (arguments["speculative_config"] or {}).get("method", "no speculative decoding")
        raise ModelLoadError(
            f"vLLM ({method}) cannot load {arguments['model']!r}: {type(error).__name__}: {error}"
        ) from None


class VLLMRun:
    """A plain vLLM engine generating the requests in batches of ``batch_size``, stepped here: the last call's forward
    passes (engine steps), tokens, decode steps (steps in which a request got tokens, summed over requests) and n-gram
    acceptance (vLLM's per-request speculative-decoding metrics). Returns the tokens generated, as ``_EngineRun``."""

    _request_ids = itertools.count()

    def __init__(self, baselines: VLLMBaselines, llm, requests: list[GenerationRequest], batch_size: int) -> None:
        self.baselines, self.engine = baselines, llm.llm_engine
        self.requests, self.batch_size = requests, batch_size
        self.forward_passes = self.tokens = self.decode_steps = 0
        self.verify_steps = self.draft_tokens_proposed = self.draft_tokens_accepted = 0

    def __call__(self) -> int:
        if torch.get_num_threads() != self.baselines.threads:
            torch._C.set_num_threads(self.baselines.threads)
        self.forward_passes = self.tokens = self.decode_steps = 0
        self.verify_steps = self.draft_tokens_proposed = self.draft_tokens_accepted = 0
        for start in range(0, len(self.requests), self.batch_size):
            self._batch(self.requests[start : start + self.batch_size])
        return self.tokens

    def _batch(self, requests: list[GenerationRequest]) -> None:
        live = set()
        try:
            for request in requests:
                request_id = f"baseline-{next(self._request_ids)}"
                prompt = {"prompt_token_ids": list(request.prompt_token_ids)}
                self.engine.add_request(request_id, prompt, self.baselines.sampling_params(request))
                live.add(request_id)
            while self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                self.forward_passes += 1
                for output in outputs:
                    self._absorb(output, live)
        finally:
            if live:
                self.engine.abort_request(list(live))

    def _absorb(self, output, live: set[str]) -> None:
        completion = output.outputs[0]
        if completion.token_ids:
            self.tokens += len(completion.token_ids)
            self.decode_steps += 1
        if output.finished:
            live.discard(output.request_id)
            metrics = completion.spec_decode_metrics
            if metrics is not None:  # j accepted draft tokens in histogram[j] verify steps
                self.verify_steps += sum(metrics.histogram)
                self.draft_tokens_accepted += sum(j * count for j, count in enumerate(metrics.histogram))
                self.draft_tokens_proposed += metrics.num_draft_tokens


ROW_FIELDS = (
    "num_requests",
    "vllm_sampler_tokens_per_s",
    "ngram_tokens_per_s",
    "ngram_speedup",
    "vllm_sampler_speedup",
    "bubble_speedup",
    "forward_passes_vllm_sampler",
    "forward_passes_ngram",
    "tokens_vllm_sampler",
    "tokens_ngram",
)
"""The baseline's fields by batch size. Speedups are against the vLLM backend's run without drafts (bubble drafts'
too, copied from its row); tokens and forward passes are the last repetition's."""


def empty_report() -> dict:
    return {"speculative_config": dict(NGRAM_SPECULATIVE_CONFIG), **{name: {} for name in ROW_FIELDS}}


def fill_row(report: dict, key: str, rates: dict, runs: dict, plain_rate: float, bubble_speedup: float) -> None:
    """One batch size's entries of the baseline's ``report`` from the interleaved ``rates`` and ``runs``."""
    sampler, ngram = runs["vllm-sampler"], runs["vllm-ngram"]
    report["num_requests"][key] = len(ngram.requests)
    report["vllm_sampler_tokens_per_s"][key] = rates["vllm-sampler"]
    report["ngram_tokens_per_s"][key] = rates["vllm-ngram"]
    report["ngram_speedup"][key] = rates["vllm-ngram"] / plain_rate
    report["vllm_sampler_speedup"][key] = rates["vllm-sampler"] / plain_rate
    report["bubble_speedup"][key] = bubble_speedup
    report["forward_passes_vllm_sampler"][key] = sampler.forward_passes
    report["forward_passes_ngram"][key] = ngram.forward_passes
    report["tokens_vllm_sampler"][key] = sampler.tokens
    report["tokens_ngram"][key] = ngram.tokens


def summary(ngram: VLLMRun) -> dict:
    """The n-gram run's decode steps and acceptance over the largest batch size's requests. Its responses are its own
    samples, so ``decode_step_reduction`` is against one step per token of those responses."""
    from bubblespec.core.interfaces import acceptance_length

    return {
        "tokens": ngram.tokens,
        "decode_steps": ngram.decode_steps,
        "decode_step_reduction": 1 - ngram.decode_steps / max(ngram.tokens, 1),
        "verify_steps": ngram.verify_steps,
        "acceptance_length_mean": acceptance_length(ngram.draft_tokens_accepted, ngram.verify_steps),
        "draft_tokens_proposed": ngram.draft_tokens_proposed,
        "draft_tokens_accepted": ngram.draft_tokens_accepted,
        "draft_acceptance_rate": ngram.draft_tokens_accepted / max(ngram.draft_tokens_proposed, 1),
    }


def baseline_table(report: dict, vllm_rows: dict):
    """The baseline beside the vLLM backend's rows, and a note on the n-gram drafts' acceptance."""
    from bubblespec.cli.bench_tables import table

    made = table("vLLM's own n-gram drafts beside bubble drafts (speedup: against vLLM without drafts)",
                 ("batch", "without\ntok/s", "vLLM\nsampler\ntok/s", "n-gram\ntok/s", "n-gram\nspeedup",
                  "bubble\nspeedup", "engine steps: without,\nsampler, n-gram, bubble"))  # fmt: skip
    for key in report["ngram_tokens_per_s"]:
        steps = (vllm_rows["forward_passes_no_draft"][key], report["forward_passes_vllm_sampler"][key],
                 report["forward_passes_ngram"][key], vllm_rows["forward_passes_with_draft"][key])  # fmt: skip
        made.add_row(
            key,
            f"{vllm_rows['engine_tokens_per_s'][key]:.0f}",
            f"{report['vllm_sampler_tokens_per_s'][key]:.0f}",
            f"{report['ngram_tokens_per_s'][key]:.0f}",
            f"{report['ngram_speedup'][key]:.2f}x",
            f"{report['bubble_speedup'][key]:.2f}x",
            ", ".join(map(str, steps)),
        )
    s = report["summary"]
    note = (
        f"n-gram drafts ({_method(report['speculative_config'])}), largest batch: {s['draft_tokens_accepted']} of "
        f"{s['draft_tokens_proposed']} proposed tokens accepted ({s['draft_acceptance_rate']:.1%}), acceptance length "
        f"{s['acceptance_length_mean']:.2f}, {s['decode_steps']} decode steps for {s['tokens']} tokens "
        f"({s['decode_step_reduction']:.1%} fewer); vLLM samples with its own RNG: other responses than bubblespec's"
    )
    return made, note


def _method(config: dict) -> str:
    return (
        f"up to {config['num_speculative_tokens']} tokens after a {config['prompt_lookup_min']}-"
        f"{config['prompt_lookup_max']}-gram match"
    )
