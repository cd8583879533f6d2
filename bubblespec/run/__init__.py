"""Starting a run: assembling its parts from a config, launching the loop, the Ray cluster and its ranks
(docs/design.md §7)."""
