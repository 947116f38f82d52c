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

Callers talk to the engine through :meth:`Engine.submit`, :meth:`Engine.generate` and
:meth:`Engine.stream`. They add requests to the scheduler synchronously (all scheduler access
happens on the event loop between awaits), but cancellations are only *enqueued* and applied by
the bookkeeping stroke at a step boundary, so that cleanup code never awaits and never races a
step.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
import attrs
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from twostroke.engine.config import EngineConfig
from twostroke.engine.errors import (
    EngineClosed,
    EngineDead,
    RequestCancelled,
    RequestFailed,
    RequestRejected,
)
from twostroke.engine.handle import RequestHandle, create_request_handle
from twostroke.engine.outputs import RequestOutput
from twostroke.engine.runners.pool_size import WindowedPool, size_pool, size_windowed_pool
from twostroke.engine.runners.protocol import (
    InvariantRunner,
    ModelRunner,
    PlannedRunner,
    WindowApartRunner,
    WindowedRunner,
)
from twostroke.engine.statistics import EngineStatistics
from twostroke.engine.strokes.delivery import Deliveries, Tracked
from twostroke.engine.strokes.launcher import Launcher
from twostroke.engine.structured.constraining import Constraining
from twostroke.engine.structured.masks import StepMasks
from twostroke.engine.text.detokenizer import IncrementalDetokenizer
from twostroke.engine.text.prompt_ids import tokenize_prompt
from twostroke.engine.text.tokenizer import Tokenizer
from twostroke.gpu.completion import Completion
from twostroke.gpu.cores import ThreadGovernor
from twostroke.gpu.device import Device
from twostroke.gpu.selection import resolve_device
from twostroke.states.constraints import Constraint, Matcher
from twostroke.states.errors import ConstraintRejected, EngineOverloaded
from twostroke.states.params import SamplingParams, check_params
from twostroke.states.plan import RunnerOutput, StepFailure, StepPlan, TokenLogprobs
from twostroke.states.prompts import Prompt
from twostroke.states.request import ConstraintCompiled, Request
from twostroke.states.scheduler import Scheduler, SchedulerConfig
from twostroke.states.validators import is_int
from twostroke.states.windowed import WindowedKV

if TYPE_CHECKING:
    from twostroke.engine.models.plan import RunPlan

__all__ = ["TOKENIZER_THREADS", "Engine"]

#: Worker threads an engine tokenizes prompts and renders chat templates in, at most, at once
#: (:meth:`Engine.tokenize`, :meth:`Engine.generate`, :meth:`Engine.stream`). Two: a
#: tokenizer's Rust code runs beside the event loop, and a burst of huge prompts waits in
#: line instead of taking every core from the forward pass.
TOKENIZER_THREADS = 2


class _Plan(NamedTuple):
    """A plan on its way to the forward stroke."""

    plan: StepPlan
    #: Made while a step was in flight or right after one was applied (not after idling).
    continues: bool
    #: The token masks of its constrained rows (``None``: it has none).
    masks: StepMasks | None


class _Launched(NamedTuple):
    """A launched step on its way back to the bookkeeping stroke."""

    #: The plan's step id: what the scheduler applies a failure of this step to.
    step_id: int
    completion: Completion[RunnerOutput]


_log = logging.getLogger(__name__)


def _without_prefix_caching(config: EngineConfig, windowed: WindowedPool) -> EngineConfig:
    """``config`` as the engine runs it where the windowed layers keep their KV apart: no
    prefix caching (a hit would skip positions whose windowed KV is not kept). Says so,
    with the windowed pool's size, once, in the log."""
    notes = [f"room for {windowed.num_windows} requests' whole windows at once"]
    if config.enable_prefix_caching:
        notes.append("prefix caching off (swa_full=True keeps it)")
    _log.info(
        "the sliding-window layers keep only their window, apart: %d blocks (%.1f MiB)%s",
        windowed.kv.num_blocks,
        windowed.num_bytes / (1 << 20),
        "".join(f"; {note}" for note in notes),
    )
    return attrs.evolve(config, enable_prefix_caching=False)


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
        model_name: str = "model",
        windowed_kv: WindowedKV | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self._model_name = model_name
        self._runner = runner
        self._device = device
        self._constraining = Constraining(tokenizer, pin_memory=device.kind == "cuda")
        max_model_len = config.max_model_len or runner.max_model_len
        self._max_model_len = min(max_model_len, runner.max_model_len)
        window = runner.kv_window if isinstance(runner, WindowedRunner) else None
        sized = SchedulerConfig.sized(
            config,
            num_blocks=num_blocks,
            max_model_len=self._max_model_len,
            # (a window as long as the context gives nothing back: none)
            sliding_window=window if window is not None and window < self._max_model_len else None,
            windowed_kv=windowed_kv,
        )
        self._scheduler = Scheduler(sized, clock=anyio.current_time)
        # Characters no prompt of max_model_len tokens can exceed: longer text is refused
        # before the tokenizer runs (it would hold a worker thread for seconds a megabyte).
        self._max_prompt_chars = self._max_model_len * tokenizer.max_token_chars
        self._tokenizing = anyio.CapacityLimiter(TOKENIZER_THREADS)
        self._ids = itertools.count()
        self._open = Deliveries(self._scheduler.finish_on_stop_string)
        self._cancels: list[int] = []
        # Bound once and shared by every handle: a method bound per submit would be one more
        # object per open request for the collector to track (16k submits: one more full
        # collection).
        self._cancel_callback = self._enqueue_cancel
        self._wakeup = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self._closing = False
        self._cancel_on_close = False
        self._death: BaseException | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        # The last step whose launch failed: the forward stroke drops the rows it strands
        # from the next plan (already planned, one step ahead) before the runner sees it.
        # Written and read only by the forward stroke's launches, which run one at a time.
        self._num_failed_steps = 0
        self._bookkeeping_seconds = 0.0
        # On the CPU, unless the user fixed the count: as many torch threads as the cores
        # other work leaves free, chosen between steps (twostroke.gpu.cores).
        governor = None
        if device.kind == "cpu" and config.torch_threads is None:
            from twostroke.engine.runners.loading import default_torch_threads

            governor = ThreadGovernor(default_torch_threads())
        self._launcher = Launcher(runner, block_size=config.block_size, governor=governor)
        depth = config.pipeline_depth
        # Each plan travels with whether it continues a busy run (made while a step was in
        # flight or right after one was applied), so its launch can tell an idle device that
        # waited on Python from one that had nothing to do.
        plans: tuple[MemoryObjectSendStream[_Plan], MemoryObjectReceiveStream[_Plan]]
        plans = anyio.create_memory_object_stream[_Plan](depth)
        self._plans_send, self._plans_receive = plans
        results = anyio.create_memory_object_stream[_Launched](depth)
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
        model_name: str | None = None,
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
            model_name: The name the engine serves the model under (default: ``model`` as
                given, or the runner's class name).
            **config: Fields of :class:`EngineConfig`.

        Leaving the block drains open requests (or cancels them, with
        ``shutdown="cancel"``, or when the body raised). If a stroke dies, every open
        waiter gets :class:`EngineDead` and the block raises it.

        Raises:
            TypeError, ValueError: a bad configuration field, device or model argument.
            ModelLoadError, TokenizerLoadError: the model cannot be loaded.
            DeviceUnavailable: the device asked for is not on this machine.
        """
        engine_config = EngineConfig(**config)
        device = resolve_device(device)
        if model_name is not None and not isinstance(model_name, str):
            raise TypeError(f"model_name must be a str, got {type(model_name).__name__}")
        if runner is None:
            from twostroke.engine.runners.loading import (
                DEFAULT_MODEL,
                load_runner,
                set_intra_op_threads,
            )

            name = model if model is not None else DEFAULT_MODEL
            # Before the device's thread starts: it takes the count this thread has.
            set_intra_op_threads(engine_config, device)
        elif model is not None:
            raise TypeError("pass either model or runner, not both")
        elif tokenizer is None:
            raise TypeError("a runner needs a tokenizer: pass tokenizer=...")
        else:
            name = type(runner).__name__
        body_error: BaseException | None = None
        # The device holds what runs steps (on the CPU, one long-lived forward thread that
        # keeps torch's OpenMP team) for exactly the engine's life. The model loads and its
        # cache is made there too: the event loop serves its other tasks meanwhile, and the
        # process keeps one OpenMP team (docs/performance-log.md, "Spinning waits inside the
        # engine").
        async with device:
            if runner is None:
                load = partial(load_runner, model, device=device, config=engine_config)
                loaded: tuple[ModelRunner, Tokenizer] = await device.call(load)
                runner, tokenizer = loaded
            assert tokenizer is not None  # given with the runner, or loaded with it
            windowed = size_windowed_pool(runner, device, engine_config)
            num_blocks = size_pool(runner, device, engine_config, windowed)
            if windowed is None:
                allocate = partial(runner.allocate_kv_cache, num_blocks, engine_config.block_size)
            else:
                assert isinstance(runner, WindowApartRunner)  # size_windowed_pool said so
                allocate = partial(
                    runner.allocate_kv_cache,
                    num_blocks,
                    engine_config.block_size,
                    num_windowed_blocks=windowed.kv.num_blocks,
                )
                engine_config = _without_prefix_caching(engine_config, windowed)
            await device.call(allocate)
            engine = cls(
                runner=runner,
                tokenizer=tokenizer,
                device=device,
                config=engine_config,
                num_blocks=num_blocks,
                windowed_kv=None if windowed is None else windowed.kv,
                model_name=model_name if model_name is not None else name,
            )
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
            self._cancels.extend(self._open)
        self._wakeup.set()

    # --- public API ---------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        """The name the engine serves its model under."""
        return self._model_name

    @property
    def max_model_len(self) -> int:
        """The longest prompt plus output a request may have."""
        return self._max_model_len

    @property
    def plan(self) -> RunPlan | None:
        """What the run decided about its model, once, when it loaded: the weights and their
        form, the activations' and the KV cache's dtypes, and the kernel of each part of a
        step (:class:`~twostroke.engine.models.plan.RunPlan`; :meth:`RunPlan.describe
        <twostroke.engine.models.plan.RunPlan.describe>` says it in one line). ``None`` for a
        runner that was not loaded by a plan (the toy model, a runner of the caller's)."""
        runner = self._runner
        return runner.plan if isinstance(runner, PlannedRunner) else None

    @contextmanager
    def record_steps(self) -> Iterator[list[StepPlan]]:
        """Record the steps the engine launches while the block is open: for replaying a
        workload's steps on the bare model (the bench's bare-forward row) or reading what
        the scheduler made of it.

        The list fills as the device launches each step (in launch order, each plan as
        launched: less the rows a failed step before it stranded); read it once the steps
        of interest are done, after the block. Recordings may nest or overlap.

        Yields:
            The list of :class:`~twostroke.states.plan.StepPlan` launched so far.
        """
        with self._launcher.record() as plans:
            yield plans

    @property
    def deterministic(self) -> bool:
        """Whether a request's tokens and logprobs are a function of the model (its weight
        form, dtype and CPU path included), its prompt, its parameters and its seed alone:
        the same whatever the requests beside it, chunking, prefix-cache hits, preemption,
        drafts and the pipeline depth (``EngineConfig.deterministic``; docs/models.md,
        "One answer per request"). ``False`` for a runner that does not say."""
        runner = self._runner
        return isinstance(runner, InvariantRunner) and runner.deterministic

    def check_health(self) -> None:
        """Return if the engine takes work.

        Raises:
            EngineDead: a stroke died (``__cause__`` is what killed it).
            EngineClosed: the engine's ``async with`` block was left.
        """
        if self._death is not None:
            raise EngineDead(f"the engine died: {self._death!r}") from self._death
        if self._closing:
            raise EngineClosed("the engine is closed: its async with block was left")

    def submit(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestHandle:
        """Queue a request and return its handle at once.

        Args:
            prompt: Text, token ids, or chat messages (the model's chat template applies).
            params: Sampling parameters (``SamplingParams()`` when omitted).

        Returns:
            The request's handle: await :meth:`RequestHandle.result` or iterate its deltas.

        The prompt is tokenized (and given ids are checked) once, here, on the caller's
        thread: text or messages too long to fit the context are refused before the
        tokenizer runs, but what fits still takes the tokenizer's time (milliseconds per
        100 kB, and a chat template's rendering). On an event loop that serves others,
        :meth:`prepare` first (in a worker thread) and submit the ids, as the HTTP server
        does, or use :meth:`generate` or :meth:`stream`, which tokenize off the loop. A
        request whose ``params.max_tokens`` is ``None`` gets as many as the context leaves
        after it.

        Raises:
            TypeError, ValueError: a malformed prompt or parameters (nothing is queued).
            RequestRejected: the request can never be served: too long for the context (the
                error carries the numbers; text or messages longer than the context can
                hold are refused before tokenizing, naming the rule) or the KV pool, or a
                stop token id outside the vocabulary.
            EngineOverloaded: ``max_waiting_requests`` requests are waiting (checked before
                the prompt is tokenized); nothing is queued.
            EngineClosed, EngineDead: the engine no longer takes work.
        """
        params = self._check_submit(params)
        self._check_prompt_size(prompt)
        return self._queue(tokenize_prompt(prompt, self.tokenizer), params)

    async def _submit_off_loop(
        self, prompt: Prompt, params: SamplingParams | None
    ) -> RequestHandle:
        """:meth:`submit`, with the prompt tokenized in a worker thread (:meth:`_tokenize`).

        Cancelled while the prompt tokenizes, it raises the cancel exception once the thread
        is done, with nothing queued.
        """
        checked = self._check_submit(params)
        prompt_token_ids = await self._tokenize(prompt)
        await anyio.lowlevel.checkpoint_if_cancelled()  # the thread ran on, shielded
        # The engine may have closed, or the queue filled, while the thread ran.
        self.check_health()
        self._check_waiting_room()
        return self._queue(prompt_token_ids, checked)

    async def prepare(self, prompt: Prompt) -> tuple[int, ...]:
        """The token ids :meth:`submit` takes for ``prompt`` at once: text and chat messages
        rendered and tokenized in a worker thread (as :meth:`tokenize` does), given ids
        checked. Always a checkpoint.

        For a caller on an event loop that serves others (the HTTP server): prepare each
        prompt, then submit the ids, and :meth:`submit` does no tokenizer work on the loop.
        Refused first, before the tokenizer runs: an engine that takes no work, a full
        waiting queue, text or messages that cannot fit the context. Cancelling the caller
        waits for the thread (the tokenizer cannot be interrupted); nothing is queued.

        Raises:
            TypeError, ValueError: a malformed prompt (a chat template's refusal too).
            RequestRejected: text or messages that cannot fit the context.
            EngineOverloaded: ``max_waiting_requests`` requests are waiting.
            EngineClosed, EngineDead: the engine no longer takes work.
        """
        await anyio.lowlevel.checkpoint()
        self.check_health()
        self._check_waiting_room()  # cheap: before the tokenizer's work
        return await self._tokenize(prompt)

    def _check_submit(self, params: SamplingParams | None) -> SamplingParams:
        """What :meth:`submit` checks before the prompt: the engine takes work, the
        parameters are right, and the waiting queue has room (cheap: before the tokenizer).

        Returns:
            The parameters (``SamplingParams()`` for ``None``).
        """
        self.check_health()
        params = check_params(params)
        if params.stop_token_ids:
            vocab = self.tokenizer.vocab_size
            for index, token_id in enumerate(params.stop_token_ids):
                if token_id >= vocab:  # (SamplingParams checked >= 0)
                    raise RequestRejected(
                        f"stop_token_ids must be in [0, {vocab}), got {token_id} at index {index}"
                    )
        constraint = params.constraint
        if constraint is not None and not self._launcher.applies_masks:
            raise ConstraintRejected(
                "constraint",
                f"this engine's runner ({type(self._runner).__name__}) does not apply constraints",
            )
        self._check_waiting_room()  # cheap: before the tokenizer's work
        return params

    def _check_prompt_size(self, prompt: object) -> bool:
        """Refuse text or chat messages that cannot fit the context, before tokenizing them.

        A token stands for at most ``tokenizer.max_token_chars`` characters, so a text
        longer than ``max_model_len`` times that cannot encode to ``max_model_len`` tokens
        or fewer; nor can more messages than ``max_model_len`` (a template writes at least
        one token for each), or messages whose contents are longer in all than that text.
        Cheap: the lengths only.

        Returns:
            Whether the prompt needs the tokenizer (text or chat messages; given token ids
            are checked on the event loop, in one pass in C).

        Raises:
            RequestRejected: the prompt cannot fit.
        """
        limit, per_token = self._max_prompt_chars, self.tokenizer.max_token_chars
        if isinstance(prompt, str):
            if len(prompt) > limit:
                raise RequestRejected(
                    f"prompt must have at most max_model_len x the longest token's characters "
                    f"= {self._max_model_len} x {per_token} = {limit} characters, "
                    f"got {len(prompt)}"
                )
            return True
        if not isinstance(prompt, list | tuple) or not prompt or is_int(prompt[0]):
            return False
        if len(prompt) > self._max_model_len:
            raise RequestRejected(
                f"messages must number at most max_model_len = {self._max_model_len}, "
                f"got {len(prompt)}"
            )
        # Malformed messages are left to validate_messages, which says which and why.
        chars = sum(
            len(content)
            for message in prompt
            if isinstance(message, Mapping) and isinstance(content := message.get("content"), str)
        )
        if chars > limit:
            raise RequestRejected(
                f"messages must have at most max_model_len x the longest token's characters "
                f"= {self._max_model_len} x {per_token} = {limit} characters of content in "
                f"all, got {chars}"
            )
        return True

    async def _tokenize(self, prompt: object) -> tuple[int, ...]:
        """:func:`tokenize_prompt` for text and chat messages in a worker thread, at most
        :data:`TOKENIZER_THREADS` of them at once, so the event loop serves everything else
        meanwhile; given token ids on the loop (checked in C, no thread needed).

        Cancelling the caller waits for the thread to finish (the tokenizer cannot be
        interrupted); its result is dropped.

        Raises:
            RequestRejected: the prompt cannot fit (:meth:`_check_prompt_size`).
            TypeError, ValueError: a malformed prompt.
        """
        if not self._check_prompt_size(prompt):
            return tokenize_prompt(prompt, self.tokenizer)
        tokenize = partial(tokenize_prompt, prompt, self.tokenizer)
        return await anyio.to_thread.run_sync(tokenize, limiter=self._tokenizing)

    def _queue(self, prompt_token_ids: tuple[int, ...], params: SamplingParams) -> RequestHandle:
        """Queue a request for prompt ids that :func:`tokenize_prompt` gave; its handle."""
        constraint = params.constraint
        max_tokens = params.max_tokens
        if max_tokens is None:  # as many as the context leaves (the scheduler checks it)
            max_tokens = max(self._max_model_len - len(prompt_token_ids), 1)
        request_id = next(self._ids)
        request = Request(
            request_id,
            prompt_token_ids,
            params,
            anyio.current_time(),
            self._eos_token_ids,
            max_tokens=max_tokens,
        )
        if constraint is None:
            self._scheduler.add_request(request)  # validates; raises before anything changes
        else:
            self._scheduler.check_request(request)  # queued once its constraint compiled
        writer, handle = create_request_handle(request_id, prompt_token_ids, self._cancel_callback)
        detokenizer = IncrementalDetokenizer.for_request(self.tokenizer, request)
        logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self._open.track(Tracked(request, writer, detokenizer, logprobs))
        self._idle = anyio.Event() if self._idle.is_set() else self._idle
        if constraint is not None:
            assert self._task_group is not None
            self._constraining.begin(request_id)  # waits for admission from now
            self._task_group.start_soon(self._compile_and_queue, request)
        self._wakeup.set()
        return handle

    def _check_waiting_room(self) -> None:
        """Refuse a new request if ``max_waiting_requests`` wait already, counting those
        whose constraint still compiles (they are queued once it has).

        Raises:
            EngineOverloaded: the queue is full; nothing changes.
        """
        compiling = len(self._constraining.compiling)
        limit = self._scheduler.config.max_waiting_requests
        if not compiling or limit is None:
            self._scheduler.check_waiting_room()
            return
        waiting = self._scheduler.statistics().num_waiting + compiling
        if waiting >= limit:
            raise EngineOverloaded(
                f"the waiting queue is full: {waiting} requests wait for admission ({compiling} "
                f"of them compiling their constraint) and max_waiting_requests is {limit}; "
                "retry later"
            )

    async def _compile_and_queue(self, request: Request) -> None:
        """Compile a request's constraint in a worker thread, then queue the request.

        A refusal (the backend cannot enforce the constraint, did not compile it in time,
        or its matcher raised as the request took it) ends the request with
        :class:`ConstraintRejected`; a request cancelled meanwhile is dropped.
        """
        request_id = request.request_id
        constraint = request.params.constraint
        assert constraint is not None
        error: Exception | None = None
        matcher = None
        try:
            matcher = await self._constraining.matcher(request_id, constraint)
        except ConstraintRejected as exc:
            error = exc
        if request_id not in self._open:  # cancelled, or the engine closed meanwhile
            self._update_idle()
            self._wakeup.set()
            return
        if error is None:
            assert matcher is not None  # only a cancelled request's compile gives none
            error = _attach(request, matcher, constraint)
        if error is None:
            try:
                self._scheduler.add_request(request)
            except (RequestRejected, EngineOverloaded) as exc:  # the queue filled meanwhile
                error = exc
        if error is not None:
            self._open.end(request_id, error)
            self._update_idle()
        self._wakeup.set()

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestOutput:
        """Generate a complete output.

        Cancelling the calling task (or a timeout around it) cancels the request.

        Raises:
            RequestFailed: a step of this request failed (the engine keeps serving).
            EngineDead, EngineClosed: the engine stopped before the request finished.
            TypeError, ValueError, RequestRejected: bad input (nothing was queued).
        """
        await anyio.lowlevel.checkpoint()
        handle = await self._submit_off_loop(prompt, params)
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

        Raises:
            TypeError, ValueError, RequestRejected: bad input (nothing was queued).
            EngineClosed, EngineDead: the engine no longer takes work.
        """
        await anyio.lowlevel.checkpoint()
        handle = await self._submit_off_loop(prompt, params)
        try:
            yield handle
        finally:
            handle.cancel()

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """The token ids a request with this prompt would compute. Always a checkpoint.

        Text and chat messages are tokenized in a worker thread (as :meth:`generate` and
        :meth:`stream` do): the event loop serves other requests meanwhile. Cancelling the
        caller waits for that thread.

        Raises:
            TypeError, ValueError: a malformed prompt.
            RequestRejected: text or messages that cannot fit the context (checked before
                the tokenizer runs).
        """
        await anyio.lowlevel.checkpoint()
        return list(await self._tokenize(prompt))

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``. Always a checkpoint.

        Raises:
            TypeError: ``token_ids`` is not a sequence of ints.
            ValueError: a token id is outside the vocabulary.
        """
        await anyio.lowlevel.checkpoint()
        if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence):
            raise TypeError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
        vocab = self.tokenizer.vocab_size
        for index, token_id in enumerate(token_ids):
            if not is_int(token_id):
                raise TypeError(
                    f"token ids must be ints, got {type(token_id).__name__} at index {index}"
                )
            if not 0 <= token_id < vocab:
                raise ValueError(
                    f"token ids must be in [0, {vocab}), got {token_id} at index {index}"
                )
        return self.tokenizer.decode(list(token_ids))

    async def wait_idle(self) -> None:
        """Wait until no request is open and no step is in flight. Always a checkpoint."""
        await anyio.lowlevel.checkpoint()
        await self._idle.wait()

    def statistics(self) -> EngineStatistics:
        """A snapshot of the engine's counters and gauges: its scheduler's, and its own.

        ``num_waiting`` counts the requests whose constraint still compiles: they wait for
        admission too (the server's and the engine's ``max_waiting_requests`` count them).
        """
        governor = self._launcher.governor
        scheduler = attrs.asdict(self._scheduler.statistics(), recurse=False)
        scheduler["num_waiting"] += len(self._constraining.compiling)
        return EngineStatistics(
            **scheduler,
            num_open_requests=len(self._open),
            num_failed_steps=self._num_failed_steps,
            bookkeeping_seconds=self._bookkeeping_seconds,
            forward_seconds=self._launcher.timer.forward_seconds,
            forward_idle_seconds=self._launcher.timer.forward_idle_seconds,
            torch_threads=self._torch_threads(),
            num_torch_thread_changes=0 if governor is None else governor.changes,
            num_masked_rows=self._constraining.num_masked_rows,
            mask_fill_seconds=self._constraining.mask_fill_seconds,
            mask_wait_seconds=self._constraining.mask_wait_seconds(self._scheduler),
        )

    def _torch_threads(self) -> int:
        """The forward pass's torch threads now: the governor's count, the configured one on
        the CPU, or 0."""
        if self._launcher.governor is not None:
            return self._launcher.governor.threads
        if self._device.kind == "cpu" and self.config.torch_threads is not None:
            return self.config.torch_threads
        return 0

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the engine's or the scheduler's books disagree."""
        self._scheduler.check_invariants()
        for tracked in self._open.values():
            request_id = tracked.request.request_id
            if request_id in self._constraining.compiling:
                continue
            assert not tracked.writer.handle.done(), f"request {request_id} is done but still open"
            assert self._scheduler.get(request_id) is tracked.request, (
                f"request {request_id} is open but the scheduler has no record of it"
            )
        if self._idle.is_set():
            assert self._scheduler.is_idle(), "idle, yet the scheduler holds requests"
            assert not self._open, "idle, yet requests are open"

    def __repr__(self) -> str:
        return (
            f"<Engine {self._model_name!r} {len(self._open)} open, {self._scheduler!r}, "
            f"{'dead' if self._death else 'closing' if self._closing else 'open'}>"
        )

    # --- the forward stroke -------------------------------------------------------------

    async def _forward_stroke(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Launch each plan on the device; send its completion back before it is done.

        The device queues the launch (on the CPU, behind the step its thread is computing) and
        ``run`` returns, so with ``pipeline_depth=2`` step N+1 is queued while step N runs
        and the device goes from one to the other without waiting for this loop.
        """
        async with self._plans_receive, self._results_send:
            task_status.started()
            try:
                async for plan, continues, masks in self._plans_receive:
                    completion: Completion[RunnerOutput] = Completion()
                    await self._results_send.send(_Launched(plan.step_id, completion))
                    launch = partial(self._launcher, plan, continues, masks)
                    await self._device.run(launch, completion)
            except Exception as exc:
                self._die(exc)

    # --- the bookkeeping stroke ---------------------------------------------------------

    async def _bookkeeping_stroke(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        scheduler = self._scheduler
        task_status.started()
        try:
            async with self._plans_send, self._results_receive:
                applied = False  # whether a step was applied since the engine was last idle
                while True:
                    began = time.perf_counter()
                    self._apply_cancels()
                    while scheduler.can_schedule:
                        continues = applied or scheduler.num_inflight_steps > 0
                        plan = scheduler.schedule()
                        if plan is None:
                            break
                        masks = self._constraining.masks_for(plan)
                        if masks is not None:  # filled now if no step is before it
                            await self._fill_oldest_masks()
                        # room for pipeline_depth plans
                        self._plans_send.send_nowait(_Plan(plan, continues, masks))
                    self._bookkeeping_seconds += time.perf_counter() - began
                    if not scheduler.num_inflight_steps:
                        self._update_idle()
                        if self._closing and not self._open:
                            break
                        applied = False
                        await self._wakeup.wait()
                        self._wakeup = anyio.Event()
                        continue
                    await self._complete()
                    await self._fill_oldest_masks()
                    applied = True
        except Exception as exc:
            self._die(exc)
        finally:
            self._fail_open_requests()

    async def _complete(self) -> None:
        """Await the oldest step in flight and apply its outcome.

        Raises:
            TimeoutError: the step took longer than ``step_timeout`` (the device hangs).
            Exception: the step failed and the device cannot run work any more (the step's
                error): the engine dies of it.
        """
        output: RunnerOutput | None = None
        cause: Exception | None = None
        with anyio.move_on_after(self.config.step_timeout) as deadline:
            launched = await self._results_receive.receive()
            try:
                output = await launched.completion
            except Exception as exc:
                cause = exc
        if deadline.cancelled_caught:
            self._device.abandon()  # a step stuck on the device's thread must not hold the exit
            raise TimeoutError(
                f"step {self._scheduler.inflight_plans[0].step_id} did not complete within "
                f"step_timeout ({self.config.step_timeout} s): the device hangs"
            )
        if cause is not None and await self._device_failed(cause):
            raise cause
        began = time.perf_counter()
        if output is not None:
            report = self._scheduler.apply(output)  # checks the runner's step id
        else:
            self._num_failed_steps += 1
            report = self._scheduler.apply(StepFailure(launched.step_id, repr(cause)))
        self._end_constraint_failures(report.failed)
        self._open.deliver(report, output, cause)
        self._bookkeeping_seconds += time.perf_counter() - began

    # --- constraints --------------------------------------------------------------------

    async def _fill_oldest_masks(self) -> None:
        """Fill the masks of the oldest step in flight, now that every step before it is
        applied: while its layers run (at depth 2), before it samples. In a worker thread:
        the loop serves other tasks meanwhile."""
        await self._constraining.fill_oldest(self._scheduler, self._fail_constrained)

    def _fail_constrained(self, request_id: int, error: RequestFailed) -> None:
        """A constrained request whose matcher gave up fails alone."""
        self._scheduler.fail(request_id, str(error))
        self._open.end(request_id, error)

    def _end_constraint_failures(self, failed: Sequence[int]) -> None:
        """End the requests of a step whose constraint's backend gave up (the scheduler
        failed them as it advanced their matchers) with :class:`ConstraintFailed`, naming
        the limit, rather than a step's ``RequestFailed``."""
        for request_id in failed:
            tracked = self._open.get(request_id)
            if tracked is not None and tracked.request.matcher is not None:
                error = self._constraining.failure_of(tracked.request)
                if error is not None:
                    self._open.end(request_id, error)

    def _apply_cancels(self) -> None:
        cancels, self._cancels = self._cancels, []
        for request_id in cancels:
            self._scheduler.cancel(request_id)
            self._constraining.cancel(request_id)  # if it still compiles: not any more
            if request_id in self._open:
                error: BaseException = RequestCancelled(request_id)
                if self._closing and self._cancel_on_close:
                    error = EngineClosed(f"the engine closed before request {request_id} finished")
                self._open.end(request_id, error)

    def _enqueue_cancel(self, request_id: int) -> None:
        if request_id in self._open:
            self._cancels.append(request_id)
            self._wakeup.set()

    def _update_idle(self) -> None:
        if not self._open and self._scheduler.is_idle():
            self._idle.set()

    # --- death --------------------------------------------------------------------------

    async def _device_failed(self, cause: Exception) -> bool:
        """Whether a step's failure is the device's: it can run no more work.

        A step fails on its own (a bad plan, running out of memory) or because the device
        is gone (on CUDA: after an illegal address, a device-side assert or a launch
        failure every later call fails). The message does not tell them apart reliably, so
        the device is probed (:meth:`~twostroke.gpu.device.Device.probe`: a tiny piece of
        work where steps run, and a wait for it). Out of memory is always the step's own:
        the probe would only add to the pressure. A probe past ``step_timeout`` counts as a
        hung device. The probe's error is added to ``cause`` as a note.
        """
        if isinstance(cause, MemoryError | torch.cuda.OutOfMemoryError):
            return False
        try:
            with anyio.fail_after(self.config.step_timeout):
                await self._device.probe()
        except Exception as exc:
            if isinstance(exc, TimeoutError):
                self._device.abandon()
            cause.add_note(f"the device failed a probe after this step failed: {exc!r}")
            return True
        return False

    def _die(self, exc: BaseException) -> None:
        """A stroke failed: fail every waiter now and stop the engine."""
        if self._death is None:
            self._death = exc
        self._fail_open_requests()
        if self._task_group is not None:
            self._task_group.cancel_scope.cancel()

    def _fail_open_requests(self) -> None:
        self._constraining.abandon()  # a runner waiting for masks wakes and fails
        for request_id in self._open:
            error: BaseException
            if self._death is not None:
                error = EngineDead(f"the engine died: {self._death!r}")
                error.__cause__ = self._death
            else:
                error = EngineClosed(f"the engine closed before request {request_id} finished")
            self._open.end(request_id, error)
        self._idle.set()


def _attach(
    request: Request, matcher: Matcher, constraint: Constraint
) -> ConstraintRejected | None:
    """Give a request its compiled constraint's matcher (:class:`ConstraintCompiled`); the
    refusal that ends the request instead, if the matcher raises as it is attached.

    Attaching reads the matcher (the request checks it is at its start), and whatever the
    backend raises there is this request's failure, as a compile's is
    (:meth:`Constraining.matcher <twostroke.engine.structured.constraining.Constraining.matcher>`),
    never the engine's: the request is unchanged by an event it refused.
    """
    try:
        request.apply(ConstraintCompiled(matcher))
    except Exception as exc:
        error = ConstraintRejected(
            f"constraint.{constraint.argument}", f"{type(exc).__name__}: {exc}"
        )
        error.__cause__ = exc
        return error
    return None
