"""The virtual clock's cost profiles: the sampling term and the draft head's calls."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from bubblespec.core.interfaces import ForwardPass
from bubblespec.models.decoder import DecoderConfig
from bubblespec.models.draft_head import draft_head_size
from bubblespec.rollout.clocks import PROFILES

QWEN25_7B = DecoderConfig(
    model_type="qwen2", vocab_size=152_064, hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
    head_dim=128, intermediate_size=18_944, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32_768,
    tie_word_embeddings=False, attention_bias=True, eos_token_ids=(151_643,),
)  # fmt: skip
"""The shape the h100-7b profile models."""


def test_sampled_logits_default_to_zero_and_come_last():
    forward = ForwardPass(16, 16 * 17, 16 * 256, 16 * 17 * 256)
    assert forward.sampled_logits == 0
    assert ForwardPass(16, 16 * 17, 16 * 256, 16 * 17 * 256, 7).sampled_logits == 7


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_sampling_is_charged_per_sampled_logit(name):
    """Wide verification at a large vocabulary costs more than a decode step at the same fed tokens."""
    profile = PROFILES[name]
    assert profile.sampling_s_per_logit > 0
    plain = ForwardPass(16, 16 * 17, 16 * 256, 16 * 17 * 256)
    verify_logits = 16 * 17 * 151_936
    verify = ForwardPass(16, 16 * 17, 16 * 256, 16 * 17 * 256, sampled_logits=verify_logits)
    extra = profile.forward_seconds(verify) - profile.forward_seconds(plain)
    assert extra == pytest.approx(profile.sampling_s_per_logit * verify_logits, rel=1e-12)


def _head_call(rows: int, steps: int, context: int, vocab: int, window: int = 64) -> ForwardPass:
    """A decode pass of ``rows`` rows after a head call drafting ``steps`` tokens from ``context`` pairs a row, every
    step sampled."""
    read = min(window, context)
    keys = sum(min(window, read + step) for step in range(steps))
    return ForwardPass(
        rows, rows, rows * 1024, rows * 1024, rows * vocab,
        head_steps=steps, head_tokens=rows * steps, head_context_pairs=rows * (read - 1),
        head_attention_pairs=rows * keys, head_sampled_logits=rows * steps * vocab,
    )  # fmt: skip


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_a_pass_without_a_head_call_is_charged_nothing_for_it(name):
    profile = PROFILES[name]
    assert profile.head_seconds(ForwardPass(8, 8, 8 * 1024, 8 * 1024, 8 * 151_936)) == 0.0
    head_fields_only = dataclasses.replace(_head_call(8, 8, 64, 151_936), head_steps=0)
    assert profile.head_seconds(head_fields_only) == 0.0


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_a_head_call_costs_more_with_more_steps_and_rows(name):
    """More context costs flops only (the head recomputes its keys and values): nothing where a call is memory
    bound."""
    profile = PROFILES[name]
    assert profile.head_fixed_s > 0 and profile.head_flops_per_token > 0
    seconds = [profile.head_seconds(_head_call(rows, steps, 1, 151_936))
               for rows, steps in ((1, 1), (1, 4), (8, 4), (8, 8), (64, 8))]  # fmt: skip
    assert 0 < seconds[0] and all(a < b for a, b in zip(seconds, seconds[1:], strict=False))
    assert profile.head_seconds(_head_call(8, 8, 64, 151_936)) >= seconds[3]


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_a_pass_is_charged_its_head_call_on_top(name):
    """The head call runs on the same device just before the pass: the two add up."""
    profile = PROFILES[name]
    with_head = _head_call(8, 8, 64, 151_936)
    without = dataclasses.replace(
        with_head, head_steps=0, head_tokens=0, head_context_pairs=0, head_attention_pairs=0, head_sampled_logits=0
    )
    assert profile.head_seconds(with_head) > 0
    assert profile.forward_seconds(with_head) == pytest.approx(
        profile.forward_seconds(without) + profile.head_seconds(with_head), rel=1e-12
    )


def test_the_gpu_head_figures_are_draft_head_size_of_the_profiles_model():
    """h100-7b's head terms are those of a draft head over Qwen2.5-7B's shape: its own parameters and the shared
    output head and final norm read in bfloat16 a step, and draft_head_size's FLOPs."""
    profile, size = PROFILES["h100-7b"], draft_head_size(QWEN25_7B)
    hidden, vocab = QWEN25_7B.hidden_size, QWEN25_7B.vocab_size
    assert profile.head_weight_bytes == 2 * (size.num_parameters + vocab * hidden + hidden)
    assert profile.head_flops_per_token == size.layer_flops_per_token + size.output_head_flops_per_token
    assert profile.head_flops_per_context_pair == size.context_flops_per_pair
    assert profile.head_attention_flops_per_pair == size.attention_flops_per_key
    assert 0 < profile.head_fixed_s < profile.fixed_s


def test_a_gpu_head_call_costs_its_roofline():
    """8 rows with a full window of 64 pairs drafting 8 tokens each on h100-7b: every step reads the head's weights
    (1.6 GB in bfloat16), which at 8 rows outweighs its flops; then keyed sampling over 8 x 8 x 152,064 logits."""
    profile, size = PROFILES["h100-7b"], draft_head_size(QWEN25_7B)
    hidden, vocab = QWEN25_7B.hidden_size, QWEN25_7B.vocab_size
    rows, steps, window = 8, 8, 64
    bandwidth, flops_per_s = 0.7 * 3.35e12, 0.5 * 989e12
    memory = steps * 2 * (size.num_parameters + vocab * hidden + hidden) / bandwidth
    compute = rows * size.drafting_call_flops(window, steps, window) / flops_per_s
    sampling = 242 * rows * steps * vocab / bandwidth
    expected = steps * profile.head_fixed_s + max(memory, compute) + sampling
    assert memory > 10 * compute
    assert profile.head_seconds(_head_call(rows, steps, window, vocab, window)) == pytest.approx(expected, rel=1e-9)


def test_the_gpu_sampling_term_matches_the_bytes_keyed_sampling_moves():
    """h100-7b charges the bytes that keyed sampling's operations read and write per logit at the profile's
    bandwidth; if the sampling code moves much more or less memory, the profile must be re-derived."""
    path = Path(__file__).parent.parent / "benchmarks" / "calibrate_cpu.py"
    spec = importlib.util.spec_from_file_location("calibrate_cpu", path)
    calibrate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calibrate)
    profile = PROFILES["h100-7b"]
    charged_bytes = profile.sampling_s_per_logit * profile.bandwidth_bytes_per_s
    assert calibrate.sampling_bytes_per_logit(vocab=151_936, num_rows=4) == pytest.approx(charged_bytes, rel=0.15)
