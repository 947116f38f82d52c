"""Engine configuration: one frozen value, validated when built."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from twostroke.states.scheduler_config import SchedulingPolicy
from twostroke.states.validators import int_at_least, is_number, number_in, one_of

__all__ = ["EngineConfig"]


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
            resolves to float32 on a CPU with the kernel, else ``None``. An explicit
            ``dtype`` keeps its weights (``dtype="float32"`` is transformers' arithmetic).
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
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = attrs.field(
        default="auto", validator=one_of("auto", "float32", "bfloat16", "float16")
    )
    quantization: Literal["auto", "fp16", "int8"] | None = attrs.field(
        default="auto", validator=attrs.validators.optional(one_of("auto", "fp16", "int8"))
    )
    torch_threads: int | None = attrs.field(default=None, validator=int_at_least(1, optional=True))
    step_timeout: float | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(number_in(0, low_open=True)),
    )
