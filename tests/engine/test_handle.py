"""A request's two ends on their own: what the writer writes is what the handle's reader sees."""

from __future__ import annotations

import anyio
import pytest

from twostroke.engine.errors import RequestCancelled
from twostroke.engine.handle import HandleWriter, RequestHandle, create_request_handle
from twostroke.engine.outputs import Delta, RequestMetrics, RequestOutput, Usage
from twostroke.states.request import FinishReason

pytestmark = pytest.mark.anyio


def output(request_id: int, token_ids: tuple[int, ...]) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=(1, 2),
        token_ids=token_ids,
        text="x" * len(token_ids),
        finish_reason=FinishReason.LENGTH,
        usage=Usage(2, len(token_ids), 0),
        metrics=RequestMetrics(queue_time=0.0, ttft=0.0, tpot=None, e2e=0.0, num_preemptions=0),
    )


def pair(cancelled: list[int] | None = None) -> tuple[HandleWriter, RequestHandle]:
    log = [] if cancelled is None else cancelled
    return create_request_handle(7, (1, 2), log.append)


async def test_a_slow_reader_gets_one_delta_with_everything_written_since_it_last_read() -> None:
    writer, handle = pair()
    assert writer.handle is handle
    writer.deliver(Delta(7, "a", (10,)))
    writer.deliver(Delta(7, "b", (11,)))
    writer.deliver(Delta(7, "", (), finish_reason=FinishReason.LENGTH))
    writer.finish(output(7, (10, 11)))
    [delta] = [delta async for delta in handle]
    assert (delta.text, delta.token_ids, delta.finish_reason) == (
        "ab",
        (10, 11),
        FinishReason.LENGTH,
    )
    assert (await handle.result()).token_ids == (10, 11)
    assert handle.done()


async def test_a_waiting_reader_wakes_for_each_write() -> None:
    writer, handle = pair()
    seen: list[Delta] = []

    async def read() -> None:
        async for delta in handle:
            seen.append(delta)

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(read)
        await anyio.wait_all_tasks_blocked()
        writer.deliver(Delta(7, "a", (10,)))
        await anyio.wait_all_tasks_blocked()
        assert [delta.text for delta in seen] == ["a"]
        writer.deliver(Delta(7, "b", (11,), finish_reason=FinishReason.STOP))
        await anyio.wait_all_tasks_blocked()
        writer.finish(output(7, (10, 11)))
    assert [delta.text for delta in seen] == ["a", "b"]


async def test_a_request_ends_once_and_its_error_reaches_every_reader() -> None:
    writer, handle = pair()
    error = RequestCancelled(7)
    writer.fail(error)
    writer.finish(output(7, (10,)))  # ended already: nothing changes
    writer.fail(RuntimeError("late"))
    with pytest.raises(RequestCancelled) as raised:
        await handle.result()
    assert raised.value is error
    with pytest.raises(RequestCancelled):
        await handle.next_delta()


async def test_cancel_asks_once_per_call_and_never_once_ended() -> None:
    cancelled: list[int] = []
    writer, handle = pair(cancelled)
    handle.cancel()
    handle.cancel()
    assert cancelled == [7, 7]
    writer.fail(RequestCancelled(7))
    handle.cancel()
    assert cancelled == [7, 7]


async def test_the_writer_tells_the_handle_its_prompt_once_known() -> None:
    writer, handle = create_request_handle(3, (), lambda _: None)
    assert handle.prompt_token_ids == ()
    writer.set_prompt_token_ids((5, 6))
    assert handle.prompt_token_ids == (5, 6)
    assert repr(handle) == "<RequestHandle 3 open>"
    writer.fail(RequestCancelled(3))
    assert repr(writer) == "<HandleWriter of <RequestHandle 3 done>>"


async def test_a_relayed_handle_hands_on_every_delta_and_its_end_and_keeps_no_delta() -> None:
    writer, handle = pair()
    deltas: list[Delta] = []
    ends: list[tuple[RequestOutput | None, BaseException | None]] = []
    handle.relay_to(deltas.append, lambda out, error: ends.append((out, error)))
    writer.deliver(Delta(7, "a", (10,)))
    writer.deliver(Delta(7, "b", (11,), finish_reason=FinishReason.LENGTH))
    assert [delta.text for delta in deltas] == ["a", "b"]  # one by one, not merged
    done = output(7, (10, 11))
    writer.finish(done)
    writer.fail(RuntimeError("late"))
    assert ends == [(done, None)]
    assert await handle.result() is done
    with pytest.raises(StopAsyncIteration):
        await handle.next_delta()


async def test_a_handle_relays_from_before_its_first_output_and_only_once() -> None:
    writer, handle = pair()
    handle.relay_to(lambda _: None, lambda *_: None)
    with pytest.raises(RuntimeError, match=r"^can't relay request 7 twice$"):
        handle.relay_to(lambda _: None, lambda *_: None)
    writer, handle = pair()
    writer.deliver(Delta(7, "a", (10,)))
    message = r"^can't relay request 7: output reached its handle first$"
    with pytest.raises(RuntimeError, match=message):
        handle.relay_to(lambda _: None, lambda *_: None)
    writer, handle = pair()
    writer.fail(RequestCancelled(7))
    with pytest.raises(RuntimeError, match=message):
        handle.relay_to(lambda _: None, lambda *_: None)
