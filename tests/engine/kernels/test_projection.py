"""The compiled bfloat16 projection: its products against torch's, its refusals, and which
models take it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.models.test_llama import _config, make_tiny_model, random_sequences
from twostroke.engine.kernels import projection
from twostroke.engine.kernels.build import NATIVE_ENV, NativeBuildError
from twostroke.engine.kernels.projection import (
    ProjectionKernel,
    ProjectionUnsupported,
    build_projection,
    projection_kernel,
)
from twostroke.engine.models import choice, decoder
from twostroke.engine.models.choice import AMX_PANEL_ROWS, CpuKernels, Projections, select_kernels
from twostroke.engine.models.forms import PanelWeight, SplitByRows, can_pack
from twostroke.engine.models.glue import CompiledGlue
from twostroke.engine.models.linear import Linear
from twostroke.engine.models.llama import LlamaForCausalLM
from twostroke.engine.models.loading import open_model
from twostroke.gpu.isa import ISA_ENV, RUNGS, cpu_personality, machine_rung

# isa: make test runs it again under each lower CPU personality (twostroke.gpu.isa).
pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("one_torch_thread")]

CPU = torch.device("cpu")

#: Largest difference from a float32 product of the same bfloat16 inputs, relative to the
#: largest output: one rounding of the output to bfloat16, float32 sums in another order.
TOLERANCE = 8e-3


@pytest.fixture(scope="module")
def kernel() -> ProjectionKernel:
    try:
        return build_projection()
    except ProjectionUnsupported as error:
        pytest.skip(str(error))


@pytest.fixture
def fresh_kernel() -> Iterator[None]:
    """Forget the kernel this process built, before and after."""
    projection._kernel.cache_clear()
    yield
    projection._kernel.cache_clear()


def assert_close_to_float32_product(
    got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    expected = x.float() @ weight.float().T
    if bias is not None:
        expected = expected + bias.float()
    assert got.dtype == torch.bfloat16
    assert got.shape == expected.shape
    if expected.numel():
        scale = float(expected.abs().max())
        assert float((got.float() - expected).abs().max()) <= TOLERANCE * scale


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 41),  # every tile height, several tiles, none
    out_features=st.integers(1, 160),  # whole and partial panels of 48
    pairs=st.integers(1, 70),
    with_bias=st.booleans(),
    row_gap=st.integers(0, 5),  # rows of x further apart than its width
    seed=st.integers(0, 2**16),
)
def test_products_are_torchs_to_bfloat16_rounding(
    kernel: ProjectionKernel,
    rows: int,
    out_features: int,
    pairs: int,
    with_bias: bool,
    row_gap: int,
    seed: int,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    in_features = 2 * pairs
    wide = torch.randn(rows, in_features + row_gap, generator=generator).to(torch.bfloat16)
    x = wide[:, row_gap:]
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=generator).to(torch.bfloat16) if with_bias else None
    got = PanelWeight.pack(kernel, weight, bias)(x)
    assert_close_to_float32_product(got, x, weight, bias)
    if rows:  # F.linear rounds the same sums once too: the two differ by those roundings
        expected = F.linear(x, weight, bias).float()
        scale = float(expected.abs().max())
        assert float((got.float() - expected).abs().max()) <= 2 * TOLERANCE * scale


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 41),  # one row tile, a part of one, several and a part
    out_features=st.integers(1, 160),
    steps=st.integers(1, 5),  # inputs a whole number of an AMX tile's 32
    with_bias=st.booleans(),
    row_gap=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_products_of_whole_tiles_of_inputs_are_torchs_to_bfloat16_rounding(
    kernel: ProjectionKernel,
    rows: int,
    out_features: int,
    steps: int,
    with_bias: bool,
    row_gap: int,
    seed: int,
) -> None:
    """The widths the AMX tiles take (where :attr:`ProjectionKernel.tiles`; the vector tiles
    elsewhere, and for fewer rows than the tiles start at)."""
    generator = torch.Generator().manual_seed(seed)
    in_features = 32 * steps
    wide = torch.randn(rows, in_features + row_gap, generator=generator).to(torch.bfloat16)
    x = wide[:, row_gap:]
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=generator).to(torch.bfloat16) if with_bias else None
    assert_close_to_float32_product(PanelWeight.pack(kernel, weight, bias)(x), x, weight, bias)


def test_amx_tiles_are_taken_where_the_cpu_has_them_and_nothing_caps_it(
    kernel: ProjectionKernel,
) -> None:
    """Every personality's rung compiles without AMX (``-march=x86-64-v4`` and flags below
    it); uncapped, GCC and clang target it with ``-march=native`` where the CPU has it."""
    assert kernel.tiles == cpu_personality().amx


def test_the_thread_team_splits_the_panels_to_the_same_products(kernel: ProjectionKernel) -> None:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(961, 576, generator=generator).to(torch.bfloat16)
    packed = PanelWeight.pack(kernel, weight)
    for rows in (1, 70):  # the vector tiles; the AMX tiles where they run
        x = torch.randn(rows, 576, generator=generator).to(torch.bfloat16)
        alone = packed(x)
        previous = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            together = packed(x)
        finally:
            torch.set_num_threads(previous)
        assert torch.equal(alone, together)  # each output is one tile's sums, whoever sums it
        assert_close_to_float32_product(together, x, weight, None)


@pytest.mark.parametrize("width", [64, 70])  # whole AMX tiles of inputs (where they run); not
def test_a_rows_products_do_not_depend_on_the_rows_beside_it(
    kernel: ProjectionKernel, width: int
) -> None:
    """Bit for bit, alone or among any number of rows: greedy tokens must not change with
    the batch (speculative decoding verifies drafts in rows a plain decode does not have)."""
    generator = torch.Generator().manual_seed(9)
    weight = torch.randn(2 * kernel.panel + 5, width, generator=generator).to(torch.bfloat16)
    bias = torch.randn(2 * kernel.panel + 5, generator=generator)
    packed = PanelWeight.pack(kernel, weight, bias)
    x = torch.randn(37, width, generator=generator).to(torch.bfloat16)
    alone = torch.cat([packed(x[r : r + 1]) for r in range(len(x))])
    for rows in (2, 4, 5, 8, 9, 16, 17, 37):
        assert torch.equal(packed(x[:rows]), alone[:rows])
    assert packed(x[:0]).shape == (0, 2 * kernel.panel + 5)  # no tile of no rows


def test_rows_read_back_from_the_panels_are_the_weights_rows(kernel: ProjectionKernel) -> None:
    """A tied embedding's lookup: every row, a whole panel's and the last partial one's,
    exactly, in the ids' shape."""
    generator = torch.Generator().manual_seed(8)
    for out_features in (2 * kernel.panel, 2 * kernel.panel + 7):  # no padding; padding
        weight = torch.randn(out_features, 10, generator=generator).to(torch.bfloat16)
        packed = PanelWeight.pack(kernel, weight)
        every = torch.arange(out_features)
        assert torch.equal(packed.rows(every), weight)
        ids = torch.randint(0, out_features, (3, 5), generator=generator)
        got = packed.rows(ids)
        assert got.shape == (3, 5, 10)
        assert torch.equal(got, weight[ids])


def test_inputs_with_more_dimensions_keep_them(kernel: ProjectionKernel) -> None:
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 10, generator=generator).to(torch.bfloat16)
    weight = torch.randn(7, 10, generator=generator).to(torch.bfloat16)
    got = PanelWeight.pack(kernel, weight)(x)
    assert got.shape == (2, 3, 7)
    assert_close_to_float32_product(got.view(6, 7), x.reshape(6, 10), weight, None)
    transposed = x.transpose(0, 1)  # not contiguous: copied first
    assert torch.equal(PanelWeight.pack(kernel, weight)(transposed), got.transpose(0, 1))


def test_what_it_was_not_built_for_is_refused(kernel: ProjectionKernel) -> None:
    bf16 = torch.zeros(4, 6, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"packs a bfloat16 weight .* got torch\.float32"):
        PanelWeight.pack(kernel, torch.zeros(4, 6))
    with pytest.raises(ValueError, match=r"got torch\.bfloat16 \(4, 6\) on meta"):
        PanelWeight.pack(kernel, torch.zeros(4, 6, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ValueError, match=r"in_features even; got torch\.bfloat16 \(4, 5\)"):
        PanelWeight.pack(kernel, torch.zeros(4, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"bias must be \[4\], got \(3,\)"):
        PanelWeight.pack(kernel, bf16, torch.zeros(3))
    packed = PanelWeight.pack(kernel, bf16)
    with pytest.raises(
        ValueError, match=r"takes bfloat16 \[\.\.\., 6\] on the CPU; got torch\.float32"
    ):
        packed(torch.zeros(2, 6))
    with pytest.raises(ValueError, match=r"got torch\.bfloat16 \(2, 8\)"):
        packed(torch.zeros(2, 8, dtype=torch.bfloat16))


def test_panels_packed_into_a_given_buffer_are_the_same(kernel: ProjectionKernel) -> None:
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(100, 64, generator=generator).to(torch.bfloat16)
    bias = torch.randn(100, generator=generator)
    size = kernel.packed_size(100, 64)
    assert size == -(-100 // kernel.panel) * kernel.panel * 64
    buffer = torch.full((size + 3,), float("nan"), dtype=torch.bfloat16)
    packed = PanelWeight.pack(kernel, weight, bias, into=buffer[3:])
    assert packed.panels.data_ptr() == buffer[3:].data_ptr()
    alone = PanelWeight.pack(kernel, weight, bias)
    assert torch.equal(packed.panels, alone.panels)
    x = torch.randn(5, 64, generator=generator).to(torch.bfloat16)
    assert torch.equal(packed(x), alone(x))
    for wrong in (buffer[4:], buffer[3:].float(), torch.empty(2 * size, dtype=torch.bfloat16)[::2]):
        with pytest.raises(
            ValueError, match=rf"into must be a contiguous bfloat16 CPU tensor of {size} elements"
        ):
            PanelWeight.pack(kernel, weight, bias, into=wrong)


def test_a_build_that_disagrees_with_torch_is_refused(
    kernel: ProjectionKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(projection, "_TOLERANCE", -1.0)  # nothing passes
    with pytest.raises(NativeBuildError, match=r"check differs from torch by .* allowed"):
        build_projection()


@pytest.mark.usefixtures("fresh_kernel")
def test_built_for_a_cpu_without_avx512_bf16_it_says_so_and_oneDNN_stays(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Built under the highest personality below ``avx512_bf16`` that this CPU runs, the
    kernel says it cannot run, and the decoder takes what the packing policy gives it
    (oneDNN's packing where oneDNN packs bfloat16, which it does only with AVX-512)."""
    below = [rung for rung in RUNGS if not rung.bf16 and rung.rank <= machine_rung().rank]
    monkeypatch.setenv(ISA_ENV, below[-1].name)
    with pytest.raises(ProjectionUnsupported, match="no AVX512-BF16"):
        build_projection()
    with caplog.at_level(logging.INFO, logger=projection.__name__):
        assert projection_kernel() is None
    said = [r for r in caplog.records if r.name == projection.__name__]
    assert [r.levelno for r in said] == [logging.INFO]
    assert "stay oneDNN's: this CPU has no AVX512-BF16" in said[0].getMessage()
    form = "onednn" if can_pack(torch.bfloat16, CPU, exact=False) else "dense"
    assert chosen(exact=False).projection == Projections(form, form)  # never the panels


@pytest.mark.usefixtures("fresh_kernel")
def test_where_the_build_fails_oneDNN_stays_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger=projection.__name__):
        assert projection_kernel() is None
        assert projection_kernel() is None
    said = [r for r in caplog.records if r.name == projection.__name__]
    assert len(said) == 1  # once per process
    assert said[0].levelno == logging.WARNING
    assert "/nonexistent/cc" in said[0].getMessage()
    assert "stay oneDNN's" in said[0].getMessage()


def chosen(dtype: torch.dtype = torch.bfloat16, *, exact: bool, **overrides: Any) -> CpuKernels:
    """The kernels chosen for the tiny model's shape (the attention is given, not built)."""
    config = _config(**overrides)
    return select_kernels(config, dtype=dtype, device=CPU, exact=exact, attention="bag")


@pytest.fixture(params=[False, True], ids=["no-amx", "amx"])
def amx(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether oneDNN's bfloat16 products run on AMX tiles, as the selection sees it."""
    has: bool = request.param
    personality = attrs.evolve(cpu_personality(), capped=False, x86=True, amx_tiles=has)
    monkeypatch.setattr(choice, "cpu_personality", lambda: personality)
    return has


@pytest.fixture(params=[False, True], ids=["vector-tiles", "amx-tiles"])
def tiles(
    request: pytest.FixtureRequest, kernel: ProjectionKernel, monkeypatch: pytest.MonkeyPatch
) -> bool:
    """Whether the compiled kernel multiplies many rows on AMX tiles, as the selection sees
    it (its products stay the real kernel's: only the decision is at stake)."""
    has: bool = request.param
    monkeypatch.setattr(choice, "projection_kernel", lambda: attrs.evolve(kernel, tiles=has))
    return has


def test_which_decoders_take_the_kernel(
    kernel: ProjectionKernel, monkeypatch: pytest.MonkeyPatch, amx: bool, tiles: bool
) -> None:
    projection._kernel.cache_clear()
    taken = chosen(exact=False)
    # Where oneDNN runs on AMX tiles and the kernel does not (a compiler without them), its
    # packed products take more than AMX_PANEL_ROWS; the kernel's own tiles take them all.
    split = amx and not tiles and can_pack(torch.bfloat16, CPU, exact=False)
    rows = AMX_PANEL_ROWS if split else None
    assert taken.projection == Projections(
        "panels", "panels", attrs.evolve(kernel, tiles=tiles), panel_rows=rows
    )
    model = LlamaForCausalLM(_config(), dtype=torch.bfloat16, device=CPU)
    for parameter in model.parameters():
        parameter.data.normal_()
    released: list[int] = []
    monkeypatch.setattr(decoder, "release_free_memory", lambda: released.append(1) or True)
    model.use_kernels(taken)
    assert released  # the dense weights the conversion dropped go back to the OS
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears
    methods = [m.method for m in linears]
    if split:
        assert all(isinstance(m, SplitByRows) and m.most_rows == rows for m in methods)
        method = methods[0]
        assert isinstance(method, SplitByRows)
        width = method.few.in_features
        for count in (1, AMX_PANEL_ROWS, AMX_PANEL_ROWS + 1, 40):
            x = torch.randn(count, width).bfloat16()
            used = method.few if count <= AMX_PANEL_ROWS else method.many
            assert torch.equal(method(x), used(x))
        methods = [m.few for m in methods if isinstance(m, SplitByRows)]
    assert all(isinstance(m, PanelWeight) for m in methods)
    # One copy of each weight: the dense ones are dropped (the tied projection's is the
    # embedding's, which lookups read).
    assert all(m.weight is None or m.weight.numel() == 0 for m in linears)
    assert isinstance(model.lm_head.method, SplitByRows if split else PanelWeight)
    # oneDNN's (F.linear's bits) where exact, for float32, for an odd input width (the
    # kernel reads inputs in pairs: down_proj's here) and with TWOSTROKE_NATIVE=0.
    assert chosen(exact=True).projection.layers != "panels"
    assert chosen(torch.float32, exact=False).projection.layers != "panels"
    assert chosen(exact=False, intermediate_size=15).projection.layers != "panels"
    monkeypatch.setenv(NATIVE_ENV, "0")
    assert chosen(exact=False).projection.layers != "panels"


@pytest.mark.parametrize(
    ("kind", "tied"),
    [("llama", False), ("llama", True), ("qwen2", False)],  # qwen2: q/k/v biases
)
def test_a_decoder_on_the_kernel_computes_what_oneDNNs_does_to_rounding(
    kernel: ProjectionKernel, kind: str, tied: bool, tmp_path: Path
) -> None:
    """Through prefill chunks and decodes, the output projection (tied or not) included."""
    make_tiny_model(kind, tmp_path, seed=11, tie_word_embeddings=tied)
    ours = open_model(tmp_path, dtype=torch.bfloat16, device=CPU, exact=False)
    # The same compiled glue, F.linear's products (oneDNN's in bfloat16): only the
    # projections differ.
    theirs = open_model(tmp_path, dtype=torch.bfloat16, device=CPU, exact=False, pack_weights=False)
    assert ours.module.kernels.projection.layers == "panels"
    assert theirs.module.kernels.projection.layers == "dense"
    if tied and isinstance(ours.module.lm_head.method, PanelWeight):
        # One copy of the tied matrix: the lookups read the head's panels.
        assert ours.module.embed_tokens.numel() == 0
    assert isinstance(theirs.module.kernels.glue, CompiledGlue)
    sequences = random_sequences([1, 6, 29], seed=12)
    got = ours.module.forward_logits(sequences, chunk_size=5)
    expected = theirs.module.forward_logits(sequences, chunk_size=5)
    for mine, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, reference, rtol=5e-2, atol=5e-2)
