"""The shapes ``twostroke synthesize`` makes: real architectures at their real configuration.

Each :class:`Shape` holds the fields of the model's own ``config.json`` as its publisher
ships it (the source is named beside each), but for the vocabulary: every shape has
SmolLM2's 49152 tokens and its tokenizer, so that every tool that drives twostroke can drive
a synthetic model. The tiny shapes (``test-*``) are the same families at a few layers and
small widths, for tests; their widths are multiples of 256 so that llama.cpp's k-quants
apply to them as they do to the real ones.

``NAME@N`` is a shape's first ``N`` layers (:meth:`Shape.with_layers`): every layer as the
real model's, fewer of them, for a model whose whole depth does not fit the disk (Qwen3-30B-A3B
is 61 GB in F16; ``qwen3-30b-a3b@12`` a quarter of its layers).
"""

from __future__ import annotations

import re
import types
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from twostroke.states.errors import EngineError

__all__ = [
    "MOE_FAMILIES",
    "SHAPES",
    "SMOLLM2_VOCAB_SIZE",
    "TEST_SHAPES",
    "Family",
    "Shape",
    "UnknownShape",
    "shape_named",
]

#: SmolLM2's vocabulary, every shape's (its tokenizer is theirs).
SMOLLM2_VOCAB_SIZE = 49152

Family = Literal["llama", "qwen3", "gemma3", "phi3", "qwen3moe", "olmoe"]
#: The families whose MLP is a mixture of experts (in every layer, as their real models').
MOE_FAMILIES: tuple[Family, ...] = ("qwen3moe", "olmoe")


class UnknownShape(EngineError, ValueError):
    """A shape name that is not in :data:`SHAPES` (nor among the tiny test shapes), or a
    ``NAME@N`` whose ``N`` is not a count of that shape's layers.

    Attributes:
        name: The name given.
    """

    def __init__(self, name: str, problem: str | None = None) -> None:
        self.name = name
        super().__init__(
            problem
            or f"a synthetic model's shape must be one of {', '.join(SHAPES)} (or a tiny "
            f"{', '.join(TEST_SHAPES)}); got {name!r}"
        )


def _frozen(config: Mapping[str, Any]) -> Mapping[str, Any]:
    return types.MappingProxyType(dict(config))


@attrs.frozen
class Shape:
    """One architecture at one configuration.

    Attributes:
        name: What ``twostroke synthesize`` calls it (``"qwen3-0.6b"``).
        family: Which tensor layout it has (``"llama"``, ``"qwen3"``, ``"gemma3"``,
            ``"phi3"``, ``"qwen3moe"``, ``"olmoe"``): transformers' modelling file and
            llama.cpp's architecture.
        source: Where its configuration comes from.
        config: Its ``config.json`` fields, ``vocab_size`` and the token ids aside (see
            :meth:`hf_config`).
    """

    name: str
    family: Family
    source: str
    config: Mapping[str, Any] = attrs.field(converter=_frozen, eq=False, hash=False, repr=False)

    @property
    def hidden_size(self) -> int:
        """The residual stream's width."""
        return int(self.config["hidden_size"])

    @property
    def intermediate_size(self) -> int:
        """The MLP's inner width."""
        return int(self.config["intermediate_size"])

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return int(self.config["num_hidden_layers"])

    @property
    def num_heads(self) -> int:
        """Query heads."""
        return int(self.config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        """Key and value heads."""
        return int(self.config["num_key_value_heads"])

    @property
    def head_dim(self) -> int:
        """Each head's width: ``head_dim`` where the configuration gives it (Qwen3's and
        Gemma 3's are not ``hidden_size / heads``), else their quotient."""
        given = self.config.get("head_dim")
        return int(given) if given is not None else self.hidden_size // self.num_heads

    @property
    def num_experts(self) -> int:
        """The experts of each layer's mixture (0: a dense MLP)."""
        return int(self.config.get("num_experts", 0)) if self.family in MOE_FAMILIES else 0

    @property
    def experts_per_token(self) -> int:
        """The experts each token's router picks (0: a dense MLP)."""
        return int(self.config["num_experts_per_tok"]) if self.num_experts else 0

    @property
    def expert_intermediate_size(self) -> int:
        """One expert's inner width: Qwen3-MoE's ``moe_intermediate_size`` (its
        ``intermediate_size`` is a dense MLP's, which no layer of the released models has),
        OLMoE's ``intermediate_size``; 0 for a dense MLP."""
        if self.family == "qwen3moe":
            return int(self.config["moe_intermediate_size"])
        return self.intermediate_size if self.num_experts else 0

    @property
    def tied(self) -> bool:
        """Whether the output projection is the embedding (no ``lm_head`` tensor)."""
        return bool(self.config.get("tie_word_embeddings", False))

    def hf_config(self, *, bos_token_id: int, eos_token_id: int, dtype: str) -> dict[str, Any]:
        """The ``config.json`` of this shape's model: its fields, SmolLM2's vocabulary size
        and token ids, and the weights' dtype.

        Args:
            bos_token_id: The tokenizer's BOS id.
            eos_token_id: The tokenizer's EOS id.
            dtype: The weights' dtype (``"bfloat16"``).

        Returns:
            A new dict, ready for ``json.dump``.
        """
        return {
            **self.config,
            "vocab_size": SMOLLM2_VOCAB_SIZE,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "pad_token_id": None,
            "torch_dtype": dtype,
        }

    def with_layers(self, layers: int) -> Shape:
        """The first ``layers`` layers of this shape, each as the real model's: named
        ``NAME@N`` and with ``num_hidden_layers`` (and Gemma 3's ``layer_types``) cut to
        them, every width as it is.

        Args:
            layers: How many, in ``[1, num_layers]``.

        Returns:
            A new shape (for all of them too: then its name alone differs).

        Raises:
            UnknownShape: ``layers`` is not in ``[1, num_layers]``.
        """
        name = f"{self.name}@{layers}"
        if not 1 <= layers <= self.num_layers:
            raise UnknownShape(
                name,
                f"a shape's layers NAME@N must be in [1, {self.num_layers}] for {self.name}, "
                f"got {layers} in {name!r}",
            )
        config = {**self.config, "num_hidden_layers": layers}
        if "layer_types" in config:
            config["layer_types"] = list(config["layer_types"][:layers])
        return Shape(name, self.family, f"{self.source}, its first {layers} layers", config)


def _qwen3(name: str, source: str, **fields: Any) -> Shape:
    # Qwen/Qwen3-0.6B/config.json (Hugging Face Hub, April 2025); Qwen3-1.7B's and -4B's
    # differ in their widths and depths alone.
    return Shape(
        name,
        "qwen3",
        source,
        {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 1024,
            "initializer_range": 0.02,
            "intermediate_size": 3072,
            "max_position_embeddings": 40960,
            "max_window_layers": 28,
            "num_attention_heads": 16,
            "num_hidden_layers": 28,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": None,
            "tie_word_embeddings": True,
            "use_cache": True,
            "use_sliding_window": False,
            **fields,
        },
    )


def _llama(name: str, source: str, **widths: Any) -> Shape:
    # meta-llama/Llama-3.2-1B-Instruct/config.json (Hugging Face Hub, September 2024).
    return Shape(
        name,
        "llama",
        source,
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "head_dim": 64,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 8192,
            "max_position_embeddings": 131072,
            "mlp_bias": False,
            "num_attention_heads": 32,
            "num_hidden_layers": 16,
            "num_key_value_heads": 8,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "factor": 32.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
            "use_cache": True,
            **widths,
        },
    )


def _gemma3(name: str, source: str, **widths: Any) -> Shape:
    # google/gemma-3-1b-it/config.json (Hugging Face Hub, March 2025); layer_types spells
    # out its sliding_window_pattern of 6 (five local layers, then a global one) as
    # transformers' Gemma3TextConfig derives it.
    config: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "initializer_range": 0.02,
        "intermediate_size": 6912,
        "max_position_embeddings": 32768,
        "num_attention_heads": 4,
        "num_hidden_layers": 26,
        "num_key_value_heads": 1,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "tie_word_embeddings": True,
        "use_cache": True,
        **widths,
    }
    config["layer_types"] = [
        "full_attention" if (layer + 1) % 6 == 0 else "sliding_attention"
        for layer in range(config["num_hidden_layers"])
    ]
    return Shape(name, "gemma3", source, config)


#: microsoft/Phi-4-mini-instruct's rope_scaling.long_factor (its config.json, February 2025;
#: Phi-4-multimodal-instruct's text model has the same): one per rotated pair, 96 / 2.
_PHI4_MINI_LONG_FACTOR = (
    1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817,
    2.187582649, 2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687,
    4.279200023, 4.785517845, 5.351743533, 5.984965424, 6.693110555, 7.485043894,
    8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
    16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03,
    32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28,
    33.49, 33.5, 44.16, 47.77,
)  # fmt: skip


def _phi3(name: str, source: str, long_factor: tuple[float, ...], **widths: Any) -> Shape:
    # microsoft/Phi-4-mini-instruct/config.json (Hugging Face Hub, February 2025).
    return Shape(
        name,
        "phi3",
        source,
        {
            "architectures": ["Phi3ForCausalLM"],
            "model_type": "phi3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "embd_pdrop": 0.0,
            "hidden_act": "silu",
            "hidden_size": 3072,
            "initializer_range": 0.02,
            "intermediate_size": 8192,
            "lm_head_bias": False,
            "max_position_embeddings": 131072,
            "mlp_bias": False,
            "num_attention_heads": 24,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "original_max_position_embeddings": 4096,
            "partial_rotary_factor": 0.75,
            "resid_pdrop": 0.0,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "long_factor": list(long_factor),
                "short_factor": [1.0] * len(long_factor),
                "type": "longrope",
            },
            "rope_theta": 10000.0,
            "sliding_window": 262144,
            "tie_word_embeddings": True,
            "use_cache": True,
            **widths,
        },
    )


def _qwen3moe(name: str, source: str, **fields: Any) -> Shape:
    # Qwen/Qwen3-30B-A3B/config.json (Hugging Face Hub, April 2025): every layer a mixture
    # (decoder_sparse_step 1, no mlp_only_layers); intermediate_size is the dense MLP's that
    # no layer has, moe_intermediate_size an expert's.
    return Shape(
        name,
        "qwen3moe",
        source,
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "decoder_sparse_step": 1,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 6144,
            "max_position_embeddings": 40960,
            "max_window_layers": 48,
            "mlp_only_layers": [],
            "moe_intermediate_size": 768,
            "norm_topk_prob": True,
            "num_attention_heads": 32,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 48,
            "num_key_value_heads": 4,
            "output_router_logits": False,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.001,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "use_cache": True,
            "use_sliding_window": False,
            **fields,
        },
    )


def _olmoe(name: str, source: str, **fields: Any) -> Shape:
    # allenai/OLMoE-1B-7B-0924/config.json (Hugging Face Hub, September 2024): q/k norms over
    # the whole projection, intermediate_size an expert's, the top 8's probabilities not
    # divided by their sum (norm_topk_prob false).
    return Shape(
        name,
        "olmoe",
        source,
        {
            "architectures": ["OlmoeForCausalLM"],
            "model_type": "olmoe",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "clip_qkv": None,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 1024,
            "max_position_embeddings": 4096,
            "norm_topk_prob": False,
            "num_attention_heads": 16,
            "num_experts": 64,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 16,
            "num_key_value_heads": 16,
            "output_router_logits": False,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "rope_theta": 10000.0,
            "router_aux_loss_coef": 0.01,
            "tie_word_embeddings": False,
            "use_cache": True,
            **fields,
        },
    )


#: The real shapes, by name.
SHAPES: Mapping[str, Shape] = types.MappingProxyType(
    {
        shape.name: shape
        for shape in (
            _qwen3("qwen3-0.6b", "Qwen/Qwen3-0.6B/config.json"),
            _qwen3(
                "qwen3-1.7b",
                "Qwen/Qwen3-1.7B/config.json",
                hidden_size=2048,
                intermediate_size=6144,
            ),
            _qwen3(
                "qwen3-4b",
                "Qwen/Qwen3-4B/config.json",
                hidden_size=2560,
                intermediate_size=9728,
                num_hidden_layers=36,
                max_window_layers=36,
                num_attention_heads=32,
            ),
            _llama("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct/config.json"),
            _gemma3("gemma-3-1b", "google/gemma-3-1b-it/config.json"),
            _phi3(
                "phi-4-mini", "microsoft/Phi-4-mini-instruct/config.json", _PHI4_MINI_LONG_FACTOR
            ),
            _olmoe("olmoe-1b-7b", "allenai/OLMoE-1B-7B-0924/config.json"),
            _qwen3moe("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B/config.json"),
        )
    }
)

_TINY: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
_TINY_SOURCE = "the family's real configuration at 2 layers and a width of 256"

#: Tiny shapes of each family, for tests (a few MB each).
TEST_SHAPES: Mapping[str, Shape] = types.MappingProxyType(
    {
        shape.name: shape
        for shape in (
            _qwen3("test-qwen3", _TINY_SOURCE, **_TINY, head_dim=64, max_window_layers=2),
            _llama("test-llama", _TINY_SOURCE, **_TINY),
            # query_pre_attn_scalar follows head_dim, as in every Gemma 3 but the 27B: a
            # GGUF file cannot carry it, and llama.cpp takes head_dim (its hidden / heads
            # for the 27B), so the two formats are one model.
            _gemma3(
                "test-gemma3",
                _TINY_SOURCE,
                **_TINY,
                head_dim=64,
                query_pre_attn_scalar=64,
                sliding_window=8,
            ),
            # head_dim 64, a quarter not rotated: 48 rotated dimensions, 24 factors.
            _phi3("test-phi3", _TINY_SOURCE, _PHI4_MINI_LONG_FACTOR[::2], **_TINY),
            # 8 experts, 2 a token: few enough to be small, enough that routing differs.
            _qwen3moe(
                "test-qwen3moe",
                _TINY_SOURCE,
                **_TINY,
                head_dim=64,
                max_window_layers=2,
                moe_intermediate_size=256,
                num_experts=8,
                num_experts_per_tok=2,
            ),
            # As many key/value heads as query heads, as the real OLMoE.
            _olmoe(
                "test-olmoe",
                _TINY_SOURCE,
                **{**_TINY, "intermediate_size": 256, "num_key_value_heads": 4},
                num_experts=8,
                num_experts_per_tok=2,
            ),
        )
    }
)


#: ``NAME@N``: a shape's first N layers.
_LAYERS = re.compile(r"(?P<name>.+)@(?P<layers>[0-9]+)")


def shape_named(name: str) -> Shape:
    """The shape called ``name``, or its first ``N`` layers for ``NAME@N``
    (:meth:`Shape.with_layers`).

    Args:
        name: A key of :data:`SHAPES` or of :data:`TEST_SHAPES`, alone or with ``@N``.

    Raises:
        UnknownShape: it is neither, or ``N`` is not in ``[1, layers of the shape]``.
    """
    subset = _LAYERS.fullmatch(name)
    base = subset["name"] if subset else name
    found = SHAPES.get(base) or TEST_SHAPES.get(base)
    if found is None:
        raise UnknownShape(name)
    return found.with_layers(int(subset["layers"])) if subset else found
