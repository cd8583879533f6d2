"""Built-in tasks: prompt sources with their reward functions and a tiny pre-trained model each."""

from bubblespec.tasks.arithmetic import ArithmeticTask

__all__ = ["ArithmeticTask"]
