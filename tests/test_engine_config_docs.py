"""docs/models.md lists the engine's options from ``EngineConfig`` itself, and the
``twostroke`` commands draw their engine flags from it, so neither drifts from the class.

The table in "The engine's options" is :func:`~twostroke.engine.config.engine_options_table`'s
output: one row per field, with its flag, its default and its doc from the class's docstring.
"""

from __future__ import annotations

import argparse
import pathlib

import attrs
import pytest

from twostroke.engine.cli import build_parser
from twostroke.engine.config import (
    DTYPE_OPTIONS,
    ENGINE_FLAGS,
    QUANTIZATION_OPTIONS,
    EngineConfig,
    engine_flag,
    engine_flag_choices,
    engine_flag_help,
    engine_options_table,
)

DOCS = pathlib.Path(__file__).parents[1] / "docs" / "models.md"


def options_section() -> str:
    """The text of models.md's "The engine's options" section, to the next ``##`` heading."""
    text = DOCS.read_text(encoding="utf-8")
    _, found, section = text.partition("\n## The engine's options\n")
    assert found, "docs/models.md has no 'The engine's options' section"
    return section.split("\n## ", 1)[0]


def test_the_docs_show_the_table_of_the_class() -> None:
    assert options_section().count(engine_options_table()) == 1, (
        "docs/models.md is out of date: paste the output of "
        "twostroke.engine.config.engine_options_table() into its 'The engine's options' section"
    )


def test_the_table_has_each_field_its_flag_and_its_default() -> None:
    header, rule, *rows = engine_options_table().splitlines()
    assert (header, rule) == ("| field | flag | default | meaning |", "|---|---|---|---|")
    cells = [row.removeprefix("| ").removesuffix(" |").split(" | ")[:3] for row in rows]
    assert cells == [
        [
            f"`{field.name}`",
            f"`{engine_flag(field.name)}`" if field.name in ENGINE_FLAGS else "",
            f"`{field.default!r}`",
        ]
        for field in attrs.fields(EngineConfig)
    ]


def _actions(command: str) -> dict[str, argparse.Action]:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {action.dest: action for action in commands.choices[command]._actions}


@pytest.mark.parametrize("command", ["generate", "chat", "demo", "serve"])
def test_the_choices_are_the_option_tuples(command: str) -> None:
    actions = _actions(command)
    assert tuple(actions["quantization"].choices or ()) == (*QUANTIZATION_OPTIONS, "none")
    assert actions["quantization"].option_strings == ["--quantization", "-q"]
    assert tuple(actions["kv_cache_dtype"].choices or ()) == DTYPE_OPTIONS
    assert engine_flag_choices("dtype") == DTYPE_OPTIONS


def test_each_flag_reads_its_help_and_its_default_from_the_class() -> None:
    serve, bench = _actions("serve"), _actions("bench")
    for name in ("max_model_len", "max_num_seqs", "quantization", "kv_cache_dtype", "mmap",
                 "deterministic", "speculative_config"):  # fmt: skip
        assert serve[name].help == engine_flag_help(name), name
        assert serve[name].default is None, name  # absent: the engine's own default
        assert engine_flag(name) in serve[name].option_strings, name
    assert "(default: 64)" in serve["max_num_seqs"].help
    defaults = EngineConfig()
    assert bench["max_num_seqs"].default == defaults.max_num_seqs
    assert bench["max_num_batched_tokens"].default == defaults.max_num_batched_tokens


def test_a_choice_flag_that_is_none_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"name must be an EngineConfig field whose flag takes a choice, got 'mmap'",
    ):
        engine_flag_choices("mmap")


def test_serve_hands_its_engine_flags_to_the_engine_only_where_given() -> None:
    from twostroke.engine.cli import _engine_options

    parser = build_parser()
    assert _engine_options(parser.parse_args(["serve"])) == {}
    given = parser.parse_args(
        ["serve", "--max-num-seqs", "8", "--max-model-len", "256", "-q", "none",
         "--kv-cache-dtype", "bfloat16", "--no-mmap", "--no-deterministic"]
    )  # fmt: skip
    assert _engine_options(given) == {
        "max_num_seqs": 8, "max_model_len": 256, "quantization": None,
        "kv_cache_dtype": "bfloat16", "mmap": False, "deterministic": False,
    }  # fmt: skip
