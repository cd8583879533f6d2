"""The ``bubblespec`` command line."""
