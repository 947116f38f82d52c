"""The decoder every architecture is: :class:`CausalLM`, over a paged KV cache.

A flat batch of tokens goes in (several requests' chunks back to back, see
:class:`~twostroke.engine.attention.metadata.AttentionMetadata`), logits for the rows that
sample come out. An architecture (:mod:`~twostroke.engine.models.llama`, one module each)
composes the shared layers (:mod:`~twostroke.engine.models.decoder_layer`,
:mod:`~twostroke.engine.models.layers`) and gives its table of checkpoint names
(:class:`CheckpointNames`); this module holds what every model does the same way.

Departures from transformers, all for speed: fused projections (:meth:`CausalLM.load_weight` takes
transformers' tensor names and copies each into its slice); on the CPU the weights are laid out once
loaded in the form the run's plan names (:mod:`~twostroke.engine.models.plan`, applied by
:meth:`CausalLM.use_kernels`; the forms are :mod:`~twostroke.engine.models.forms`). Parameters are
allocated uninitialized and filled by the loader, so building the module costs no random
initialization and holds one copy of the weights.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar, cast

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from twostroke.engine.attention.kernels import AttentionKernel, native_kernel
from twostroke.engine.attention.kv_cache import KVCache
from twostroke.engine.attention.metadata import AttentionMetadata, ChunkSpec
from twostroke.engine.checkpoints.gguf import BlockTensor
from twostroke.engine.kernels.libc import release_free_memory
from twostroke.engine.kernels.paged_attention import PagedDecodeKernel
from twostroke.engine.kernels.stack import StackLayer, StackProjection, StackWeight
from twostroke.engine.models.choice import CpuKernels, Projections, torch_kernels
from twostroke.engine.models.config import ModelConfig
from twostroke.engine.models.decoder_layer import MLP, DecoderLayer
from twostroke.engine.models.experts import SparseMoE
from twostroke.engine.models.forms import (
    QUANTIZATIONS,
    BlockEmbedding,
    BlockWeight,
    FullPrecision,
    PanelWeight,
    SplitByRows,
)
from twostroke.engine.models.glue import CompiledGlue
from twostroke.engine.models.layers import (
    RMSNorm,
    inverse_frequencies,
    long_inverse_frequencies,
    rotary_attention_factor,
    rotary_tables,
)
from twostroke.engine.models.linear import Linear, empty_parameter
from twostroke.engine.models.stack import DecoderStack, build_stack
from twostroke.gpu.huge_pages import huge_page_buffer
from twostroke.gpu.threads import torch_threads
from twostroke.states.errors import EngineError
from twostroke.states.validators import check_int_at_least

__all__ = ["GGUF_BLOCK", "CausalLM", "CheckpointNames", "WeightError"]

_log = logging.getLogger(__name__)

#: Bytes of dense weights converted between two hand-backs of the freed memory to the OS
#: (:func:`~twostroke.engine.kernels.libc.release_free_memory`): about a layer of SmolLM2
#: in bfloat16, so the peak holds one layer's dense weights beside the converted ones.
_RELEASE_EVERY = 8 << 20


class WeightError(EngineError, ValueError):
    """A tensor does not fit the model: unknown name, wrong shape, or missing.

    Bad input (the checkpoint's), so also a ``ValueError``, like every error of twostroke
    that a caller's input causes.
    """


@attrs.frozen
class CheckpointNames:
    """An architecture's table of checkpoint names: which tensor of an HF checkpoint or a
    GGUF file fills which parameter (or slice of a fused one).

    Attributes:
        fused: transformers' ``(block, projection)`` of a layer's tensor to the module that
            holds it and the index of its slice in a fused projection (``None``: the whole).
        parts: Each fused projection of a layer and its parts' names (transformers'), in
            output order.
        norms: A layer's norm weights' names.
        ignored: transformers' tensors the model recomputes (rotary tables).
        gguf_global: llama.cpp's names of the model-wide tensors, to transformers'.
        gguf_layer: llama.cpp's names of a layer's tensors (``blk.N.<name>``), to
            transformers' (the layer's part of the name).
        gguf_rotary_order: GGUF architectures whose converter stored the q/k rows in
            llama.cpp's rotary order (``llama``: the rows permuted, undone at load).
    """

    fused: Mapping[tuple[str, str], tuple[str, int | None]]
    parts: tuple[tuple[str, tuple[str, ...]], ...]
    norms: tuple[str, ...]
    ignored: re.Pattern[str]
    gguf_global: Mapping[str, str]
    gguf_layer: Mapping[str, str]
    gguf_rotary_order: frozenset[str] = frozenset()

    def hf_name(self, gguf_name: str) -> str | None:
        """transformers' name for a llama.cpp tensor name, or ``None`` if it has none."""
        if gguf_name in self.gguf_global:
            return self.gguf_global[gguf_name]
        match = GGUF_BLOCK.fullmatch(gguf_name)
        if match is None or match.group(2) not in self.gguf_layer:
            return None
        index, part, kind = match.groups()
        return f"model.layers.{index}.{self.gguf_layer[part]}.{kind}"


#: A GGUF layer tensor's name: ``blk.<layer>.<name>.<weight|bias>``.
GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
#: A layer's MLP tensor, for a mixture of experts: layer, the name after ``mlp.``.
_EXPERTS_TENSOR = re.compile(r"model\.layers\.(\d+)\.mlp\.(\S+)")
#: transformers' per-layer tensor names: layer, block (or none, for a norm), name, kind.
_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(?:(\w+)\.)?(\w+)\.(weight|bias)")


class CausalLM(nn.Module):
    """A decoder-only model over the paged cache: embedding, layers, final norm and output
    projection, and everything a model does once its architecture composed it (loading
    tensors by the architecture's names, taking the plan's kernels, the compiled stack).

    An architecture is a subclass that names its layer (:attr:`layer`) and its checkpoint
    names (:attr:`names`): :mod:`~twostroke.engine.models.llama` is one.

    Args:
        config: The model's shape.
        dtype: Dtype of the weights, the activations and the KV cache.
        device: Where the weights live.
    """

    #: The decoder layer the architecture stacks.
    layer: ClassVar[type[DecoderLayer]] = DecoderLayer
    #: Which checkpoint tensor fills which parameter.
    names: ClassVar[CheckpointNames]

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = device
        self.embed_tokens = empty_parameter(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device
        )
        self.layers = nn.ModuleList(
            self.layer(config, dtype=dtype, device=device, index=index)
            for index in range(config.num_layers)
        )
        self.norm = RMSNorm(
            config.hidden_size,
            config.rms_norm_eps,
            dtype=dtype,
            device=device,
            offset=config.norm_offset,
        )
        # A tied output projection multiplies by the embedding (which stays dense for the
        # lookups where the projection's other form is a copy; its panels serve both).
        self.lm_head = (
            Linear.tied(self.embed_tokens)
            if config.tie_word_embeddings
            else Linear(
                config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device
            )
        )
        self._kernels: CpuKernels | None = None  # chosen once: use_kernels()
        self._stack: DecoderStack | None = None  # the chosen driver, bound to the weights
        self.inv_freq = inverse_frequencies(config).to(device)
        self.rotary_factor = rotary_attention_factor(config)
        long_inv_freq = long_inverse_frequencies(config)  # LongRoPE's, past the original context
        scaling = config.rope_scaling
        self.long_rotary = (
            None
            if long_inv_freq is None or scaling is None
            else (long_inv_freq.to(device), scaling.original_max_position_embeddings)
        )
        # Gemma 3's sliding-window layers rotate by a base of their own, unscaled: their
        # tables are made once a step too, beside the others.
        local = config.local_rope_theta
        self.local_inv_freq = (
            None
            if local is None
            else inverse_frequencies(
                attrs.evolve(
                    config, rope_theta=local, rope_scaling=None, rope_frequency_factors=None
                )
            ).to(device)
        )
        self.local_layers = frozenset(
            index for index in range(config.num_layers) if config.window_of(index) is not None
        )
        #: What the embeddings are multiplied by (an architecture may round it).
        self.embedding_scale = config.embedding_scale
        self._loaded: set[str] = set()
        # Weights a GGUF file holds in blocks, kept as stored (load_blocks), and the
        # embedding's lookup from them (or from a tied head's panels) once the kernels are
        # chosen.
        self._blocks: dict[str, BlockTensor] = {}
        self._embedding: Callable[[torch.Tensor], torch.Tensor] | None = None

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
        # The residual stream, added to in place.
        embedding = self._embedding
        x = F.embedding(input_ids, self.embed_tokens) if embedding is None else embedding(input_ids)
        config = self.config
        if self.embedding_scale != 1.0:
            x = x * self.embedding_scale
        cos, sin = rotary_tables(
            metadata.positions, self.inv_freq, self.dtype, self.rotary_factor, self.long_rotary
        )
        glue, stack = self.kernels.glue, self._stack
        delta: torch.Tensor | None = None
        if stack is not None and stack.runs(metadata):
            delta = stack(x, cos, sin, metadata, kv_cache)  # the loop below, in C
        else:
            local = (
                None
                if self.local_inv_freq is None
                else rotary_tables(metadata.positions, self.local_inv_freq, self.dtype)
            )
            for index, (layer, layer_cache) in enumerate(
                zip(self.layers, kv_cache.layers, strict=True)
            ):
                tables = local if local is not None and index in self.local_layers else (cos, sin)
                delta = layer(x, delta, *tables, metadata, layer_cache, glue)
        last = None if delta is None else delta.index_select(0, logits_indices)
        x = self.norm.add_norm(x.index_select(0, logits_indices), last, glue)
        logits: torch.Tensor = self.lm_head(x)
        if config.logit_scale != 1.0:
            logits = logits / config.logit_scale  # a division, as transformers' Granite
        cap = config.final_logit_softcapping
        if cap is not None:  # transformers' Gemma: divide, tanh, multiply
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    @property
    def kernels(self) -> CpuKernels:
        """What computes each part of a step: chosen once (:meth:`use_kernels`), torch's
        operators and dense weights until then."""
        return self._kernels or torch_kernels(self.device)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's element type: the chosen kernels' (``kv_cache_dtype``), else the
        model's dtype."""
        cache = self.kernels.cache_dtype
        return self.dtype if cache is None else cache

    @property
    def stack(self) -> DecoderStack | None:
        """The compiled driver that runs a step's layers in one call
        (:mod:`~twostroke.engine.kernels.stack`), where the chosen kernels have one."""
        return self._stack

    def use_kernels(self, kernels: CpuKernels, *, threads: int = 1) -> None:
        """Compute with ``kernels`` from now on: the last step of loading.

        Each projection's weight takes its chosen form (packed for oneDNN, laid out for the
        compiled bfloat16 kernel, or held in float16 / int8 for fbgemm: see
        :class:`~twostroke.engine.models.choice.Projections`), and the compiled stack,
        if chosen, is bound to the weights. Weights in those forms cannot be loaded into any
        more, so no tensor is loaded after this.

        Args:
            kernels: What :func:`~twostroke.engine.models.choice.select_kernels` chose
                for this model.
            threads: Python threads packing matrices at once (fp16 only: int8's per-channel
                quantization sets warning filters, which are process-wide).

        Raises:
            RuntimeError: the model computes with other kernels already (they are chosen
                once).
            TypeError, ValueError: ``threads`` is not an int >= 1.
        """
        check_int_at_least("threads", threads, 1)
        if self._kernels is not None:
            if kernels == self._kernels:
                return
            raise RuntimeError(
                "the model's kernels are chosen once: it computes with "
                f"{self._kernels.describe()!r} already"
            )
        self._convert(kernels.projection, threads)
        self._kernels = kernels
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.by_row = kernels.experts_by_row
        if kernels.stack is not None:
            self._stack = self._bind_stack(kernels)
            if self._stack is None:
                _log.info(
                    "twostroke: the compiled stack is not used: a decoder projection is not "
                    "in the %s form (a GGUF matrix in 16 bits); the layers run one by one",
                    kernels.projection.layers,
                )

    def _convert(self, projection: Projections, threads: int) -> None:
        """Every projection's weight in its chosen form (:class:`.linear.LinearMethod`)."""
        if projection.layers == "blocks":
            self._use_blocks(projection)
            return
        linears = [m for m in self.modules() if isinstance(m, Linear)]  # the head last
        forms = [projection.head if m is self.lm_head else projection.layers for m in linears]
        quantized = [m for m, form in zip(linears, forms, strict=True) if form in QUANTIZATIONS]
        if quantized:
            # fbgemm packs each matrix in one serial loop that reads the weight with a
            # stride (about 25 ns an element on the AVX2 EPYC, 2.5 s for SmolLM2) and
            # releases the GIL, so ``threads`` Python threads pack different matrices at
            # once (fp16 only: int8's per-channel quantization sets warning filters, which
            # are process-wide); torch's own team stays at one thread.
            kind = projection.layers
            workers = threads if kind == "fp16" else 1
            with torch_threads(1), ThreadPoolExecutor(workers, "twostroke-pack") as pool:
                for _ in pool.map(lambda linear: linear.convert(kind), quantized):
                    pass
        panels = [m for m, form in zip(linears, forms, strict=True) if form == "panels"]
        kernel = projection.kernel
        room: dict[int, torch.Tensor] = {}  # by id of the projection
        if panels:
            assert kernel is not None
            # All the panels in one allocation, in huge pages: each weight is read in full
            # every step (1.28x the speed at one row, measured; see huge_pages).
            sizes = [kernel.packed_size(m.out_features, m.in_features) for m in panels]
            room = dict(zip(map(id, panels), huge_page_buffer(sizes, torch.bfloat16), strict=True))
        # One thread: the reorders are memory-bound, and with two threads on a busy machine
        # each call waits for a descheduled thread (5x slower, measured: 0.9 s for SmolLM2).
        # The dense weights each conversion drops go back to the OS as the new forms fill,
        # so the load's peak holds about one copy of the weights, not two (engine.kernels.libc).
        dropped = 0
        with torch_threads(1):
            for linear, form in zip(linears, forms, strict=True):
                if form not in QUANTIZATIONS:
                    into, rows = room.get(id(linear)), projection.panel_rows
                    if form != "dense" and linear.weight is not None:
                        dropped += linear.weight.nbytes
                    linear.convert(form, kernel=kernel, into=into, panel_rows=rows)
                    if dropped >= _RELEASE_EVERY:
                        release_free_memory()
                        dropped = 0
            # A mixture's experts take the dense projections' form too (one expert at a
            # time, each packed from its slice of the stacked tensors, dropped after).
            for layer in self.layers:
                if isinstance(layer.mlp, SparseMoE):
                    layer.mlp.use_form(
                        projection.layers, kernel=kernel, panel_rows=projection.panel_rows
                    )
        head = self.lm_head.method
        if self.config.tie_word_embeddings and isinstance(head, PanelWeight):
            # One copy of the tied matrix: lookups read the head's panels (the same values).
            self._embedding = head.rows
            self.embed_tokens = empty_parameter(0, dtype=self.dtype, device=self.device)
        release_free_memory()

    def _use_blocks(self, projection: Projections) -> None:
        """Each projection whose weights the file holds in blocks computes from them as
        stored (:class:`~twostroke.engine.models.forms.BlockWeight`, a fused one from
        its parts side by side). A decoder projection the file holds in 16 bits (F16, or BF16
        whose values float16 holds) takes the chosen 16-bit form (``projection.sixteen``:
        fbgemm's float16, every value exact in half float32's bytes); the others stay as
        loaded. A mixture's experts loaded in blocks compute from them too
        (:meth:`SparseMoE.use_blocks <twostroke.engine.models.experts.SparseMoE.use_blocks>`).
        An embedding in blocks is looked
        up row by row from them, and the tied output projection multiplies by them."""
        kernel = projection.blocks
        assert kernel is not None, "the 'blocks' form comes with its kernel"
        for index, layer in enumerate(self.layers):
            prefix = f"model.layers.{index}."
            if isinstance(layer.mlp, SparseMoE):
                try:  # its experts, where they were loaded in blocks
                    layer.mlp.use_blocks(kernel)
                except ValueError as error:
                    raise WeightError(f"{prefix}mlp: {error}") from error
            for module_name, names in self.names.parts:
                if module_name.startswith("mlp.") and isinstance(layer.mlp, SparseMoE):
                    continue  # a mixture's projections are its experts': above
                linear = cast(Linear, layer.get_submodule(module_name))
                parts = [self._blocks.get(f"{prefix}{name}.weight") for name in names]
                found = [part for part in parts if part is not None]
                if not found:
                    if projection.sixteen != "dense" and _exact_in_float16(linear):
                        with torch_threads(1):  # fbgemm's packing: see _convert
                            linear.convert(projection.sixteen)
                    continue
                if len(found) != len(parts):
                    raise WeightError(
                        f"{prefix}{module_name}: {len(found)} of its {len(parts)} parts are "
                        "GGUF blocks and the others are not; a fused projection computes in "
                        "one form"
                    )
                bias = None if linear.bias is None else linear.bias.detach().float().clone()
                linear.use(BlockWeight(kernel, tuple(found), bias))
        embedding = self._blocks.get("model.embed_tokens.weight")
        if embedding is not None:
            self._embedding = BlockEmbedding(kernel, embedding)
            self.embed_tokens = empty_parameter(0, dtype=self.dtype, device=self.device)
        head = embedding if self.config.tie_word_embeddings else self._blocks.get("lm_head.weight")
        if head is not None:
            self.lm_head.use(BlockWeight(kernel, (head,)))

    def _bind_stack(self, kernels: CpuKernels) -> DecoderStack | None:
        """The chosen stack driver, given every decoder projection's weight in the form of
        the chosen projection kernel (the bfloat16 panels or the GGUF blocks); ``None``
        where one is in another form."""
        glue = kernels.glue
        projection: StackProjection | None = (
            kernels.projection.blocks
            if kernels.projection.layers == "blocks"
            else kernels.projection.kernel
        )
        assert isinstance(glue, CompiledGlue)
        assert projection is not None
        assert kernels.stack is not None
        layers = []
        for layer in self.layers:
            decoder = cast(DecoderLayer, layer)
            attention, mlp = decoder.self_attn, decoder.mlp
            assert isinstance(mlp, MLP)  # a mixture of experts is a departure: no stack
            linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
            weights = [_stack_weight(linear, projection) for linear in linears]
            first, second = decoder.input_layernorm, decoder.post_attention_layernorm
            norms = (first.weight, first.eps, second.weight, second.eps)
            qkv, o, gate_up, down = weights
            if qkv is None or o is None or gate_up is None or down is None:
                return None
            q_norm, k_norm = attention.q_norm, attention.k_norm
            if not attention.head_norms or q_norm is None or k_norm is None:
                q_norm = k_norm = None  # none, or norms the stack does not compute
            layers.append(
                StackLayer(
                    *norms,
                    qkv,
                    o,
                    gate_up,
                    down,
                    window=attention.window,
                    q_norm=None if q_norm is None else q_norm.weight,
                    k_norm=None if k_norm is None else k_norm.weight,
                    qk_eps=0.0 if q_norm is None else q_norm.eps,
                )
            )
        config = self.config
        return build_stack(
            layers,
            most_tokens=kernels.projection.stack_rows,
            function=kernels.stack,
            glue=glue.library,
            projection=projection,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            intermediate=config.intermediate_size,
        )

    def attention_for(
        self, block_size: int, kernel: AttentionKernel | None = None
    ) -> AttentionKernel | PagedDecodeKernel:
        """How a cache of ``block_size``-position blocks attends: the chosen kernel (or
        ``kernel``), the compiled ``"native"`` one as itself, built for this shape.

        Built (or loaded from the cache) on first use and kept for the process: a runner
        asks once, when it allocates its cache, and hands it to every step's
        :meth:`AttentionMetadata.build
        <twostroke.engine.attention.metadata.AttentionMetadata.build>`.

        Raises:
            ValueError: ``"native"`` where it does not run (see
                :func:`~twostroke.engine.attention.kernels.native_kernel`).
        """
        chosen = self.kernels.attention if kernel is None else kernel
        if chosen != "native":
            return chosen
        config = self.config
        return native_kernel(
            self.device,
            block_size=block_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=self.dtype,
            cache_dtype=self.cache_dtype,
        )

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        *,
        zeroed: bool = True,
        num_windowed_blocks: int = 0,
    ) -> KVCache:
        """A paged cache for this model in :attr:`cache_dtype`, zeroed unless ``zeroed`` is
        false (see KVCache). With ``num_windowed_blocks``, the sliding-window layers
        (:attr:`local_layers`) of a model that also has global ones keep their KV apart, in
        that many blocks (:mod:`~twostroke.engine.runners.window_kv`)."""
        config = self.config
        apart = tuple(sorted(self.local_layers)) if num_windowed_blocks else ()
        return KVCache.allocate(
            num_layers=config.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=self.cache_dtype,
            device=self.device,
            zeroed=zeroed,
            windowed_layers=apart,
            num_windowed_blocks=num_windowed_blocks,
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
            kernel: How the steps attend (``None``: the chosen kernel, :attr:`kernels`).

        Returns:
            One float32 tensor ``[len(sequence), vocab_size]`` per sequence.

        Raises:
            ValueError: no sequences, an empty one, or ``chunk_size`` below 1; or
                ``"native"`` attention where it does not run.
        """
        if not sequences or not all(sequences):
            raise ValueError("forward_logits needs at least one sequence, each non-empty")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 (or None), got {chunk_size}")
        count = len(sequences)
        longest = max(len(tokens) for tokens in sequences)
        width = -(-longest // block_size)
        attention = self.attention_for(block_size, kernel)
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
                kernel=attention,
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
            RuntimeError: the kernels are chosen (:meth:`use_kernels`): the weights are in
                their forms already.
        """
        if self._kernels is not None:
            raise RuntimeError(
                f"cannot load {name!r}: the kernels are chosen, and the weights packed or "
                "quantized for them already"
            )
        if self.names.ignored.match(name):
            return
        experts = self._experts_target(name)
        target = self._target(name) if experts is None else experts[0]
        if target is None:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                return  # tied: the embedding is the output projection
            raise WeightError(f"unexpected tensor {name!r}: the model has no such weight")
        if tuple(tensor.shape) != tuple(target.shape):
            raise WeightError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)
        # A stacked tensor of every expert stands for the checkpoint's experts one by one.
        self._loaded.update([name] if experts is None else experts[1])

    def weight(self, name: str) -> torch.Tensor:
        """The loaded weight of that transformers name (a view: a part of a fused
        projection is its rows).

        Raises:
            WeightError: the model has no such weight, or holds it in blocks.
        """
        experts = self._experts_target(name)
        target = self._target(name) if experts is None else experts[0]
        if target is None or target.numel() == 0:
            raise WeightError(f"the model holds no weight {name!r} in full precision")
        return target

    def load_blocks(self, name: str, tensor: BlockTensor) -> None:
        """Take one weight matrix, named as transformers names it, in a GGUF file's blocks as
        stored (not copied, not dequantized): the projection (or embedding, or output
        projection) computes from them once the kernels choose the ``"blocks"`` form
        (:meth:`use_kernels`).

        A mixture's expert matrix (``mlp.experts.<n>.<proj>.weight``), or every expert's
        stacked as a GGUF file stores them (``mlp.experts.<proj>.weight``, ``[experts *
        rows, row bytes]``), goes to its layer's mixture
        (:meth:`SparseMoE.load_blocks <twostroke.engine.models.experts.SparseMoE.load_blocks>`).

        Raises:
            WeightError: the name is not a projection's, an expert's, the embedding's or the
                output projection's weight, or the shape does not fit.
            RuntimeError: the kernels are chosen already.
        """
        if self._kernels is not None:
            raise RuntimeError(f"cannot load {name!r}: the kernels are chosen")
        mixture = self._mixture(name)
        if mixture is not None:
            mlp, prefix, rest = mixture
            try:
                experts = mlp.load_blocks(rest, tensor)
            except ValueError as error:
                raise WeightError(f"{prefix.removesuffix('.')}: {error}") from error
            if experts is not None:
                self._loaded.update(prefix + part for part in experts)
                return
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return  # tied: the embedding is the output projection
        target = self._target(name)
        if target is None or target.dim() != 2:
            raise WeightError(
                f"tensor {name!r} cannot be held in GGUF blocks: blocks hold the projections', "
                "the embedding's and the output projection's weights"
            )
        shape = (tensor.out_features, tensor.in_features)
        if shape != tuple(target.shape):
            raise WeightError(f"tensor {name!r} has shape {shape}, expected {tuple(target.shape)}")
        self._blocks[name] = tensor
        self._loaded.add(name)

    def expected_weights(self) -> list[str]:
        """The transformers tensor names the model needs, in order."""
        names = ["model.embed_tokens.weight"]
        config = self.config
        for index in range(config.num_layers):
            prefix = f"model.layers.{index}."
            names += [f"{prefix}{norm}.weight" for norm in self.names.norms]
            mlp = self.layers[index].mlp
            if isinstance(mlp, SparseMoE):
                names += [f"{prefix}mlp.{name}" for name in mlp.expected()]
            for block, proj in self.names.fused:
                if isinstance(mlp, SparseMoE) and block == "mlp":
                    continue  # the experts' names are the mixture's
                names.append(f"{prefix}{block}.{proj}.weight")
                bias = {
                    "qkv_proj": config.qkv_bias,
                    "q_proj": config.qkv_bias,
                    "k_proj": config.qkv_bias,
                    "v_proj": config.qkv_bias,
                    "o_proj": config.o_bias,
                }.get(proj, config.mlp_bias)
                if bias:
                    names.append(f"{prefix}{block}.{proj}.bias")
        names.append("model.norm.weight")
        if not config.tie_word_embeddings:
            names.append("lm_head.weight")
        return names

    def missing_weights(self) -> list[str]:
        """Expected tensors that :meth:`load_weight` has not received."""
        return [name for name in self.expected_weights() if name not in self._loaded]

    def _experts_target(self, name: str) -> tuple[torch.Tensor, tuple[str, ...]] | None:
        """A mixture-of-experts layer's tensor of that name, and the names it stands for
        (:meth:`SparseMoE.target <twostroke.engine.models.experts.SparseMoE.target>`), or
        ``None`` where the name is not a mixture's."""
        mixture = self._mixture(name)
        if mixture is None:
            return None
        mlp, prefix, rest = mixture
        found: tuple[torch.Tensor, tuple[str, ...]] | None = mlp.target(rest)
        if found is None:
            return None
        return found[0], tuple(prefix + part for part in found[1])

    def _mixture(self, name: str) -> tuple[SparseMoE, str, str] | None:
        """The mixture-of-experts layer a tensor name is under, the name's prefix up to
        ``mlp.`` and the rest, or ``None`` where it is not a mixture's."""
        match = _EXPERTS_TENSOR.fullmatch(name)
        if match is None or int(match.group(1)) >= len(self.layers):
            return None
        mlp = self.layers[int(match.group(1))].mlp
        if not isinstance(mlp, SparseMoE):
            return None
        return mlp, f"model.layers.{match.group(1)}.mlp.", match.group(2)

    def _target(self, name: str) -> torch.Tensor | None:
        if name == "model.embed_tokens.weight":
            return self.embed_tokens
        if name == "model.norm.weight":
            return self.norm.weight
        if name == "lm_head.weight":
            return self.lm_head.weight  # None where tied
        match = _LAYER_TENSOR.fullmatch(name)
        if match is None:
            return None
        index, block, proj, kind = match.groups()
        if int(index) >= len(self.layers):
            return None
        layer = self.layers[int(index)]
        if block == "mlp" and isinstance(layer.mlp, SparseMoE):
            return None  # a mixture's names are its own: _experts_target
        norm = proj if block is None else f"{block}.{proj}"  # a layer's or a block's norm
        if block is None or norm in self.names.norms:
            return (
                layer.get_parameter(f"{norm}.weight")
                if norm in self.names.norms and kind == "weight"
                else None
            )
        fused = self.names.fused.get((block, proj))
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


def _exact_in_float16(linear: Linear) -> bool:
    """Whether a full-precision projection's weight (and bias) are float16 values: a GGUF
    file's F16 matrix, or a BF16 one whose values float16 holds (its exponents in float16's
    normal range: then its 8 significant bits fit float16's 11)."""
    method = linear.method
    if not isinstance(method, FullPrecision) or method.weight.dtype != torch.float32:
        return False
    tensors = [method.weight] if method.bias is None else [method.weight, method.bias]
    return all(
        bool(torch.equal(tensor.to(torch.float16).to(torch.float32), tensor)) for tensor in tensors
    )


def _stack_weight(linear: Linear, projection: StackProjection) -> StackWeight | None:
    """A projection's weight laid out for the stack's ``projection`` (the bfloat16 panels,
    or GGUF blocks), or ``None`` where it is in another form."""
    method = linear.method
    if isinstance(method, SplitByRows):
        method = method.few  # (the stack runs steps of no more rows than it takes)
    if isinstance(method, PanelWeight | BlockWeight) and method.kernel is projection:
        return method
    return None
