"""The bottom layer, which every other layer reads: errors, the interfaces plugins implement, the config sections,
plugin discovery, the draft-source plugin bases, and the fault-test seam. It imports nothing else of bubblespec
(docs/design.md §7)."""
