"""llama.cpp as a second reference for an architecture: a transformers model written as a GGUF
file under llama.cpp's names and keys (:func:`write_gguf`), and llama.cpp's logits on it
(:func:`llamacpp_logits`), computed by ``llama_cpp`` in a child process of the venv it is
built in (``.venv-llamacpp``, ``scripts/setup_llamacpp_peer.sh``; ``$TWOSTROKE_LLAMACPP_PYTHON``
names another). Without it the tests that ask say why they skip.

The writer is independent of twostroke's loader: tensor names come from the ``gguf`` package's
own ``TensorNameMap`` (the one llama.cpp's converter uses), the q/k rows of the architectures
whose converter is a ``LlamaModel`` are permuted as ``LlamaModel.permute`` does, and the keys
are those the converter's ``set_gguf_parameters`` writes. The tokenizer is a byte-level BPE of
the model's vocabulary size (the 256 byte tokens of GPT-2's alphabet): llama.cpp needs one to
load a file, and the logits are compared by token id.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import gguf
import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
LLAMACPP_PYTHON_ENV = "TWOSTROKE_LLAMACPP_PYTHON"

#: GGUF architectures whose converter class is a ``LlamaModel`` (q/k rows permuted).
PERMUTED = frozenset({"llama", "granite", "smollm3"})

_CHILD = """
import json, sys
import llama_cpp
import numpy

job = json.load(sys.stdin)
model = llama_cpp.Llama(
    model_path=job["path"], n_ctx=job["n_ctx"], n_batch=job["n_ctx"], logits_all=True,
    n_threads=1, type_k=0, type_v=0, verbose=False,  # GGML_TYPE_F32: a float32 KV cache
)
result = []
for tokens in job["sequences"]:
    model.reset()
    model.eval(tokens)
    result.append(numpy.array(model.scores[: len(tokens)], dtype=numpy.float32).tolist())
json.dump(result, sys.stdout)
"""


def llamacpp_python() -> Path:
    """The Python of the venv llama-cpp-python is built in, or a skip saying how to build it."""
    configured = os.environ.get(LLAMACPP_PYTHON_ENV)
    python = Path(configured) if configured else REPO / ".venv-llamacpp" / "bin" / "python"
    if not python.is_file():
        pytest.skip(
            f"llama_cpp is not importable: no {python} (build it with "
            f"scripts/setup_llamacpp_peer.sh, or set ${LLAMACPP_PYTHON_ENV})"
        )
    found = subprocess.run(
        [str(python), "-c", "import llama_cpp"], capture_output=True, text=True, check=False
    )
    if found.returncode != 0:
        last = found.stderr.strip().splitlines()[-1:] or [f"exit status {found.returncode}"]
        pytest.skip(f"llama_cpp is not importable by {python}: {last[0]}")
    return python


def llamacpp_logits(path: Path, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """llama.cpp's float32 logits at every position of each sequence, each evaluated from an
    empty cache (one ``Llama`` with ``logits_all=True``)."""
    longest = max(len(tokens) for tokens in sequences)
    job = {"path": str(path), "n_ctx": max(32, longest), "sequences": [list(s) for s in sequences]}
    done = subprocess.run(
        [str(llamacpp_python()), "-c", _CHILD],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return [torch.tensor(rows, dtype=torch.float32) for rows in json.loads(done.stdout)]


def _byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: the 256 strings its BPE starts from (``bytes_to_unicode``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[byte] for byte in range(256)]


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``: interleave each head's rotary halves."""
    shape = weights.shape
    return (
        weights.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def _add_phi3(writer: Any, config: Any, rope: dict[str, Any]) -> None:
    """Phi3MiniModel's own keys: the original context, the sliding window (0 for none) and,
    with LongRoPE, its attention factor (the factors are tensors: :func:`write_gguf`)."""
    original = rope.get("original_max_position_embeddings", config.max_position_embeddings)
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(config.sliding_window or 0)
    if rope.get("rope_type") == "longrope":
        scale = config.max_position_embeddings / original
        attn_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        writer.add_rope_scaling_attn_factors(attn_factor)


def _add_gemma3(writer: Any, config: Any, rope: dict[str, Any]) -> None:
    """Gemma3Model's own keys: the sliding window and the global layers' linear scaling (the
    layer kinds, the local base and ``query_pre_attn_scalar`` are llama.cpp's constants)."""
    writer.add_sliding_window(config.sliding_window)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if config.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)


def _add_gemma2(writer: Any, config: Any) -> None:
    """Gemma2Model's own keys: the sliding window and both soft-capping values (the layer
    kinds, every other one windowed, and ``query_pre_attn_scalar`` are llama.cpp's
    constants)."""
    writer.add_sliding_window(config.sliding_window)
    writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    writer.add_final_logit_softcapping(config.final_logit_softcapping)


def _stacked_experts(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The state's tensors, transformers 5's fused experts (``experts.gate_up_proj``
    ``[experts, 2 * width, hidden]``) split into the gate and up stacks the converter writes
    (``experts.gate_proj.weight``: ``ffn_gate_exps``), the others under their names."""
    found = []
    for name, tensor in state.items():
        if name.endswith(".experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            stem = name.removesuffix("gate_up_proj")
            found += [(f"{stem}gate_proj.weight", gate), (f"{stem}up_proj.weight", up)]
        elif name.endswith(".experts.down_proj"):
            found.append((f"{name}.weight", tensor))
        else:
            found.append((name, tensor))
    return found


def write_gguf(
    path: Path, model: Any, arch: str, *, matrices: Literal["f32", "q8_0"] = "f32"
) -> None:
    """Write a transformers model as llama.cpp's converter would, as ``arch``.

    Args:
        path: The file.
        model: The transformers model (its config's fields are read as the converter reads
            them: Granite's multipliers, a yarn ``rope_parameters``, Phi-3's partial rotary
            share and LongRoPE factors).
        arch: llama.cpp's architecture name.
        matrices: Every 2-D tensor (the embedding included) in F32 or Q8_0; norms stay F32.
    """
    config = model.config
    layers = config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if config.vocab_size != 256:
        raise ValueError(f"the byte-level tokenizer has 256 tokens, the model {config.vocab_size}")
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = dict(config.rope_parameters)
    rope = dict(rope.get("full_attention") or rope)  # Gemma 3's global layers' (the file's)
    # Phi3MiniModel: the rotated part's width (int() of the share of the residual stream).
    share = rope.get("partial_rotary_factor", 1.0) if arch == "phi3" else 1.0
    writer.add_rope_dimension_count(int(share * config.hidden_size) // config.num_attention_heads)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "phi3":
        _add_phi3(writer, config, rope)
    if arch == "gemma3":
        _add_gemma3(writer, config, rope)
    if arch == "gemma2":
        _add_gemma2(writer, config)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:
        # Qwen2MoeModel's keys (Qwen3-MoE's converter is one): the experts' count, those a
        # token uses and one expert's width.
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(
            getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        )
    if arch == "granite":
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    writer.add_tokenizer_model("gpt2")
    tokens = _byte_tokens()
    if arch == "phi3":
        # llama.cpp sets attributes of Phi's special tokens in a file named "phi3" (and
        # refuses one that lacks them): the last bytes' ids hold them.
        tokens[-5:] = ["</s>", "<unk>", "<s>", "<|endoftext|>", "<|end|>"]
    writer.add_token_list(tokens)
    writer.add_token_merges(["Ġ Ġ"])
    writer.add_eos_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_add_bos_token(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    matrix = gguf.GGMLQuantizationType.F32 if matrices == "f32" else gguf.GGMLQuantizationType.Q8_0
    for hf_name, parameter in _stacked_experts(model.state_dict()):
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"gguf maps no name for {hf_name}"
        weights = parameter.detach().float().numpy()
        if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            weights = weights + 1.0  # Gemma3Model.norm_shift: llama.cpp scales by the weight
        if arch in PERMUTED and ".q_proj." in hf_name:
            weights = _permute(weights, config.num_attention_heads)
        elif arch in PERMUTED and ".k_proj." in hf_name:
            weights = _permute(weights, config.num_key_value_heads)
        # The converter keeps a router (ffn_gate_inp) in F32; experts' stacks are matrices.
        router = hf_name.endswith(".mlp.gate.weight")
        if weights.ndim >= 2 and not router and matrix != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(weights, matrix), raw_dtype=matrix)
        else:
            writer.add_tensor(name, np.ascontiguousarray(weights))
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        for kind in ("long", "short"):
            factors = np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
