"""Workloads whose answers repeat tokens: where speculative decoding without a draft model pays.

Drafts taken from a request's own tokens (prompt lookup) or from recent outputs (suffix
decoding) are accepted only where the model writes what was written before. Two workloads
have that shape, built, like :func:`~twostroke.engine.bench.workload.offline_workload`'s,
from text fixed in this package (no network, no data set) and rendered by the model's own
chat template, so an instruct model answers as a user would see it answer:

* :func:`grounded_workload`, **input-grounded** requests: an instruction and a passage,
  whose answer quotes or edits the passage: repeat it with a word changed, correct its
  spelling, extract the sentences that name something, rewrite it as a list, rename a
  function in a piece of code, turn a CSV table into a Markdown one.
* :func:`agent_workload`, a **multi-turn agent trace**: sessions of a coding agent that
  reads a file, writes it back fixed, runs the tests and reports, each turn a request whose
  prompt holds the session so far. The same files recur across sessions, so outputs recur
  across requests (the shared trie of the ``suffix`` method's purpose) as well as inside
  the prompt.

Every request still generates exactly its ``max_tokens`` (EOS ignored, as in every bench
workload), sized to the answer the instruction asks for (its tokens, plus
:data:`ANSWER_MARGIN`), so most of the measured tokens are the answer and not what a model
writes past its end. Both workloads are offline: every request is submitted at t = 0, and
with one sequence at a time they run in order (a session's turns one after another).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping, Sequence

import attrs

from twostroke.engine.bench.workload import CORPUS, BenchRequest, Workload
from twostroke.states.validators import is_int

__all__ = [
    "ANSWER_MARGIN",
    "CODE",
    "GROUNDED_KINDS",
    "TABLE",
    "Exchange",
    "agent_workload",
    "grounded_exchanges",
    "grounded_workload",
]

#: Renders a conversation with the model's chat template, generation prompt included
#: (:meth:`~twostroke.engine.text.tokenizer.HFTokenizer.apply_chat_template`).
Chat = Callable[[Sequence[Mapping[str, str]]], Sequence[int]]

#: Tokens each request may generate beyond its expected answer (a preamble such as "Here is
#: the corrected text:", the end of turn).
ANSWER_MARGIN = 8

#: Small Python modules the code tasks and the agent trace edit (written for this project).
CODE: Mapping[str, str] = {
    "src/config.py": '''\
def load_config(path):
    """Read KEY=VALUE lines into a dict, skipping blanks and comments."""
    config = {}
    with open(path) as file:
        for line in file.read().splitlines():
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config
''',
    "src/units.py": '''\
def parse_duration(text):
    """Seconds in a duration such as "90s", "15m" or "2h"."""
    units = {"s": 1, "m": 60, "h": 3600}
    number, unit = text[:-1], text[-1]
    if unit not in units:
        raise ValueError(f"unknown unit {unit!r} in {text!r}")
    return float(number) * units[unit]
''',
    "src/stats.py": '''\
def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    averages = []
    total = sum(values[:window])
    averages.append(total / window)
    for index in range(window, len(values)):
        total += values[index] - values[index - window]
        averages.append(total / window)
    return averages
''',
    "src/names.py": '''\
def slugify(title):
    """A lower-case, hyphen-separated name for a title, safe in a URL."""
    words = []
    for word in title.lower().split():
        cleaned = "".join(c for c in word if c.isalnum())
        if cleaned:
            words.append(cleaned)
    return "-".join(words)
''',
}

#: A small CSV table the data tasks transform (figures written for this project).
TABLE = """\
engine,cylinders,stroke,power_kw,mass_kg
chainsaw,1,two,2.4,5.1
outboard,2,two,18.0,46.0
scooter,1,two,3.5,11.2
motorcycle,2,four,35.0,58.5
delivery van,4,four,85.0,190.0
"""

#: The input-grounded tasks, in the order :func:`grounded_exchanges` cycles through them.
GROUNDED_KINDS = ("replace", "spelling", "extract", "list", "rename", "markdown")

_SYSTEM = "You are a careful assistant. Follow the instruction exactly."

#: Pairs of a word to replace and its replacement; a passage uses those it contains.
_REPLACEMENTS = (
    ("engine", "motor"),
    ("people", "folk"),
    ("paper", "parchment"),
    ("river", "stream"),
    ("cook", "chef"),
    ("system", "machine"),
    ("weather", "climate"),
    ("water", "rain"),
    ("light", "daylight"),
    ("report", "record"),
)

#: Functions renamed by the code tasks, by the file that defines them.
_RENAMES = {
    "src/config.py": ("load_config", "read_settings"),
    "src/units.py": ("parse_duration", "duration_seconds"),
    "src/stats.py": ("moving_average", "rolling_mean"),
    "src/names.py": ("slugify", "url_name"),
}


@attrs.frozen
class Exchange:
    """One request of a chat workload as text: the conversation and the answer it asks for.

    Attributes:
        messages: The conversation, oldest first, ending with the user's turn.
        answer: What a model that follows the instruction exactly writes (its length sizes
            the request's ``max_tokens``).
        kind: The task (one of :data:`GROUNDED_KINDS`, or an agent turn).
    """

    messages: tuple[Mapping[str, str], ...]
    answer: str
    kind: str


def _paragraphs() -> list[str]:
    return [" ".join(block.split()) for block in CORPUS.split("\n\n") if block.strip()]


def _sentences(paragraph: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", paragraph) if s]


def _misspell(paragraph: str, rng: random.Random) -> str:
    """``paragraph`` with two inner letters swapped in about one word of six of 5+ letters."""
    words = paragraph.split(" ")
    long = [i for i, w in enumerate(words) if len(w) >= 5 and w.isalpha()]
    for index in rng.sample(long, max(1, len(long) // 6)):
        word = words[index]
        at = rng.randrange(1, len(word) - 2)
        words[index] = word[:at] + word[at + 1] + word[at] + word[at + 2 :]
    return " ".join(words)


def _markdown(table: str) -> str:
    rows = [line.split(",") for line in table.strip().splitlines()]
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(lines)


def _user(instruction: str, passage: str) -> tuple[Mapping[str, str], ...]:
    return (
        {"role": "system", "content": _SYSTEM},
        {"role": "user", "content": f"{instruction}\n\n{passage}"},
    )


def _grounded(kind: str, variant: int, rng: random.Random) -> Exchange:
    """The ``variant``-th exchange of task ``kind`` (variants cycle over the passages)."""
    paragraphs = _paragraphs()
    paragraph = paragraphs[variant % len(paragraphs)]
    if kind == "replace":
        pairs = [pair for pair in _REPLACEMENTS if pair[0] in paragraph] or [("the", "a")]
        old, new = pairs[variant // len(paragraphs) % len(pairs)]
        instruction = f'Repeat the text below word for word, but write "{new}" instead of "{old}".'
        return Exchange(_user(instruction, paragraph), paragraph.replace(old, new), kind)
    if kind == "spelling":
        instruction = (
            "Correct the spelling mistakes in the text below and return the whole corrected text."
        )
        return Exchange(_user(instruction, _misspell(paragraph, rng)), paragraph, kind)
    if kind == "extract":
        sentences = _sentences(paragraph)
        words = sorted({w.strip(",.;:").lower() for w in paragraph.split() if len(w) >= 6})
        word = words[(variant // len(paragraphs) * 7 + variant) % len(words)]
        chosen = [s for s in sentences if word in s.lower()]
        instruction = (
            f'Copy, word for word, every sentence of the text below that contains "{word}".'
        )
        return Exchange(_user(instruction, paragraph), " ".join(chosen), kind)
    if kind == "list":
        items = [f"{i}. {s}" for i, s in enumerate(_sentences(paragraph), 1)]
        instruction = (
            "Rewrite the text below as a numbered list with one sentence per item, keeping "
            "each sentence's words."
        )
        return Exchange(_user(instruction, paragraph), "\n".join(items), kind)
    if kind == "rename":
        path = sorted(CODE)[variant % len(CODE)]
        old, new = _RENAMES[path]
        code = CODE[path]
        instruction = f"In the code below, rename `{old}` to `{new}` and return the whole code."
        passage = f"```python\n{code}```"
        return Exchange(_user(instruction, passage), passage.replace(old, new), kind)
    assert kind == "markdown", kind
    rows = TABLE.strip().splitlines()
    # Variants drop one data row each, so prompts differ.
    kept = [rows[0], *(row for i, row in enumerate(rows[1:]) if i != variant % (len(rows) - 1))]
    table = "\n".join(kept) + "\n"
    instruction = "Convert the CSV table below to a Markdown table with the same rows."
    return Exchange(_user(instruction, table), _markdown(table), kind)


def grounded_exchanges(n: int, *, seed: int = 0) -> tuple[Exchange, ...]:
    """``n`` input-grounded exchanges: the tasks of :data:`GROUNDED_KINDS` in turn, each on
    the next passage, misspellings drawn from ``seed``.

    Raises:
        ValueError: ``n`` < 1.
    """
    if not is_int(n) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    rng = random.Random(f"grounded-{seed}")
    kinds = len(GROUNDED_KINDS)
    return tuple(_grounded(GROUNDED_KINDS[i % kinds], i // kinds + seed, rng) for i in range(n))


def _requests(
    exchanges: Sequence[Exchange], chat: Chat, encode: Callable[[str], Sequence[int]]
) -> tuple[BenchRequest, ...]:
    return tuple(
        BenchRequest(
            prompt_token_ids=[int(t) for t in chat(exchange.messages)],
            max_tokens=len(encode(exchange.answer)) + ANSWER_MARGIN,
        )
        for exchange in exchanges
    )


def grounded_workload(
    chat: Chat, encode: Callable[[str], Sequence[int]], *, n: int = 24, seed: int = 0
) -> Workload:
    """``n`` input-grounded requests submitted at once (see the module's summary).

    Args:
        chat: The model's chat template, messages to prompt ids.
        encode: The model's tokenizer (sizes each answer).
        n: How many requests.
        seed: Fixes the passages each task starts from and the misspellings.

    Returns:
        The workload, offline (``arrival_times`` ``None``).

    Raises:
        ValueError: ``n`` < 1.
        ChatTemplateError: the model has no chat template.
    """
    requests = _requests(grounded_exchanges(n, seed=seed), chat, encode)
    return Workload(
        requests=requests,
        arrival_times=None,
        seed=seed,
        description=(
            f"input-grounded: {n} chat requests at once quoting or editing their prompt's "
            f"passage ({', '.join(GROUNDED_KINDS[:n])}), outputs sized to the answers "
            f"({min(r.max_tokens for r in requests)}-{max(r.max_tokens for r in requests)} "
            f"tokens), seed {seed}"
        ),
    )


# --- the agent trace ----------------------------------------------------------------------

_AGENT_SYSTEM = """\
You are a coding agent working in a repository. Act with exactly one tool call per turn, \
written alone on the first line:
read_file PATH
write_file PATH, followed by the whole new file in a ```python block
run_tests PATH
When the tests pass, answer with one line that starts with "Done:"."""

#: Bugs a session fixes, by file: (what the failing test says, the buggy line, the fix).
_BUGS: Mapping[str, tuple[tuple[str, str, str], ...]] = {
    "src/config.py": (
        (
            "test_values_keep_equals_signs fails: 'a=b' was split twice",
            'key, value = line.split("=")',
            'key, value = line.split("=", 1)',
        ),
        (
            "test_comments_are_skipped fails: KeyError '# note'",
            'if not line or line.startswith("//"):',
            'if not line or line.startswith("#"):',
        ),
    ),
    "src/units.py": (
        (
            "test_hours fails: parse_duration('2h') returned 120.0",
            'units = {"s": 1, "m": 60, "h": 60}',
            'units = {"s": 1, "m": 60, "h": 3600}',
        ),
        (
            "test_fractions fails: ValueError for '1.5m'",
            "return int(number) * units[unit]",
            "return float(number) * units[unit]",
        ),
    ),
    "src/stats.py": (
        (
            "test_window_of_one fails: the first average is missing",
            "total = sum(values[:window - 1])",
            "total = sum(values[:window])",
        ),
        (
            "test_running_total fails: the averages drift upwards",
            "total += values[index] + values[index - window]",
            "total += values[index] - values[index - window]",
        ),
    ),
    "src/names.py": (
        (
            "test_lower_case fails: slugify('Two Strokes') returned 'Two-Strokes'",
            "for word in title.split():",
            "for word in title.lower().split():",
        ),
        (
            "test_separator fails: slugify('a b') returned 'a_b'",
            'return "_".join(words)',
            'return "-".join(words)',
        ),
    ),
}


def _test_path(path: str) -> str:
    return path.replace("src/", "tests/test_")


def _session(path: str, bug: tuple[str, str, str]) -> list[Exchange]:
    """One session's four turns: read the file, write it fixed, run the tests, report."""
    failure, buggy, fixed = bug
    code = CODE[path]
    assert fixed in code, (path, fixed)
    broken = code.replace(fixed, buggy)
    calls = [
        f"read_file {path}",
        f"write_file {path}\n```python\n{code}```",
        f"run_tests {_test_path(path)}",
        f"Done: fixed {path} ({buggy.strip()} -> {fixed.strip()}); the tests pass.",
    ]
    results = [
        f"{failure}. Find the bug and fix it.",
        f"Tool result:\n```python\n{broken}```",
        f"Tool result: wrote {len(code.splitlines())} lines to {path}.",
        f"Tool result: {_test_path(path)}: all tests passed.",
    ]
    history: list[Mapping[str, str]] = [{"role": "system", "content": _AGENT_SYSTEM}]
    exchanges = []
    for turn, (result, call) in enumerate(zip(results, calls, strict=True)):
        history.append({"role": "user", "content": result})
        exchanges.append(Exchange(tuple(history), call, f"agent turn {turn + 1}"))
        history.append({"role": "assistant", "content": call})
    return exchanges


def agent_workload(
    chat: Chat, encode: Callable[[str], Sequence[int]], *, n: int = 32, seed: int = 0
) -> Workload:
    """The first ``n`` turns of a trace of agent sessions, submitted at once, in order.

    Each session fixes one bug in one of :data:`CODE`'s files in four turns (read, write
    the whole file back fixed, run the tests, report); the trace runs every (file, bug)
    pair in an order drawn from ``seed``, and again in another order when ``n`` asks for
    more. Each turn's prompt holds the session so far: the previous turns' calls as the
    assistant's messages, the tools' results as the user's. The file a session writes is
    the file it read with one line changed (prompt lookup finds it), and the same files,
    calls and reports recur across sessions (a trie over recent outputs finds those).

    Args:
        chat: The model's chat template, messages to prompt ids.
        encode: The model's tokenizer (sizes each answer).
        n: How many turns (requests).
        seed: Fixes the order of the sessions.

    Returns:
        The workload, offline (``arrival_times`` ``None``).

    Raises:
        ValueError: ``n`` < 1.
        ChatTemplateError: the model has no chat template.
    """
    if not is_int(n) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    pairs = [(path, bug) for path in sorted(_BUGS) for bug in _BUGS[path]]
    rng = random.Random(f"agent-{seed}")
    exchanges: list[Exchange] = []
    while len(exchanges) < n:
        order = rng.sample(pairs, len(pairs))
        for path, bug in order:
            exchanges.extend(_session(path, bug))
    requests = _requests(exchanges[:n], chat, encode)
    return Workload(
        requests=requests,
        arrival_times=None,
        seed=seed,
        description=(
            f"agent trace: {n} turns of coding-agent sessions at once (read, write back "
            f"fixed, run tests, report; the same files recur), outputs sized to the "
            f"answers ({min(r.max_tokens for r in requests)}-"
            f"{max(r.max_tokens for r in requests)} tokens), seed {seed}"
        ),
    )
