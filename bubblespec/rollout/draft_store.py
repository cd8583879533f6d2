"""Draft stores: drafts by rollout key, with the policy version that produced them.

``memory`` keeps them in the controller's process; ``ray`` keeps them in a Ray actor so that ranks on other
nodes can put and get drafts directly. Both refuse malformed drafts, cap their size and drop a step's drafts once
it has been used. Past the cap the drafts of the farthest step go first, the newest of them first: the next step's
drafts are the ones about to pay off, and within a step the plan drafts the most useful keys first.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

from bubblespec.core.errors import BubblespecError
from bubblespec.core.interfaces import Draft, DraftStoreBase, RolloutKey
from bubblespec.verify.drafts import validate_draft

logger = logging.getLogger(__name__)


class InMemoryDraftStore(DraftStoreBase):
    """A dict of drafts in this process, capped at ``max_tokens`` draft tokens in all."""

    def __init__(self, vocab_size: int, max_tokens: int = 50_000_000) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens
        self._drafts: OrderedDict[RolloutKey, Draft] = OrderedDict()
        self._num_tokens = 0
        self.num_evicted = 0

    def put(self, drafts: Sequence[Draft]) -> None:
        for draft in drafts:
            validate_draft(draft, self.vocab_size)
        for draft in drafts:
            self._remove(draft.key)
            self._drafts[draft.key] = draft
            self._num_tokens += draft.num_tokens
        while self._num_tokens > self.max_tokens:
            farthest = max(key.step for key in self._drafts)
            for key in [key for key in reversed(self._drafts) if key.step == farthest]:
                self._remove(key)
                self.num_evicted += 1
                if self._num_tokens <= self.max_tokens:
                    break

    def get(self, keys: Sequence[RolloutKey]) -> dict[RolloutKey, Draft]:
        return {key: self._drafts[key] for key in keys if key in self._drafts}

    def drop(self, keys: Sequence[RolloutKey]) -> None:
        for key in keys:
            self._remove(key)

    def drop_steps_before(self, step: int) -> None:
        self.drop([key for key in self._drafts if key.step < step])

    def __len__(self) -> int:
        return len(self._drafts)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def stats(self) -> dict[str, int]:
        """Drafts and draft tokens held now, and drafts evicted by the cap so far."""
        return {"drafts": len(self._drafts), "tokens": self._num_tokens, "evicted": self.num_evicted}

    def _remove(self, key: RolloutKey) -> None:
        draft = self._drafts.pop(key, None)
        if draft is not None:
            self._num_tokens -= draft.num_tokens


class RayDraftStore(DraftStoreBase):
    """The same store inside a Ray actor; this object is a thin, picklable client that any node can use."""

    def __init__(self, vocab_size: int, max_tokens: int = 50_000_000, label_selector: dict | None = None) -> None:
        """``label_selector``: the nodes the actor may run on (a Ray label selector); empty: Ray's choice."""
        import ray

        actor_class = ray.remote(num_cpus=0)(InMemoryDraftStore)
        self._actor = actor_class.options(label_selector=dict(label_selector or {})).remote(vocab_size, max_tokens)
        self.vocab_size = vocab_size

    def put(self, drafts: Sequence[Draft]) -> None:
        # Validate here too, so the caller gets the error, not the actor's log.
        for draft in drafts:
            validate_draft(draft, self.vocab_size)
        self._call("put", list(drafts))

    def get(self, keys: Sequence[RolloutKey]) -> dict[RolloutKey, Draft]:
        return self._call("get", list(keys))

    def drop(self, keys: Sequence[RolloutKey]) -> None:
        self._call("drop", list(keys))

    def drop_steps_before(self, step: int) -> None:
        self._call("drop_steps_before", step)

    def __len__(self) -> int:
        return self._call("__len__")

    def stats(self) -> dict[str, int]:
        return self._call("stats")

    def _call(self, method: str, *args):
        import ray

        return ray.get(getattr(self._actor, method).remote(*args))


class TolerantDraftStore(DraftStoreBase):
    """Wraps the configured store so that losing it (a dead actor, a lost node) only costs speed: the first failure
    is logged, and from then on the run goes on without drafts, which changes no result. Refused drafts
    (a :class:`~bubblespec.core.errors.BubblespecError`) still raise: they are a bug, not a loss."""

    def __init__(self, store: DraftStoreBase) -> None:
        self.store = store
        self.lost: str | None = None

    def put(self, drafts: Sequence[Draft]) -> None:
        self._call("put", list(drafts), default=None)

    def get(self, keys: Sequence[RolloutKey]) -> dict[RolloutKey, Draft]:
        return self._call("get", list(keys), default={})

    def drop(self, keys: Sequence[RolloutKey]) -> None:
        self._call("drop", list(keys), default=None)

    def drop_steps_before(self, step: int) -> None:
        self._call("drop_steps_before", step, default=None)

    def __len__(self) -> int:
        return self._call("__len__", default=0)

    def stats(self) -> dict[str, int]:
        """The store's :meth:`DraftStoreBase.stats`; zeros once lost."""
        return self._call("stats", default={"drafts": 0, "tokens": 0, "evicted": 0})

    def _call(self, method: str, *args, default):
        if self.lost is not None:
            return default
        try:
            return getattr(self.store, method)(*args)
        except BubblespecError:
            raise
        except Exception as error:
            self.lost = f"{type(error).__name__}: {error}"
            logger.warning(
                "the draft store (%s) failed and is given up: %s; the run goes on without drafts (results are "
                "unchanged, steps are slower)",
                type(self.store).__name__,
                self.lost,
            )
            return default
