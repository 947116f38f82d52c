"""Resolving ``Engine.open(model=...)`` into a runner and its tokenizer."""

from __future__ import annotations

import torch

from twostroke.engine.config import EngineConfig
from twostroke.engine.runner import ModelRunner
from twostroke.engine.tokenizer import Tokenizer
from twostroke.gpu.device import Device

__all__ = ["DEFAULT_MODEL", "load_runner"]

#: The model ``make run`` and the CLI use when none is named.
DEFAULT_MODEL = "smollm2"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_runner(
    model: str | None, *, device: Device, config: EngineConfig
) -> tuple[ModelRunner, Tokenizer]:
    """The runner and tokenizer for a model name, directory or GGUF file.

    ``"toy"`` is the model-free toy runner (see :mod:`twostroke.engine.testing`).
    ``config.torch_threads``, when set, is applied to torch before the model loads.

    Raises:
        ModelLoadError: the model cannot be found or loaded; the message says why.
        TokenizerLoadError: its tokenizer cannot be loaded.
    """
    if model is None:
        model = DEFAULT_MODEL
    if not isinstance(model, str):
        raise TypeError(f"model must be a name or a path (str), got {type(model).__name__}")
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    if model == "toy":
        from twostroke.engine.testing import ByteTokenizer, ToyRunner

        return ToyRunner(), ByteTokenizer()
    from twostroke.engine.model_runner import TorchModelRunner
    from twostroke.engine.models.loader import load_model
    from twostroke.engine.tokenizer import HFTokenizer

    dtype = None if config.dtype == "auto" else _DTYPES[config.dtype]
    loaded = load_model(model, dtype=dtype, device=device.torch_device)
    runner = TorchModelRunner.from_loaded(
        loaded, max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs
    )
    return runner, HFTokenizer.from_pretrained(loaded.source)
