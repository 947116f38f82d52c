"""Sampling parameters: what a caller asks of one request, validated at construction.

Every rule is enforced by a validator, never by ``assert``: a value out of range raises
``ValueError`` naming the field, the rule and the value; a value of the wrong type raises
``TypeError``. The names and defaults follow vLLM's ``SamplingParams`` so that people who
know one know the other; where vLLM uses a ``-1`` sentinel (``top_k``) we use ``None``.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from twostroke.states.constraints import Constraint, check_constraint
from twostroke.states.validators import boolean, check_int_at_least, int_at_least, int_in, number_in

__all__ = [
    "MAX_LOGPROBS",
    "MAX_PRIORITY",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_LENGTH",
    "MAX_STOP_TOKEN_IDS",
    "MIN_PRIORITY",
    "SamplingParams",
    "check_params",
]

#: The most alternatives a request may ask log-probabilities for (vLLM's default cap).
MAX_LOGPROBS = 20
#: The most stop strings one request may have. OpenAI's API takes 4; chat templates and
#: few-shot prompts use a handful more. Every one is matched against the text at every token.
MAX_STOP_STRINGS = 16
#: The longest stop string, in characters. A stop string is a marker (``"</answer>"``,
#: ``"\n\nUser:"``), not a document; the streamed text is held back by up to this many
#: characters while it could still be the start of one.
MAX_STOP_STRING_LENGTH = 256
#: The most stop token ids one request may have: every sampled token is looked up in them.
#: Far more than any model's end-of-turn tokens.
MAX_STOP_TOKEN_IDS = 128
#: The range of ``priority`` (vLLM's meaning: lower runs first). Bounded so that the
#: scheduler's aging bound is a number of steps worth stating: a request is passed by newer
#: ones only while it has waited fewer than ``priority_aging_steps`` steps per level of
#: priority between them (see :class:`~twostroke.states.scheduler.Scheduler`).
MIN_PRIORITY = -1000
MAX_PRIORITY = 1000
#: The longest ``cache_ttl``, in seconds: an hour, the longest prompt-cache lifetime
#: Anthropic's API offers.
MAX_CACHE_TTL = 3600.0
_MAX_SEED = 2**63


def _stop_strings(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Iterable):
        raise TypeError(f"stop must be a string or a sequence of strings, got {value!r}")
    strings = tuple(value)
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"stop must hold <= {MAX_STOP_STRINGS} strings, got {len(strings)}")
    for item in strings:
        if not isinstance(item, str):
            raise TypeError(f"stop must contain only strings, got {type(item).__name__} {item!r}")
        if not item:
            raise ValueError("stop strings must be non-empty, got ''")
        if len(item) > MAX_STOP_STRING_LENGTH:
            raise ValueError(
                f"stop strings must be <= {MAX_STOP_STRING_LENGTH} characters long, "
                f"got one of {len(item)}"
            )
    return strings


def _token_ids(value: object) -> tuple[int, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise TypeError(f"stop_token_ids must be a sequence of ints, got {value!r}")
    ids = tuple(value)
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids must hold <= {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
    for item in ids:
        check_int_at_least("stop_token_ids", item, 0)
    return ids


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to sample one request's output, and when to stop.

    Args:
        max_tokens: The most tokens to generate (>= 1; 16 by default, the one place this
            default is written). The request finishes with reason ``length`` when it reaches
            this many. ``None``: as many as the context leaves after the prompt
            (``max_model_len`` minus the prompt's tokens, at least 1), as vLLM's ``None``
            and OpenAI's chat completions without one; the engine sets the number when the
            prompt is tokenized.
        min_tokens: Stop tokens and EOS are ignored until this many tokens exist (at most
            ``max_tokens`` when that is a number).
        temperature: 0 means greedy; higher flattens the distribution.
        top_k: Keep only the k most likely tokens (``None`` keeps all).
        top_p: Keep the smallest set of tokens whose probability reaches ``top_p``.
        min_p: Drop tokens less likely than ``min_p`` times the most likely one.
        seed: Makes sampling reproducible for this request whatever else is batched with it.
        stop: Strings that end the output; they are not included unless
            ``include_stop_str_in_output``. At most :data:`MAX_STOP_STRINGS` of them, each
            of at most :data:`MAX_STOP_STRING_LENGTH` characters.
        stop_token_ids: Token ids that end the output (in addition to the model's EOS); at
            most :data:`MAX_STOP_TOKEN_IDS`. The engine checks each against its vocabulary
            when the request is submitted.
        ignore_eos: Keep generating past the model's EOS token (benchmarks use this).
        repetition_penalty: Divides the logits of tokens already seen (prompt and output)
            when positive, multiplies them when negative; 1 disables it.
        presence_penalty: Subtracted once from the logit of every token already generated.
        frequency_penalty: Subtracted from a token's logit once per time it was generated.
        logprobs: Return the log-probability of each chosen token and of this many top
            alternatives (``None`` returns none).
        include_stop_str_in_output: Keep the matched stop string at the end of the text.
        constraint: What the output must be (a JSON schema, any JSON object, a regular
            expression, a choice or a grammar; see :mod:`twostroke.states.constraints`), or
            ``None``. Whether the backend can enforce it is checked when it is compiled.
        priority: When the request runs, against the others waiting: lower runs first (vLLM's
            ``priority``, default 0), arrival order among equals, with aging: a request
            that has waited ``priority_aging_steps`` steps counts as one level better, so
            none waits forever. An int in [:data:`MIN_PRIORITY`, :data:`MAX_PRIORITY`]. It
            never changes the output, only when it comes.
        cache_ttl: Seconds to keep the request's KV pinned in the prefix cache once it
            finishes (its prompt's and output's full blocks), so that a continuation of the
            conversation prefills only what is new (a stored Response's next turn): pinned
            blocks are not evicted for other requests' cached blocks, and go back to the
            pool when the time is up or as soon as a request needs the room, oldest first,
            so a pin never delays anyone. 0 (the default) pins nothing; at most
            :data:`MAX_CACHE_TTL`. Without prefix caching it does nothing. It never
            changes the output.

    Raises:
        TypeError: a value of the wrong type.
        ValueError: a value outside its range; the message names the field and the rule.
    """

    max_tokens: int | None = attrs.field(default=16, validator=int_at_least(1, optional=True))
    min_tokens: int = attrs.field(default=0, validator=int_at_least(0))
    temperature: float = attrs.field(default=1.0, validator=number_in(0))
    top_k: int | None = attrs.field(
        default=None, validator=int_at_least(1, optional=True, note=" (or None to disable)")
    )
    top_p: float = attrs.field(default=1.0, validator=number_in(0, 1, low_open=True))
    min_p: float = attrs.field(default=0.0, validator=number_in(0, 1))
    seed: int | None = attrs.field(
        default=None, validator=int_in(0, _MAX_SEED, high_open=True, optional=True)
    )
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop_strings)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_token_ids)
    ignore_eos: bool = attrs.field(default=False, validator=boolean)
    repetition_penalty: float = attrs.field(
        default=1.0, validator=number_in(0, low_open=True, note=" (1 disables it)")
    )
    presence_penalty: float = attrs.field(default=0.0, validator=number_in(-2, 2))
    frequency_penalty: float = attrs.field(default=0.0, validator=number_in(-2, 2))
    logprobs: int | None = attrs.field(
        default=None, validator=int_in(0, MAX_LOGPROBS, optional=True, note=" (or None)")
    )
    include_stop_str_in_output: bool = attrs.field(default=False, validator=boolean)
    constraint: Constraint | None = attrs.field(default=None, validator=check_constraint)
    priority: int = attrs.field(default=0, validator=int_in(MIN_PRIORITY, MAX_PRIORITY))
    cache_ttl: float = attrs.field(default=0.0, validator=number_in(0, MAX_CACHE_TTL))

    def __attrs_post_init__(self) -> None:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"and max_tokens={self.max_tokens}"
            )

    @property
    def greedy(self) -> bool:
        """Whether sampling reduces to taking the most likely token."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """Whether any history-dependent penalty is active."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


#: What a submit without parameters gets: one frozen value, shared (not made per submit).
_DEFAULT_PARAMS = SamplingParams()


def check_params(params: SamplingParams | None) -> SamplingParams:
    """The parameters a submit gets: ``SamplingParams()`` for ``None``, checked otherwise.

    Every surface's ``submit`` (the engine's and the coordinator's) asks this first, before
    anything is queued.

    Raises:
        TypeError: ``params`` is not a :class:`SamplingParams`.
    """
    if params is None:
        return _DEFAULT_PARAMS
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    return params
