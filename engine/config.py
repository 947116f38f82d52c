"""Configuration: the engine's and the HTTP server's, each one frozen value, validated when built.

:class:`EngineConfig` says how an engine batches, sizes its memory and shuts down;
:class:`ServerConfig` holds the limits of ``twostroke serve``'s server. The server's value lives
here, beside the engine's, and not in :mod:`twostroke.engine.server`: the ``twostroke`` command
builds its ``serve`` flags from the class whatever the subcommand, and the server's package
needs starlette, which ``twostroke generate`` does not.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, get_args

import attrs

from twostroke.states.params import MAX_CACHE_TTL
from twostroke.states.scheduler_config import SchedulingPolicy
from twostroke.states.speculation import SpeculativeConfig, speculative_config
from twostroke.states.validators import (
    Validator,
    int_at_least,
    is_number,
    number_in,
    one_of,
)
from twostroke.states.validators import boolean as _boolean

__all__ = [
    "DTYPE_OPTIONS",
    "ENGINE_FLAGS",
    "LOOPBACK_HOST_NAMES",
    "NO_QUANTIZATION",
    "QUANTIZATION_OPTIONS",
    "DtypeOption",
    "EngineConfig",
    "QuantizationOption",
    "ServerConfig",
    "engine_flag",
    "engine_flag_choices",
    "engine_flag_help",
    "engine_flag_value",
    "engine_options_table",
    "host_names",
    "parse_server_limit",
    "server_field_docs",
    "server_flag",
    "server_flag_help",
    "server_flag_metavar",
    "server_limits_table",
    "speculative_config_argument",
    "without_port",
]


#: The values of ``EngineConfig.dtype`` and ``kv_cache_dtype``: named here once; the CLI's
#: choices and the run's plan (:func:`~twostroke.engine.models.plan.resolve_run`) read them.
DtypeOption = Literal["auto", "float32", "bfloat16", "float16"]
DTYPE_OPTIONS: tuple[DtypeOption, ...] = get_args(DtypeOption)

#: The values of ``EngineConfig.quantization`` besides ``None`` (weights in ``dtype``), named
#: here once: what each means is :func:`~twostroke.engine.models.plan.resolve_run`'s.
QuantizationOption = Literal["auto", "fp16", "int8", "gguf", "gguf_f32", "q8_0", "q4_0"]
QUANTIZATION_OPTIONS: tuple[QuantizationOption, ...] = get_args(QuantizationOption)


def _check_kv_memory(_: object, __: object, value: Any) -> None:
    if value is None:
        return
    if not is_number(value):
        raise TypeError(
            "kv_cache_memory must be bytes (int) or a fraction (float), "
            f"got {type(value).__name__} {value!r}"
        )
    if isinstance(value, float) and not 0 < value < 1:
        raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1), got {value}")
    if isinstance(value, int) and value < 1:
        raise ValueError(f"kv_cache_memory in bytes must be >= 1, got {value}")


@attrs.frozen(kw_only=True)
class EngineConfig(SchedulingPolicy):
    """How an engine batches, how much KV memory it takes, and how it shuts down.

    The batching fields (``block_size``, ``max_num_batched_tokens``, ``max_num_seqs``,
    ``pipeline_depth``, ``enable_prefix_caching``, ``max_waiting_requests``) are the
    scheduler's own :class:`~twostroke.states.scheduler_config.SchedulingPolicy`, with its
    defaults and checks: the engine hands them to its scheduler as they are, with the pool
    and the context it sized.

    Args:
        block_size: Token positions per KV block.
        max_num_batched_tokens: Token budget of one step (chunked prefill splits longer
            prompts).
        max_num_seqs: The most requests running at once.
        pipeline_depth: 2 plans step N+1 while step N runs (the default); 1 is serial.
        enable_prefix_caching: Keep the KV of full blocks after their requests end, so a
            prompt that starts with the same tokens (a shared system prompt, the earlier
            turns of a chat) skips computing them. Outputs are the same either way.
        max_waiting_requests: The most requests that may wait for admission: ``submit``
            raises :class:`~twostroke.engine.errors.EngineOverloaded` (before it tokenizes
            the prompt) while that many wait, and queues nothing. ``None`` (the default) sets
            no limit: a program that submits a batch of any size (``LLM.generate``) decides
            what it queues. ``twostroke serve`` sets 1024 (``--max-waiting-requests``).
        speculative_config: Speculative decoding from the requests' own tokens (a
            :class:`~twostroke.states.speculation.SpeculativeConfig` or a mapping of its
            fields); ``None`` (the default) drafts nothing. Outputs are the same either way
            (docs/speculative.md).
        num_blocks: KV blocks in the pool; ``None`` sizes the pool from ``kv_cache_memory``.
        kv_cache_memory: KV cache budget when ``num_blocks`` is ``None``: bytes (``int``) or
            a fraction of the device's free memory (``float`` in (0, 1)). ``None`` takes
            half the free memory on CUDA and 1 GiB on the CPU (whose memory the rest of the
            program shares).
        max_model_len: Context length; ``None`` takes the model's.
        shutdown: Leaving the ``async with`` block normally ``"drain"``s open requests, or
            ``"cancel"``s them.
        dtype: Weights and activations: ``"auto"`` (bfloat16 where the device computes it
            fast, else float32 on the CPU and float16 on CUDA), ``"float32"``,
            ``"bfloat16"`` or ``"float16"``. On the CPU ``"auto"``'s float32 products use
            weights packed once for oneDNN (1.2-1.5x faster projections, rounded
            differently: about 1e-6 of an output); an explicit ``"float32"`` keeps MKL's
            products, which are transformers' own bit for bit.
        quantization: The decoder's projection weights in reduced precision, activations
            in ``dtype``, as vLLM's option of the same name quantizes an unquantized
            checkpoint as it loads: ``"fp16"`` (float16 weights) or ``"int8"`` (int8
            weights, one scale per output channel; activations quantized per call). CPU
            only (fbgemm); where the kernel does not run, the engine warns
            (:class:`~twostroke.engine.models.quantization.QuantizationUnavailable`) and
            keeps full precision. ``None``: weights in ``dtype``. ``"auto"`` (the default)
            goes with ``dtype="auto"``: the fastest weights whose perplexity is within 1 %
            of float32's, measured (docs/models.md): ``"fp16"`` where ``dtype="auto"``
            resolves to float32 on a CPU with the kernel, else ``None``; a GGUF file's
            blocks as ``"gguf"`` computes them where they win (at most 2 sequences on a
            model of 0.9 B projection weights or more, or a file whose dequantized copy would
            not fit half the memory available; docs/models.md). An explicit ``dtype`` keeps
            its weights (``dtype="float32"`` is transformers' arithmetic).
            ``"gguf"``: a GGUF file's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K
            weights computed as stored, with activations quantized per block (float32 on a CPU;
            docs/models.md), as llama.cpp computes them. ``"gguf_f32"``: the same blocks
            multiplied by the float32 activations themselves, so the file's own model to
            float32 rounding. ``"q8_0"``, ``"q4_0"``: any checkpoint's projection weights
            quantized into those GGUF blocks at load and computed as ``"gguf"`` computes a
            file's (float32 on a CPU). With these four ``dtype="auto"`` is float32, the
            blocks' activations, on every CPU.
        kv_cache_dtype: The KV cache's element type, vLLM's option of the same name:
            ``"float32"``, ``"bfloat16"`` or ``"float16"``, read and written in place by the
            CPU's compiled attention (the other kernels widen what they gather).
            ``"auto"`` (the default) goes with ``dtype="auto"``: float16 where the
            activations are float32 on a CPU whose compiled kernels run with F16C (half the
            bytes a decode reads from the cache; its quality, measured, in
            docs/models.md), else the activations' dtype. An explicit ``dtype`` keeps its
            cache in that dtype unless this asks for another.
        torch_threads: torch's intra-op threads for the forward pass, fixed. ``None`` (the
            default) lets the engine choose on the CPU: every core
            (:func:`~twostroke.engine.runners.loading.default_torch_threads`) while they
            are free, one fewer at a time while other work wants them, chosen between steps
            (:class:`~twostroke.gpu.cores.ThreadGovernor`; ``Engine.statistics().torch_threads``
            says how many now). On CUDA ``None`` leaves torch's default. A fixed count
            above one on a machine shared with other work wants ``OMP_WAIT_POLICY=PASSIVE``
            exported before Python starts (:mod:`twostroke.gpu.openmp`).
        step_timeout: Seconds a step may take, from when the engine starts waiting for it
            until its tokens are back (and the probe of a device after a failed step); a
            step past it means a hung device, and the engine dies
            (:class:`~twostroke.engine.errors.EngineDead`) instead of leaving its requests
            waiting forever. ``None`` (the default) waits as long as it takes: a first step
            on a cold GPU, or a long prefill chunk of a large model on a CPU, may take many
            seconds.
        mmap: Whether a GGUF file whose blocks are computed as stored (``quantization=
            "gguf"`` or ``"gguf_f32"``) stays memory-mapped (the default: its pages are
            read as they are used, and shared with other processes mapping it). ``False``
            (``--no-mmap``, llama.cpp's flag) reads it into memory at load: the file's size
            in memory, and a model that no longer depends on the file, which a file
            rewritten or truncated in place would otherwise kill with SIGBUS
            (docs/serving.md, "Limits and security").
        deterministic: Whether a request's tokens and logprobs must be a function of the
            model, its prompt, its parameters and its seed alone, whatever runs beside it
            (other requests, chunking, prefix-cache hits, preemption, drafts, the pipeline
            depth; docs/models.md, "One answer per request"). ``None`` (the default): the
            fastest arrangement of the kernels, which is batch-invariant where that costs
            nothing (the compiled bfloat16 panels and AMX tiles, oneDNN's float32 products;
            ``Engine.statistics().deterministic`` says whether this run is). ``True``
            (``--deterministic``): the invariant arrangement at its cost (float32 weights
            instead of fbgemm's fp16 on AVX2, the panels at every row count on AMX, GGUF
            blocks block by block in long prefills), or
            :class:`~twostroke.engine.models.choice.DeterminismUnavailable` at open where
            none is (``dtype="float32"``'s MKL products, ``int8`` weights, CUDA). ``False``:
            the fastest arrangement, no promise asked.
        swa_full: Where a model's sliding-window layers sit beside layers that see every
            position (Gemma 2 and 3), keep every position of their KV too (llama.cpp's
            ``--swa-full``), so that prefix caching serves the model. ``False`` (the
            default): they keep only their window, in a pool of their own sized for
            ``max_num_seqs`` windows (at most half of ``kv_cache_memory``; the scheduler
            admits against it), the pool's blocks hold the global layers' KV alone
            (a context several times longer in the same memory), and the engine runs
            without prefix caching, which would need the windowed KV of the positions a hit
            skips (docs/models.md, "Sliding windows beside global layers").

    Raises:
        TypeError: a value of the wrong type (``None`` included, for a field that is not
            optional); the message names the field and the value.
        ValueError: a value out of range or not among a field's choices.
    """

    num_blocks: int | None = attrs.field(default=None, validator=int_at_least(1, optional=True))
    kv_cache_memory: int | float | None = attrs.field(default=None, validator=_check_kv_memory)
    max_model_len: int | None = attrs.field(default=None, validator=int_at_least(2, optional=True))
    shutdown: Literal["drain", "cancel"] = attrs.field(
        default="drain", validator=one_of("drain", "cancel")
    )
    dtype: DtypeOption = attrs.field(default="auto", validator=one_of(*DTYPE_OPTIONS))
    quantization: QuantizationOption | None = attrs.field(
        default="auto", validator=attrs.validators.optional(one_of(*QUANTIZATION_OPTIONS))
    )
    kv_cache_dtype: DtypeOption = attrs.field(default="auto", validator=one_of(*DTYPE_OPTIONS))
    torch_threads: int | None = attrs.field(default=None, validator=int_at_least(1, optional=True))
    step_timeout: float | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(number_in(0, low_open=True)),
    )
    mmap: bool = attrs.field(default=True, validator=_boolean)
    deterministic: bool | None = attrs.field(
        default=None, validator=attrs.validators.optional(_boolean)
    )
    swa_full: bool = attrs.field(default=False, validator=_boolean)


# --- the engine's flags -------------------------------------------------------------------

#: The fields of :class:`EngineConfig` the ``twostroke`` commands take as flags, and how each
#: flag reads its value: ``count`` an int, ``choice`` one of :func:`engine_flag_choices`,
#: ``negated`` ``--no-<field>`` for ``False``, ``switch`` ``--<field>`` / ``--no-<field>``,
#: ``json`` a JSON object of the field's value. The flags, their choices, help and defaults
#: are drawn from the class, so none restates what the class says.
ENGINE_FLAGS: Mapping[str, str] = {
    "max_model_len": "count",
    "max_num_seqs": "count",
    "max_num_batched_tokens": "count",
    "quantization": "choice",
    "kv_cache_dtype": "choice",
    "mmap": "negated",
    "deterministic": "switch",
    "swa_full": "switch",
    "speculative_config": "json",
}

#: The command line's spelling of ``quantization=None`` (weights in ``dtype``).
NO_QUANTIZATION = "none"


def engine_flag(name: str) -> str:
    """The ``twostroke`` flag of :class:`EngineConfig`'s field ``name`` (``--no-mmap`` for
    ``mmap``, whose flag turns it off)."""
    prefix = "--no-" if ENGINE_FLAGS.get(name) == "negated" else "--"
    return prefix + name.replace("_", "-")


def engine_flag_choices(name: str) -> tuple[str, ...]:
    """The values the flag of the field ``name`` takes: the field's options, and for
    ``quantization`` :data:`NO_QUANTIZATION` for ``None``.

    Raises:
        ValueError: ``name`` is no field whose flag takes a choice.
    """
    if name == "quantization":
        return (*QUANTIZATION_OPTIONS, NO_QUANTIZATION)
    if name in ("dtype", "kv_cache_dtype"):
        return DTYPE_OPTIONS
    raise ValueError(f"name must be an EngineConfig field whose flag takes a choice, got {name!r}")


def engine_flag_value(name: str, value: object) -> object:
    """The value of the field ``name`` a flag's parsed ``value`` stands for (``"none"`` is
    ``None`` for ``quantization``)."""
    return None if name == "quantization" and value == NO_QUANTIZATION else value


def engine_flag_help(name: str) -> str:
    """The ``--help`` text of the flag of :class:`EngineConfig`'s field ``name``: its doc's
    first clause and its default, as :func:`server_flag_help` writes the server's."""
    text = _flag_help(EngineConfig, name)
    if ENGINE_FLAGS.get(name) == "negated":
        return f"{text}; {engine_flag(name)} makes it false"
    return text


def engine_options_table() -> str:
    """docs/configuration.md's table of the engine's options, drawn from :class:`EngineConfig`.

    One row per field: its name, its ``twostroke`` flag (blank where the commands have none),
    its default and its doc. The docs paste this output and a test fails when the two
    diverge.

    Returns:
        The Markdown table, one row per line, without a trailing newline.

    Raises:
        ValueError: the class has no docstring (``python -OO``), or a doc holds a ``|``.
    """
    docs = _field_docs(EngineConfig)
    if not docs:
        raise ValueError("EngineConfig has no docstring to draw the table from (python -OO)")
    lines = ["| field | flag | default | meaning |", "|---|---|---|---|"]
    for field in attrs.fields(EngineConfig):
        doc = re.sub(r"``(.+?)``", r"`\1`", docs[field.name])
        if "|" in doc:
            raise ValueError(f"EngineConfig.{field.name}'s doc has a '|', which ends a cell")
        flag = f"`{engine_flag(field.name)}`" if field.name in ENGINE_FLAGS else ""
        lines.append(f"| `{field.name}` | {flag} | `{field.default!r}` | {doc} |")
    return "\n".join(lines)


# --- the HTTP server ----------------------------------------------------------------------

#: The ``Host`` names a server without an API key answers to when its ``allowed_hosts`` is
#: ``None``, besides the address it binds.
LOOPBACK_HOST_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})


def without_port(host: str) -> str:
    """``host``, as a ``Host`` header gives it, without its port (``[::1]:8000``: ``[::1]``)."""
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def host_names(value: object) -> frozenset[str] | None:
    """The allow-list ``value`` names, lower-cased (``None`` stays ``None``), if it is one.

    Each entry is a host as it appears in a ``Host`` header without its port (``localhost``,
    ``10.0.0.5``, ``[::1]``, ``llm.internal``), or ``*`` for any host; an IPv6 address gets
    the brackets a ``Host`` header puts around it (``::1`` is ``[::1]``). The converter of
    :attr:`ServerConfig.allowed_hosts`.

    Raises:
        TypeError: ``value`` is a string (not a list of them) or holds something else.
        ValueError: an entry is empty or has a port or a space in it.
    """
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise TypeError(
            f"allowed_hosts must be a list of host names, got {type(value).__name__} {value!r}"
        )
    hosts = set()
    for host in value:
        if not isinstance(host, str):
            raise TypeError(
                f"allowed_hosts entries must be str, got {type(host).__name__} {host!r}"
            )
        name = host.strip().lower()
        if name.count(":") > 1 and not name.startswith("["):
            name = f"[{name}]"  # an IPv6 address, as a Host header writes it
        if not name or " " in name or without_port(name) != name:
            raise ValueError(
                f"allowed_hosts entries must be host names without a port, got {host!r}"
            )
        hosts.add(name)
    return frozenset(hosts)


def _seconds(*, zero: bool, most: float = math.inf) -> Validator:
    """An attrs validator: a finite number of seconds, above 0 (at least 0 with ``zero``),
    at most ``most``."""
    rule = (">= 0" if zero else "> 0") + ("" if math.isinf(most) else f" and <= {most:g}")

    def check(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not is_number(value):
            raise TypeError(
                f"{attribute.name} must be a number of seconds, "
                f"got {type(value).__name__} {value!r}"
            )
        if not ((value >= 0 if zero else value > 0) and math.isfinite(value) and value <= most):
            raise ValueError(f"{attribute.name} must be {rule} seconds and finite, got {value}")

    return check


#: How a limit given as text (a command-line flag) becomes its value, by the field's
#: ``kind`` (its metadata): the parse, the words for what it wants, the flag's metavar.
def _switch(text: str) -> bool:
    """``true`` or ``false`` (any case) as a bool."""
    if text.lower() not in ("true", "false"):
        raise ValueError(text)
    return text.lower() == "true"


_FROM_TEXT: Mapping[str, tuple[Callable[[str], object], str, str]] = {
    "count": (int, "an int", "N"),
    "seconds": (float, "a number of seconds", "SECONDS"),
    "hosts": (lambda text: text.split(","), "host names", "HOST,..."),
    "switch": (lambda text: _switch(text), "true or false", "BOOL"),
    "path": (str, "a file path", "PATH"),
}


def _store_path(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """An attrs validator: ``None``, or a non-empty path (``:memory:`` included)."""
    if value is None:
        return
    if not isinstance(value, str):
        raise TypeError(
            f"{attribute.name} must be a file path (str) or None, "
            f"got {type(value).__name__} {value!r}"
        )
    if not value.strip() or "\0" in value:
        raise ValueError(f"{attribute.name} must be a non-empty file path, got {value!r}")


@attrs.frozen(kw_only=True)
class ServerConfig:
    """What the HTTP server allows: its limits on requests, connections and time.

    One value, validated when built, from ``twostroke serve``'s flags (one per field,
    ``--max-body-bytes`` for ``max_body_bytes``) or in code, and handed whole to
    :func:`~twostroke.engine.server.serve.serve` and
    :func:`~twostroke.engine.server.app.build_app` as ``config=`` (never as keywords), and
    by them to the parts of the server that read it.
    ``build_app`` uses the application's fields; ``max_connections``, ``header_timeout`` and
    ``shutdown_timeout`` are the HTTP server's, which ``serve`` runs.
    docs/serving.md's table of them is :func:`server_limits_table`'s output.

    Args:
        max_body_bytes: The largest request body accepted, in bytes: a larger one is a 413
            ``invalid_request_error`` / ``request_too_large``, refused from its
            ``Content-Length`` before a byte is read or as soon as a chunked body passes it,
            never buffered; that connection is closed.
        max_choices: The most choices one request may ask for, prompts × ``n`` (one engine
            request each): more is a 400 ``invalid_request_error`` / ``too_many_choices``
            (``param`` ``n``, or ``prompt`` when ``n`` is 1) before anything is tokenized.
            Never more than ``max_waiting_requests``, since more could never be queued.
        max_waiting_requests: The most engine requests waiting for admission (those whose
            constraint compiles included; all replicas together behind a coordinator): a
            request whose choices would pass it is a 503 ``server_error`` /
            ``engine_overloaded`` with ``Retry-After: 1``, and none of its choices is queued.
            ``twostroke serve`` gives the engine (each replica) the same limit, which it
            enforces too (``EngineOverloaded``; an engine alone has none). ``None``: no limit
            here.
        allowed_hosts: Without an API key, the ``Host`` names answered (``*``: any; ``None``:
            ``localhost``, ``127.0.0.1``, ``[::1]`` and the address the server binds): another
            is a 403 ``invalid_request_error`` / ``host_not_allowed``. Names without a port,
            comma-separated on the command line; ``/health`` and ``/metrics`` answer any
            ``Host``.
        max_connections: Connections served at once: a request on one more is a 503
            ``server_error`` / ``too_many_connections`` with ``Retry-After: 1``, and that
            connection is closed.
        header_timeout: Seconds a connection has to send a request's headers, from its start
            or its previous response (idle keep-alive connections too): a later one is closed
            without an answer.
        body_timeout: Seconds a request body may take after its headers: a later one is a 408
            ``invalid_request_error`` / ``request_timeout``, and that connection is closed.
        shutdown_timeout: Seconds open responses may take to finish once the server is
            cancelled (SIGTERM or Ctrl-C for ``twostroke serve``; 0: none): meanwhile a new
            request is a 503 ``server_error`` / ``server_shutting_down``; at the end an open
            stream gets an ``error`` event with that type and code and ``[DONE]``, a request
            not yet answered the 503.
        keepalive: Seconds of silence on a stream before a keep-alive comment
            (``: keep-alive``), so that proxies do not time the stream out.
        strict_schemas: Whether a JSON schema that comes over HTTP (``response_format``, a
            tool's ``parameters``) is compiled as if each object subschema with
            ``properties`` and no ``additionalProperties`` said ``false`` (OpenAI's and
            xgrammar's strict mode; docs/structured-output.md says where, and why every
            output still validates against the schema as sent). ``false``: as sent.
        responses_store: The SQLite file ``/v1/responses`` stores responses in (``store``,
            the default, as OpenAI's) for ``previous_response_id`` and ``GET``/``DELETE
            /v1/responses/{id}``; it outlives the server. ``None``:
            ``responses/responses.sqlite3`` in the artifact cache folder
            (``$TWOSTROKE_CACHE_DIR``, else ``~/.cache/twostroke``); ``:memory:``: gone with
            the server.
        responses_max_count: The most responses stored: a new one evicts the oldest.
        responses_max_bytes: The most bytes of JSON the stored responses (with their input
            items) hold: a new one evicts the oldest; one larger alone is not stored (its
            ``store`` reads ``false``).
        responses_max_age: Seconds a stored response is kept (30 days, as OpenAI's): an
            older one is gone (``previous_response_id`` naming it is a 400
            ``previous_response_not_found``, ``GET`` a 404).
        responses_cache_ttl: Seconds a stored response's conversation keeps its KV pinned in
            the prefix cache (``SamplingParams.cache_ttl``), so that the turn continuing it
            (``previous_response_id``) prefills only its new input; pinned blocks give way
            to any request that needs the room. 5 minutes, as the hosted APIs' prompt caches
            (at most an hour); 0 pins nothing.
        batches_store: The SQLite file ``/v1/files`` and ``/v1/batches`` keep files, batches
            and each answered line in; a batch outlives the server and resumes in the next
            one on the same file. ``None``: ``batches.sqlite3`` beside the response store's
            default file (``responses/`` in the artifact cache folder); ``:memory:``: gone
            with the server.
        batch_max_file_bytes: The largest file ``POST /v1/files`` takes, in bytes (100 MiB,
            as OpenAI's): a larger one is a 413, or a 400 naming ``file``.
        batch_max_lines: The most lines a batch's input file may have (50,000, as OpenAI's):
            more is a 400 naming ``file``.
        batch_max_in_flight: The most lines of batches submitted to the engine at once (each
            at most ``max_choices`` engine requests, at priority 1000): what a batch may put
            ahead of an interactive request (docs/serving.md, "Batches").
        batch_store_max_bytes: The most bytes the stored files (uploads and batch outputs)
            hold: an upload past it is a 400 ``storage_full`` until files are deleted.

    Raises:
        TypeError: a value of the wrong type (a bool is not a number); the message names the
            field and the value.
        ValueError: a value out of its field's range.
    """

    # Enough for a whole context as a prompt, with room to spare. Take Llama 3.1's context,
    # 131,072 tokens. As token ids a prompt takes at most 8 bytes a token ("128255, "):
    # 1 MiB. As text, an English token is about 4 characters; the worst common case is text
    # JSON-escaped to ASCII (Python's json.dumps default), where a CJK character becomes
    # \uXXXX (6 bytes) at about 1.5 characters a token: 9 bytes a token, about 1.2 MiB.
    # 8 MiB leaves room for chat framing, a batch of prompts or 64 bytes a token, while no
    # request holds more than 8 MiB of raw body (its decoded JSON is a small multiple of that).
    max_body_bytes: int = attrs.field(
        default=8 * 1024 * 1024, validator=int_at_least(1), metadata={"kind": "count"}
    )
    # As n's own limit (MAX_N): a body of 1.7 KB with 400 one-token prompts and n=128 asked
    # for 51,200 engine requests and stalled the server for minutes.
    max_choices: int = attrs.field(
        default=128, validator=int_at_least(1), metadata={"kind": "count"}
    )
    # 16 batches of the default max_num_seqs (64). The last request in a full queue waits for
    # about 16 rounds of generation, already a long wait for an interactive client, and beyond
    # it a client is better told at once, with a 503 and Retry-After, than kept waiting
    # (Ollama's OLLAMA_MAX_QUEUE is 512). A full queue holds 1024 prompts: 2 million token ids
    # at a 2048-token context, well under 100 MB. An offline batch is no reason for more:
    # LLM.generate queues in-process, unlimited (the engine's own default).
    max_waiting_requests: int | None = attrs.field(
        default=1024, validator=int_at_least(1, optional=True), metadata={"kind": "count"}
    )
    allowed_hosts: frozenset[str] | None = attrs.field(
        default=None, converter=host_names, metadata={"kind": "hosts"}
    )
    # Each connection is a file descriptor, and the usual soft limit of a process is 1,024; a
    # streaming client holds one connection per open request, and an engine runs a few dozen
    # requests at a time (max_num_seqs, 64 by default), so 512 leaves room for a long queue.
    max_connections: int = attrs.field(
        default=512, validator=int_at_least(1), metadata={"kind": "count"}
    )
    # A client on any network sends a few hundred bytes of headers in well under a second;
    # one that takes longer is holding the connection open (a "slowloris").
    header_timeout: float = attrs.field(
        default=10.0, validator=_seconds(zero=False), metadata={"kind": "seconds"}
    )
    # The default body limit, 8 MiB, takes 7 s at 10 Mbit/s; a prompt of a few kilobytes
    # takes milliseconds. A client slower than that is holding a connection, not sending.
    body_timeout: float = attrs.field(
        default=60.0, validator=_seconds(zero=False), metadata={"kind": "seconds"}
    )
    shutdown_timeout: float = attrs.field(
        default=5.0, validator=_seconds(zero=True), metadata={"kind": "seconds"}
    )
    # Under the 30-60 s read timeouts that proxies default to.
    keepalive: float = attrs.field(
        default=15.0, validator=_seconds(zero=False), metadata={"kind": "seconds"}
    )
    # LangChain's bind_tools drops additionalProperties even from a model that forbids extra
    # keys, and a small model then adds keys of its own until max_tokens (issue 36).
    strict_schemas: bool = attrs.field(
        default=True, validator=_boolean, metadata={"kind": "switch"}
    )
    # Under the artifact cache folder, which tests and users already redirect
    # ($TWOSTROKE_CACHE_DIR), and which a user may delete safely: a response is a convenience
    # to continue from, not a record.
    responses_store: str | None = attrs.field(
        default=None, validator=_store_path, metadata={"kind": "path"}
    )
    # An agent's turn stores a response of a few kilobytes to a few hundred (its whole
    # conversation so far as input items): 10,000 of them fit the 256 MiB below on average.
    responses_max_count: int = attrs.field(
        default=10_000, validator=int_at_least(1), metadata={"kind": "count"}
    )
    responses_max_bytes: int = attrs.field(
        default=256 * 1024 * 1024, validator=int_at_least(1), metadata={"kind": "count"}
    )
    responses_max_age: float = attrs.field(
        default=30 * 24 * 3600.0, validator=_seconds(zero=False), metadata={"kind": "seconds"}
    )
    responses_cache_ttl: float = attrs.field(
        default=300.0,
        validator=_seconds(zero=True, most=MAX_CACHE_TTL),
        metadata={"kind": "seconds"},
    )
    # Beside the responses (same folder, same rules), in a file of its own: its own
    # connection and writer, and a batch's answers never count against the responses' bounds.
    batches_store: str | None = attrs.field(
        default=None, validator=_store_path, metadata={"kind": "path"}
    )
    batch_max_file_bytes: int = attrs.field(
        default=100 * 1024 * 1024, validator=int_at_least(1), metadata={"kind": "count"}
    )
    batch_max_lines: int = attrs.field(
        default=50_000, validator=int_at_least(1), metadata={"kind": "count"}
    )
    # A few lines: enough to fill a step's idle seats on a small server, few enough that an
    # interactive request finds at most that many batch requests ahead of it.
    batch_max_in_flight: int = attrs.field(
        default=8, validator=int_at_least(1), metadata={"kind": "count"}
    )
    batch_store_max_bytes: int = attrs.field(
        default=4 * 1024 * 1024 * 1024, validator=int_at_least(1), metadata={"kind": "count"}
    )

    def hosts_answered(self, host: str | None = None) -> frozenset[str]:
        """The ``Host`` names answered without an API key by a server bound to ``host``.

        ``allowed_hosts``, or where it is ``None`` :data:`LOOPBACK_HOST_NAMES` and ``host``
        (an IPv6 address in brackets), lower-cased.

        Raises:
            ValueError: ``host`` cannot be a ``Host`` name (a space in it, say).
        """
        if self.allowed_hosts is not None:
            return self.allowed_hosts
        if host is None:
            return LOOPBACK_HOST_NAMES
        bound = f"[{host}]" if ":" in host and not host.startswith("[") else host
        names = host_names((*LOOPBACK_HOST_NAMES, bound))
        assert names is not None  # a tuple is never None
        return names


def parse_server_limit(name: str, text: str) -> object:
    """The value of :class:`ServerConfig`'s field ``name`` given as ``text`` (a flag), checked.

    Raises:
        ValueError: ``text`` is not what the field takes, or its value is out of range (the
            messages are the field's own: ``"max_connections must be >= 1, got 0"``).
        TypeError: from the field's check, as for a value given in code.
    """
    field = attrs.fields_dict(ServerConfig)[name]
    parse, wanted, _ = _FROM_TEXT[field.metadata["kind"]]
    try:
        value: Any = parse(text)  # the field's check, in ServerConfig, says what it must be
    except ValueError:
        raise ValueError(f"{name} must be {wanted}, got {text!r}") from None
    return getattr(ServerConfig(**{name: value}), name)


def server_field_docs() -> dict[str, str]:
    """Each field of :class:`ServerConfig` and its text in the class's ``Args:``, one line.

    Empty where Python runs without docstrings (``-OO``).

    Raises:
        ValueError: a field the docstring does not document.
    """
    return _field_docs(ServerConfig)


def _field_docs(cls: type) -> dict[str, str]:
    """Each attrs field of ``cls`` and its text in the class's ``Args:``, one line (see
    :func:`server_field_docs`)."""
    if cls.__doc__ is None:
        return {}
    docstring = inspect.cleandoc(cls.__doc__)
    _, _, after = docstring.partition("\nArgs:\n")
    docs: dict[str, list[str]] = {}
    for line in after.splitlines():
        if line and not line.startswith(" "):
            break  # the next section
        entry = re.fullmatch(r" {4}(\w+): (.*)", line)
        if entry:
            docs[entry[1]] = [entry[2]]
        elif docs and line.startswith(" " * 8):
            docs[list(docs)[-1]].append(line.strip())
    missing = [name for name in attrs.fields_dict(cls) if name not in docs]
    if missing:
        raise ValueError(f"{cls.__name__}'s docstring documents no {', '.join(missing)}")
    return {name: " ".join(lines) for name, lines in docs.items()}


def server_flag(name: str) -> str:
    """The ``twostroke serve`` flag of :class:`ServerConfig`'s field ``name``."""
    return "--" + name.replace("_", "-")


def server_flag_metavar(name: str) -> str:
    """How ``--help`` shows the value of the flag of ``name`` (``N``, ``SECONDS``)."""
    return _FROM_TEXT[attrs.fields_dict(ServerConfig)[name].metadata["kind"]][2]


def server_flag_help(name: str) -> str:
    """The ``--help`` text of the flag of ``name``: its doc's first clause and its default.

    Lower-cased at its start, as the command's other help texts are.

    (For argparse, which formats help with ``%``: a ``%`` in the doc is doubled.)
    """
    return _flag_help(ServerConfig, name)


def _flag_help(cls: type, name: str) -> str:
    """:func:`server_flag_help` for the field ``name`` of ``cls``."""
    doc = _field_docs(cls).get(name, name.replace("_", " ")).replace("``", "")
    # A Sphinx role shows its target's last name (:class:`~a.b.C`: C), as Sphinx would.
    doc = re.sub(r":\w+:`~?(?:[\w.]*\.)?(\w+)`", r"\1", doc)
    depth = 0
    for index, character in enumerate(doc):
        depth += {"(": 1, ")": -1}.get(character, 0)
        if depth == 0 and (character == ":" or doc.startswith(". ", index)):
            doc = doc[:index]
            break
    doc = doc[:1].lower() + doc[1:].removesuffix(".").replace("%", "%%")
    default = attrs.fields_dict(cls)[name].default
    if default is None:
        return doc
    return (
        f"{doc} (default: {default:g})"
        if isinstance(default, float)
        else f"{doc} (default: {default})"
    )


def server_limits_table() -> str:
    """docs/serving.md's table of the server's limits, drawn from :class:`ServerConfig`.

    One row per field: its name, its ``twostroke serve`` flag, its default and its doc. The
    docs paste this output and a test fails when the two diverge, so the table can never
    disagree with the class.

    Returns:
        The Markdown table, one row per line, without a trailing newline.
    """
    docs = server_field_docs()
    if not docs:
        raise ValueError("ServerConfig has no docstring to draw the table from (python -OO)")
    lines = ["| field | flag | default | limit |", "|---|---|---|---|"]
    for field in attrs.fields(ServerConfig):
        doc = re.sub(r"``(.+?)``", r"`\1`", docs[field.name])
        if "|" in doc:
            raise ValueError(f"ServerConfig.{field.name}'s doc has a '|', which ends a cell")
        lines.append(
            f"| `{field.name}` | `{server_flag(field.name)}` | `{field.default!r}` | {doc} |"
        )
    return "\n".join(lines)


def count_argument(option: str) -> Callable[[str], int]:
    """An argparse ``type`` for an option that counts something: an integer >= 0, or an
    error that names ``option`` and the value."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option} must be an int, got {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{option} must be >= 0, got {value}")
        return value

    return parse


def speculative_config_argument(text: str) -> SpeculativeConfig:
    """``--speculative-config JSON`` (``twostroke serve``, ``generate``, ``bench`` and the
    rest): a JSON object of :class:`~twostroke.states.speculation.SpeculativeConfig`'s
    fields, checked as it parses.

    Raises:
        argparse.ArgumentTypeError: not JSON, not an object, or not a valid configuration
            (the message is the configuration's own, naming the field).
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(
            f'must be a JSON object such as \'{{"method": "ngram"}}\': {error}'
        ) from None
    try:
        config = speculative_config(value)
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if config is None:
        raise argparse.ArgumentTypeError("must be a JSON object, got null")
    return config
