"""Every field of every statistics record is documented: a ``#:`` comment or ``Attributes:``.

A reader of ``engine.statistics()`` or ``scheduler.statistics()`` must be able to look up
what each number counts; the API reference shows these comments as the fields' docs.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parents[1]


def statistics_classes() -> list[tuple[str, ast.ClassDef, list[str]]]:
    """``(path, class, source lines)`` of every ``*Statistics`` class of the three packages."""
    found = []
    for package in ("states", "gpu", "engine"):
        for path in sorted((ROOT / package).rglob("*.py")):
            source = path.read_text()
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ClassDef) and node.name.endswith("Statistics"):
                    found.append((str(path.relative_to(ROOT)), node, source.splitlines()))
    return found


CLASSES = statistics_classes()


def test_the_records_are_found() -> None:
    names = {node.name for _, node, _ in CLASSES}
    assert {"SchedulerStatistics", "BlockPoolStatistics", "EngineStatistics"} <= names


@pytest.mark.parametrize(
    ("path", "node", "lines"), CLASSES, ids=[node.name for _, node, _ in CLASSES]
)
def test_every_field_is_documented(path: str, node: ast.ClassDef, lines: list[str]) -> None:
    docstring = ast.get_docstring(node) or ""
    _, _, attributes = docstring.partition("Attributes:")
    listed = {line.strip().partition(":")[0] for line in attributes.splitlines()}
    fields = [item for item in node.body if isinstance(item, ast.AnnAssign)]
    assert fields, f"{path}: {node.name} has no fields"
    undocumented = [
        ast.unparse(field.target)
        for field in fields
        if not lines[field.lineno - 2].strip().startswith("#:")
        and ast.unparse(field.target) not in listed
    ]
    assert not undocumented, f"{path}: {node.name} fields without a doc: {undocumented}"
