"""A policy's weights as byte buffers, for the weight sync to every rank.

Ray pickles a dict of torch tensors tensor by tensor (through torch's own reducer, a copy of every storage on
``put`` and again on every ``get``), about 0.2 GB/s on one core. :class:`PackedWeights` holds each tensor as a byte
buffer plus its name, dtype and shape. Ray stores such buffers out of band: ``ray.put`` copies them into the
node's shared-memory object store once, and every rank on that node maps the same bytes without a copy (a rank on
another node pulls one copy for its node). Values are never converted: a bfloat16 tensor travels as its own two
bytes per element (a buffer is a uint8 NumPy array only because that is what Ray maps without copying).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PackedWeights:
    buffers: tuple[np.ndarray, ...]
    """Each tensor's bytes (uint8), views of the tensors themselves until Ray copies them into its store."""
    layout: tuple[tuple[str, str, tuple[int, ...]], ...]
    """(name, dtype name, shape) per tensor, in the state dict's order."""

    @classmethod
    def pack(cls, state_dict: Mapping[str, torch.Tensor]) -> PackedWeights:
        """Byte views of every tensor (moved to the CPU and made contiguous where they are not): no copy of its
        own; ``ray.put`` makes the one copy."""
        layout, buffers = [], []
        for name, tensor in state_dict.items():
            flat = tensor.detach().to("cpu").contiguous().reshape(-1)
            layout.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)))
            buffers.append(flat.view(torch.uint8).numpy())
        return cls(tuple(buffers), tuple(layout))

    @property
    def nbytes(self) -> int:
        return sum(int(buffer.nbytes) for buffer in self.buffers)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state dict again: views of the buffers (no copy; read-only when they are Ray's shared memory, so an
        engine copies them into its own parameters, as ``update_weights`` does)."""
        with warnings.catch_warnings():  # torch warns that a read-only buffer's tensors must not be written to
            warnings.simplefilter("ignore", UserWarning)
            return {
                name: _from_bytes(buffer, getattr(torch, dtype), shape)
                for (name, dtype, shape), buffer in zip(self.layout, self.buffers, strict=True)
            }


def _from_bytes(buffer: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if buffer.size == 0:  # NumPy gives an empty array stride 0, which no view to a wider dtype accepts
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(buffer).view(dtype).reshape(shape)
