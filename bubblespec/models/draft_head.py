"""An EAGLE-style draft head for the built-in decoder: one decoder layer that reads the policy's last hidden states and
drafts the next tokens with the rollout key's own noise.

The network. Let ``h_t`` be the policy's last hidden state (the last layer's output, before the final norm) at the
position whose logits sampled token ``x_{t+1}``. The head pairs them:

    f_t = fc([h_t, E x_{t+1}])                 fc: 2H -> H, E: the policy's embedding
    g_t = layer(f_0 .. f_t)                    one decoder layer of the policy's shape (causal, RoPE, GQA,
                                               q/k/v biases, qk-norm as the family has), attending the latest
                                               ``window`` pairs only
    logits_t = W_out norm(g_t)                 the policy's final norm and output head

``g_t`` stands in for ``h_{t+1}`` and ``logits_t`` for the policy's logits of token ``x_{t+2}``. The embedding, the
final norm and the output head are the policy's own tensors (the same storage, never copied; frozen for the head's
training), so the head has no vocabulary matrix of its own and a weight sync into the policy, which copies into those
tensors in place, reaches the head at once.

Drafting (:meth:`DraftHead.draft`) goes on autoregressively: the pair ``(g_t, d_1)`` of the head's own output and its
first draft token gives the second, and so on. Each draft token is the keyed sample of the head's logits at its
response position, ``d_i = argmax_v(mask(logits / T)[v] + G(k, i, v))`` with the request's temperature, top-k and
top-p, so verification accepts it exactly when it equals the policy's keyed sample (docs/design.md §4): the head
needs no probabilities, and like every draft it changes speed only. The sampler is passed in
(:data:`KeyedSampler`, the engine binds ``verify.sampling.keyed_sample``): ``models/`` sits below ``verify/`` in the
layer contract (docs/design.md §7).

Statelessness. The head attends over the latest ``window`` pairs, in training as in drafting (a sliding window), and
keeps no cache between calls: each drafting call recomputes the keys and values of the window it is handed (and
keeps those of its own draft tokens until it returns). A caller keeps the latest hidden states of each sequence and
nothing else; weights, sequences and batches can change between calls without any bookkeeping.

Learning (:meth:`DraftHead.loss`, :class:`DraftHeadTrainer`): from what a rollout already computed, the policy's
hidden states and its sampled tokens, the cross-entropy of ``softmax(logits_t / T)`` against the policy's sampled
``x_{t+2}``. The tokens are samples of the policy at temperature ``T``, so this is an unbiased estimate of the
gradient of the forward KL divergence from the policy's distribution to the head's: what raises the chance that
the two keyed samples are equal. Top-k and top-p are left out of the loss: the policy's sample is always inside its
own filtered set, the head's may not be. Training is teacher-forced (the policy's hidden state at every pair); at a
draft's later tokens the head reads its own output instead.

Precision: the head's own parameters are float32 (AdamW's master weights); it computes in the policy's dtype.
Shapes: B rows, T pairs, C context pairs, H hidden, N query heads, K key/value heads, D head dim, S keys, V vocabulary.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bubblespec.core.config import HeadPosition
from bubblespec.core.interfaces import ForwardPass
from bubblespec.models.decoder import (
    DecoderConfig,
    DecoderModel,
    rms_norm,
    rope_inverse_frequency,
    rotary_cos_sin,
    rotate,
)

KeyedSampler = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``sample(logits_B1V, positions_B1) -> tokens_B1``: each row's keyed sample of the head's logits at the given
response positions, with the rollout key's own noise and the request's sampling settings (temperature, top-k,
top-p): ``verify.sampling.keyed_sample(logits, seeds, positions, temperature, top_k, top_p)[0]``."""

DEFAULT_WINDOW = 64
"""Pairs the head attends by default: recent enough to be cheap, long enough to hold the local context."""
HIDDEN_ROWS_PER_PASS = 4
"""Responses per forward pass that computes hidden states to learn from (bounds the pass's memory at long
responses)."""
_INIT_STD = 0.02
"""Standard deviation of the head's initial matrices (transformers' ``initializer_range`` default)."""


def head_parameter_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """The head's own parameters by name, in their initialisation order. q/k/v and gate/up are one matrix each
    (as the decoder computes them)."""
    hidden, intermediate = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (hidden, 2 * hidden),
        "layer.input_layernorm.weight": (hidden,),
        "layer.self_attn.qkv_proj.weight": (q_size + 2 * kv_size, hidden),
        "layer.self_attn.o_proj.weight": (hidden, q_size),
        "layer.post_attention_layernorm.weight": (hidden,),
        "layer.mlp.gate_up_proj.weight": (2 * intermediate, hidden),
        "layer.mlp.down_proj.weight": (hidden, intermediate),
    }
    if config.attention_bias:
        shapes["layer.self_attn.qkv_proj.bias"] = (q_size + 2 * kv_size,)
    if config.output_bias:
        shapes["layer.self_attn.o_proj.bias"] = (hidden,)
    if config.qk_norm:
        shapes["layer.self_attn.q_norm.weight"] = (config.head_dim,)
        shapes["layer.self_attn.k_norm.weight"] = (config.head_dim,)
    return shapes


@dataclass(frozen=True)
class DraftHeadSize:
    """A draft head's size and the matrix-product FLOPs of drafting (2 per multiply-add; norms, rotary angles,
    softmax, biases and the sampler are not counted): see :func:`draft_head_size`."""

    num_parameters: int
    """The head's own parameters: fc and the decoder layer."""
    num_shared_parameters: int
    """The policy's tensors it borrows: embedding, final norm and output head (one matrix when tied)."""
    layer_flops_per_token: int
    """fc, q/k/v/o projections and the MLP, for one drafted token."""
    attention_flops_per_key: int
    """Scores and weighted sum of one query over one key: ``4 N D``."""
    output_head_flops_per_token: int
    """The shared output head: ``2 H V``, the largest part for every shipped family."""
    context_flops_per_pair: int
    """fc and the key/value projections of a context pair (all but the last of a drafting call's)."""

    def flops_per_token(self, window: int = DEFAULT_WINDOW) -> int:
        """One drafted token with ``window`` keys attended (the most it attends): layer + attention + output head."""
        return self.layer_flops_per_token + window * self.attention_flops_per_key + self.output_head_flops_per_token

    def drafting_call_flops(self, num_context: int, num_tokens: int, window: int = DEFAULT_WINDOW) -> int:
        """One :meth:`DraftHead.draft` call that reads ``num_context`` pairs (at most ``window``) and drafts
        ``num_tokens``: the keys and values of the context but its last pair, then per token one full step whose
        query attends the latest ``min(window, num_context + step)`` keys."""
        keys = sum(min(window, num_context + step) for step in range(num_tokens))
        per_token = self.layer_flops_per_token + self.output_head_flops_per_token
        return (
            (num_context - 1) * self.context_flops_per_pair
            + num_tokens * per_token
            + keys * self.attention_flops_per_key
        )


def draft_head_size(config: DecoderConfig) -> DraftHeadSize:
    """The parameter count and drafting FLOPs of a draft head for ``config``'s policy."""
    shapes = head_parameter_shapes(config)
    hidden, vocab = config.hidden_size, config.vocab_size
    kv_size = config.num_kv_heads * config.head_dim
    matrices = sum(rows * columns for rows, columns in (s for s in shapes.values() if len(s) == 2))
    shared = vocab * hidden * (1 if config.tie_word_embeddings else 2) + hidden
    return DraftHeadSize(
        num_parameters=sum(_numel(shape) for shape in shapes.values()),
        num_shared_parameters=shared,
        layer_flops_per_token=2 * matrices,
        attention_flops_per_key=4 * config.num_heads * config.head_dim,
        output_head_flops_per_token=2 * hidden * vocab,
        context_flops_per_pair=2 * (2 * hidden * hidden + 2 * kv_size * hidden),
    )


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


@dataclass(frozen=True)
class HeadBatch:
    """Responses to learn from, right-padded: ``hidden_BTH[b, t]`` is the policy's last hidden state (before the
    final norm) at the position whose logits sampled ``tokens_BT[b, t]``; for a response that is the prompt's last
    position for its first token, then the positions of its tokens. Entries at ``t >= lengths_B[b]`` are padding
    and change nothing. ``temperature_B``: each response's sampling temperature (0: greedy, trained at 1)."""

    hidden_BTH: torch.Tensor
    tokens_BT: torch.Tensor
    lengths_B: torch.Tensor
    temperature_B: torch.Tensor

    @classmethod
    def pad(
        cls, hidden: Sequence[torch.Tensor], tokens: Sequence[torch.Tensor], temperatures: Sequence[float]
    ) -> HeadBatch:
        """One batch of responses given one by one: ``hidden[r]`` [T_r, H] and ``tokens[r]`` [T_r]."""
        lengths = [len(t) for t in tokens]
        if [len(h) for h in hidden] != lengths or len(temperatures) != len(lengths):
            raise ValueError(
                f"each response needs one hidden state per token and a temperature: {len(hidden)} hidden of lengths "
                f"{[len(h) for h in hidden]}, {len(tokens)} token rows of lengths {lengths}, "
                f"{len(temperatures)} temperatures"
            )
        return cls(
            torch.nn.utils.rnn.pad_sequence(list(hidden), batch_first=True),
            torch.nn.utils.rnn.pad_sequence([t.to(torch.int64) for t in tokens], batch_first=True),
            torch.tensor(lengths, dtype=torch.int64),
            torch.tensor(temperatures, dtype=torch.float64),
        )


class DraftHead:
    """A one-layer draft head over ``policy`` (a :class:`~bubblespec.models.decoder.DecoderModel`), initialised from
    ``seed``; it attends the latest ``window`` pairs (or the family's sliding window, if shorter)."""

    def __init__(self, policy: DecoderModel, seed: int = 0, window: int = DEFAULT_WINDOW) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive number of positions, got {window!r}")
        cfg = policy.config
        self.policy, self.config, self.dtype, self.device = policy, cfg, policy.dtype, policy.device
        family_window = cfg.layer_window(cfg.num_layers - 1)
        self.window = window if family_window is None else min(window, family_window)
        shared = policy.weights
        self.embedding = shared["model.embed_tokens.weight"]
        self.final_norm = shared["model.norm.weight"]
        self.output_head = shared["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
        frequency = rope_inverse_frequency(cfg.head_dim, cfg.rope_theta, cfg.rope_llama3)
        self._inverse_frequency = frequency.to(self.device)
        self.parameters = _initial_parameters(cfg, seed, self.device)
        self._inference: dict[str, torch.Tensor] | None = None

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the head's own parameters (float32) by name; the policy's shared tensors are not in it."""
        return {name: p.detach().clone() for name, p in self.parameters.items()}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Sets the head's parameters from :meth:`state_dict`'s names and shapes, exactly (any other name, a missing
        one or a wrong shape is refused)."""
        expected = {name: tuple(p.shape) for name, p in self.parameters.items()}
        given = {name: tuple(t.shape) for name, t in state.items()}
        if given != expected:
            wrong = sorted(n for n in given.keys() | expected.keys() if given.get(n) != expected.get(n))
            raise ValueError(
                f"draft head state does not fit this head: {wrong[:5]} (given {[given.get(n) for n in wrong[:5]]}, "
                f"expected {[expected.get(n) for n in wrong[:5]]})"
            )
        for name, tensor in state.items():
            self.parameters[name].copy_(tensor)
        self._parameters_changed()

    def _parameters_changed(self) -> None:
        self._inference = None

    def _weights(self) -> dict[str, torch.Tensor]:
        """The own parameters in the compute dtype: with gradients to the float32 parameters while they are
        trained, else a copy kept until the parameters change (the parameters themselves in float32)."""
        if torch.is_grad_enabled():
            return {name: p.to(self.dtype) for name, p in self.parameters.items()}
        if self._inference is None:
            self._inference = {name: p.detach().to(self.dtype) for name, p in self.parameters.items()}
        return self._inference

    def forward(self, hidden_BTH: torch.Tensor, tokens_BT: torch.Tensor) -> torch.Tensor:
        """The head's outputs ``g`` [B, T, H] over whole rows of pairs from their first (teacher-forced: the
        policy's hidden state at every pair), right-padded rows allowed (a pair sees only pairs before it):
        ``g[:, t]`` stands in for the policy's hidden state at the position after ``tokens_BT[:, t]``."""
        w = self._weights()
        batch, length = tokens_BT.shape
        f_BTH = self._fc(w, hidden_BTH, tokens_BT)
        positions_BT = torch.arange(length, device=self.device)[None, :].expand(batch, length)
        q_BTND, k_BTND, v_BTND = self._queries_keys_values(w, f_BTH, positions_BT)
        keys_1S, queries_T1 = positions_BT[0][None, :], positions_BT[0][:, None]
        visible_TS = (keys_1S <= queries_T1) & (keys_1S > queries_T1 - self.window)
        attention_BNTD = F.scaled_dot_product_attention(
            q_BTND.transpose(1, 2), k_BTND.transpose(1, 2), v_BTND.transpose(1, 2), attn_mask=visible_TS,
            enable_gqa=self.config.num_heads != self.config.num_kv_heads,
        )  # fmt: skip
        return self._layer_output(w, f_BTH, attention_BNTD)

    def logits(self, output_BTH: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] of head outputs: the policy's final norm and output head."""
        normed_BTH = rms_norm(output_BTH, self.final_norm.detach(), self.config.rms_norm_eps)
        return F.linear(normed_BTH, self.output_head.detach())

    @torch.no_grad()
    def draft(
        self,
        hidden_BTH: torch.Tensor,
        tokens_BT: torch.Tensor,
        lengths_B: torch.Tensor,
        first_positions_B: torch.Tensor,
        num_tokens: int,
        sample: KeyedSampler,
        return_logits: bool = False,
        given: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``num_tokens`` draft tokens [B, num_tokens] per row, each the keyed sample of the head's logits at its
        response position (``sample``, :data:`KeyedSampler`); with ``return_logits`` also those logits
        [B, num_tokens, V].

        Rows are right-padded as in :class:`HeadBatch` (``lengths_B`` >= 1 real pairs each): ``hidden_BTH[b, t]``
        the policy's last hidden state at the position whose logits sampled ``tokens_BT[b, t]``; the last real
        token of a row is the newest sampled one (not yet fed to the policy). Only the latest :attr:`window` pairs
        of a row are read. ``first_positions_B``: the response position of each row's first draft token (the
        newest token's plus one). The head keeps nothing between calls (see the module docstring).

        ``given``: per row, its first draft tokens (at most ``num_tokens``), taken instead of sampled and read as
        the head reads its own: the head continues a proposal from elsewhere. A step where every row's token is
        given computes no logits, unless ``return_logits`` asks for them.
        """
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be at least 1, got {num_tokens}")
        lengths_B = lengths_B.to(self.device, torch.int64)
        if bool((lengths_B < 1).any()) or int(lengths_B.max()) > tokens_BT.shape[1]:
            raise ValueError(f"each row needs 1 to {tokens_BT.shape[1]} pairs, got lengths {lengths_B.tolist()}")
        w = self._weights()
        hidden_BCH, tokens_BC, positions_BC, real_BC = self._latest_pairs(hidden_BTH, tokens_BT, lengths_B)
        # Keys and values of the context but its last pair, which the first step feeds: [B, K, C - 1, D].
        _, keys_BTKD, values_BTKD = self._queries_keys_values(
            w, self._fc(w, hidden_BCH[:, :-1], tokens_BC[:, :-1]), positions_BC[:, :-1], queries=False
        )
        keys_BKSD, values_BKSD = keys_BTKD.transpose(1, 2), values_BTKD.transpose(1, 2)
        real_BS = real_BC[:, :-1]
        hidden_B1H, token_B1, position_B1 = hidden_BCH[:, -1:], tokens_BC[:, -1:], positions_BC[:, -1:]
        first_positions_B1 = first_positions_B.to(self.device, torch.int64)[:, None]
        given_BN, num_given_B = self._given(given, len(lengths_B), num_tokens)
        drafted, logits = [], []
        for step in range(num_tokens):
            f_B1H = self._fc(w, hidden_B1H, token_B1)
            q_B1ND, k_B1KD, v_B1KD = self._queries_keys_values(w, f_B1H, position_B1)
            # The latest `window` keys, this pair's included: what the pair sees in training (forward's mask).
            keys_BKSD = torch.cat([keys_BKSD, k_B1KD.transpose(1, 2)], dim=2)[:, :, -self.window :]
            values_BKSD = torch.cat([values_BKSD, v_B1KD.transpose(1, 2)], dim=2)[:, :, -self.window :]
            real_BS = torch.cat([real_BS, real_BS.new_ones(len(real_BS), 1)], dim=1)[:, -self.window :]
            attention_BN1D = F.scaled_dot_product_attention(
                q_B1ND.transpose(1, 2), keys_BKSD, values_BKSD, attn_mask=real_BS[:, None, None, :],
                enable_gqa=self.config.num_heads != self.config.num_kv_heads,
            )  # fmt: skip
            hidden_B1H = self._layer_output(w, f_B1H, attention_BN1D)
            if return_logits or bool((num_given_B <= step).any()):
                logits_B1V = self.logits(hidden_B1H)
                token_B1 = sample(logits_B1V, first_positions_B1 + step).to(self.device, torch.int64)
                token_B1 = torch.where(num_given_B[:, None] > step, given_BN[:, step : step + 1], token_B1)
                logits.append(logits_B1V)
            else:  # every row continues a given proposal: no output head, no sampling
                token_B1 = given_BN[:, step : step + 1]
            drafted.append(token_B1)
            position_B1 = position_B1 + 1
        tokens_BN = torch.cat(drafted, dim=1)
        return (tokens_BN, torch.cat(logits, dim=1)) if return_logits else tokens_BN

    def _given(self, given, batch: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`draft`'s given tokens as [B, num_tokens] int64 (0 past a row's own) and their counts [B]."""
        given_BN = torch.zeros(batch, num_tokens, dtype=torch.int64)
        num_given_B = torch.zeros(batch, dtype=torch.int64)
        if given is not None:
            if len(given) != batch or any(len(row) > num_tokens for row in given):
                raise ValueError(
                    f"given needs one row of at most {num_tokens} tokens per drafting row ({batch}), got lengths "
                    f"{[len(row) for row in given]}"
                )
            for row, tokens in enumerate(given):
                given_BN[row, : len(tokens)] = torch.tensor(list(tokens), dtype=torch.int64)
                num_given_B[row] = len(tokens)
        return given_BN.to(self.device), num_given_B.to(self.device)

    def _latest_pairs(self, hidden_BTH, tokens_BT, lengths_B):
        """The latest ``min(window, longest row)`` pairs of each row, left-padded to C: hidden [B, C, H], tokens
        [B, C], positions [B, C] (0 at a row's first pair read) and which entries are real [B, C]."""
        num_context = min(self.window, int(lengths_B.max()))
        index_BC = lengths_B[:, None] - num_context + torch.arange(num_context, device=self.device)
        real_BC = index_BC >= 0
        index_BC = index_BC.clamp(min=0)
        hidden_BCH = torch.gather(
            hidden_BTH.to(self.device), 1, index_BC[:, :, None].expand(-1, -1, hidden_BTH.shape[-1])
        )
        tokens_BC = torch.gather(tokens_BT.to(self.device, torch.int64), 1, index_BC)
        positions_BC = (torch.arange(num_context, device=self.device) - (~real_BC).sum(1, keepdim=True)).clamp(min=0)
        return hidden_BCH, tokens_BC, positions_BC, real_BC

    def _fc(self, w, hidden_BTH: torch.Tensor, tokens_BT: torch.Tensor) -> torch.Tensor:
        """``fc([h_t, E x_{t+1}])`` [B, T, H] (the policy's hidden states are inputs: no gradient reaches them)."""
        embedded_BTH = F.embedding(tokens_BT, self.embedding.detach())
        return F.linear(torch.cat([hidden_BTH.detach().to(self.dtype), embedded_BTH], dim=-1), w["fc.weight"])

    def _queries_keys_values(self, w, f_BTH: torch.Tensor, positions_BT: torch.Tensor, queries: bool = True):
        """Queries [B, T, N, D] (None without ``queries``), keys and values [B, T, K, D] of the layer's attention,
        normalised per head (qk-norm) and rotated as the policy's layers do."""
        cfg = self.config
        batch, length, _ = f_BTH.shape
        x_BTH = rms_norm(f_BTH, w["layer.input_layernorm.weight"], cfg.rms_norm_eps)
        q_size = 0 if queries else cfg.num_heads * cfg.head_dim
        bias = w.get("layer.self_attn.qkv_proj.bias")
        projected = F.linear(
            x_BTH, w["layer.self_attn.qkv_proj.weight"][q_size:], None if bias is None else bias[q_size:]
        )
        kv_size = cfg.num_kv_heads * cfg.head_dim
        q, k, v = projected.split([projected.shape[-1] - 2 * kv_size, kv_size, kv_size], dim=-1)
        k_BTKD = k.view(batch, length, cfg.num_kv_heads, cfg.head_dim)
        v_BTKD = v.view(batch, length, cfg.num_kv_heads, cfg.head_dim)
        q_BTND = q.view(batch, length, cfg.num_heads, cfg.head_dim) if queries else None
        if cfg.qk_norm:
            k_BTKD = rms_norm(k_BTKD, w["layer.self_attn.k_norm.weight"], cfg.rms_norm_eps)
            if queries:
                q_BTND = rms_norm(q_BTND, w["layer.self_attn.q_norm.weight"], cfg.rms_norm_eps)
        cos_BT1D, sin_BT1D = rotary_cos_sin(positions_BT, self._inverse_frequency, self.dtype)
        q_BTND = rotate(q_BTND, cos_BT1D, sin_BT1D) if queries else None
        return q_BTND, rotate(k_BTKD, cos_BT1D, sin_BT1D), v_BTKD

    def _layer_output(self, w, f_BTH: torch.Tensor, attention_BNTD: torch.Tensor) -> torch.Tensor:
        """The layer's output [B, T, H] from its input and its attention: output projection and MLP, each with its
        residual connection."""
        batch, length, _ = f_BTH.shape
        attention_BTH = attention_BNTD.transpose(1, 2).reshape(batch, length, -1)
        output_bias = w.get("layer.self_attn.o_proj.bias")
        hidden_BTH = f_BTH + F.linear(attention_BTH, w["layer.self_attn.o_proj.weight"], output_bias)
        x_BTH = rms_norm(hidden_BTH, w["layer.post_attention_layernorm.weight"], self.config.rms_norm_eps)
        gate, up = F.linear(x_BTH, w["layer.mlp.gate_up_proj.weight"]).chunk(2, dim=-1)
        return hidden_BTH + F.linear(F.silu(gate) * up, w["layer.mlp.down_proj.weight"])

    def row_losses(self, batch: HeadBatch) -> torch.Tensor:
        """Each row's mean cross-entropy [B] float32 over its targets (0 for a row of fewer than 2 tokens)."""
        losses_BT, targets_BT = self._token_losses(batch)
        return losses_BT.sum(1) / targets_BT.sum(1).clamp(min=1)

    def loss(self, batch: HeadBatch) -> torch.Tensor:
        """The mean cross-entropy over every target of the batch: ``-log softmax(logits_t / T)[x_{t+2}]`` with
        ``logits_t`` the head's at the pair of ``tokens[t]`` (0-d float32)."""
        losses_BT, targets_BT = self._token_losses(batch)
        return losses_BT.sum() / targets_BT.sum().clamp(min=1)

    def _token_losses(self, batch: HeadBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-entropy [B, T - 1] float32 of pair t's logits against token t + 1 (0 at padding), and where a
        target is real [B, T - 1]."""
        tokens_BT = batch.tokens_BT.to(self.device, torch.int64)
        logits_BTV = self.logits(self.forward(batch.hidden_BTH[:, :-1].to(self.device), tokens_BT[:, :-1]))
        temperature_B = batch.temperature_B.to(self.device, torch.float32)
        divisor_B = torch.where(temperature_B > 0, temperature_B, 1.0)
        scaled_BVT = (logits_BTV.float() / divisor_B[:, None, None]).transpose(1, 2)
        losses_BT = F.cross_entropy(scaled_BVT, tokens_BT[:, 1:], reduction="none")
        length = tokens_BT.shape[1] - 1
        targets_BT = torch.arange(length, device=self.device)[None, :] < batch.lengths_B.to(self.device)[:, None] - 1
        return torch.where(targets_BT, losses_BT, 0.0), targets_BT


def _initial_parameters(config: DecoderConfig, seed: int, device) -> dict[str, torch.Tensor]:
    """float32 parameters from ``seed`` (drawn on the CPU, so every device starts alike): matrices normal with
    standard deviation 0.02, norm weights 1, biases 0."""
    generator = torch.Generator().manual_seed(seed)
    parameters = {}
    for name, shape in head_parameter_shapes(config).items():
        if name.endswith("bias"):
            value = torch.zeros(shape)
        elif len(shape) == 1:
            value = torch.ones(shape)
        else:
            value = _INIT_STD * torch.randn(shape, generator=generator)
        parameters[name] = value.to(device)
    return parameters


class DraftHeadTrainer:
    """AdamW on a :class:`DraftHead`'s own parameters (the policy's shared tensors are never in it)."""

    def __init__(
        self,
        head: DraftHead,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        max_grad_norm: float | None = 1.0,
    ) -> None:
        self.head = head
        self.max_grad_norm = max_grad_norm
        parameters = [p.requires_grad_() for p in head.parameters.values()]
        self.optimizer = torch.optim.AdamW(
            parameters, lr=learning_rate, betas=betas, weight_decay=weight_decay, foreach=False
        )

    def step(self, batch: HeadBatch) -> float:
        """One optimizer step on ``batch``'s loss (:meth:`DraftHead.loss`); returns the loss before the step."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.head.loss(batch)
        loss.backward()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(self.head.parameters.values()), self.max_grad_norm, foreach=False)
        self.optimizer.step()
        self.head._parameters_changed()
        return float(loss.detach())

    def state_dict(self) -> dict:
        """The optimizer's state (moments and step counts), copied: with :meth:`DraftHead.state_dict` what a
        checkpoint stores to resume training exactly."""
        state = self.optimizer.state_dict()
        return {
            "state": {i: {k: v.clone() for k, v in s.items()} for i, s in state["state"].items()},
            "param_groups": [dict(group) for group in state["param_groups"]],
        }

    def load_state_dict(self, state: Mapping) -> None:
        self.optimizer.load_state_dict(state)

    def train(
        self, batch: HeadBatch, steps: int, rows_per_step: int, until: float | None = None
    ) -> tuple[list[float], int]:
        """``steps`` optimizer steps on ``batch``'s responses, ``rows_per_step`` a step in turn (the responses in
        order, around again where they run out), each step's rows cut to its longest; returns each step's loss and
        the pairs the steps trained on (summed over steps: what their cost grows with). ``until``: a
        ``time.perf_counter()`` reading after which no further step starts (the first always runs)."""
        num_rows = len(batch.lengths_B)
        if num_rows == 0 or steps < 1:
            return [], 0
        losses, trained = [], 0
        for step in range(steps):
            if step and until is not None and time.perf_counter() > until:
                break
            rows = step_rows(step, rows_per_step, num_rows)
            longest = int(batch.lengths_B[rows].max())
            chunk = HeadBatch(batch.hidden_BTH[rows, :longest], batch.tokens_BT[rows, :longest],
                              batch.lengths_B[rows], batch.temperature_B[rows])  # fmt: skip
            losses.append(self.step(chunk))
            trained += int(chunk.lengths_B.sum())
        return losses, trained


Sample = tuple[Sequence[int], Sequence[int], float]
"""One response to learn from: its prompt's token ids, its own token ids and its sampling temperature."""


def step_rows(step: int, rows_per_step: int, num_rows: int) -> list[int]:
    """The responses :meth:`DraftHeadTrainer.train`'s ``step`` learns from: ``rows_per_step`` of ``num_rows`` in
    turn, around again where they run out."""
    per_step = min(rows_per_step, num_rows)
    return [(step * per_step + i) % num_rows for i in range(per_step)]


def trained_pairs_by_step(lengths: Sequence[int], steps: int, rows_per_step: int) -> list[int]:
    """The pairs each of ``steps`` training steps learns from (responses of ``lengths`` pairs, :func:`step_rows`):
    what a step's cost grows with, known before training."""
    return [sum(lengths[row] for row in step_rows(step, rows_per_step, len(lengths))) for step in range(steps)]


def hidden_passes(samples: Sequence[Sample], rows_per_pass: int = 4) -> tuple[ForwardPass, ...]:
    """The policy's passes that :func:`hidden_pairs` runs over ``samples`` (those with tokens), as a cost model
    counts them: prompt + response fed without a cache, causal attention, no logits sampled."""
    kept = [(prompt, response) for prompt, response, _ in samples if len(response)]
    passes = []
    for start in range(0, len(kept), rows_per_pass):
        lengths = [len(prompt) + len(response) for prompt, response in kept[start : start + rows_per_pass]]
        attended = sum(length * (length + 1) // 2 for length in lengths)
        passes.append(ForwardPass(len(lengths), sum(lengths), sum(lengths), attended))
    return tuple(passes)


@dataclass(frozen=True)
class HeadLearning:
    """How a head learns online (``speculation.draft_head``): from ``seed``'s initialisation, ``steps`` AdamW steps
    at ``learning_rate`` per rollout on its responses, ``rows_per_step`` responses a step; it attends ``window``
    pairs and proposes up to ``max_tokens`` tokens a pass (None: the engine's ``max_draft_tokens_per_step``)."""

    window: int = DEFAULT_WINDOW
    max_tokens: int | None = None
    learning_rate: float = 3e-3
    """From nothing, a few dozen steps: tests/test_draft_head.py and ``bench engine``'s ``draft_head`` learn at it."""
    steps: int = 32
    rows_per_step: int = 8
    seed: int = 0
    step_cost: float | None = None
    """A head step's cost over a decode pass's (a cost model's): the head then proposes as many tokens a pass as
    its measured acceptance pays for (:class:`HeadSizing`); None: ``max_tokens`` every pass."""
    position: HeadPosition = "last"
    """Where in the draft chain the head proposes (:data:`HeadPosition`)."""
    max_live_sequences: int | None = None
    """The head proposes only in passes of at most this many sequences (a rank's tail); None: in every pass."""


@dataclass(frozen=True)
class HeadLearningReport:
    """What one round of online learning did: responses and pairs learned from, optimizer steps, the pairs those
    steps trained on (summed over steps: what their cost grows with), the first and last step's loss, wall seconds,
    and the policy's passes that computed the hidden states (as :class:`~bubblespec.core.interfaces.ForwardPass`
    counts, for a cost model), one per ``rows_per_pass`` responses."""

    responses: int
    pairs: int
    steps: int
    trained_pairs: int
    first_loss: float | None
    final_loss: float | None
    seconds: float
    hidden_passes: tuple[ForwardPass, ...] = ()
    """The policy's passes over prompt + response (no cache, no logits sampled), for the responses whose hidden
    states the rollout did not keep."""
    kept_responses: int = 0
    """The responses whose hidden states the rollout kept (no pass computed them again)."""

    @classmethod
    def nothing(cls, seconds: float = 0.0) -> HeadLearningReport:
        """A round that learned nothing (no response with tokens, or no step in its budget)."""
        return cls(0, 0, 0, 0, None, None, seconds)


def drafting_call_counts(
    contexts: Sequence[int], given: Sequence[int], num_tokens: int, window: int, vocab_size: int
) -> dict[str, int]:
    """What one :meth:`DraftHead.draft` call computes, as :class:`~bubblespec.core.interfaces.ForwardPass`'s head
    fields (what a cost model charges): rows with ``contexts`` pairs each (capped at ``window``; the last is fed at
    the first step) and ``given`` tokens each, ``num_tokens`` steps. Every row runs every step; each step's query
    attends the latest ``window`` keys; the output head and sampler run at the steps where some row's token is not
    given."""
    contexts = [min(window, c) for c in contexts]
    return {
        "head_steps": num_tokens,
        "head_tokens": len(contexts) * num_tokens,
        "head_context_pairs": sum(c - 1 for c in contexts),
        "head_attention_pairs": sum(min(window, c + step) for c in contexts for step in range(num_tokens)),
        "head_sampled_logits": (num_tokens - min(given, default=0)) * len(contexts) * vocab_size,
    }


PROBE_EVERY = 16
"""Where a head's measured acceptance does not pay for one token, it still proposes one every this many passes, so
that a head that has learned more since is measured again."""


class HeadSizing:
    """How many tokens the head proposes in a pass: the k-th token of a proposal is accepted with probability about
    ``a^k`` (``a``: the head's measured per-token acceptance, each accepted token given the ones before it) and saves
    a pass where it is, while each head step costs ``step_cost`` passes; so it proposes the k with ``a^k >= step_cost``,
    ``floor(log(step_cost) / log(a))``, at most ``max_tokens`` (``max_tokens`` every pass where ``step_cost`` is None).

    ``a`` is ``(accepted + 1) / (accepted + rejected + 2)`` over the head's tokens that verification reached (a
    proposal's own tokens all accepted before them): 0.5 before any evidence. A new round of learning halves the
    counts, so the estimate follows the head as it learns."""

    def __init__(self, max_tokens: int, step_cost: float | None) -> None:
        self.max_tokens = max_tokens
        self.step_cost = step_cost if step_cost is not None and step_cost > 0 else None
        """None (also for a cost of 0: a free step): ``max_tokens`` every pass."""
        self.accepted = self.rejected = 0.0
        self.passes = 0
        """Passes it sized (its probes fall on every :data:`PROBE_EVERY`-th): with the counts, what a checkpoint
        keeps (:meth:`state`)."""

    @property
    def acceptance(self) -> float:
        return (self.accepted + 1) / (self.accepted + self.rejected + 2)

    def tokens(self) -> int:
        """The head's tokens for the next pass (called once a pass)."""
        self.passes += 1
        if self.step_cost is None:
            return self.max_tokens
        a = self.acceptance
        paid = 0 if a <= self.step_cost else self.max_tokens if a >= 1 else int(math.log(self.step_cost) / math.log(a))
        if paid == 0 and self.passes % PROBE_EVERY == 0:
            return 1
        return min(paid, self.max_tokens)

    def observe(self, accepted: int, rejected: bool) -> None:
        """A proposal's head tokens that verification reached: ``accepted`` of them, then a rejected one or not."""
        self.accepted += accepted
        self.rejected += rejected

    def new_round(self) -> None:
        self.accepted, self.rejected = self.accepted / 2, self.rejected / 2

    def state(self) -> list[float]:
        return [self.accepted, self.rejected, self.passes]

    def load_state(self, state: Sequence[float]) -> None:
        self.accepted, self.rejected, self.passes = float(state[0]), float(state[1]), int(state[2])


KeptHidden = Mapping[tuple[tuple[int, ...], tuple[int, ...]], torch.Tensor]
"""Hidden states a rollout already computed, by (prompt ids, response ids): each response's [T, H] rows as
:func:`hidden_pairs` would compute them (the engine that generated it keeps them, ``TorchEngine.keep_hidden``)."""


def sample_key(sample: Sample) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A sample's key among :data:`KeptHidden`: its prompt's and its response's token ids."""
    prompt, response, _ = sample
    return tuple(prompt), tuple(response)


@torch.no_grad()
def hidden_pairs(policy: DecoderModel, samples: Sequence[Sample], rows_per_pass: int = 4) -> HeadBatch:
    """The (hidden state, token) pairs of ``samples``: ``policy``'s last hidden states (before the final norm) over
    prompt + response, from the prompt's last position on (the position whose logits sampled the first token), one
    forward pass per ``rows_per_pass`` responses (bounds a pass's memory at long responses); responses of no tokens
    are left out. What a training pass computes over the same responses, without gradients."""
    kept = [sample for sample in samples if len(sample[1])]
    return _batch(kept, _hidden_rows(policy, kept, rows_per_pass))


def _batch(samples: Sequence[Sample], hidden: Sequence[torch.Tensor]) -> HeadBatch:
    """``samples`` (each with tokens) with their hidden-state rows, as one batch."""
    return HeadBatch.pad(hidden, [torch.tensor(list(r)) for _, r, _ in samples], [t for _, _, t in samples])


@torch.no_grad()
def _hidden_rows(policy: DecoderModel, samples: Sequence[Sample], rows_per_pass: int) -> list[torch.Tensor]:
    """:func:`hidden_pairs`' rows of ``samples`` (each with tokens), one [T, H] tensor a response."""
    hidden = []
    for start in range(0, len(samples), rows_per_pass):
        chunk = samples[start : start + rows_per_pass]
        rows = [torch.tensor([*prompt, *response]) for prompt, response, _ in chunk]
        tokens_BT = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True).to(policy.device)
        positions_BT = torch.arange(tokens_BT.shape[1], device=policy.device)[None].expand(len(rows), -1)
        select_BW = torch.zeros(len(rows), 1, dtype=torch.int64, device=policy.device)  # no logits needed
        _, hidden_BTH = policy.forward(tokens_BT, positions_BT, select_BW=select_BW, return_hidden=True)
        for row, (prompt, response, _) in enumerate(chunk):
            first = len(prompt) - 1
            hidden.append(hidden_BTH[row, first : first + len(response)])
    return hidden


def learn_online(
    trainer: DraftHeadTrainer,
    samples: Sequence[Sample],
    learning: HeadLearning,
    kept_hidden: KeptHidden | None = None,
    until: float | None = None,
) -> HeadLearningReport:
    """One round of online learning: the hidden states of ``samples`` under the policy the trainer's head reads,
    ``kept_hidden``'s where the rollout kept them and :func:`hidden_pairs`' passes for the rest, then
    ``learning.steps`` optimizer steps on them (:meth:`DraftHeadTrainer.train`; none started after ``until``, a
    ``time.perf_counter()`` reading, but the first: the wall clock's budget)."""
    clock = time.perf_counter()
    kept = [sample for sample in samples if len(sample[1])]
    if not kept:
        return HeadLearningReport.nothing(time.perf_counter() - clock)
    kept_hidden = kept_hidden or {}
    found = [kept_hidden.get(sample_key(sample)) for sample in kept]
    missing = [sample for sample, hidden in zip(kept, found, strict=True) if hidden is None]
    rows_per_pass = HIDDEN_ROWS_PER_PASS
    computed = iter(_hidden_rows(trainer.head.policy, missing, rows_per_pass))
    hidden = [next(computed) if rows is None else rows for rows in found]
    batch = _batch(kept, hidden)
    losses, trained = trainer.train(batch, learning.steps, learning.rows_per_step, until)
    return HeadLearningReport(
        responses=len(kept),
        pairs=int(batch.lengths_B.sum()),
        steps=len(losses),
        trained_pairs=trained,
        first_loss=losses[0] if losses else None,
        final_loss=losses[-1] if losses else None,
        seconds=time.perf_counter() - clock,
        hidden_passes=hidden_passes(missing, rows_per_pass),
        kept_responses=len(kept) - len(missing),
    )
