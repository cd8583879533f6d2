"""A minimal engine backend: the whole GenerationEngine contract in one short file, for plugin authors to read.

No KV cache (every forward pass recomputes each active sequence from its first token), no memory management,
CPU only: slow, but every rule of the contract is in plain sight, and it passes the conformance suite
(``tests/test_conformance.py`` runs it). A real backend keeps the same four rules:

1. Keyed sampling: the token at response position ``i`` of key ``k`` comes from ``bubblespec.sampling`` with the
   key's noise seed and the position ``i`` (never from an RNG), so it does not depend on the batch.
2. Verification: feed the last token plus up to N draft tokens in one pass, sample at every position, accept
   draft tokens while they equal the samples, then emit the first differing sample (or a bonus token).
3. ``stop.is_set()`` is checked before every forward pass; unfinished requests come back ``"preempted"`` with
   the tokens they have.
4. ``update_weights`` takes Hugging Face weight names and records the policy version.

To ship it as a plugin, declare the class under the ``bubblespec.backends`` entry point group of your package::

    [project.entry-points."bubblespec.backends"]
    minimal = "my_package.minimal_backend:MinimalEngine"

and select it with ``rollout.backend: minimal``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from bubblespec import sampling
from bubblespec.backends.torch_model import DTYPES, DecoderModel, read_checkpoint
from bubblespec.drafts import validate_draft
from bubblespec.errors import RequestError
from bubblespec.interfaces import ForwardPass, GenerationRequest, GenerationResult, RequestStats, StopSignal


class MinimalEngine:
    def __init__(self, model_path: str, dtype: str = "float32", max_draft_tokens_per_step: int = 8) -> None:
        self.model_config, weights = read_checkpoint(model_path)
        self.model = DecoderModel(self.model_config, weights, DTYPES[dtype], "cpu")
        self.max_draft_tokens_per_step = max_draft_tokens_per_step
        self._policy_version = 0

    @classmethod
    def from_pretrained(cls, model_path: str, **settings) -> MinimalEngine:
        """The constructor every backend offers: a model folder and the engine's own settings."""
        return cls(str(model_path), **settings)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.model.load_weights(state_dict)
        self._policy_version = version

    def release(self) -> None:  # nothing held between calls
        pass

    def resume(self) -> None:
        pass

    def close(self) -> None:
        pass

    @torch.inference_mode()
    def generate(
        self,
        requests: Sequence[GenerationRequest],
        stop: StopSignal | None = None,
        on_forward: Callable[[ForwardPass], None] | None = None,
    ) -> list[GenerationResult]:
        for request in requests:  # refuse bad input before any work
            if not request.prompt_token_ids or max(request.prompt_token_ids) >= self.vocab_size:
                raise RequestError(f"{request.key}: the prompt is empty or has ids outside [0, {self.vocab_size})")
            if request.draft is not None:
                validate_draft(request.draft, self.vocab_size)
        tokens: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[float]] = [[] for _ in requests]
        stats = [RequestStats() for _ in requests]
        finish: list[str | None] = [None] * len(requests)
        while None in finish:
            if stop is not None and stop.is_set():
                break
            active = [i for i, reason in enumerate(finish) if reason is None]
            drafts = [self._draft_chunk(requests[i], tokens[i]) for i in active]
            rows = [
                list(requests[i].prompt_token_ids) + tokens[i] + draft for i, draft in zip(active, drafts, strict=True)
            ]
            logits = self._logits_at_response_positions(rows, [len(d) for d in drafts])
            for row, (i, draft) in enumerate(zip(active, drafts, strict=True)):
                request, width = requests[i], len(draft) + 1
                params = request.sampling
                sampled, sampled_logprobs = sampling.keyed_sample(
                    logits[row][None, :width],
                    torch.tensor([request.key.noise_seed()]),
                    torch.arange(len(tokens[i]), len(tokens[i]) + width)[None],
                    torch.tensor([params.temperature], dtype=torch.float64),
                    torch.tensor([params.top_k]),
                    torch.tensor([params.top_p], dtype=torch.float64),
                )
                accepted = int(sampling.count_accepted(sampled, torch.tensor([draft]), torch.tensor([len(draft)])))
                emitted = sampled[0, : accepted + 1].tolist()
                finish[i], emitted = self._finish(request, tokens[i], emitted)
                accepted = min(accepted, len(emitted))  # tokens after a stop token are not emitted
                tokens[i] += emitted
                logprobs[i] += sampled_logprobs[0, : len(emitted)].tolist()
                stats[i].decode_steps += 1
                if draft:
                    stats[i].verify_steps += 1
                    stats[i].draft_tokens_proposed += len(draft)
                    stats[i].draft_tokens_accepted += accepted
                    stats[i].acceptance_lengths[accepted + 1] = stats[i].acceptance_lengths.get(accepted + 1, 0) + 1
            if on_forward is not None:
                fed = sum(len(row) for row in rows)
                on_forward(ForwardPass(len(rows), fed, fed, sum(len(row) * (len(row) + 1) // 2 for row in rows)))
        return [
            GenerationResult(r.key, tokens[i], logprobs[i], finish[i] or "preempted", stats[i])
            for i, r in enumerate(requests)
        ]

    def _draft_chunk(self, request: GenerationRequest, tokens: list[int]) -> list[int]:
        """The draft tokens proposed for the next positions (positional alignment: draft[i] for position i)."""
        if request.draft is None:
            return []
        room = request.sampling.max_new_tokens - len(tokens) - 1  # one sampled token always follows
        start = len(tokens)
        return list(request.draft.token_ids[start : start + min(self.max_draft_tokens_per_step, room)])

    def _logits_at_response_positions(self, rows: list[list[int]], num_draft: list[int]) -> list[torch.Tensor]:
        """Per row, the logits [num_draft + 1, V] that predict the next token and each draft position's token."""
        width = max(len(row) for row in rows)
        batch = torch.zeros(len(rows), width, dtype=torch.int64)
        for i, row in enumerate(rows):
            batch[i, : len(row)] = torch.tensor(row)
        positions = torch.arange(width).expand(len(rows), width)
        logits = self.model.forward(batch, positions)  # no cache: causal attention over each whole row
        # logits at index j predict token j + 1; the last (num_draft + 1) fed tokens predict the new ones
        return [logits[i, len(row) - n - 1 : len(row)] for i, (row, n) in enumerate(zip(rows, num_draft, strict=True))]

    def _finish(self, request: GenerationRequest, tokens: list[int], emitted: list[int]) -> tuple[str | None, list]:
        params = request.sampling
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.model_config.eos_token_ids))
        for j, token in enumerate(emitted):
            if token in stop_ids:
                return "stop", emitted[: j + 1]
        limit = min(params.max_new_tokens, self.model_config.max_position_embeddings - len(request.prompt_token_ids))
        if len(tokens) + len(emitted) >= limit:
            return "length", emitted[: limit - len(tokens)]
        return None, emitted
