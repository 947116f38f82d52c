"""The ``twostroke`` command: generate, chat, serve, and the demonstration ``make run`` shows."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import importlib.util
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import anyio
import attrs

from twostroke.engine.config import (
    ENGINE_FLAGS,
    EngineConfig,
    ServerConfig,
    engine_flag,
    engine_flag_choices,
    engine_flag_help,
    engine_flag_value,
    parse_server_limit,
    server_flag,
    server_flag_help,
    server_flag_metavar,
    speculative_config_argument,
)
from twostroke.engine.engine import Engine
from twostroke.engine.runners.loading import DEFAULT_MODEL
from twostroke.engine.surface import open_surface
from twostroke.engine.text.reasoning import REASONING_PARSERS
from twostroke.engine.tools.formats import TOOL_FORMATS, tokenizer_tool_format, tool_format
from twostroke.engine.tools.template import native_template
from twostroke.states.constraints import MAX_SCHEMA_LENGTH, Constraint, JsonSchema, Regex
from twostroke.states.errors import ConstraintRejected
from twostroke.states.params import SamplingParams

__all__ = ["main"]

DEMO_QUESTIONS = (
    "What is the capital of France? Answer in one sentence.",
    "Give me three tips for writing clear Python code.",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about an engine with two strokes.",
)


def _sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="name, model directory or GGUF")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    _engine_arguments(parser, *_MODEL_OPTIONS)
    add_speculative_argument(parser)


#: The engine's options each command that opens an engine takes, besides ``serve``'s sizes.
_MODEL_OPTIONS = ("quantization", "kv_cache_dtype", "mmap", "deterministic", "swa_full")
#: A flag's short form, where it has one.
_SHORT_FLAGS = {"quantization": "-q"}


def _engine_arguments(
    parser: argparse.ArgumentParser, *names: str, with_defaults: bool = False
) -> None:
    """One flag per :class:`~twostroke.engine.config.EngineConfig` field in ``names``, drawn
    from the class (:data:`~twostroke.engine.config.ENGINE_FLAGS`).

    Absent, a flag reads ``None`` and the engine takes its own default, which the help
    shows; ``with_defaults`` makes the flag read the field's default instead, for a command
    that hands the value on itself (``bench``).
    """
    fields = attrs.fields_dict(EngineConfig)
    for name in names:
        kind = ENGINE_FLAGS[name]
        default = fields[name].default if with_defaults else None
        flags = (engine_flag(name), *([_SHORT_FLAGS[name]] if name in _SHORT_FLAGS else []))
        options: dict[str, Any] = {"dest": name, "default": default, "help": engine_flag_help(name)}
        if kind == "count":
            options.update(type=int, metavar="N")
        elif kind == "choice":
            options.update(choices=engine_flag_choices(name))
        elif kind == "negated":
            options.update(action="store_false")
        elif kind == "switch":
            options.update(action=argparse.BooleanOptionalAction)
        else:  # json: the one such field is speculative_config
            options.update(type=speculative_config_argument, metavar="JSON")
        parser.add_argument(*flags, **options)


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's options among the command's flags (:data:`ENGINE_FLAGS`), each where it
    was given ("none" for ``--quantization`` is ``None``)."""
    options: dict[str, Any] = {}
    for name in ENGINE_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            options[name] = engine_flag_value(name, value)
    return options


def _one_stream_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's options for ``generate`` and ``chat``, which run one request at a time:
    ``max_num_seqs=1``, so the plan is a single stream's (a GGUF model large enough computes
    its blocks as stored, where they beat the dequantized copy: docs/models.md)."""
    return {"max_num_seqs": 1, **_engine_options(args)}


def add_speculative_argument(parser: argparse.ArgumentParser) -> None:
    """``--speculative-config JSON`` (vLLM's flag): speculative decoding without a draft model."""
    _engine_arguments(parser, "speculative_config")


def _replica_arguments(parser: argparse.ArgumentParser) -> None:
    """``--replicas`` and ``--placement``: either one serves through a coordinator."""
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve through a coordinator over N engine replicas (default: one engine, "
        "no coordinator; 1 with --placement)",
    )
    parser.add_argument(
        "--placement",
        default=None,
        choices=["local", "process", "ray"],
        help="where the replicas run (default: local)",
    )


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        constraint=getattr(args, "constraint", None),
    )


def _json_schema_file(path: str) -> Constraint:
    """``--json-schema FILE``: read and checked as it is parsed, before any model is loaded."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read(4 * MAX_SCHEMA_LENGTH + 1)  # JsonSchema refuses a longer text
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read the schema file {path!r}: {exc}") from None
    try:
        return JsonSchema(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"{path}: {exc}") from None


def _regex(pattern: str) -> Constraint:
    """``--regex PATTERN``: its shape and length checked as it is parsed."""
    try:
        return Regex(pattern)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _server_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field of :class:`~twostroke.engine.config.ServerConfig`, with its default.

    Each is checked as it is parsed, by the field's own check, before any model is loaded.
    """
    for field in attrs.fields(ServerConfig):
        parser.add_argument(
            server_flag(field.name),
            type=partial(_server_limit, field.name),
            default=field.default,
            metavar=server_flag_metavar(field.name),
            help=server_flag_help(field.name),
        )


def _server_limit(name: str, text: str) -> object:
    try:
        return parse_server_limit(name, text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _server_config(args: argparse.Namespace) -> ServerConfig:
    """The ``serve`` command's limits: its flags, each field's default where one is absent."""
    return ServerConfig(
        **{field.name: getattr(args, field.name) for field in attrs.fields(ServerConfig)}
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="twostroke", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="stream a completion to the terminal")
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="apply the chat template")
    constrain = generate.add_mutually_exclusive_group()
    constrain.add_argument(
        "--json-schema",
        dest="constraint",
        type=_json_schema_file,
        metavar="FILE",
        help="the output is JSON that validates against the JSON schema in FILE",
    )
    constrain.add_argument(
        "--regex",
        dest="constraint",
        type=_regex,
        metavar="PATTERN",
        help="the output, as a whole, matches PATTERN (Rust regex syntax)",
    )
    _sampling_arguments(generate)
    _replica_arguments(generate)

    chat = commands.add_parser("chat", help="a small chat REPL")
    _sampling_arguments(chat)

    demo = commands.add_parser("demo", help="a few prompts generated concurrently, streamed")
    _sampling_arguments(demo)

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server")
    serve.add_argument("--model", default=DEFAULT_MODEL, help="name, model directory or GGUF")
    serve.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    serve.add_argument("--served-model-name", default=None, help="default: --model as given")
    serve.add_argument("--host", default="127.0.0.1", help="0.0.0.0 serves the whole network")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    serve.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    serve.add_argument(
        "--api-key",
        default=os.environ.get("TWOSTROKE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $TWOSTROKE_API_KEY)",
    )
    _engine_arguments(serve, "max_model_len", "max_num_seqs")
    serve.add_argument(
        "--tool-format",
        default=None,
        choices=sorted(TOOL_FORMATS),
        help="the syntax the model writes tool calls in (default: the one its chat template "
        "implies: mistral where it writes [TOOL_CALLS], hermes where it writes <tool_call>, "
        "llama3_json for a Llama 3 template that writes a call's parameters, else generic)",
    )
    serve.add_argument(
        "--reasoning-parser",
        default=None,
        choices=[*REASONING_PARSERS, "none"],
        help="read a thinking model's <think>...</think> apart from its answer, as "
        "reasoning_content (default: think where the chat template mentions <think>, else "
        "none); deepseek_r1 reads every output as starting inside the reasoning",
    )
    _engine_arguments(serve, *_MODEL_OPTIONS)
    add_speculative_argument(serve)
    _server_arguments(serve)
    _replica_arguments(serve)

    from twostroke.engine.artifacts.command import add_cache_arguments

    cache = commands.add_parser(
        "cache", help="the artifact cache (converted models, compiled kernels): list, prune, clear"
    )
    add_cache_arguments(cache)

    from twostroke.engine.bench.runner import add_bench_arguments

    bench = commands.add_parser(
        "bench", help="one workload through twostroke and its peers, side by side"
    )
    add_bench_arguments(bench)
    bench.add_argument(
        "--device",
        default="cpu",
        choices=["auto", "cpu", "cuda"],
        help="where twostroke's systems run (the peers run on the CPU)",
    )
    _engine_arguments(bench, "max_num_seqs", "max_num_batched_tokens", with_defaults=True)
    bench.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="also run the coordinator over 1 and over N engine replicas (twostroke-dp*)",
    )
    bench.add_argument(
        "--placement", default="process", choices=["local", "process", "ray"], help="of replicas"
    )

    from twostroke.engine.synthetic.command import add_synthesize_arguments

    synthesize = commands.add_parser(
        "synthesize",
        help="a random-weight model of a real architecture at its real size (hf or GGUF)",
    )
    add_synthesize_arguments(synthesize)

    from twostroke.engine.bench.step_profile import add_profile_arguments

    profile = commands.add_parser(
        "profile-step",
        help="torch calls, aten ops and GIL-free time of one decode step (CPU)",
    )
    add_profile_arguments(profile)

    isa = commands.add_parser(
        "isa",
        help="the CPU's instruction set, the TWOSTROKE_CPU_ISA personality and what it decides",
    )
    isa.add_argument(
        "--rungs-to-test",
        action="store_true",
        help="print only the lower rungs `make test` runs the isa tests on, one a line",
    )
    return parser


async def _generate(args: argparse.Namespace) -> int:
    prompt: Any = args.prompt
    if args.chat:
        prompt = [{"role": "user", "content": args.prompt}]
    opened = open_surface(
        args.model,
        replicas=args.replicas,
        placement=args.placement,
        device=args.device,
        **_one_stream_options(args),
    )
    async with opened as engine:
        try:
            async with engine.stream(prompt, _params(args)) as deltas:
                async for delta in deltas:
                    print(delta.text, end="", flush=True)
        except ConstraintRejected as exc:  # the backend cannot enforce --json-schema / --regex
            flag = "--json-schema" if isinstance(args.constraint, JsonSchema) else "--regex"
            print(f"twostroke generate: error: argument {flag}: {exc.reason}", file=sys.stderr)
            return 2
        print()
    return 0


async def _chat(args: argparse.Namespace) -> None:
    messages: list[dict[str, str]] = []
    options = _one_stream_options(args)
    async with Engine.open(args.model, device=args.device, **options) as engine:
        while True:
            try:
                line = await anyio.to_thread.run_sync(input, "> ")
            except EOFError:
                print()
                return
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            reply = ""
            async with engine.stream(messages, _params(args)) as deltas:
                async for delta in deltas:
                    reply += delta.text
                    print(delta.text, end="", flush=True)
            print()
            messages.append({"role": "assistant", "content": reply})


async def _demo(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    async with Engine.open(args.model, device=args.device, **_engine_options(args)) as engine:
        loaded = time.perf_counter()
        blocks = engine.statistics().num_blocks
        print(
            f"loaded {args.model} in {loaded - started:.1f} s "
            f"({blocks} KV blocks of {engine.config.block_size} tokens)"
        )
        texts = [""] * len(DEMO_QUESTIONS)
        first_token: list[float | None] = [None] * len(DEMO_QUESTIONS)

        async def ask(index: int) -> None:
            messages = [{"role": "user", "content": DEMO_QUESTIONS[index]}]
            async with engine.stream(messages, _params(args)) as deltas:
                async for delta in deltas:
                    if first_token[index] is None and delta.token_ids:
                        first_token[index] = time.perf_counter() - loaded
                    texts[index] += delta.text
                    if index == 0:
                        print(delta.text, end="", flush=True)

        print(f"\n[streaming answer 1 of {len(DEMO_QUESTIONS)}; all generate concurrently]\n")
        async with anyio.create_task_group() as task_group:
            for index in range(len(DEMO_QUESTIONS)):
                task_group.start_soon(ask, index)
        elapsed = time.perf_counter() - loaded
        stats = engine.statistics()
    print("\n")
    for index, question in enumerate(DEMO_QUESTIONS):
        ttft = first_token[index]
        print(f"Q: {question}\nA: {texts[index].strip()}\n   (first token {ttft or 0:.2f} s)\n")
    print(
        f"{stats.num_tokens_generated} tokens in {elapsed:.1f} s "
        f"({stats.num_tokens_generated / elapsed:.1f} tok/s over {stats.num_steps} steps, "
        f"{len(DEMO_QUESTIONS)} requests batched)"
    )


async def _serve(args: argparse.Namespace) -> None:
    from twostroke.engine.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = _server_config(args)
    options: dict[str, Any] = {
        "device": args.device,
        "model_name": args.served_model_name,
        # The engine (each replica's) refuses past it too: the server's check counts the
        # coordinator's replicas together, from statistics a process replica reports late.
        "max_waiting_requests": config.max_waiting_requests,
        **_engine_options(args),
    }
    # The server takes any engine surface: a coordinator over replicas is one.
    opened = open_surface(args.model, replicas=args.replicas, placement=args.placement, **options)
    async with opened as engine:
        if args.tool_format is not None:
            tools = tool_format(args.tool_format)
        else:
            tools = tokenizer_tool_format(engine.tokenizer)
        # What is alive now (torch, the model) lives as long as the process: frozen, the
        # collector no longer walks it at every full collection (as vLLM does). A burst of
        # 16,000 submits spent half its time there (0.77 s, 0.37 s frozen).
        gc.freeze()
        # SIGTERM (systemd, containers) and SIGINT stop it the same way: the server shuts
        # down gracefully, then the engine drains.
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with anyio.create_task_group() as task_group:
                port = await task_group.start(
                    partial(
                        serve,
                        engine,
                        args.host,
                        args.port,
                        api_key=args.api_key,
                        config=config,
                        access_log=True,
                        tool_format=tools,
                        reasoning_parser=args.reasoning_parser,
                    )
                )
                shown = (
                    " through the chat template" if native_template(tools, engine.tokenizer) else ""
                )
                print(
                    f"serving {engine.model_name!r} at http://{args.host}:{port}/v1 "
                    f"(backend {args.backend}; tool calls: {tools.name}{shown}; Ctrl-C or "
                    "SIGTERM stops)",
                    flush=True,
                )
                async for _ in signals:
                    task_group.cancel_scope.cancel()
                    break


def _bench(args: argparse.Namespace) -> int:
    from twostroke.engine.bench.runner import bench_command
    from twostroke.engine.bench.twostroke_driver import engine_drivers

    drivers = engine_drivers(
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        compare_prefix_caching=args.compare_prefix_caching,
        compare_unconstrained=args.compare_unconstrained,
        compare_governed=args.compare_governed,
        compare_attention=args.compare_attention,
        compare_deterministic=args.compare_deterministic,
        quantizations=tuple(args.quantization or ()),
    )
    if args.replicas is not None:
        from twostroke.engine.bench.coordinator_driver import coordinator_drivers

        drivers += coordinator_drivers(
            args.replicas,
            args.placement,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    return bench_command(args, engine_drivers=drivers)


def _isa(args: argparse.Namespace) -> int:
    """``twostroke isa``: the personality and each decision it reaches (see
    :mod:`twostroke.engine.models.report`)."""
    from twostroke.gpu.isa import cpu_personality, rungs_to_test

    try:
        personality = cpu_personality()
    except ValueError as error:
        print(f"twostroke isa: error: {error}", file=sys.stderr)
        return 2
    if args.rungs_to_test:
        for name in rungs_to_test(personality.machine):
            print(name)
        return 0
    from twostroke.engine.models.report import cpu_report

    with _progress_on_stderr():
        report = cpu_report()
    print("\n".join(report.lines()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    # The interpreter's last garbage collections walk every object torch created, 0.6-0.9 s
    # of every `twostroke generate` (AVX2 EPYC, load 2.4: `import torch` alone exits in
    # 3.35 s, 2.71 s frozen); whatever is left at exit is freed by the OS anyway.
    atexit.unregister(_freeze_at_exit)  # once, however often main() runs (tests)
    atexit.register(_freeze_at_exit)
    args = build_parser().parse_args(argv)
    if args.command == "cache":
        from twostroke.engine.artifacts.command import cache_command

        return cache_command(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "isa":
        return _isa(args)
    if args.command == "synthesize":
        from twostroke.engine.synthetic.command import synthesize_command

        with _progress_on_stderr():
            return synthesize_command(args)
    if args.command == "profile-step":
        from twostroke.engine.bench.step_profile import profile_command

        return profile_command(args)
    if args.command == "serve":
        interrupted = False
        options = {}
        if args.backend == "asyncio" and importlib.util.find_spec("uvloop") is not None:
            options["use_uvloop"] = True
        try:
            anyio.run(_serve, args, backend=args.backend, backend_options=options)
        except* KeyboardInterrupt:  # trio delivers it through the task groups
            interrupted = True
        return 130 if interrupted else 0
    command = {"generate": _generate, "chat": _chat, "demo": _demo}[args.command]
    try:
        with _progress_on_stderr():
            code = anyio.run(command, args)
    except KeyboardInterrupt:
        return 130
    return code or 0


def _freeze_at_exit() -> None:
    gc.freeze()


#: The loggers that say, at INFO, what loading converts or packs (seconds, on a first start).
_PROGRESS_LOGGERS = (
    "twostroke.engine.artifacts",
    "twostroke.engine.synthetic",
    "twostroke.engine.checkpoints",
    "twostroke.engine.kernels",
    "twostroke.engine.models",
    "twostroke.engine.text",
)


@contextlib.contextmanager
def _progress_on_stderr() -> Iterator[None]:
    """Show the loaders' progress lines on stderr, one line each, for the block.

    ``serve`` logs everything at INFO already; the other commands print only what the model
    writes, so a start that spends seconds converting or packing would look hung.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    loggers = [logging.getLogger(name) for name in _PROGRESS_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
