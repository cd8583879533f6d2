"""One step's rollout across ranks: the rollout service, the bubble scheduler and its two drivers (virtual clock,
Ray Serve), clocks, the draft store, response-length predictions, the speculation-effect replay and the weight
transport (docs/design.md §5-6, §7)."""
