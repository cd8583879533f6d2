"""Keyed sampling and exact verification: the pure tensor functions, their loop reference, a sequence's decoding
state and the draft checks every engine shares (docs/design.md §3-4, §7). Engines import this layer; it imports no
engine."""
