"""A model-free engine for tests and examples: the toy runner and a byte tokenizer.

``Engine.open(model="toy")`` runs the real engine, scheduler and strokes over
:class:`ToyRunner`, so applications can test how they embed twostroke without loading a
model. The toy runner keeps a paged "KV cache" of token ids
(:class:`twostroke.states.simulation.SimulatedKV`) and its next token is a pure function of the
request's whole sequence *as read back through its block table*: scheduling bugs show up as
wrong text, and the same prompt always gives the same output.

A constrained request's token is chosen among the ones its mask allows (``choose``, by
default :func:`toy_text_choose`). The toy never blocks for masks: a step whose masks are not
filled when it is launched (the lookahead: they depend on the step before's tokens) is
computed once they are, when it is read back or when the next step is launched, whichever
comes first; the engine fills them before either can happen.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from twostroke.engine.structured.masks import StepMasks
from twostroke.engine.text.chat import validate_messages
from twostroke.engine.text.chat_template import check_template_kwargs
from twostroke.gpu.completion import Launched, ReadyEvent
from twostroke.states.constraints import read_bitmask
from twostroke.states.plan import RunnerOutput, StepPlan, TokenLogprobs
from twostroke.states.simulation import ChooseToken, NextToken, SimulatedKV, toy_next_token

__all__ = ["ByteTokenizer", "ToyRunner", "toy_text_choose", "toy_text_next_token"]

#: The toy model writes lowercase words.
_ALPHABET = b"abcdefghijklmnopqrstuvwxyz   "
EOS_TOKEN_ID = 256


def toy_text_next_token(token_ids: Sequence[int], *, eos_rate: float = 0.02) -> int:
    """The toy model: a letter or a space, or EOS with probability about ``eos_rate``."""
    value = toy_next_token(token_ids, vocab_size=1_000_003)
    if value % 10_000 < eos_rate * 10_000:
        return EOS_TOKEN_ID
    return _ALPHABET[value % len(_ALPHABET)]


def toy_text_choose(token_ids: Sequence[int], allowed: frozenset[int]) -> int:
    """The toy model under a constraint: EOS half of the time where it is allowed, else one
    of the allowed tokens by a hash of the sequence (nothing allowed: the unconstrained toy)."""
    if not allowed:
        return toy_text_next_token(token_ids)
    value = toy_next_token(token_ids, vocab_size=1_000_003)
    if EOS_TOKEN_ID in allowed and value % 2:
        return EOS_TOKEN_ID
    ordered = sorted(allowed)
    return ordered[(value >> 1) % len(ordered)]


class _MasksEvent:
    """Fires once a deferred step's masks are filled (the step is computed on readback)."""

    def __init__(self, masks: StepMasks) -> None:
        self._masks = masks

    def query(self) -> bool:
        return self._masks.ready


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, and 256 as EOS: the toy runner's tokenizer."""

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({EOS_TOKEN_ID})

    @property
    def vocab_size(self) -> int:
        return EOS_TOKEN_ID + 1

    @property
    def max_token_chars(self) -> int:
        """One: a byte is at most one character."""
        return 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(i for i in token_ids if i < EOS_TOKEN_ID).decode("utf-8", errors="replace")

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes (EOS's is its name): what structured output builds its trie from."""
        return [bytes([i]) for i in range(EOS_TOKEN_ID)] + [b"<eos>"]

    def special_token_ids(self) -> frozenset[int]:
        """EOS, the one token that is not text."""
        return frozenset({EOS_TOKEN_ID})

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Bytes of ``<role>content`` lines, then ``<assistant>`` (a template of its own).

        ``template_kwargs`` are checked as a real template's are, and read by none of its
        (a template need not read every variable it is given).

        Raises:
            TypeError, ValueError: ``messages`` is malformed; the same check as the real
                tokenizer's (:func:`~twostroke.engine.text.chat.validate_messages`).
            ChatTemplateKwargsError: ``template_kwargs`` breaks a rule of
                :func:`~twostroke.engine.text.chat_template.check_template_kwargs`.
        """
        check_template_kwargs(template_kwargs)
        conversation = validate_messages(messages)
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in conversation) + "<assistant>"
        return self.encode(text)


class ToyRunner:
    """A deterministic model runner with no model (see the module docstring).

    Args:
        max_model_len: Context length it claims.
        eos_rate: Roughly how often it emits EOS (0 never does).
        latency: Seconds each step takes, slept in the worker thread (demos only; tests
            use ``FakeDevice`` virtual time instead).
        fail_when: Called with each plan; if it returns true the step raises
            ``RuntimeError`` (to test failure handling).
        choose: The model under a constraint: the sequence and the allowed ids to the next
            id (default :func:`toy_text_choose`).
        next_token: The model: the whole sequence to the next id (default
            :func:`toy_text_next_token` at ``eos_rate``), e.g. one that repeats its input,
            to see speculative decoding's drafts accepted.
    """

    def __init__(
        self,
        *,
        max_model_len: int = 4096,
        eos_rate: float = 0.02,
        latency: float = 0.0,
        fail_when: Callable[[StepPlan], bool] | None = None,
        choose: ChooseToken = toy_text_choose,
        next_token: NextToken | None = None,
    ) -> None:
        if not 0 <= eos_rate <= 1:
            raise ValueError(f"eos_rate must be in [0, 1], got {eos_rate}")
        if latency < 0:
            raise ValueError(f"latency must be >= 0, got {latency}")
        self._max_model_len = max_model_len
        self._eos_rate = eos_rate
        self._latency = latency
        self._fail_when = fail_when
        self._choose = choose
        self._model = next_token
        self._kv: SimulatedKV | None = None
        # A launched step whose masks were not filled yet, and outputs not read back yet.
        self._lock = threading.Lock()
        self._deferred: tuple[StepPlan, StepMasks] | None = None
        self._outputs: dict[int, RunnerOutput] = {}
        self.num_steps = 0

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def deterministic(self) -> bool:
        """Always: a sequence's next token is a function of that sequence alone."""
        return True

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        # One Python slot per position; a notional size so memory budgets mean something.
        return 64 * block_size

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._kv = SimulatedKV(num_blocks, block_size, self._next_token, self._choose)

    def _next_token(self, token_ids: Sequence[int]) -> int:
        if self._model is not None:
            return self._model(token_ids)
        return toy_text_next_token(token_ids, eos_rate=self._eos_rate)

    def execute(self, plan: StepPlan) -> Launched[RunnerOutput]:
        """Run one step without constraints."""
        return self.execute_masked(plan, None)

    def execute_masked(self, plan: StepPlan, masks: StepMasks | None) -> Launched[RunnerOutput]:
        """Run one step whose constrained rows sample under ``masks``.

        Never blocks: with masks not filled yet, the step is computed when they are (see
        the module docstring), and its event fires then.
        """
        if self._kv is None:
            raise RuntimeError("allocate_kv_cache must be called before the first step")
        with self._lock:
            self._settle()  # the step before, if deferred: its masks are filled by now
            self.num_steps += 1
            if self._fail_when is not None and self._fail_when(plan):
                raise RuntimeError(f"injected failure in step {plan.step_id}")
            if self._latency:
                time.sleep(self._latency)
            if masks is None or masks.ready:
                output = self._run(self._kv, plan, masks)
                return Launched(event=ReadyEvent(), readback=lambda: output)
            self._deferred = (plan, masks)
        step_id = plan.step_id
        return Launched(event=_MasksEvent(masks), readback=lambda: self._read(step_id))

    def _settle(self) -> None:
        if self._deferred is None:
            return
        assert self._kv is not None
        plan, masks = self._deferred
        self._deferred = None
        masks.wait()  # filled already (the engine fills them before this can run)
        self._outputs[plan.step_id] = self._run(self._kv, plan, masks)

    def _read(self, step_id: int) -> RunnerOutput:
        with self._lock:
            if step_id not in self._outputs:
                # Then the deferred step is this one, and its event fired: its masks are
                # filled. Another step deferred since (launched after this one was computed)
                # is left alone: its masks may not be filled yet, and this is the event
                # loop's thread, which fills them.
                self._settle()
            return self._outputs.pop(step_id)

    def _run(self, kv: SimulatedKV, plan: StepPlan, masks: StepMasks | None) -> RunnerOutput:
        allowed: dict[int, tuple[frozenset[int], ...]] | None = None
        if masks is not None:
            bitmask = masks.wait()
            allowed = {
                entry.request_id: tuple(
                    read_bitmask(bitmask[masks.rows[entry.request_id] + offset].numpy().data)
                    for offset in range(entry.num_samples)
                )
                for entry in plan.requests
                if entry.sample and entry.request_id in masks.rows
            }
        outcome = kv.execute(plan, allowed)
        # The toy is certain of every token it picks: log-probability 0.
        logprobs: dict[int, TokenLogprobs] = {}
        speculated_logprobs: dict[int, tuple[TokenLogprobs, ...]] = {}
        for entry in plan.requests:
            if not entry.sample or entry.params.logprobs is None:
                continue
            certain = [TokenLogprobs(t, 0.0, ((t, 0.0),)) for t in outcome.tokens(entry.request_id)]
            logprobs[entry.request_id] = certain[0]
            if entry.draft_token_ids:
                speculated_logprobs[entry.request_id] = tuple(certain[1:])
        return RunnerOutput(
            step_id=plan.step_id,
            sampled=outcome.sampled,
            logprobs=logprobs,
            speculated=outcome.speculated,
            speculated_logprobs=speculated_logprobs,
        )
