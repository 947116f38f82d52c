"""The engine: one ``async with`` block, two strokes, continuous batching.

Entering :meth:`Engine.open` starts one anyio task group with exactly two long-lived tasks:

* the **bookkeeping** stroke admits and cancels requests, plans step N+1, sends the plan
  forward, *then* awaits step N's completion, applies its outcome to the requests, and
  delivers output;
* the **forward** stroke receives plans, launches each on the device and sends the step's
  :class:`~twostroke.gpu.completion.Completion` back before the work is done.

They talk only through two small memory object streams. With ``pipeline_depth=2`` the plan
for step N+1 is already waiting when step N finishes, so the device never waits for Python;
with ``pipeline_depth=1`` the two strokes alternate (useful to measure the overlap).

Callers talk to the engine through :meth:`submit`, :meth:`generate` and :meth:`stream`. They
add requests to the scheduler synchronously (all scheduler access happens on the event loop
between awaits), but cancellations are only *enqueued* and applied by the bookkeeping stroke
at a step boundary, so that cleanup code never awaits and never races a step.
"""

from __future__ import annotations

import collections
import itertools
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from twostroke.engine.config import EngineConfig
from twostroke.engine.errors import (
    EngineClosed,
    EngineDead,
    RequestCancelled,
    RequestFailed,
)
from twostroke.engine.handle import RequestHandle
from twostroke.engine.outputs import Delta, RequestMetrics, RequestOutput, Usage
from twostroke.engine.runners.protocol import ModelRunner, RunnerOutput
from twostroke.engine.text.detokenizer import IncrementalDetokenizer
from twostroke.engine.text.prompts import Prompt, tokenize_prompt
from twostroke.engine.text.tokenizer import Tokenizer
from twostroke.gpu.completion import Completion
from twostroke.gpu.device import Device, select_device
from twostroke.states.params import SamplingParams
from twostroke.states.plan import StepFailure, StepOutcome, StepPlan, StepReport
from twostroke.states.request import FinishReason, Request
from twostroke.states.scheduler import Scheduler, SchedulerConfig

__all__ = ["Engine", "EngineStatistics"]


@attrs.frozen
class EngineStatistics:
    """A snapshot of the engine, cheap to take at any time."""

    num_waiting: int
    num_running: int
    num_open_requests: int
    num_free_blocks: int
    num_blocks: int
    num_steps: int
    num_tokens_scheduled: int
    num_tokens_generated: int
    num_preemptions: int
    num_failed_steps: int
    #: Seconds the bookkeeping stroke spent in its own work (planning, applying, delivering).
    bookkeeping_seconds: float
    #: Seconds the forward stroke spent launching steps (on the CPU: running them).
    forward_seconds: float
    #: Seconds the forward stroke sat waiting for the next plan (the device idled on Python).
    forward_idle_seconds: float


@attrs.define(eq=False)
class _Tracked:
    """The engine's side of one open request."""

    request: Request
    handle: RequestHandle
    detokenizer: IncrementalDetokenizer
    logprobs: list[Any] | None


class Engine:
    """A running engine. Use :meth:`open`; the constructor is internal."""

    def __init__(
        self,
        *,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        device: Device,
        config: EngineConfig,
        num_blocks: int,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._runner = runner
        self._device = device
        max_model_len = config.max_model_len or runner.max_model_len
        self.max_model_len = min(max_model_len, runner.max_model_len)
        self._scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=num_blocks,
                block_size=config.block_size,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len,
                pipeline_depth=config.pipeline_depth,
            ),
            clock=anyio.current_time,
        )
        self._ids = itertools.count()
        self._tracked: dict[int, _Tracked] = {}
        self._cancels: collections.deque[int] = collections.deque()
        self._wakeup = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self._closing = False
        self._cancel_on_close = False
        self._death: BaseException | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._num_failed_steps = 0
        self._bookkeeping_seconds = 0.0
        self._forward_seconds = 0.0
        self._forward_idle_seconds = 0.0
        depth = config.pipeline_depth
        plans: tuple[MemoryObjectSendStream[StepPlan], MemoryObjectReceiveStream[StepPlan]]
        plans = anyio.create_memory_object_stream[StepPlan](depth)
        self._plans_send, self._plans_receive = plans
        results = anyio.create_memory_object_stream[Completion[RunnerOutput]](depth)
        self._results_send, self._results_receive = results

    # --- lifecycle ----------------------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        model: str | None = None,
        *,
        runner: ModelRunner | None = None,
        tokenizer: Tokenizer | None = None,
        device: Device | str = "auto",
        **config: Any,
    ) -> AsyncIterator[Engine]:
        """Start an engine for the body of an ``async with`` block.

        Args:
            model: A model name (``"smollm2"``, or ``"toy"`` for the model-free toy runner),
                a Hugging Face model directory, or a GGUF file.
            runner: A ready :class:`ModelRunner` instead of ``model`` (with ``tokenizer``).
            tokenizer: The tokenizer that goes with ``runner``.
            device: ``"auto"``, ``"cuda"``, ``"cpu"``, ``"fake"`` or a
                :class:`~twostroke.gpu.device.Device`.
            **config: Fields of :class:`EngineConfig`.

        Leaving the block drains open requests (or cancels them, with
        ``shutdown="cancel"``, or when the body raised). If a stroke dies, every open
        waiter gets :class:`EngineDead` and the block raises it.
        """
        engine_config = EngineConfig(**config)
        if isinstance(device, str):
            device = select_device(device)
        if runner is None:
            from twostroke.engine.runners.loading import load_runner

            runner, tokenizer = load_runner(model, device=device, config=engine_config)
        elif model is not None:
            raise TypeError("pass either model or runner, not both")
        if tokenizer is None:
            raise TypeError("a runner needs a tokenizer: pass tokenizer=...")
        num_blocks = _size_pool(runner, device, engine_config)
        runner.allocate_kv_cache(num_blocks, engine_config.block_size)
        engine = cls(
            runner=runner,
            tokenizer=tokenizer,
            device=device,
            config=engine_config,
            num_blocks=num_blocks,
        )
        body_error: BaseException | None = None
        async with anyio.create_task_group() as task_group:
            engine._task_group = task_group
            await task_group.start(engine._forward_stroke)
            await task_group.start(engine._bookkeeping_stroke)
            try:
                yield engine
            except BaseException as exc:
                # Kept out of the task group so the caller sees its own exception, not a
                # group; the strokes are told to cancel their work and exit.
                body_error = exc
                engine._close(cancel=True)
            else:
                engine._close(cancel=engine_config.shutdown == "cancel")
        if engine._death is not None:
            raise EngineDead(f"the engine died: {engine._death!r}") from engine._death
        if body_error is not None:
            raise body_error

    def _close(self, *, cancel: bool) -> None:
        self._closing = True
        self._cancel_on_close = cancel
        if cancel:
            self._cancels.extend(self._tracked)
        self._wakeup.set()

    def _check_open(self) -> None:
        if self._death is not None:
            raise EngineDead(f"the engine died: {self._death!r}") from self._death
        if self._closing:
            raise EngineClosed("the engine is closed: its async with block was left")

    # --- public API ---------------------------------------------------------------------

    def submit(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestHandle:
        """Queue a request and return its handle at once.

        Args:
            prompt: Text, token ids, or chat messages (the model's chat template applies).
            params: Sampling parameters (``SamplingParams()`` when omitted).

        Raises:
            TypeError, ValueError: a malformed prompt or parameters.
            RequestRejected: the request can never fit (context length or KV pool).
            EngineClosed, EngineDead: the engine no longer takes work.
        """
        self._check_open()
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt_token_ids = tokenize_prompt(prompt, self.tokenizer)
        request_id = next(self._ids)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            params=params,
            arrival_time=anyio.current_time(),
            eos_token_ids=self.tokenizer.eos_token_ids,
        )
        self._scheduler.add_request(request)  # validates; raises before anything changes
        handle = RequestHandle(request_id, request.prompt_token_ids, self._enqueue_cancel)
        self._tracked[request_id] = _Tracked(
            request=request,
            handle=handle,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            ),
            logprobs=[] if params.logprobs is not None else None,
        )
        self._idle = anyio.Event() if self._idle.is_set() else self._idle
        self._wakeup.set()
        return handle

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestOutput:
        """Generate a complete output.

        Cancelling the calling task (or a timeout around it) cancels the request.

        Raises:
            RequestFailed: a step of this request failed (the engine keeps serving).
            EngineDead, EngineClosed: the engine stopped before the request finished.
            TypeError, ValueError, RequestRejected: bad input (nothing was queued).
        """
        await anyio.lowlevel.checkpoint()
        handle = self.submit(prompt, params)
        try:
            return await handle.result()
        finally:
            handle.cancel()  # no-op once done; only enqueues, never awaits

    @asynccontextmanager
    async def stream(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> AsyncIterator[RequestHandle]:
        """Stream a request's output: ``async for delta in deltas`` inside the block.

        Leaving the block before the last delta (or being cancelled) cancels the request.
        """
        await anyio.lowlevel.checkpoint()
        handle = self.submit(prompt, params)
        try:
            yield handle
        finally:
            handle.cancel()

    async def wait_idle(self) -> None:
        """Wait until no request is open and no step is in flight. Always a checkpoint."""
        await anyio.lowlevel.checkpoint()
        await self._idle.wait()

    def statistics(self) -> EngineStatistics:
        stats = self._scheduler.statistics()
        return EngineStatistics(
            num_waiting=stats.num_waiting,
            num_running=stats.num_running,
            num_open_requests=len(self._tracked),
            num_free_blocks=stats.num_free_blocks,
            num_blocks=stats.num_blocks,
            num_steps=stats.num_steps_completed,
            num_tokens_scheduled=stats.num_tokens_scheduled,
            num_tokens_generated=stats.num_tokens_generated,
            num_preemptions=stats.num_preemptions,
            num_failed_steps=self._num_failed_steps,
            bookkeeping_seconds=self._bookkeeping_seconds,
            forward_seconds=self._forward_seconds,
            forward_idle_seconds=self._forward_idle_seconds,
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the engine's or the scheduler's books disagree."""
        self._scheduler.check_invariants()
        for request_id, tracked in self._tracked.items():
            assert not tracked.handle.done(), f"request {request_id} is done but still tracked"
        if self._idle.is_set():
            assert self._scheduler.is_idle(), "idle, yet the scheduler holds requests"
            assert not self._tracked, "idle, yet requests are open"

    def __repr__(self) -> str:
        return (
            f"<Engine {len(self._tracked)} open, {self._scheduler!r}, "
            f"{'closing' if self._closing else 'open'}>"
        )

    # --- the forward stroke -------------------------------------------------------------

    async def _forward_stroke(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Launch each plan on the device; send its completion back before it is done."""
        async with self._plans_receive, self._results_send:
            task_status.started()
            try:
                started = False
                while True:
                    waited = time.perf_counter()
                    try:
                        plan = await self._plans_receive.receive()
                    except anyio.EndOfStream:
                        break
                    launched = time.perf_counter()
                    if started:  # before the first plan the engine is just empty
                        self._forward_idle_seconds += launched - waited
                    started = True
                    completion: Completion[RunnerOutput] = Completion()
                    await self._results_send.send(completion)
                    await self._device.run(partial(self._runner.execute, plan), completion)
                    self._forward_seconds += time.perf_counter() - launched
            except Exception as exc:
                self._die(exc)

    # --- the bookkeeping stroke ---------------------------------------------------------

    async def _bookkeeping_stroke(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        scheduler = self._scheduler
        inflight: collections.deque[StepPlan] = collections.deque()
        task_status.started()
        try:
            async with self._plans_send, self._results_receive:
                while True:
                    began = time.perf_counter()
                    self._apply_cancels()
                    while scheduler.can_schedule:
                        plan = scheduler.schedule()
                        if plan is None:
                            break
                        self._plans_send.send_nowait(plan)  # room for pipeline_depth plans
                        inflight.append(plan)
                    self._bookkeeping_seconds += time.perf_counter() - began
                    if not inflight:
                        self._update_idle()
                        if self._closing and not self._tracked:
                            break
                        await self._wakeup.wait()
                        self._wakeup = anyio.Event()
                        continue
                    plan = inflight.popleft()
                    await self._complete(plan)
        except Exception as exc:
            self._die(exc)
        finally:
            self._fail_open_requests()

    async def _complete(self, plan: StepPlan) -> None:
        """Await the oldest step in flight and apply its outcome."""
        completion = await self._results_receive.receive()
        output: RunnerOutput | None = None
        cause: Exception | None = None
        try:
            output = await completion
        except Exception as exc:
            cause = exc
        began = time.perf_counter()
        if output is not None:
            report = self._scheduler.apply(StepOutcome(plan.step_id, output.sampled))
        else:
            self._num_failed_steps += 1
            report = self._scheduler.apply(StepFailure(plan.step_id, repr(cause)))
        self._deliver(report, output, cause)
        self._bookkeeping_seconds += time.perf_counter() - began

    def _apply_cancels(self) -> None:
        while self._cancels:
            request_id = self._cancels.popleft()
            tracked = self._tracked.get(request_id)
            self._scheduler.cancel(request_id)
            if tracked is not None:
                error: BaseException = RequestCancelled(request_id)
                if self._closing and self._cancel_on_close:
                    error = EngineClosed(f"the engine closed before request {request_id} finished")
                self._end(tracked, None, error)

    def _enqueue_cancel(self, request_id: int) -> None:
        if request_id in self._tracked:
            self._cancels.append(request_id)
            self._wakeup.set()

    def _update_idle(self) -> None:
        if not self._tracked and self._scheduler.is_idle():
            self._idle.set()

    # --- delivery -----------------------------------------------------------------------

    def _deliver(
        self, report: StepReport, output: RunnerOutput | None, cause: Exception | None
    ) -> None:
        now = anyio.current_time()
        for request_id, token_id in report.new_tokens:
            tracked = self._tracked[request_id]
            logprobs = None
            if tracked.logprobs is not None and output is not None:
                entry = output.logprobs.get(request_id)
                if entry is not None:
                    tracked.logprobs.append(entry)
                    logprobs = (entry,)
            update = tracked.detokenizer.push([token_id])
            reason: FinishReason | None = None
            if update.stopped:
                self._scheduler.finish(request_id, FinishReason.STOP)
                reason = FinishReason.STOP
            delta = Delta(request_id, update.text, (token_id,), logprobs)
            tracked.handle._deliver(delta)
            if reason is not None:
                self._finish(tracked, reason, now)
        for request_id, reason in report.finished:
            ended = self._tracked.get(request_id)
            if ended is not None:  # not already ended by a stop string
                tail = ended.detokenizer.flush()
                ended.handle._deliver(Delta(request_id, tail, ()))
                self._finish(ended, reason, now)
        for request_id in report.failed:
            failed = self._tracked.get(request_id)
            if failed is not None:
                error = RequestFailed(request_id, repr(cause))
                error.__cause__ = cause
                self._end(failed, None, error)

    def _finish(self, tracked: _Tracked, reason: FinishReason, now: float) -> None:
        request = tracked.request
        handle = tracked.handle
        handle._deliver(Delta(request.request_id, finish_reason=reason))
        output_ids = request.output_token_ids
        ttft = None if request.first_token_time is None else request.first_token_time
        e2e = now - request.arrival_time
        ttft_s = None if ttft is None else ttft - request.arrival_time
        tpot = None
        if ttft_s is not None and len(output_ids) > 1:
            tpot = (e2e - ttft_s) / (len(output_ids) - 1)
        queue_time = None
        if request.first_scheduled_time is not None:
            queue_time = request.first_scheduled_time - request.arrival_time
        output = RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=output_ids,
            text=tracked.detokenizer.text,
            finish_reason=reason,
            usage=Usage(request.num_prompt_tokens, len(output_ids)),
            metrics=RequestMetrics(
                queue_time=queue_time,
                ttft=ttft_s,
                tpot=tpot,
                e2e=e2e,
                num_preemptions=request.num_preemptions,
            ),
            logprobs=tuple(tracked.logprobs) if tracked.logprobs is not None else None,
        )
        self._end(tracked, output, None)

    def _end(
        self, tracked: _Tracked, output: RequestOutput | None, error: BaseException | None
    ) -> None:
        del self._tracked[tracked.request.request_id]
        tracked.handle._finish(output, error)

    # --- death --------------------------------------------------------------------------

    def _die(self, exc: BaseException) -> None:
        """A stroke failed: fail every waiter now and stop the engine."""
        if self._death is None:
            self._death = exc
        self._fail_open_requests()
        if self._task_group is not None:
            self._task_group.cancel_scope.cancel()

    def _fail_open_requests(self) -> None:
        for tracked in list(self._tracked.values()):
            request_id = tracked.request.request_id
            error: BaseException
            if self._death is not None:
                error = EngineDead(f"the engine died: {self._death!r}")
                error.__cause__ = self._death
            else:
                error = EngineClosed(f"the engine closed before request {request_id} finished")
            self._end(tracked, None, error)
        self._idle.set()


def _size_pool(runner: ModelRunner, device: Device, config: EngineConfig) -> int:
    """Blocks in the KV pool: as configured, or as many as the memory budget holds."""
    if config.num_blocks is not None:
        return config.num_blocks
    per_block = runner.kv_cache_bytes_per_block(config.block_size)
    budget = config.kv_cache_memory
    if budget is None:
        budget = 0.5 if device.kind == "cuda" else 1 << 30
    if isinstance(budget, float):
        budget = int(budget * _free_memory(device))
    num_blocks = budget // max(per_block, 1)
    needed = math.ceil(runner.max_model_len / config.block_size)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory ({budget} bytes) holds no KV block of {per_block} bytes")
    return int(min(num_blocks, max(needed * config.max_num_seqs, needed)))


def _free_memory(device: Device) -> int:
    """Bytes of memory free on ``device`` (host memory for the CPU)."""
    if device.kind == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device.torch_device)
        return int(free)
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30
