"""A checkpoint as a model: :class:`ModelSource`, its configuration read and checked.

The checkpoint reader (:mod:`~twostroke.engine.checkpoints.source`) gives the files and what they
say; this module makes the model's shape of it
(:class:`~twostroke.engine.models.config.ModelConfig`) and checks a GGUF file's sizes against its
tensors before anything is allocated from them. The run's plan
(:func:`~twostroke.engine.models.plan.resolve_run`) and the loader
(:func:`~twostroke.engine.models.loading.load_model`) take the result.
"""

from __future__ import annotations

import os
import re
from typing import Any

import attrs
import numpy as np

from twostroke.engine.checkpoints.gguf import GGUFTensor
from twostroke.engine.checkpoints.source import Checkpoint, ModelLoadError, read_checkpoint
from twostroke.engine.models.config import ModelConfig

__all__ = ["ModelSource", "read_config", "read_source"]

_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@attrs.frozen
class ModelSource:
    """A model's files and its shape, its weights unread.

    Attributes:
        checkpoint: The files, and what they say.
        config: The model's shape.
        tensors: A GGUF file's tensors without ``rope_freqs`` (which the configuration
            holds as ``rope_frequency_factors``); empty for a directory.
    """

    checkpoint: Checkpoint
    config: ModelConfig
    tensors: dict[str, GGUFTensor] = attrs.field(factory=dict, repr=False)

    @property
    def path(self) -> os.PathLike[str]:
        """The directory or GGUF file."""
        return self.checkpoint.path

    @property
    def is_gguf(self) -> bool:
        """Whether the weights are a GGUF file's."""
        return self.checkpoint.format == "gguf"


def read_source(model: str | os.PathLike[str], *, mmap: bool = True) -> ModelSource:
    """The model a name, directory or GGUF file stands for, its weights unread.

    Args:
        model: A name from :data:`~twostroke.engine.checkpoints.source.KNOWN_MODELS`, a model
            directory or a GGUF file.
        mmap: Map a GGUF file (``False``: read it into memory).

    Raises:
        ModelLoadError: the model cannot be found, is not supported, or its configuration
            is missing, invalid or not borne out by its tensors.
    """
    checkpoint = read_checkpoint(model, mmap=mmap)
    if checkpoint.format == "hf":
        try:
            config = ModelConfig.from_hf_config(checkpoint.metadata)
        except (TypeError, ValueError) as error:
            raise ModelLoadError(checkpoint.path / "config.json", str(error)) from error
        return ModelSource(checkpoint, config)
    config, tensors = _gguf_config(checkpoint)
    return ModelSource(checkpoint, config, tensors)


def read_config(model: str | os.PathLike[str]) -> ModelConfig:
    """The shape of a model, read without loading its weights (for what needs sizes only,
    the benchmark's cost model: a GGUF file's tensors are mapped, not read).

    Raises:
        ModelLoadError: as :func:`read_source`.
    """
    return read_source(model).config


def _gguf_config(checkpoint: Checkpoint) -> tuple[ModelConfig, dict[str, GGUFTensor]]:
    """The file's configuration and its tensors (``rope_freqs`` taken out).

    The configuration is checked against the tensors (:func:`_check_sizes`) before it is
    returned, so that nothing is allocated from sizes the file's tensors do not bear out.
    """
    path = checkpoint.path
    metadata: dict[str, Any] = dict(checkpoint.metadata)
    tensors = dict(checkpoint.tensors)
    freqs = tensors.pop("rope_freqs.weight", None)
    longrope = {kind: _rope_factors(path, tensors, kind) for kind in ("short", "long")}
    try:
        config = ModelConfig.from_gguf_metadata(
            metadata,
            tuple(tensors),
            rope_factors_short=longrope["short"],
            rope_factors_long=longrope["long"],
        )
    except (TypeError, ValueError) as error:
        raise ModelLoadError(path, str(error)) from error
    _check_sizes(path, config, tensors)
    if freqs is not None:
        # Its length is checked before a float of it is made: a file's tensor may be huge.
        if freqs.data.dtype.kind != "f" or freqs.shape != (config.head_dim // 2,):
            raise ModelLoadError(
                path,
                f"tensor 'rope_freqs.weight' is {freqs.tensor_type.name} {list(freqs.shape)}, "
                f"expected plain numbers [head_dim / 2] = [{config.head_dim // 2}]",
            )
        factors = tuple(float(x) for x in np.asarray(freqs.data, dtype=np.float32))
        config = attrs.evolve(config, rope_frequency_factors=factors)
    return config, tensors


def _rope_factors(
    path: os.PathLike[str], tensors: dict[str, GGUFTensor], kind: str
) -> tuple[float, ...] | None:
    """Phi-3's LongRoPE ``rope_factors_<kind>`` tensor taken out of ``tensors`` (one number
    per rotated pair; the configuration checks the count), or ``None`` where absent."""
    name = f"rope_factors_{kind}.weight"
    tensor = tensors.pop(name, None)
    if tensor is None:
        return None
    # Its kind and size are checked before a float of it is made: a file's tensor may be huge.
    if tensor.data.dtype.kind != "f" or len(tensor.shape) != 1 or tensor.shape[0] > 1 << 16:
        raise ModelLoadError(
            path,
            f"tensor {name!r} is {tensor.tensor_type.name} {list(tensor.shape)}, expected "
            "plain numbers, one per rotated pair",
        )
    return tuple(float(x) for x in np.asarray(tensor.data, dtype=np.float32))


def _check_sizes(
    path: os.PathLike[str], config: ModelConfig, tensors: dict[str, GGUFTensor]
) -> None:
    """Refuse a configuration whose sizes the file's tensors do not have, before the model
    is allocated from it.

    Each size the model allocates by (layers, vocabulary, widths of the residual stream, the
    MLP and the attention) is compared with a tensor that has it: the highest ``blk.N``, and
    the shapes of the embedding, the first layer's q, k and up projections. A file whose
    ``block_count`` says 200 000 was otherwise allocated for 20 s and 2 GB before "missing
    tensors" was reported.

    Raises:
        ModelLoadError: a size differs from its tensor's, or the tensor is missing.
    """
    layers = [int(match[1]) for name in tensors if (match := _GGUF_BLOCK.fullmatch(name))]
    highest = max(layers, default=-1)
    if highest + 1 != config.num_layers:
        found = f"blk.{highest} ({highest + 1} layers)" if layers else "no blk.N tensor"
        raise ModelLoadError(
            path,
            f"the metadata's block_count is {config.num_layers}, but the file's highest layer "
            f"is {found}",
        )
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden = config.hidden_size
    expected: dict[str, tuple[tuple[int, ...], str]] = {
        "token_embd.weight": ((config.vocab_size, hidden), "(vocab_size, embedding_length)"),
        "blk.0.ffn_up.weight": (
            (config.intermediate_size, hidden),
            "(feed_forward_length, embedding_length)",
        ),
        "blk.0.attn_q.weight": ((q_rows, hidden), "(head_count * head_dim, embedding_length)"),
        "blk.0.attn_k.weight": ((kv_rows, hidden), "(head_count_kv * head_dim, embedding_length)"),
    }
    if config.sparse(0):  # a mixture of experts: its experts' stacked up projections
        del expected["blk.0.ffn_up.weight"]
        expected["blk.0.ffn_up_exps.weight"] = (
            (config.num_experts, config.expert_intermediate_size, hidden),
            "(expert_count, expert_feed_forward_length, embedding_length)",
        )
    if config.architecture == "Phi3ForCausalLM":  # its fused projections, stored fused
        expected = {
            "token_embd.weight": expected["token_embd.weight"],
            "blk.0.ffn_up.weight": (
                (2 * config.intermediate_size, hidden),
                "(2 * feed_forward_length, embedding_length)",
            ),
            "blk.0.attn_qkv.weight": (
                (q_rows + 2 * kv_rows, hidden),
                "((head_count + 2 * head_count_kv) * head_dim, embedding_length)",
            ),
        }
    for name, (shape, meaning) in expected.items():
        tensor = tensors.get(name)
        if tensor is None:
            raise ModelLoadError(path, f"missing tensor {name!r}, which the model needs")
        if tensor.shape != shape:
            raise ModelLoadError(
                path,
                f"tensor {name!r} has shape {tensor.shape}, but the metadata says {meaning} "
                f"= {shape}",
            )
