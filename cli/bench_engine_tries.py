"""``bubblespec bench engine``'s draft-tries measures: where responses left their drafts, and what branches win back.

Given pi_t (the drafting policy, a torch engine that reports margins) and pi_t+1's responses to the same keys:

- **Divergences.** pi_t teacher-forced along each pi_t+1 response, with the same keys: every position where pi_t's
  keyed sample given the response's own prefix differs from the response's token. pi_t verifies the response as a
  draft (its keyed samples and their runner-ups and margins at every accepted position); at the first position it
  samples otherwise, the response's token there is compared with pi_t's runner-up, and the walk goes on with the
  response's tokens up to and including that one given as a response prefix, so each divergence costs one more
  batched call. A divergence's *margin rank* is its place among the response's positions by pi_t's Gumbel-max margin
  (1: the smallest; positions past the response's end are not walked); margins above the engine's reporting limit
  (:data:`~bubblespec.verify.margins.REPORTED_MARGIN_LIMIT`) are not known, so a divergence there has no rank.
- **Decode steps with and without branches.** pi_t's drafts verified by pi_t+1 as single paths, then as tries with a
  branch at each draft's ``branches_per_draft`` smallest near-ties (one round, drafted by pi_t as the bubble does).

docs/design.md §13 says why the runner-up: keyed sampling gives both policies the same noise.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

from bubblespec.core.interfaces import Draft, GenerationRequest, GenerationResult
from bubblespec.rollout.step import drafts_from
from bubblespec.verify.tries import branch_from, branch_request, open_ties, with_branch


def divergences(older, requests: Sequence[GenerationRequest], newer: Sequence[GenerationResult]) -> list[dict]:
    """Per response: its tokens, pi_t's margin at every position where it reported one, and each divergence
    (position, the response's token, pi_t's sample, pi_t's runner-up, the margin; see the module)."""
    found = [{"tokens": len(r.token_ids), "margins": {}, "divergences": []} for r in newer]
    walking = list(range(len(requests)))
    given = [0] * len(requests)  # response tokens given as a prefix in the next call
    while walking:
        calls = []
        for i in walking:
            tokens = tuple(newer[i].token_ids)
            draft = Draft(requests[i].key, tokens, 0)
            # no position past the response's end is needed: pi_t stops there instead of decoding on to its limit
            sampling = dataclasses.replace(requests[i].sampling, max_new_tokens=len(tokens))
            calls.append(
                dataclasses.replace(
                    requests[i], sampling=sampling, draft=draft, response_prefix=tokens[: given[i]], margins=True
                )
            )
        results = older.generate(calls)
        still = []
        for i, result in zip(walking, results, strict=True):
            tokens = newer[i].token_ids
            for position in range(given[i], len(result.token_ids)):
                if result.runner_up_ids[position] >= 0:
                    found[i]["margins"][position] = result.margins[position]
                if result.token_ids[position] != tokens[position]:
                    found[i]["divergences"].append(
                        {
                            "position": position,
                            "token": tokens[position],
                            "older_sample": result.token_ids[position],
                            "older_runner_up": result.runner_up_ids[position],
                            "margin": result.margins[position],
                        }
                    )
                    if position + 1 < len(tokens):  # go on along the response after the divergence
                        given[i] = position + 1
                        still.append(i)
                    break
        walking = still
    for response in found:
        ordered = sorted(response["margins"].values())
        for divergence in response["divergences"]:
            margin = divergence["margin"]
            divergence["margin_rank"] = 1 + sum(m < margin for m in ordered) if margin != float("inf") else None
    return found


def divergence_summary(found: list[dict]) -> dict:
    """What :func:`divergences` found, as the bench reports it."""
    all_divergences = [d for r in found for d in r["divergences"]]
    ranks = [d["margin_rank"] for d in all_divergences]
    tokens = sum(r["tokens"] for r in found)
    medians = [statistics.median(r["margins"].values()) for r in found if r["margins"]]

    def share(count: int) -> float | None:
        return count / len(all_divergences) if all_divergences else None

    return {
        "responses": len(found),
        "responses_that_left_their_draft": sum(bool(r["divergences"]) for r in found),
        "divergences": len(all_divergences),
        "divergences_per_token": len(all_divergences) / tokens if tokens else 0.0,
        "took_the_runner_up": share(sum(d["token"] == d["older_runner_up"] for d in all_divergences)),
        "margin_rank_1": share(sum(r == 1 for r in ranks)),
        "margin_rank_at_most_4": share(sum(r is not None and r <= 4 for r in ranks)),
        "margin_rank_at_most_10": share(sum(r is not None and r <= 10 for r in ranks)),
        "margin_not_reported": share(sum(r is None for r in ranks)),
        "largest_divergence_margin": max((d["margin"] for d in all_divergences), default=None),
        "median_reported_margin_per_response": statistics.median(medians) if medians else None,
    }


def decode_steps_with_branches(older, newer, requests: Sequence[GenerationRequest], branches_per_draft: int) -> dict:
    """pi_t's drafts of ``requests`` (with near-ties), verified by pi_t+1 as single paths and as tries with a branch
    at each draft's ``branches_per_draft`` smallest near-ties; the outputs must be the same."""
    asked = [dataclasses.replace(r, draft=None, margins=True) for r in requests]
    drafted = older.generate(asked)
    drafts = {draft.key: draft for draft in drafts_from(drafted, 0)}
    by_key = {r.key: r for r in asked}
    opened = [
        (key, tie)
        for key, draft in drafts.items()
        for tie in sorted(open_ties(draft), key=lambda t: t.tie.margin)[:branches_per_draft]
    ]
    tries = dict(drafts)
    for (key, tie), result in zip(opened, older.generate([branch_request(by_key[k], t) for k, t in opened]),
                                  strict=True):  # fmt: skip
        tries[key] = with_branch(tries[key], tie.route, branch_from(result, tie.tie.index))
    single = newer.generate([dataclasses.replace(r, draft=drafts[r.key], margins=False) for r in requests])
    branched = newer.generate([dataclasses.replace(r, draft=tries[r.key], margins=False) for r in requests])
    return {
        "branches_per_draft": branches_per_draft,
        "branches_drafted": len(opened),
        "branch_tokens": sum(t.num_tokens for t in tries.values()) - sum(len(d.token_ids) for d in drafts.values()),
        "decode_steps_single": sum(r.stats.decode_steps for r in single),
        "decode_steps_with_branches": sum(r.stats.decode_steps for r in branched),
        "slowest_response_decode_steps_single": max(r.stats.decode_steps for r in single),
        "slowest_response_decode_steps_with_branches": max(r.stats.decode_steps for r in branched),
        "branches_followed": sum(r.stats.branches_followed for r in branched),
        "identical": [r.token_ids for r in single] == [r.token_ids for r in branched],
    }
