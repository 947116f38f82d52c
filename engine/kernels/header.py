"""The C signatures of the compiled kernels, read from ``kernels.h``: each declared once.

Every kernel's source includes ``kernels.h``, so the compiler holds each definition to its
declaration there; this module reads the same declarations, so a binding's argument types
(:func:`~.build.bind`) and the decoder stack's structures (:func:`structures`) follow the C
without being written again in Python. It understands the small subset of C the header is
written in, and refuses anything else (:class:`HeaderError`), rather than guess at a type:

* a function type, ``typedef RET twostroke_NAME_fn(PARAMS);``, whose parameters are
  ``ptrdiff_t``, ``float``, ``int`` or pointers (``RET`` is ``void`` or ``int``);
* a structure, ``struct twostroke_NAME { FIELDS };``, each field of those types, a pointer
  to a function type or to an earlier structure, or ``void *const *`` (an array of
  pointers); several declarators may share a declaration (``const void *a, *b;``).

Pointers are addresses to ctypes (``c_void_p``): the kernels' modules check the tensors'
types and shapes before a call. A pointer to a structure is typed, so ``ctypes.byref``
of that structure is what the call takes.
"""

from __future__ import annotations

import ctypes
import functools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

__all__ = ["KERNELS_HEADER", "Declaration", "HeaderError", "declarations", "structures"]

#: The header that declares every exported function and the stack's structures.
KERNELS_HEADER = Path(__file__).with_name("kernels.h")

#: Scalar types and what ctypes passes them as.
_SCALARS: Mapping[str, Any] = {
    "ptrdiff_t": ctypes.c_ssize_t,
    "float": ctypes.c_float,
    "int": ctypes.c_int,
}
#: What a pointer may point to, besides a function type (``*_fn``) or a structure.
_POINTEES = frozenset(
    {"void", "element", "cached", "float", "int8_t", "int32_t", "int64_t", "uint16_t", "ptrdiff_t"}
)

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)
_PREPROCESSOR = re.compile(r"^\s*#[^\n]*$", re.MULTILINE)
_FUNCTION_TYPE = re.compile(r"typedef\s+(\w+)\s+(twostroke_\w+)_fn\s*\(([^)]*)\)\s*;")
_STRUCTURE = re.compile(r"struct\s+(twostroke_\w+)\s*\{([^}]*)\}\s*;")
_TOKEN = re.compile(r"\*|\w+")


class HeaderError(ValueError):
    """``kernels.h`` holds C this module does not read (what, and where, in the message)."""


@attrs.frozen
class Declaration:
    """One exported function's C signature, as ctypes calls it.

    Attributes:
        name: The function's symbol.
        restype: Its result (``None`` for ``void``).
        argtypes: Its parameters.
    """

    name: str
    restype: Any
    argtypes: tuple[Any, ...]


def declarations(path: Path = KERNELS_HEADER) -> Mapping[str, Declaration]:
    """Every function type of the header, by function name (``twostroke_NAME``), read once
    a process.

    Raises:
        HeaderError: a type outside the subset (see the module), or no function type.
    """
    return _declarations(path)


def structures(path: Path = KERNELS_HEADER) -> Mapping[str, type[ctypes.Structure]]:
    """Every structure of the header as a ctypes ``Structure``, by its C name, fields in
    order: the same classes for the life of the process, which the declarations' pointers
    to structures point to (so ``ctypes.byref`` of one is what a call takes).

    Raises:
        HeaderError: a field of a type outside the subset (see the module).
    """
    return _structures(path)


# Cached by the path given positionally, always: one set of classes per header.
@functools.cache
def _declarations(path: Path) -> Mapping[str, Declaration]:
    text = _code(path)
    found = {}
    for result, name, parameters in _FUNCTION_TYPE.findall(text):
        if result not in ("void", "int"):
            raise HeaderError(f"{name} returns {result!r}: a kernel returns void or int")
        argtypes: list[Any] = []
        if parameters.strip() != "void":
            structs = _structures(path)
            for parameter in parameters.split(","):
                tokens = _TOKEN.findall(parameter)
                if len(tokens) < 2 or tokens[-1] == "*":
                    raise HeaderError(f"{name}: a parameter needs a type and a name: {parameter!r}")
                argtypes.append(_ctype(tokens[:-1], structs, f"{name}'s {tokens[-1]}"))
        restype = ctypes.c_int if result == "int" else None
        found[name] = Declaration(name, restype, tuple(argtypes))
    if not found:
        raise HeaderError(f"{path} declares no function type (typedef RET twostroke_*_fn(...);)")
    return found


@functools.cache
def _structures(path: Path) -> Mapping[str, type[ctypes.Structure]]:
    found: dict[str, type[ctypes.Structure]] = {}
    for name, body in _STRUCTURE.findall(_code(path)):
        fields: list[tuple[str, Any]] = []
        for declaration in filter(str.strip, body.split(";")):
            first, *others = declaration.split(",")
            tokens = _TOKEN.findall(first)
            if len(tokens) < 2 or tokens[-1] == "*":
                raise HeaderError(f"struct {name}: a field needs a type and a name: {first!r}")
            stars = tokens.index("*") if "*" in tokens else len(tokens) - 1
            base = tokens[:stars]
            for declarator in (tokens[stars:], *map(_TOKEN.findall, others)):
                if not declarator or declarator[-1] == "*":
                    raise HeaderError(f"struct {name}: a declarator without a name in {first!r}")
                where = f"struct {name}'s {declarator[-1]}"
                fields.append((declarator[-1], _ctype(base + declarator[:-1], found, where)))
        found[name] = type(name, (ctypes.Structure,), {"_fields_": fields})
    return found


def _code(path: Path) -> str:
    """The header without comments and preprocessor lines."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise HeaderError(f"cannot read {path}: {error}") from error
    return _PREPROCESSOR.sub("", _COMMENT.sub(" ", text))


def _ctype(tokens: list[str], structs: Mapping[str, Any], where: str) -> Any:
    """The ctypes type of a declaration's type tokens (its name left out)."""
    words = [token for token in tokens if token not in ("const", "restrict")]
    stars = words.count("*")
    base = [word for word in words if word != "*"]
    if stars == 0 and len(base) == 1 and base[0] in _SCALARS:
        return _SCALARS[base[0]]
    if stars == 1 and len(base) == 2 and base[0] == "struct" and base[1] in structs:
        return ctypes.POINTER(structs[base[1]])
    if stars == 1 and len(base) == 1 and (base[0] in _POINTEES or base[0].endswith("_fn")):
        return ctypes.c_void_p
    if stars == 2 and base == ["void"]:
        return ctypes.POINTER(ctypes.c_void_p)
    raise HeaderError(f"{where} has a type this binding does not read: {' '.join(tokens)!r}")
