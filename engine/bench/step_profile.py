"""What one decode step asks of Python: torch calls, aten ops, and time outside the GIL.

On the CPU the forward stroke runs a step's torch ops in the device's worker thread while
the bookkeeping stroke runs on the event loop. Both are Python, so they share the GIL: torch
releases it inside every op it dispatches (the generated Python bindings drop it around the
dispatcher call) and takes it back to return to Python. The more of a step that runs in
Python (argument parsing, module calls, the model's own code between ops), the less the two
strokes overlap, and every op is a point where the forward thread may have to wait for the
GIL. So :func:`profile_decode_step` reports, for a batch of decodes through the real
runner:

* **torch calls**: functions and tensor methods the model and runner call from Python,
  counted with a :class:`~torch.overrides.TorchFunctionMode` (attribute reads such as
  ``.shape`` and ``.dtype`` go through that mode too and are counted apart);
* **aten ops**: the operators those calls dispatch, counted with a
  :class:`~torch.utils._python_dispatch.TorchDispatchMode` (composite calls count once per
  operator they reach);
* **GIL-free fraction**: the step under :mod:`torch.profiler`, where the time inside the
  outermost ops of the calling thread (the GIL is released for all of it), plus the time
  inside the compiled kernels (:mod:`~twostroke.engine.kernels.build`'s, which ``ctypes``
  calls with the GIL released; timed by :func:`~twostroke.engine.kernels.build.timed`), is
  divided by the step's wall time. What is left is Python and the bindings' own work, with
  the GIL held. The profiler adds a microsecond or two per op, partly outside the ops, so
  the fraction is a slight underestimate;
* **step time**: the median wall time of uninstrumented steps.

Counts do not depend on the machine (only on the model's shape, the batch and the code);
times do. ``twostroke profile-step`` runs it from the command line.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from twostroke.engine.config import DTYPE_OPTIONS, QUANTIZATION_OPTIONS
from twostroke.engine.kernels import build
from twostroke.engine.models.loading import LoadedModel
from twostroke.engine.runners.loading import DEFAULT_MODEL
from twostroke.engine.runners.torch import TorchModelRunner
from twostroke.gpu.completion import Launched
from twostroke.gpu.threads import torch_threads
from twostroke.states.params import SamplingParams
from twostroke.states.plan import RunnerOutput, StepPlan
from twostroke.states.request import Request
from twostroke.states.scheduler import Scheduler, SchedulerConfig
from twostroke.states.validators import check_int_at_least
from twostroke.states.windowed import WindowedKV, window_pool_blocks

__all__ = [
    "DecodeStep",
    "StepProfile",
    "add_profile_arguments",
    "profile_command",
    "profile_decode_step",
]


@attrs.frozen
class StepProfile:
    """One decode step's calls into torch and where its time went.

    Attributes:
        batch: Decodes in the step.
        torch_calls: Torch functions and tensor methods called from Python per step.
        attribute_reads: Tensor attribute reads (``.shape``, ``.dtype``...) per step.
        aten_ops: Aten operators dispatched per step.
        top_calls: The most frequent torch calls, ``(name, count)``, most frequent first.
        step_seconds: Median wall time of the uninstrumented steps.
        step_samples: The uninstrumented steps' wall times, in order.
        profiled_seconds: Wall time of the step run under the profiler.
        kernel_seconds: Of that, the time inside the calling thread's outermost ops.
        compiled_seconds: And the time inside compiled kernels (outside torch's ops).
        compiled_calls: Calls into compiled kernels in that step.
    """

    batch: int
    torch_calls: int
    attribute_reads: int
    aten_ops: int
    top_calls: tuple[tuple[str, int], ...]
    step_seconds: float
    step_samples: tuple[float, ...]
    profiled_seconds: float
    kernel_seconds: float
    compiled_seconds: float
    compiled_calls: int

    @property
    def gil_free_fraction(self) -> float:
        """The share of the profiled step spent inside torch ops and compiled kernels, the
        GIL released."""
        if not self.profiled_seconds:
            return 0.0
        return (self.kernel_seconds + self.compiled_seconds) / self.profiled_seconds

    def report(self) -> str:
        """A few lines for a terminal."""
        calls = ", ".join(f"{name} {count}" for name, count in self.top_calls[:12])
        return "\n".join(
            [
                f"decode step, batch {self.batch}",
                f"  torch calls from Python  {self.torch_calls}"
                f" (+ {self.attribute_reads} attribute reads)",
                f"  aten ops dispatched      {self.aten_ops}",
                f"  step wall time (median)  {self.step_seconds * 1e3:.1f} ms"
                f" of {len(self.step_samples)}",
                f"  GIL released (profiled)  {self.gil_free_fraction:.1%}"
                f" of {self.profiled_seconds * 1e3:.1f} ms (torch ops"
                f" {self.kernel_seconds * 1e3:.1f} ms, compiled kernels"
                f" {self.compiled_seconds * 1e3:.1f} ms in {self.compiled_calls} calls)",
                f"  most called: {calls}",
            ]
        )


class _CallCounter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        self.calls[getattr(func, "__qualname__", None) or str(func)] += 1
        return func(*args, **(kwargs or {}))


class _OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's __init_subclass__
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops = 0

    def __torch_dispatch__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _kernel_seconds(work: Callable[[], object]) -> tuple[float, float]:
    """Wall time of ``work`` under the profiler, and the part inside this thread's top ops."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        work()
        wall = time.perf_counter() - start
    # The profiler numbers threads its own way; the step's ops all run in this thread (the
    # CPU runner computes where it is called, and OpenMP's workers record no ops).
    inside = sum(
        event.time_range.elapsed_us() for event in prof.events() if event.cpu_parent is None
    )
    return wall, inside / 1e6


@attrs.define(eq=False)
class DecodeStep:
    """A runner whose requests are all decoding, and the next decode plan, repeatable.

    The requests' prompts are random tokens of ``history`` lengths (seeded), prefilled at
    construction. :meth:`execute` runs the current plan; :meth:`advance` applies its tokens
    and plans the next, so the steps measured are consecutive decode steps of one batch.
    """

    runner: TorchModelRunner
    scheduler: Scheduler
    plan: StepPlan
    _launched: Launched[RunnerOutput] | None = None

    @classmethod
    def prefill(
        cls,
        loaded: LoadedModel,
        *,
        batch: int,
        history: tuple[int, int] = (90, 312),
        block_size: int = 16,
        seed: int = 0,
        max_steps: int = 1024,
    ) -> DecodeStep:
        """Prefill ``batch`` requests and stop at their first all-decode step.

        Args:
            loaded: The model.
            batch: Requests decoding together.
            history: Shortest and longest prompt (the decodes' history lengths).
            block_size: Positions per KV block.
            seed: Draws the prompts.
            max_steps: Decode steps the requests may run (their ``max_tokens``).

        Raises:
            ValueError: ``batch`` or ``max_steps`` below 1, or a bad ``history``.
        """
        check_int_at_least("batch", batch, 1)
        check_int_at_least("max_steps", max_steps, 1)
        low, high = history
        if not 1 <= low <= high:
            raise ValueError(f"history must be (low, high) with 1 <= low <= high, got {history}")
        rng = random.Random(seed)
        vocab = loaded.config.vocab_size
        prompts = [
            [rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(batch)
        ]
        runner = TorchModelRunner.from_loaded(loaded, max_num_seqs=batch)
        per_request = -(-(high + max_steps + 1) // block_size)
        num_blocks = batch * per_request + 1
        window = runner.windowed_kv_window
        windowed = None
        if window is not None:  # room for every request's whole window, as the engine's
            count = window_pool_blocks(
                window=window,
                block_size=block_size,
                max_num_seqs=batch,
                max_num_batched_tokens=batch * high,
            )
            windowed = WindowedKV(window=window, num_blocks=count)
        runner.allocate_kv_cache(
            num_blocks,
            block_size,
            num_windowed_blocks=0 if windowed is None else windowed.num_blocks,
        )
        scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=num_blocks,
                block_size=block_size,
                # Every prompt in the first step, so no request decodes before the last
                # is prefilled: the second step is the whole batch's first decode.
                max_num_batched_tokens=batch * high,
                max_num_seqs=batch,
                max_model_len=runner.max_model_len,
                pipeline_depth=1,
                # (a model whose windowed layers keep their KV apart runs without: the
                # engine's way, window_kv)
                enable_prefix_caching=windowed is None,
                windowed_kv=windowed,
            )
        )
        params = SamplingParams(max_tokens=max_steps, temperature=0.0, ignore_eos=True)
        for index, prompt in enumerate(prompts):
            scheduler.add_request(Request(index, prompt, params, 0.0))
        while True:
            plan = scheduler.schedule()
            assert plan is not None
            if len(plan.requests) == batch and all(e.num_tokens == 1 for e in plan.requests):
                return cls(runner, scheduler, plan)
            scheduler.apply(runner.execute(plan).readback())

    def execute(self) -> None:
        """Execute the current decode step: what the forward thread does, and only that."""
        self._launched = self.runner.execute(self.plan)

    def advance(self) -> None:
        """Apply the executed step's tokens and plan the next decode step.

        Raises:
            RuntimeError: the current step was not executed, or the requests have run out
                of tokens (``max_steps``).
        """
        if self._launched is None:
            raise RuntimeError("advance() needs the current step executed first")
        self.scheduler.apply(self._launched.readback())
        self._launched = None
        plan = self.scheduler.schedule()
        if plan is None or not all(e.num_tokens == 1 for e in plan.requests):
            raise RuntimeError("the decode steps ran out: prefill with a larger max_steps")
        self.plan = plan


def profile_decode_step(step: DecodeStep, *, repeats: int = 5) -> StepProfile:
    """Count and time decode steps of ``step`` (see the module).

    Runs one warm-up step, one counting torch calls, one counting aten ops, one under the
    profiler, then ``repeats`` uninstrumented: ``repeats + 4`` consecutive decode steps.
    Only the runner's ``execute`` (the forward thread's work) is counted and timed, not
    the scheduler.

    Raises:
        ValueError: ``repeats`` below 1.
    """
    check_int_at_least("repeats", repeats, 1)

    step.execute()  # warm-up: first-use allocations and kernel selection
    step.advance()
    counter = _CallCounter()
    with counter:
        step.execute()
    step.advance()
    ops = _OpCounter()
    with ops:
        step.execute()
    step.advance()
    with build.timed() as compiled:
        profiled, inside = _kernel_seconds(step.execute)
    step.advance()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        step.execute()
        samples.append(time.perf_counter() - start)
        step.advance()
    calls = counter.calls
    reads = calls.pop("getset_descriptor.__get__", 0)
    return StepProfile(
        batch=len(step.plan.requests),
        torch_calls=sum(calls.values()),
        attribute_reads=reads,
        aten_ops=ops.ops,
        top_calls=tuple(calls.most_common()),
        step_seconds=statistics.median(samples),
        step_samples=tuple(samples),
        profiled_seconds=profiled,
        kernel_seconds=inside,
        compiled_seconds=compiled.seconds,
        compiled_calls=compiled.calls,
    )


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``twostroke profile-step``."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help="name, directory or GGUF file")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_OPTIONS)
    parser.add_argument("--batch", type=int, default=32, help="decodes in the step")
    parser.add_argument(
        "--history",
        type=int,
        nargs=2,
        default=(90, 312),
        metavar=("LOW", "HIGH"),
        help="shortest and longest history of the decodes (default: the bench's prompts + 64)",
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=[*QUANTIZATION_OPTIONS, "none"],
        help="the projections' weights (auto: the engine's for the dtype; none: the dtype's; "
        "gguf, q8_0, q4_0 take float32 activations, which --dtype auto then is)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--repeats", type=int, default=5, help="uninstrumented steps timed")


def profile_command(args: argparse.Namespace) -> int:
    """Run ``twostroke profile-step``: load the model, prefill, profile, print.

    Returns:
        The exit status.
    """
    from twostroke.engine.config import EngineConfig
    from twostroke.engine.models.loading import load_model
    from twostroke.engine.models.plan import resolve_run
    from twostroke.engine.models.source import read_source

    check_int_at_least("threads", args.threads, 1)
    quantization = None if args.quantization == "none" else args.quantization
    # The engine's plan for these options (its weights and KV cache for the dtype).
    config = EngineConfig(dtype=args.dtype, quantization=quantization)
    with torch_threads(args.threads):
        source = read_source(args.model)
        loaded = load_model(resolve_run(config, source, torch.device("cpu")))
        dtype = loaded.dtype
        step = DecodeStep.prefill(
            loaded, batch=args.batch, history=tuple(args.history), max_steps=args.repeats + 8
        )
        profile = profile_decode_step(step, repeats=args.repeats)
    print(
        f"{loaded.source.name}, {dtype}, weights {loaded.quantization or 'in the dtype'}, "
        f"KV cache {str(loaded.module.cache_dtype).removeprefix('torch.')}, "
        f"{args.threads} torch thread(s), CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, load average {os.getloadavg()[0]:.2f}"
    )
    print(profile.report())
    return 0
