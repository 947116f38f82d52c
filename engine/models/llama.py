"""The Llama-family decoder over a paged KV cache (Llama, Mistral, Qwen2, SmolLM).

A flat batch of tokens goes in (several requests' chunks back to back, see
:class:`~twostroke.engine.attention.ops.AttentionMetadata`), logits for the rows that
sample come out. The arithmetic follows transformers' ``modeling_llama`` operation for
operation (RMSNorm in float32, rotary tables in float32 cast to the model dtype, the same
residual order), so float32 logits match it to rounding and greedy tokens match exactly.

Departures, all for speed: q/k/v are one fused projection and so are gate/up
(:meth:`LlamaForCausalLM.load_weight` takes transformers' tensor names and copies each into
its slice); queries and keys are rotated together; on the CPU the projections' weights are
packed for oneDNN once loaded, in bfloat16 (same results) and, unless transformers' exact
float32 arithmetic is asked for, in float32; where it is not asked for, bfloat16 weights on
a CPU with AVX512-BF16 go to twostroke's compiled kernel instead
(:meth:`LlamaForCausalLM.pack_weights`; the projection layer is
:mod:`~twostroke.engine.models.linear`'s). Parameters are
allocated uninitialized and filled by the loader, so building the module costs no random
initialization and holds one copy of the weights.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from twostroke.engine.attention.kernels import AttentionKernel
from twostroke.engine.attention.kv_cache import KVCache, LayerCache
from twostroke.engine.attention.metadata import AttentionMetadata, ChunkSpec
from twostroke.engine.attention.ops import paged_attention, write_kv
from twostroke.engine.kernels.build import native_wanted
from twostroke.engine.kernels.glue import DecoderGlue, decoder_glue
from twostroke.engine.kernels.projection import PanelWeight, projection_kernel
from twostroke.engine.kernels.stack import DecoderStack, StackLayer, decoder_stack
from twostroke.engine.models.config import ModelConfig
from twostroke.engine.models.layers import (
    RMSNorm,
    inverse_frequencies,
    rotary_tables,
    rotate_,
    silu_mul,
)
from twostroke.engine.models.linear import Linear, can_pack, empty_parameter, pack, packed_linear
from twostroke.engine.models.quantization import (
    Quantization,
    QuantizationUnavailable,
    kernel_available,
    unavailable_message,
)
from twostroke.gpu.huge_pages import huge_page_buffer
from twostroke.gpu.threads import torch_threads
from twostroke.states.errors import EngineError
from twostroke.states.validators import check_int_at_least

__all__ = ["LlamaForCausalLM", "WeightError", "inverse_frequencies"]


class WeightError(EngineError, ValueError):
    """A tensor does not fit the model: unknown name, wrong shape, or missing.

    Bad input (the checkpoint's), so also a ``ValueError``, like every error of twostroke
    that a caller's input causes.
    """


class Attention(nn.Module):
    """Grouped-query self-attention over the paged cache."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        width = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, width, bias=config.qkv_bias, dtype=dtype, device=device
        )
        self.o_proj = Linear(
            config.num_heads * config.head_dim,
            config.hidden_size,
            bias=config.o_bias,
            dtype=dtype,
            device=device,
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        metadata: AttentionMetadata,
        layer: LayerCache,
        glue: DecoderGlue | None = None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        # Queries and keys rotate together, in place in the projection's output, which
        # then holds them and the values side by side: no split, no copy.
        query_key = qkv[:, : (heads + kv_heads) * dim].view(num_tokens, -1, dim)
        key_value = qkv[:, heads * dim :].view(num_tokens, 2, kv_heads, dim)
        if glue is not None and metadata.keys_transposed:
            slots = metadata.slot_mapping
            glue.rotate_write(qkv, heads, kv_heads, cos, signed_sin, slots, layer.data)
        else:
            rotate_(query_key, cos, signed_sin)
            write_kv(layer, key_value, metadata)
        out = paged_attention(query_key[:, :heads], key_value, layer, metadata, scale=self.scale)
        projected: torch.Tensor = self.o_proj(out)
        return projected


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(
            config.hidden_size,
            2 * config.intermediate_size,
            bias=config.mlp_bias,
            dtype=dtype,
            device=device,
        )
        self.down_proj = Linear(
            config.intermediate_size,
            config.hidden_size,
            bias=config.mlp_bias,
            dtype=dtype,
            device=device,
        )

    def forward(self, x: torch.Tensor, glue: DecoderGlue | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        mixed = silu_mul(gate_up) if glue is None else glue.silu_mul(gate_up)
        down: torch.Tensor = self.down_proj(mixed)
        return down


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks, each added to the residual stream."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.self_attn = Attention(config, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.mlp = MLP(config, dtype=dtype, device=device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        metadata: AttentionMetadata,
        layer: LayerCache,
    ) -> torch.Tensor:
        attended: torch.Tensor = self.self_attn(
            self.input_layernorm(x), cos, signed_sin, metadata, layer
        )
        x = x + attended
        mixed: torch.Tensor = self.mlp(self.post_attention_layernorm(x))
        return x + mixed

    def forward_fused(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        metadata: AttentionMetadata,
        layer: LayerCache,
        glue: DecoderGlue,
    ) -> torch.Tensor:
        """:meth:`forward` with its glue compiled: each residual add and the norm after it,
        the rotary embeddings and the cache write, and SiLU times up, one call each.

        ``residual`` is the stream before the previous layer's MLP output ``delta`` (``None``
        for the first layer) is added; both adds happen in place in ``residual``. Returns this
        layer's MLP output, which the next layer (or the final norm) adds.
        """
        first, second = self.input_layernorm, self.post_attention_layernorm
        normed = glue.add_rms_norm(residual, delta, first.weight, first.eps)
        attended: torch.Tensor = self.self_attn(normed, cos, signed_sin, metadata, layer, glue)
        normed = glue.add_rms_norm(residual, attended, second.weight, second.eps)
        mixed: torch.Tensor = self.mlp(normed, glue)
        return mixed


#: transformers' per-layer tensor names -> (our parameter, index of the slice in a fused one).
_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(?:(\w+)\.)?(\w+)\.(weight|bias)")
_FUSED = {
    ("self_attn", "q_proj"): ("self_attn.qkv_proj", 0),
    ("self_attn", "k_proj"): ("self_attn.qkv_proj", 1),
    ("self_attn", "v_proj"): ("self_attn.qkv_proj", 2),
    ("self_attn", "o_proj"): ("self_attn.o_proj", None),
    ("mlp", "gate_proj"): ("mlp.gate_up_proj", 0),
    ("mlp", "up_proj"): ("mlp.gate_up_proj", 1),
    ("mlp", "down_proj"): ("mlp.down_proj", None),
}
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class LlamaForCausalLM(nn.Module):
    """The decoder with its embedding and output projection.

    Args:
        config: The model's shape.
        dtype: Dtype of the weights, the activations and the KV cache.
        device: Where the weights live.
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = device
        self.embed_tokens = empty_parameter(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype=dtype, device=device) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(
                config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device
            )
        )
        # The packed copy of the tied embedding for the output projection (the embedding
        # itself stays dense: lookups index it), set by pack_weights().
        self._packed_embedding: torch.Tensor | None = None
        # Or its panels for the compiled bfloat16 kernel, where pack_weights() chose it.
        self._embedding_panels: PanelWeight | None = None
        self._packed = False
        self._quantization: Quantization | None = None
        self._glue: DecoderGlue | None = None  # set by fuse_glue()
        self._stack: DecoderStack | None = None  # set once the glue and the panels are
        self.inv_freq = inverse_frequencies(config).to(device)
        self._loaded: set[str] = set()

    # --- computing ------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        metadata: AttentionMetadata,
        kv_cache: KVCache,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run one step and return float32 logits ``[len(logits_indices), vocab_size]``.

        Args:
            input_ids: ``[num_tokens]`` token ids in batch order.
            metadata: Positions, cache slots and attention layout of the step.
            kv_cache: The cache; the step's keys and values are written into it.
            logits_indices: Rows whose logits are wanted (the output projection is the
                largest matrix, so it runs only for them).
        """
        x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = rotary_tables(metadata.positions, self.inv_freq, self.dtype)
        glue, stack = self._glue, self._stack
        if glue is None:
            for layer, layer_cache in zip(self.layers, kv_cache.layers, strict=True):
                x = layer(x, cos, sin, metadata, layer_cache)
            x = self.norm(x.index_select(0, logits_indices))
        else:
            delta: torch.Tensor | None = None  # x is the residual stream, added to in place
            if stack is not None and stack.runs(metadata):
                delta = stack(x, cos, sin, metadata, kv_cache)  # the loop below, in C
            else:
                for layer, layer_cache in zip(self.layers, kv_cache.layers, strict=True):
                    decoder = cast(DecoderLayer, layer)  # ModuleList items are Modules to mypy
                    delta = decoder.forward_fused(x, delta, cos, sin, metadata, layer_cache, glue)
            last = None if delta is None else delta.index_select(0, logits_indices)
            x = glue.add_rms_norm(
                x.index_select(0, logits_indices), last, self.norm.weight, self.norm.eps
            )
        if self.lm_head is not None:
            logits: torch.Tensor = self.lm_head(x)
        elif self._embedding_panels is not None:
            logits = self._embedding_panels(x)
        elif self._packed_embedding is not None:
            logits = packed_linear(x, self._packed_embedding, None)
        else:
            logits = F.linear(x, self.embed_tokens)
        return logits.float()

    @property
    def packed(self) -> bool:
        """Whether :meth:`pack_weights` packed the projections (for either kernel)."""
        return self._packed

    @property
    def panels(self) -> bool:
        """Whether :meth:`pack_weights` gave the projections it packed to the compiled
        bfloat16 kernel (:mod:`twostroke.engine.kernels.projection`) rather than to oneDNN."""
        # The output projection is never quantized, so it is laid out whenever the rest is.
        if self.lm_head is not None:
            return self.lm_head.panels is not None
        return self._embedding_panels is not None

    def pack_weights(self, *, exact: bool = True) -> bool:
        """Pack every projection for its fastest kernel here, where that works.

        bfloat16 weights on a CPU with AVX512-BF16, unless ``exact``, are laid out for the
        compiled kernel of :mod:`~twostroke.engine.kernels.projection` (1.36x oneDNN's speed
        at 32 rows, 1.9x at one, on SmolLM2's projections; it sums in another order, so not
        bit for bit
        ``F.linear``, and ``TWOSTROKE_NATIVE=0`` keeps oneDNN's). Otherwise they are packed
        for oneDNN where :func:`.linear.can_pack` says that works.

        The last step of loading: packed weights cannot be loaded into any more. A tied
        embedding gets a packed copy for the output projection (it stays dense for lookups).
        Projections :meth:`quantize_weights` quantized stay as they are; the output
        projection, never quantized, is packed.

        Args:
            exact: Keep products exactly transformers' (MKL's in float32, oneDNN's plain
                ones in bfloat16): float32 weights are packed and bfloat16 ones go to the
                compiled kernel only when this is false.

        Returns:
            Whether the weights are packed (``False`` unless bfloat16, or float32 with
            ``exact=False``, on a CPU with oneDNN or the compiled kernel).
        """
        if self._packed:
            return True
        kernel = (
            projection_kernel()
            if not exact
            and self.dtype == torch.bfloat16
            and self.device.type == "cpu"
            and native_wanted()
            else None
        )
        dense = [m for m in self.modules() if isinstance(m, Linear) and m.quantized is None]
        if kernel is not None and all(m.weight.shape[1] % 2 == 0 for m in dense):
            # (The kernel reads inputs in pairs: a model with an odd width stays on oneDNN.)
            # All the panels in one allocation, in huge pages: each weight is read in full
            # every step (1.28x the speed at one row, measured; see huge_pages).
            tied = [] if self.lm_head is not None else [self.embed_tokens.shape]
            shapes = [m.weight.shape for m in dense] + tied
            rooms = huge_page_buffer([kernel.packed_size(*s) for s in shapes], torch.bfloat16)
            with torch_threads(1):
                for linear, room in zip(dense, rooms[: len(dense)], strict=True):
                    linear.pack_panels(kernel, room)
                if tied:
                    self._embedding_panels = kernel.pack(self.embed_tokens, into=rooms[-1])
            self._packed = True
            self._link_stack()
            return True
        if not can_pack(self.dtype, self.device, exact=exact):
            return False
        # One thread: the reorders are memory-bound, and with two threads on a busy machine
        # each call waits for a descheduled thread (5x slower, measured: 0.9 s for SmolLM2).
        with torch_threads(1):
            for module in self.modules():
                if isinstance(module, Linear):
                    module.pack()
            if self.lm_head is None:
                self._packed_embedding = pack(self.embed_tokens)
        self._packed = True
        return True

    @property
    def glue(self) -> DecoderGlue | None:
        """The compiled glue :meth:`fuse_glue` set, if any (the runner's sampler takes its
        ``argmax``)."""
        return self._glue

    def fuse_glue(self) -> bool:
        """Run the decoder's element-wise glue as compiled calls
        (:mod:`~twostroke.engine.kernels.glue`).

        Each residual add and the RMSNorm after it, the rotary embeddings with the cache
        write (where the cache holds keys transposed, the CPU's layout), and SiLU times up:
        one call each. On the CPU, in float32 or bfloat16, where the glue builds and passes
        its check, unless ``TWOSTROKE_NATIVE=0``. The norms and SiLU agree with torch's
        operators to float32 rounding, not bit for bit, so the loader asks for this only
        when transformers' exact arithmetic is not (``exact=False``).

        Returns:
            Whether the glue is now compiled (``False`` where it does not run; its build
            logs why).
        """
        if self._glue is None and self.device.type == "cpu" and native_wanted():
            config = self.config
            self._glue = decoder_glue(
                hidden=config.hidden_size, head_dim=config.head_dim, dtype=self.dtype
            )
            self._link_stack()
        return self._glue is not None

    @property
    def stack(self) -> DecoderStack | None:
        """The compiled driver that runs a step's layers in one call
        (:mod:`~twostroke.engine.kernels.stack`), set once the glue is fused and the
        projections are packed for the bfloat16 kernel (with any projection quantized, there
        is none)."""
        return self._stack

    def _link_stack(self) -> None:
        """Set :attr:`stack` where the glue and every decoder projection's panels are."""
        glue = self._glue
        if glue is None or not self.panels or self._stack is not None:
            return
        layers = []
        for layer in self.layers:
            decoder = cast(DecoderLayer, layer)
            attention, mlp = decoder.self_attn, decoder.mlp
            qkv, o = attention.qkv_proj.panels, attention.o_proj.panels
            gate_up, down = mlp.gate_up_proj.panels, mlp.down_proj.panels
            if qkv is None or o is None or gate_up is None or down is None:
                return  # quantized projections: their kernels are torch's
            first, second = decoder.input_layernorm, decoder.post_attention_layernorm
            norms = (first.weight, first.eps, second.weight, second.eps)
            layers.append(StackLayer(*norms, qkv, o, gate_up, down))
        config = self.config
        self._stack = decoder_stack(
            layers,
            glue=glue,
            projection=layers[0].qkv.kernel,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            intermediate=config.intermediate_size,
        )

    @property
    def quantization(self) -> Quantization | None:
        """The projections' weight precision set by :meth:`quantize_weights`, if any."""
        return self._quantization

    def quantize_weights(self, kind: Quantization, *, threads: int = 1) -> bool:
        """Hold every decoder projection's weight in ``kind`` (see :mod:`.quantization`).

        A last step of loading, like :meth:`pack_weights` (call it first: packing then
        leaves the quantized projections alone). The embedding and the output projection
        keep the model's dtype. Where ``kind``'s kernel does not run (any device but the
        CPU, or a torch without it), warns once with :class:`QuantizationUnavailable` and
        leaves the weights as they are.

        Args:
            kind: ``"fp16"`` or ``"int8"``.
            threads: Python threads packing matrices at once (fp16 only: int8's per-channel
                quantization sets warning filters, which are process-wide).

        Returns:
            Whether the weights are now held in ``kind``.

        Raises:
            RuntimeError: the weights are packed or quantized (differently) already.
            TypeError, ValueError: ``threads`` is not an int >= 1.
        """
        check_int_at_least("threads", threads, 1)
        if self._quantization == kind:
            return True
        if self._packed or self._quantization is not None:
            raise RuntimeError(
                f"cannot quantize to {kind!r}: the weights are packed or quantized already"
            )
        if not kernel_available(kind, self.device):
            warnings.warn(
                unavailable_message(kind, self.device), QuantizationUnavailable, stacklevel=2
            )
            return False
        linears = [m for layer in self.layers for m in layer.modules() if isinstance(m, Linear)]
        # fbgemm packs each matrix in one serial loop that reads the weight with a stride
        # (about 25 ns an element on the AVX2 EPYC, 2.5 s for SmolLM2) and releases the GIL,
        # so ``threads`` Python threads pack different matrices at once; torch's own team
        # stays at one thread, as in pack_weights.
        workers = threads if kind == "fp16" else 1
        with torch_threads(1), ThreadPoolExecutor(workers, "twostroke-pack") as pool:
            for _ in pool.map(lambda linear: linear.quantize(kind), linears):
                pass
        self._quantization = kind
        return True

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, *, zeroed: bool = True
    ) -> KVCache:
        """A paged cache for this model, zeroed unless ``zeroed`` is false (see KVCache)."""
        config = self.config
        return KVCache.allocate(
            num_layers=config.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=self.dtype,
            device=self.device,
            zeroed=zeroed,
        )

    @torch.inference_mode()
    def forward_logits(
        self,
        sequences: Sequence[Sequence[int]],
        *,
        chunk_size: int | None = None,
        block_size: int = 4,
        kernel: AttentionKernel | None = None,
    ) -> list[torch.Tensor]:
        """Logits at every position of each sequence, computed through a fresh paged cache.

        For tests and checks: all sequences run as one batch of steps, each step computing
        the next ``chunk_size`` positions of every unfinished sequence (all of them when
        ``None``; ``1`` runs everything after the first step as batched decodes). Block
        tables interleave the sequences' blocks, so no table is contiguous.

        Args:
            sequences: Token ids, each non-empty.
            chunk_size: Positions per sequence per step.
            block_size: Positions per cache block.
            kernel: How the steps attend (``None``: the device's default, as
                :meth:`~twostroke.engine.attention.metadata.AttentionMetadata.build`
                takes it).

        Returns:
            One float32 tensor ``[len(sequence), vocab_size]`` per sequence.

        Raises:
            ValueError: no sequences, an empty one, or ``chunk_size`` below 1.
        """
        if not sequences or not all(sequences):
            raise ValueError("forward_logits needs at least one sequence, each non-empty")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 (or None), got {chunk_size}")
        count = len(sequences)
        longest = max(len(tokens) for tokens in sequences)
        width = -(-longest // block_size)
        cache = self.allocate_kv_cache(count * width, block_size)
        tables = [tuple(index + count * k for k in range(width)) for index in range(count)]
        done = [0] * count
        parts: list[list[torch.Tensor]] = [[] for _ in sequences]
        while any(done[i] < len(tokens) for i, tokens in enumerate(sequences)):
            step: list[tuple[int, ChunkSpec]] = []
            for i, tokens in enumerate(sequences):
                remaining = len(tokens) - done[i]
                if remaining:
                    size = remaining if chunk_size is None else min(chunk_size, remaining)
                    step.append((i, ChunkSpec(done[i], size, tables[i])))
            step.sort(key=lambda item: item[1].num_tokens != 1)  # decodes first
            ids = [t for i, chunk in step for t in sequences[i][chunk.start : chunk.end]]
            metadata = AttentionMetadata.build(
                [chunk for _, chunk in step],
                block_size=block_size,
                num_blocks=cache.num_blocks,
                num_kv_heads=self.config.num_kv_heads,
                dtype=self.dtype,
                device=self.device,
                num_heads=self.config.num_heads,
                head_dim=self.config.head_dim,
                kernel=kernel,
            )
            rows = torch.arange(len(ids), device=self.device)
            input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
            logits = self(input_ids, metadata, cache, rows).cpu()
            offset = 0
            for i, chunk in step:
                parts[i].append(logits[offset : offset + chunk.num_tokens])
                offset += chunk.num_tokens
                done[i] = chunk.end
        return [torch.cat(chunks) for chunks in parts]

    # --- loading --------------------------------------------------------------------------

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one tensor, named as transformers names it, into its parameter (or slice).

        Args:
            name: E.g. ``model.layers.3.self_attn.k_proj.weight``.
            tensor: The values, in any floating dtype (converted to the model's).

        Raises:
            WeightError: the name is unknown, or the shape does not fit.
            RuntimeError: the weights are packed (:meth:`pack_weights`) already.
        """
        if self._packed:
            raise RuntimeError(f"cannot load {name!r}: the weights are packed already")
        if self._quantization is not None:
            raise RuntimeError(f"cannot load {name!r}: the weights are quantized already")
        if _IGNORED.match(name):
            return
        target = self._target(name)
        if target is None:
            if name == "lm_head.weight" and self.lm_head is None:
                return  # tied: the embedding is the output projection
            raise WeightError(f"unexpected tensor {name!r}: the model has no such weight")
        if tuple(tensor.shape) != tuple(target.shape):
            raise WeightError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)
        self._loaded.add(name)

    def expected_weights(self) -> list[str]:
        """The transformers tensor names the model needs, in order."""
        names = ["model.embed_tokens.weight"]
        config = self.config
        for index in range(config.num_layers):
            prefix = f"model.layers.{index}."
            names += [prefix + "input_layernorm.weight", prefix + "post_attention_layernorm.weight"]
            for (block, proj), (_, _) in _FUSED.items():
                names.append(f"{prefix}{block}.{proj}.weight")
                bias = {
                    "q_proj": config.qkv_bias,
                    "k_proj": config.qkv_bias,
                    "v_proj": config.qkv_bias,
                    "o_proj": config.o_bias,
                }.get(proj, config.mlp_bias)
                if bias:
                    names.append(f"{prefix}{block}.{proj}.bias")
        names.append("model.norm.weight")
        if self.lm_head is not None:
            names.append("lm_head.weight")
        return names

    def missing_weights(self) -> list[str]:
        """Expected tensors that :meth:`load_weight` has not received."""
        return [name for name in self.expected_weights() if name not in self._loaded]

    def _target(self, name: str) -> torch.Tensor | None:
        if name == "model.embed_tokens.weight":
            return self.embed_tokens
        if name == "model.norm.weight":
            return self.norm.weight
        if name == "lm_head.weight":
            return None if self.lm_head is None else self.lm_head.weight
        match = _LAYER_TENSOR.fullmatch(name)
        if match is None:
            return None
        index, block, proj, kind = match.groups()
        if int(index) >= len(self.layers):
            return None
        layer = self.layers[int(index)]
        if block is None:
            norms = ("input_layernorm", "post_attention_layernorm")
            return (
                layer.get_parameter(f"{proj}.weight")
                if proj in norms and kind == "weight"
                else None
            )
        fused = _FUSED.get((block, proj))
        if fused is None:
            return None
        module_name, part = fused
        module = layer.get_submodule(module_name)
        param: torch.Tensor | None = getattr(module, kind)
        if param is None:
            return None
        if part is None:
            return param
        config = self.config
        if module_name.endswith("qkv_proj"):
            q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
            start, size = ((0, q), (q, kv), (q + kv, kv))[part]
        else:
            size = config.intermediate_size
            start = part * size
        return param.narrow(0, start, size)
