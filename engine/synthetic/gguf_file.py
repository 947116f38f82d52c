"""A synthetic model as one GGUF file, as llama.cpp's converter would make it of the folder
:func:`~twostroke.engine.synthetic.hf.write_hf` writes.

What follows ``convert_hf_to_gguf.py`` (ggml-org/llama.cpp; its classes ``TextModel``,
``LlamaModel``, ``Qwen3Model``, ``Gemma3Model``, ``Phi3MiniModel``, ``Qwen3MoeModel`` and
``OlmoeModel``):

* the architecture's name and keys: the common ones of ``TextModel.set_gguf_parameters``
  (``key_length`` and ``value_length`` where ``config.json`` has ``head_dim``), plus
  ``vocab_size`` and ``rope.dimension_count`` for llama, Gemma 3's own list (its
  ``sliding_window``), Phi-3's ``rope.scaling.original_context_length``,
  ``rope.dimension_count`` of the rotated part, ``sliding_window`` and
  ``rope.scaling.attn_factor``; a mixture's ``expert_count`` and ``expert_used_count``,
  and Qwen3-MoE's ``expert_feed_forward_length`` (``Qwen2MoeModel``'s; OLMoE's experts are
  its ``feed_forward_length`` wide, and ``OlmoeModel`` writes its epsilon as 1e-5);
* tensor names through gguf's own ``TensorNameMap`` (the converter's), q and k rows of
  llama permuted as ``LlamaModel.permute`` does (no other family's are), Gemma's norms
  stored plus one (``Gemma3Model.norm_shift``);
* the tensors it makes up: llama 3's ``rope_freqs`` from ``rope_scaling``, Phi-3's
  ``rope_factors_long`` and ``rope_factors_short``; a layer's experts stacked into one
  tensor per projection (``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``:
  ``[experts, rows, columns]``, as ``Qwen2MoeModel.modify_tensors`` merges them);
* types: norms, the router (``ffn_gate_inp``) and every 1-D tensor F32, the rest F16 or
  Q8_0 (F16 where a row does not split into Q8_0 blocks), as ``prepare_tensors`` decides.

Q4_K_M is llama.cpp's own: the F16 file goes through ``llama_cpp.llama_model_quantize`` in a
child process of the Python that ``--llamacpp-python`` names (``_quantize_child.py``), so
the file is made exactly as users' are. The tokenizer is SmolLM2's ``tokenizer.*`` keys,
copied.

Tensors are drawn and written one at a time (``GGUFWriter``'s tensor infos first, then
``write_tensor_data`` per tensor), so memory holds one tensor (a layer's stack of one
projection's experts: 0.8 GB in float32 for Qwen3-30B-A3B's).
"""

from __future__ import annotations

import functools
import math
import os
import re
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import numpy as np
import torch

from twostroke.engine.synthetic.shapes import SMOLLM2_VOCAB_SIZE, Shape
from twostroke.engine.synthetic.tokenizer import gguf_tokenizer_fields
from twostroke.engine.synthetic.weights import TensorSpec, draw, tensor_specs
from twostroke.states.errors import EngineError

__all__ = [
    "GGUF_TYPES",
    "GGUFType",
    "QuantizerUnavailable",
    "require_quantizer",
    "write_gguf",
]

GGUFType = Literal["f16", "q8_0", "q4_k_m"]
#: The types a GGUF file may be made in, the first the default.
GGUF_TYPES: tuple[GGUFType, ...] = ("f16", "q8_0", "q4_k_m")

#: llama.cpp's architecture of each family.
_ARCHITECTURES = {
    "llama": "llama",
    "qwen3": "qwen3",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "qwen3moe": "qwen3moe",
    "olmoe": "olmoe",
}
#: One expert's projection in a checkpoint: its stack's name is the same without ``N.``.
_EXPERT = re.compile(r"(?P<stem>.+\.mlp\.experts)\.(?P<expert>[0-9]+)\.(?P<proj>\w+)\.weight")
#: llama.cpp's ``LLAMA_FTYPE_MOSTLY_Q4_K_M`` (``gguf.LlamaFileType.MOSTLY_Q4_K_M``).
_Q4_K_M = 15
_CHILD = Path(__file__).with_name("_quantize_child.py")
#: A quantization of a 4 B model takes a minute or two on two cores; this bounds a hang.
_QUANTIZE_TIMEOUT = 3600.0


class QuantizerUnavailable(EngineError, ValueError):
    """Q4_K_M was asked for without a Python that has llama.cpp's quantizer, or that Python
    could not quantize.

    Attributes:
        python: The ``--llamacpp-python`` given (``None``: none).
    """

    def __init__(self, python: str | None, problem: str) -> None:
        self.python = python
        super().__init__(problem)


def write_gguf(
    shape: Shape,
    path: Path,
    *,
    type: GGUFType = "f16",
    seed: int = 0,
    llamacpp_python: str | os.PathLike[str] | None = None,
) -> None:
    """Write ``shape``'s model, its weights drawn from ``seed``, as the GGUF file ``path``.

    Args:
        shape: The shape.
        path: The file (replaced if it exists); its folder must exist.
        type: The weights' type.
        seed: The weights' seed (the same numbers as :func:`~.hf.write_hf`'s).
        llamacpp_python: The Python of a venv with ``llama-cpp-python``; needed for
            ``"q4_k_m"`` only.

    Raises:
        ValueError: ``type`` is not one of :data:`GGUF_TYPES`.
        QuantizerUnavailable: ``"q4_k_m"`` without ``llamacpp_python``, or that Python
            cannot import ``llama_cpp`` or failed to quantize (its message says how).
        ModelLoadError: SmolLM2's GGUF (its tokenizer) is not installed.
        OSError: the file cannot be written.
    """
    require_quantizer(type, llamacpp_python)
    if type != "q4_k_m" or llamacpp_python is None:
        _write(shape, path, "q8_0" if type == "q8_0" else "f16", seed)
        return
    unquantized = path.with_name(f".{path.name}.f16.tmp")
    try:
        _write(shape, unquantized, "f16", seed)
        _quantize(str(llamacpp_python), unquantized, path)
    finally:
        unquantized.unlink(missing_ok=True)


def require_quantizer(type: GGUFType, llamacpp_python: str | os.PathLike[str] | None) -> None:
    """Check that ``type`` can be made with the quantizer given.

    Raises:
        ValueError: ``type`` is not one of :data:`GGUF_TYPES`.
        QuantizerUnavailable: ``"q4_k_m"`` without ``llamacpp_python``.
    """
    if type not in GGUF_TYPES:
        raise ValueError(f"a GGUF type must be one of {', '.join(GGUF_TYPES)}; got {type!r}")
    if type == "q4_k_m" and llamacpp_python is None:
        raise QuantizerUnavailable(
            None,
            "type q4_k_m is made by llama.cpp's own quantizer, which needs --llamacpp-python "
            "PY, the Python of a venv with llama-cpp-python (`make bench-peers` builds "
            ".venv-llamacpp); got none",
        )


@attrs.frozen
class _Planned:
    """One tensor of the file: its name, the numbers' maker, and its type."""

    name: str
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor] = attrs.field(repr=False)
    qtype: Any


def _write(shape: Shape, path: Path, type: Literal["f16", "q8_0"], seed: int) -> None:
    import gguf

    arch = _ARCHITECTURES[shape.family]
    planned = list(_plan(shape, type, seed))
    writer = gguf.GGUFWriter(path=None, arch=arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"synthetic {shape.name}")
    _add_parameters(writer, shape, gguf)
    writer.add_file_type(
        gguf.LlamaFileType.MOSTLY_F16 if type == "f16" else gguf.LlamaFileType.MOSTLY_Q8_0
    )
    for field in gguf_tokenizer_fields():
        writer.add_key_value(field.key, field.value, field.type, sub_type=field.sub_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for tensor in planned:
        block, type_bytes = gguf.GGML_QUANT_SIZES[tensor.qtype]
        nbytes = math.prod(tensor.shape) // block * type_bytes
        writer.add_tensor_info(
            tensor.name, tensor.shape, np.dtype(np.float32), nbytes, raw_dtype=tensor.qtype
        )
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in planned:
        data = tensor.make().numpy()
        writer.write_tensor_data(gguf.quants.quantize(data, tensor.qtype))
        del data
    writer.close()


def _plan(shape: Shape, type: Literal["f16", "q8_0"], seed: int) -> Iterator[_Planned]:
    """The file's tensors in order: the made-up ones, then the checkpoint's."""
    import gguf

    arch = gguf.MODEL_ARCH[_ARCHITECTURES[shape.family].upper()]
    names = gguf.get_tensor_name_map(arch, shape.num_layers)
    f32 = gguf.GGMLQuantizationType.F32
    for extra, values in _extra_tensors(shape):
        made = torch.tensor(values, dtype=torch.float32)
        yield _Planned(extra, tuple(made.shape), functools.partial(made.clone), f32)
    matrix = gguf.GGMLQuantizationType.F16 if type == "f16" else gguf.GGMLQuantizationType.Q8_0
    for hf_name, specs in _stacked(tensor_specs(shape)):
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        assert name is not None, f"gguf maps no name for {hf_name}"  # the table is ours
        tensor_shape = specs[0].shape if len(specs) == 1 else (len(specs), *specs[0].shape)
        qtype = matrix
        if len(tensor_shape) == 1 or name.endswith(("_norm.weight", "ffn_gate_inp.weight")):
            qtype = f32
        elif tensor_shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            qtype = gguf.GGMLQuantizationType.F16  # the converter's fallback on QuantError
        yield _Planned(name, tensor_shape, _maker(shape, specs, seed), qtype)


def _stacked(specs: Sequence[TensorSpec]) -> Iterator[tuple[str, tuple[TensorSpec, ...]]]:
    """The checkpoint's tensors as the file holds them: each alone under its name, but a
    layer's experts, whose projections come as one stack each (``mlp.experts.gate_proj``),
    yielded once the layer's last expert is seen."""
    stacks: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        expert = _EXPERT.fullmatch(spec.name)
        if expert is None:
            yield from _flushed(stacks)
            yield spec.name, (spec,)
        else:
            stacks.setdefault(f"{expert['stem']}.{expert['proj']}.weight", []).append(spec)
    yield from _flushed(stacks)


def _flushed(stacks: dict[str, list[TensorSpec]]) -> Iterator[tuple[str, tuple[TensorSpec, ...]]]:
    for name, specs in stacks.items():
        yield name, tuple(specs)
    stacks.clear()


def _maker(shape: Shape, specs: tuple[TensorSpec, ...], seed: int) -> Callable[[], torch.Tensor]:
    if len(specs) > 1:
        return functools.partial(_stack, specs, seed)
    (spec,) = specs

    def make() -> torch.Tensor:
        tensor = draw(spec, seed)
        if shape.family == "llama" and spec.name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = shape.num_heads if spec.name.endswith("q_proj.weight") else shape.num_kv_heads
            tensor = _permute(tensor, heads)
        if shape.family == "gemma3" and spec.name.endswith("norm.weight"):
            tensor = tensor + 1.0  # Gemma3RMSNorm scales by 1 + weight; llama.cpp by weight
        return tensor

    return make


def _stack(specs: tuple[TensorSpec, ...], seed: int) -> torch.Tensor:
    """A stack of experts, each drawn as the folder's, in order; filled in place, so that
    memory holds the stack and one expert's matrix, not every expert's twice."""
    stack = torch.empty((len(specs), *specs[0].shape), dtype=torch.float32)
    for index, spec in enumerate(specs):
        stack[index] = draw(spec, seed)
    return stack


def _permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """``LlamaModel.permute``: each head's rotary halves interleaved, as llama.cpp's llama
    rotates pairs of neighbours where transformers rotates halves."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _rotary_dims(shape: Shape) -> int:
    return int(float(shape.config.get("partial_rotary_factor", 1.0)) * shape.hidden_size) // (
        shape.num_heads
    )


def _add_parameters(writer: Any, shape: Shape, gguf: Any) -> None:
    """The architecture's keys, as the converter's ``set_gguf_parameters`` writes them."""
    config = shape.config
    if shape.family == "phi3":
        writer.add_context_length(config["max_position_embeddings"])
        writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
        writer.add_embedding_length(shape.hidden_size)
        writer.add_feed_forward_length(shape.intermediate_size)
        writer.add_block_count(shape.num_layers)
        writer.add_head_count(shape.num_heads)
        writer.add_head_count_kv(shape.num_kv_heads)
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
        writer.add_rope_dimension_count(_rotary_dims(shape))
        writer.add_rope_freq_base(config["rope_theta"])
        writer.add_sliding_window(config.get("sliding_window") or 0)
        scale = config["max_position_embeddings"] / config["original_max_position_embeddings"]
        original = config["original_max_position_embeddings"]
        # Phi3MiniModel's factor for "longrope": sqrt(1 + ln(scale) / ln(original context)).
        attn_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        writer.add_rope_scaling_attn_factors(attn_factor)
        return
    if shape.family == "gemma3":
        writer.add_context_length(config["max_position_embeddings"])
        writer.add_embedding_length(shape.hidden_size)
        writer.add_block_count(shape.num_layers)
        writer.add_feed_forward_length(shape.intermediate_size)
        writer.add_head_count(shape.num_heads)
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
        writer.add_rope_freq_base(config["rope_theta"])
        writer.add_sliding_window(config["sliding_window"])
        writer.add_head_count_kv(shape.num_kv_heads)
        return
    writer.add_block_count(shape.num_layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_freq_base(config["rope_theta"])
    # OlmoeModel writes 1e-5 over TextModel's value (the released config's own, too).
    writer.add_layer_norm_rms_eps(1e-5 if shape.family == "olmoe" else config["rms_norm_eps"])
    if config.get("head_dim") is not None:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.family == "llama":
        writer.add_vocab_size(SMOLLM2_VOCAB_SIZE)
        writer.add_rope_dimension_count(shape.head_dim)
    if shape.num_experts:
        writer.add_expert_used_count(shape.experts_per_token)
        writer.add_expert_count(shape.num_experts)
    if shape.family == "qwen3moe":
        writer.add_expert_feed_forward_length(shape.expert_intermediate_size)


def _extra_tensors(shape: Shape) -> list[tuple[str, list[float]]]:
    """The tensors the converter makes from ``config.json``: llama 3's ``rope_freqs``
    (``LlamaModel.generate_extra_tensors``), Phi-3's long and short rope factors."""
    config = shape.config
    scaling = config.get("rope_scaling") or {}
    if shape.family == "llama" and scaling.get("rope_type") == "llama3":
        dim = shape.head_dim
        base = float(config["rope_theta"])
        freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        factor = scaling.get("factor", 8.0)
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        # As the converter reads it: from config.json's top level, where Llama 3.2 has none.
        old_context = config.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_context / low, old_context / high
        factors = []
        for freq in freqs.tolist():
            wavelen = 2 * math.pi / freq
            if wavelen < high_wavelen:
                factors.append(1.0)
            elif wavelen > low_wavelen:
                factors.append(float(factor))
            else:
                smooth = (old_context / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        return [("rope_freqs.weight", factors)]
    if shape.family == "phi3" and scaling.get("long_factor"):
        return [
            ("rope_factors_long.weight", [float(x) for x in scaling["long_factor"]]),
            ("rope_factors_short.weight", [float(x) for x in scaling["short_factor"]]),
        ]
    return []


def _quantize(python: str, source: Path, target: Path) -> None:
    """``source`` quantized to Q4_K_M as ``target`` by ``llama_cpp.llama_model_quantize`` in a
    child process of ``python``."""
    try:
        done = subprocess.run(
            [python, str(_CHILD), str(source), str(target), str(_Q4_K_M)],
            capture_output=True,
            text=True,
            check=False,
            timeout=_QUANTIZE_TIMEOUT,
        )
    except OSError as error:
        raise QuantizerUnavailable(
            python, f"--llamacpp-python {python!r} cannot be run: {error}"
        ) from error
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise QuantizerUnavailable(
            python,
            f"--llamacpp-python {python!r} could not quantize to q4_k_m "
            f"(exit status {done.returncode}): {last}",
        )
