"""An example bubblespec engine backend on Hugging Face transformers (entry point ``transformers-example``)."""

from bubblespec_transformers_example.engine import TransformersEngine, TransformersEngineConfig

__all__ = ["TransformersEngine", "TransformersEngineConfig"]
