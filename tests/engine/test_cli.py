"""``twostroke generate --json-schema FILE`` and ``--regex PATTERN``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from twostroke.engine.cli import main

GENERATE = ["generate", "Weather?", "--model", "toy", "--device", "cpu", "--max-tokens", "64"]
SCHEMA = {
    "type": "object",
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "high": {"type": "boolean"}},
    "required": ["unit", "high"],
    "additionalProperties": False,
}


def test_generate_follows_a_json_schema_file_and_a_regex(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    schema = tmp_path / "weather.json"
    schema.write_text(json.dumps(SCHEMA, indent=2))
    assert main([*GENERATE, "--json-schema", str(schema)]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), SCHEMA)
    assert main([*GENERATE, "--regex", "[0-9]{4}-[a-z]{2}"]) == 0
    assert re.fullmatch("[0-9]{4}-[a-z]{2}\n", capsys.readouterr().out)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--json-schema", "{missing}"], "argument --json-schema: cannot read the schema file "
         "'{missing}': [Errno 2] No such file or directory"),
        (["--json-schema", "{not_json}"], "argument --json-schema: {not_json}: schema is not "
         "valid JSON: Expecting property name enclosed in double quotes"),
        (["--json-schema", "{array}"], "argument --json-schema: {array}: schema must be a JSON "
         "object, got list [1]"),
        (["--regex", ""], "argument --regex: pattern must be non-empty, got ''"),
        (["--regex", "a", "--json-schema", "{good}"], "argument --json-schema: not allowed "
         "with argument --regex"),
    ],
)  # fmt: skip
def test_an_unreadable_or_malformed_constraint_is_refused_before_anything_loads(
    arguments: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = {"missing": tmp_path / "missing.json", "not_json": tmp_path / "bad.json",
             "array": tmp_path / "array.json", "good": tmp_path / "good.json"}  # fmt: skip
    files["good"].write_text(json.dumps(SCHEMA))
    files["not_json"].write_text("{nope")
    files["array"].write_text("[1]")
    names = {name: str(path) for name, path in files.items()}
    with pytest.raises(SystemExit) as exited:
        main([*GENERATE, *(argument.format(**names) for argument in arguments)])
    assert exited.value.code == 2
    assert f"twostroke generate: error: {message.format(**names)}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--regex", "(?<=a)b"], "argument --regex: invalid regex: look-around, including "
         "look-ahead and look-behind, is not supported"),
        (["--json-schema", "{schema}"], 'argument --json-schema: Unimplemented keys: ["if"]'),
    ],
)  # fmt: skip
def test_a_constraint_the_backend_refuses_is_an_error_naming_the_flag(
    arguments: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    schema = tmp_path / "if.json"
    schema.write_text('{"type": "object", "if": {}}')
    assert main([*GENERATE, *(a.format(schema=schema) for a in arguments)]) == 2
    assert capsys.readouterr().err == f"twostroke generate: error: {message}\n"
