"""A workload streamed through twostroke's engine surface, every chunk timed.

twostroke's own systems (the engine at each depth, the coordinator over N replicas) are
measured the same way: each request is submitted at its arrival time, streamed through
:meth:`~twostroke.engine.surface.EngineSurface.stream` greedily to its ``max_tokens``
(``ignore_eos``; under its JSON schema where it has one, under the lazy constraint of the
bench's tools with ``tool_choice`` ``"auto"`` where it offers them), and the delivery time of every
chunk with tokens is recorded. One function
does it for all of them, so their figures differ only in the system.
"""

from __future__ import annotations

import time

import anyio
import attrs

from twostroke.engine.bench.metrics import RequestTiming
from twostroke.engine.bench.schemas import BENCH_TOOLS
from twostroke.engine.bench.workload import BenchRequest, Workload
from twostroke.engine.surface import EngineSurface
from twostroke.engine.tools import GENERIC, ToolSpec, tool_constraint
from twostroke.states.constraints import Constraint, Grammar, JsonSchema
from twostroke.states.params import SamplingParams

__all__ = ["StreamedRun", "request_constraint", "stream_workload"]

#: The bench's tools as the engine takes them.
_TOOLS = tuple(
    ToolSpec(tool["function"]["name"], tool["function"]["description"],
             tool["function"]["parameters"])
    for tool in BENCH_TOOLS
)  # fmt: skip


#: The lazy grammar's text branch, and the bench's: the same text, then a NUL byte.
_TEXT_BRANCH = "start: TEXT | TEXT_FIRST calls"
_ENDLESS_TEXT_BRANCH = 'start: TEXT "\\u0000" | TEXT_FIRST calls'


def request_constraint(request: BenchRequest) -> Constraint | None:
    """The constraint a bench request samples under: its JSON schema, or with tools the
    lazy grammar of ``tool_choice`` ``"auto"`` in the generic format (the schema, if any,
    on its text branch), as the server builds it for a chat request offering them.

    With one change: the free text branch must end with a NUL byte, which no model writes.
    A text answer under the server's grammar ends at the model's EOS (the constraint
    accepts it at any point, and a constraint that accepted its output ends the request,
    ``ignore_eos`` or not), so a bench request would stop early where the same request
    without tools generates past EOS to its ``max_tokens``; with the NUL the mask is the
    lazy grammar's but for EOS, and the work is the same. A call still ends the request
    (the report counts the tokens each request got).
    """
    schema = None if request.json_schema is None else JsonSchema(request.json_schema)
    if not request.tools:
        return schema
    grammar = tool_constraint(GENERIC, _TOOLS, "auto", text=schema)
    if schema is not None:  # the text branch is the schema's JSON, which the bench's
        return grammar  # schema does not let complete before max_tokens
    assert grammar.source.startswith(_TEXT_BRANCH), grammar.source[:80]
    return Grammar(_ENDLESS_TEXT_BRANCH + grammar.source[len(_TEXT_BRANCH) :])


@attrs.frozen
class StreamedRun:
    """What streaming a workload through an engine surface measured.

    Attributes:
        timings: One per request, in workload order; times in seconds from the run's start.
        wall_seconds: From the run's start until the last request ended.
        request_ids: The surface's request id of each workload request.
        output_token_ids: The tokens each request generated, in workload order (the
            bench's greedy check compares them across systems).
    """

    timings: tuple[RequestTiming, ...]
    wall_seconds: float
    request_ids: tuple[int, ...]
    output_token_ids: tuple[tuple[int, ...], ...] = ()


async def stream_workload(surface: EngineSurface, workload: Workload) -> StreamedRun:
    """Submit every request of ``workload`` at its arrival time and stream it to the end.

    The run starts (t = 0) when this is called. Each request streams its prompt token ids with
    greedy sampling and ``ignore_eos``, so it produces exactly its ``max_tokens`` (a request
    with a JSON schema samples under it: the bench's schema does not complete sooner).

    Args:
        surface: An open engine or coordinator.
        workload: The requests and their arrival times.

    Returns:
        Every request's timing, the wall time, the request ids and the tokens generated.

    Raises:
        ExceptionGroup: a request failed (the other requests are cancelled); it holds the
            surface's errors (``RequestRejected``, ``RequestFailed``, ...), or an
            ``IndexError`` for a request that ended without delivering a token.

    Cancelling the caller cancels every request in flight.
    """
    t0 = time.perf_counter()
    count = len(workload.requests)
    timings: list[RequestTiming | None] = [None] * count
    request_ids: list[int | None] = [None] * count
    outputs: list[list[int]] = [[] for _ in range(count)]

    async def one(index: int) -> None:
        request = workload.requests[index]
        delay = workload.arrival(index) - (time.perf_counter() - t0)
        if delay > 0:
            await anyio.sleep(delay)
        start = time.perf_counter() - t0
        params = SamplingParams(
            max_tokens=request.max_tokens,
            temperature=0,
            ignore_eos=True,
            constraint=request_constraint(request),
        )
        chunks: list[float] = []
        num_tokens = 0
        async with surface.stream(list(request.prompt_token_ids), params) as deltas:
            request_ids[index] = deltas.request_id
            async for delta in deltas:
                if delta.token_ids:
                    chunks.append(time.perf_counter() - t0)
                    num_tokens += len(delta.token_ids)
                    outputs[index].extend(delta.token_ids)
        timings[index] = RequestTiming(
            prompt_tokens=len(request.prompt_token_ids),
            output_tokens=num_tokens,
            start=start,
            first_token=chunks[0],
            end=chunks[-1],
            chunk_times=chunks,
        )

    async with anyio.create_task_group() as task_group:
        for index in range(count):
            task_group.start_soon(one, index)
    wall = time.perf_counter() - t0
    return StreamedRun(
        timings=tuple(t for t in timings if t is not None),
        wall_seconds=wall,
        request_ids=tuple(i for i in request_ids if i is not None),
        output_token_ids=tuple(tuple(tokens) for tokens in outputs),
    )
