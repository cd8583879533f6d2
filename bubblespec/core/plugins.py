"""Plugin discovery through entry points: one mechanism for every kind of plugin.

A package adds a plugin by declaring an entry point in one of the groups below, exactly as bubblespec's
built-ins do in its own pyproject.toml, e.g.::

    [project.entry-points."bubblespec.backends"]
    my-engine = "my_package.engine:MyEngine"

Only the plugin a config names is imported, so optional engines stay optional. Nothing is loaded from a path
given at run time: plugins come only from installed entry points. (A reward may also be named
``module:function``, an importable module's function: see :mod:`bubblespec.tasks.rewards`.)
"""

from __future__ import annotations

from importlib import metadata

from bubblespec.core.errors import PluginNotFoundError

KINDS: dict[str, str] = {
    "backends": "bubblespec.backends",
    "draft_stores": "bubblespec.draft_stores",
    "draft_sources": "bubblespec.draft_sources",
    "policies": "bubblespec.policies",
    "tasks": "bubblespec.tasks",
    "rewards": "bubblespec.rewards",
}


def available(kind: str) -> dict[str, metadata.EntryPoint]:
    """Installed plugins of ``kind`` by name (nothing is imported)."""
    group = _group(kind)
    found: dict[str, metadata.EntryPoint] = {}
    for entry_point in metadata.entry_points(group=group):
        if entry_point.name in found and found[entry_point.name].value != entry_point.value:
            raise PluginNotFoundError(
                f"{kind} plugin {entry_point.name!r} is provided twice: by {found[entry_point.name].value!r} and "
                f"{entry_point.value!r}; uninstall one of the packages"
            )
        found[entry_point.name] = entry_point
    return dict(sorted(found.items()))


def load(kind: str, name: str) -> object:
    """Imports and returns the object behind plugin ``name`` of ``kind``; lists the installed ones if absent."""
    plugins = available(kind)
    if name not in plugins:
        choices = ", ".join(plugins) or "none installed"
        raise PluginNotFoundError(f"unknown {kind} plugin {name!r}; available: {choices}")
    entry_point = plugins[name]
    try:
        return entry_point.load()
    except ImportError as error:
        extra = f" (pip install 'bubblespec[{name}]')" if kind == "backends" else ""
        raise PluginNotFoundError(
            f"{kind} plugin {name!r} ({entry_point.value}) cannot be imported: {error}{extra}"
        ) from error


def load_subclass(kind: str, name: str, base: type) -> type:
    """:func:`load`, refusing by name a plugin that is not a subclass of ``base`` (the base class of its kind, which
    declares what a plugin of the kind may implement and the defaults of the rest)."""
    found = load(kind, name)
    if not (isinstance(found, type) and issubclass(found, base)):
        raise PluginNotFoundError(
            f"{kind} plugin {name!r} ({available(kind)[name].value}) is not a subclass of "
            f"{base.__module__}.{base.__qualname__}, the base class of {kind}; subclass it (see docs/plugins.md)"
        )
    return found


def _group(kind: str) -> str:
    if kind not in KINDS:
        raise PluginNotFoundError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KINDS)}")
    return KINDS[kind]
