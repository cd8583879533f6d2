"""bubblespec's rollout under the trainers of other RL frameworks (see docs/integrations.md)."""
