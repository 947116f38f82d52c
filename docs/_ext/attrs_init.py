"""Griffe extension: give attrs classes the ``__init__`` attrs writes at import time.

griffe reads sources without importing them, so an ``@attrs.frozen`` class has no
``__init__`` to show: the reference would print ``SamplingParams()`` and warn that every
field its docstring lists under ``Args:`` "does not appear in the function signature".
This extension imports each attrs class once the package is loaded and rebuilds the
signature attrs generated (names after aliasing, defaults, keyword-only markers), taking the
annotations from the sources so that they stay cross-referenced. It is the counterpart of
griffe's built-in ``dataclasses`` extension, which does the same for ``@dataclass``.
"""

from __future__ import annotations

import enum
import importlib
import inspect
from typing import Any

import attrs
import griffe

_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: griffe.ParameterKind.positional_only,
    inspect.Parameter.POSITIONAL_OR_KEYWORD: griffe.ParameterKind.positional_or_keyword,
    inspect.Parameter.VAR_POSITIONAL: griffe.ParameterKind.var_positional,
    inspect.Parameter.KEYWORD_ONLY: griffe.ParameterKind.keyword_only,
    inspect.Parameter.VAR_KEYWORD: griffe.ParameterKind.var_keyword,
}


def _is_attrs_decorated(cls: griffe.Class) -> bool:
    return any(
        decorator.callable_path.split(".", 1)[0] in {"attrs", "attr"}
        for decorator in cls.decorators
    )


def _runtime_class(cls: griffe.Class) -> type | None:
    try:
        obj: Any = importlib.import_module(cls.module.path)
    except ImportError:
        # An optional dependency is missing (a bench peer, say); the class keeps no
        # signature, and if a page renders it the docstring check says so.
        return None
    for name in cls.path.removeprefix(cls.module.path + ".").split("."):
        obj = getattr(obj, name)
    return obj if isinstance(obj, type) and attrs.has(obj) else None


def _default(field: attrs.Attribute[Any], value: object) -> str | None:
    if value is inspect.Parameter.empty:
        return None
    # attrs.Factory is a class at run time but a function to type checkers: read it by shape.
    factory = getattr(field.default, "factory", None)
    if callable(factory):
        return f"{getattr(factory, '__qualname__', repr(factory))}()"
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    return repr(value)


def _set_init(cls: griffe.Class, runtime: type) -> None:
    fields = {field.alias: field for field in attrs.fields(runtime)}
    parameters = [
        griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword),
    ]
    for name, parameter in inspect.signature(runtime).parameters.items():
        field = fields[name]
        member = cls.all_members.get(field.name)
        annotation = getattr(member, "annotation", None)
        parameters.append(
            griffe.Parameter(
                name,
                annotation=annotation,
                kind=_KINDS[parameter.kind],
                default=_default(field, parameter.default),
            )
        )
    init = griffe.Function(
        "__init__",
        lineno=cls.lineno,
        endlineno=cls.lineno,
        parent=cls,
        parameters=griffe.Parameters(*parameters),
        returns="None",
    )
    cls.set_member("__init__", init)


def _classes(obj: griffe.Module | griffe.Class) -> list[griffe.Class]:
    found: list[griffe.Class] = []
    for member in obj.members.values():
        if member.is_alias:
            continue
        if isinstance(member, griffe.Module | griffe.Class):
            if isinstance(member, griffe.Class):
                found.append(member)
            found.extend(_classes(member))
    return found


class AttrsInit(griffe.Extension):
    """Recreate the ``__init__`` of every attrs class in a loaded package."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Set ``__init__`` on each attrs class that defines none in its source."""
        for cls in _classes(pkg):
            if "__init__" in cls.members or not _is_attrs_decorated(cls):
                continue
            runtime = _runtime_class(cls)
            if runtime is not None:
                _set_init(cls, runtime)
