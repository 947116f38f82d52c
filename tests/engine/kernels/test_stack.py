"""The compiled decoder stack: the per-layer path's logits bit for bit, which steps it runs,
which models get it, and its refusals."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import torch
from attrs import evolve as attrs_evolve
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.checkpoints.test_blocks import write
from tests.engine.kernels.emulated_projection import emulated_projection
from tests.engine.models.test_llama import make_tiny_model, random_sequences
from twostroke.engine.attention.kernels import AttentionKernel
from twostroke.engine.attention.metadata import AttentionMetadata, ChunkSpec
from twostroke.engine.kernels import build, stack
from twostroke.engine.kernels import projection as projection_module
from twostroke.engine.kernels.build import NativeBuildError
from twostroke.engine.kernels.gguf_blocks import DENSE_ROWS
from twostroke.engine.kernels.glue import decoder_glue
from twostroke.engine.kernels.projection import (
    ProjectionKernel,
    ProjectionUnsupported,
    build_projection,
    projection_kernel,
)
from twostroke.engine.kernels.stack import StackLayer, load_stack
from twostroke.engine.models import decoder_layer
from twostroke.engine.models.forms import (
    BlockEmbedding,
    BlockWeight,
    FullPrecision,
    PanelWeight,
    SplitByRows,
)
from twostroke.engine.models.glue import CompiledGlue
from twostroke.engine.models.linear import Linear
from twostroke.engine.models.llama import LlamaForCausalLM
from twostroke.engine.models.loading import open_model
from twostroke.engine.models.quantization import kernel_available
from twostroke.engine.models.stack import DecoderStack, build_stack

# isa: make test runs it again under each lower CPU personality (twostroke.gpu.isa).
pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("one_torch_thread")]

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def projection() -> Iterator[ProjectionKernel]:
    """The process's kernel, which models pack for: the compiled one, or where the CPU has no
    AVX512-BF16 its emulation (tests/engine/kernels/emulated_projection.py), so that the
    stack's paths run on every CPU."""
    try:
        build_projection()  # (raises why there is none)
    except ProjectionUnsupported:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(projection_module, "_kernel", emulated_projection)
            yield emulated_projection()
        return
    kernel = projection_kernel()
    assert kernel is not None
    yield kernel


@pytest.fixture(scope="module")
def models(
    projection: ProjectionKernel, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, LlamaForCausalLM]:
    """Tiny decoders on the compiled kernels, by kind: llama (tied output projection), qwen2
    (q/k/v biases, untied) and qwen3 (per-head q/k norms) in bfloat16 with the bfloat16
    projections; and in float32
    with their projections in GGUF blocks, over the engine's KV cache ("auto": float16
    where the personality converts it in one instruction) and a float32 one."""
    found = {}
    for kind, tied in (("llama", True), ("qwen2", False), ("qwen3", True)):
        folder = tmp_path_factory.mktemp(kind)
        make_tiny_model(kind, folder, seed=5, tie_word_embeddings=tied)
        module = open_model(folder, dtype=torch.bfloat16, device=CPU, exact=False).module
        assert module.stack is not None
        found[kind] = module
        for blocks, cache in (("q8_0", "auto"), ("q4_0", torch.float32)):
            module = open_model(
                folder,
                dtype=torch.float32,
                device=CPU,
                exact=False,
                quantization=blocks,
                kv_cache_dtype=cache,
            ).module
            assert module.kernels.projection.layers == "blocks"
            assert module.stack is not None
            assert module.stack.cache_dtype == module.cache_dtype
            found[f"{kind}-{blocks}"] = module
    # A GGUF file's Q4_1 blocks as stored, by the float32 activations themselves.
    folder = tmp_path_factory.mktemp("gguf")
    file = write(folder, Q.Q4_1, Q.Q8_0, seed=5, tie_word_embeddings=True)
    loaded = open_model(file, dtype=torch.float32, device=CPU, exact=False, quantization="gguf_f32")
    assert loaded.module.stack is not None
    found["llama-gguf_f32"] = loaded.module
    return found


def layer_by_layer(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The same model without its stack (shares the weights)."""
    twin = LlamaForCausalLM.__new__(LlamaForCausalLM)
    twin.__dict__.update(model.__dict__)
    twin._stack = None
    return twin


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(
        [
            "llama",
            "qwen2",
            "llama-q8_0",
            "qwen2-q8_0",
            "llama-q4_0",
            "qwen2-q4_0",
            "llama-gguf_f32",
            "qwen3",
            "qwen3-q8_0",
            "qwen3-q4_0",
        ]
    ),
    lengths=st.lists(st.integers(1, 23), min_size=1, max_size=4),
    chunk=st.sampled_from([None, 1, 3, 8]),
    block_size=st.sampled_from([4, 16]),
)
def test_logits_are_the_per_layer_paths_bit_for_bit(
    models: dict[str, LlamaForCausalLM],
    kind: str,
    lengths: list[int],
    chunk: int | None,
    block_size: int,
) -> None:
    """Through prefills, chunks with history, decodes among them and decodes alone, in
    partially filled blocks of tables that interleave the sequences' blocks."""
    model = models[kind]
    sequences = random_sequences(lengths, seed=sum(lengths))
    expected = layer_by_layer(model).forward_logits(  # (builds the attention first)
        sequences, chunk_size=chunk, block_size=block_size, kernel="native"
    )
    with build.timed() as timer:
        got = model.forward_logits(
            sequences, chunk_size=chunk, block_size=block_size, kernel="native"
        )
    for mine, reference in zip(got, expected, strict=True):
        assert torch.equal(mine, reference)
    steps = -(-max(lengths) // (chunk or max(lengths)))
    # The stack, the final norm and the output projection where it is compiled (the blocks
    # quantized at load leave it in float32, torch's), and the embedding's lookup where it
    # reads a file's blocks (a tied head's panels are read by torch's indexing).
    head = isinstance(model.lm_head.method, PanelWeight | BlockWeight | SplitByRows)
    embedding = isinstance(model._embedding, BlockEmbedding)
    most = model.stack.most_tokens if model.stack is not None else None
    if most is None or sum(lengths) <= most:  # (a larger step runs layer by layer)
        assert timer.calls == (2 + head + embedding) * steps


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-q8_0"])
def test_qwen3s_heads_norms_run_inside_the_stack(
    models: dict[str, LlamaForCausalLM], kind: str
) -> None:
    """Qwen3's per-head q/k norms are the stack's, with the per-layer path's results bit for
    bit: one call a step, not each layer's."""
    model = models[kind]
    layers = layers_of(model)
    assert all(layer.q_norm is not None and layer.k_norm is not None for layer in layers)
    assert layers[0].qk_eps == model.config.rms_norm_eps
    sequences = random_sequences([7, 12], seed=9)
    expected = layer_by_layer(model).forward_logits(sequences, chunk_size=5, kernel="native")
    with build.timed() as timer:
        got = model.forward_logits(sequences, chunk_size=5, kernel="native")
    for mine, reference in zip(got, expected, strict=True):
        assert torch.equal(mine, reference)
    head = isinstance(model.lm_head.method, PanelWeight | BlockWeight | SplitByRows)
    assert timer.calls == (2 + head) * 3  # three steps of at most five tokens a sequence


def test_a_block_models_steps_of_many_tokens_run_layer_by_layer(
    models: dict[str, LlamaForCausalLM],
) -> None:
    """From DENSE_ROWS tokens on, the blocks' products are torch's GEMM of the dequantized
    weights, which the stack does not call: such a step runs layer by layer, and a smaller
    one through the stack."""
    model = models["qwen2-q8_0"]
    compiled = model.stack
    assert compiled is not None
    assert compiled.most_tokens == DENSE_ROWS - 1
    for length, stacked in ((DENSE_ROWS - 1, True), (DENSE_ROWS + 5, False)):
        sequences = random_sequences([length], seed=length)
        expected = layer_by_layer(model).forward_logits(sequences, kernel="native")
        with build.timed() as timer:
            got = model.forward_logits(sequences, kernel="native")
        assert torch.equal(got[0], expected[0])
        assert (timer.calls == 2) == stacked  # the stack and the final norm, or each layer's


def test_steps_of_another_attention_kernel_run_layer_by_layer(
    models: dict[str, LlamaForCausalLM],
) -> None:
    """The "bag" kernel's decodes and torch's prefills are not the compiled attention's."""
    model = models["llama"]
    sequences = random_sequences([5, 9], seed=3)
    with build.timed() as timer:
        got = model.forward_logits(sequences, chunk_size=4, kernel="bag")
    expected = layer_by_layer(model).forward_logits(sequences, chunk_size=4, kernel="bag")
    for mine, reference in zip(got, expected, strict=True):
        assert torch.equal(mine, reference)
    layers = model.config.num_layers
    assert timer.calls > 3 * layers  # each layer's norms, projections and SiLU, one by one


def step_of(
    model: LlamaForCausalLM, kernel: AttentionKernel
) -> tuple[AttentionMetadata, torch.Tensor]:
    """One prefill of three tokens, in blocks of 4: its metadata and rotary tables."""
    metadata = AttentionMetadata.build(
        [ChunkSpec(0, 3, (0,))],
        block_size=4,
        num_blocks=2,
        num_kv_heads=model.config.num_kv_heads,
        dtype=model.dtype,
        device=CPU,
        num_heads=model.config.num_heads,
        head_dim=model.config.head_dim,
        kernel=model.attention_for(4, kernel),
    )
    return metadata, torch.zeros(3, 1, model.config.head_dim, dtype=model.dtype)


def test_what_it_was_not_built_for_is_refused(models: dict[str, LlamaForCausalLM]) -> None:
    model = models["llama"]
    compiled = model.stack
    assert compiled is not None
    cache = model.allocate_kv_cache(2, 4)
    hidden = model.config.hidden_size
    metadata, table = step_of(model, "native")
    assert compiled.runs(metadata)
    residual = torch.zeros(3, hidden, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"got residual torch\.float32 \(3, 64\)"):
        compiled(residual.float(), table, table, metadata, cache)
    with pytest.raises(ValueError, match=r"cos torch\.bfloat16 \(2, 1, 16\)"):
        compiled(residual, table[:2], table, metadata, cache)
    with pytest.raises(ValueError, match=r"cache \(3, 2, 2, 2, 4, 16\) in torch\.float32"):
        compiled(residual, table, table, metadata, cache.__class__(cache.data.float()))
    bag, _ = step_of(model, "bag")
    assert not compiled.runs(bag)
    with pytest.raises(ValueError, match="calls the compiled attention for this model's"):
        compiled(residual, table, table, bag, cache)
    other_blocks = model.allocate_kv_cache(1, 8)  # the kernel was built for blocks of 4
    with pytest.raises(ValueError, match="and the cache's blocks only"):
        compiled(residual, table, table, metadata, other_blocks)
    assert torch.equal(residual, torch.zeros_like(residual))  # nothing ran


def layers_of(model: LlamaForCausalLM) -> list[StackLayer]:
    compiled = model.stack
    assert compiled is not None
    layers = compiled._kept[1]  # what it was built from
    assert isinstance(layers, tuple)
    return list(layers)


def test_layers_that_do_not_fit_are_refused(
    models: dict[str, LlamaForCausalLM], projection: ProjectionKernel
) -> None:
    model = models["llama"]
    config = model.config
    layers = layers_of(model)
    chosen = model.kernels.glue
    assert isinstance(chosen, CompiledGlue)
    glue = chosen.library
    function = load_stack()
    shape = {
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "intermediate": config.intermediate_size,
    }
    assert isinstance(
        build_stack(layers, function=function, glue=glue, projection=projection, **shape),
        DecoderStack,
    )
    with pytest.raises(ValueError, match="at least one layer"):
        build_stack([], function=function, glue=glue, projection=projection, **shape)
    float32 = decoder_glue(hidden=glue.hidden, head_dim=glue.head_dim, dtype=torch.float32)
    assert float32 is not None
    with pytest.raises(ValueError, match=r"the glue is torch\.float32"):
        build_stack(layers, function=function, glue=float32, projection=projection, **shape)
    wider = {**shape, "intermediate": 2 * config.intermediate_size}
    with pytest.raises(
        ValueError, match=r"layer 0's gate_up projection maps 64 -> 256; .* 64 -> 512"
    ):
        build_stack(layers, function=function, glue=glue, projection=projection, **wider)
    other = ProjectionKernel(projection.panel, projection.path, function=projection._function)
    with pytest.raises(ValueError, match="layer 0's qkv projection is laid out for another kernel"):
        build_stack(layers, function=function, glue=glue, projection=other, **shape)
    loose = [attrs_evolve(layers[0], post_norm=layers[0].post_norm.float()), *layers[1:]]
    with pytest.raises(
        ValueError, match=r"layer 0's norm weights must be contiguous torch\.bfloat16 \[64\]"
    ):
        build_stack(loose, function=function, glue=glue, projection=projection, **shape)
    heads = torch.ones(glue.head_dim + 1, dtype=torch.bfloat16)
    wrong = [attrs_evolve(layers[0], q_norm=heads, k_norm=heads), *layers[1:]]
    with pytest.raises(
        ValueError,
        match=r"layer 0's heads' norm weights must be contiguous torch\.bfloat16 \[16\]; "
        r"got torch\.bfloat16 \(17,\)",
    ):
        build_stack(wrong, function=function, glue=glue, projection=projection, **shape)
    with pytest.raises(ValueError, match="the heads' norms come as a pair"):
        attrs_evolve(layers[0], q_norm=heads[:16])


def test_a_block_models_stack_is_built_for_float32_and_refuses_what_does_not_fit(
    models: dict[str, LlamaForCausalLM],
) -> None:
    """The blocks' stack takes float32 activations over the model's cache, and its builder
    holds the blocks to their kernel and the glue to their dtype."""
    model = models["qwen2-q8_0"]
    compiled = model.stack
    assert compiled is not None
    assert compiled.dtype == torch.float32
    blocks = model.kernels.projection.blocks
    assert blocks is not None
    layers = layers_of(model)
    chosen = model.kernels.glue
    assert isinstance(chosen, CompiledGlue)
    glue = chosen.library
    config = model.config
    shape = {
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "intermediate": config.intermediate_size,
    }
    function = stack.stack_library(torch.float32)
    assert function is not None
    bfloat16 = decoder_glue(hidden=glue.hidden, head_dim=glue.head_dim, dtype=torch.bfloat16)
    assert bfloat16 is not None
    with pytest.raises(ValueError, match=r"take torch\.float32 activations; the glue is"):
        build_stack(layers, function=function, glue=bfloat16, projection=blocks, **shape)
    bf16_layers = layers_of(models["qwen2"])
    with pytest.raises(ValueError, match="layer 0's qkv projection is laid out for another"):
        build_stack(bf16_layers, function=function, glue=glue, projection=blocks, **shape)
    cache = model.allocate_kv_cache(2, 4)
    metadata, table = step_of(model, "native")
    assert compiled.runs(metadata)
    residual = torch.zeros(3, config.hidden_size)
    other = torch.float32 if model.cache_dtype != torch.float32 else torch.float16
    with pytest.raises(ValueError, match=f"a {model.cache_dtype} cache of"):
        compiled(residual, table, table, metadata, cache.__class__(cache.data.to(other)))
    with pytest.raises(ValueError, match="a native kernel takes float32 or bfloat16"):
        stack.stack_library(torch.float64)


def test_a_block_model_with_a_projection_in_another_form_has_no_stack(
    models: dict[str, LlamaForCausalLM],
) -> None:
    """A GGUF file may hold a matrix in 16 bits among its blocks: that projection keeps its
    own form, and the model runs its layers one by one (no stack is bound)."""
    model = models["llama-q8_0"]
    down = cast(Linear, model.layers[0].get_submodule("mlp.down_proj"))
    original = down.method
    assert model._bind_stack(model.kernels) is not None
    try:
        down.method = FullPrecision(torch.zeros(down.out_features, down.in_features), None)
        assert model._bind_stack(model.kernels) is None
    finally:
        down.method = original


def test_where_the_library_does_not_build_the_layers_run_one_by_one_with_one_warning(
    models: dict[str, LlamaForCausalLM],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    make_tiny_model("llama", tmp_path, seed=5, tie_word_embeddings=True)  # models["llama"]
    sequences = random_sequences([4, 7], seed=8)
    # First, while a compiler is there: this builds the attention kernel the model without a
    # stack also calls (it relied on an earlier test of this module having built it, and
    # failed where pytest-xdist ran it first in its worker).
    expected = models["llama"].forward_logits(sequences, chunk_size=3, kernel="native")
    stack._library.cache_clear()
    monkeypatch.setenv("CC", "/nonexistent/cc")
    try:
        with pytest.raises(NativeBuildError, match="/nonexistent/cc"):
            load_stack()
        with caplog.at_level(logging.WARNING, logger=stack.__name__):
            first = open_model(tmp_path, dtype=torch.bfloat16, device=CPU, exact=False).module
            second = open_model(tmp_path, dtype=torch.bfloat16, device=CPU, exact=False).module
    finally:
        stack._library.cache_clear()
    assert first.kernels.projection.layers == "panels"
    assert isinstance(first.kernels.glue, CompiledGlue)
    assert first.kernels.stack is None
    assert first.stack is None
    assert second.stack is None
    said = [r for r in caplog.records if r.name == stack.__name__]
    assert len(said) == 1  # once per process
    assert "called one by one" in said[0].getMessage()
    got = first.forward_logits(sequences, chunk_size=3, kernel="native")
    for mine, reference in zip(got, expected, strict=True):
        assert torch.equal(mine, reference)  # the same model, the same bits, the slow way


def test_a_model_with_quantized_projections_has_no_stack(tmp_path: Path) -> None:
    make_tiny_model("llama", tmp_path, seed=5)
    if not kernel_available("fp16", CPU):
        pytest.skip("no fp16 weight kernel in this torch")
    loaded = open_model(
        tmp_path, dtype=torch.bfloat16, device=CPU, exact=False, quantization="fp16"
    )
    assert loaded.module.kernels.projection.quantization == "fp16"
    assert isinstance(loaded.module.kernels.glue, CompiledGlue)
    assert loaded.module.stack is None


@pytest.mark.parametrize("window", [1, 3, 7])
def test_a_windowed_stack_is_the_per_layer_path_through_the_same_window(
    models: dict[str, LlamaForCausalLM],
    projection: ProjectionKernel,
    window: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each layer's sliding window (``StackLayer.window``) reaches the compiled attention:
    prefills, chunks with history and decodes through the stack give the per-layer path's
    logits with ``paged_attention(window=...)``, bit for bit, and differ from no window."""
    model = models["llama"]
    config = model.config
    chosen = model.kernels.glue
    assert isinstance(chosen, CompiledGlue)
    windowed = build_stack(
        [attrs_evolve(layer, window=window) for layer in layers_of(model)],
        function=load_stack(),
        glue=chosen.library,
        projection=projection,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        intermediate=config.intermediate_size,
    )
    twin = layer_by_layer(model)
    twin._stack = windowed
    sequences = random_sequences([9, 14], seed=window)
    with build.timed() as stacked:
        unwindowed = model.forward_logits(sequences, chunk_size=4, kernel="native")
    with build.timed() as timer:
        got = twin.forward_logits(sequences, chunk_size=4, kernel="native")
    assert timer.calls == stacked.calls  # through the stack: no layer ran in Python
    attend = decoder_layer.paged_attention
    monkeypatch.setattr(
        decoder_layer,
        "paged_attention",
        lambda *args, **options: attend(*args, **{**options, "window": window}),
    )
    expected = layer_by_layer(model).forward_logits(sequences, chunk_size=4, kernel="native")
    for mine, reference, whole in zip(got, expected, unwindowed, strict=True):
        assert torch.equal(mine, reference)
        assert not torch.equal(mine, whole)
    with pytest.raises(ValueError, match="'window' must be >= 1"):
        attrs_evolve(layers_of(model)[0], window=0)
