"""Bubble policies, sharding policies and draft alignment (registered as ``bubblespec.policies`` entry points)."""
