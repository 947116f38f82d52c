"""Resolving ``Engine.open(model=...)`` into a runner and its tokenizer."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from twostroke.engine.config import EngineConfig
from twostroke.engine.runners.protocol import ModelRunner
from twostroke.engine.text.tokenizer import Tokenizer
from twostroke.gpu.cores import usable_cores
from twostroke.gpu.device import Device
from twostroke.gpu.isa import cpu_personality
from twostroke.states.validators import check_int_at_least

__all__ = [
    "DEFAULT_MODEL",
    "check_vocabulary",
    "default_torch_threads",
    "intra_op_threads",
    "load_runner",
    "set_intra_op_threads",
]

_log = logging.getLogger(__name__)

#: The model ``make run`` and the CLI use when none is named.
DEFAULT_MODEL = "smollm2"


def default_torch_threads(cores: int | None = None) -> int:
    """The most torch intra-op threads an engine takes on a CPU with ``cores`` cores: all.

    The event loop thread shares a core with the team, which used to make every core a
    loss: a team thread that reaches a barrier spun while the loop thread held its partner's
    core. With every step on the device's own forward thread
    (:class:`~twostroke.gpu.forward_thread.ForwardThread`), OpenMP's waits bounded
    (:mod:`twostroke.gpu.openmp`) and a thread dropped while another wants a core, the
    second core pays. Measured on 2 cores (AMD EPYC, AVX512 with bf16, SmolLM2-135M bf16):
    the bare forward loop goes from 347 to 597 output tok/s on a quiet machine from 1 to 2
    threads. While other processes want the cores, fewer threads run faster, and the
    engine's :class:`~twostroke.gpu.cores.ThreadGovernor` drops to them between steps
    (docs/performance-log.md, "Fewer threads while other work wants the cores").

    Args:
        cores: The cores the engine may use; ``None`` takes the ones this process may run
            on (:func:`~twostroke.gpu.cores.usable_cores`).

    Returns:
        The thread count, at least 1.

    Raises:
        TypeError: ``cores`` is not an int.
        ValueError: ``cores`` is less than 1.
    """
    if cores is None:
        cores = usable_cores()
    return check_int_at_least("cores", cores, 1)


def intra_op_threads(config: EngineConfig, device: Device) -> int | None:
    """torch's intra-op thread count for an engine: ``config.torch_threads``, or the default.

    The default on the CPU is :func:`default_torch_threads` for this machine's cores.
    Elsewhere ``None``: torch's own.
    """
    threads = config.torch_threads
    if threads is None and device.kind == "cpu":
        threads = default_torch_threads()
    return threads


def set_intra_op_threads(config: EngineConfig, device: Device) -> int | None:
    """Set torch's intra-op thread count (process-wide) to :func:`intra_op_threads`.

    :meth:`Engine.open <twostroke.engine.Engine.open>` calls it on its own thread before it
    enters the device, whose forward thread takes the count of the thread that starts it.

    Returns:
        The count set, or ``None`` where torch keeps its own.
    """
    threads = intra_op_threads(config, device)
    if threads is not None:
        torch.set_num_threads(threads)
    return threads


def _log_unapplied() -> None:
    """Say what of a capped personality a library missed (the kernels' choice names the
    personality it was made for)."""
    personality = cpu_personality()
    for line in personality.unapplied(torch.backends.cpu.get_cpu_capability()):
        _log.warning("twostroke: %s", line)


def load_runner(
    model: str | None, *, device: Device, config: EngineConfig
) -> tuple[ModelRunner, Tokenizer]:
    """The runner and tokenizer for a model name, directory or GGUF file.

    ``"toy"`` is the model-free toy runner (see :mod:`twostroke.engine.runners.toy`). The
    engine calls it on its device's thread (:meth:`~twostroke.gpu.device.Device.call`),
    after :func:`set_intra_op_threads`.

    Raises:
        ModelLoadError: the model cannot be found or loaded, or its tokenizer has more
            tokens than its embedding has rows (:func:`check_vocabulary`); the message says
            why.
        TokenizerLoadError: its tokenizer cannot be loaded.
    """
    if model is None:
        model = DEFAULT_MODEL
    if not isinstance(model, str):
        raise TypeError(f"model must be a name or a path (str), got {type(model).__name__}")
    if model == "toy":
        from twostroke.engine.runners.toy import ByteTokenizer, ToyRunner

        return ToyRunner(), ByteTokenizer()
    from twostroke.engine.models.loading import load_model
    from twostroke.engine.models.plan import resolve_run
    from twostroke.engine.models.source import read_source
    from twostroke.engine.runners.torch import TorchModelRunner
    from twostroke.engine.text.tokenizer import HFTokenizer

    if device.kind == "cpu":
        _log_unapplied()
    source = read_source(model, mmap=config.mmap)
    loaded = load_model(resolve_run(config, source, device.torch_device))
    tokenizer = HFTokenizer.from_pretrained(loaded.source)
    check_vocabulary(tokenizer, loaded.config.vocab_size, loaded.source)
    runner = TorchModelRunner.from_loaded(
        loaded,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        swa_full=config.swa_full,
    )
    return runner, tokenizer


def check_vocabulary(tokenizer: Tokenizer, embedding_rows: int, source: Path) -> None:
    """Refuse a tokenizer that gives ids the model's embedding has no row for.

    Such a pair loads, and then every prompt that holds one of the extra tokens fails its
    step (the embedding's lookup is out of range): refused at load instead. A tokenizer
    with fewer ids than rows is usual (embeddings padded to a multiple of 64 or 128).

    Args:
        tokenizer: The model's tokenizer.
        embedding_rows: The model's ``vocab_size``, the embedding's rows.
        source: The model's file or directory, for the message.

    Raises:
        ModelLoadError: the tokenizer has more ids than the embedding has rows.
    """
    from twostroke.engine.checkpoints.source import ModelLoadError

    if tokenizer.vocab_size > embedding_rows:
        raise ModelLoadError(
            source,
            f"the tokenizer has {tokenizer.vocab_size} tokens, more than the embedding's "
            f"{embedding_rows} rows: a prompt with a token id >= {embedding_rows} would fail",
        )
