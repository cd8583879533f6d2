"""Step records built by hand, for tests of what reads them."""

from __future__ import annotations

from bubblespec.observe.records import PhaseSeconds, StepRecord


def step_record(step: int, **fields) -> StepRecord:
    """A step record of zeros (no ranks, no phase seconds, no training metrics) with ``fields`` set."""
    required = [name for name, field in StepRecord.model_fields.items() if field.is_required()]
    values = dict.fromkeys(required, 0) | {"phase_seconds": PhaseSeconds(rollout=0, train=0, weight_sync=0)}
    return StepRecord.model_validate(values | {"train": {}, "ranks": [], "timelines": [], "step": step} | fields)
