"""Every private vLLM name and signature the vllm backend relies on (backends/vllm_glue.py), checked against the
installed vLLM in one place: a vLLM upgrade that moves one fails here first, with one message naming each."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytestmark = [pytest.mark.vllm]

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("BUBBLESPEC_SKIP_VLLM") == "1":
        pytest.skip("vLLM is not installed and BUBBLESPEC_SKIP_VLLM=1", allow_module_level=True)
    raise RuntimeError(
        "tests/test_vllm_glue.py needs vLLM: pip install -e '.[vllm]', or set BUBBLESPEC_SKIP_VLLM=1 to skip it"
    )


def test_every_private_vllm_name_the_backend_relies_on_is_there():
    from bubblespec.backends.vllm_glue import TESTED_VLLM_VERSION, private_name_problems

    problems = private_name_problems()
    assert not problems, f"vLLM {TESTED_VLLM_VERSION}'s private names the vllm backend relies on: {problems}"


def test_a_changed_private_name_is_named_and_refused_before_vllm_loads_anything(monkeypatch):
    """The check sees a signature change and a missing field, and the engine refuses such a vLLM at start-up,
    before it builds an engine."""
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from bubblespec.backends.vllm_engine import VLLMEngine
    from bubblespec.backends.vllm_glue import private_name_problems
    from bubblespec.core.errors import ModelLoadError
    from bubblespec.tasks import ArithmeticTask

    monkeypatch.setattr(GPUModelRunner, "_sample", lambda self, logits, sampling_metadata: None)
    monkeypatch.setattr(SamplerOutput, "__dataclass_fields__", {})
    problems = private_name_problems()
    assert problems == [
        "GPUModelRunner._sample(logits, spec_decode_metadata)",
        "SamplerOutput(sampled_token_ids, logprobs_tensors)",
    ]
    built = []
    monkeypatch.setattr(VLLMEngine, "_load", staticmethod(lambda *args: built.append(args)))
    with pytest.raises(ModelLoadError, match=r"private to vLLM 0\.32\.0 .*GPUModelRunner\._sample\(logits, spec"):
        VLLMEngine.from_pretrained(str(ArithmeticTask.model_path()), cpu_kv_cache_gib=0.25)
    assert not built
