"""The RL loop and what it trains with: the loop itself, the rollout schedules, the learner and its losses,
advantages, logprobs and batches, the trainer's models and the Ray Train workers (docs/design.md §7)."""
