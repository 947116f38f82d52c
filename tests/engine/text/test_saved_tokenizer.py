"""SavedTokenizer: a saved fast tokenizer read without transformers, checked against transformers.

The shared tests of ``test_tokenizer.py`` run every HFTokenizer behaviour over both; these
cover what only the saved files can get wrong: the chat template's environment, the forms
``tokenizer_config.json`` writes special tokens in, and damaged files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.engine.text.test_tokenizer import BOS, EOS, write_model_directory
from twostroke.engine.text.saved_tokenizer import SavedTokenizer

#: Everything transformers' environment adds: loop controls, its tojson (non-ASCII kept,
#: keyword options), the {% generation %} tag, the named special tokens, raise_exception.
TEMPLATE = (
    "{% for m in messages %}"
    "{% if loop.index > 2 %}{% break %}{% endif %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
    "{{ bos_token }}{{ m | tojson(sort_keys=True) }}\n"
    "  {% generation %}{{ m['content'] | tojson(indent=1) }}{% endgeneration %}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ unk_token or 'none' }}|{{ bos_token }}{% endif %}"
)
MESSAGES = [
    {"role": "user", "content": "日本語 <b>&</b> 😀"},
    {"role": "assistant", "content": "ok"},
    {"role": "user", "content": "not rendered: the loop breaks"},
]


def test_the_chat_template_renders_as_transformers_renders_it(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    write_model_directory(tmp_path, chat_template=TEMPLATE)
    theirs = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    expected = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ours = SavedTokenizer.read(tmp_path)
    rendered = ours.render_chat(MESSAGES)
    assert rendered == expected
    assert '"content": "日本語 <b>&</b> 😀"' in rendered  # not escaped
    assert ours.encode(rendered, add_special_tokens=False) == theirs.encode(
        rendered, add_special_tokens=False
    )


def test_a_template_that_raises(tmp_path: Path) -> None:
    import jinja2

    write_model_directory(tmp_path, chat_template=TEMPLATE)
    with pytest.raises(jinja2.TemplateError, match=r"^no tools$"):
        SavedTokenizer.read(tmp_path).render_chat([{"role": "tool", "content": "x"}])


def test_the_template_file_wins_over_the_config(tmp_path: Path) -> None:
    write_model_directory(tmp_path, chat_template="from the config")
    (tmp_path / "chat_template.jinja").write_text("from the file", encoding="utf-8")
    assert SavedTokenizer.read(tmp_path).chat_template == "from the file"


def test_special_tokens_written_as_added_token_dicts(tmp_path: Path) -> None:
    write_model_directory(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token"] = {"__type": "AddedToken", "content": EOS, "special": True}
    config_path.write_text(json.dumps(config))
    saved = SavedTokenizer.read(tmp_path)
    assert saved.eos_token_id == 1
    assert saved.render_chat([{"role": "user", "content": "hi"}]).startswith(f"{BOS}user: hi")


def test_truncation_saved_in_the_file_is_turned_off(tmp_path: Path) -> None:
    raw = write_model_directory(tmp_path)
    raw.enable_truncation(max_length=2)
    raw.save(str(tmp_path / "tokenizer.json"))
    text = "the quick brown fox, jumps!"
    assert len(SavedTokenizer.read(tmp_path).encode(text)) > 2


def test_without_an_eos_token(tmp_path: Path) -> None:
    write_model_directory(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["eos_token"]
    config_path.write_text(json.dumps(config))
    assert SavedTokenizer.read(tmp_path).eos_token_id is None


def _damage(folder: Path, file: str, text: str) -> None:
    (folder / file).write_text(text, encoding="utf-8")


@pytest.mark.parametrize(
    ("file", "text", "message"),
    [
        ("tokenizer.json", '{"version": "1.0", "model": ', "{folder}: Exception: "),
        ("tokenizer_config.json", "{", "{folder}: JSONDecodeError: "),
        ("tokenizer_config.json", "[]", "{config} must hold a JSON object, got list"),
        (
            "tokenizer_config.json",
            '{"chat_template": [{"name": "default", "template": "x"}]}',
            "{config}: chat_template is a list",
        ),
        (
            "tokenizer_config.json",
            '{"eos_token": 7}',
            "{config}: eos_token must be a string or {{'content': str}}, got 7",
        ),
    ],
)
def test_a_damaged_file_is_a_value_error_naming_it(
    tmp_path: Path, file: str, text: str, message: str
) -> None:
    write_model_directory(tmp_path)
    _damage(tmp_path, file, text)
    expected = message.format(folder=tmp_path, config=tmp_path / "tokenizer_config.json")
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}"):
        SavedTokenizer.read(tmp_path)


def test_a_missing_tokenizer_json(tmp_path: Path) -> None:
    write_model_directory(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path))}: Exception: "):
        SavedTokenizer.read(tmp_path)
