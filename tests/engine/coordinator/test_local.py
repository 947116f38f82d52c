"""The coordinator over local replicas (engines in this task group), on the toy runner."""

from __future__ import annotations

import json
import random
import re
import threading
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import trio.testing

from twostroke.engine import (
    Choice,
    ConstraintRejected,
    Coordinator,
    CoordinatorStatistics,
    Engine,
    EngineClosed,
    EngineDead,
    EngineStatistics,
    FinishReason,
    JsonSchema,
    Regex,
    ReplicaFailed,
    RequestCancelled,
    RequestOutput,
    RequestRejected,
    SamplingParams,
)
from twostroke.engine.surface import EngineSurface
from twostroke.gpu.completion import Completion, Launched
from twostroke.gpu.fake import FakeDevice

pytestmark = pytest.mark.anyio

#: Every replica (and the bare engine compared against) gets the same small pool.
TOY = {"device": "cpu", "num_blocks": 64, "block_size": 4}

PROMPTS: list[Any] = [
    "hello world",
    [104, 105, 33],
    [{"role": "user", "content": "what is a stroke?"}],
    "the same prompt",
    "the same prompt",
    "stop at the first e",
]
PARAMS = [
    SamplingParams(max_tokens=30, temperature=0),
    SamplingParams(max_tokens=12, seed=3, logprobs=2),
    SamplingParams(max_tokens=20, temperature=0, stop=["e"]),
    SamplingParams(max_tokens=25, ignore_eos=True),
]


def comparable(output: RequestOutput) -> tuple[Any, ...]:
    """Everything of an output but its request id, timings, preemptions and cache hits.

    Which prompts share a replica's prefix cache depends on routing, so cached prompt
    tokens may differ from a bare engine's; the tokens computed from them may not.
    """
    return (
        output.prompt_token_ids,
        output.token_ids,
        output.text,
        output.finish_reason,
        (output.usage.prompt_tokens, output.usage.completion_tokens),
        output.logprobs,
    )


async def bare_outputs(requests: list[tuple[Any, SamplingParams]]) -> list[RequestOutput]:
    async with Engine.open(model="toy", **TOY) as engine:
        return [await engine.generate(prompt, params) for prompt, params in requests]


def workload(count: int) -> list[tuple[Any, SamplingParams]]:
    return [(PROMPTS[i % len(PROMPTS)], PARAMS[i % len(PARAMS)]) for i in range(count)]


async def test_outputs_through_the_coordinator_equal_a_bare_engines() -> None:
    requests = workload(24)
    expected = await bare_outputs(requests)
    async with Coordinator.open(model="toy", replicas=3, **TOY) as coordinator:
        surface: EngineSurface = coordinator
        assert isinstance(surface, EngineSurface)
        assert surface.tokenizer is None  # each replica tokenizes
        outputs: list[RequestOutput | None] = [None] * len(requests)
        streamed: list[tuple[tuple[int, ...], str]] = [((), "")] * len(requests)

        async def one(index: int) -> None:
            prompt, params = requests[index]
            if index % 2:
                outputs[index] = await coordinator.generate(prompt, params)
                return
            tokens: tuple[int, ...] = ()
            text = ""
            async with coordinator.stream(prompt, params) as deltas:
                async for delta in deltas:
                    assert delta.request_id == deltas.request_id
                    tokens += delta.token_ids
                    text += delta.text
                outputs[index] = await deltas.result()
            streamed[index] = (tokens, text)

        async with anyio.create_task_group() as task_group:
            for index in range(len(requests)):
                task_group.start_soon(one, index)
        for index, output in enumerate(outputs):
            assert output is not None
            assert comparable(output) == comparable(expected[index])
            if index % 2 == 0:
                assert streamed[index] == (output.token_ids, output.text)
        assert len({output.request_id for output in outputs if output}) == len(requests)
        stats = coordinator.statistics()
        assert all(replica.engine and replica.engine.num_steps for replica in stats.replicas)
        assert await coordinator.tokenize("ab") == [97, 98]
        assert await coordinator.detokenize([104, 105]) == "hi"
        assert coordinator.model_name == "toy"
        assert coordinator.max_model_len == 4096
        coordinator.check_invariants()


async def test_bad_requests_raise_what_a_bare_engine_raises() -> None:
    too_long = ("x" * 300, SamplingParams(max_tokens=4))
    async with Engine.open(model="toy", **TOY) as engine:
        with pytest.raises(RequestRejected) as bare:
            engine.submit(*too_long)
    message = f"^{re.escape(str(bare.value))}$"
    async with Coordinator.open(model="toy", replicas=2, **TOY) as coordinator:
        with pytest.raises(RequestRejected, match=message):
            coordinator.submit(*too_long)
        with pytest.raises(RequestRejected, match=message):
            await coordinator.generate(*too_long)
        with pytest.raises(RequestRejected, match=message):
            async with coordinator.stream(*too_long):
                raise AssertionError("a rejected request must not stream")
        with pytest.raises(TypeError, match=r"^params must be SamplingParams, got dict$"):
            coordinator.submit("hi", {"max_tokens": 3})  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"^prompt must not be empty, got ''$"):
            await coordinator.generate("")
        with pytest.raises(ValueError, match=r"^token ids must be in \[0, 257\), got 999 at"):
            await coordinator.detokenize([999])
        assert coordinator.statistics().num_open_requests == 0
        coordinator.check_invariants()
    with pytest.raises(EngineClosed, match=r"^the coordinator is closed"):
        coordinator.submit("hi")


async def test_max_tokens_none_takes_what_the_replicas_context_leaves() -> None:
    params = SamplingParams(max_tokens=None, ignore_eos=True)  # routed on an estimate
    async with Coordinator.open(model="toy", replicas=2, max_model_len=40, **TOY) as coordinator:
        outputs = [await coordinator.generate("x" * length, params) for length in (10, 30)]
        assert [len(output.token_ids) for output in outputs] == [30, 10]
        assert coordinator.statistics().num_open_requests == 0
        coordinator.check_invariants()


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"replicas": 0}, ValueError, "replicas must be >= 1, got 0"),
        ({"replicas": "2"}, TypeError, "replicas must be an int, got str '2'"),
        (
            {"placement": "threads"},
            ValueError,
            "placement must be one of 'local', 'process', 'ray', got 'threads'",
        ),
        ({"block_size": 0}, ValueError, "block_size must be >= 1, got 0"),
        (
            {"replicas": 2, "replica_options": [{}]},
            ValueError,
            r"replica_options must have one mapping per replica \(2\), got 1",
        ),
        ({"grace_period": "1"}, TypeError, "grace_period must be a number, got str '1'"),
        ({"grace_period": -1}, ValueError, "grace_period must be >= 0, got -1"),
        (
            {"unhealthy_after": None},
            TypeError,
            "unhealthy_after must be a number, got NoneType None",
        ),
        ({"unhealthy_after": 0}, ValueError, "unhealthy_after must be > 0, got 0"),
        (
            {"placement": 1},
            TypeError,
            "placement must be a str: one of 'local', 'process', 'ray', got int 1",
        ),
        ({"routing": {}}, TypeError, "routing must be a RoutingConfig, got dict"),
    ],
)
async def test_bad_options_are_refused_before_any_replica_starts(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=f"^{message}$"):
        async with Coordinator.open(model="toy", **options):
            raise AssertionError("must not start")


async def test_a_cancellation_storm_leaks_nothing_and_leaves_the_rest_unchanged() -> None:
    rng = random.Random(7)
    requests = workload(48)
    expected = await bare_outputs(requests)
    async with Coordinator.open(model="toy", replicas=3, **TOY) as coordinator:
        outcomes: list[Any] = [None] * len(requests)

        async def one(index: int) -> None:
            prompt, params = requests[index]
            plan = rng.choice(["finish", "cancel-at-once", "cancel-later", "leave-early"])
            handle = coordinator.submit(prompt, params)
            if plan == "cancel-at-once":
                handle.cancel()  # before the replica produced anything
            elif plan == "cancel-later":
                await handle.next_delta()
                handle.cancel()
            elif plan == "leave-early":
                async with coordinator.stream(prompt, params) as deltas:
                    await deltas.next_delta()
                handle.cancel()
            try:
                outcomes[index] = await handle.result()
            except RequestCancelled as exc:
                outcomes[index] = (plan, exc.request_id == handle.request_id)

        async with anyio.create_task_group() as task_group:
            for index in range(len(requests)):
                task_group.start_soon(one, index)
        await coordinator.wait_idle()
        finished = [i for i, outcome in enumerate(outcomes) if isinstance(outcome, RequestOutput)]
        cancelled = [outcome for outcome in outcomes if not isinstance(outcome, RequestOutput)]
        assert all(same_id for _, same_id in cancelled)
        assert 0 < len(finished) < len(requests)
        for index in finished:
            assert comparable(outcomes[index]) == comparable(expected[index])
        stats = coordinator.statistics()
        assert stats.num_open_requests == 0
        for replica in stats.replicas:
            assert replica.engine is not None
            assert replica.engine.num_free_blocks == replica.engine.num_blocks
            assert replica.engine.num_open_requests == 0
            assert replica.num_open_requests == 0
            assert replica.load_tokens == 0
        coordinator.check_invariants()


async def test_statistics_are_totals_plus_one_entry_per_replica() -> None:
    async with Coordinator.open(model="toy", replicas=2, **TOY) as coordinator:
        async with anyio.create_task_group() as task_group:
            for index in range(6):
                task_group.start_soon(coordinator.generate, f"prompt {index}")
        await coordinator.wait_idle()
        stats = coordinator.statistics()
    assert isinstance(stats, CoordinatorStatistics)
    assert isinstance(stats, EngineStatistics)
    engines = [replica.engine for replica in stats.replicas]
    assert all(engine is not None for engine in engines)
    assert stats.num_tokens_generated == sum(e.num_tokens_generated for e in engines if e)
    assert stats.num_blocks == 128
    assert stats.num_free_blocks == 128
    assert stats.num_replicas_alive == 2
    assert stats.num_resubmitted == 0
    assert [(r.index, r.placement, r.alive, r.healthy, r.pid) for r in stats.replicas] == [
        (0, "local", True, True, None),
        (1, "local", True, True, None),
    ]
    assert all(engine.num_steps > 0 for engine in engines if engine)  # both got work


class DyingDevice(FakeDevice):
    """A device that fails every launch once ``armed`` (the engine on it dies)."""

    def __init__(self) -> None:
        super().__init__(step_time=0.0)
        self.armed = False

    async def run(self, work: Callable[[], Launched[Any]], completion: Completion[Any]) -> None:
        if self.armed:
            raise RuntimeError("device lost")
        await super().run(work, completion)


async def test_a_dying_replica_fails_only_its_requests_and_the_last_one_ends_the_block() -> None:
    devices = [DyingDevice(), DyingDevice()]
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    (expected,) = await bare_outputs([("same prompt", long)])
    with pytest.raises(EngineDead, match=r"^every replica died; the last: ") as caught:
        async with Coordinator.open(
            model="toy",
            replicas=2,
            num_blocks=256,
            block_size=4,
            replica_options=[{"device": device} for device in devices],
        ) as coordinator:
            first = coordinator.submit("same prompt", long)  # replica 0 (ties rotate)
            second = coordinator.submit("other prompt", long)  # replica 1
            await first.next_delta()
            await second.next_delta()
            devices[0].armed = True
            fresh = coordinator.submit("same prompt", long)  # prefix affinity: replica 0
            with pytest.raises(ReplicaFailed, match="replica 0 failed: the engine died") as died:
                await first.result()
            assert died.value.replica == 0
            assert died.value.request_id == first.request_id
            assert isinstance(died.value.__cause__, EngineDead)
            # ``fresh`` had no token yet: resubmitted to replica 1, its output unchanged.
            assert comparable(await fresh.result()) == comparable(expected)
            assert (await second.result()).finish_reason is FinishReason.LENGTH
            stats = coordinator.statistics()
            assert [r.alive for r in stats.replicas] == [False, True]
            assert "device lost" in (stats.replicas[0].failure or "")
            assert stats.num_resubmitted == 1
            assert stats.num_replicas_alive == 1
            coordinator.check_invariants()
            devices[1].armed = True
            last = coordinator.submit("anything", long)
            await last.result()
    assert isinstance(caught.value.__cause__, EngineDead)


@pytest.mark.parametrize(
    "anyio_backend", [("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})]
)
async def test_a_replica_that_stops_stepping_is_reported_unhealthy() -> None:
    # Each step takes 1 s of virtual time; the coordinator tolerates 0.2 s without one.
    async with Coordinator.open(
        model="toy",
        replicas=2,
        unhealthy_after=0.2,
        num_blocks=64,
        block_size=4,
        replica_options=[{"device": FakeDevice(step_time=1.0)} for _ in range(2)],
    ) as coordinator:
        handle = coordinator.submit("hello", SamplingParams(max_tokens=2, ignore_eos=True))
        await anyio.sleep(0.5)
        stats = coordinator.statistics()
        assert [(r.healthy, r.num_open_requests) for r in stats.replicas] == [(False, 1), (True, 0)]
        await handle.result()
        assert all(r.healthy for r in coordinator.statistics().replicas)


async def test_replicas_answer_constrained_requests_and_refuse_what_the_backend_refuses() -> None:
    schema = {
        "type": "object",
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "high": {"type": "boolean"}},
        "required": ["unit", "high"],
        "additionalProperties": False,
    }
    constraints = [JsonSchema(schema), Choice(["yes", "no"]), Regex("[a-c]{2}[0-9]")] * 2
    outputs: list[RequestOutput | None] = [None] * len(constraints)
    async with Coordinator.open(model="toy", replicas=2, **TOY) as coordinator:

        async def one(index: int) -> None:
            params = SamplingParams(max_tokens=48, constraint=constraints[index])
            outputs[index] = await coordinator.generate(f"{index}: a question", params)

        async with anyio.create_task_group() as task_group:
            for index in range(len(constraints)):
                task_group.start_soon(one, index)
        handle = coordinator.submit("hi", SamplingParams(constraint=Regex("(?<=a)b")))
        with pytest.raises(ConstraintRejected, match=r"^constraint\.pattern: invalid regex: "):
            await handle.result()
        replicas = coordinator.statistics().replicas
    steps = [replica.engine.num_steps if replica.engine else 0 for replica in replicas]
    assert all(steps), steps  # both replicas compiled constraints and answered
    for output, constraint in zip(outputs, constraints, strict=True):
        assert output is not None
        assert str(output.finish_reason) == "stop"
        if isinstance(constraint, JsonSchema):
            assert json.loads(output.text)["unit"] in {"celsius", "fahrenheit"}
        elif isinstance(constraint, Choice):
            assert output.text in {"yes", "no"}
        else:
            assert re.fullmatch("[a-c]{2}[0-9]", output.text)


async def test_prepare_tokenizes_in_a_local_replicas_worker_thread() -> None:
    """Behind local replicas, ``prepare`` gives the ids a bare engine computes, tokenized in
    a replica engine's worker thread (a local replica's ``submit`` would tokenize on this
    event loop); malformed prompts raise as the bare engine's ``prepare`` does."""
    from twostroke.engine.runners.toy import ByteTokenizer, ToyRunner

    threads: list[int] = []

    class Recorded(ByteTokenizer):
        def encode(self, text: str) -> list[int]:
            threads.append(threading.get_ident())
            return super().encode(text)

    options: dict[str, Any] = {"runner": ToyRunner(), "tokenizer": Recorded(), **TOY}
    async with Engine.open(**options) as engine:
        expected = [await engine.prepare(prompt) for prompt in PROMPTS]
    async with Coordinator.open(replicas=2, **options) as coordinator:
        threads.clear()
        prepared = [await coordinator.prepare(prompt) for prompt in PROMPTS]
        assert [tuple(ids) for ids in prepared] == expected
        assert threads
        assert threading.get_ident() not in threads
        with pytest.raises(ValueError, match=r"^prompt must not be empty, got ''$"):
            await coordinator.prepare("")
        output = await coordinator.generate(prepared[0], SamplingParams(max_tokens=3))
        assert output.prompt_token_ids == expected[0]
