"""What one step of a model must move through memory and compute: the roofline's two costs.

A decoder step reads every weight once whatever the batch (each projection's matrix is
streamed through the cores once per step), reads the KV history of every row, writes the
step's new keys and values, and does two FLOPs per multiply-add. The step can be no faster
than the slower of its two costs at the machine's rates (the roofline): bytes / bandwidth
or FLOPs / FLOPS. This module counts the two costs from the model's shape; the rates and the
floor are :mod:`~twostroke.engine.bench.roof`'s.

What is counted, per step of rows ``(start, num_tokens, sample)``:

* **bytes** = the weights streamed once (every decoder layer's projections, biases and norms,
  the final norm and the output projection; the embedding only for the rows it looks up,
  ``num_tokens * hidden`` elements), in their dtype or reduced precision, or as a GGUF file
  stores them where the model computes its blocks as stored + each row's KV history,
  ``start`` positions of keys and values in every layer, read once + the ``num_tokens``
  positions of keys and values the step writes + the activations, at the activations' dtype,
  per token and layer: the layer's input row read once by the attention's projections and
  once by the MLP's (q, k and v share one read, as gate and up do), the q, k and v rows
  written, o's input row read and output row written, the gate and up rows written, down's
  input row read and output row written (``4 * hidden + 2 * q_width + 2 * kv_width +
  3 * intermediate`` elements), and per sampled row the final hidden row read and its logits
  written (``hidden + vocab``); small beside the weights at a decode step, but a step's bytes;
* **FLOPs** = ``2 * layer_params`` per token (the projections) + the attention products,
  ``4 * num_heads * head_dim * num_layers`` per key a query attends to (QKᵀ and PV; a token
  at position ``p`` attends to ``p + 1`` keys, so a row attends to ``num_tokens * start +
  num_tokens * (num_tokens + 1) / 2`` keys) + ``2 * vocab * hidden`` per sampled row (the
  output projection runs only for the rows that sample).

Left out, because they are small beside these or stay in the caches: the norms', residual
adds' and attention's own activations, norms' and rotary FLOPs, softmax, the sampler. The floor
is a lower bound: leaving work out only lowers it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from twostroke.engine.models.config import ModelConfig
from twostroke.states.plan import StepPlan
from twostroke.states.validators import int_at_least

__all__ = [
    "BLOCK_BYTES",
    "DTYPE_BYTES",
    "KV_DTYPE_BYTES",
    "WEIGHT_BYTES",
    "ModelCost",
    "RowShape",
    "StepCost",
]

#: Bytes of one element of each activation (and KV cache) dtype.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

#: Bytes of one element of each KV cache dtype: the activations' and OpenVINO's default
#: 8-bit cache on a CPU (its ``KV_CACHE_PRECISION`` u8, which a peer's roof costs).
KV_DTYPE_BYTES = {**DTYPE_BYTES, "uint8": 1}

#: Bytes of one projection weight in each reduced precision
#: (:mod:`~twostroke.engine.models.quantization`); int8 adds a float32 scale per output channel.
WEIGHT_BYTES = {"fp16": 2, "int8": 1}

#: Bytes and weights of one GGUF block of each type the projections are quantized into at load
#: (:data:`~twostroke.engine.models.plan.QUANTIZE_TO_BLOCKS`): Q8_0 a float16 scale and 32
#: int8 weights, Q4_0 a float16 scale and 32 nibbles.
BLOCK_BYTES = {"q8_0": (34, 32), "q4_0": (18, 32)}


@attrs.frozen
class StepCost:
    """The bytes a step moves and the FLOPs it computes.

    Attributes:
        bytes: Bytes read or written in memory.
        flops: Floating-point operations (a multiply-add is two).
    """

    bytes: int
    flops: int

    def __add__(self, other: StepCost) -> StepCost:
        return StepCost(self.bytes + other.bytes, self.flops + other.flops)


@attrs.frozen
class RowShape:
    """One request's share of a step, as the cost model needs it.

    Attributes:
        start: Positions already in the KV cache (the history the row reads).
        num_tokens: Positions the step computes for the row.
        sample: Whether the row samples (the output projection runs for it).
    """

    start: int = attrs.field(validator=int_at_least(0))
    num_tokens: int = attrs.field(validator=int_at_least(1))
    sample: bool = True


@attrs.frozen(kw_only=True)
class ModelCost:
    """A model's per-step costs, counted from its shape (see the module's docstring).

    Make one with :meth:`of`; the fields are the model's constants.

    Attributes:
        weight_bytes: Bytes of the weights every step streams once.
        layer_params: Projection parameters of all decoder layers: each token multiplies
            by every one of them once.
        output_params: Parameters of the output projection (``vocab * hidden``).
        embedding_row_bytes: Bytes of one embedding row (looked up per token).
        kv_bytes_per_token: Bytes of one position's keys and values in every layer.
        attention_flops_per_key: FLOPs of one query attending to one key in every layer.
        activation_bytes_per_token: Bytes of the rows one token's projections read and write
            in every layer (see the module's docstring).
        head_activation_bytes: Bytes of a sampled row's final hidden row and its logits.
    """

    weight_bytes: int = attrs.field(validator=int_at_least(1))
    layer_params: int = attrs.field(validator=int_at_least(1))
    output_params: int = attrs.field(validator=int_at_least(1))
    embedding_row_bytes: int = attrs.field(validator=int_at_least(1))
    kv_bytes_per_token: int = attrs.field(validator=int_at_least(1))
    attention_flops_per_key: int = attrs.field(validator=int_at_least(1))
    activation_bytes_per_token: int = attrs.field(validator=int_at_least(0))
    head_activation_bytes: int = attrs.field(validator=int_at_least(0))

    @classmethod
    def of(
        cls,
        config: ModelConfig,
        *,
        dtype: str = "float32",
        quantization: str | None = None,
        stored: Mapping[str, int] | None = None,
        kv_cache_dtype: str | None = None,
    ) -> ModelCost:
        """The costs of a model of shape ``config``.

        Args:
            config: The model's shape.
            dtype: The weights' and activations' dtype (a key of :data:`DTYPE_BYTES`), and
                the KV cache's unless ``kv_cache_dtype`` is given.
            quantization: The decoder projections' weight precision (a key of
                :data:`WEIGHT_BYTES` or of :data:`BLOCK_BYTES`), or ``None`` for ``dtype``.
                The embedding, the output projection, norms and biases stay in ``dtype``.
            stored: The weights as a file stores them and the model reads them (a GGUF
                file's blocks computed as stored): bytes by transformers' tensor name
                (:func:`~twostroke.engine.models.loading.stored_bytes`). Then each
                weight costs its stored bytes, an embedding row its share of the stored
                embedding, the tied output projection the embedding's bytes, and
                ``quantization`` is not consulted.
            kv_cache_dtype: The KV cache's dtype (a key of :data:`KV_DTYPE_BYTES`), or
                ``None`` for ``dtype``.

        Raises:
            ValueError: an unknown ``dtype``, ``kv_cache_dtype`` or ``quantization``, or
                ``stored`` without a weight the model has.
        """
        for name, value, known in (
            ("dtype", dtype, DTYPE_BYTES),
            ("kv_cache_dtype", kv_cache_dtype or dtype, KV_DTYPE_BYTES),
        ):
            if value not in known:
                raise ValueError(f"{name} must be one of {', '.join(known)}, got {value!r}")
        kv_bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim
        kv_bytes_per_token *= KV_DTYPE_BYTES[kv_cache_dtype or dtype]
        if quantization is not None and quantization not in (*WEIGHT_BYTES, *BLOCK_BYTES):
            raise ValueError(
                f"quantization must be None or one of {', '.join((*WEIGHT_BYTES, *BLOCK_BYTES))}"
                f", got {quantization!r}"
            )
        element = DTYPE_BYTES[dtype]
        hidden, inner = config.hidden_size, config.intermediate_size
        q_width = config.num_heads * config.head_dim
        kv_width = config.num_kv_heads * config.head_dim
        # (out_features, in_features) of each projection of one layer.
        projections = (
            (q_width, hidden),
            (kv_width, hidden),
            (kv_width, hidden),
            (hidden, q_width),
            (inner, hidden),
            (inner, hidden),
            (hidden, inner),
        )
        params = sum(rows * columns for rows, columns in projections)
        if quantization is None:
            projection_bytes = params * element
        elif quantization in BLOCK_BYTES:
            size, weights = BLOCK_BYTES[quantization]
            projection_bytes = sum(
                rows * -(-columns // weights) * size for rows, columns in projections
            )
        else:
            scales = 4 * sum(rows for rows, _ in projections) if quantization == "int8" else 0
            projection_bytes = params * WEIGHT_BYTES[quantization] + scales
        biases = (q_width + 2 * kv_width) * config.qkv_bias
        biases += hidden * config.o_bias + (2 * inner + hidden) * config.mlp_bias
        norms = 2 * hidden
        layer_bytes = projection_bytes + (biases + norms) * element
        output_params = config.vocab_size * hidden
        # The rows a token's projections read and write, one layer (the module's docstring).
        rows = 4 * hidden + 2 * q_width + 2 * kv_width + 3 * inner
        activations = {
            "activation_bytes_per_token": config.num_layers * rows * element,
            "head_activation_bytes": (hidden + config.vocab_size) * element,
        }
        if stored is not None:
            return cls._stored(
                config, stored, params, output_params, kv_bytes_per_token, q_width, activations
            )
        return cls(
            weight_bytes=config.num_layers * layer_bytes + (hidden + output_params) * element,
            layer_params=config.num_layers * params,
            output_params=output_params,
            embedding_row_bytes=hidden * element,
            kv_bytes_per_token=kv_bytes_per_token,
            attention_flops_per_key=4 * config.num_layers * q_width,
            **activations,
        )

    @classmethod
    def _stored(
        cls,
        config: ModelConfig,
        stored: Mapping[str, int],
        layer_params: int,
        output_params: int,
        kv_bytes_per_token: int,
        q_width: int,
        activations: Mapping[str, int],
    ) -> ModelCost:
        embedding = "model.embed_tokens.weight"
        head = embedding if config.tie_word_embeddings else "lm_head.weight"
        missing = [name for name in (embedding, head) if name not in stored]
        if missing:
            raise ValueError(f"the stored weights have no {missing[0]!r}")
        # Every weight but the embedding is streamed once a step (a tied head: the
        # embedding's blocks, as the output projection).
        streamed = sum(size for name, size in stored.items() if name != embedding)
        if config.tie_word_embeddings:
            streamed += stored[embedding]
        return cls(
            weight_bytes=streamed,
            layer_params=config.num_layers * layer_params,
            output_params=output_params,
            embedding_row_bytes=max(1, stored[embedding] // config.vocab_size),
            kv_bytes_per_token=kv_bytes_per_token,
            attention_flops_per_key=4 * config.num_layers * q_width,
            **activations,
        )

    def step(self, rows: Iterable[RowShape]) -> StepCost:
        """The cost of one step that computes ``rows``.

        Raises:
            ValueError: ``rows`` is empty (a step computes something).
        """
        total = StepCost(self.weight_bytes, 0)
        count = 0
        for row in rows:
            count += 1
            n, start = row.num_tokens, row.start
            keys = n * start + n * (n + 1) // 2
            total += StepCost(
                bytes=(start + n) * self.kv_bytes_per_token
                + n * (self.embedding_row_bytes + self.activation_bytes_per_token)
                + self.head_activation_bytes * row.sample,
                flops=2 * self.layer_params * n
                + self.attention_flops_per_key * keys
                + 2 * self.output_params * row.sample,
            )
        if not count:
            raise ValueError("a step must compute at least one row, got none")
        return total

    def plan(self, plan: StepPlan) -> StepCost:
        """The cost of a step plan as a runner executes it (see :meth:`step`).

        Raises:
            ValueError: the plan has no rows.
        """
        return self.step(
            RowShape(entry.start, entry.num_tokens, entry.sample) for entry in plan.requests
        )
