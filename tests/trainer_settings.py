"""Trainer settings as one flat mapping of dotted keys, the way tests vary them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bubblespec.core.config import TrainerConfig


def trainer_config(settings: Mapping[str, Any]) -> TrainerConfig:
    """The trainer section of ``{"optimizer.learning_rate": 1e-2, "kl.coef": 0.1, "loss.policy.kind": "cispo"}``."""
    nested: dict[str, Any] = {}
    for path, value in settings.items():
        *sections, name = path.split(".")
        node = nested
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = value
    return TrainerConfig.model_validate(nested)
