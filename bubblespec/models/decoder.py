"""A Llama/Qwen2/Qwen3/Mistral decoder in plain torch, with a slotted KV cache: the built-in engine generates with
it and the trainer's built-in model trains it (one model, in core; engines import it, it imports no engine).

Weights keep their Hugging Face names, so a checkpoint folder (``config.json`` + ``*.safetensors``) loads as it
is and a trainer's ``state_dict`` can be applied by name. The cache is addressed by absolute position, which is
what makes speculative verification cheap: a rejected draft token needs no undo, its cache entry is simply
overwritten by the next token fed at that position and never read before that (causal masking by position).

Families: Llama (plain RoPE or Llama 3.x ``llama3`` rotary scaling; attention biases if configured), Qwen2
(q/k/v biases, tied embeddings, sliding windows on the layers ``layer_types`` names), Qwen3 (per-head RMSNorm of
queries and keys before RoPE) and Mistral (a sliding window on every layer). A window is a mask by position: the
cache still holds every position, so windows need no eviction bookkeeping (and save no cache memory).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bubblespec.core.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
"""The dtypes of ``model.dtype``, by name."""
_ATTENTION_KINDS = ("full_attention", "sliding_attention")
KEY_ALIGNMENT = 16
"""With a cache, attention reads key positions up to a multiple of this many (masked past the last fed one), and
:class:`KVCache` holds a multiple of it. torch's CPU attention runs over keys 16 floats at a time and handles a
partial last vector apart: with a span that ends where the pass's longest row ends, the keys a row sees would be
summed in an order set by the other rows (and by the draft tokens after it), and in bfloat16 or float32 the row's
attention output, hence its logits, would change with the batch."""
KEY_BLOCK = 512
"""A sliding window's first key position is a multiple of this: torch's CPU attention takes keys in blocks of 512
from the first one it is given and rescales its running softmax sum per block, so blocks starting at a position
set by the batch's shortest row would change a row's rounding with the batch."""
ROW_MULTIPLE = 4
"""A batch-invariant model (``DecoderModel(batch_invariant=True)``, float32 or float64 on a CPU) runs every matrix
product of an inference pass over a multiple of this many rows (zero rows added, their outputs dropped): torch's CPU
matrix product (MKL) computes the last rows of a product apart when their count is not a multiple of 4, in another
summation order, so a row would round otherwise in a decode pass of 1-3 sequences than in a verify pass."""
_FOLDED_MASK_ELEMENTS = 1 << 24
"""At most this many mask entries per attention call when a chunk's queries are folded into heads (see
:meth:`DecoderModel._attention`): a long prefill runs in several calls."""


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1/3.2 rotary scaling (``rope_type: llama3``): see :func:`rope_inverse_frequency`."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
    qk_norm: bool = False
    """Qwen3: a per-head RMSNorm (``q_norm``, ``k_norm``, weights of size head_dim) on queries and keys, before
    the rotary embedding."""
    output_bias: bool = False
    """A bias on ``o_proj`` (Llama/Qwen3 with ``attention_bias``; Qwen2 has q/k/v biases only)."""
    rope_llama3: Llama3RopeScaling | None = None
    """Llama 3.x frequency-dependent rotary scaling; None: plain RoPE."""
    sliding_windows: tuple[int | None, ...] = ()
    """Per layer, how many latest positions (the query's own included) a query attends; None or a missing
    entry: all of them."""

    @classmethod
    def from_hf(cls, config: Mapping, source: str) -> DecoderConfig:
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{source}: model_type {model_type!r} is not supported by the torch backend; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        _check_mlp(config, source)
        rope_theta, rope_llama3 = _read_rope(config, source)
        eos = config.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        num_layers = int(config["num_hidden_layers"])
        # Qwen2 always has q/k/v biases and Mistral never; Llama and Qwen3 follow attention_bias, o_proj included.
        configurable_bias = model_type in ("llama", "qwen3") and bool(config.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            intermediate_size=int(config["intermediate_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or configurable_bias,
            eos_token_ids=eos_ids,
            qk_norm=model_type == "qwen3",
            output_bias=configurable_bias,
            rope_llama3=rope_llama3,
            sliding_windows=_read_sliding_windows(config, model_type, num_layers, source),
        )

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, None for full attention."""
        return self.sliding_windows[layer] if layer < len(self.sliding_windows) else None

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
            if self.output_bias:
                shapes[prefix + "self_attn.o_proj.bias"] = (self.hidden_size,)
            if self.qk_norm:
                shapes[prefix + "self_attn.q_norm.weight"] = (self.head_dim,)
                shapes[prefix + "self_attn.k_norm.weight"] = (self.head_dim,)
        return shapes


def _check_mlp(config: Mapping, source: str) -> None:
    """The forward pass computes ``down(silu(gate(x)) * up(x))`` without biases."""
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise ModelLoadError(f"{source}: hidden_act {activation!r} is not supported; supported: 'silu'")
    if config.get("mlp_bias", False):
        raise ModelLoadError(f"{source}: mlp_bias true is not supported; supported: mlp_bias false")


def _read_rope(config: Mapping, source: str) -> tuple[float, Llama3RopeScaling | None]:
    """``rope_theta`` and the Llama 3 scaling, from transformers 5's ``rope_parameters`` (which holds
    ``rope_theta`` and ``rope_type``) or 4.x's top-level ``rope_theta`` with ``rope_scaling``."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if any(isinstance(value, Mapping) for value in rope.values()):
        raise ModelLoadError(
            f"{source}: rotary parameters per layer type ({sorted(rope)}) are not supported; "
            f"supported: one set of rotary parameters with rope_type in {list(SUPPORTED_ROPE_TYPES)}"
        )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope type {rope_type!r} is not supported; supported: "
            + ", ".join(repr(t) for t in SUPPORTED_ROPE_TYPES)
        )
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor {partial!r} is not supported; supported: 1.0")
    theta = float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0)
    if rope_type == "default":
        return theta, None
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in rope]
    if missing:
        raise ModelLoadError(f"{source}: rope type 'llama3' needs {missing} in its rotary parameters")
    # Like transformers: a top-level original_max_position_embeddings wins, then the rotary parameters' own.
    original = (
        config.get("original_max_position_embeddings")
        or rope.get("original_max_position_embeddings")
        or config.get("max_position_embeddings", 8192)
    )
    scaling = Llama3RopeScaling(
        float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]), int(original)
    )
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ModelLoadError(
            f"{source}: llama3 rope needs high_freq_factor > low_freq_factor, got {scaling.high_freq_factor} "
            f"and {scaling.low_freq_factor}"
        )
    return theta, scaling


def _read_sliding_windows(config: Mapping, model_type: str, num_layers: int, source: str) -> tuple[int | None, ...]:
    """Per-layer attention windows as transformers applies them. Mistral: ``sliding_window`` on every layer.
    Qwen2/Qwen3: only with ``use_sliding_window``, on the layers that ``layer_types`` marks
    ``sliding_attention`` (without ``layer_types``: layers ``max_window_layers`` and above). Llama: none."""
    # A missing key takes the transformers config class's default (sliding_window 4096, max_window_layers 28).
    if model_type == "mistral":
        window = config.get("sliding_window", 4096)
        kinds = ["sliding_attention"] * num_layers
    elif model_type in ("qwen2", "qwen3") and config.get("use_sliding_window", False):
        window = config.get("sliding_window", 4096)
        first = int(config.get("max_window_layers", 28))
        kinds = config.get("layer_types") or [_ATTENTION_KINDS[i >= first] for i in range(num_layers)]
    else:
        return ()
    if window is None:
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelLoadError(f"{source}: sliding_window {window!r} is not a positive number of positions")
    unknown = sorted({kind for kind in kinds if kind not in _ATTENTION_KINDS})
    if unknown or len(kinds) != num_layers:
        raise ModelLoadError(
            f"{source}: layer_types {kinds!r} must name {num_layers} layers, each one of {list(_ATTENTION_KINDS)}"
        )
    windows = tuple(window if kind == "sliding_attention" else None for kind in kinds)
    return windows if any(w is not None for w in windows) else ()


def rope_inverse_frequency(head_dim: int, theta: float, llama3: Llama3RopeScaling | None = None) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim / 2] in float64: ``f_d = theta^(-2d / head_dim)``.

    Llama 3 scaling (as transformers' ``_compute_llama3_parameters``), with wavelength ``l_d = 2 pi / f_d`` and
    original context ``L``: ``f_d`` is kept where ``l_d < L / high_freq_factor``, divided by ``factor`` where
    ``l_d > L / low_freq_factor``, and in between interpolated as ``(1 - s) f_d / factor + s f_d`` with
    ``s = (L / l_d - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
    """
    frequency_d = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if llama3 is None:
        return frequency_d
    original = llama3.original_max_position_embeddings
    wavelength_d = 2 * math.pi / frequency_d
    smooth_d = (original / wavelength_d - llama3.low_freq_factor) / (llama3.high_freq_factor - llama3.low_freq_factor)
    interpolated_d = (1 - smooth_d) * frequency_d / llama3.factor + smooth_d * frequency_d
    scaled_d = torch.where(wavelength_d > original / llama3.low_freq_factor, frequency_d / llama3.factor, frequency_d)
    is_medium_d = (wavelength_d >= original / llama3.high_freq_factor) & (
        wavelength_d <= original / llama3.low_freq_factor
    )
    return torch.where(is_medium_d, interpolated_d, scaled_d)


def read_checkpoint(model_path: str | Path) -> tuple[DecoderConfig, dict[str, torch.Tensor]]:
    """Reads ``config.json`` and every ``*.safetensors`` file of a local Hugging Face model folder."""
    from bubblespec.core import model_folder

    return read_model_config(model_path), model_folder.weights(model_path)


def read_model_config(model_path: str | Path) -> DecoderConfig:
    """The decoder configuration of a local Hugging Face model folder, without reading its weights: an error
    naming what is missing or unsupported (architecture, rope type, ...)."""
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
    return DecoderConfig.from_hf(hf_config, str(config_file))


def check_weight_names(given: Sequence[str], expected: Sequence[str], strict: bool) -> None:
    """Weights by Hugging Face name: an unknown name is refused, and with ``strict`` so is a missing one."""
    known = set(expected)
    unknown = [name for name in given if name not in known]
    if unknown:
        raise ValueError(f"unknown weight names {unknown[:5]}; expected names like {expected[0]!r}")
    if strict:
        present = set(given)
        missing = [name for name in expected if name not in present]
        if missing:
            raise ModelLoadError(f"checkpoint is missing weights {missing[:5]} ({len(missing)} in all)")


@dataclass(frozen=True)
class TokenTree:
    """A forward pass's chunks as token trees (:meth:`DecoderModel.forward`): candidate continuations of each
    sequence share their common prefixes, and a token sees only the tokens on its own path.

    A chunk's tokens are stored at consecutive cache positions as usual (so a rejected branch needs no undo); a
    tree token stands at the position its depth gives it in the sequence, which may be before where it is stored.
    The engine moves the keys and values of the accepted path to their positions afterwards
    (:meth:`KVCache.move_positions`)."""

    positions_BT: torch.Tensor
    """The position of each chunk token in its sequence (RoPE, windows)."""
    visible_BTT: torch.Tensor
    """Bool [B, T, T]: whether chunk token t (a query) sees chunk token u (a key): itself and its ancestors."""


class KVCache:
    """Keys and values by (layer, slot, head, absolute position). Slots ``[0, num_active)`` are in use."""

    def __init__(self, config: DecoderConfig, num_slots: int, max_positions: int, dtype, device) -> None:
        # At least max_positions: a whole number of KEY_ALIGNMENT, so that an aligned key span always fits.
        max_positions = -(-max_positions // KEY_ALIGNMENT) * KEY_ALIGNMENT
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

    def move_positions(self, slot: int, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Copies the keys and values at positions ``sources`` of ``slot`` to ``targets`` (all read first)."""
        self.keys[:, slot, :, list(targets)] = self.keys[:, slot, :, list(sources)]
        self.values[:, slot, :, list(targets)] = self.values[:, slot, :, list(sources)]


def check_batch_invariant(dtype: torch.dtype, device) -> None:
    """Refuses a batch-invariant model where it is not built: bfloat16 (its matrix products round with the row count
    past 16 rows) and CUDA (its kernels are not measured)."""
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.float64):
        name = str(dtype).removeprefix("torch.")
        raise ValueError(
            f"batch_invariant is for float32 or float64 on a CPU, not {name} on {str(device)!r} (bfloat16's matrix "
            "products round with the row count past 16 rows; CUDA kernels are not measured)"
        )


class DecoderModel:
    """The forward pass of a Llama/Qwen2/Qwen3/Mistral decoder over a batch of variable-length chunks."""

    def __init__(
        self,
        config: DecoderConfig,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device,
        batch_invariant: bool = False,
    ) -> None:
        """``batch_invariant`` (float32 or float64 on a CPU): a row's logits are bit-identical in every inference
        pass, whatever the other rows and however many of its own tokens the pass feeds, so a verified draft never
        flips a sampling near-tie that plain decoding would not; a verify pass costs 1.2-1.9x as much on a CPU
        (docs/design.md §3.2)."""
        if batch_invariant:
            check_batch_invariant(dtype, device)
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.weights = self._allocate_weights()
        self.load_weights(weights, strict=True)
        inverse_frequency = rope_inverse_frequency(config.head_dim, config.rope_theta, config.rope_llama3)
        self._inverse_frequency = inverse_frequency.to(self.device)
        # A chunk's queries attend one per head, as a decode pass's do (see _attention): in bfloat16 on a CPU always
        # (its verify passes would flip near-ties more often than batch order does), in float32 and float64 where
        # the model is batch-invariant, whose products also run over a multiple of ROW_MULTIPLE rows (_linear).
        self._one_query_per_head = batch_invariant or (dtype == torch.bfloat16 and self.device.type == "cpu")
        self._row_multiple = ROW_MULTIPLE if batch_invariant else 1

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
        given = [n for n in weights if n not in ignored and "rotary_emb" not in n]
        check_weight_names(given, list(expected), strict)
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
        tree: TokenTree | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, W, V] at chunk indices ``select_BW`` (all indices when None).

        ``return_hidden``: also the last layer's output before the final norm at every fed token, not only the
        selected ones (``(logits_BWV, hidden_BTH)``): what a draft head reads (:mod:`bubblespec.models.draft_head`).

        With a cache, ``tokens_BT`` are fed at ``positions_BT`` into cache slots ``[0, B)`` and attend to
        everything cached before them. Without one (training), each row is a whole sequence from position 0,
        right-padded, attending causally within itself. A layer with a sliding window ``w`` lets the query at
        position ``p`` attend positions ``(p - w, p]`` only.

        ``tree`` (with a cache): the chunk holds token trees (several candidate continuations verified at once);
        ``positions_BT`` are then where each token's keys and values are stored, and the tree gives the positions
        its tokens take in their sequence and which of the chunk's tokens each one sees (see :class:`TokenTree`).
        """
        w, cfg = self.weights, self.config
        batch, length = tokens_BT.shape
        cos_BT1D, sin_BT1D = self._rope(positions_BT if tree is None else tree.positions_BT)
        masks = {window: self._mask(positions_BT, cache, window, tree) for window in {None, *cfg.sliding_windows}}
        slots_BT = None if cache is None else torch.arange(batch, device=self.device)[:, None].expand(batch, length)
        qkv_sizes = [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
        hidden_BTH = F.embedding(tokens_BT, w["model.embed_tokens.weight"])
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            x_BTH = self._rms_norm(hidden_BTH, w[p + "input_layernorm.weight"])
            fused = self._fused[i]
            q, k, v = self._linear(x_BTH, fused["qkv"], fused["qkv_bias"]).split(qkv_sizes, dim=-1)
            q_BTND = q.view(batch, length, cfg.num_heads, cfg.head_dim)
            k_BTND = k.view(batch, length, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q_BTND = self._rms_norm(q_BTND, w[p + "self_attn.q_norm.weight"])
                k_BTND = self._rms_norm(k_BTND, w[p + "self_attn.k_norm.weight"])
            q_BTND = rotate(q_BTND, cos_BT1D, sin_BT1D)
            k_BTND = rotate(k_BTND, cos_BT1D, sin_BT1D)
            v_BTND = v.view(batch, length, cfg.num_kv_heads, cfg.head_dim)
            mask = masks[cfg.layer_window(i)]
            attention_BNTD = self._attention(i, q_BTND, k_BTND, v_BTND, cache, (slots_BT, positions_BT), mask)
            attention_BTH = attention_BNTD.transpose(1, 2).reshape(batch, length, -1)
            output_bias = w.get(p + "self_attn.o_proj.bias")
            hidden_BTH = hidden_BTH + self._linear(attention_BTH, w[p + "self_attn.o_proj.weight"], output_bias)
            x_BTH = self._rms_norm(hidden_BTH, w[p + "post_attention_layernorm.weight"])
            gate, up = self._linear(x_BTH, fused["gate_up"]).chunk(2, dim=-1)
            gate = F.silu(gate) * up
            hidden_BTH = hidden_BTH + self._linear(gate, w[p + "mlp.down_proj.weight"])
        if select_BW is None:
            selected_BWH = hidden_BTH
        else:
            selected_BWH = torch.gather(hidden_BTH, 1, select_BW[:, :, None].expand(-1, -1, hidden_BTH.shape[-1]))
        head = w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
        logits_BWV = self._linear(self._rms_norm(selected_BWH, w["model.norm.weight"]), head)
        return (logits_BWV, hidden_BTH) if return_hidden else logits_BWV

    def _mask(
        self, positions_BT: torch.Tensor, cache: KVCache | None, window: int | None, tree: TokenTree | None = None
    ) -> tuple[int, torch.Tensor | None]:
        """The first key position a query of this forward pass can see, and the boolean attention mask over
        key positions ``[start, ...)``: ``key <= query`` and, with a window, ``key > query - window``.

        Without a cache and a window the mask is None (causal attention by index). With a cache, keys are cache
        positions ``[start, span)`` with ``span`` one past the last fed position rounded up to a multiple of
        :data:`KEY_ALIGNMENT`: a window also skips the cache positions no query of the batch can see, from a multiple
        of :data:`KEY_BLOCK` on. Both roundings keep a row's attention from depending on the other rows of the pass:
        masked keys add exact zeros, but where the span ends and where the key blocks start changes the order in
        which the visible ones are summed. With a ``tree``, a query sees the cache before the chunk and, within the
        chunk, what :attr:`TokenTree.visible_BTT` says; windows count by the tree's positions."""
        if cache is None:
            if window is None:
                return 0, None
            keys_B1S = positions_BT[:, None, :]
            queries_BT1 = positions_BT[:, :, None]
            return 0, ((keys_B1S <= queries_BT1) & (keys_B1S > queries_BT1 - window))[:, None]
        span = min(-(-(int(positions_BT.max()) + 1) // KEY_ALIGNMENT) * KEY_ALIGNMENT, cache.max_positions)
        start = 0 if window is None else max(0, int(positions_BT.min()) - window + 1) // KEY_BLOCK * KEY_BLOCK
        keys_11S = torch.arange(start, span, device=self.device)[None, None, :]
        queries_BT1 = positions_BT[:, :, None]
        visible_BTS = keys_11S <= queries_BT1
        if tree is not None:
            # The chunk's own keys: those the tree lets each query see (their stored positions need not be in order).
            chunk_keys_BTT = (positions_BT - start)[:, None, :].expand(-1, positions_BT.shape[1], -1)
            visible_BTS = visible_BTS & (keys_11S < positions_BT.min(dim=1).values[:, None, None])
            visible_BTS = visible_BTS.scatter(2, chunk_keys_BTT, tree.visible_BTT)
            if window is not None:  # by the keys' and queries' positions in their sequences
                keys_BTS = torch.arange(start, span, device=self.device)[None, None, :].expand_as(visible_BTS)
                keys_BTS = keys_BTS.scatter(2, chunk_keys_BTT, tree.positions_BT[:, None, :].expand_as(chunk_keys_BTT))
                visible_BTS = visible_BTS & (keys_BTS > tree.positions_BT[:, :, None] - window)
            return start, visible_BTS[:, None]
        if window is not None:
            visible_BTS = visible_BTS & (keys_11S > queries_BT1 - window)
        return start, visible_BTS[:, None]

    def _attention(self, layer, q_BTND, k_BTND, v_BTND, cache, where, mask) -> torch.Tensor:
        """Attention [B, N, T, D]: within the chunk (no cache) or over the cache after writing the chunk's keys and
        values at ``where`` = (cache slots [B, T], positions [B, T]); ``mask`` is :meth:`_mask`'s."""
        gqa = self.config.num_heads != self.config.num_kv_heads
        start, mask_B1TS = mask
        if cache is None:
            return F.scaled_dot_product_attention(
                q_BTND.transpose(1, 2),
                k_BTND.transpose(1, 2),
                v_BTND.transpose(1, 2),
                attn_mask=mask_B1TS,
                is_causal=mask_B1TS is None,
                enable_gqa=gqa,
            )
        slots_BT, positions_BT = where
        batch, length, heads, dim = q_BTND.shape
        cache.keys[layer, slots_BT, :, positions_BT] = k_BTND
        cache.values[layer, slots_BT, :, positions_BT] = v_BTND
        span = start + mask_B1TS.shape[-1]
        keys_BKSD = cache.keys[layer, :batch, :, start:span]
        values_BKSD = cache.values[layer, :batch, :, start:span]
        q_BNTD = q_BTND.transpose(1, 2)
        if length == 1 or not self._one_query_per_head:
            return F.scaled_dot_product_attention(q_BNTD, keys_BKSD, values_BKSD, attn_mask=mask_B1TS, enable_gqa=gqa)
        # One query per head, as in a decode pass: torch's CPU attention computes a head's lone query with other
        # kernels (another summation order) than a block of several, so a chunk's T queries become T heads of one
        # query each. Head n * T + t still reads key/value head n // (N / K); the mask is copied per head. It costs
        # time in passes of several tokens per sequence (attention 3-7x slower there on a CPU).
        num_keys = mask_B1TS.shape[-1]
        step = max(1, _FOLDED_MASK_ELEMENTS // (batch * heads * num_keys))
        outputs = []
        for first in range(0, length, step):
            q_BNtD = q_BNTD[:, :, first : first + step]
            chunk = q_BNtD.shape[2]
            mask_BNtS = mask_B1TS[:, :, first : first + chunk].expand(batch, heads, chunk, num_keys)
            out_BHlD = F.scaled_dot_product_attention(
                q_BNtD.reshape(batch, heads * chunk, 1, dim),
                keys_BKSD,
                values_BKSD,
                attn_mask=mask_BNtS.reshape(batch, heads * chunk, 1, num_keys),
                enable_gqa=True,
            )
            outputs.append(out_BHlD.view(batch, heads, chunk, dim))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear``, over a multiple of :data:`ROW_MULTIPLE` rows in a batch-invariant model (with gradients off:
        training's products are left as they are)."""
        rows = x.shape[:-1].numel()
        pad = -rows % self._row_multiple
        if not pad or torch.is_grad_enabled():
            return F.linear(x, weight, bias)
        padded = torch.cat([x.reshape(rows, x.shape[-1]), x.new_zeros(pad, x.shape[-1])])
        return F.linear(padded, weight, bias)[:rows].view(*x.shape[:-1], weight.shape[0])

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def _rope(self, positions_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_cos_sin(positions_BT, self._inverse_frequency, self.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension. Like Hugging Face: normalise in at least float32, scale in ``x``'s dtype."""
    compute = x.to(torch.promote_types(x.dtype, torch.float32))
    compute = compute * torch.rsqrt(compute.pow(2).mean(-1, keepdim=True) + eps)
    return weight * compute.to(x.dtype)


def rotary_cos_sin(
    positions_BT: torch.Tensor, inverse_frequency: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, T, 1, D] of the rotary angles ``position * f_d`` (computed in float64, then cast to ``dtype``;
    ``inverse_frequency``: :func:`rope_inverse_frequency`), each half of the head dimension taking the same angles."""
    angles_BTd = positions_BT.to(torch.float64)[..., None] * inverse_frequency
    angles_BTD = torch.cat([angles_BTd, angles_BTd], dim=-1)[:, :, None, :]
    return angles_BTD.cos().to(dtype), angles_BTD.sin().to(dtype)


def rotate(x_BTND: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of queries or keys [B, T, N, D] (Hugging Face's rotate-half layout)."""
    half = x_BTND.shape[-1] // 2
    rotated = torch.cat([-x_BTND[..., half:], x_BTND[..., :half]], dim=-1)
    return x_BTND * cos + rotated * sin
