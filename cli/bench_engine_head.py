"""``bubblespec bench engine``'s draft-head measures: a head learned from one step's samples, drafting for the next
policy.

Given pi_t (the drafting policy, a torch engine), pi_t+1 (the verifying policy, a torch engine) and the samples of
pi_t that the policy step trained on:

- **Training, online from what the rollout computed.** pi_t's last hidden states along each sample's prompt +
  response (one forward pass without gradients, as a training pass computes them: :func:`head_batch`) and its sampled
  tokens; a :class:`~bubblespec.models.draft_head.DraftHead` from nothing (its ``seed`` initialisation) learns from them
  for ``steps`` AdamW steps of :data:`ROWS_PER_STEP` responses each (the responses in turn; :func:`train_head`).
- **Decoding the next step's requests with pi_t+1**, four arms on the same requests (:func:`decode_steps_with_head`):
  ``plain`` (no drafts), ``drafts`` (pi_t's responses to the same keys, the bubble drafts), ``head`` (the trained head
  alone: no request drafts) and ``drafts_and_head`` (the head proposes where a draft has nothing left to propose).
  Keyed sampling makes the outputs of all four the same (``identical``; in float32 without batch invariance a
  verify pass may round a near-tie otherwise: ``differing_responses`` counts the responses that differ from
  ``plain``'s).

**Head acceptance length** (``head_acceptance_length``): in the ``head`` arm every draft token is the head's (the
requests carry no drafts and the engine's draft chain is the request draft alone, so ``draft_tokens_proposed ==
head_tokens_proposed``), hence every verify step is a pass in which the head proposed; it is the mean tokens emitted
per such pass, ``(head tokens accepted + verify steps) / verify steps`` (docs/design.md §2's acceptance length of
the head's passes; 1.0 where nothing it drafted was accepted). A response's first pass has no hidden states yet and
decodes one token without the head. ``head_share_of_accepted_draft_tokens``: in ``drafts_and_head``, the head's
accepted tokens over all accepted draft tokens.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from bubblespec.cli.bench_engine_requests import with_drafts
from bubblespec.core.interfaces import GenerationRequest, GenerationResult, acceptance_length
from bubblespec.models.draft_head import (
    DEFAULT_WINDOW,
    HIDDEN_ROWS_PER_PASS,
    DraftHead,
    DraftHeadTrainer,
    HeadBatch,
    HeadLearning,
    hidden_pairs,
)

TRAINING_STEPS = HeadLearning.steps
"""Default AdamW steps of the head (``--head-steps``), as a run's online learning takes per rollout
(:class:`~bubblespec.models.draft_head.HeadLearning`): 8 passes over 32 responses of :data:`ROWS_PER_STEP`."""
ROWS_PER_STEP = HeadLearning.rows_per_step
"""Responses per training step."""
LEARNING_RATE = HeadLearning.learning_rate
"""The head's AdamW learning rate."""
ARMS = ("plain", "drafts", "head", "drafts_and_head")


def head_batch(model, requests: Sequence[GenerationRequest], results: Sequence[GenerationResult]) -> HeadBatch:
    """The responses' (hidden state, token) pairs (:func:`~bubblespec.models.draft_head.hidden_pairs`, one forward
    pass per :data:`HIDDEN_ROWS_PER_PASS` responses); responses of no tokens are left out."""
    pairs = zip(requests, results, strict=True)
    samples = [(r.prompt_token_ids, x.token_ids, r.sampling.temperature) for r, x in pairs]
    return hidden_pairs(model, samples, HIDDEN_ROWS_PER_PASS)


def train_head(
    model, batch: HeadBatch, steps: int, seed: int = 0, window: int = DEFAULT_WINDOW
) -> tuple[dict[str, torch.Tensor], dict]:
    """A head over ``model`` from ``seed``'s initialisation, trained ``steps`` AdamW steps on ``batch``'s responses,
    :data:`ROWS_PER_STEP` a step in turn; returns its state and what the training took (``steps`` 0: the untrained
    head)."""
    head = DraftHead(model, seed=seed, window=window)
    trainer = DraftHeadTrainer(head, learning_rate=LEARNING_RATE)
    num_rows = len(batch.lengths_B)
    clock = time.perf_counter()
    losses, _ = trainer.train(batch, steps, ROWS_PER_STEP)
    summary = {
        "responses": num_rows,
        "pairs": int(batch.lengths_B.sum()),
        "steps": steps,
        "responses_per_step": min(ROWS_PER_STEP, num_rows),
        "learning_rate": LEARNING_RATE,
        "window": head.window,
        "init": f"seed {seed}, no warm start",
        "seconds": time.perf_counter() - clock,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
    }
    return head.state_dict(), summary


def decode_steps_with_head(
    newer,
    requests: Sequence[GenerationRequest],
    drafts: Sequence[GenerationRequest],
    state: dict[str, torch.Tensor],
    window: int = DEFAULT_WINDOW,
) -> dict:
    """pi_t+1 (``newer``, a torch engine without a head) decoding ``requests`` in the four arms of the module:
    ``requests`` without drafts, ``drafts`` the same requests with pi_t's drafts attached; ``state`` the trained
    head's. The engine holds no head afterwards."""
    undrafted = [dataclasses.replace(r, draft=None) for r in requests]
    newer.set_draft_head(None)
    results = {"plain": newer.generate(undrafted), "drafts": newer.generate(drafts)}
    newer.set_draft_head(state, window=window)
    try:
        results["head"] = newer.generate(undrafted)
        results["drafts_and_head"] = newer.generate(drafts)
    finally:
        newer.set_draft_head(None)
    arms = {name: _arm(results[name]) for name in ARMS}
    plain = [r.token_ids for r in results["plain"]]
    differing = {
        sum(a != b for a, b in zip(plain, (r.token_ids for r in results[name]), strict=True)) for name in ARMS[1:]
    }
    head, both = arms["head"], arms["drafts_and_head"]
    return {
        "requests": len(requests),
        "arms": arms,
        "identical": differing == {0},
        "differing_responses": max(differing),
        "head_acceptance_length": acceptance_length(head["head_tokens_accepted"], head["verify_steps"]),
        "head_share_of_accepted_draft_tokens": both["head_tokens_accepted"] / max(both["draft_tokens_accepted"], 1),
    }


def _arm(results: Sequence[GenerationResult]) -> dict:
    """One arm's counts, summed over its responses."""
    stats = [r.stats for r in results]
    counts = {
        "tokens": sum(len(r.token_ids) for r in results),
        "decode_steps": sum(s.decode_steps for s in stats),
        "slowest_response_decode_steps": max((s.decode_steps for s in stats), default=0),
        "verify_steps": sum(s.verify_steps for s in stats),
        "draft_tokens_proposed": sum(s.draft_tokens_proposed for s in stats),
        "draft_tokens_accepted": sum(s.draft_tokens_accepted for s in stats),
        "head_tokens_proposed": sum(s.head_tokens_proposed for s in stats),
        "head_tokens_accepted": sum(s.head_tokens_accepted for s in stats),
    }
    counts["head_tokens_accepted_per_proposed"] = counts["head_tokens_accepted"] / max(
        counts["head_tokens_proposed"], 1
    )
    return counts


def measure(
    older,
    newer,
    training: Sequence[GenerationRequest],
    requests: Sequence[GenerationRequest],
    steps: int,
    window: int = DEFAULT_WINDOW,
) -> dict:
    """The whole measure: pi_t (``older``) samples ``training`` (the keys the policy step trained on: keyed sampling
    gives again the samples it trained on), a head learns from them for ``steps`` steps, pi_t drafts ``requests``
    and pi_t+1 (``newer``) decodes them in the four arms."""
    clock = time.perf_counter()
    batch = head_batch(older.model, training, older.generate(training))
    hidden_seconds = time.perf_counter() - clock
    state, summary = train_head(older.model, batch, steps, window=window)
    summary["samples_and_hidden_states_seconds"] = hidden_seconds
    drafted = with_drafts(list(requests), older.generate(requests))
    return {"training": summary, **decode_steps_with_head(newer, requests, drafted, state, window)}


def measure_config_step(settings, run, new_state: dict, requests: Sequence[GenerationRequest]) -> dict:
    """:func:`measure` on the torch engine for ``bubblespec bench engine --config``: pi_t from the checkpoint, pi_t+1
    holding ``new_state``, the head trained on pi_t's samples of the keys of the GRPO step (the task's step 0,
    ``samples_per_prompt`` each, as :func:`~bubblespec.cli.bench_engine_requests.grpo_step` asks them)."""
    from bubblespec.cli.bench_engine_measures import make_engine
    from bubblespec.rollout.step import step_requests

    config = run.config
    training = step_requests(run.task.batch(0), config.seed, 0, config.task.samples_per_prompt, run.sampling)
    older = make_engine("torch", settings.model_path, settings.dtype, settings)  # pi_t
    newer = make_engine("torch", settings.model_path, settings.dtype, settings)
    newer.update_weights(new_state, version=1)  # pi_t+1
    try:
        return measure(older, newer, training, requests, settings.head_training_steps)
    finally:
        older.close()
        newer.close()


def head_tables(found: dict) -> tuple:
    """The four arms side by side, then the head's acceptance and training (each fits 80 columns)."""
    from bubblespec.cli.bench_tables import figure, table

    arms, training = found["arms"], found["training"]
    title = f"pi_t+1 decoding with a draft head learned from pi_t's samples ({found['requests']} requests)"
    shown = table(title, ("measure", "plain", "drafts", "head", "drafts+head"), first="left")
    for name in ("decode_steps", "slowest_response_decode_steps", "verify_steps", "draft_tokens_proposed",
                 "draft_tokens_accepted", "head_tokens_proposed", "head_tokens_accepted"):  # fmt: skip
        shown.add_row(name, *(str(arms[arm][name]) for arm in ARMS))
    summary = table("The draft head (torch engine)", ("measure", "value"), first="left")
    for name, value in (
        ("outputs identical in all four", found["identical"]),
        ("head acceptance length (head alone)", found["head_acceptance_length"]),
        ("head share of accepted draft tokens", found["head_share_of_accepted_draft_tokens"]),
        ("training steps (from nothing)", training["steps"]),
        ("training responses / pairs", f"{training['responses']} / {training['pairs']}"),
        ("training seconds", training["seconds"]),
        ("loss first -> final", f"{figure(training['first_loss'])} -> {figure(training['final_loss'])}"),
    ):
        summary.add_row(name, figure(value))
    return shown, summary
