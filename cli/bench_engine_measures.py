"""Parts of ``bubblespec bench engine`` that are not timing rows: the engines of each backend, the exactness table
and keyed sampling's share of a forward pass.

Exactness. For each backend and engine dtype: pi_t drafts every request (its keyed samples for the same keys),
pi_t+1 generates them without drafts twice, in batches that differ (all at once; in reverse order, half as many at
a time), and once with pi_t's drafts. The table reports the share of responses that differ with drafts, and the
share that differ between the two plain runs: the engine's own nondeterminism under another batch composition,
which drafts must not exceed. Keyed verification emits exactly the tokens of plain keyed decoding, so any
difference is a rounding near-tie between the logits of a position computed in one pass shape and in another.
float64 must show none (docs/design.md §3.2); float32 and bfloat16 are measured, not bounded. The benchmarked
backends' engines at the benchmarked dtype are reused.

Keyed sampling's share. One decode forward pass of the torch engine's model (``batch_size`` sequences, one
token each, at a context of ``context_tokens`` cached positions) against :func:`bubblespec.verify.sampling.keyed_sample`
on that pass's logits (temperature 1, no top-k / top-p, the model's whole vocabulary): the median time of each
over ``repeats`` and their ratio.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from bubblespec.cli.bench_engine_requests import with_drafts
from bubblespec.core.interfaces import GenerationRequest, GenerationResult

VLLM_DTYPES = ("float32", "bfloat16")
"""The dtypes of the exactness table on the vLLM backend (vLLM has no float64)."""
VLLM_GPU_MEMORY_SHARE = 0.3
"""GPU memory each vLLM engine may take: the exactness table starts a second one, and the torch engines that
draft share the same GPU (ignored on CPU)."""


def make_engine(backend: str, model_path: str, dtype: str, settings, batch_invariant: bool = False):
    """An engine of ``backend`` on ``model_path`` holding the checkpoint's weights (pi_t); ``batch_invariant`` is the
    torch engine's own setting."""
    if backend == "torch":
        from bubblespec.backends.torch_engine import TorchEngine

        return TorchEngine.from_pretrained(
            model_path, dtype=dtype, device=settings.device, batch_invariant=batch_invariant, **_common(settings)
        )
    from bubblespec.backends.vllm_engine import VLLMEngine

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a model folder; nothing to fetch
    return VLLMEngine.from_pretrained(model_path, dtype=dtype, **vllm_engine_settings(settings))


def vllm_engine_settings(settings) -> dict:
    """The vLLM backend's settings of every vLLM engine of the benchmark (``VLLMEngineConfig`` fields)."""
    return {
        **_common(settings),
        "max_model_len": settings.max_model_len,
        "gpu_memory_utilization": VLLM_GPU_MEMORY_SHARE,
    }


def _common(settings) -> dict:
    """The settings every engine of the benchmark shares."""
    return {
        "max_batch_size": settings.max_batch_size,
        "max_draft_tokens_per_step": settings.max_draft_tokens_per_step,
        "adaptive_draft_length": settings.adaptive_draft_length,
    }


def draft_results(model_path: str, dtype: str, settings, requests: list[GenerationRequest]) -> list[GenerationResult]:
    """pi_t's keyed samples for ``requests`` from the torch engine (keyed sampling is the same on every backend)."""
    engine = make_engine("torch", model_path, dtype, settings)
    return engine.generate(requests)


def exactness_row(engine, requests: list[GenerationRequest], drafts: list[GenerationResult]) -> dict:
    """On ``engine`` (holding pi_t+1): the share of responses that differ with pi_t's drafts attached and without,
    and between two plain runs whose batches differ."""
    plain = engine.generate(requests)
    half = max(1, (len(requests) + 1) // 2)
    reordered = list(reversed(requests))
    other = [r for start in range(0, len(reordered), half) for r in engine.generate(reordered[start : start + half])]
    other_by_key = {r.key: r for r in other}
    drafted = engine.generate(with_drafts(requests, drafts))
    differing = sum(a.token_ids != b.token_ids for a, b in zip(plain, drafted, strict=True))
    between = sum(r.token_ids != other_by_key[r.key].token_ids for r in plain)
    count = max(len(plain), 1)
    return {
        "responses": len(plain),
        "differing": differing,
        "mismatch_rate": differing / count,
        "differing_between_plain_batches": between,
        "plain_batch_mismatch_rate": between / count,
    }


def exactness_table(settings, engines: dict, new_state: dict, requests: list[GenerationRequest]) -> dict:
    """{backend: {dtype: exactness_row}}: torch for ``settings.exactness_dtypes``, vLLM for float32 and bfloat16,
    for each benchmarked backend (torch always: it is the reference). ``engines`` (holding pi_t+1 at
    ``settings.dtype``) are reused for their dtype."""
    path = settings.model_path
    table: dict = {}
    dtypes_by_backend = {"torch": settings.exactness_dtypes, "vllm": VLLM_DTYPES}
    for backend in dict.fromkeys(["torch", *settings.backends]):
        table[backend] = {}
        for dtype in dtypes_by_backend[backend]:
            drafts = draft_results(path, dtype, settings, requests)
            engine = engines.get(backend) if dtype == settings.dtype else None
            if engine is None:
                engine = make_engine(backend, path, dtype, settings)
                engine.update_weights(new_state, version=1)
            table[backend][dtype] = exactness_row(engine, requests, drafts)
            del engine
    return table


def exactness_summary(table: dict) -> dict:
    """The torch rows of the exactness table under the names of earlier reports (``float64_identical``,
    ``float32_mismatch_rate``), where the table has them."""
    rows = table.get("torch", {})
    summary = {}
    if "float64" in rows:
        summary["float64_identical"] = rows["float64"]["differing"] == 0
    if "float32" in rows:
        summary["float32_mismatch_rate"] = rows["float32"]["mismatch_rate"]
    return summary


@torch.inference_mode()
def keyed_sampling_share(model, batch_size: int, context_tokens: int, repeats: int) -> dict:
    """Median seconds of one decode forward pass of ``model`` (a ``DecoderModel``) and of keyed sampling on its
    logits, and their ratio."""
    from bubblespec.models.decoder import KVCache
    from bubblespec.verify.sampling import keyed_sample

    device, vocab_size = model.device, model.config.vocab_size
    cache = KVCache(model.config, batch_size, context_tokens + 1, model.dtype, device)
    generator = torch.Generator().manual_seed(0)
    tokens_B1 = torch.randint(vocab_size, (batch_size, 1), generator=generator).to(device)
    positions_B1 = torch.full((batch_size, 1), context_tokens, device=device)
    seeds_B2 = torch.randint(2**31, (batch_size, 2), generator=generator)
    response_positions_B1 = torch.full((batch_size, 1), context_tokens // 2)
    temperature_B = torch.ones(batch_size, dtype=torch.float64, device=device)
    top_k_B = torch.zeros(batch_size, dtype=torch.int64, device=device)
    top_p_B = torch.ones(batch_size, dtype=torch.float64, device=device)
    logits_B1V = model.forward(tokens_B1, positions_B1, cache)

    def forward() -> None:
        model.forward(tokens_B1, positions_B1, cache)

    def sample() -> None:
        keyed_sample(logits_B1V, seeds_B2, response_positions_B1, temperature_B, top_k_B, top_p_B)

    forward_s, sample_s = _median_seconds([forward, sample], repeats, device)
    return {
        "batch_size": batch_size,
        "context_tokens": context_tokens,
        "vocab_size": vocab_size,
        "dtype": str(model.dtype).removeprefix("torch."),
        "forward_pass_s": forward_s,
        "keyed_sample_s": sample_s,
        "share_of_forward_pass": sample_s / forward_s,
    }


def _median_seconds(runs, repeats: int, device: torch.device) -> list[float]:
    """Median seconds of each of ``runs``, interleaved, after one warm-up call each."""
    seconds: list[list[float]] = [[] for _ in runs]
    for repeat in range(repeats + 1):
        for run, times in zip(runs, seconds, strict=True):
            synchronize(device)
            start = time.perf_counter()
            run()
            synchronize(device)
            if repeat:
                times.append(time.perf_counter() - start)
    return [statistics.median(times) for times in seconds]


def synchronize(device: torch.device | str) -> None:
    """Waits for the device's queued work, so that a timer reads the work's end (a no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
