"""The in-process draft store and the policies (the Ray store runs in tests/test_ray.py)."""

from __future__ import annotations

import pytest

from bubblespec.core.errors import DraftError
from bubblespec.core.interfaces import Draft, GenerationRequest, RolloutKey
from bubblespec.policies.bubble import CoverageFirst, LongestFirst
from bubblespec.policies.sharding import LengthBalanced, RoundRobin
from bubblespec.rollout.draft_store import InMemoryDraftStore


def _draft(step: int, uid: str, sample: int = 0, length: int = 3) -> Draft:
    return Draft(RolloutKey(0, step, uid, sample), tuple(range(3, 3 + length)), policy_version=step - 1)


def test_store_puts_gets_and_drops_by_key_and_step():
    store = InMemoryDraftStore(vocab_size=100)
    store.put([_draft(1, "a"), _draft(1, "b"), _draft(2, "a")])
    key = RolloutKey(0, 1, "a", 0)
    assert store.get([key, RolloutKey(0, 1, "zzz", 0)]) == {key: _draft(1, "a")}
    store.drop([key])
    assert len(store) == 2
    store.drop_steps_before(2)
    assert [d.key.step for d in store.get([RolloutKey(0, 2, "a", 0)]).values()] == [2] and len(store) == 1


def test_store_caps_its_size_and_evicts_the_farthest_step_newest_first():
    store = InMemoryDraftStore(vocab_size=100, max_tokens=10)
    store.put([_draft(2, "far", length=4), _draft(1, "near", length=4)])
    store.put([_draft(1, "nearer", length=4)])  # over the cap: step 2's draft goes, step 1's stay
    assert store.num_tokens == 8 and store.num_evicted == 1
    assert set(store.get([RolloutKey(0, 1, "near", 0), RolloutKey(0, 1, "nearer", 0)])) == {
        RolloutKey(0, 1, "near", 0),
        RolloutKey(0, 1, "nearer", 0),
    }
    store.put([_draft(1, "last", length=4)])  # one step left: its newest draft goes first
    assert not store.get([RolloutKey(0, 1, "last", 0)]) and store.num_evicted == 2
    store.put([_draft(1, "huge", length=11)])  # larger than the cap on its own: refused by eviction, not kept
    assert store.num_tokens <= 10


def test_store_refuses_malformed_drafts_and_keeps_nothing_of_them():
    store = InMemoryDraftStore(vocab_size=10)
    bad = Draft(RolloutKey(0, 1, "a", 0), (1, 2, 10), policy_version=0)
    with pytest.raises(DraftError, match=r"token 10 at position 2; token ids must be integers in \[0, 10\)"):
        store.put([_draft(1, "fine", length=2), bad])
    assert len(store) == 0
    with pytest.raises(ValueError, match="max_tokens"):
        InMemoryDraftStore(vocab_size=10, max_tokens=0)


def test_bubble_policies_order_keys():
    keys = [RolloutKey(0, 1, p, s) for p in ("a", "b", "c") for s in range(2)]
    coverage = CoverageFirst().order(keys, {})
    assert [k.sample_index for k in coverage] == [0, 0, 0, 1, 1, 1]
    lengths = {keys[0]: 5, keys[2]: 50, keys[4]: 20}
    longest = LongestFirst().order(keys, lengths)
    assert longest[:3] == [keys[2], keys[4], keys[0]]


def test_sharding_policies_split_every_request_once():
    requests = [GenerationRequest((1,), RolloutKey(0, 1, str(i), 0)) for i in range(10)]
    lengths = {r.key: (100 if i == 0 else 10) for i, r in enumerate(requests)}
    for policy in (RoundRobin(), LengthBalanced()):
        shards = policy.shard(requests, 3, lengths)
        assert sorted(r.key for shard in shards for r in shard) == sorted(r.key for r in requests)
    balanced = LengthBalanced().shard(requests, 3, lengths)
    assert [len(s) for s in balanced if requests[0] in s] == [1]  # the long one gets a rank to itself
