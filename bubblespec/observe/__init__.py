"""What a run records and shows: step records, the run directory, Prometheus metrics, the report, progress lines
and the task summary (docs/design.md §7)."""
