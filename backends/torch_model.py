"""A Llama/Qwen2-family decoder in plain torch, with a slotted KV cache, for the built-in engine.

Weights keep their Hugging Face names, so a checkpoint folder (``config.json`` + ``*.safetensors``) loads as it
is and a trainer's ``state_dict`` can be applied by name. The cache is addressed by absolute position, which is
what makes speculative verification cheap: a rejected draft token needs no undo, its cache entry is simply
overwritten by the next token fed at that position and never read before that (causal masking by position).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bubblespec.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class DecoderConfig:
    """The architecture hyper-parameters the forward pass needs, read from a Hugging Face ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, config: Mapping, source: str) -> DecoderConfig:
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{source}: model_type {model_type!r} is not supported by the torch backend; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelLoadError(f"{source}: rope type {rope_type!r} is not supported; supported: 'default'")
        eos = config.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            intermediate_size=int(config["intermediate_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            eos_token_ids=eos_ids,
        )

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight the forward pass reads, by Hugging Face name."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, self.hidden_size),
            "model.norm.weight": (self.hidden_size,),
        }
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, self.hidden_size)
        for i in range(self.num_layers):
            prefix = f"model.layers.{i}."
            shapes |= {
                prefix + "input_layernorm.weight": (self.hidden_size,),
                prefix + "post_attention_layernorm.weight": (self.hidden_size,),
                prefix + "self_attn.q_proj.weight": (q_size, self.hidden_size),
                prefix + "self_attn.k_proj.weight": (kv_size, self.hidden_size),
                prefix + "self_attn.v_proj.weight": (kv_size, self.hidden_size),
                prefix + "self_attn.o_proj.weight": (self.hidden_size, q_size),
                prefix + "mlp.gate_proj.weight": (self.intermediate_size, self.hidden_size),
                prefix + "mlp.up_proj.weight": (self.intermediate_size, self.hidden_size),
                prefix + "mlp.down_proj.weight": (self.hidden_size, self.intermediate_size),
            }
            if self.attention_bias:
                shapes |= {
                    prefix + "self_attn.q_proj.bias": (q_size,),
                    prefix + "self_attn.k_proj.bias": (kv_size,),
                    prefix + "self_attn.v_proj.bias": (kv_size,),
                }
        return shapes


def read_checkpoint(model_path: str | Path) -> tuple[DecoderConfig, dict[str, torch.Tensor]]:
    """Reads ``config.json`` and every ``*.safetensors`` file of a local Hugging Face model folder."""
    from safetensors.torch import load_file

    folder = Path(model_path).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(
            f"model path {str(model_path)!r} is not a directory (expected a Hugging Face model folder)"
        )
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"model path {str(model_path)!r} has no config.json")
    weight_files = sorted(folder.glob("*.safetensors"))
    if not weight_files:
        raise ModelLoadError(f"model path {str(model_path)!r} has no *.safetensors weights (only safetensors load)")
    try:
        hf_config = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{config_file}: not valid JSON ({error})") from None
    config = DecoderConfig.from_hf(hf_config, str(config_file))
    weights: dict[str, torch.Tensor] = {}
    for file in weight_files:
        weights.update(load_file(file))
    return config, weights


class KVCache:
    """Keys and values by (layer, slot, head, absolute position). Slots ``[0, num_active)`` are in use."""

    def __init__(self, config: DecoderConfig, num_slots: int, max_positions: int, dtype, device) -> None:
        shape = (config.num_layers, num_slots, config.num_kv_heads, max_positions, config.head_dim)
        # Zeros, not empty: masked positions still enter attention as 0 * value, and 0 * NaN would be NaN.
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def max_positions(self) -> int:
        return self.keys.shape[3]

    def move_slot(self, source: int, target: int) -> None:
        self.keys[:, target] = self.keys[:, source]
        self.values[:, target] = self.values[:, source]


class DecoderModel:
    """The forward pass of a Llama/Qwen2-family decoder over a batch of variable-length chunks."""

    def __init__(self, config: DecoderConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, device) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.weights = self._allocate_weights()
        self.load_weights(weights, strict=True)
        inverse_frequency = 1.0 / config.rope_theta ** (
            torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim
        )
        self._inverse_frequency = inverse_frequency.to(self.device)

    def _allocate_weights(self) -> dict[str, torch.Tensor]:
        """Zeroed weights by Hugging Face name. Per layer, q/k/v and gate/up are views into one fused matrix
        each, so that a decode step runs 4 matrix products per layer instead of 7."""
        cfg = self.config

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=self.dtype, device=self.device)

        weights = {name: zeros(*shape) for name, shape in cfg.parameter_shapes().items()}
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self._fused: list[dict[str, torch.Tensor]] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv = zeros(q_size + 2 * kv_size, cfg.hidden_size)
            gate_up = zeros(2 * cfg.intermediate_size, cfg.hidden_size)
            fused = {"qkv": qkv, "gate_up": gate_up, "qkv_bias": None}
            q, k, v = qkv.split([q_size, kv_size, kv_size])
            weights |= {p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k}
            weights[p + "self_attn.v_proj.weight"] = v
            gate, up = gate_up.split([cfg.intermediate_size, cfg.intermediate_size])
            weights |= {p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up}
            if cfg.attention_bias:
                fused["qkv_bias"] = zeros(q_size + 2 * kv_size)
                q_bias, k_bias, v_bias = fused["qkv_bias"].split([q_size, kv_size, kv_size])
                weights |= {p + "self_attn.q_proj.bias": q_bias, p + "self_attn.k_proj.bias": k_bias}
                weights[p + "self_attn.v_proj.bias"] = v_bias
            self._fused.append(fused)
        return weights

    def trainable_parameters(self) -> list[torch.Tensor]:
        """The leaf tensors (fused matrices included), set to require gradients, for an optimizer."""
        fused_views = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
        leaves = [t for n, t in self.weights.items() if n.split(".")[-2] not in fused_views]
        for fused in self._fused:
            leaves += [t for t in fused.values() if t is not None]
        return [t.requires_grad_() for t in leaves]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Detached copies of every weight by Hugging Face name."""
        return {name: tensor.detach().clone() for name, tensor in self.weights.items()}

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor], strict: bool = False) -> None:
        """Copies ``weights`` (Hugging Face names) into the model; unknown names or wrong shapes are refused."""
        expected = self.config.parameter_shapes()
        ignored = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        unknown = [n for n in weights if n not in expected and n not in ignored and "rotary_emb" not in n]
        if unknown:
            raise ValueError(f"unknown weight names {unknown[:5]}; expected names like {next(iter(expected))!r}")
        missing = [n for n in expected if n not in weights]
        if strict and missing:
            raise ModelLoadError(f"checkpoint is missing weights {missing[:5]} ({len(missing)} in all)")
        for name, tensor in weights.items():
            if name not in expected:
                continue
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected[name]}")
            self.weights[name].copy_(tensor.detach())

    def forward(
        self,
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor,
        cache: KVCache | None = None,
        select_BW: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, W, V] at chunk indices ``select_BW`` (all indices when None).

        With a cache, ``tokens_BT`` are fed at ``positions_BT`` into cache slots ``[0, B)`` and attend to
        everything cached before them. Without one (training), each row is a whole sequence from position 0,
        right-padded, attending causally within itself.
        """
        w, cfg = self.weights, self.config
        batch, length = tokens_BT.shape
        cos_BT1D, sin_BT1D = self._rope(positions_BT)
        if cache is not None:
            span = int(positions_BT.max()) + 1  # attend to cache positions [0, span)
            slots_BT = torch.arange(batch, device=self.device)[:, None].expand(batch, length)
            # A query attends every cache position at or before its own: the causal mask by absolute position.
            mask_B1TS = (torch.arange(span, device=self.device)[None, None, :] <= positions_BT[:, :, None])[:, None]
        qkv_sizes = [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
        hidden_BTH = F.embedding(tokens_BT, w["model.embed_tokens.weight"])
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            x_BTH = self._rms_norm(hidden_BTH, w[p + "input_layernorm.weight"])
            fused = self._fused[i]
            q, k, v = F.linear(x_BTH, fused["qkv"], fused["qkv_bias"]).split(qkv_sizes, dim=-1)
            q_BTND = _rotate(q.view(batch, length, cfg.num_heads, cfg.head_dim), cos_BT1D, sin_BT1D)
            k_BTND = _rotate(k.view(batch, length, cfg.num_kv_heads, cfg.head_dim), cos_BT1D, sin_BT1D)
            v_BTND = v.view(batch, length, cfg.num_kv_heads, cfg.head_dim)
            gqa = cfg.num_heads != cfg.num_kv_heads
            if cache is None:
                attention_BNTD = F.scaled_dot_product_attention(
                    q_BTND.transpose(1, 2),
                    k_BTND.transpose(1, 2),
                    v_BTND.transpose(1, 2),
                    is_causal=True,
                    enable_gqa=gqa,
                )
            else:
                cache.keys[i, slots_BT, :, positions_BT] = k_BTND
                cache.values[i, slots_BT, :, positions_BT] = v_BTND
                attention_BNTD = F.scaled_dot_product_attention(
                    q_BTND.transpose(1, 2),
                    cache.keys[i, :batch, :, :span],
                    cache.values[i, :batch, :, :span],
                    attn_mask=mask_B1TS,
                    enable_gqa=gqa,
                )
            attention_BTH = attention_BNTD.transpose(1, 2).reshape(batch, length, -1)
            hidden_BTH = hidden_BTH + F.linear(attention_BTH, w[p + "self_attn.o_proj.weight"])
            x_BTH = self._rms_norm(hidden_BTH, w[p + "post_attention_layernorm.weight"])
            gate, up = F.linear(x_BTH, fused["gate_up"]).chunk(2, dim=-1)
            gate = F.silu(gate) * up
            hidden_BTH = hidden_BTH + F.linear(gate, w[p + "mlp.down_proj.weight"])
        if select_BW is None:
            selected_BWH = hidden_BTH
        else:
            selected_BWH = torch.gather(hidden_BTH, 1, select_BW[:, :, None].expand(-1, -1, hidden_BTH.shape[-1]))
        head = w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
        return F.linear(self._rms_norm(selected_BWH, w["model.norm.weight"]), head)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Like Hugging Face: normalise in at least float32, scale in the model's dtype.
        compute = x.to(torch.promote_types(x.dtype, torch.float32))
        compute = compute * torch.rsqrt(compute.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * compute.to(x.dtype)

    def _rope(self, positions_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles_BTd = positions_BT.to(torch.float64)[..., None] * self._inverse_frequency
        angles_BTD = torch.cat([angles_BTd, angles_BTd], dim=-1)[:, :, None, :]
        return angles_BTD.cos().to(self.dtype), angles_BTD.sin().to(self.dtype)


def _rotate(x_BTND: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x_BTND.shape[-1] // 2
    rotated = torch.cat([-x_BTND[..., half:], x_BTND[..., :half]], dim=-1)
    return x_BTND * cos + rotated * sin
