"""What runs inside an SGLang 0.5.23 server for bubblespec (the client is ``bubblespec.backends.sglang_engine``).

**Keyed sampling in plain steps.** :class:`KeyedGumbelProcessor` is a custom logit processor
(``--enable-custom-logit-processor``): every row it sees becomes a two-point row, 0 at the keyed sample ``y`` and
``lp(y) - 1`` at ``(y + 1) % V`` (-inf elsewhere), ``lp(y)`` being the log-probability of ``y`` under
``softmax(mask(z / T))`` in float64. With SGLang's ``temperature: 0`` the argmax is ``y`` (the row survives a cast
to float32), and the top-2 output logprobs carry ``lp(y)`` back as their difference. It travels with each request
(:func:`processor_payload`: pickled by reference, or by value with dill).

**Drafts inside SGLang's speculative decoding** (docs/plugins.md, *Drafts inside an engine's own speculative
decoding*). An ``sglang.srt.plugins`` entry point calls :func:`register`, which registers the speculative algorithm
``BUBBLESPEC``. Its worker is SGLang's NGRAM worker (no draft model) with two changes:

- *Drafts come with the request.* ``_prepare_draft_tokens`` lays out each request's next draft chunk instead of an
  n-gram corpus lookup: the request's ``custom_params`` carry the processor's settings plus ``"draft"``, the
  draft's token ids, and the chunk is :func:`next_chunk` (the draft at the response's next positions, as
  ``decoding.Sequence`` proposes with position alignment). SGLang's verify width is fixed
  (``--speculative-num-draft-tokens`` N): a chunk is a chain in slots 1..c after the root (slot 0, the last
  committed token), the rest is padding (:func:`chain_layout`).
- *Every verify row is a keyed sample.* SGLang's verify (``eagle_utils.eagle_sample``) never calls a custom logit
  processor, so the target worker is wrapped: after the verify forward, every row of ``next_token_logits`` becomes
  the processor's two-point row at the keyed sample of its response position (:func:`keyed_tree_rows_`) and the
  padding's candidate ids become unmatchable. With every request greedy, SGLang's greedy tree walk then accepts a
  draft token iff it equals the keyed sample, emits the keyed sample at the first mismatch and the bonus after a
  fully accepted chunk: plain keyed decoding. ``compute_spec_logprobs`` reads the same rows, so the top-2 output
  logprobs carry each token's log-probability as in plain generation.

The client (``speculative: true``) sends one request per response and :func:`replay` s each reply through
``decoding.Sequence`` with the same chunk rule, which gives the per-request stats and checks the server's tokens.
:func:`chain_layout`, :func:`next_chunk`, :func:`keyed_tree_rows_` and :func:`replay` are pure and tested against
the fake server (``tests/sglang_fake_server.py``, which emulates SGLang's greedy tree walk); the worker class
(:func:`_worker_class`) touches SGLang's private classes and runs only on a real server (a GPU):
``scripts/sglang_real_test.sh``.

This module imports torch, the standard library and ``bubblespec.verify.sampling`` only (SGLang inside functions):
servers import it.
"""

from __future__ import annotations

import inspect
import json
import pickle
from collections.abc import Sequence as Seq
from typing import Any

import torch

from bubblespec.core.errors import ConfigError, EngineError
from bubblespec.verify import sampling
from bubblespec.verify.sampling import keyed_sample

ALGORITHM = "BUBBLESPEC"
"""The ``--speculative-algorithm`` name this module registers."""
DRAFT = "draft"
"""The ``custom_params`` key of a request's draft token ids."""
UNMATCHABLE = -1
"""A candidate id no argmax equals: padding slots can never be accepted."""


class KeyedGumbelProcessor:
    """SGLang ``CustomLogitProcessor`` (duck-typed, stateless): the keyed sample as a two-point logit row.

    logits: [R, V] float32; custom_param_list[r]: {"seed0", "seed1", "offset", "temperature", "top_k", "top_p",
    "__req__"}. Returns [R, V]: 0 at y, lp(y) - 1 at (y + 1) % V, -inf elsewhere.
    """

    def __call__(self, logits, custom_param_list=None):
        params = custom_param_list
        positions_R = torch.tensor([p["offset"] + len(p["__req__"].output_ids) for p in params], dtype=torch.int64)
        return self.rows(logits, params, positions_R)[0]

    @staticmethod
    def rows(logits, params, positions_R):
        """The two-point rows [R, V] (in the logits' dtype) of the keyed samples at response positions
        ``positions_R`` [R], and the samples [R] int64. params[r]: row r's settings (seed0, seed1, temperature,
        top_k, top_p)."""
        device = logits.device
        seeds_R2 = torch.tensor([[p["seed0"], p["seed1"]] for p in params], dtype=torch.int64, device=device)
        temperature_R = torch.tensor([p["temperature"] for p in params], dtype=torch.float64, device=device)
        top_k_R = torch.tensor([p["top_k"] for p in params], dtype=torch.int64, device=device)
        top_p_R = torch.tensor([p["top_p"] for p in params], dtype=torch.float64, device=device)
        tokens_R1, logprobs_R1 = keyed_sample(
            logits[:, None, :], seeds_R2, positions_R[:, None].to(device), temperature_R, top_k_R, top_p_R
        )
        rows = torch.arange(logits.shape[0], device=device)
        tokens_R = tokens_R1[:, 0]
        out = torch.full(logits.shape, float("-inf"), dtype=torch.float64, device=device)
        out[rows, (tokens_R + 1) % logits.shape[1]] = logprobs_R1[:, 0] - 1.0
        out[rows, tokens_R] = 0.0
        return out.to(logits.dtype), tokens_R


def processor_payload(mode: str) -> str:
    """The ``custom_logit_processor`` string: ``{"callable": hex(pickle of the class)}`` as SGLang's ``to_str``.

    "reference" pickles the class by name (stdlib pickle; SGLang's ``dill.loads`` reads it; the server imports
    bubblespec). "value" rebuilds the class and bubblespec.verify.sampling in a ``__main__`` namespace so dill pickles
    their bytecode.
    """
    if mode == "reference":
        return json.dumps({"callable": pickle.dumps(KeyedGumbelProcessor, protocol=4).hex()})
    try:
        import dill
    except ImportError:
        raise ConfigError(
            "processor: 'value' needs the dill package on the client (pip install dill), "
            "or use processor: 'reference' with bubblespec installed on the server"
        ) from None
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(inspect.getsource(sampling), "<bubblespec.verify.sampling>", "exec"), namespace)
    exec(compile(inspect.getsource(KeyedGumbelProcessor), "<KeyedGumbelProcessor>", "exec"), namespace)
    return json.dumps({"callable": dill.dumps(namespace["KeyedGumbelProcessor"]).hex()})


def next_chunk(draft: Seq[int], num_output: int, room: int, num_draft_slots: int) -> list[int]:
    """The draft tokens to verify next: the draft's tokens at the response's next positions, leaving room for the
    sample that always follows them (``decoding.Sequence.propose`` with position alignment)."""
    limit = min(num_draft_slots, room - 1)
    return list(draft[num_output : num_output + limit]) if limit > 0 else []


def chain_layout(
    chunks: Seq[Seq[int]], roots: Seq[int], width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's NGRAM tree layout for chains (``ngram_corpus/result.cpp::fillResult``): per request, slot 0 the root
    (last committed token), slots 1..c the chunk (slot j's parent is j - 1), the rest padding (token 0, parent the
    root). Returns tokens [B * W] int64, the ancestor-or-self mask [B * W * W] bool, each slot's depth [B * W] (the
    response position its row predicts is the response length + depth) and which slots are padding [B * W] bool."""
    batch = len(chunks)
    tokens_BW = torch.zeros(batch, width, dtype=torch.int64)
    mask_BWW = torch.zeros(batch, width, width, dtype=torch.bool)
    depth_BW = torch.ones(batch, width, dtype=torch.int64)  # padding hangs off the root: depth 1
    padding_BW = torch.ones(batch, width, dtype=torch.bool)
    for b, (chunk, root) in enumerate(zip(chunks, roots, strict=True)):
        if len(chunk) >= width:
            raise ValueError(f"a chunk of {len(chunk)} draft tokens does not fit {width} slots with the root")
        chain = len(chunk) + 1
        tokens_BW[b, :chain] = torch.tensor([root, *chunk])
        depth_BW[b, :chain] = torch.arange(chain)
        padding_BW[b, :chain] = False
        mask_BWW[b, :chain, :chain] = torch.tril(torch.ones(chain, chain, dtype=torch.bool))
        mask_BWW[b, chain:, 0] = True  # padding: the root, then itself
        mask_BWW[b, range(chain, width), range(chain, width)] = True
    return tokens_BW.reshape(-1), mask_BWW.reshape(-1), depth_BW.reshape(-1), padding_BW.reshape(-1)


def keyed_tree_rows_(
    logits_RV: torch.Tensor, settings: Seq[dict], num_outputs: Seq[int], depth_R: torch.Tensor
) -> torch.Tensor:
    """Makes every verify row the two-point row of its keyed sample, in place; returns the samples [R] int64.

    logits_RV: [B * W, V], request-major in slot order; settings[b]: request b's ``custom_params`` (seed0, seed1,
    offset, temperature, top_k, top_p); num_outputs[b]: its response tokens so far. Row (b, j) predicts response
    position ``offset + num_outputs[b] + depth[b, j]``.
    """
    width = logits_RV.shape[0] // len(settings)
    starts = torch.tensor([s["offset"] + n for s, n in zip(settings, num_outputs, strict=True)], dtype=torch.int64)
    positions_R = starts.repeat_interleave(width) + depth_R.to(torch.int64)
    rows = [settings[r // width] for r in range(logits_RV.shape[0])]
    two_point_RV, tokens_R = KeyedGumbelProcessor.rows(logits_RV, rows, positions_R)
    logits_RV.copy_(two_point_RV)
    return tokens_R


def replay(
    sequence, tokens: Seq[int], logprobs: Seq[float], settings, max_new_tokens: int, verify_count: int | None
) -> None:
    """Records a reply the server generated with :data:`ALGORITHM` on its ``decoding.Sequence``: the prefill's token,
    then each verify step as the server ran it (the chunk :func:`next_chunk` chose within the call's
    ``max_new_tokens``, verified against the tokens that came back). This gives the request's stats and checks the
    server: the steps must emit exactly ``tokens`` and number ``verify_count`` (SGLang's
    ``meta_info["spec_verify_ct"]``, absent when it ran none: plain decoding gives the same tokens, so the count is
    what tells a server without the algorithm). ``settings``: position alignment and a fixed proposal length, as
    the server proposes."""
    start, steps_before = len(sequence.tokens), sequence.stats.decode_steps
    if tokens:
        sequence.record((), (tokens[0],), (logprobs[0],), settings)
    while sequence.finish is None and len(sequence.tokens) - start < len(tokens):
        made = len(sequence.tokens) - start
        chunk = sequence.propose(settings)[: max(0, max_new_tokens - made - 1)]
        samples = list(tokens[made : made + len(chunk) + 1])
        if len(samples) <= len(chunk) and samples == chunk[: len(samples)]:
            # every token left matched the chunk: only a stop token among them ends a reply inside a verify step
            if not sequence.stop_ids.intersection(samples):
                raise EngineError(f"the server's reply ends inside a verify step, after {samples}, at no stop token")
        samples += [UNMATCHABLE] * (len(chunk) + 1 - len(samples))  # positions after the step's last token
        step_logprobs = [*logprobs[made : made + len(chunk) + 1], *[0.0] * len(chunk)]
        sequence.record(chunk, samples, step_logprobs, settings)
    if sequence.tokens[start:] != list(tokens):
        raise EngineError(
            f"replaying the server's verify steps gives {sequence.tokens[start:][:24]}... where it returned "
            f"{list(tokens)[:24]}...: the server does not run bubblespec's {ALGORITHM} algorithm (position-aligned "
            "drafts, keyed verify rows)"
        )
    verify_steps = max(0, sequence.stats.decode_steps - steps_before - 1)  # every step after the call's prefill
    if verify_steps and verify_count is None:  # plain decoding makes the same tokens: only the count tells
        raise EngineError(
            f"the server reported no speculative verify steps for a reply of {len(tokens)} tokens: start it with "
            f"--speculative-algorithm {ALGORITHM} and bubblespec installed (its sglang.srt.plugins entry point)"
        )
    if verify_steps and verify_count != verify_steps:
        raise EngineError(f"the server ran {verify_count} verify steps where the drafts need {verify_steps}")


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: registers :data:`ALGORITHM` (SGLang imports it in every server
    process; ``SGLANG_PLUGINS`` may filter plugins by name)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    @SpeculativeAlgorithm.register(ALGORITHM, supports_overlap=False)
    def _factory(server_args):
        return _worker_class()


def _worker_class() -> type:
    """SGLang's ``NGRAMWorker`` with drafts from the requests and keyed verify rows (SGLang 0.5.23's private
    classes; only a real server runs this)."""
    import numpy as np
    from sglang.srt.speculative.ngram_worker import NGRAMWorker

    class KeyedVerifyTarget:
        """The target worker, with every verify forward's rows keyed (other attributes pass through)."""

        def __init__(self, target, worker) -> None:
            self._target, self._worker = target, worker

        def __getattr__(self, name):
            return getattr(self._target, name)

        def forward_batch_generation(self, batch, *args, is_verify: bool = False, **kwargs):
            result = self._target.forward_batch_generation(batch, *args, is_verify=is_verify, **kwargs)
            if is_verify:
                depth_R, padding_R = self._worker.layout
                settings = [req.sampling_params.custom_params for req in batch.reqs]
                logits_RV = result.logits_output.next_token_logits
                keyed_tree_rows_(logits_RV, settings, [len(r.output_ids) for r in batch.reqs], depth_R)
                batch.spec_info.draft_token[padding_R.to(batch.spec_info.draft_token.device)] = UNMATCHABLE
            return result

    class BubblespecWorker(NGRAMWorker):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.target_worker = KeyedVerifyTarget(self.target_worker, self)
            self.layout = None

        def _prepare_draft_tokens(self, batch):
            chunks, roots = [], []
            for req in batch.reqs:
                params = req.sampling_params
                draft = (params.custom_params or {}).get(DRAFT) or []
                room = params.max_new_tokens - len(req.output_ids)
                chunks.append(next_chunk(draft, len(req.output_ids), room, self.draft_token_num - 1))
                roots.append(req.output_ids[-1] if req.output_ids else req.origin_input_ids[-1])
            tokens, mask, depth, padding = chain_layout(chunks, roots, self.draft_token_num)
            self.layout = (depth, padding)
            return tokens.numpy().astype(np.int64), mask.numpy()

        def _update_ngram_corpus(self, batch) -> None:
            """No n-gram corpus: drafts come with the requests."""

    return BubblespecWorker
