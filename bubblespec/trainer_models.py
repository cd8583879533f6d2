"""The models a learner trains: the built-in decoder, or the user's model as transformers loads it (optionally with
LoRA adapters from peft). Both look alike to :class:`bubblespec.trainer.GRPOLearner`::

    forward(tokens_BT, positions_BT) -> logits_BTV     whole right-padded sequences from position 0
    trainable_parameters() -> list of leaf tensors     what the optimizer updates, in a fixed order
    state_dict() -> {Hugging Face name: tensor}        the weights engines receive (LoRA: merged into the base)
    load_weights(weights, strict)                      weights by Hugging Face name
    device

The engines keep their own model (the built-in decoder for the torch engine): whichever the trainer trains, weights
travel by Hugging Face name, so the engine must run the architecture (checked before a run starts).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from bubblespec.backends.torch_model import DecoderModel, check_weight_names, read_checkpoint
from bubblespec.config import LoraSettings, TrainerConfig
from bubblespec.errors import ModelLoadError


def load_trainer_model(model_path: str, dtype: torch.dtype, config: TrainerConfig):
    """The model ``config.model`` names, in ``dtype`` on ``config.device``."""
    if config.model == "builtin":
        model_config, weights = read_checkpoint(model_path)
        return DecoderModel(model_config, weights, dtype, config.device)
    return TransformersModel(model_path, dtype, config.device, config.gradient_checkpointing, config.lora)


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
        weights = {name: tensor.detach().clone() for name, tensor in self._base_state().items()}
        if self.lora is not None:
            for name, delta in self._lora_deltas().items():
                weights[name] = (weights[name].float() + delta.float()).to(weights[name].dtype)
        return weights

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
        model = self.module.get_base_model() if self.lora is not None else self.module
        state = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            if "lora_" in name:
                continue
            state[name.replace(".base_layer.", ".")] = tensor.data
        return state

    def _lora_deltas(self) -> dict[str, torch.Tensor]:
        """scale * B @ A for every adapted layer, by the Hugging Face name of the layer's weight."""
        from peft.tuners.lora import LoraLayer

        deltas = {}
        for name, module in self.module.get_base_model().named_modules():
            if isinstance(module, LoraLayer):
                adapter = module.active_adapters[0]
                deltas[f"{name}.weight"] = module.get_delta_weight(adapter).detach()
        return deltas
