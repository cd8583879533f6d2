"""A minimal engine backend: the whole GenerationEngine contract in one short file, for plugin authors to read.

No KV cache (every forward pass recomputes each active sequence from its first token), no memory management,
CPU only: slow, but every rule of the contract is in plain sight, and it passes the conformance suite
(``tests/test_example_plugins.py`` runs it through its entry point). A real backend keeps the same four rules:

1. Keyed sampling: the token at response position ``i`` of key ``k`` comes from ``bubblespec.verify.sampling`` with the
   key's noise seed and the position ``i`` (never from an RNG), so it does not depend on the batch;
   ``bubblespec.verify.sequence.keyed_samples`` does it for the rows of a pass, with every sampling setting of the
   request (temperature, top-k, top-p, min-p, the repetition penalty over the tokens before each position).
2. Verification: feed the last token plus the draft tokens :class:`bubblespec.verify.sequence.Sequence` proposes in one
   pass, sample at every position, and hand the samples back to ``Sequence.record``: the shared bookkeeping
   accepts draft tokens while they equal the samples, emits the first differing sample (or a bonus token), and
   keeps alignment, stop tokens, the length limit and the stats. (An engine that returns only top-K logprobs
   decides its samples with ``bubblespec.verify.verification.decide_keyed_samples``; see the vLLM backend.)
3. ``stop.is_set()`` is checked before every forward pass; unfinished requests come back ``"preempted"`` with
   the tokens they have.
4. ``update_weights`` takes Hugging Face weight names and records the policy version.

Its settings are the run's (``from_pretrained`` gets every field of :class:`bubblespec.core.config.EngineSettings`:
dtype, max_batch_size, max_draft_tokens_per_step, ...). ``config_class`` declares them, so a run checks them before
anything starts, and narrows the ones this engine cannot follow: ``verification: one_hot`` is refused by name.

To ship it as a plugin, declare the class under the ``bubblespec.backends`` entry point group of your package::

    [project.entry-points."bubblespec.backends"]
    minimal = "my_package.minimal_backend:MinimalEngine"

and select it with ``rollout.backend: minimal``.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch

from bubblespec.core.config import EngineSettings, engine_config
from bubblespec.core.interfaces import Engine, ForwardPass, GenerationRequest, GenerationResult, StopSignal
from bubblespec.models.decoder import DTYPES, DecoderModel, read_checkpoint
from bubblespec.verify import sequence as decoding


class MinimalConfig(EngineSettings):
    """Every setting an engine receives (model_path, max_batch_size, num_threads, ...), two of them narrowed."""

    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    verification: Literal["coupled"] = "coupled"
    """Keyed sampling with the key's own noise; the "one_hot" ablation (a noise stream per policy version, see
    backends/torch_engine.py) is not implemented here, so a run that asks for it fails before it starts."""


class MinimalEngine(Engine):
    config_class = MinimalConfig

    def __init__(self, config: MinimalConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.model_config, weights = read_checkpoint(config.model_path)
        self.model = DecoderModel(self.model_config, weights, DTYPES[config.dtype], "cpu")
        # The shared bookkeeping's settings: draft tokens per pass, adaptive length, alignment after a mismatch.
        self._proposal = decoding.ProposalSettings(
            config.max_draft_tokens_per_step, config.adaptive_draft_length, config.draft_alignment
        )
        self._policy_version = 0

    @classmethod
    def from_pretrained(cls, model_path: str, **settings) -> "MinimalEngine":
        """The constructor every backend offers: a model folder and the run's settings, checked by config_class (a
        bad or unknown one is a ConfigError that names it)."""
        return cls(engine_config("minimal", MinimalConfig, {"model_path": str(model_path), **settings}))

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def context_length(self) -> int:
        """Prompt + response tokens a sequence may hold (a schedule that cuts responses asks)."""
        return self.model_config.max_position_embeddings

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.model.load_weights(state_dict)
        self._policy_version = version

    # release(), resume() and close(): Engine's defaults (no-ops); this engine holds no memory between calls.

    @torch.inference_mode()
    def generate(
        self,
        requests: Sequence[GenerationRequest],
        stop: StopSignal | None = None,
        on_forward: Callable[[ForwardPass], None] | None = None,
    ) -> list[GenerationResult]:
        context, eos = self.context_length, self.model_config.eos_token_ids
        # admit() refuses a bad request (empty prompt, ids outside the vocabulary, malformed draft) before any work
        sequences = [decoding.Sequence.admit(i, r, self.vocab_size, context, eos) for i, r in enumerate(requests)]
        while any(s.finish is None for s in sequences):
            if stop is not None and stop.is_set():
                break
            # at most max_batch_size sequences a pass, first come first served; the others wait for a free slot
            active = [s for s in sequences if s.finish is None][: self.config.max_batch_size]
            drafts = [s.propose(self._proposal) for s in active]
            rows = [[*s.request.prompt_token_ids, *s.tokens, *d] for s, d in zip(active, drafts, strict=True)]
            logits = self._logits_at_response_positions(rows, [len(d) for d in drafts])
            for sequence, draft, row_logits in zip(active, drafts, logits, strict=True):
                # the keyed samples at the positions this pass scored, with the request's sampling settings
                samples, logprobs = decoding.keyed_samples(row_logits[None], [sequence], [draft])
                sequence.record(draft, samples[0], logprobs[0], self._proposal)
            if on_forward is not None:
                fed = sum(len(row) for row in rows)
                sampled = sum(len(d) + 1 for d in drafts) * self.vocab_size
                pairs = sum(len(row) * (len(row) + 1) // 2 for row in rows)
                on_forward(ForwardPass(len(rows), fed, fed, pairs, sampled_logits=sampled))
        return [s.result() for s in sequences]

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
