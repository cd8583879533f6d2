"""The virtual clock's cost profiles: the sampling term."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from bubblespec.core.interfaces import ForwardPass
from bubblespec.rollout.clocks import PROFILES


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
