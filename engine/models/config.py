"""The shape of a Llama-family model, read from a Hugging Face ``config.json`` or GGUF metadata.

One frozen value describes every model :mod:`twostroke.engine.models.llama` can run, however
it was stored, so the decoder never looks at file formats. The two named constructors take
plain mappings (already parsed JSON, already read GGUF key/values): they do no I/O, and the
loader wraps the ``ValueError`` they raise in an error that names the file.

Only what changes the computation is kept. Flavours differ in a few flags: Qwen2 adds biases
to the q/k/v projections, Llama may add them to every attention projection (and to the MLP),
Mistral's layers attend within a sliding window (``sliding_window``; Qwen2's from
``max_window_layers`` on where it asks, a ``layer_types`` list where the config has one).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

import attrs

from twostroke.engine.models.features import (
    GEMMA2_DEFAULTS,
    GEMMA3_DEFAULTS,
    gguf_features,
    hf_features,
    sliding_window_of,
)
from twostroke.engine.models.fields import count, head_dim_of, require, token_ids
from twostroke.engine.models.rope import RopeScaling, hf_rope_scaling, phi3_rope, yarn_mscale
from twostroke.states.validators import int_at_least, number_in

__all__ = ["MISSING_FEATURES", "SUPPORTED_ARCHITECTURES", "ModelConfig", "RopeScaling"]

#: The Hugging Face ``architectures`` the decoder implements.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "SmolLM3ForCausalLM",
    "GraniteForCausalLM",
    "Olmo2ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
)

#: GGUF ``general.architecture`` values and the Hugging Face architecture each one is.
_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}


#: Architectures people bring that the decoder does not run yet, by the feature it lacks
#: (HF ``architectures`` names and GGUF ``general.architecture`` values alike), so the
#: refusal says what is missing rather than only what is supported.
MISSING_FEATURES = {
    "GptOssForCausalLM": "mixture-of-experts layers with MXFP4 experts and attention sinks",
    "gpt-oss": "mixture-of-experts layers with MXFP4 experts and attention sinks",
    "Gemma3ForConditionalGeneration": "image inputs (its text model runs as Gemma3ForCausalLM)",
    "FalconH1ForCausalLM": "hybrid Mamba layers",
    "falcon-h1": "hybrid Mamba layers",
    "GraniteMoeHybridForCausalLM": "hybrid Mamba layers and mixture-of-experts layers",
    "granitehybrid": "hybrid Mamba layers and mixture-of-experts layers",
    "Qwen3NextForCausalLM": "hybrid linear-attention layers and mixture-of-experts layers",
    "qwen3next": "hybrid linear-attention layers and mixture-of-experts layers",
    "GPT2LMHeadModel": "learned position embeddings and LayerNorm",
    "gpt2": "learned position embeddings and LayerNorm",
}


def _unsupported(kind: str, names: object, supported: Iterable[str]) -> ValueError:
    """The refusal of an architecture: what it lacks where that is known, and what runs."""
    listed = names if isinstance(names, list) else [names]
    lacking = [MISSING_FEATURES[n] for n in listed if isinstance(n, str) and n in MISSING_FEATURES]
    missing = f" (twostroke lacks its {lacking[0]})" if lacking else ""
    return ValueError(f"unsupported {kind} {names!r}{missing}; supported: {', '.join(supported)}")


_POSITIVE = int_at_least(1)
_POSITIVE_NUMBER = number_in(0, low_open=True)
_QK_NORMS = ("none", "head", "full")


@attrs.frozen(kw_only=True)
class ModelConfig:
    """The sizes and flavour flags of one Llama-family decoder.

    Attributes:
        architecture: The Hugging Face class name (one of :data:`SUPPORTED_ARCHITECTURES`).
        vocab_size: Rows of the embedding and of the output projection.
        hidden_size: Width of the residual stream.
        intermediate_size: Width of the SwiGLU MLP.
        num_layers: Decoder layers.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (grouped-query attention when fewer than query heads).
        head_dim: Width of one head.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: Rotary base.
        rope_scaling: Long-context frequency scaling, or ``None``.
        rope_frequency_factors: Per-frequency divisors stored by llama.cpp instead of
            ``rope_scaling`` (its ``rope_freqs`` tensor), or ``None``.
        max_position_embeddings: The longest context the model supports.
        tie_word_embeddings: The output projection reuses the embedding matrix.
        qkv_bias: The q, k and v projections have biases (Qwen2; Llama's ``attention_bias``).
        o_bias: The attention output projection has a bias (Llama's ``attention_bias``).
        mlp_bias: The MLP projections have biases (Llama's ``mlp_bias``).
        bos_token_id: Beginning-of-sequence id, if the model has one.
        eos_token_ids: End-of-sequence ids.
        qk_norm: RMSNorm of the queries and keys before rotary: ``"none"``, ``"head"``
            (Qwen3: each head, a weight of ``head_dim``) or ``"full"`` (OLMo 2: the whole
            projection, a weight of its width).
        norm_placement: ``"pre"``: each block's input normalized (Llama); ``"post"``: each
            block's output normalized before it joins the residual stream (OLMo 2);
            ``"both"``: each block's input and output (Gemma 3).
        nope_layers: Indices of the layers whose queries and keys are not rotated
            (SmolLM3's NoPE layers).
        embedding_scale: What the embeddings are multiplied by (Granite).
        attention_scale: What the attention scores are multiplied by, or ``None`` for
            ``head_dim ** -0.5`` (Granite's ``attention_multiplier``).
        residual_scale: What each block's output is multiplied by before it joins the
            residual stream (Granite).
        logit_scale: What the logits are divided by (Granite's ``logits_scaling``).
        sliding_window: The positions a windowed layer's query sees, its own included
            (transformers' ``sliding_window``), or ``None`` where every layer sees all.
        global_layers: With a sliding window, the layers that see all positions anyway
            (Qwen2's below ``max_window_layers``; a ``layer_types`` list's
            ``full_attention`` layers).
        rotary_dim: The leading dimensions of each head that rotate (Phi-3's
            ``partial_rotary_factor`` times ``head_dim``), or ``None`` for the whole head.
        local_rope_theta: The rotary base of the sliding-window layers, which rotate
            unscaled (Gemma 3's ``rope_local_base_freq``), or ``None`` where every layer
            rotates by ``rope_theta`` and ``rope_scaling``.
        norm_offset: ``None``: Llama's RMSNorm (the weight times the normalized values cast
            to the dtype). A number: Gemma's, ``(norm_offset + weight)`` times the
            normalized values in float32, then cast: 1 from a Hugging Face checkpoint, 0
            from a GGUF file (llama.cpp's converter stores ``weight + 1``).
        hidden_activation: The MLP's gate activation: ``"silu"`` (SwiGLU) or
            ``"gelu_tanh"`` (Gemma's ``gelu_pytorch_tanh``).
        final_logit_softcapping: The logits become ``cap * tanh(logits / cap)`` (Gemma),
            or ``None``.
        attn_logit_softcapping: The scaled attention scores become ``cap * tanh(scores /
            cap)`` before the mask and the softmax (Gemma 2), or ``None``.
        num_experts: The experts of a mixture-of-experts layer (0: every MLP is dense).
        experts_per_token: The experts each token's router picks (top-k).
        expert_intermediate_size: Width of one expert's SwiGLU.
        normalize_expert_weights: The picked experts' router probabilities are divided by
            their sum (Qwen3-MoE's ``norm_topk_prob``).
        dense_layers: With experts, the layers whose MLP is dense anyway (Qwen3-MoE's
            ``mlp_only_layers``, and those ``decoder_sparse_step`` skips).
    """

    architecture: str = attrs.field(validator=attrs.validators.in_(SUPPORTED_ARCHITECTURES))
    vocab_size: int = attrs.field(validator=_POSITIVE)
    hidden_size: int = attrs.field(validator=_POSITIVE)
    intermediate_size: int = attrs.field(validator=_POSITIVE)
    num_layers: int = attrs.field(validator=_POSITIVE)
    num_heads: int = attrs.field(validator=_POSITIVE)
    num_kv_heads: int = attrs.field(validator=_POSITIVE)
    head_dim: int = attrs.field(validator=_POSITIVE)
    rms_norm_eps: float = attrs.field(validator=_POSITIVE_NUMBER)
    rope_theta: float = attrs.field(validator=_POSITIVE_NUMBER)
    rope_scaling: RopeScaling | None = None
    rope_frequency_factors: tuple[float, ...] | None = None
    max_position_embeddings: int = attrs.field(validator=_POSITIVE)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qk_norm: str = attrs.field(default="none", validator=attrs.validators.in_(_QK_NORMS))
    norm_placement: str = attrs.field(
        default="pre", validator=attrs.validators.in_(("pre", "post", "both"))
    )
    nope_layers: tuple[int, ...] = ()
    embedding_scale: float = attrs.field(default=1.0, validator=_POSITIVE_NUMBER)
    attention_scale: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(_POSITIVE_NUMBER)
    )
    residual_scale: float = attrs.field(default=1.0, validator=_POSITIVE_NUMBER)
    logit_scale: float = attrs.field(default=1.0, validator=_POSITIVE_NUMBER)
    sliding_window: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_POSITIVE)
    )
    global_layers: tuple[int, ...] = ()
    rotary_dim: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_POSITIVE)
    )
    local_rope_theta: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(_POSITIVE_NUMBER)
    )
    norm_offset: float | None = None
    hidden_activation: str = attrs.field(
        default="silu", validator=attrs.validators.in_(("silu", "gelu_tanh"))
    )
    final_logit_softcapping: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(_POSITIVE_NUMBER)
    )
    attn_logit_softcapping: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(_POSITIVE_NUMBER)
    )
    num_experts: int = attrs.field(default=0, validator=int_at_least(0))
    experts_per_token: int = attrs.field(default=0, validator=int_at_least(0))
    expert_intermediate_size: int = attrs.field(default=0, validator=int_at_least(0))
    normalize_expert_weights: bool = False
    dense_layers: tuple[int, ...] = ()

    def __attrs_post_init__(self) -> None:
        if self.num_experts and not (
            1 <= self.experts_per_token <= self.num_experts and self.expert_intermediate_size
        ):
            raise ValueError(
                f"experts_per_token must be in [1, num_experts = {self.num_experts}] and "
                f"expert_intermediate_size >= 1, got {self.experts_per_token} and "
                f"{self.expert_intermediate_size}"
            )
        for name in ("nope_layers", "global_layers", "dense_layers"):
            indices = getattr(self, name)
            outside = [index for index in indices if not 0 <= index < self.num_layers]
            if outside:
                raise ValueError(
                    f"{name} must be layer indices in [0, {self.num_layers}), got {outside}"
                )
        if self.local_rope_theta is not None and self.sliding_window is None:
            raise ValueError(
                f"local_rope_theta is the sliding-window layers' rotary base, and there is no "
                f"sliding window: got local_rope_theta={self.local_rope_theta} and "
                f"sliding_window=None"
            )
        if self.global_layers and self.sliding_window is None:
            raise ValueError(
                f"global_layers are the exceptions to a sliding window, and there is none: "
                f"got global_layers={self.global_layers} and sliding_window=None"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads must be a multiple of num_kv_heads, got num_heads={self.num_heads} "
                f"and num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        rotated = self.rotary_width
        if rotated % 2 or rotated > self.head_dim:
            raise ValueError(
                f"rotary_dim must be even and at most head_dim = {self.head_dim}, got {rotated}"
            )
        factors = self.rope_frequency_factors
        if factors is not None and len(factors) != rotated // 2:
            width = "head_dim" if self.rotary_dim is None else "rotary_dim"
            raise ValueError(
                f"rope_frequency_factors must have {width} / 2 = {rotated // 2} "
                f"entries, got {len(factors)}"
            )
        scaling = self.rope_scaling
        if (
            scaling is not None
            and scaling.kind == "longrope"
            and len(scaling.short_factor) != (rotated // 2)
        ):
            raise ValueError(
                f"longrope's factors must have rotary_dim / 2 = {rotated // 2} entries, got "
                f"{len(scaling.short_factor)}"
            )

    @property
    def rotary_width(self) -> int:
        """The leading dimensions of each head that rotate: ``rotary_dim``, else all."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def sparse(self, index: int) -> bool:
        """Whether layer ``index``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and index not in self.dense_layers

    def window_of(self, index: int) -> int | None:
        """The sliding window of layer ``index``'s attention, or ``None`` for all positions."""
        return None if index in self.global_layers else self.sliding_window

    @property
    def departures(self) -> tuple[str, ...]:
        """What a layer computes beyond the Llama layer, one phrase each: the compiled stack
        (:mod:`~twostroke.engine.kernels.stack`) computes the Llama layer only, so a model
        with any runs its layers one by one (:func:`~twostroke.engine.models.choice.select_kernels`
        says so). The embedding and logit scales and the rotary tables are outside the
        layers, so they are not departures."""
        found = []
        if self.qk_norm == "full":  # (per head, Qwen3's, the stack computes)
            found.append("q/k norms over the whole projection")
        if self.norm_placement != "pre":
            both = self.norm_placement == "both"
            found.append(f"norms {'before and ' if both else ''}after attention and MLP")
        if self.norm_offset is not None:
            found.append("(offset + weight) norms in float32")
        if self.hidden_activation != "silu":
            found.append(f"a {self.hidden_activation} MLP")
        if self.local_rope_theta is not None:
            found.append("a rotary base of its own in its sliding-window layers")
        if self.nope_layers:
            found.append("layers without rotary embeddings")
        if self.attention_scale is not None:
            found.append("an attention scale of its own")
        if self.attn_logit_softcapping is not None:
            found.append("soft-capped attention scores")
        if self.residual_scale != 1.0:
            found.append("a residual scale")
        if self.rotary_width != self.head_dim:
            # The stack rotates whole heads, with the halves of the head as pairs; partial
            # rotary pairs the halves of the rotated part (Attention rotates it first).
            found.append("partial rotary embeddings")
        if self.num_experts:
            found.append("mixture-of-experts layers")
        return tuple(found)

    # --- plain values (the artifact cache) -------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The configuration as JSON-ready values; :meth:`from_dict` reads them back."""
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """The configuration :meth:`to_dict` wrote.

        Args:
            data: The values, as parsed from JSON (lists where tuples were).

        Returns:
            The configuration.

        Raises:
            TypeError, ValueError: a field is missing, unknown or invalid.
        """
        fields = dict(data)
        scaling = fields.pop("rope_scaling", None)
        factors = fields.pop("rope_frequency_factors", None)
        eos = fields.pop("eos_token_ids", ())
        nope = fields.pop("nope_layers", ())
        global_layers = fields.pop("global_layers", ())
        dense_layers = fields.pop("dense_layers", ())
        return cls(
            global_layers=tuple(global_layers),
            dense_layers=tuple(dense_layers),
            **fields,
            rope_scaling=None if scaling is None else RopeScaling(**scaling),
            rope_frequency_factors=None if factors is None else tuple(factors),
            eos_token_ids=tuple(eos),
            nope_layers=tuple(nope),
        )

    # --- Hugging Face config.json ---------------------------------------------------------

    @classmethod
    def from_hf_config(cls, data: Mapping[str, Any]) -> ModelConfig:
        """Read a parsed Hugging Face ``config.json``.

        Both the transformers 4 layout (``rope_theta`` and ``rope_scaling``) and the 5 layout
        (``rope_parameters``) are understood.

        Args:
            data: The parsed JSON object.

        Returns:
            The model's configuration.

        Raises:
            ValueError: an unsupported architecture, activation or rope type, or a missing
                or invalid field; the message names it.
        """
        architectures = data.get("architectures") or []
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            raise _unsupported("architecture", architectures, SUPPORTED_ARCHITECTURES)
        gemma = architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
        if architecture == "Gemma3ForCausalLM":
            data = {**GEMMA3_DEFAULTS, **data}
        if architecture == "Gemma2ForCausalLM":
            data = {**GEMMA2_DEFAULTS, **data}
        activation = data.get("hidden_act", "silu")
        # (Gemma reads hidden_activation instead: hf_features)
        if activation != "silu" and not gemma:
            raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {activation!r}")
        num_heads = count(data, "num_attention_heads")
        hidden_size = count(data, "hidden_size")
        head_dim = head_dim_of(data, "head_dim", hidden_size, num_heads, "hidden_size")
        rope = dict(data.get("rope_parameters") or {})
        rope = dict(rope.get("full_attention") or rope)  # Gemma 3's: one set per layer kind
        legacy_scaling = data.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", data.get("rope_theta", 10000.0))
        scaling = {**legacy_scaling, **rope} if legacy_scaling else rope
        max_positions = require(data, "max_position_embeddings")
        if architecture == "Phi3ForCausalLM":
            scaling = phi3_rope(scaling, data)
        # Gemma 3's layer kinds rotate differently, so its window stays however long.
        window, global_layers = sliding_window_of(
            data, max_positions, keep=architecture == "Gemma3ForCausalLM"
        )
        qwen2 = architecture == "Qwen2ForCausalLM"
        # transformers' Phi-3 has no biases, whatever its config.json says.
        biased = architecture != "Phi3ForCausalLM"
        attention_bias = biased and bool(data.get("attention_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=require(data, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=require(data, "intermediate_size"),
            num_layers=require(data, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=count(data, "num_key_value_heads", default=num_heads),
            head_dim=head_dim,
            rms_norm_eps=data.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=hf_rope_scaling(scaling, max_positions),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=biased and bool(data.get("mlp_bias", False)),
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=token_ids(data.get("eos_token_id")),
            sliding_window=window,
            global_layers=global_layers,
            **hf_features(architecture, data),
        )

    # --- GGUF metadata --------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(
        cls,
        metadata: Mapping[str, Any],
        tensor_names: Collection[str],
        *,
        rope_frequency_factors: tuple[float, ...] | None = None,
        rope_factors_short: tuple[float, ...] | None = None,
        rope_factors_long: tuple[float, ...] | None = None,
    ) -> ModelConfig:
        """Read the key/values of a GGUF file (llama.cpp's names).

        Args:
            metadata: Key to value (strings, numbers, lists), as the GGUF file stores them;
                the vocabulary size may be given as ``tokenizer.ggml.token_count`` instead
                of the whole ``tokenizer.ggml.tokens`` list.
            tensor_names: The names of the file's tensors: they say whether the output
                projection is tied and whether the attention has biases.
            rope_frequency_factors: The file's ``rope_freqs`` tensor, if it has one.
            rope_factors_short: Phi-3's ``rope_factors_short`` tensor (LongRoPE), if any.
            rope_factors_long: Phi-3's ``rope_factors_long`` tensor, if any.

        Returns:
            The model's configuration.

        Raises:
            ValueError: an unsupported architecture or rope scaling, a missing key, or a
                count (head counts, widths) that is not an int >= 1, or an embedding length
                the heads do not divide where no key length is given.
        """
        arch = metadata.get("general.architecture")
        architecture = _GGUF_ARCHITECTURES.get(str(arch))
        if architecture is None:
            raise _unsupported("GGUF architecture", arch, _GGUF_ARCHITECTURES)
        if (
            architecture == "LlamaForCausalLM"
            and "mistral" in str(metadata.get("general.name", "")).lower()
        ):
            architecture = "MistralForCausalLM"
        if architecture == "LlamaForCausalLM" and metadata.get("llama.expert_count"):
            architecture = "MixtralForCausalLM"  # llama.cpp's llama with expert tensors

        def key(name: str) -> Any:
            return require(metadata, f"{arch}.{name}")

        num_heads = count(metadata, f"{arch}.attention.head_count")
        hidden_size = count(metadata, f"{arch}.embedding_length")
        head_dim = head_dim_of(
            metadata, f"{arch}.attention.key_length", hidden_size, num_heads, "embedding_length"
        )
        vocab_size = metadata.get(f"{arch}.vocab_size")
        if vocab_size is None:
            tokens = metadata.get("tokenizer.ggml.tokens")
            vocab_size = metadata.get(
                "tokenizer.ggml.token_count", None if tokens is None else len(tokens)
            )
            if vocab_size is None:
                raise ValueError(f"GGUF metadata lacks {arch}.vocab_size and tokenizer.ggml.tokens")
        max_positions = key("context_length")
        scaling_type = metadata.get(f"{arch}.rope.scaling.type", "none")
        scaling: RopeScaling | None = None
        if scaling_type == "linear":
            scaling = RopeScaling(kind="linear", factor=key("rope.scaling.factor"))
        elif scaling_type == "yarn":
            factor = key("rope.scaling.factor")
            scaling = RopeScaling(
                kind="yarn",
                factor=factor,
                original_max_position_embeddings=key("rope.scaling.original_context_length"),
                beta_fast=metadata.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0),
                beta_slow=metadata.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0),
                attention_factor=yarn_mscale(factor),
            )
        elif scaling_type != "none":
            raise ValueError(
                f"unsupported rope scaling {scaling_type!r}; supported: 'none', 'linear', 'yarn'"
            )
        if rope_factors_short is not None or rope_factors_long is not None:
            # LongRoPE: llama.cpp's phi3 stores no scaling type, only its factors' tensors
            # and the keys Phi3MiniModel writes beside them.
            original = key("rope.scaling.original_context_length")
            scaling = RopeScaling(
                kind="longrope",
                factor=max_positions / original,
                original_max_position_embeddings=original,
                attention_factor=metadata.get(f"{arch}.rope.scaling.attn_factor", 1.0),
                short_factor=rope_factors_short or (),
                long_factor=rope_factors_long or (),
            )
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=key("feed_forward_length"),
            num_layers=key("block_count"),
            num_heads=num_heads,
            num_kv_heads=count(metadata, f"{arch}.attention.head_count_kv", default=num_heads),
            head_dim=head_dim,
            rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
            rope_theta=metadata.get(f"{arch}.rope.freq_base", 10000.0),
            rope_scaling=scaling,
            rope_frequency_factors=rope_frequency_factors,
            max_position_embeddings=max_positions,
            tie_word_embeddings="output.weight" not in tensor_names,
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            o_bias="blk.0.attn_output.bias" in tensor_names,
            mlp_bias="blk.0.ffn_up.bias" in tensor_names,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=token_ids(eos),
            **gguf_features(str(arch), metadata, key("block_count")),
        )
