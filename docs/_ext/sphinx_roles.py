"""Griffe extension: turn the docstrings' Sphinx roles into cross-references.

The sources cross-reference in Sphinx's syntax (``:class:`~twostroke.gpu.device.Device```,
``:meth:`submit```), which Markdown would print as is. Before mkdocstrings renders a
docstring, this extension resolves each role's target the way Python would read the name
where the docstring stands (the object's members, its module's imports, its parents).
As in Sphinx, ``.name`` is looked up from the module outwards; a bare method name in a
module docstring means the one class of the module that has it. It then writes a link to
the page that documents the target. A target that exists but that no page renders (a private
helper, a runner's internals, torch) stays code without a link; a target that resolves to
nothing is a broken reference and is logged as a warning, which ``mkdocs build --strict``
turns into a failure.
"""

from __future__ import annotations

import builtins
import re
from html import escape
from typing import Any

import griffe

_ROLE = re.compile(
    r":(?:py:)?(?:class|func|meth|attr|mod|exc|data|obj|const|type):`(?P<target>[^`]+)`"
)
_EXPLICIT_TITLE = re.compile(r"^(?P<title>.+?)\s*<(?P<target>[^<>]+)>$")


def _lookup(collection: griffe.ModulesCollection, path: str) -> bool:
    try:
        collection.get_member(path)
    except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return False
    return True


def _in_module_classes(obj: griffe.Object, name: str) -> str | None:
    """The one class of ``obj``'s module with a member ``name`` (a module docstring's
    ``:meth:`submit``` means its class's method), or None if none or several have it."""
    found = [
        cls.members[name].path
        for cls in obj.module.classes.values()
        if not cls.is_alias and name in cls.members
    ]
    return found[0] if len(found) == 1 else None


def _resolve(obj: griffe.Object, target: str) -> str | None:
    """The full path ``target`` names where ``obj``'s docstring stands, or None."""
    head, _, rest = target.partition(".")
    if head == "twostroke":
        path = target
    elif not head:  # Sphinx's ".name": the module's, else the nearest enclosing package's.
        scope = obj.module.path.split(".")
        candidates = [".".join(scope[:end]) + target for end in range(len(scope), 0, -1)]
        return next((c for c in candidates if _lookup(obj.modules_collection, c)), None)
    else:
        try:
            base = obj.resolve(head)
        except griffe.NameResolutionError:
            if hasattr(builtins, head):
                return target
            in_class = _in_module_classes(obj, head)
            if in_class is None:
                return None
            base = in_class
        path = f"{base}.{rest}" if rest else base
    if path.split(".", 1)[0] != "twostroke":
        return path  # Another package (torch, anyio, hypothesis): no page of ours.
    return path if _lookup(obj.modules_collection, path) else None


def _rewrite(obj: griffe.Object, docstring: griffe.Docstring) -> None:
    def replace(match: re.Match[str]) -> str:
        target = match["target"]
        explicit = _EXPLICIT_TITLE.match(target)
        if explicit:
            title, target = explicit["title"], explicit["target"]
        elif target.startswith("~"):
            target = target[1:]
            title = target.rsplit(".", 1)[-1]
        else:
            title = target
        if target.startswith("!"):
            return f"`{title}`"
        path = _resolve(obj, target)
        if path is None:
            griffe.logger.warning(
                "%s:%s: %s: cross-reference %r names nothing in scope",
                obj.relative_filepath,
                docstring.lineno,
                obj.path,
                match[0],
            )
            return f"`{title}`"
        if path.split(".", 1)[0] != "twostroke":
            return f"`{title}`"
        return (
            f'<autoref identifier="{escape(path)}" optional><code>{escape(title)}</code></autoref>'
        )

    docstring.value = _ROLE.sub(replace, docstring.value)


def _walk(obj: griffe.Object) -> None:
    if obj.docstring is not None:
        _rewrite(obj, obj.docstring)
    for member in obj.members.values():
        if not member.is_alias:
            _walk(member)  # type: ignore[arg-type]


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx cross-reference roles in every docstring of a loaded package."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Rewrite the roles once the whole package, and so every target, is loaded."""
        _walk(pkg)
