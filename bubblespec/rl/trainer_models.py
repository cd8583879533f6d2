"""The models a learner trains: the built-in decoder, or the user's model as transformers loads it (optionally with
LoRA adapters from peft). Both look alike to :class:`bubblespec.rl.learner.GRPOLearner`::

    forward(tokens_BT, positions_BT) -> logits_BTV     whole right-padded sequences from position 0
    trainable_parameters() -> list of leaf tensors     what the optimizer updates, in a fixed order
    state_dict() -> {Hugging Face name: tensor}        the weights engines receive (LoRA: merged into the base)
    load_weights(weights, strict)                      weights by Hugging Face name
    device

The engines keep their own model (the built-in decoder for the torch engine): whichever the trainer trains, weights
travel by Hugging Face name, so the engine must run the architecture (checked before a run starts).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import torch

from bubblespec.core.config import BuiltinModel, LoraSettings
from bubblespec.core.config import TransformersModel as TransformersSettings
from bubblespec.core.errors import ModelLoadError
from bubblespec.models.decoder import DecoderModel, check_weight_names, read_checkpoint


def load_trainer_model(model_path: str, dtype: torch.dtype, settings: BuiltinModel | TransformersSettings, device: str):
    """The model ``settings`` (``trainer.model``) names, in ``dtype`` on ``device``."""
    if isinstance(settings, BuiltinModel):
        model_config, weights = read_checkpoint(model_path)
        return DecoderModel(model_config, weights, dtype, device)
    return TransformersModel(model_path, dtype, device, settings.gradient_checkpointing, settings.lora)


class TransformersModel:
    """A causal LM as transformers' ``AutoModelForCausalLM`` loads it from the folder; with ``lora``, peft adapters
    on it: only the adapters train (in float32 whatever ``dtype``), and :meth:`state_dict` merges them into the base
    weights without touching the base."""

    def __init__(
        self, model_path: str, dtype: torch.dtype, device: str, gradient_checkpointing: bool, lora: LoraSettings | None
    ) -> None:
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        except (OSError, ValueError, KeyError) as error:
            raise ModelLoadError(f"transformers cannot load {model_path} as a causal LM: {error}") from None
        self.device = torch.device(device)
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        self.lora = lora
        if lora is not None:
            from peft import LoraConfig, get_peft_model

            # No adapter dropout: it would draw from an RNG no checkpoint restores, and a run must be reproducible.
            settings = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,
                                  target_modules=list(lora.target_modules), bias="none")  # fmt: skip
            with torch.random.fork_rng(devices=[]):  # A's random start, the same in every run and worker
                torch.manual_seed(lora.init_seed)
                model = get_peft_model(model, settings)  # adapters in float32 (peft's autocast_adapter_dtype)
        model.to(self.device)  # after the adapters: they are initialised on the CPU's seeded generator
        model.train()
        self.module = model

    def forward(self, tokens_BT: torch.Tensor, positions_BT: torch.Tensor) -> torch.Tensor:
        # Right-padded rows from position 0: causal attention keeps every real token's logits unaffected by padding.
        return self.module(input_ids=tokens_BT, position_ids=positions_BT, use_cache=False).logits

    def trainable_parameters(self) -> list[torch.Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight by Hugging Face name, detached copies; LoRA adapters merged: W + scale * B @ A."""
        return {name: tensor.clone() for name, tensor in merged_weights(self.module).items()}

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor], strict: bool = False) -> None:
        """Base weights by Hugging Face name (into the base model under LoRA; adapters are not touched)."""
        current = self._base_state()
        check_weight_names(list(weights), list(current), strict)
        for name, tensor in weights.items():
            current[name].copy_(tensor.to(current[name].dtype))

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The LoRA adapters' weights (peft names), for checkpoints; empty without LoRA."""
        if self.lora is None:
            return {}
        return {n: p.detach().clone() for n, p in self.module.named_parameters() if "lora_" in n}

    @torch.no_grad()
    def load_adapter_state(self, state: Mapping[str, torch.Tensor]) -> None:
        parameters = dict(self.module.named_parameters())
        for name, tensor in state.items():
            parameters[name].copy_(tensor)

    def _base_state(self) -> dict[str, torch.Tensor]:
        """The base model's weights by Hugging Face name (live tensors, tied ones once under each name)."""
        return base_weights(self.module)


# -- weights of a transformers model, peft's LoRA merged (also what bubblespec.integrations.trl sends TRL's model as) --


def base_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A transformers model's weights by Hugging Face name: live tensors, tied ones once under each name. On a peft
    model, its base model's: adapters left out, peft's ``base_model.model.`` and ``.base_layer.`` out of the names."""
    state = {}
    for name, tensor in _peft_base(module).state_dict(keep_vars=True).items():
        if "lora_" not in name:
            state[name.replace(".base_layer.", ".")] = tensor.data
    return state


@torch.no_grad()
def lora_deltas(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """scale * B @ A of the active LoRA adapter (peft's ``get_delta_weight``) for every adapted layer, by the Hugging
    Face name of the layer's weight; an adapter already merged into its layer is left out; empty without peft."""
    if not _is_peft_model(module):
        return {}
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for name, layer in module.get_base_model().named_modules():
        if isinstance(layer, LoraLayer):
            held = set(layer.lora_A) | set(layer.lora_embedding_A)  # the adapters on this layer
            for adapter in layer.active_adapters:
                if adapter in held and adapter not in layer.merged_adapters:
                    deltas[f"{name}.weight"] = layer.get_delta_weight(adapter).detach()
    return deltas


def merged_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight by Hugging Face name with the LoRA adapter merged as peft's ``merge_and_unload`` merges it:
    W + scale * B @ A, added in W's and the delta's dtype (at least float32) and rounded to W's dtype. The merged
    weights are new tensors, the others the live ones (detached); the module is not changed. What this cannot
    merge is listed by :func:`lora_merge_problems`."""
    weights = base_weights(module)
    for name, delta in lora_deltas(module).items():
        weight = weights[name]
        dtype = torch.promote_types(torch.promote_types(weight.dtype, delta.dtype), torch.float32)
        weights[name] = (weight.to(dtype) + delta.to(dtype)).to(weight.dtype)
    return weights


def lora_merge_problems(module: torch.nn.Module) -> list[str]:
    """Why :func:`merged_weights` would not be the weights this peft model computes with; [] when it would (a model
    without peft, or one active plain LoRA adapter: no variant such as DoRA, no ``lora_bias``, no
    ``modules_to_save``, ``trainable_token_indices`` or ``target_parameters``)."""
    if not _is_peft_model(module):
        return []
    from peft import PeftType
    from peft.tuners.lora import LoraLayer, ParamWrapper
    from peft.utils.other import AuxiliaryTrainingWrapper

    active = list(module.active_adapters)
    problems = [] if len(active) == 1 else [f"{len(active)} active adapters {active}, not one"]
    problems += [
        f"adapter {name!r} is {module.peft_config[name].peft_type.value}, not LORA"
        for name in active
        if module.peft_config[name].peft_type != PeftType.LORA
    ]
    found: dict[str, str] = {}  # problem -> the first layer with it
    for name, layer in module.get_base_model().named_modules():
        if isinstance(layer, AuxiliaryTrainingWrapper):
            found.setdefault(f"{type(layer).__name__} (modules_to_save / trainable_token_indices)", name)
        elif isinstance(layer, ParamWrapper):
            found.setdefault("LoRA on parameters (target_parameters)", name)
        elif isinstance(layer, LoraLayer):
            for adapter in active:
                if adapter in layer.lora_variant:
                    variant = type(layer.lora_variant[adapter]).__name__
                    found.setdefault(f"the LoRA variant {variant} (use_dora, ...)", name)
                if layer.lora_bias.get(adapter, False):
                    found.setdefault("lora_bias=True", name)
    return problems + [f"{problem}, first on {name!r}" for problem, name in found.items()]


def _is_peft_model(module: torch.nn.Module) -> bool:
    peft = sys.modules.get("peft")  # a PeftModel exists only where peft has been imported
    return peft is not None and isinstance(module, peft.PeftModel)


def _peft_base(module: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft model (the module itself otherwise)."""
    return module.get_base_model() if _is_peft_model(module) else module
