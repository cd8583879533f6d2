"""Weight sync: the packed form weights travel in, and what the virtual clock charges for it."""

from __future__ import annotations

import pickle

import pytest
import torch

from bubblespec.rollout.clocks import PROFILES
from bubblespec.rollout.weights import PackedWeights


def _state(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(6, 4, generator=generator, dtype=torch.float64).to(dtype)
    return {
        "model.embed_tokens.weight": weights,
        "model.layers.0.self_attn.q_proj.weight": weights.t(),  # not contiguous
        "model.norm.weight": torch.randn(4, generator=generator, dtype=torch.float64).to(dtype),
        "empty": torch.zeros(0, 3, dtype=dtype),
        "model.layers.0.step": torch.tensor(7, dtype=dtype),  # a 0-d tensor
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64])
def test_packed_weights_come_back_bit_for_bit_in_their_own_dtype(dtype):
    state = _state(dtype)
    back = PackedWeights.pack(state).tensors()
    assert list(back) == list(state)
    for name, tensor in state.items():
        assert back[name].dtype == dtype and back[name].shape == tensor.shape
        assert torch.equal(back[name].view(-1).view(torch.uint8), tensor.contiguous().view(-1).view(torch.uint8))


def test_packing_copies_nothing_and_pickle_carries_the_bytes_out_of_band():
    """Ray's object store takes pickle protocol 5's out-of-band buffers as they are (one copy into shared
    memory, mapped by every reader): the pickled header holds names, dtypes and shapes only."""
    weight = torch.randn(256, 256, dtype=torch.float32).to(torch.bfloat16)
    packed = PackedWeights.pack({"w": weight})
    assert packed.buffers[0].ctypes.data == weight.data_ptr()  # a view of the tensor, not a copy
    assert packed.nbytes == 256 * 256 * 2
    buffers: list[pickle.PickleBuffer] = []
    header = pickle.dumps(packed, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and len(header) < 1_000
    again = pickle.loads(header, buffers=buffers)
    assert torch.equal(again.tensors()["w"], weight)


def test_the_virtual_clock_charges_weight_sync_by_bytes_and_ranks():
    cpu = PROFILES["cpu-tiny"]
    one_rank, eight_ranks = cpu.weight_sync_seconds(10**9, 1), cpu.weight_sync_seconds(10**9, 8)
    assert cpu.weight_sync_seconds(2 * 10**9, 1) > one_rank > cpu.weight_sync_seconds(10**6, 1) > 0
    assert eight_ranks > one_rank
    # a profile of a simulated model charges that model's bytes, whatever the checkpoint that is run
    h100 = PROFILES["h100-7b"]
    assert h100.weight_sync_seconds(3 * 10**6, 8) == h100.weight_sync_seconds(15 * 10**9, 8)
    assert h100.weight_sync_seconds(3 * 10**6, 64) > h100.weight_sync_seconds(3 * 10**6, 8)
