"""``twostroke generate --json-schema FILE`` and ``--regex PATTERN``; ``twostroke cache``."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import attrs
import jsonschema
import pytest

from twostroke.engine.artifacts.cache import (
    CACHE_DIR_ENV,
    CACHE_LIMIT_ENV,
    LAST_USED,
    NATIVE_FOLDER,
    ArtifactCache,
    CacheEntry,
    format_size,
)
from twostroke.engine.artifacts.records import Provenance
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
        (["--speculative-config", "ngram"], "argument --speculative-config: must be a JSON "
         "object such as '{{\"method\": \"ngram\"}}': Expecting value"),
        (["--speculative-config", "null"], "argument --speculative-config: must be a JSON "
         "object, got null"),
        (["--speculative-config", '{{"method": "eagle"}}'], "argument --speculative-config: "
         "method must be one of 'ngram', 'suffix', got 'eagle'"),
        (["--speculative-config", '{{"method": "ngram", "k": 2}}'], "argument "
         "--speculative-config: speculative_config has no field 'k'; its fields are method, "),
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
        (["--json-schema", "{schema}"],
         'argument --json-schema: Unimplemented keys: ["$dynamicRef"]'),
    ],
)  # fmt: skip
def test_a_constraint_the_backend_refuses_is_an_error_naming_the_flag(
    arguments: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    schema = tmp_path / "dynamic.json"
    schema.write_text('{"type": "object", "$dynamicRef": "#node"}')
    assert main([*GENERATE, *(a.format(schema=schema) for a in arguments)]) == 2
    assert capsys.readouterr().err == f"twostroke generate: error: {message}\n"


# --- twostroke cache ----------------------------------------------------------------------------


def _stored(cache: ArtifactCache, artifact: Path, provenance: Provenance, used: int) -> None:
    def write(folder: Path) -> None:
        folder.mkdir()
        (folder / "data").write_bytes(b"x" * 1000)

    assert cache.store(artifact, write, provenance=provenance)
    entry = artifact if artifact.parent.name == NATIVE_FOLDER else artifact.parent
    os.utime(entry / LAST_USED, (used, used))


@pytest.fixture
def filled_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ArtifactCache:
    """A cache of two model entries and a library, in that order of last use (oldest first)."""
    root = tmp_path / "cache"
    monkeypatch.setenv(CACHE_DIR_ENV, str(root))
    monkeypatch.delenv(CACHE_LIMIT_ENV, raising=False)
    cache = ArtifactCache(root, limit=None)
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"GGUF")
    entry = cache.prepare(model)
    weights = Provenance(
        what="weights", source=str(model), torch="2.13.0+cpu", isa="native (avx2)", dtype="float32"
    )
    _stored(cache, entry / "model-float32", weights, used=1_000_000_000)
    _stored(
        cache, entry / "tokenizer", Provenance(what="tokenizer", source=str(model)), 1_000_000_000
    )
    other = cache.root / "other.gguf-0123456789abcdef"
    _stored(cache, other / "model-bfloat16", attrs.evolve(weights, dtype="bfloat16"), 900_000_000)
    library = Provenance(
        what="library",
        source="paged_decode.c",
        torch="2.13.0+cpu",
        isa="avx2 (capped by TWOSTROKE_CPU_ISA; this CPU: avx512_bf16)",
        dtype="bfloat16",
        detail="-DBLOCK_SIZE=16",
    )
    _stored(
        cache, cache.root / NATIVE_FOLDER / "paged_decode-0123456789abcdef", library, 1_100_000_000
    )
    return cache


def total(entries: list[CacheEntry]) -> str:
    return format_size(sum(entry.size for entry in entries))


def test_cache_lists_its_entries_most_recently_used_first(
    filled_cache: ArtifactCache, capsys: pytest.CaptureFixture[str]
) -> None:
    entries = filled_cache.entries()
    assert main(["cache"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        f"{filled_cache.root}: {total(entries)} in 3 entries (limit 8.6 GB, $TWOSTROKE_CACHE_LIMIT)"
    )
    heading, library, model, other = (
        [c.strip() for c in line.split("  ") if c] for line in lines[1:]
    )
    assert heading == ["last used", "size", "what", "torch", "ISA", "source"]
    assert library[1:] == [
        format_size(entries[0].size),
        "library bfloat16",
        "2.13.0+cpu",
        "avx2 (capped by TWOSTROKE_CPU_ISA; this CPU: avx512_bf16)",
        "paged_decode.c -DBLOCK_SIZE=16",
    ]
    tiny = str((filled_cache.root.parent / "tiny.gguf").resolve())
    assert model[2:] == ["weights float32, tokenizer", "2.13.0+cpu", "native (avx2)", tiny]
    assert other[2] == "weights bfloat16"
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(1_100_000_000))
    assert library[0] == when
    assert main(["cache", "list"]) == 0
    assert capsys.readouterr().out.splitlines() == lines


def test_cache_prune_keeps_the_newest(
    filled_cache: ArtifactCache, capsys: pytest.CaptureFixture[str]
) -> None:
    newest, *older = filled_cache.entries()
    assert main(["cache", "prune", "--keep", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        *(f"removed {entry.path} ({format_size(entry.size)})" for entry in older),
        f"pruned: 2 entries, {total(older)}",
    ]
    assert filled_cache.entries() == [newest]


def test_cache_prune_fits_the_size_it_is_given(
    filled_cache: ArtifactCache, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    newest, middle, oldest = filled_cache.entries()
    assert main(["cache", "prune"]) == 0  # the default limit: nothing to do
    assert capsys.readouterr().out == "pruned: 0 entries, 0 B\n"
    monkeypatch.setenv(CACHE_LIMIT_ENV, str(newest.size + middle.size))
    assert main(["cache", "prune"]) == 0
    assert capsys.readouterr().out.endswith(f"pruned: 1 entry, {total([oldest])}\n")
    assert main(["cache", "prune", "--max-size", str(newest.size)]) == 0
    assert capsys.readouterr().out.endswith(f"pruned: 1 entry, {total([middle])}\n")
    assert filled_cache.entries() == [newest]
    assert main(["cache", "prune", "--max-size", "unlimited", "--keep", "0"]) == 0
    assert filled_cache.entries() == []


def test_cache_clear_removes_everything(
    filled_cache: ArtifactCache, capsys: pytest.CaptureFixture[str]
) -> None:
    entries = filled_cache.entries()
    assert main(["cache", "clear"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"cleared: 3 entries, {total(entries)}"
    assert filled_cache.entries() == []
    assert main(["cache"]) == 0
    assert capsys.readouterr().out == (
        f"{filled_cache.root}: 0 B in 0 entries (limit 8.6 GB, $TWOSTROKE_CACHE_LIMIT)\n"
    )


def test_cache_says_when_others_may_write_it(
    filled_cache: ArtifactCache, capsys: pytest.CaptureFixture[str]
) -> None:
    filled_cache.root.chmod(0o777)
    assert main(["cache"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        f"warning: {filled_cache.root}: is writable by its group or by others (mode 0777); a "
        "cache folder must belong to this user and be writable by no one else: nothing in it is "
        "loaded (`twostroke cache clear` empties it and makes it private)"
    )


@pytest.mark.parametrize(
    ("arguments", "environ", "message"),
    [
        (["cache"], {CACHE_LIMIT_ENV: "big"}, "twostroke cache: error: TWOSTROKE_CACHE_LIMIT "
         "must be a size above zero such as 8GiB, 500MB or 1073741824 (bytes), or 'unlimited'; "
         "got 'big'"),
        (["cache", "prune", "--max-size", "0"], {}, "twostroke cache prune: error: argument "
         "--max-size: --max-size must be a size above zero such as 8GiB, 500MB or 1073741824 "
         "(bytes), or 'unlimited'; got '0'"),
        (["cache", "prune", "--keep", "-1"], {}, "twostroke cache prune: error: argument --keep: "
         "--keep must be >= 0, got -1"),
        (["cache", "prune", "--keep", "two"], {}, "twostroke cache prune: error: argument --keep: "
         "--keep must be an int, got 'two'"),
    ],
)  # fmt: skip
def test_cache_refuses_a_bad_limit_or_count(
    arguments: list[str],
    environ: dict[str, str],
    message: str,
    filled_cache: ArtifactCache,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    try:
        code = main(arguments)
    except SystemExit as exited:
        code = exited.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert len(filled_cache.entries()) == 3  # nothing removed


def test_cache_says_when_it_is_off(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TWOSTROKE_NO_CACHE", "1")
    assert main(["cache", "clear"]) == 0
    assert capsys.readouterr().out == "the artifact cache is off (TWOSTROKE_NO_CACHE=1)\n"


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_no_mmap_asks_the_engine_for_a_gguf_file_read_into_memory(command: str) -> None:
    from twostroke.engine.cli import _engine_options, build_parser

    positional = ["hi"] if command == "generate" else []
    parser = build_parser()
    assert _engine_options(parser.parse_args([command, *positional, "--no-mmap"])) == {
        "mmap": False
    }
    assert "mmap" not in _engine_options(parser.parse_args([command, *positional]))


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_swa_full_keeps_every_position_of_the_windowed_layers(command: str) -> None:
    from twostroke.engine.cli import _engine_options, build_parser

    positional = ["hi"] if command == "generate" else []
    parser = build_parser()
    for flag, value in (("--swa-full", True), ("--no-swa-full", False)):
        assert _engine_options(parser.parse_args([command, *positional, flag])) == {
            "swa_full": value
        }
    assert "swa_full" not in _engine_options(parser.parse_args([command, *positional]))


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_the_one_request_commands_open_a_one_sequence_engine(command: str) -> None:
    """generate and chat serve one request at a time, so their engine plans for one
    sequence (where a large GGUF file's blocks win: docs/models.md); the flags given stay."""
    from twostroke.engine.cli import _one_stream_options, build_parser

    positional = ["hi"] if command == "generate" else []
    parser = build_parser()
    assert _one_stream_options(parser.parse_args([command, *positional])) == {"max_num_seqs": 1}
    asked = parser.parse_args([command, *positional, "-q", "gguf"])
    assert _one_stream_options(asked) == {"max_num_seqs": 1, "quantization": "gguf"}
