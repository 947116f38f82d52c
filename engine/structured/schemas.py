"""JSON schemas as the backend takes them: keywords it cannot enforce rewritten, or checked.

llguidance enforces most of JSON Schema and refuses the rest. Some of what it refuses can
be written in what it enforces, with the same valid instances, or be checked on the whole
output once it is complete. :func:`for_backend` does both, and only where every output the
engine lets finish still validates against the schema as it was given:

* **Rewritten, exactly** (the rewritten schema has the same valid instances):
  ``uniqueItems: false`` (it constrains nothing) and ``uniqueItems: true`` on an array of at
  most one item are dropped; ``dependentRequired`` and ``dependencies``' lists
  (``{"a": ["b"]}``: if ``a`` is there, so is ``b``) become ``anyOf: [{a absent}, {a and b
  required}]``, and ``dependentSchemas`` and ``dependencies``' schemas the same with the
  schema joined to the second branch (``allOf``); a list whose ``a`` the parent requires
  already is added to its ``required``. ``not: {"required": [a, ...]}`` (alone in its ``not``)
  becomes an object without ``a`` or without another of them (``required`` holds for
  anything but an object, so its negation holds only for objects). Where ``$schema`` names
  draft 3, 4, 6 or 7, the keys beside a ``$ref`` are dropped, annotations apart: those
  drafts ignore them (llguidance would intersect them with the target).
* **Dropped, as JSON Schema says**: a ``format`` llguidance does not implement
  (``uri-reference``, ``int32`` on a string ...). JSON Schema makes ``format`` an annotation
  unless a validator is told to assert it, so any string validates; llguidance enforces the
  formats it knows (:data:`ENFORCED_FORMATS`: a narrower language, so still valid).
* **Checked after generation**: ``uniqueItems: true`` (no grammar can say "no two items
  equal") and ``oneOf`` whose branches llguidance cannot prove disjoint (it enforces
  ``anyOf`` of them, which also lets an output match two branches). The backend gets the
  schema without them; the matcher validates the complete output against the schema as it
  was given (:class:`SchemaCheck`) before it lets the output end, and an output that does
  not validate cannot end: the request fails with a ``ConstraintFailed`` naming the keyword
  and the place, never with output that does not validate.
* **Relaxed, and checked**: what llguidance cannot express is replaced by the closest
  schema it can that admits every valid instance (a superset), and checked as above.
  ``if``/``then``/``else`` becomes ``anyOf: [then, else]`` (where both are given; else it
  is dropped: an instance satisfies ``then`` or ``else`` whichever way ``if`` goes); any
  other ``not``, ``propertyNames``, ``unevaluatedItems``, ``contains`` (and
  ``minContains``/``maxContains``) are dropped; ``unevaluatedProperties`` is
  ``additionalProperties`` where nothing beside it evaluates properties (exactly), dropped
  elsewhere; ``min``/``maxProperties`` beside optional properties are dropped (llguidance
  takes them only where every property is required); a ``pattern`` with look-around or a
  back-reference (Rust's regex has neither), or with a ``$``/``^`` inside it that the
  backend refuses as look-around (``for_backend``'s ``regex_refused`` asks it), is dropped;
  ``min``/``maxProperties`` beside joined branches (``allOf`` ...) are dropped;
  ``patternProperties`` with a pattern every name matches, beside other patterns or beside
  declared properties where a circular reference would be intersected, becomes that
  pattern's ``additionalProperties``; a ``$ref`` to a definition that refers back to itself
  loses the keys beside it (llguidance refuses circular references with sibling keys),
  annotations apart. Subschemas a ``$ref`` names under a key that is no keyword are
  rewritten as the others.
* Everything else llguidance refuses stays refused, in its words.

:func:`strict` is the server's rule for schemas that arrive over HTTP: an object subschema
with ``properties`` and no ``additionalProperties`` is compiled as if it said ``false``.

Pure: the standard library, and ``jsonschema`` (for the check, and to read the draft a
schema names), imported when first needed.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs

__all__ = [
    "CHECKED_KEYWORDS",
    "ENFORCED_FORMATS",
    "BackendSchema",
    "SchemaCheck",
    "for_backend",
    "ignores_ref_siblings",
    "ref_target",
    "strict",
]

#: The ``format`` s llguidance 1.9 enforces (its docs/json_schema.md); any other is dropped.
ENFORCED_FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"}
)
#: The keywords a schema may hold that the backend does not enforce (or enforces relaxed) and
#: the matcher checks on the complete output (``if`` stands for ``then`` and ``else`` too,
#: ``contains`` for ``minContains`` and ``maxContains``; ``$ref`` for the keys beside it).
CHECKED_KEYWORDS = (
    *("oneOf", "uniqueItems", "not", "if", "propertyNames", "unevaluatedProperties"),
    *("unevaluatedItems", "contains", "minProperties", "maxProperties", "pattern", "$ref"),
    "patternProperties",
)
#: Keywords checked under another's name (:data:`CHECKED_KEYWORDS`).
_CHECKED_AS = {"then": "if", "else": "if", "minContains": "contains", "maxContains": "contains"}
#: Keys beside a ``$ref`` that constrain nothing (llguidance takes them beside a circular one).
_ANNOTATIONS = frozenset(
    {"$comment", "$id", "$schema", "$anchor", "title", "description", "default", "examples"}
    | {"deprecated", "readOnly", "writeOnly", "$defs", "definitions"}
)
#: Keywords that evaluate an object's properties in place (``unevaluatedProperties`` sees
#: what they evaluated, ``additionalProperties`` does not).
_IN_PLACE = (
    *("allOf", "anyOf", "oneOf", "not", "$ref", "$dynamicRef", "$recursiveRef"),
    *("if", "then", "else", "dependentSchemas", "dependencies"),
)
#: Asks the backend whether it refuses a regex (:func:`for_backend`).
RegexRefused = Callable[[str], bool] | None
#: Look-around and back-references: Python's ``re`` has them, llguidance's regexes do not.
_LOOK_AROUND = re.compile(r"\\(?:[1-9]|k<)|\(\?(?:<?[=!]|P=)")

#: Keywords whose value is one subschema.
_ONE = (
    "additionalProperties",
    "additionalItems",
    "unevaluatedProperties",
    "unevaluatedItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
)
#: Keywords whose value maps names to subschemas.
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
#: Keywords whose value is a list of subschemas.
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")


def subschemas(schema: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The subschemas of one schema that are objects, each with the keyword it is under
    (``items`` and ``dependencies`` in each of their forms)."""
    for keyword in _ONE:
        value = schema.get(keyword)
        if isinstance(value, dict):
            yield keyword, value
    for keyword in _MAP:
        value = schema.get(keyword)
        if isinstance(value, dict):
            yield from ((keyword, sub) for sub in value.values() if isinstance(sub, dict))
    for keyword in _LIST:
        value = schema.get(keyword)
        if isinstance(value, list):
            yield from ((keyword, sub) for sub in value if isinstance(sub, dict))
    items = schema.get("items")
    if isinstance(items, dict):
        yield "items", items
    elif isinstance(items, list):
        yield from (("items", sub) for sub in items if isinstance(sub, dict))
    dependencies = schema.get("dependencies")
    if isinstance(dependencies, dict):
        yield from (("dependencies", sub) for sub in dependencies.values() if isinstance(sub, dict))


def _walk(schema: dict[str, Any], visit: Callable[[dict[str, Any]], None]) -> None:
    """Call ``visit`` on every subschema that is an object, children first (iterative)."""
    stack: list[tuple[dict[str, Any], bool]] = [(schema, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            visit(node)
            continue
        stack.append((node, True))
        stack.extend((sub, False) for _, sub in subschemas(node))


def _walk_referenced(schema: dict[str, Any], visit: Callable[[dict[str, Any]], None]) -> None:
    """:func:`_walk`, then the same for each target of a local ``$ref`` it did not reach: a
    ``$ref`` may name any place of the document, under a key that is no keyword."""
    reached: set[int] = set()
    refs: list[str] = []

    def mark(node: dict[str, Any]) -> None:
        reached.add(id(node))
        visit(node)
        if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
            refs.append(node["$ref"])

    _walk(schema, mark)
    while refs:
        target = ref_target(schema, refs.pop())
        if isinstance(target, dict) and id(target) not in reached:
            _walk(target, mark)


def _absent(name: str) -> dict[str, Any]:
    return {"properties": {name: False}}


def _dependency(
    node: dict[str, Any], name: str, then: list[str] | dict[str, Any]
) -> dict[str, Any] | None:
    """One dependency of ``node`` as a schema to join to it (``None``: nothing to join)."""
    given = node.get("required")
    required: list[Any] = given if isinstance(given, list) else []
    if isinstance(then, list):
        if all(item in required for item in then):
            return None  # already required, whether or not ``name`` is there
        if name in required:
            return {"required": then}  # (a non-object satisfies it, as the dependency)
        return {"anyOf": [_absent(name), {"required": [name, *then]}]}
    # A schema applies to an object that has ``name``, never to a non-object: keep the
    # first branch even where ``name`` is required (a non-object takes it).
    return {"anyOf": [_absent(name), {"required": [name], "allOf": [then]}]}


def _rewrite_dependencies(node: dict[str, Any]) -> None:
    """``dependentRequired``, ``dependentSchemas`` and ``dependencies`` as ``allOf`` members."""
    joined: list[dict[str, Any]] = []
    for keyword in ("dependentRequired", "dependentSchemas", "dependencies"):
        value = node.get(keyword)
        if not isinstance(value, dict):
            continue
        if not all(isinstance(then, list | dict | bool) for then in value.values()):
            continue  # malformed: the backend refuses it in its words
        del node[keyword]
        for name, then in value.items():
            if then is True or then == {}:
                continue
            if then is False:
                joined.append(_absent(name))
                continue
            schema = _dependency(node, name, then)
            if schema is not None:
                joined.append(schema)
    if joined:
        existing = node.get("allOf")
        node["allOf"] = [*(existing if isinstance(existing, list) else []), *joined]


def _relax(node: dict[str, Any], checked: set[str], regex_refused: RegexRefused) -> None:
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt not in ENFORCED_FORMATS:
        del node["format"]
    unique = node.get("uniqueItems")
    if unique is False:
        del node["uniqueItems"]
    elif unique is True:
        del node["uniqueItems"]
        at_most = node.get("maxItems")
        if not (isinstance(at_most, int) and not isinstance(at_most, bool) and at_most <= 1):
            checked.add("uniqueItems")
    if isinstance(node.get("oneOf"), list):
        checked.add("oneOf")
    # Before anything joins ``allOf`` here: it would evaluate properties in place.
    _relax_unevaluated_properties(node, checked)
    _rewrite_dependencies(node)
    _rewrite_not_required(node)
    _relax_not_expressible(node, checked, regex_refused)


def _join(node: dict[str, Any], schema: dict[str, Any]) -> None:
    """Add ``schema`` to ``node``'s ``allOf`` (the node then also has to satisfy it)."""
    existing = node.get("allOf")
    node["allOf"] = [*(existing if isinstance(existing, list) else []), schema]


def _relax_unevaluated_properties(node: dict[str, Any], checked: set[str]) -> None:
    """``unevaluatedProperties``: ``additionalProperties`` where nothing in place evaluates
    properties beside it (the same valid instances), else dropped and checked."""
    if "unevaluatedProperties" not in node:
        return
    unevaluated = node.pop("unevaluatedProperties")
    if any(key in node for key in _IN_PLACE):
        checked.add("unevaluatedProperties")
    elif "additionalProperties" not in node:  # (beside it, it leaves nothing unevaluated)
        node["additionalProperties"] = unevaluated


def _relax_not_expressible(
    node: dict[str, Any], checked: set[str], regex_refused: RegexRefused
) -> None:
    """The keywords llguidance cannot express, as a superset of their valid instances."""
    if "if" in node or "then" in node or "else" in node:
        condition, then, otherwise = (node.pop(key, True) for key in ("if", "then", "else"))
        # An instance satisfies ``then`` or ``else``, whichever way ``if`` goes for it.
        if condition is not False and then is not True and otherwise is not True:
            _join(node, {"anyOf": [then, otherwise]})
        checked.add("if")
    for keyword in ("not", "propertyNames", "unevaluatedItems"):
        if keyword in node:
            del node[keyword]
            checked.add(keyword)
    if "contains" in node or "minContains" in node or "maxContains" in node:
        for keyword in ("contains", "minContains", "maxContains"):
            node.pop(keyword, None)
        checked.add("contains")
    _relax_property_counts(node, checked)
    pattern = node.get("pattern")
    if isinstance(pattern, str) and (
        _LOOK_AROUND.search(pattern)
        or (regex_refused is not None and _inner_anchor(pattern) and regex_refused(pattern))
    ):
        del node["pattern"]
        checked.add("pattern")


#: Escapes that assert a place rather than match a character (word boundaries, \A, \z).
_ASSERTIONS = frozenset("bBAzZG")


def _inner_anchor(pattern: str) -> bool:
    """Whether ``pattern`` asserts a place other than its own two ends (``$`` or ``^``
    inside it, ``\\b`` ...): llguidance reads some of those as look-around and refuses
    them, so the backend is asked about such a pattern (a cheap filter before it)."""
    in_class = False
    index, last = 0, len(pattern) - 1
    while index <= last:
        char = pattern[index]
        if char == "\\":
            if not in_class and pattern[index + 1 : index + 2] in _ASSERTIONS:
                return True
            index += 2
            continue
        if in_class:
            in_class = char != "]" or pattern[index - 1] == "["
        elif char == "[":
            in_class = True
            if pattern[index + 1 : index + 2] == "^":
                index += 1  # a negated class, not an anchor
        elif (char == "^" and index > 0) or (char == "$" and index < last):
            return True
        index += 1
    return False


def _universal(pattern: str) -> bool:
    """Whether every property name matches ``pattern`` (``.*``, ``^[a-z_]*`` ...): it
    matches the empty string with no assertion but a leading ``^`` (which holds at the start
    of any name), so it matches an empty prefix of every name, as JSON Schema searches."""
    if "$" in pattern or "\\" in pattern or "(?" in pattern.replace("(?:", ""):
        return False  # an assertion, or an escape that may be one: not told apart here
    try:
        return re.match(pattern, "") is not None
    except re.error:
        return False


def _relax_universal_patterns(schema: dict[str, Any], checked: set[str]) -> None:
    """``patternProperties`` with a pattern every key matches (:func:`_universal`) beside
    other patterns, or beside declared properties where a circular reference would be
    intersected: llguidance refuses patterns that are not disjoint, and intersects a
    declared property's schema with each pattern that matches it (refusing circular
    references there). The universal pattern's schema becomes ``additionalProperties`` (it
    applies to every undeclared key, and leaves ``additionalProperties`` nothing), the other
    patterns are dropped: a superset (a key they matched keeps the universal schema, a
    declared one its own), checked."""
    circular = _circular_refs(schema)

    def holds_circular(node: Any) -> bool:
        return isinstance(node, dict) and bool(circular & _refs_under(node))

    def visit(node: dict[str, Any]) -> None:
        patterns = node.get("patternProperties")
        if not isinstance(patterns, dict):
            return
        universal = [pattern for pattern in patterns if _universal(pattern)]
        if not universal:
            return
        properties = node.get("properties")
        declared = list(properties.values()) if isinstance(properties, dict) else []
        if len(patterns) == 1 and not (
            declared and any(map(holds_circular, [patterns[universal[0]], *declared]))
        ):
            return  # llguidance intersects what it can
        matched = [patterns[pattern] for pattern in universal]
        del node["patternProperties"]
        node["additionalProperties"] = matched[0] if len(matched) == 1 else {"allOf": matched}
        checked.add("patternProperties")

    _walk_referenced(schema, visit)


def _refs_under(node: dict[str, Any]) -> set[str]:
    """The local ``$ref`` s in ``node`` and its subschemas (not followed)."""
    found: set[str] = set()
    stack = [node]
    while stack:
        part = stack.pop()
        ref = part.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            found.add(ref)
        stack.extend(sub for _, sub in subschemas(part))
    return found


def _relax_property_counts(node: dict[str, Any], checked: set[str]) -> None:
    """``min``/``maxProperties`` beside optional properties (llguidance takes them only
    where every property is required): dropped, checked unless ``required`` implies them."""
    properties, required = node.get("properties"), node.get("required")
    names = set(required) if isinstance(required, list) else set()
    if node.get("minProperties") == 0:
        del node["minProperties"]  # every object has at least none
    # Branches joined in place bring their properties (llguidance intersects them first).
    joined = any(key in node for key in ("allOf", "anyOf", "oneOf", "$ref"))
    if not joined and (not isinstance(properties, dict) or set(properties) <= names):
        return
    at_least = node.get("minProperties")
    if isinstance(at_least, int) and len(names) >= at_least:
        del node["minProperties"]  # every valid instance has that many properties already
    for keyword in ("minProperties", "maxProperties"):
        if keyword in node:
            del node[keyword]
            checked.add(keyword)


def _lacking(negated: Any) -> dict[str, Any] | None:
    """``{"required": [a, ...]}`` negated: an object that lacks ``a`` or another of them
    (``None`` for any other schema)."""
    if not isinstance(negated, dict) or set(negated) != {"required"}:
        return None
    names = negated["required"]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        return None
    absent = [_absent(name) for name in dict.fromkeys(names)]
    return {"type": "object", **(absent[0] if len(absent) == 1 else {"anyOf": absent})}


def _rewrite_not_required(node: dict[str, Any]) -> None:
    """``not: {"required": [a, ...]}``: an object that lacks ``a`` or another of them; ``not:
    {"anyOf": [{"required": ...}, ...]}`` (keys that exclude each other): all of those."""
    negated = node.get("not")
    branches = negated.get("anyOf") if isinstance(negated, dict) and len(negated) == 1 else None
    if isinstance(branches, list) and branches:
        lacking = [_lacking(branch) for branch in branches]
        if all(schema is not None for schema in lacking):
            del node["not"]
            for schema in lacking:
                assert schema is not None
                _join(node, schema)
        return
    schema = _lacking(negated)
    if schema is not None:
        del node["not"]
        _join(node, schema)


#: Keywords whose subschemas the rewrites move or drop.
_MOVED = frozenset(
    {"not", "if", "then", "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties"}
    | {"contains", "dependentSchemas", "dependencies"}
)
#: How many characters (compact JSON) :func:`_rehome_refs` copies at most, twice the longest
#: schema: a schema past it keeps its other references, which the backend refuses as dangling
#: (ui5.yaml of the shared sample copies 44 definitions, 19,000 characters).
_MAX_COPIED = 262_144


def _new_home(
    schema: dict[str, Any],
    defs_key: str,
    ref: str,
    target: object,
    homes: dict[str, str],
    copied: int,
) -> tuple[int, object] | None:
    """Give ``ref`` a home of its own: a copy of ``target`` among ``schema[defs_key]`` (as
    ``twostroke-ref-<n>``), recorded in ``homes``, within :data:`_MAX_COPIED` characters of
    copies in all (``copied`` so far).

    Returns:
        The characters copied with this one and the copy; ``None`` where ``target`` is no
        schema (the reference named nothing) or the copy would pass the bound.
    """
    size = len(json.dumps(target)) if isinstance(target, dict | bool) else 0
    if not size or copied + size > _MAX_COPIED:
        return None
    defs = schema.setdefault(defs_key, {})
    name = f"twostroke-ref-{len(homes)}"
    while name in defs:
        name += "-"
    homes[ref] = f"#/{defs_key}/{name}"
    defs[name] = copy.deepcopy(target)
    return copied + size, defs[name]


def _rehome_refs(schema: dict[str, Any]) -> None:
    """Point each local ``$ref`` into a subschema the rewrites move or drop (under ``then``,
    ``not`` ...) at a copy of it among the root's ``$defs``, where it stays."""
    homes: dict[str, str] = {}
    copied = 0
    defs_key = "definitions" if "definitions" in schema and "$defs" not in schema else "$defs"
    stack: list[dict[str, Any]] = [schema]
    while stack:
        node = stack.pop()
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/") and _MOVED.intersection(ref.split("/")):
            if ref not in homes:
                home = _new_home(schema, defs_key, ref, ref_target(schema, ref), homes, copied)
                if home is None:
                    stack.extend(sub for _, sub in subschemas(node))
                    continue  # names nothing already, or past the bound: the backend says so
                copied, placed = home
                if isinstance(placed, dict):
                    stack.append(placed)
            node["$ref"] = homes[ref]
        stack.extend(sub for _, sub in subschemas(node))


def _circular_refs(schema: dict[str, Any]) -> frozenset[str]:
    """The local ``$ref`` s whose target refers back to itself (directly or not)."""
    reached: dict[str, set[str]] = {}

    def refs_in(target: Any) -> set[str]:
        found: set[str] = set()
        stack = [target] if isinstance(target, dict) else []
        while stack:
            node = stack.pop()
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                found.add(ref)
            stack.extend(sub for _, sub in subschemas(node))
        return found

    stack = list(refs_in(schema))
    while stack:
        ref = stack.pop()
        if ref in reached:
            continue
        reached[ref] = refs_in(ref_target(schema, ref))
        stack.extend(reached[ref])
    circular = set()
    for ref in reached:
        seen, frontier = set(), list(reached[ref])
        while frontier:
            other = frontier.pop()
            if other == ref:
                circular.add(ref)
                break
            if other not in seen:
                seen.add(other)
                frontier.extend(reached.get(other, ()))
    return frozenset(circular)


def ref_target(schema: Any, ref: str) -> Any:
    """What a local ``$ref`` (``#/a/b``, JSON pointer escapes read) names in ``schema``, or
    ``None``."""
    target: Any = schema
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return None
    return target


#: Keywords whose subschemas llguidance intersects with the keys beside them.
_JOINED = ("allOf", "anyOf", "oneOf")


def _relax_circular_siblings(schema: dict[str, Any], checked: set[str]) -> None:
    """A ``$ref`` to a circular definition, and a subschema that joins one (``allOf``,
    ``anyOf``, ``oneOf`` of it), keep only annotations beside them: llguidance refuses to
    intersect a circular reference with sibling keys."""
    circular = _circular_refs(schema)
    if not circular:
        return

    def joins_circular(node: Any) -> bool:
        if not isinstance(node, dict):
            return False
        if node.get("$ref") in circular:
            return True
        return any(
            isinstance(node.get(keyword), list) and any(map(joins_circular, node[keyword]))
            for keyword in _JOINED
        )

    def visit(node: dict[str, Any]) -> None:
        if not joins_circular(node):
            return
        kept = _ANNOTATIONS | {"$ref", *_JOINED}
        siblings = [key for key in node if key not in kept]
        for key in siblings:
            del node[key]
        if siblings:
            checked.add("$ref")

    _walk(schema, visit)


def _validator_class(schema: dict[str, Any]) -> Any:
    """The ``jsonschema`` validator of the draft ``$schema`` names (2020-12 where none): the
    one the check validates with, so that the rewrites read the schema as it does."""
    import jsonschema  # type: ignore[import-untyped]

    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)


def ignores_ref_siblings(schema: dict[str, Any]) -> bool:
    """Whether ``schema``'s draft ignores the keys beside a ``$ref``.

    Drafts 3 to 7 do ("all other properties in a $ref object MUST be ignored"), and so does
    ``jsonschema``, which the check validates with; 2019-09 and 2020-12 (the default where
    ``$schema`` names none) apply them beside it.

    Args:
        schema: A root schema, as given.

    Returns:
        Whether its ``$schema`` names draft 3, 4, 6 or 7.
    """
    import jsonschema

    drafts = ("Draft3Validator", "Draft4Validator", "Draft6Validator", "Draft7Validator")
    return _validator_class(schema) in [getattr(jsonschema, draft) for draft in drafts]


def _drop_ref_siblings(schema: dict[str, Any]) -> None:
    """Drop the keys beside each ``$ref``, annotations apart: the same valid instances where
    the draft ignores them (:func:`ignores_ref_siblings`), where llguidance would intersect
    them with the target (refusing valid instances, or a circular target outright). A
    ``$ref`` that pointed into a dropped key points at a copy of its target among the
    root's definitions."""
    given = copy.deepcopy(schema)

    def visit(node: dict[str, Any]) -> None:
        if isinstance(node.get("$ref"), str):
            for key in [key for key in node if key != "$ref" and key not in _ANNOTATIONS]:
                del node[key]

    _walk_referenced(schema, visit)
    homes: dict[str, str] = {}
    copied = 0
    defs_key = "definitions" if "definitions" in schema and "$defs" not in schema else "$defs"
    stack: list[dict[str, Any]] = [schema]
    while stack:
        node = stack.pop()
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/") and ref_target(schema, ref) is None:
            if ref not in homes:
                home = _new_home(schema, defs_key, ref, ref_target(given, ref), homes, copied)
                if home is None:
                    continue  # named nothing already, or past the bound: the backend says so
                copied, placed = home
                if isinstance(placed, dict):
                    _walk(placed, visit)
                    stack.append(placed)
            node["$ref"] = homes[ref]
        stack.extend(sub for _, sub in subschemas(node))


@attrs.frozen
class BackendSchema:
    """What the backend compiles for a schema, and what the matcher checks after it.

    Attributes:
        schema: The schema the backend compiles (the given one, rewritten).
        checked: The keywords of :data:`CHECKED_KEYWORDS` the schema holds: the backend
            does not enforce them (``oneOf`` as ``anyOf``), the complete output is validated.
    """

    schema: dict[str, Any]
    checked: frozenset[str]


def for_backend(schema: dict[str, Any], regex_refused: RegexRefused = None) -> BackendSchema:
    """The schema the backend compiles, rewritten as the module docstring says.

    Args:
        schema: The schema as given (not changed).
        regex_refused: Whether the backend refuses a ``pattern`` that asserts a place
            inside it (``$`` or ``^`` not at its ends: llguidance takes some and refuses
            others as look-around); a refused one is dropped and checked. ``None``: such
            patterns are left to the backend.

    Returns:
        The rewritten schema and the keywords checked after generation.
    """
    rewritten = copy.deepcopy(schema)
    checked: set[str] = set()
    if ignores_ref_siblings(schema):
        _drop_ref_siblings(rewritten)
    _rehome_refs(rewritten)
    _walk_referenced(rewritten, lambda node: _relax(node, checked, regex_refused))
    _relax_universal_patterns(rewritten, checked)
    _relax_circular_siblings(rewritten, checked)
    return BackendSchema(rewritten, frozenset(checked))


class SchemaCheck:
    """Validates a complete output against the schema as it was given (``jsonschema``).

    ``format`` is an annotation, as JSON Schema's default says (the backend enforces the
    formats it knows all the same).

    Args:
        schema: The schema as given.
        checked: Which keywords the backend left to this check (named in its reasons).
    """

    def __init__(self, schema: dict[str, Any], checked: frozenset[str]) -> None:
        cls = _validator_class(schema)
        # Not cls.check_schema(schema): validating a schema against its metaschema took
        # 25 ms (p50) to 0.8 s on the shared sample's checked schemas, in every compile. A
        # schema the checker cannot read fails each output's check instead, never passes it.
        self._validator = cls(schema)
        self.checked = checked

    def __call__(self, output: bytes) -> str | None:
        """Why ``output`` does not validate (``None`` if it does)."""
        try:
            value = json.loads(output)
        except ValueError as exc:  # the grammar writes JSON: this is the backend's fault
            return f"the output is not JSON ({exc})"
        try:
            error = next(iter(self._validator.iter_errors(value)), None)
        except Exception as exc:  # a schema jsonschema cannot read (a bad $ref, a bad value)
            return f"the output cannot be checked against the schema ({type(exc).__name__}: {exc})"[
                :300
            ]
        if error is None:
            return None
        where = "/" + "/".join(str(part) for part in error.absolute_path)
        keyword = str(error.validator)
        return (
            f"the output does not validate at {where}: {keyword} "
            f"({error.message[:120]}); {self._named(error.absolute_schema_path)} is "
            f"checked after generation, not enforced while sampling"
        )

    def _named(self, schema_path: Iterable[Any]) -> str:
        """The checked keyword the failed rule is under (``then`` is ``if``'s), else ``$ref``
        where keys beside circular ones were dropped (a rule under none is one of them), or
        ``it``."""
        named = "$ref" if "$ref" in self.checked else "it"
        under_names = False  # the part is a name (of a property, a definition), not a keyword
        for part in schema_path:
            if isinstance(part, str) and not under_names:
                keyword = _CHECKED_AS.get(part, part)
                if keyword in self.checked:
                    named = keyword  # the innermost: the one the rule broke
            under_names = part in _MAP and not under_names
        return named


def _is_object_schema(node: dict[str, Any]) -> bool:
    return isinstance(node.get("properties"), dict)


#: Where a subschema may gain ``additionalProperties: false`` (:func:`strict`): positions
#: where a narrower subschema makes a narrower schema, and that are not joined with a
#: sibling's properties.
_STRICT_INTO = (
    *("properties", "patternProperties", "additionalProperties", "items"),
    *("prefixItems", "additionalItems", "anyOf", "$defs", "definitions"),
)
#: Keywords beside ``properties`` that make a subschema join others (or name other keys).
_JOINS = ("allOf", "anyOf", "oneOf", "$ref", "patternProperties", "unevaluatedProperties")


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with ``additionalProperties: false`` where an object subschema has
    ``properties`` and says nothing of other keys (xgrammar's and OpenAI's strict mode).

    Only where it narrows the schema without emptying it: not under ``not``, ``if``,
    ``oneOf`` (a narrower branch can make an instance match one branch where it matched two),
    ``allOf``, ``then``/``else`` or ``dependentSchemas`` (joined with their parent, whose
    properties the ``false`` would forbid), nor in a subschema that joins others (``allOf``,
    ``anyOf``, ``oneOf``, ``$ref``, ``patternProperties``, ``unevaluatedProperties`` beside
    its ``properties``), nor in ``$defs`` that such a place refers to. So every output it
    allows validates against the schema as given.

    Args:
        schema: The schema as given (not changed).

    Returns:
        A new schema.
    """
    result = copy.deepcopy(schema)
    unsafe = _refs_in_unsafe_places(result)
    stack: list[tuple[dict[str, Any], str]] = [(result, "")]
    while stack:
        node, path = stack.pop()
        joins = any(key in node for key in _JOINS)
        if _is_object_schema(node) and "additionalProperties" not in node and not joins:
            node["additionalProperties"] = False
        for keyword in _STRICT_INTO:
            value = node.get(keyword)
            if keyword in ("$defs", "definitions") and path:
                continue  # only the root's: the ones a local $ref names
            if keyword in ("properties", "patternProperties", "$defs", "definitions"):
                if isinstance(value, dict):
                    for name, sub in value.items():
                        sub_path = f"{path}/{keyword}/{name}"
                        if isinstance(sub, dict) and not (
                            keyword in ("$defs", "definitions") and f"#{sub_path}" in unsafe
                        ):
                            stack.append((sub, sub_path))
            elif isinstance(value, dict):
                stack.append((value, f"{path}/{keyword}"))
            elif isinstance(value, list):
                stack.extend(
                    (sub, f"{path}/{keyword}/{index}")
                    for index, sub in enumerate(value)
                    if isinstance(sub, dict)
                )
    return result


def _refs_in_unsafe_places(schema: dict[str, Any]) -> frozenset[str]:
    """The local ``$ref`` s (``#/$defs/...``) of definitions that :func:`strict` must not
    narrow: ones referred to from a place it leaves alone, or from a subschema that joins."""
    refs: set[str] = set()
    definitions = {
        f"#/{keyword}/{name}": sub
        for keyword in ("$defs", "definitions")
        if isinstance(schema.get(keyword), dict)
        for name, sub in schema[keyword].items()
        if isinstance(sub, dict)
    }
    stack: list[tuple[Any, bool]] = [(schema, False)]
    seen: set[tuple[int, bool]] = set()
    while stack:
        node, unsafe = stack.pop()
        if not isinstance(node, dict) or (id(node), unsafe) in seen:
            continue
        seen.add((id(node), unsafe))
        ref = node.get("$ref")
        if isinstance(ref, str):
            if unsafe or len(node) > 1:
                if ref not in refs:
                    refs.add(ref)
                    stack.append((definitions.get(ref), True))
            else:
                stack.append((definitions.get(ref), False))
        for keyword, sub in subschemas(node):
            if keyword in ("$defs", "definitions"):
                continue  # reached through their references
            stack.append((sub, unsafe or keyword not in _STRICT_INTO))
    return frozenset(refs)
