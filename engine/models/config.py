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

import math
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import attrs

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
    "Gemma3ForCausalLM",
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
    "gemma3": "Gemma3ForCausalLM",
}

#: Every ``no_rope_layer_interval``-th layer of SmolLM3 has no rotary embeddings: llama.cpp's
#: ``smollm3`` stores no key for it and hard-codes 4 (``n_no_rope_layer_step``), the default
#: of transformers' ``SmolLM3Config``.
_SMOLLM3_NOPE_INTERVAL = 4

#: Architectures people bring that the decoder does not run yet, by the feature it lacks
#: (HF ``architectures`` names and GGUF ``general.architecture`` values alike), so the
#: refusal says what is missing rather than only what is supported.
MISSING_FEATURES = {
    "Qwen3MoeForCausalLM": "mixture-of-experts layers",
    "qwen3moe": "mixture-of-experts layers",
    "MixtralForCausalLM": "mixture-of-experts layers",
    "OlmoeForCausalLM": "mixture-of-experts layers",
    "olmoe": "mixture-of-experts layers",
    "GptOssForCausalLM": "mixture-of-experts layers with MXFP4 experts and attention sinks",
    "gpt-oss": "mixture-of-experts layers with MXFP4 experts and attention sinks",
    "Gemma3ForConditionalGeneration": "image inputs (its text model runs as Gemma3ForCausalLM)",
    "Gemma2ForCausalLM": "attention-score soft-capping (attn_logit_softcapping)",
    "gemma2": "attention-score soft-capping (attn_logit_softcapping)",
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


def _floats(values: Iterable[float]) -> tuple[float, ...]:
    """A list of numbers (parsed JSON, a GGUF tensor's) as the frozen tuple a value holds."""
    return tuple(float(value) for value in values)


@attrs.frozen(kw_only=True)
class RopeScaling:
    """How rotary frequencies are stretched for long contexts.

    ``"linear"`` divides every frequency by ``factor``; ``"llama3"`` divides only the low
    frequencies and interpolates in between (Llama 3.1's rule, as transformers computes it);
    ``"yarn"`` (Qwen2 and Qwen3's long context) blends divided and undivided frequencies
    over a ramp between ``beta_fast`` and ``beta_slow`` rotations and multiplies the rotary
    tables by ``attention_factor`` (transformers' ``_compute_yarn_parameters``);
    ``"longrope"`` (Phi-3's LongRoPE) divides each frequency by its own factor, from
    ``short_factor`` at positions inside ``original_max_position_embeddings`` and from
    ``long_factor`` beyond, and multiplies the tables by ``attention_factor``
    (transformers' ``_compute_longrope_parameters``; which set a position takes:
    :func:`~twostroke.engine.models.layers.rotary_tables`).

    Attributes:
        kind: ``"linear"``, ``"llama3"``, ``"yarn"`` or ``"longrope"``.
        factor: The stretch factor.
        low_freq_factor: llama3 only.
        high_freq_factor: llama3 only.
        original_max_position_embeddings: llama3, yarn and longrope: the context the model
            was trained on (longrope: the positions below it take the short factors).
        beta_fast: yarn only: the ramp's end, in rotations.
        beta_slow: yarn only: the ramp's start, in rotations.
        attention_factor: yarn and longrope: what ``cos`` and ``sin`` are multiplied by.
        truncate: yarn only: the ramp's bounds rounded outwards to whole dimensions.
        short_factor: longrope only: each rotated pair's divisor inside the original context.
        long_factor: longrope only: each rotated pair's divisor beyond it.
    """

    kind: str = attrs.field(
        validator=attrs.validators.in_(("linear", "llama3", "yarn", "longrope"))
    )
    factor: float = attrs.field(validator=_POSITIVE_NUMBER)
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = attrs.field(default=1.0, validator=_POSITIVE_NUMBER)
    truncate: bool = True
    short_factor: tuple[float, ...] = attrs.field(default=(), converter=_floats)
    long_factor: tuple[float, ...] = attrs.field(default=(), converter=_floats)

    def __attrs_post_init__(self) -> None:
        if self.kind == "longrope" and (
            not self.short_factor or len(self.short_factor) != len(self.long_factor)
        ):
            raise ValueError(
                f"longrope needs short_factor and long_factor of one length (one per rotated "
                f"pair), got {len(self.short_factor)} and {len(self.long_factor)}"
            )


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

    def __attrs_post_init__(self) -> None:
        for name in ("nope_layers", "global_layers"):
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
        if self.qk_norm != "none":
            found.append(f"q/k norms over the {self.qk_norm}")
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
        if self.residual_scale != 1.0:
            found.append("a residual scale")
        if self.rotary_width != self.head_dim:
            # The stack rotates whole heads, with the halves of the head as pairs; partial
            # rotary pairs the halves of the rotated part (Attention rotates it first).
            found.append("partial rotary embeddings")
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
        return cls(
            global_layers=tuple(global_layers),
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
        if architecture == "Gemma3ForCausalLM":
            data = {**_GEMMA3_DEFAULTS, **data}
        activation = data.get("hidden_act", "silu")
        # (Gemma 3 reads hidden_activation instead: _hf_features)
        if activation != "silu" and architecture != "Gemma3ForCausalLM":
            raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {activation!r}")
        num_heads = _count(data, "num_attention_heads")
        hidden_size = _count(data, "hidden_size")
        head_dim = _head_dim(data, "head_dim", hidden_size, num_heads, "hidden_size")
        rope = dict(data.get("rope_parameters") or {})
        rope = dict(rope.get("full_attention") or rope)  # Gemma 3's: one set per layer kind
        legacy_scaling = data.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", data.get("rope_theta", 10000.0))
        scaling = {**legacy_scaling, **rope} if legacy_scaling else rope
        max_positions = _require(data, "max_position_embeddings")
        if architecture == "Phi3ForCausalLM":
            scaling = _phi3_rope(scaling, data)
        # Gemma 3's layer kinds rotate differently, so its window stays however long.
        window, global_layers = _sliding_window(
            data, max_positions, keep=architecture == "Gemma3ForCausalLM"
        )
        qwen2 = architecture == "Qwen2ForCausalLM"
        # transformers' Phi-3 has no biases, whatever its config.json says.
        biased = architecture != "Phi3ForCausalLM"
        attention_bias = biased and bool(data.get("attention_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=_require(data, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_require(data, "intermediate_size"),
            num_layers=_require(data, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=_count(data, "num_key_value_heads", default=num_heads),
            head_dim=head_dim,
            rms_norm_eps=data.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=_rope_scaling(scaling, max_positions),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=biased and bool(data.get("mlp_bias", False)),
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=_token_ids(data.get("eos_token_id")),
            sliding_window=window,
            global_layers=global_layers,
            **_hf_features(architecture, data),
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

        def key(name: str) -> Any:
            return _require(metadata, f"{arch}.{name}")

        num_heads = _count(metadata, f"{arch}.attention.head_count")
        hidden_size = _count(metadata, f"{arch}.embedding_length")
        head_dim = _head_dim(
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
                attention_factor=_yarn_mscale(factor),
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
            num_kv_heads=_count(metadata, f"{arch}.attention.head_count_kv", default=num_heads),
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
            eos_token_ids=_token_ids(eos),
            **_gguf_features(str(arch), metadata, key("block_count")),
        )


def _sliding_window(
    data: Mapping[str, Any], max_positions: int, *, keep: bool = False
) -> tuple[int | None, tuple[int, ...]]:
    """A config's sliding window and the layers that see every position anyway, as
    transformers reads them: ``layer_types`` where the config lists it, else every
    ``sliding_window_pattern``-th layer global (Gemma's older configs), else every layer
    windowed (Mistral) or, for Qwen2, those from ``max_window_layers`` on; Qwen2 asks for
    a window only with ``use_sliding_window``. A window as long as the context is none,
    unless ``keep``."""
    window = data.get("sliding_window")
    if window is None or not data.get("use_sliding_window", True):
        return None, ()
    window = _count(data, "sliding_window")
    if window >= max_positions and not keep:
        return None, ()
    num_layers = _count(data, "num_hidden_layers")
    types = data.get("layer_types")
    if types is None and data.get("sliding_window_pattern") is not None:
        pattern = _count(data, "sliding_window_pattern")
        types = [
            "full_attention" if (index + 1) % pattern == 0 else "sliding_attention"
            for index in range(num_layers)
        ]
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ValueError(
                f"layer_types must list one type per layer ({num_layers}), got {types!r}"
            )
        unknown = sorted({t for t in types if t not in ("sliding_attention", "full_attention")})
        if unknown:
            raise ValueError(
                f"layer_types must be 'sliding_attention' or 'full_attention', got {unknown}"
            )
        return window, tuple(i for i, kind in enumerate(types) if kind == "full_attention")
    first = data.get("max_window_layers", 0) if "use_sliding_window" in data else 0
    return window, tuple(range(min(int(first), num_layers)))


def _require(data: Mapping[str, Any], name: str) -> Any:
    if data.get(name) is None:
        raise ValueError(f"the configuration lacks {name!r}")
    return data[name]


def _count(data: Mapping[str, Any], name: str, *, default: int | None = None) -> int:
    """A count the configuration is divided by or allocated from: an int >= 1 (``default``
    where the key is absent or null), checked before it is used."""
    value = data.get(name)
    if value is None and default is not None:
        return default
    if value is None:
        raise ValueError(f"the configuration lacks {name!r}")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _head_dim(
    data: Mapping[str, Any], name: str, hidden_size: int, num_heads: int, hidden_name: str
) -> int:
    """The width of a head: ``name`` where the configuration gives it, else the residual
    stream's width shared among the heads, which must then divide it."""
    if data.get(name) is not None:
        return _count(data, name)
    if hidden_size % num_heads:
        raise ValueError(
            f"{hidden_name} must be a multiple of the head count without {name!r}, got "
            f"{hidden_size} and {num_heads} heads"
        )
    return hidden_size // num_heads


def _token_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list | tuple):
        return tuple(int(item) for item in value)
    raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}")


def _rope_scaling(scaling: Mapping[str, Any], max_positions: int) -> RopeScaling | None:
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=_require(scaling, "factor"))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=_require(scaling, "factor"),
            low_freq_factor=_require(scaling, "low_freq_factor"),
            high_freq_factor=_require(scaling, "high_freq_factor"),
            original_max_position_embeddings=scaling.get(
                "original_max_position_embeddings", max_positions
            ),
        )
    if kind == "yarn":
        factor = scaling.get("factor")
        original = scaling.get("original_max_position_embeddings", max_positions)
        if factor is None:
            factor = max_positions / original
        attention_factor = scaling.get("attention_factor")
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if attention_factor is None and mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        elif attention_factor is None:
            attention_factor = _yarn_mscale(factor)
        return RopeScaling(
            kind="yarn",
            factor=factor,
            original_max_position_embeddings=original,
            # transformers reads these with ``or``: a null or zero takes the default too.
            beta_fast=scaling.get("beta_fast") or 32.0,
            beta_slow=scaling.get("beta_slow") or 1.0,
            attention_factor=attention_factor,
            truncate=bool(scaling.get("truncate", True)),
        )
    if kind == "longrope":
        original = _require(scaling, "original_max_position_embeddings")
        factor = scaling.get("factor")
        if factor is None:
            factor = max_positions / original
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:  # LongRoPE's paper, as transformers computes it
            attention_factor = (
                math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
            )
        return RopeScaling(
            kind="longrope",
            factor=factor,
            original_max_position_embeddings=original,
            attention_factor=attention_factor,
            short_factor=_require(scaling, "short_factor"),
            long_factor=_require(scaling, "long_factor"),
        )
    raise ValueError(
        f"unsupported rope_type {kind!r}; supported: 'default', 'linear', 'llama3', 'yarn', "
        "'longrope'"
    )


def _phi3_rope(scaling: Mapping[str, Any], data: Mapping[str, Any]) -> dict[str, Any]:
    """Phi-3's rope parameters as ``Phi3Config`` standardizes them: ``"su"`` and ``"yarn"``
    are its old names of ``"longrope"``, and the top level's
    ``original_max_position_embeddings`` (4096 where absent) wins over the dict's."""
    found = dict(scaling)
    kind = found.get("rope_type", found.get("type", "default"))
    if kind in ("su", "yarn", "longrope"):
        found["rope_type"] = "longrope"
        found["original_max_position_embeddings"] = data.get(
            "original_max_position_embeddings", 4096
        )
    return found


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor (its paper's eq. 21, transformers' ``yarn_get_mscale``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _hf_features(architecture: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of :class:`ModelConfig` in which ``architecture`` departs from Llama, read
    from its ``config.json`` as its transformers class reads them."""
    if architecture == "Gemma3ForCausalLM":
        return _gemma3_features(data)
    if architecture == "Qwen3ForCausalLM":
        return {"qk_norm": "head"}
    if architecture == "Olmo2ForCausalLM":
        return {"qk_norm": "full", "norm_placement": "post"}
    if architecture == "SmolLM3ForCausalLM":
        layers = _require(data, "num_hidden_layers")
        rotates = data.get("no_rope_layers")
        if rotates is None:  # SmolLM3Config's default: every interval-th layer is NoPE
            interval = _count(data, "no_rope_layer_interval", default=_SMOLLM3_NOPE_INTERVAL)
            rotates = [int((index + 1) % interval != 0) for index in range(layers)]
        if len(rotates) != layers or any(flag not in (0, 1) for flag in rotates):
            raise ValueError(
                f"no_rope_layers must be {layers} flags of 0 or 1 (1: the layer rotates), "
                f"got {rotates!r}"
            )
        return {"nope_layers": tuple(i for i, flag in enumerate(rotates) if not flag)}
    if architecture == "Phi3ForCausalLM":
        rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
        share = rope.get("partial_rotary_factor", data.get("partial_rotary_factor", 1.0))
        head_dim = _head_dim(
            data,
            "head_dim",
            _count(data, "hidden_size"),
            _count(data, "num_attention_heads"),
            "hidden_size",
        )
        rotary_dim = int(head_dim * share)  # transformers' int(), as Phi3RotaryEmbedding
        return {"rotary_dim": None if rotary_dim == head_dim else rotary_dim}
    if architecture == "GraniteForCausalLM":
        # GraniteConfig's defaults; its attention always scales by attention_multiplier.
        return {
            "embedding_scale": data.get("embedding_multiplier", 1.0),
            "attention_scale": data.get("attention_multiplier", 1.0),
            "residual_scale": data.get("residual_multiplier", 1.0),
            "logit_scale": data.get("logits_scaling", 1.0),
        }
    return {}


def _gguf_features(arch: str, metadata: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """The fields of :class:`ModelConfig` in which a GGUF architecture departs from Llama,
    as llama.cpp reads them (``llm_load_hparams``)."""
    if arch == "gemma3":
        return _gemma3_gguf_features(metadata, num_layers)
    if arch == "qwen3":
        return {"qk_norm": "head"}
    if arch == "olmo2":
        return {"qk_norm": "full", "norm_placement": "post"}
    if arch == "smollm3":
        step = _SMOLLM3_NOPE_INTERVAL
        return {"nope_layers": tuple(i for i in range(num_layers) if (i + 1) % step == 0)}
    if arch == "phi3":
        hidden, heads = (
            _count(metadata, f"phi3.{n}") for n in ("embedding_length", "attention.head_count")
        )
        head_dim = _head_dim(
            metadata, "phi3.attention.key_length", hidden, heads, "embedding_length"
        )
        rotary_dim = _count(metadata, "phi3.rope.dimension_count", default=head_dim)
        # Phi3MiniModel writes 0 for no window; one as long as the context is none.
        window = metadata.get("phi3.attention.sliding_window") or None
        if window is not None and window >= _require(metadata, "phi3.context_length"):
            window = None
        return {
            "rotary_dim": None if rotary_dim == head_dim else rotary_dim,
            "sliding_window": window,
        }
    if arch == "granite":
        return {
            "embedding_scale": _require(metadata, "granite.embedding_scale"),
            "attention_scale": _require(metadata, "granite.attention.scale"),
            "residual_scale": _require(metadata, "granite.residual_scale"),
            "logit_scale": _require(metadata, "granite.logit_scale"),
        }
    return {}


#: transformers' ``Gemma3TextConfig`` defaults for the keys a Gemma 3 ``config.json`` may
#: leave out (the Hub's older files spell the layer kinds as ``sliding_window_pattern``).
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
}

#: llama.cpp's ``gemma3`` stores no layer kinds: every sixth layer is global
#: (``set_swa_pattern(6)``), and the others rotate by a base of 10000 unless the file says.
_GEMMA3_GGUF_PATTERN = 6
_GEMMA3_GGUF_LOCAL_BASE = 10_000.0


def _gemma3_features(data: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3's departures as transformers' ``Gemma3TextModel`` computes them: each layer
    kind's rotary base (``rope_parameters["sliding_attention"]``, or the older
    ``rope_local_base_freq``), ``(1 + weight)`` norms before and after each block,
    gelu-tanh, embeddings times ``sqrt(hidden_size)``, scores times
    ``query_pre_attn_scalar ** -0.5``. ``data`` has :data:`_GEMMA3_DEFAULTS` filled in."""
    activation = data.get("hidden_activation")
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation must be 'gelu_pytorch_tanh', got {activation!r}")
    if data.get("attn_logit_softcapping") is not None:
        raise ValueError(
            "attn_logit_softcapping must be null: twostroke's attention does not cap "
            f"scores, got {data['attn_logit_softcapping']!r}"
        )
    if data.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention must be false: twostroke decodes causally")
    _count(data, "sliding_window")  # the local layers' rotary base needs a window to name them
    rope = data.get("rope_parameters")
    local = rope.get("sliding_attention") if isinstance(rope, Mapping) else None
    theta = data["rope_local_base_freq"]
    if isinstance(local, Mapping):
        kind = local.get("rope_type", "default")
        if kind != "default":
            raise ValueError(
                "rope_parameters['sliding_attention'] must rotate unscaled (rope_type "
                f"'default'), got {kind!r}"
            )
        theta = local.get("rope_theta", theta)
    return {
        "qk_norm": "head",
        "norm_placement": "both",
        "norm_offset": 1.0,
        "hidden_activation": "gelu_tanh",
        "embedding_scale": _count(data, "hidden_size") ** 0.5,
        "attention_scale": _require(data, "query_pre_attn_scalar") ** -0.5,
        "local_rope_theta": theta,
        "final_logit_softcapping": data.get("final_logit_softcapping"),
    }


def _gemma3_gguf_features(metadata: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Gemma 3 as llama.cpp's ``gemma3`` reads it: the layer kinds and the local base are
    its constants (:data:`_GEMMA3_GGUF_PATTERN`), the norms' ``+ 1`` is in the stored
    weights, and ``query_pre_attn_scalar``, which the converter does not store, is the
    head width except for the 62-layer 27B (``hidden_size / heads``, as its config says)."""
    hidden = _count(metadata, "gemma3.embedding_length")
    heads = _count(metadata, "gemma3.attention.head_count")
    head_dim = _count(metadata, "gemma3.attention.key_length", default=hidden // heads)
    scalar = hidden // heads if num_layers == 62 else head_dim
    features: dict[str, Any] = {
        "qk_norm": "head",
        "norm_placement": "both",
        "norm_offset": 0.0,
        "hidden_activation": "gelu_tanh",
        "embedding_scale": hidden**0.5,
        "attention_scale": scalar**-0.5,
        "final_logit_softcapping": metadata.get("gemma3.final_logit_softcapping") or None,
    }
    window = metadata.get("gemma3.attention.sliding_window") or 0
    if window:  # newer llama.cpp runs a file without one with every layer global
        pattern = _GEMMA3_GGUF_PATTERN
        features["sliding_window"] = _count(metadata, "gemma3.attention.sliding_window")
        features["global_layers"] = tuple(
            i for i in range(num_layers) if i % pattern == pattern - 1
        )
        features["local_rope_theta"] = metadata.get(
            "gemma3.rope.freq_base_swa", _GEMMA3_GGUF_LOCAL_BASE
        )
    return features
