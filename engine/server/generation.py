"""Running one OpenAI request as engine requests: one per choice, collected or streamed.

A completion with ``n`` choices over ``p`` prompts is ``n * p`` independent engine requests.
Every one of them is *settled* when the HTTP request ends, however it ends: cancelled if it
is still open, then awaited (under a shield, it ends within one step) so that its outcome is
counted exactly once: finished (with its timings), aborted by the server, or failed.

Prompts go to the engine as the body gives them (text, token ids or chat messages), through
its ``prepare``: an engine renders and tokenizes each once, in a worker thread (never on the
event loop, which serves every other request), and a coordinator hands it as given to its
replica, which does. The engine's refusals (a prompt too long for the context, token ids
outside the vocabulary, a chat template's) become 400s here, from ``prepare`` or ``submit``
or, behind a coordinator's remote replicas, from the handle.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import anyio
import attrs

from twostroke.engine.errors import (
    ConstraintFailed,
    ConstraintRejected,
    EngineError,
    RequestCancelled,
    RequestRejected,
)
from twostroke.engine.handle import RequestHandle
from twostroke.engine.outputs import Delta, RequestOutput
from twostroke.engine.server.errors import ApiError, api_error_from, invalid_request
from twostroke.engine.server.metrics import ServerMetrics
from twostroke.engine.server.reasoning import ChoiceReasoning
from twostroke.engine.server.sse import Disconnected, EventSender
from twostroke.engine.server.structured import ToolCalls, constraint_error, constraint_failure
from twostroke.engine.surface import EngineSurface
from twostroke.engine.text.reasoning import ReasoningFormat
from twostroke.engine.tools.parser import CallStarted, TextDelta, ToolCallParser, ToolEvent
from twostroke.states.params import SamplingParams
from twostroke.states.plan import TokenLogprobs
from twostroke.states.prompts import Prompt

__all__ = ["ChatFormat", "Choice", "CompletionFormat", "Generation", "Submission"]

logger = logging.getLogger("twostroke.server")


@attrs.define(eq=False)
class Choice:
    """One engine request behind one choice of the response."""

    index: int
    prompt_index: int
    handle: RequestHandle
    num_tokens: int = 0  # output tokens delivered so far
    text_offset: int = 0  # characters of text delivered so far (completion logprobs)


class Format(Protocol):
    """The JSON shapes of one endpoint (completions or chat)."""

    object_name: str
    chunk_object_name: str

    def opening(self, index: int) -> dict[str, Any] | None: ...

    async def begin(self, choice: Choice) -> None: ...

    def choice(
        self, index: int, text: str, logprobs: Any, finish_reason: str | None, *, chunk: bool
    ) -> dict[str, Any]: ...

    def chunks(
        self, index: int, text: str, logprobs: Any, finish_reason: str | None
    ) -> list[dict[str, Any]]: ...

    async def logprobs(
        self, choice: Choice, entries: Sequence[TokenLogprobs], text: str
    ) -> Any: ...


class Submission:
    """The engine requests of one HTTP request: submitted, collected, and settled.

    Args:
        engine: The engine surface.
        metrics: Where outcomes are counted.
        prompt_field: The body's field that holds the prompts (``prompt``, ``messages``).
        max_tokens_field: The body's field that set the most tokens to generate.
        constraint_field: The body's field that constrained the output, if one did: the
            constraint's refusal (:class:`ConstraintRejected`, from ``submit`` or, once the
            engine compiled it, from the handle) is a 400 naming it.
    """

    def __init__(
        self,
        engine: EngineSurface,
        metrics: ServerMetrics,
        *,
        prompt_field: str = "prompt",
        max_tokens_field: str = "max_tokens",
        constraint_field: str | None = None,
    ) -> None:
        self._engine = engine
        self._metrics = metrics
        self._prompt_field = prompt_field
        self._max_tokens_field = max_tokens_field
        self._constraint_field = constraint_field
        self.choices: list[Choice] = []

    async def submit(
        self,
        prompts: Sequence[Prompt],
        params: Sequence[SamplingParams],
        check_room: Callable[[int], None],
    ) -> None:
        """Submit every choice: ``len(params)`` per prompt, indexed prompt-major.

        Each prompt is prepared once (:meth:`EngineSurface.prepare`: an engine renders and
        tokenizes it in a worker thread, a coordinator leaves it to its replica), then
        ``check_room`` is asked again for all the choices (other requests came in while the
        prompts were prepared) and every choice is submitted in one synchronous run, so
        they are queued whole or not at all. Cancelled while preparing, it queues nothing.

        Args:
            prompts: The body's prompts.
            params: One sampling parameters per choice of each prompt.
            check_room: Refuses ``count`` more engine requests when the waiting queue cannot
                take them (an ``EngineOverloaded``); asked by the caller before this too,
                before any prompt is prepared.

        Raises:
            ApiError: the engine refused a prompt (:meth:`error`).
            EngineOverloaded, EngineDead, EngineClosed: from the engine, or ``check_room``.

        Choices already submitted stay in :attr:`choices` to be settled.
        """
        prepared = []
        for prompt in prompts:
            try:
                prepared.append(await self._engine.prepare(prompt))
            except (TypeError, ValueError) as exc:
                raise self.error(exc) from None
        check_room(len(prompts) * len(params))  # nothing awaits from here to the last submit
        for prompt_index, prompt in enumerate(prepared):
            for choice_params in params:
                try:
                    handle = self._engine.submit(prompt, choice_params)
                except (TypeError, ValueError) as exc:
                    raise self.error(exc) from None
                self.choices.append(Choice(len(self.choices), prompt_index, handle))

    def error(self, exc: BaseException) -> ApiError:
        """The answer to an error of one of this request's choices.

        The engine's refusals are 400s: a prompt too long for the context in OpenAI's words
        (naming the field that set ``max_tokens``), any other ``TypeError`` or ``ValueError``
        naming the prompt's field (a malformed prompt, a token id outside the vocabulary).
        A refused constraint names the field that set it, and so does one whose backend gave
        up partway through the output (:class:`ConstraintFailed`, a 400 too).
        """
        if isinstance(exc, ConstraintRejected):
            return constraint_error(self._constraint_field, exc)
        if isinstance(exc, ConstraintFailed):
            return constraint_failure(self._constraint_field, exc)
        if isinstance(exc, RequestRejected):
            return api_error_from(exc, max_tokens_field=self._max_tokens_field)
        if isinstance(exc, TypeError | ValueError):
            return invalid_request(str(exc), param=self._prompt_field)
        return api_error_from(exc)

    async def settle(self) -> None:
        """Cancel what is still open and count every outcome once. Shielded; always returns."""
        with anyio.CancelScope(shield=True):
            for choice in self.choices:
                choice.handle.cancel()
            for choice in self.choices:
                try:
                    output = await choice.handle.result()
                except RequestCancelled:
                    self._metrics.ended_early("abort", choice.num_tokens)
                except (TypeError, ValueError):  # RequestRejected too
                    continue  # a remote replica refused it: never served, as with submit's
                except EngineError:
                    self._metrics.ended_early("error", choice.num_tokens)
                else:
                    self._metrics.finished(output)
                # Known once the engine tokenized the prompt (a remote replica's: once it
                # accepted the request, which it reports before the request's end).
                self._metrics.submitted(len(choice.handle.prompt_token_ids))
            self.choices = []

    async def collect(self) -> list[RequestOutput]:
        """Wait for every choice's output.

        Raises:
            ApiError: a remote replica refused a choice, or its constraint failed partway
                (:meth:`error`).
            RequestFailed, EngineDead, EngineClosed: a choice failed.
        """
        outputs = []
        for choice in self.choices:
            try:
                output = await choice.handle.result()
            except (TypeError, ValueError, ConstraintFailed) as exc:
                raise self.error(exc) from None
            choice.num_tokens = len(output.token_ids)
            outputs.append(output)
        return outputs


class Generation(Submission):
    """The engine requests of one OpenAI request, and how to answer with them.

    Args:
        engine: The engine surface.
        metrics: Where outcomes are counted.
        fmt: The endpoint's JSON shapes.
        keepalive: Seconds of silence on a stream before a keep-alive comment goes out.
        prompt_field: The body's field that holds the prompts (``prompt``, ``messages``).
        max_tokens_field: The body's field that set the most tokens to generate.
        constraint_field: The body's field that constrained the output, if one did (see
            :class:`Submission`); a stream then waits for the first output (or refusal)
            before it answers.
    """

    def __init__(
        self,
        engine: EngineSurface,
        metrics: ServerMetrics,
        fmt: Format,
        *,
        keepalive: float,
        prompt_field: str = "prompt",
        max_tokens_field: str = "max_tokens",
        constraint_field: str | None = None,
    ) -> None:
        super().__init__(engine, metrics, prompt_field=prompt_field,
                         max_tokens_field=max_tokens_field,
                         constraint_field=constraint_field)  # fmt: skip
        self._fmt = fmt
        self._keepalive = keepalive
        self.id = f"{'chatcmpl' if fmt.object_name == 'chat.completion' else 'cmpl'}-"
        self.id += uuid.uuid4().hex
        self.created = int(time.time())

    async def submit(
        self,
        prompts: Sequence[Prompt],
        params: Sequence[SamplingParams],
        check_room: Callable[[int], None],
    ) -> None:
        """:meth:`Submission.submit`, then each choice shown to the format (a reasoning
        parser reads its prompt's tail)."""
        await super().submit(prompts, params, check_room)
        for choice in self.choices:
            await self._fmt.begin(choice)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        model = self._engine.model_name
        return {"id": self.id, "object": obj, "created": self.created, "model": model,
                "choices": choices}  # fmt: skip

    def _usage(self, outputs: Sequence[RequestOutput], completion_tokens: int) -> dict[str, Any]:
        """OpenAI's ``usage``: each prompt counts once, however many choices it has."""
        prompts = {c.prompt_index: o.usage for c, o in zip(self.choices, outputs, strict=True)}
        prompt_tokens = sum(usage.prompt_tokens for usage in prompts.values())
        cached = max((output.usage.cached_prompt_tokens for output in outputs), default=0)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # --- a complete response -----------------------------------------------------------

    async def response(self, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
        """The JSON body of a complete response."""
        choices = []
        for choice, output in zip(self.choices, outputs, strict=True):
            logprobs = None
            if output.logprobs is not None:
                logprobs = await self._fmt.logprobs(choice, output.logprobs, output.text)
            reason = str(output.finish_reason)
            choices.append(self._fmt.choice(choice.index, output.text, logprobs, reason,
                                            chunk=False))  # fmt: skip
        body = self._envelope(self._fmt.object_name, choices)
        body["usage"] = self._usage(outputs, sum(len(output.token_ids) for output in outputs))
        return body

    # --- a streamed response -----------------------------------------------------------

    async def stream(self, sender: EventSender, *, include_usage: bool) -> None:
        """Stream every choice as SSE chunks, then the usage chunk if asked, then ``[DONE]``.

        An error after the stream started goes out as an ``error`` event before ``[DONE]``.
        A constrained request's stream starts with its first output (or keep-alive), so that
        a constraint the engine refuses once it compiled it is still a plain 400.

        Raises:
            Disconnected: a send to the client failed.
            ApiError: (constrained only) the first thing a choice reported was an error.
        """
        usage_field: dict[str, Any] = {"usage": None} if include_usage else {}
        obj = self._fmt.chunk_object_name
        opened = self._constraint_field is None
        if opened:
            await self._open(sender, usage_field)
        events, received = anyio.create_memory_object_stream[dict[str, Any] | ApiError](
            len(self.choices)
        )
        failure: ApiError | None = None
        disconnected = False
        async with anyio.create_task_group() as task_group:
            async with events:
                for choice in self.choices:
                    task_group.start_soon(self._pump, choice, events.clone())
            async with received:
                try:
                    failure, opened = await self._relay(sender, received, usage_field, opened)
                except Disconnected:  # raised below, outside the task group
                    disconnected = True
                task_group.cancel_scope.cancel()
        if disconnected:
            raise Disconnected
        if not opened:
            if failure is not None:
                raise failure  # nothing was sent: the answer is the error itself
            await self._open(sender, usage_field)
        if failure is not None:
            await sender.data(failure.body())
        elif include_usage:
            completion_tokens = sum(choice.num_tokens for choice in self.choices)
            # Every choice has ended without error here, so each result is at hand.
            outputs = [await choice.handle.result() for choice in self.choices]
            usage = self._envelope(obj, []) | {"usage": self._usage(outputs, completion_tokens)}
            await sender.data(usage)
        await sender.done()

    async def _open(self, sender: EventSender, usage_field: dict[str, Any]) -> None:
        """Start the response: its headers, then each choice's opening chunk (chat's role)."""
        await sender.start()
        obj = self._fmt.chunk_object_name
        for choice in self.choices:
            opening = self._fmt.opening(choice.index)
            if opening is not None:
                await sender.data(self._envelope(obj, [opening]) | usage_field)

    async def _relay(
        self, sender: EventSender, received: Any, usage_field: dict[str, Any], opened: bool
    ) -> tuple[ApiError | None, bool]:
        """Send the pumps' chunks as they come, a keep-alive comment when none comes.

        Opens the response first if ``opened`` is false, unless the first item is an error.
        Returns the error that ended the stream, if any, and whether the response is open.
        """
        obj = self._fmt.chunk_object_name
        while True:
            with anyio.move_on_after(self._keepalive) as timer:
                try:
                    item = await received.receive()
                except anyio.EndOfStream:
                    return None, opened
            if not timer.cancelled_caught and isinstance(item, ApiError):
                return item, opened
            if not opened:
                await self._open(sender, usage_field)
                opened = True
            if timer.cancelled_caught:
                await sender.comment("keep-alive")
            else:
                await sender.data(self._envelope(obj, [item]) | usage_field)

    async def _pump(self, choice: Choice, events: Any) -> None:
        """Turn one choice's deltas into chunk payloads (or one ``ApiError``)."""
        async with events:
            last: float | None = None
            try:
                async for delta in choice.handle:
                    now = anyio.current_time()
                    if last is not None:
                        self._metrics.streamed(now - last, len(delta.token_ids))
                    last = now
                    for payload in await self._chunks(choice, delta):
                        await events.send(payload)
            except anyio.BrokenResourceError:
                return  # the relay stopped: the stream is over
            except Exception as exc:
                error = self.error(exc)
                if error.status >= 500 and not isinstance(exc, EngineError):
                    logger.exception("choice %d of %s failed", choice.index, self.id)
                with contextlib.suppress(anyio.BrokenResourceError):
                    await events.send(error)

    async def _chunks(self, choice: Choice, delta: Delta) -> list[dict[str, Any]]:
        """A delta's chunk payloads: one, or with tools as many as its pieces (none while
        text that could start a call is held back)."""
        choice.num_tokens += len(delta.token_ids)
        logprobs = None
        if delta.logprobs is not None:
            logprobs = await self._fmt.logprobs(choice, delta.logprobs, delta.text)
        reason = None if delta.finish_reason is None else str(delta.finish_reason)
        payloads = self._fmt.chunks(choice.index, delta.text, logprobs, reason)
        choice.text_offset += len(delta.text)
        return payloads


class _TokenTexts:
    """Token ids to their text, through the engine (cached per response)."""

    def __init__(self, engine: EngineSurface) -> None:
        self._engine = engine
        self._texts: dict[int, str] = {}

    async def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = await self._engine.detokenize([token_id])
        return text


class CompletionFormat:
    """``/v1/completions``: ``text`` choices, logprobs as four parallel lists."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, engine: EngineSurface, top_logprobs: int) -> None:
        self._texts = _TokenTexts(engine)
        self._top = top_logprobs

    def opening(self, index: int) -> dict[str, Any] | None:
        return None

    async def begin(self, choice: Choice) -> None:
        pass  # a completion's text is all answer

    def choice(
        self, index: int, text: str, logprobs: Any, finish_reason: str | None, *, chunk: bool
    ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason}  # fmt: skip

    def chunks(
        self, index: int, text: str, logprobs: Any, finish_reason: str | None
    ) -> list[dict[str, Any]]:
        return [self.choice(index, text, logprobs, finish_reason, chunk=True)]

    async def logprobs(
        self, choice: Choice, entries: Sequence[TokenLogprobs], text: str
    ) -> dict[str, Any]:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        offset = choice.text_offset
        for entry in entries:
            token = await self._texts(entry.token_id)
            tokens.append(token)
            token_logprobs.append(entry.logprob)
            tops.append({await self._texts(t): lp for t, lp in entry.top[: self._top]})
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}  # fmt: skip


class ChatFormat:
    """``/v1/chat/completions``: ``message`` / ``delta`` choices, logprobs per token.

    With tools, an output is read as text and calls (:class:`ToolCalls`): a complete answer
    carries its complete calls as ``message.tool_calls`` (``content`` the text before them,
    or ``null``) with ``finish_reason`` ``"tool_calls"``; a call that ``max_tokens`` cut is
    dropped, none of its text in ``content``, and the reason is ``"length"`` only where no
    call is complete (:meth:`ToolCalls.finish_reason` says why). A stream sends text as
    ``content`` deltas until the trigger (none of which reaches them), then each complete
    call as OpenAI streams one: a delta with its ``index``, ``id``, ``type`` and
    ``function.name`` (``arguments`` ``""``), then a delta of its ``arguments``, whole (a
    call is sent once its JSON is closed, so a stream never sends a call that the complete
    answer drops); its last chunk's ``finish_reason`` is the complete answer's.

    With a reasoning parser (:class:`~twostroke.engine.server.reasoning.ChoiceReasoning`),
    the reasoning goes apart as ``message.reasoning_content`` (``null`` where the output did
    not reason) or ``delta.reasoning_content``; ``content`` and the calls are read from the
    answer after it.
    """

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(
        self,
        engine: EngineSurface,
        top_logprobs: int,
        tool_calls: ToolCalls | None = None,
        reasoning: ReasoningFormat | None = None,
    ) -> None:
        self._texts = _TokenTexts(engine)
        self._top = top_logprobs
        self._tool_calls = tool_calls
        self._parsers: dict[int, ToolCallParser] = {}
        self._reasoning = None if reasoning is None else ChoiceReasoning(reasoning, engine)

    async def begin(self, choice: Choice) -> None:
        if self._reasoning is not None:
            await self._reasoning.begin(choice.index, choice.handle.prompt_token_ids)

    def opening(self, index: int) -> dict[str, Any] | None:
        # With tools, an answer may have no text at all (``content`` null, as the complete
        # answer says): the opening delta must not make the SDK's accumulator hold "".
        content = None if self._tool_calls is not None else ""
        return {"index": index, "delta": {"role": "assistant", "content": content},
                "logprobs": None, "finish_reason": None}  # fmt: skip

    def choice(
        self, index: int, text: str, logprobs: Any, finish_reason: str | None, *, chunk: bool
    ) -> dict[str, Any]:
        if chunk:
            content: dict[str, Any] = {"delta": {"content": text} if text else {}}
        else:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self._reasoning is not None:
                split = self._reasoning.split(index, text)
                message["reasoning_content"] = split.reasoning
                message["content"] = text = split.content
            tools = self._tool_calls
            if tools is not None:
                parsed = tools.read(text)
                message["content"] = tools.content(parsed)
                if parsed.calls:  # as OpenAI answers
                    message["tool_calls"] = [call.openai() for call in parsed.calls]
                assert finish_reason is not None  # a complete answer has ended
                finish_reason = tools.finish_reason(parsed, finish_reason)
            content = {"message": message}
        return {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunks(
        self, index: int, text: str, logprobs: Any, finish_reason: str | None
    ) -> list[dict[str, Any]]:
        thought = ""
        if self._reasoning is not None:
            split = self._reasoning.feed(index, text, finished=finish_reason is not None)
            thought, text = split.reasoning, split.content
        if self._tool_calls is None:
            payload = self.choice(index, text, logprobs, finish_reason, chunk=True)
            if thought:
                payload["delta"] = {"reasoning_content": thought, **payload["delta"]}
            return [payload]
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = ToolCallParser(self._tool_calls.format)
        events = parser.feed(text)
        if finish_reason is not None:
            events += parser.finish()
            finish_reason = self._tool_calls.finish_reason(parser.result(), finish_reason)
        deltas = _deltas(events)
        if thought:
            deltas.insert(0, {"reasoning_content": thought})
        if finish_reason is not None or logprobs is not None:
            deltas = deltas or [{}]
        payloads: list[dict[str, Any]] = [
            {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
            for delta in deltas
        ]
        if payloads:
            payloads[0]["logprobs"] = logprobs
            payloads[-1]["finish_reason"] = finish_reason
        return payloads

    async def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = await self._texts(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    async def logprobs(
        self, choice: Choice, entries: Sequence[TokenLogprobs], text: str
    ) -> dict[str, Any]:
        content = []
        for entry in entries:
            token = await self._token(entry.token_id, entry.logprob)
            token["top_logprobs"] = [await self._token(t, lp) for t, lp in entry.top[: self._top]]
            content.append(token)
        return {"content": content, "refusal": None}


def _deltas(events: Sequence[ToolEvent]) -> list[dict[str, Any]]:
    """Parser events as chat deltas: text pieces joined, a call's start a delta of its own,
    then its arguments' pieces joined."""
    deltas: list[dict[str, Any]] = []
    for event in events:
        last = deltas[-1] if deltas else None
        if isinstance(event, TextDelta):
            if last is not None and "content" in last:
                last["content"] += event.text
            else:
                deltas.append({"content": event.text})
        elif isinstance(event, CallStarted):
            function = {"name": event.name, "arguments": ""}
            call = {"index": event.index, "id": event.id, "type": "function", "function": function}
            deltas.append({"tool_calls": [call]})
        else:
            previous = last.get("tool_calls", [{}])[0] if last is not None else {}
            if previous.get("index") == event.index and "id" not in previous:
                previous["function"]["arguments"] += event.text
            else:
                piece = {"index": event.index, "function": {"arguments": event.text}}
                deltas.append({"tool_calls": [piece]})
    return deltas
