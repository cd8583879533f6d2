"""bubblespec: idle rollout ranks draft the next RL step; the updated policy verifies the drafts exactly."""

__version__ = "0.1.0"

__all__ = ["RolloutService"]


def __getattr__(name: str):
    # Lazy: `import bubblespec` (the CLI's --help) stays free of torch.
    if name == "RolloutService":
        from bubblespec.rollout.service import RolloutService

        return RolloutService
    raise AttributeError(f"module 'bubblespec' has no attribute {name!r}")
