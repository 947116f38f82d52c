"""The engine's public API and semantics on the toy runner, on asyncio and trio."""

from __future__ import annotations

import re
from typing import Any

import anyio
import attrs
import pytest

from twostroke.engine import (
    Engine,
    EngineClosed,
    EngineOverloaded,
    FinishReason,
    RequestCancelled,
    RequestRejected,
    SamplingParams,
)
from twostroke.engine.runners.toy import ByteTokenizer, ToyRunner, toy_text_next_token
from twostroke.states.testing import reference_output

from .conftest import expected_tokens, toy_engine

pytestmark = pytest.mark.anyio

TOKENIZER = ByteTokenizer()


def expected(prompt: str, params: SamplingParams) -> tuple[list[int], str]:
    return reference_output(
        TOKENIZER.encode(prompt),
        params,
        eos_token_ids=TOKENIZER.eos_token_ids,
        next_token=toy_text_next_token,
    )


async def test_generate_matches_the_reference() -> None:
    params = SamplingParams(max_tokens=40)
    async with toy_engine() as engine:
        output = await engine.generate("hello world", params)
    tokens, reason = expected("hello world", params)
    assert list(output.token_ids) == tokens
    assert output.finish_reason.value == reason
    assert output.text == TOKENIZER.decode(tokens)
    assert output.usage.prompt_tokens == len("hello world")
    assert output.usage.completion_tokens == len(tokens)


async def test_record_steps_gives_the_launched_plans_while_open() -> None:
    """The bench's bare forward replays a workload's steps from this record: every step
    launched inside the block, in order, and none from before or after it."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    async with toy_engine() as engine:
        await engine.generate("before", params)
        before = engine.statistics().num_steps
        with engine.record_steps() as outer:
            with engine.record_steps() as inner:
                await engine.generate("inside", params)
            await engine.generate("outer only", params)
        recorded = engine.statistics().num_steps
        await engine.generate("after", params)
    assert len(outer) == recorded - before
    assert [plan.step_id for plan in outer] == sorted(plan.step_id for plan in outer)
    assert inner == outer[: len(inner)]
    assert 0 < len(inner) < len(outer)
    tokens = sum(row.num_tokens for plan in inner for row in plan.requests)
    assert tokens >= len("inside") + 5  # its prompt, then a row per token sampled after


@pytest.mark.parametrize("depth", [1, 2])
async def test_concurrent_requests_under_memory_pressure(depth: int) -> None:
    prompts = [f"request number {i} " * (1 + i % 5) for i in range(24)]
    params = [SamplingParams(max_tokens=8 + (i * 7) % 40, ignore_eos=i % 3 == 0) for i in range(24)]
    results: dict[int, Any] = {}
    async with toy_engine(
        num_blocks=48, max_num_batched_tokens=32, max_num_seqs=8, pipeline_depth=depth
    ) as engine:

        async def one(index: int) -> None:
            results[index] = await engine.generate(prompts[index], params[index])

        async with anyio.create_task_group() as task_group:
            for index in range(len(prompts)):
                task_group.start_soon(one, index)
        assert engine.statistics().num_preemptions > 0
    for index, output in results.items():
        tokens, reason = expected(prompts[index], params[index])
        assert list(output.token_ids) == tokens, index
        assert output.finish_reason.value == reason


async def test_stream_deltas_add_up_to_the_output() -> None:
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    async with toy_engine() as engine:
        async with engine.stream("stream me", params) as deltas:
            chunks = [delta async for delta in deltas]
        final = await engine.generate("stream me", params)
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert "".join(chunk.text for chunk in chunks) == final.text
    assert sum((chunk.token_ids for chunk in chunks), ()) == final.token_ids


async def test_slow_consumer_gets_coalesced_deltas() -> None:
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    async with toy_engine() as engine:
        async with engine.stream("slow", params) as deltas:
            await deltas.result()  # let the whole request finish before reading anything
            chunks = [delta async for delta in deltas]
    assert len(chunks) == 1
    assert len(chunks[0].token_ids) == 50
    assert chunks[0].finish_reason is FinishReason.LENGTH


async def test_leaving_a_stream_early_cancels_the_request() -> None:
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    async with toy_engine() as engine:
        async with engine.stream("leave early", params) as deltas:
            async for delta in deltas:
                if delta.token_ids:
                    break
        await engine.wait_idle()
        stats = engine.statistics()
        assert stats.num_tokens_generated < 200
        # the engine keeps serving
        assert (await engine.generate("after", SamplingParams(max_tokens=3))).token_ids


async def test_cancel_through_the_handle() -> None:
    async with toy_engine() as engine:
        handle = engine.submit("cancel me", SamplingParams(max_tokens=200, ignore_eos=True))
        handle.cancel()
        handle.cancel()  # idempotent
        with pytest.raises(RequestCancelled, match="request 0 was cancelled"):
            await handle.result()


async def test_stop_string_is_cut_from_the_text() -> None:
    plain = SamplingParams(max_tokens=60, ignore_eos=True)
    async with toy_engine() as engine:
        text = (await engine.generate("stop strings", plain)).text
        stop = text[10:12]
        cut = await engine.generate("stop strings", SamplingParams(max_tokens=60, stop=stop))
        kept = await engine.generate(
            "stop strings",
            SamplingParams(max_tokens=60, stop=stop, include_stop_str_in_output=True),
        )
    first = text.index(stop)
    assert cut.text == text[:first]
    assert cut.finish_reason is FinishReason.STOP
    assert kept.text == text[: first + len(stop)]


@pytest.mark.parametrize(
    ("prompt", "error", "message"),
    [
        ("", ValueError, "prompt must not be empty, got ''"),
        ([], ValueError, "prompt must not be empty"),
        (42, TypeError, "prompt must be text, a sequence of token ids or a list of chat"),
        ([1, "a"], TypeError, "got a sequence of int, str"),
        ([1, 999], ValueError, r"prompt token ids must be in \[0, 257\), got 999 at index 1"),
        ("x" * 250, RequestRejected, r"must be <= max_model_len \(256\)"),
        (
            "x" * 300,
            RequestRejected,
            r"at most max_model_len x the longest token's characters = 256 x 1",
        ),
    ],
)
async def test_bad_input_is_rejected_and_changes_nothing(
    prompt: Any, error: type[Exception], message: str
) -> None:
    async with toy_engine(max_model_len=256) as engine:
        before = engine.statistics()
        with pytest.raises(error, match=message):
            await engine.generate(prompt, SamplingParams(max_tokens=8))
        assert engine.statistics() == before
        assert (await engine.generate("still serving", SamplingParams(max_tokens=2))).token_ids


async def test_max_tokens_none_takes_what_the_context_leaves() -> None:
    async with toy_engine(max_model_len=40) as engine:
        params = SamplingParams(max_tokens=None, ignore_eos=True)
        output = await engine.generate("x" * 30, params)
        assert (len(output.token_ids), output.finish_reason) == (10, FinishReason.LENGTH)
        before = engine.statistics()
        with pytest.raises(
            RequestRejected, match=r"^prompt \(40 tokens\) \+ max_tokens \(1\)"
        ) as full:
            engine.submit("x" * 40, params)  # no room: at least one token, which passes it
        numbers = full.value.num_prompt_tokens, full.value.max_tokens, full.value.max_model_len
        assert numbers == (40, 1, 40)
        assert engine.statistics() == before


async def test_a_stop_token_id_outside_the_vocabulary_is_rejected() -> None:
    async with toy_engine() as engine:
        before = engine.statistics()
        with pytest.raises(
            RequestRejected, match=r"^stop_token_ids must be in \[0, 257\), got 257 at index 1$"
        ):
            engine.submit("x", SamplingParams(stop_token_ids=[5, 257]))
        assert engine.statistics() == before
        params = SamplingParams(max_tokens=4, stop_token_ids=[256])  # the last id is fine
        assert (await engine.generate("x", params)).token_ids


class CountingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        self.num_encoded = 0

    def encode(self, text: str) -> list[int]:
        self.num_encoded += 1
        return super().encode(text)


async def test_a_full_waiting_queue_refuses_before_tokenizing_and_loses_nothing() -> None:
    tokenizer = CountingTokenizer()
    params = SamplingParams(max_tokens=6)
    async with Engine.open(
        runner=ToyRunner(), tokenizer=tokenizer, device="cpu", num_blocks=64, block_size=4,
        max_waiting_requests=2,
    ) as engine:  # fmt: skip
        # No step runs between two submits: both requests wait.
        handles = [engine.submit("first", params), engine.submit("second", params)]
        before, encoded = engine.statistics(), tokenizer.num_encoded
        message = (
            "the waiting queue is full: 2 requests wait for admission and "
            "max_waiting_requests is 2; retry later"
        )
        with pytest.raises(EngineOverloaded, match=f"^{re.escape(message)}$"):
            engine.submit("third", params)
        assert tokenizer.num_encoded == encoded  # refused before the tokenizer ran
        assert engine.statistics() == before
        outputs = [await handle.result() for handle in handles]  # nothing lost
        assert [list(output.token_ids) for output in outputs] == [
            expected("first", params)[0],
            expected("second", params)[0],
        ]
        assert (await engine.generate("third", params)).token_ids  # room again
        await engine.wait_idle()
        engine.check_invariants()


async def test_wrong_params_type() -> None:
    async with toy_engine() as engine:
        with pytest.raises(TypeError, match="params must be SamplingParams, got dict"):
            engine.submit("x", {"max_tokens": 3})  # type: ignore[arg-type]


async def test_shutdown_drains_by_default_then_refuses_work() -> None:
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    async with toy_engine() as engine:
        handles = [engine.submit(f"drain {i}", params) for i in range(5)]
    for handle in handles:
        assert len((await handle.result()).token_ids) == 20
    with pytest.raises(EngineClosed, match="the engine is closed"):
        engine.submit("late", params)
    with pytest.raises(EngineClosed):
        await engine.generate("late", params)


async def test_shutdown_cancel_mode_fails_open_requests() -> None:
    params = SamplingParams(max_tokens=2000, ignore_eos=True)
    async with Engine.open(
        model="toy", shutdown="cancel", max_model_len=4096, num_blocks=1024
    ) as engine:
        handle = engine.submit("cancel at close", params)
    with pytest.raises(EngineClosed, match="closed before request 0 finished"):
        await handle.result()


async def test_body_exception_propagates_unwrapped() -> None:
    with pytest.raises(KeyError, match="mine"):
        async with toy_engine() as engine:
            engine.submit("x", SamplingParams(max_tokens=200, ignore_eos=True))
            raise KeyError("mine")


async def test_chat_messages_and_token_ids() -> None:
    params = SamplingParams(max_tokens=5)
    messages = [{"role": "user", "content": "hi"}]
    async with toy_engine() as engine:
        chat = await engine.generate(messages, params)
        ids = await engine.generate(list(chat.prompt_token_ids), params)
    assert chat.token_ids == ids.token_ids
    assert TOKENIZER.decode(chat.prompt_token_ids).endswith("<assistant>")


async def test_logprobs_are_delivered_per_token() -> None:
    async with toy_engine() as engine:
        output = await engine.generate("lp", SamplingParams(max_tokens=6, logprobs=2))
    assert output.logprobs is not None
    assert [entry.token_id for entry in output.logprobs] == list(output.token_ids)


async def test_metrics_are_consistent() -> None:
    async with toy_engine() as engine:
        output = await engine.generate("timing", SamplingParams(max_tokens=10, ignore_eos=True))
    metrics = output.metrics
    assert metrics.ttft is not None
    assert metrics.queue_time is not None
    assert 0 <= metrics.queue_time <= metrics.ttft <= metrics.e2e
    assert metrics.tpot is not None
    assert metrics.tpot >= 0


@pytest.mark.anyio
async def test_the_cpu_forward_thread_lives_exactly_as_long_as_the_engine() -> None:
    import threading

    def forward_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "twostroke cpu forward"]

    assert not forward_threads()
    async with Engine.open(model="toy", device="cpu", num_blocks=16) as engine:
        assert len(forward_threads()) == 1
        output = await engine.generate("warm", SamplingParams(max_tokens=3))
        assert output.token_ids
    assert not forward_threads()


async def test_the_model_loads_and_its_cache_is_made_on_the_forward_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Loading takes seconds: the event loop serves its other tasks meanwhile, and torch's
    set-up runs on the one thread that runs the steps (one OpenMP team in the process)."""
    import threading

    from twostroke.engine.runners import loading

    # Only reached if the loop waited for the load (then nobody sets the event).
    deadlock = 10.0
    released = threading.Event()
    seen: dict[str, int] = {}
    load_runner = loading.load_runner

    class Recorder(ToyRunner):
        def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
            seen["cache"] = threading.get_ident()
            super().allocate_kv_cache(num_blocks, block_size)

    def load(*args: Any, **kwargs: Any) -> Any:
        seen["load"] = threading.get_ident()
        assert released.wait(deadlock), "the event loop waited for the model to load"
        _, tokenizer = load_runner(*args, **kwargs)
        return Recorder(), tokenizer

    async def release() -> None:
        released.set()

    monkeypatch.setattr(loading, "load_runner", load)
    async with anyio.create_task_group() as task_group:
        task_group.start_soon(release)
        async with Engine.open(model="toy", device="cpu", num_blocks=16) as engine:
            forward = [t for t in threading.enumerate() if t.name == "twostroke cpu forward"]
            output = await engine.generate("warm", SamplingParams(max_tokens=3))
    assert output.token_ids
    (thread,) = forward
    assert seen == {"load": thread.ident, "cache": thread.ident}
    assert thread.ident != threading.get_ident()


async def test_on_the_cpu_the_engine_governs_its_threads_unless_the_count_is_fixed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``torch_threads`` left to it, the engine adjusts the forward thread's count before
    each step (twostroke.gpu.cores); a count the user fixed, or a device that is not the CPU,
    is never governed."""
    import threading

    from twostroke.engine import engine as engine_module
    from twostroke.engine.runners.loading import default_torch_threads
    from twostroke.gpu import FakeDevice
    from twostroke.gpu.cores import CoreSample, ThreadGovernor

    class Contended:
        """A machine where the forward thread waits for its core half of every second."""

        def __init__(self) -> None:
            self.now = 0.0
            self.threads: set[str] = set()

        def clock(self) -> float:
            self.now += 1.0
            return self.now

        def sample(self) -> CoreSample:
            self.threads.add(threading.current_thread().name)
            return CoreSample(wall=self.now, idle=0.0, waited=self.now / 2)

    machine = Contended()
    asked: list[int] = []

    def governor(most: int) -> ThreadGovernor:
        # Two threads whatever this machine's cores, so that the first contended window
        # drops the count to one, where it stays: with the machine's own count (it was
        # max(cores, 2)) a machine of more than two cores dropped one a step, and the
        # changes counted depended on its cores.
        asked.append(most)
        return ThreadGovernor(2, sample=machine.sample, clock=machine.clock)

    monkeypatch.setattr(engine_module, "ThreadGovernor", governor)
    async with Engine.open(model="toy", device="cpu", num_blocks=16) as engine:
        assert engine.statistics().torch_threads == 2
        output = await engine.generate("busy", SamplingParams(max_tokens=4))
        stats = engine.statistics()
    assert asked == [default_torch_threads()]  # the engine governs every core it may use
    assert len(output.token_ids) == 4
    assert (stats.torch_threads, stats.num_torch_thread_changes) == (1, 1)
    assert machine.threads == {"twostroke cpu forward"}  # read where the steps run

    machine.threads.clear()
    async with Engine.open(model="toy", device="cpu", num_blocks=16, torch_threads=1) as engine:
        await engine.generate("fixed", SamplingParams(max_tokens=4))
        stats = engine.statistics()
    assert (stats.torch_threads, stats.num_torch_thread_changes) == (1, 0)
    async with toy_engine(device=FakeDevice()) as engine:
        await engine.generate("fake", SamplingParams(max_tokens=4))
        assert engine.statistics().torch_threads == 0
    assert not machine.threads


async def test_a_low_priority_request_submitted_first_runs_after_a_high_priority_one() -> None:
    # One seat (max_num_seqs=1) taken by a running request; then a priority-5 request and a
    # priority-0 one are queued, in that order: the second is admitted first.
    order: list[str] = []
    async with toy_engine(max_num_seqs=1) as engine:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        running = engine.submit("busy", params)
        low = engine.submit("low", attrs.evolve(params, priority=5))
        high = engine.submit("high", attrs.evolve(params, priority=0))

        async def finish(name: str, handle: Any) -> None:
            output = await handle.result()
            order.append(name)
            assert list(output.token_ids) == expected_tokens(name, params)

        async with anyio.create_task_group() as group:
            for name, handle in (("busy", running), ("low", low), ("high", high)):
                group.start_soon(finish, name, handle)
    assert order == ["busy", "high", "low"]
