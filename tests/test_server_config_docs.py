"""docs/serving.md lists the server's limits from ``ServerConfig`` itself, so the two never drift.

The table in "Limits and security" is :func:`~twostroke.engine.config.server_limits_table`'s
output: one row per field, with its flag, its default and its doc from the class's docstring.
These tests fail when the pasted table and the class differ, when the table leaves out or
misstates a field, and when a field has no doc.
"""

from __future__ import annotations

import pathlib

import attrs

from twostroke.engine.cli import build_parser
from twostroke.engine.config import (
    ServerConfig,
    server_field_docs,
    server_flag,
    server_limits_table,
)

DOCS = pathlib.Path(__file__).parents[1] / "docs" / "serving.md"


def limits_section() -> str:
    """The text of serving.md's "Limits and security" section, to the next ``##`` heading."""
    text = DOCS.read_text(encoding="utf-8")
    _, found, section = text.partition("\n## Limits and security\n")
    assert found, "docs/serving.md has no 'Limits and security' section"
    return section.split("\n## ", 1)[0]


def test_the_docs_show_the_table_of_the_class() -> None:
    assert limits_section().count(server_limits_table()) == 1, (
        "docs/serving.md is out of date: paste the output of "
        "twostroke.engine.config.server_limits_table() into its 'Limits and security' section"
    )


def test_every_field_has_a_doc() -> None:
    docs = server_field_docs()
    assert list(docs) == [field.name for field in attrs.fields(ServerConfig)]
    assert all(len(doc.split()) >= 5 for doc in docs.values()), docs


def test_the_table_has_each_field_its_flag_its_default_and_its_doc() -> None:
    header, rule, *rows = server_limits_table().splitlines()
    assert (header, rule) == ("| field | flag | default | limit |", "|---|---|---|---|")
    cells = [row.removeprefix("| ").removesuffix(" |").split(" | ") for row in rows]
    docs = server_field_docs()
    expected = [
        [
            f"`{field.name}`",
            f"`{server_flag(field.name)}`",
            f"`{field.default!r}`",
            docs[field.name].replace("``", "`"),
        ]
        for field in attrs.fields(ServerConfig)
    ]
    assert cells == expected


def test_each_flag_in_the_table_sets_its_field() -> None:
    parser = build_parser()
    for field in attrs.fields(ServerConfig):
        value = {"allowed_hosts": "*", "strict_schemas": "false"}.get(field.name, "3")
        given = parser.parse_args(["serve", server_flag(field.name), value])
        expected = {"allowed_hosts": frozenset({"*"}), "strict_schemas": False,
                    "responses_store": "3", "batches_store": "3"}.get(field.name, 3)  # fmt: skip
        assert getattr(given, field.name) == expected, field.name
