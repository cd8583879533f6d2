"""bubblespec: idle rollout ranks draft the next RL step; the updated policy verifies the drafts exactly."""

__version__ = "0.1.0"
