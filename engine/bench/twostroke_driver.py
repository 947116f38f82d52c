"""twostroke's own systems in a benchmark: the engine at depth 2 and 1, and the bare forward.

The **bare forward loop** is the limit the engine is measured against: the same runner
executing *exactly the step plans the depth-2 engine scheduled*, one after another in a plain
loop with no event loop, no bookkeeping and no detokenization, at the same torch thread
count and on the same kind of thread (a fresh
:class:`~twostroke.gpu.forward_thread.ForwardThread`). The ratio of the engine's throughput
to it is the fraction of model time the engine keeps (the overlap's promise is that this is
close to 1).

Both run on the device the driver is given (the CPU by default, so the peers, which run on
the CPU, compare like for like; ``twostroke bench --device cuda`` measures a GPU). On CUDA
the bare loop waits for each step's device work before the next launch: it is the serial
loop, without the engine's overlap.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import anyio
import attrs
import torch

from twostroke.engine.attention.kernels import AttentionKernel
from twostroke.engine.bench.metrics import RequestTiming, SystemResult
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.streaming import request_constraint, stream_workload
from twostroke.engine.bench.workload import Workload, without_json_schemas, without_tools
from twostroke.engine.config import DtypeOption, EngineConfig
from twostroke.engine.engine import Engine
from twostroke.engine.models.loading import LoadedModel, load_model
from twostroke.engine.models.plan import RunPlan, resolve_run
from twostroke.engine.models.source import read_source
from twostroke.engine.runners.loading import default_torch_threads
from twostroke.engine.runners.protocol import ModelRunner
from twostroke.engine.runners.torch import TorchModelRunner
from twostroke.engine.statistics import EngineStatistics
from twostroke.engine.text.tokenizer import HFTokenizer, Tokenizer
from twostroke.gpu.device import Device
from twostroke.gpu.forward_thread import ForwardThread
from twostroke.gpu.selection import select_device
from twostroke.gpu.threads import torch_threads
from twostroke.states.params import SamplingParams
from twostroke.states.plan import StepPlan
from twostroke.states.speculation import SpeculativeConfig, speculative_config

__all__ = [
    "BareForwardDriver",
    "TwostrokeDriver",
    "engine_drivers",
    "release_unneeded",
    "speculative_drivers",
]


def _intra_op_threads(model: ModelSpec) -> int:
    """torch threads for twostroke given ``--threads`` cores: the engine's own default rule.

    The bare forward loop runs at the same count, so its ratio to the engine is honest.
    """
    return default_torch_threads(model.threads)


@attrs.define
class _Recording:
    """What the depth-2 run leaves for the bare forward replay (its model, until
    :func:`release_unneeded` lets it go) and for the roof (its plans)."""

    #: ``None`` once released: no system left to run replays it.
    loaded: LoadedModel | None
    plans: list[StepPlan]
    num_blocks: int
    #: The windowed layers' own blocks, where they keep their KV apart (else 0).
    num_windowed_blocks: int
    block_size: int
    #: The engine's request id of each workload request.
    request_ids: list[int]


class TwostrokeDriver:
    """The engine through its public async API, streaming every request.

    Args:
        depth: The pipeline depth (2: lookahead, 1: serial).
        device: Where the engine runs: a kind :func:`~twostroke.gpu.selection.select_device`
            takes (``"cpu"``, ``"cuda"``, ``"auto"``).
        unconstrained: Run the workload with its JSON schemas and tools taken off (the same
            prompts and lengths): what the cost of structured output, or of offering tools
            with ``tool_choice`` ``"auto"``, is measured against.
        attention_kernel: The runner's decode attention (``None``: the one it picks).
        engine_options: More :class:`~twostroke.engine.config.EngineConfig` fields. With a
            ``speculative_config``, the system's name ends in ``-spec``, its row reports the
            engine's draft counters, and the bench's greedy check compares its outputs with
            the same system's without speculation.
    """

    def __init__(
        self,
        depth: int,
        *,
        device: str = "cpu",
        unconstrained: bool = False,
        attention_kernel: AttentionKernel | None = None,
        **engine_options: Any,
    ) -> None:
        self.depth = depth
        self.device = device
        self.unconstrained = unconstrained
        self.attention_kernel = attention_kernel
        self.name = f"twostroke-depth{depth}"
        if attention_kernel is not None:
            self.name += f"-{attention_kernel}"
        if engine_options.get("enable_prefix_caching") is False:
            self.name += "-nocache"
        if engine_options.get("quantization") is not None:
            self.name += f"-{engine_options['quantization']}"
        if engine_options.get("deterministic"):
            self.name += "-deterministic"
        #: The thread count is left to the engine (``torch_threads=None``).
        self.governed = (
            "torch_threads" in engine_options and engine_options["torch_threads"] is None
        )
        if self.governed:
            self.name += "-governed"
        if unconstrained:
            self.name += "-unconstrained"
        #: Speculative decoding, checked as the engine would (``None``: off).
        self.speculative_config = speculative_config(engine_options.get("speculative_config"))
        if self.speculative_config is not None:
            engine_options = engine_options | {"speculative_config": self.speculative_config}
            self.name += "-spec"
        self.engine_options = engine_options
        self.recording: _Recording | None = None

    def with_speculation(self, config: SpeculativeConfig) -> TwostrokeDriver:
        """The same system with speculative decoding by ``config`` (named ``...-spec``)."""
        return TwostrokeDriver(
            self.depth,
            device=self.device,
            unconstrained=self.unconstrained,
            attention_kernel=self.attention_kernel,
            **(self.engine_options | {"speculative_config": config}),
        )

    def new_device(self) -> Device:
        """A fresh device of the driver's kind (one per engine run)."""
        return select_device(self.device)

    def check(self) -> str | None:
        return None

    def run(self, workload: Workload, *, model: ModelSpec) -> SystemResult:
        if self.unconstrained:
            workload = without_tools(without_json_schemas(workload))
        with torch_threads(_intra_op_threads(model)):
            return self._run(workload, model)

    def _run(self, workload: Workload, model: ModelSpec) -> SystemResult:
        started = time.perf_counter()
        torch_device = self.new_device().torch_device
        loaded = load_model(self.plan(model, torch_device))
        tokenizer = HFTokenizer.from_pretrained(loaded.source)
        warmup = _warm_up(workload, model, loaded, tokenizer, self.engine_options, self)
        started += warmup
        runner = TorchModelRunner.from_loaded(
            loaded,
            max_num_seqs=self.engine_options.get("max_num_seqs", 64),
            swa_full=self.engine_options.get("swa_full", False),
        )
        request_ids = [-1] * len(workload.requests)
        outputs: list[tuple[int, ...]] = []
        plans: list[StepPlan] = []
        timings, wall, stats, startup = anyio.run(
            functools.partial(
                self._serve,
                workload,
                runner,
                tokenizer,
                started,
                request_ids,
                outputs=outputs,
                plans=plans,
            )
        )
        self.recording = _Recording(
            loaded=loaded,
            plans=plans,
            num_blocks=stats.num_blocks,
            num_windowed_blocks=runner.num_windowed_blocks,
            block_size=self.engine_options.get("block_size", 16),
            request_ids=request_ids,
        )
        return SystemResult(
            name=self.name,
            available=True,
            startup_seconds=startup,
            wall_seconds=wall,
            timings=timings,
            extra={
                "device": str(torch_device),
                "dtype": str(loaded.dtype).removeprefix("torch."),
                "threads": self._threads_described(model, stats),
                "pipeline_depth": self.depth,
                "steps": stats.num_steps,
                "preemptions": stats.num_preemptions,
                "bookkeeping_s": round(stats.bookkeeping_seconds, 3),
                "forward_s": round(stats.forward_seconds, 3),
                "forward_idle_s": round(stats.forward_idle_seconds, 3),
                "warmup_s": round(warmup, 1),
                "weights": _weights(loaded.source, loaded.quantization),
                "quantization": loaded.quantization,
                "projections": loaded.module.kernels.projection.layers,
                "output_projection": loaded.module.kernels.projection.head,
                "attention": runner.attention_kernel,
                "batch_invariant": runner.deterministic,
                **_mask_figures(stats),
                **self._speculation_figures(stats),
            },
            output_token_ids=outputs,
        )

    def plan(self, model: ModelSpec, device: torch.device) -> RunPlan:
        """The run's plan, as the engine makes it from this system's options: ``model``'s
        dtype where it asks for transformers' exact arithmetic, else the engine's
        ``dtype="auto"``."""
        options = {
            name: self.engine_options[name]
            for name in ("quantization", "kv_cache_dtype", "deterministic", "block_size")
            if name in self.engine_options
        }
        dtype = cast(DtypeOption, model.dtype) if model.exact else "auto"
        config = EngineConfig(dtype=dtype, **options)
        source = read_source(model.engine_model, mmap=config.mmap)
        return resolve_run(config, source, device, attention=self.attention_kernel)

    def _speculation_figures(self, stats: Any) -> dict[str, Any]:
        """For a speculating system: its configuration, the engine's draft counters (vLLM's
        names), and the system its greedy outputs must equal."""
        config = self.speculative_config
        if config is None:
            return {}
        return {
            "speculation_off": self.name.removesuffix("-spec"),
            "speculative_config": attrs.asdict(config),
            "spec_decode_drafts": stats.num_spec_decode_drafts,
            "spec_decode_draft_tokens": stats.num_spec_decode_draft_tokens,
            "spec_decode_accepted_tokens": stats.num_spec_decode_accepted_tokens,
            "spec_decode_mean_acceptance_length": round(
                stats.spec_decode_mean_acceptance_length, 3
            ),
            "spec_decode_accepted_per_pos": list(
                stats.spec_decode_accepted_tokens_per_pos[: config.num_speculative_tokens]
            ),
        }

    def _threads_described(self, model: ModelSpec, stats: Any) -> str:
        """The torch threads the row ran on: the bench's count, or, where the engine chose
        (``torch_threads=None``), the count it ended on and how often it changed."""
        if self.governed:
            return (
                f"governed: {stats.torch_threads} torch at the end, "
                f"{stats.num_torch_thread_changes} changes + 1 event loop"
            )
        return f"{_intra_op_threads(model)} torch + 1 event loop"

    async def _serve(
        self,
        workload: Workload,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        started: float,
        request_ids: list[int],
        *,
        outputs: list[tuple[int, ...]] | None = None,
        plans: list[StepPlan] | None = None,
    ) -> tuple[list[RequestTiming], float, Any, float]:
        """Serve ``workload`` on an engine over ``runner``; the steps it launched go into
        ``plans`` (for the bare forward's replay: the warm-up's are not among them)."""
        device = self.new_device()
        options = {
            "pipeline_depth": self.depth,
            "device": device,
            "torch_threads": torch.get_num_threads(),
            **self.engine_options,
        }
        # Held for the engine's life, so every step runs on the device's own forward thread
        # (Engine.open holding it as well only nests).
        async with device, Engine.open(runner=runner, tokenizer=tokenizer, **options) as engine:
            await _compile_constraints(engine, workload)
            warm = engine.statistics()
            startup = time.perf_counter() - started
            with engine.record_steps() as launched:
                streamed = await stream_workload(engine, workload)
            if plans is not None:
                plans[:] = launched
            request_ids[:] = streamed.request_ids
            if outputs is not None:
                outputs[:] = streamed.output_token_ids
            stats = _since(engine.statistics(), warm)
        return list(streamed.timings), streamed.wall_seconds, stats, startup


#: The statistics that count from the engine's start: what the measured run added to them
#: is the difference (the gauges, such as the pool's size, are read as they are).
_CUMULATIVE = (
    "num_steps",
    "num_steps_planned",
    "num_tokens_scheduled",
    "num_tokens_generated",
    "num_preemptions",
    "num_prefix_cache_queries",
    "num_prefix_cache_hits",
    "num_masked_rows",
    "mask_fill_seconds",
    "mask_wait_seconds",
    "bookkeeping_seconds",
    "forward_seconds",
    "forward_idle_seconds",
    "num_spec_decode_drafts",
    "num_spec_decode_draft_tokens",
    "num_spec_decode_accepted_tokens",
)


def _since(stats: EngineStatistics, before: EngineStatistics) -> EngineStatistics:
    """``stats`` with its cumulative counts taken from ``before`` (the warm-up's)."""
    changes: dict[str, Any] = {
        name: getattr(stats, name) - getattr(before, name) for name in _CUMULATIVE
    }
    changes["spec_decode_accepted_tokens_per_pos"] = tuple(
        now - then
        for now, then in zip(
            stats.spec_decode_accepted_tokens_per_pos,
            before.spec_decode_accepted_tokens_per_pos,
            strict=True,
        )
    )
    return attrs.evolve(stats, **changes)


async def _compile_constraints(engine: Engine, workload: Workload) -> None:
    """Compile the workload's constraints on the engine before it is measured, each with a
    one-token request on a one-token prompt: reading the vocabulary for the structured-output
    backend (about a second for SmolLM2's 49,152 tokens) and compiling each distinct schema
    or tools grammar happen once in a server's life, and were 2.9 s of a 19.6 s tools run
    (16 requests of 64 tokens), billed as throughput. They count in the startup column."""
    constraints = {request_constraint(request) for request in workload.requests} - {None}
    for constraint in constraints:
        warm = SamplingParams(max_tokens=1, temperature=0, constraint=constraint)
        await engine.generate([workload.requests[0].prompt_token_ids[0]], warm)


def _mask_figures(stats: Any) -> dict[str, Any]:
    """The structured-output masks' cost, for a run that had any: how many, the bookkeeping
    stroke's time per mask, and how long the runner waited for them (what the forward did
    not hide)."""
    if not stats.num_masked_rows:
        return {}
    return {
        "masked_tokens": stats.num_masked_rows,
        "mask_fill_ms_per_token": round(1000 * stats.mask_fill_seconds / stats.num_masked_rows, 4),
        "mask_fill_s": round(stats.mask_fill_seconds, 3),
        "mask_wait_s": round(stats.mask_wait_seconds, 3),
    }


#: The (model, dtype, threads, device) this process has run a warm-up pass for.
_WARMED: set[tuple[str, str, bool, str | None, int, str, bool]] = set()

#: Output tokens per request in the warm-up pass: every prompt chunk, then a few decodes.
WARMUP_TOKENS = 8


def _warm_up(
    workload: Workload,
    model: ModelSpec,
    loaded: LoadedModel,
    tokenizer: HFTokenizer,
    engine_options: dict[str, Any],
    driver: TwostrokeDriver,
) -> float:
    """Run the workload once, untimed and with few output tokens, the first time a process
    measures this model; return the seconds it took (0 when warm already).

    The first engine run in a process is slower than the next ones on the same shapes:
    measured 2026-11-30 (SmolLM2 bf16, 32 requests, 2 torch threads), the forward thread spent
    0.4-0.9 CPU s more on the first of three runs of the same workload (4-8 %), whatever its
    pipeline depth: oneDNN creates its kernels for each new matrix shape on first use, and
    memory is touched for the first time. Without this pass the bench billed that to
    whichever twostroke system ran first (twostroke-depth2). The peers get no such pass: vLLM
    warms up in its own start-up, and HF static batching has one prefill and one decode shape.
    """
    quantization = engine_options.get("quantization", "auto")
    key = (
        model.name,
        model.dtype,
        model.exact,
        quantization,
        torch.get_num_threads(),
        driver.device,
        # Verifying drafts runs chunks of shapes a step without them never has.
        driver.speculative_config is not None,
    )
    if key in _WARMED:
        return 0.0
    _WARMED.add(key)
    began = time.perf_counter()
    short = attrs.evolve(
        workload,
        requests=[
            attrs.evolve(request, max_tokens=min(request.max_tokens, WARMUP_TOKENS))
            for request in workload.requests
        ],
        arrival_times=None,
    )
    runner = TorchModelRunner.from_loaded(
        loaded,
        max_num_seqs=engine_options.get("max_num_seqs", 64),
        swa_full=engine_options.get("swa_full", False),
    )

    async def serve() -> None:
        device = driver.new_device()
        options = {"device": device, "torch_threads": torch.get_num_threads(), **engine_options}
        async with device, Engine.open(runner=runner, tokenizer=tokenizer, **options) as engine:
            await stream_workload(engine, short)

    anyio.run(serve)
    return time.perf_counter() - began


class BareForwardDriver:
    """The runner alone, replaying the plans a :class:`TwostrokeDriver` run scheduled."""

    name = "bare-forward"

    def __init__(self, source: TwostrokeDriver) -> None:
        self.source = source

    def check(self) -> str | None:
        if self.source.recording is None:
            return f"needs a {self.source.name} run first (it replays that run's step plans)"
        if self.source.recording.loaded is None:
            return f"{self.source.name}'s model was released before this system ran"
        return None

    def run(self, workload: Workload, *, model: ModelSpec) -> SystemResult:
        recording = self.source.recording
        assert recording is not None
        if workload.arrival_times is not None:
            return SystemResult.unavailable(
                self.name, "the bare forward loop replays an offline run only"
            )
        with torch_threads(_intra_op_threads(model)):
            return self._replay(workload, recording, model)

    def _replay(self, workload: Workload, recording: _Recording, model: ModelSpec) -> SystemResult:
        loaded = recording.loaded
        assert loaded is not None  # check() refuses a released recording
        torch_device = loaded.device
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        counts: dict[int, int] = {}
        chunks: dict[int, list[float]] = {}

        def replay() -> float:
            with contextlib.ExitStack() as stack:
                if torch_device.type == "cuda":
                    stack.enter_context(torch.cuda.device(torch_device))
                return replay_steps()

        def replay_steps() -> float:
            # The runner and its cache are made here, on the forward thread, as the engine
            # makes them: zeroing the cache on the calling thread gave that thread an OpenMP
            # team of its own, and with two teams alive GNU OpenMP stops spinning at barriers
            # (the loop's steps, and depth 1's after it, took 28 ms a token against 18).
            runner = TorchModelRunner.from_loaded(
                loaded, swa_full=not recording.num_windowed_blocks
            )
            runner.allocate_kv_cache(
                recording.num_blocks,
                recording.block_size,
                num_windowed_blocks=recording.num_windowed_blocks,
            )
            t0 = time.perf_counter()
            for plan in recording.plans:
                launched = runner.execute(plan)
                if torch_device.type == "cuda":  # the readback is valid once the step ran
                    torch.cuda.synchronize(torch_device)
                output = launched.readback()
                now = time.perf_counter() - t0
                for request_id in output.sampled:
                    first.setdefault(request_id, now)
                    last[request_id] = now
                    counts[request_id] = counts.get(request_id, 0) + 1
                    chunks.setdefault(request_id, []).append(now)
            return time.perf_counter() - t0

        async def on_a_forward_thread() -> float:
            # The kind of thread the engine's steps run on (a fresh one, with its own OpenMP
            # team at this thread count), so the two differ only in what runs around steps.
            async with ForwardThread("twostroke bare forward") as thread:
                return await thread.run(replay)

        wall = anyio.run(on_a_forward_thread)
        timings = [
            RequestTiming(
                prompt_tokens=len(workload.requests[index].prompt_token_ids),
                # A finished request's one wasted lookahead token is not output.
                output_tokens=min(counts[request_id], workload.requests[index].max_tokens),
                start=0.0,
                first_token=first[request_id],
                end=last[request_id],
                chunk_times=chunks[request_id],
            )
            for index, request_id in enumerate(recording.request_ids)
        ]
        return SystemResult(
            name=self.name,
            available=True,
            startup_seconds=0.0,
            wall_seconds=wall,
            timings=timings,
            extra={
                "device": str(torch_device),
                "dtype": str(loaded.dtype).removeprefix("torch."),
                "threads": f"{_intra_op_threads(model)} torch",
                "steps": len(recording.plans),
                "replays": self.source.name,
            },
        )


def engine_drivers(
    *,
    compare_prefix_caching: bool = False,
    compare_unconstrained: bool = False,
    compare_governed: bool = False,
    compare_attention: bool = False,
    compare_deterministic: bool = False,
    device: str = "cpu",
    quantizations: tuple[str, ...] = (),
    **engine_options: Any,
) -> list[Any]:
    """twostroke's systems in the order they must run: depth 2, the bare loop, depth 1,
    with ``compare_prefix_caching`` depth 2 without prefix caching, with
    ``compare_unconstrained`` depth 2 and depth 1 with the workload's JSON schemas and tools
    taken off,
    with ``compare_governed`` depth 2 with its thread count left to the engine (its
    :class:`~twostroke.gpu.cores.ThreadGovernor`, up to every core), with
    ``compare_attention`` depth 2 with the ``"bag"`` decode attention (the compiled kernel's
    fallback), and depth 2 with each of ``quantizations`` (weight precisions), each of those
    last again with ``deterministic=True`` where ``compare_deterministic`` asks (the
    batch-invariant kernels against the fastest); all on ``device``."""
    depth2 = TwostrokeDriver(2, device=device, **engine_options)
    drivers = [
        depth2,
        BareForwardDriver(depth2),
        TwostrokeDriver(1, device=device, **engine_options),
    ]
    if compare_prefix_caching:
        options = engine_options | {"enable_prefix_caching": False}
        drivers.append(TwostrokeDriver(2, device=device, **options))
    if compare_unconstrained:
        for depth in (2, 1):
            drivers.append(
                TwostrokeDriver(depth, device=device, unconstrained=True, **engine_options)
            )
    if compare_governed:
        options = engine_options | {"torch_threads": None}
        drivers.append(TwostrokeDriver(2, device=device, **options))
    if compare_attention:
        drivers.append(TwostrokeDriver(2, device=device, attention_kernel="bag", **engine_options))
    if compare_deterministic:
        options = engine_options | {"deterministic": True}
        drivers.append(TwostrokeDriver(2, device=device, **options))
    for quantization in quantizations:
        options = engine_options | {"quantization": quantization}
        drivers.append(TwostrokeDriver(2, device=device, **options))
        if compare_deterministic:
            options |= {"deterministic": True}
            drivers.append(TwostrokeDriver(2, device=device, **options))
    return drivers


def _weights(source: Path, quantization: str | None) -> str:
    """The report's word on the weights a system computed with."""
    kind = "GGUF" if source.suffix == ".gguf" else "HF"
    if quantization == "gguf":
        return "GGUF blocks as stored"
    if quantization == "gguf_f32":
        return "GGUF blocks as stored, float32 activations"
    if quantization in ("q8_0", "q4_0"):
        return f"{kind}, projections quantized to {quantization.upper()} at load"
    if quantization is not None:
        return f"{kind} dequantized, {quantization} projections"
    return "GGUF dequantized" if kind == "GGUF" else "HF"


def speculative_drivers(drivers: Sequence[Any], config: SpeculativeConfig) -> list[Any]:
    """``drivers`` with ``twostroke-depth2-spec`` and ``twostroke-depth1-spec`` added: the
    plain depth-2 and depth-1 systems with speculative decoding by ``config``, right after
    the last of them (so before the compared variants), for ``twostroke bench
    --speculative-config``. Drivers that speculate already are left as they are."""
    plain = [
        index
        for index, driver in enumerate(drivers)
        if isinstance(driver, TwostrokeDriver) and driver.name == f"twostroke-depth{driver.depth}"
    ]
    if not plain:
        return list(drivers)
    speculating = [drivers[index].with_speculation(config) for index in plain]
    return [*drivers[: plain[-1] + 1], *speculating, *drivers[plain[-1] + 1 :]]


def release_unneeded(ran: Sequence[object], pending: Sequence[object]) -> int:
    """Let go of the models that the systems which ``ran`` keep for a replay no ``pending``
    system will make, so that the next system (a peer loading the same weights in a process
    of its own) does not find this process still holding them: a 14 GB twostroke model kept
    beside vLLM's 11 GB one was killed for memory on a 24 GB machine. The plans stay, for
    the roof.

    Args:
        ran: The systems run so far.
        pending: The systems still to run.

    Returns:
        The number of models released.
    """
    replayed = {id(system.source) for system in pending if isinstance(system, BareForwardDriver)}
    released = 0
    for system in ran:
        recording = getattr(system, "recording", None)
        if not isinstance(recording, _Recording) or recording.loaded is None:
            continue
        if id(system) not in replayed:
            recording.loaded = None
            released += 1
    if released:
        gc.collect()  # the model's modules hold reference cycles
    return released
