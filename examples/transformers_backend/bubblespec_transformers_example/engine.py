"""A bubblespec engine backend on Hugging Face transformers: any causal LM ``AutoModelForCausalLM`` loads.

A third-party plugin written from docs/plugins.md, in a package of its own: its ``pyproject.toml`` declares the
entry point ``transformers-example`` in the group ``bubblespec.backends``. No KV cache: every forward pass feeds
each active sequence from its first token (rows right-padded, with an attention mask), so it is slow on long
responses; what makes it a bubblespec engine is the same as in ``examples/minimal_backend.py``:

- keyed sampling (``bubblespec.verify.sequence.keyed_samples``, every sampling setting of the request): the token at
  response position ``i`` of key ``k`` is ``bubblespec.verify.sampling.keyed_sample`` of the
  logits there with the key's noise seed and ``i``, never an RNG draw, so neither the batch nor drafts change it;
- verification through :class:`bubblespec.verify.sequence.Sequence`: the last token and the draft tokens it proposes are
  scored in one pass, and ``Sequence.record`` takes the keyed samples at those positions (accepting draft tokens
  while they equal the samples) and keeps the stop tokens, length limit and stats;
- ``stop.is_set()`` before every forward pass, ``on_forward`` after each;
- ``update_weights`` by Hugging Face name (what the trainer sends), through ``load_state_dict``.

transformers computes the rotary tables and RMSNorm in float32 even for a float64 model, so its logits agree with
bubblespec's float64 decoder (the built-in ``torch`` engine) to about 1e-6; with keyed Gumbel noise the tokens are
the same except at such near-ties.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch
from pydantic import field_validator
from transformers import AutoConfig, AutoModelForCausalLM

from bubblespec.core.config import EngineSettings, engine_config
from bubblespec.core.errors import ModelLoadError
from bubblespec.core.interfaces import Engine, ForwardPass, GenerationRequest, GenerationResult, StopSignal
from bubblespec.verify import sequence as decoding

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


class TransformersEngineConfig(EngineSettings):
    """Every setting an engine receives, the dtype narrowed to those named here, and the model's device."""

    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    device: str = "cpu"
    """A torch device for the model: "cpu", "cuda" or "cuda:N" (``rollout.engine_options.device``)."""

    @field_validator("device")
    @classmethod
    def _is_a_device(cls, device: str) -> str:
        try:
            torch.device(device)
        except RuntimeError:
            raise ValueError(f"{device!r} is not a torch device; use cpu, cuda or cuda:N") from None
        return device


class TransformersEngine(Engine):
    config_class = TransformersEngineConfig

    def __init__(self, config: TransformersEngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=DTYPES[config.dtype])
        self.model = model.to(self.device).eval()
        eos = self.model.config.eos_token_id
        self.eos_token_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        self.context_length = self.model.config.max_position_embeddings
        self._proposal = decoding.ProposalSettings(
            config.max_draft_tokens_per_step, config.adaptive_draft_length, config.draft_alignment
        )
        self._policy_version = 0

    @classmethod
    def from_pretrained(cls, model_path: str, **settings) -> TransformersEngine:
        """The model folder and the run's settings, checked by config_class (a bad or unknown one is a ConfigError
        that names it)."""
        settings = {"model_path": str(model_path), **settings}
        return cls(engine_config("transformers-example", TransformersEngineConfig, settings))

    @classmethod
    def check_model(cls, model_path: str) -> None:
        """A folder transformers cannot read fails here, before any rank loads weights."""
        try:
            AutoConfig.from_pretrained(model_path)
        except (OSError, ValueError) as error:
            raise ModelLoadError(f"transformers cannot load {model_path}: {error}") from None

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @torch.no_grad()
    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """New weights by Hugging Face name (a subset is fine). With tied embeddings ``lm_head.weight`` and
        ``model.embed_tokens.weight`` are one tensor, so either name updates both."""
        known = self.model.state_dict().keys()
        unknown = [name for name in state_dict if name not in known]
        if unknown:
            raise ValueError(f"unknown weight names {unknown[:5]}; expected names like {next(iter(known))!r}")
        self.model.load_state_dict(dict(state_dict), strict=False)  # copies into the model's dtype and device
        self._policy_version = version

    # release(), resume() and close(): Engine's defaults; without a KV cache nothing is held between calls.

    @torch.inference_mode()
    def generate(
        self,
        requests: Sequence[GenerationRequest],
        stop: StopSignal | None = None,
        on_forward: Callable[[ForwardPass], None] | None = None,
    ) -> list[GenerationResult]:
        sequences = [
            decoding.Sequence.admit(i, r, self.vocab_size, self.context_length, self.eos_token_ids)
            for i, r in enumerate(requests)
        ]
        while any(s.finish is None for s in sequences):
            if stop is not None and stop.is_set():
                break  # unfinished sequences come back "preempted" with the tokens they have
            active = [s for s in sequences if s.finish is None][: self.config.max_batch_size]
            drafts = [s.propose(self._proposal) for s in active]
            rows = [[*s.request.prompt_token_ids, *s.tokens, *d] for s, d in zip(active, drafts, strict=True)]
            logits = self._logits_at_response_positions(rows, [len(d) for d in drafts])
            for sequence, draft, row_logits in zip(active, drafts, logits, strict=True):
                samples, logprobs = self._keyed_samples(sequence, draft, row_logits)
                sequence.record(draft, samples, logprobs, self._proposal)
            if on_forward is not None:
                fed = sum(len(row) for row in rows)
                sampled = sum(len(d) + 1 for d in drafts) * self.vocab_size
                pairs = sum(len(row) * (len(row) + 1) // 2 for row in rows)
                on_forward(ForwardPass(len(rows), fed, fed, pairs, sampled_logits=sampled))
        return [s.result() for s in sequences]

    def _keyed_samples(
        self, sequence: decoding.Sequence, draft: list[int], logits: torch.Tensor
    ) -> tuple[list[int], list[float]]:
        """The keyed samples (and their logprobs) at the response positions ``logits`` [W, V] predict."""
        # one_hot: each policy version samples its own noise stream of the key
        stream = (self._policy_version + 1) % 2**32 if self.config.verification == "one_hot" else 0
        samples, logprobs = decoding.keyed_samples(logits[None], [sequence], [draft], stream=stream)
        return samples[0], logprobs[0]

    def _logits_at_response_positions(self, rows: list[list[int]], num_draft: list[int]) -> list[torch.Tensor]:
        """Per row, the logits [num_draft + 1, V] that predict the next token and each draft position's token."""
        width = max(len(row) for row in rows)
        input_ids = torch.zeros(len(rows), width, dtype=torch.int64)
        attention_mask = torch.zeros(len(rows), width, dtype=torch.int64)
        for i, row in enumerate(rows):
            input_ids[i, : len(row)] = torch.tensor(row)
            attention_mask[i, : len(row)] = 1  # right padding: real tokens keep positions 0, 1, ...
        # Logits from the first column any row samples at: a row's last (num_draft + 1) tokens predict the new ones.
        first = min(len(row) - n - 1 for row, n in zip(rows, num_draft, strict=True))
        logits = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            use_cache=False,
            logits_to_keep=width - first,
        ).logits
        return [
            logits[i, len(row) - n - 1 - first : len(row) - first]
            for i, (row, n) in enumerate(zip(rows, num_draft, strict=True))
        ]
