"""Engine backends. Each module imports only its own engine; find them through the ``bubblespec.backends``
entry points (:func:`bubblespec.core.plugins.load`), not by importing this package."""
