"""Batch invariance, part by part: every weight form the policy calls invariant gives a row
the same bits alone or among any number of rows on this run's CPU personality (`make test`
runs the module again under each lower rung), the policy names every part that is not, and
``deterministic=True`` takes the invariant arrangement or refuses with the reason.

The model-level property (SmolLM2's answers alone against answers in crowds, chunks,
preemption, drafts) is tests/engine/test_invariance.py's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.models.test_llama import _config
from twostroke.engine.checkpoints.gguf import BLOCK_TYPES, BlockTensor
from twostroke.engine.kernels.gguf_blocks import (
    ACTIVATIONS,
    DENSE_ROWS,
    BlockKernel,
    build_blocks,
    random_blocks,
)
from twostroke.engine.kernels.projection import projection_kernel
from twostroke.engine.models import choice
from twostroke.engine.models.choice import (
    DeterminismUnavailable,
    Projections,
    fp16_rows_dependent,
    row_dependences,
    select_kernels,
)
from twostroke.engine.models.forms import (
    BlockWeight,
    LinearMethod,
    OneDNNWeight,
    can_pack,
    weight_method,
)
from twostroke.engine.models.quantization import kernel_available
from twostroke.gpu.isa import cpu_personality
from twostroke.gpu.threads import torch_threads

# isa: make test runs it again under each lower CPU personality (twostroke.gpu.isa).
pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("one_torch_thread")]

CPU = torch.device("cpu")

#: Row counts a step may have: one, the small tiles' remainders, the panels' and tiles'
#: widths and one past them, the blocks' old dense threshold and past it, a long chunk.
ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 31, 33, DENSE_ROWS - 1, DENSE_ROWS, 130, 300)


def assert_rows_alone_or_among_others(method: LinearMethod, x: torch.Tensor) -> None:
    """Each row of ``x``'s product, among any leading number of rows, is its product alone,
    bit for bit, on one thread and on two."""
    with torch.inference_mode():
        alone = torch.cat([method(x[row : row + 1]) for row in range(len(x))])
        for threads in (1, 2):
            with torch_threads(threads):
                for rows in ROWS:
                    got = method(x[:rows])
                    assert torch.equal(got, alone[:rows]), f"{rows} rows, {threads} threads"


def forms_called_invariant() -> list[tuple[str, torch.dtype]]:
    """The full-precision and reduced forms this personality runs and the policy calls
    invariant (:func:`row_dependences` names none of them)."""
    forms: list[tuple[str, torch.dtype]] = [("dense", torch.bfloat16)]
    for dtype in (torch.float32, torch.bfloat16):
        if can_pack(dtype, CPU, exact=False):
            forms.append(("onednn", dtype))
    if kernel_available("fp16", CPU) and not fp16_rows_dependent():
        forms.append(("fp16", torch.float32))
    if projection_kernel() is not None:
        forms.append(("panels", torch.bfloat16))
    return forms


@pytest.mark.parametrize(("form", "dtype"), forms_called_invariant())
def test_a_form_the_policy_calls_invariant_is(form: str, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    # SmolLM2's gate/up shape: 576 inputs (a width the panels, oneDNN and fbgemm all take).
    weight = (torch.randn(1536, 576, generator=generator) * 0.05).to(dtype)
    x = torch.randn(max(ROWS), 576, generator=generator).to(dtype)
    kernel = projection_kernel() if form == "panels" else None
    method = weight_method(form, weight, None, kernel=kernel)  # type: ignore[arg-type]
    projection = Projections(form, form, kernel)  # type: ignore[arg-type]
    assert row_dependences(projection, "native", dtype) == ()
    assert_rows_alone_or_among_others(method, x)


def test_a_float32_onednn_product_of_one_row_is_computed_as_two() -> None:
    """oneDNN's one-row float32 path summed a row another way than its path for more on the
    portable rung (every one of SmolLM2's projections, packed on one thread): a lone row is
    multiplied beside itself, and its leading dimensions are kept."""
    if not can_pack(torch.float32, CPU, exact=False):
        pytest.skip("oneDNN's packed float32 products do not run here")
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(96, 64, generator=generator)
    bias = torch.randn(96, generator=generator)
    with torch_threads(1):
        method = OneDNNWeight.pack(weight, bias)
    assert method.one_row_apart
    if can_pack(torch.bfloat16, CPU, exact=False):
        assert not OneDNNWeight.pack(weight.bfloat16(), None).one_row_apart
    x = torch.randn(2, 64, generator=generator)
    with torch.inference_mode():
        single = method(x[:1].view(1, 1, 64))
        assert single.shape == (1, 1, 96)
        assert torch.equal(single.view(1, 96), method(x)[:1])
        torch.testing.assert_close(single.view(1, 96), x[:1] @ weight.T + bias)


@pytest.fixture(scope="module")
def blocks() -> BlockKernel:
    return build_blocks()


@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_blocks_block_by_block_are_invariant_at_every_row_count(
    blocks: BlockKernel, activations: str, type_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """:meth:`BlockKernel.block_by_block` never takes the dense path (whose float32 GEMM sums
    a row another way), and a row's product is the same in every tile of rows it falls in:
    the integer sums are exact, and the float ones are compiled without reassociation."""
    kernel = blocks.taking(activations).block_by_block()
    assert kernel.most_rows is None

    def refuse(*args: object) -> None:
        raise AssertionError("the dense path ran")

    monkeypatch.setattr(BlockKernel, "dense", refuse)
    generator = np.random.default_rng(7)
    block_type = BLOCK_TYPES[type_name]
    data = random_blocks(generator, block_type, 70, 512)
    weight = BlockWeight(kernel, (BlockTensor(type_name, block_type, data, None),))
    x = torch.from_numpy(generator.normal(0, 1, (max(ROWS), 512)).astype(np.float32))
    assert_rows_alone_or_among_others(weight, x)


def test_the_policy_names_each_part_that_depends_on_its_rows(blocks: BlockKernel) -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    assert row_dependences(Projections("onednn", "onednn"), "native", f32) == ()
    assert row_dependences(Projections("dense", "dense"), "native", bf16) == ()
    assert row_dependences(Projections("onednn", "onednn"), "bag", f32) == (
        "the attention is 'bag': decodes and prefill chunks are summed by other operators",
    )
    assert row_dependences(Projections("dense", "dense"), "native", f32) == (
        "the decoder's projections are MKL's float32 products (transformers' exact "
        "arithmetic, dtype='float32'), which sum a row another way as the rows change",
    )
    assert row_dependences(Projections("int8", "onednn"), "native", f32) == (
        "the decoder's projections are fbgemm's int8 products, which quantize a step's rows "
        "with one scale",
    )
    split = Projections("panels", "panels", panel_rows=8)
    assert row_dependences(split, "native", bf16) == (
        "the decoder's projections switch from the compiled panels to oneDNN's AMX products "
        "above 8 rows",
    )
    dense_rows = Projections("blocks", "blocks", blocks=blocks, sixteen="onednn")
    assert row_dependences(dense_rows, "native", f32) == (
        f"the decoder's projections switch from the GGUF blocks to a dense float32 product "
        f"from {DENSE_ROWS} rows",
    )
    sixteen = Projections("blocks", "blocks", blocks=blocks.densely(bf16), sixteen="onednn")
    assert row_dependences(sixteen, "native", f32) == (
        f"the decoder's projections switch from the GGUF blocks to a dense bfloat16 product "
        f"from {DENSE_ROWS} rows",
    )
    invariant = Projections("blocks", "blocks", blocks=blocks.block_by_block(), sixteen="onednn")
    assert row_dependences(invariant, "native", f32) == ()
    fp16 = Projections("fp16", "onednn")
    expected = (
        (
            "the decoder's projections are fbgemm's fp16 products, whose AVX2 kernels sum a "
            "row another way as the rows change",
        )
        if cpu_personality().rung.fbgemm == "AVX2"
        else ()
    )
    assert row_dependences(fp16, "native", f32) == expected


def test_deterministic_takes_the_invariant_arrangement() -> None:
    """``deterministic=True`` keeps the arrangement where it is invariant already and trades
    fbgemm's AVX2 fp16 weights for float32 ones packed for oneDNN where it is not; ``None``
    takes the fastest and says whether it is invariant."""
    config = _config()
    fast = select_kernels(config, dtype=torch.float32, device=CPU, exact=False, quantization="auto")
    held = select_kernels(
        config,
        dtype=torch.float32,
        device=CPU,
        exact=False,
        quantization="auto",
        deterministic=True,
    )
    assert held.deterministic
    assert held.row_dependences == ()
    assert "batch-invariant" in held.describe()
    if fp16_rows_dependent() and kernel_available("fp16", CPU):
        assert fast.projection.layers == "fp16"
        assert not fast.deterministic
        assert "not batch-invariant (the decoder's projections are fbgemm's fp16" in (
            fast.describe()
        )
        assert held.projection.layers != "fp16"
    else:
        assert held.projection == fast.projection
        assert fast.deterministic == (fast.attention == "native")


def test_deterministic_refuses_what_cannot_be_invariant(monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config()
    with pytest.raises(
        DeterminismUnavailable,
        match=r"^deterministic=True: the decoder's projections are MKL's float32 products "
        r"\(transformers' exact arithmetic, dtype='float32'\), which sum a row another way as "
        r"the rows change, so a request's tokens could depend on the requests beside it "
        r"\(docs/models.md, 'One answer per request'\)$",
    ):
        select_kernels(config, dtype=torch.float32, device=CPU, exact=True, deterministic=True)
    with pytest.raises(DeterminismUnavailable, match=r"the attention is 'bag'"):
        select_kernels(
            config,
            dtype=torch.float32,
            device=CPU,
            exact=False,
            attention="bag",
            deterministic=True,
        )
    with pytest.raises(DeterminismUnavailable, match=r"on cuda the kernels are torch's"):
        select_kernels(
            config, dtype=torch.float32, device=torch.device("cuda"), exact=False,
            deterministic=True,
        )  # fmt: skip
    # On an AMX machine whose compiled panels cannot use the tiles, the fastest arrangement
    # gives large products to oneDNN; deterministic=True keeps the panels for every count.
    if projection_kernel() is None:
        return
    monkeypatch.setattr(choice, "_amx_split_wanted", lambda *args: True)
    split = select_kernels(config, dtype=torch.bfloat16, device=CPU, exact=False)
    assert split.projection.panel_rows == choice.AMX_PANEL_ROWS
    assert not split.deterministic
    held = select_kernels(config, dtype=torch.bfloat16, device=CPU, exact=False, deterministic=True)
    assert held.projection.panel_rows is None
    assert held.deterministic


def test_an_asked_attention_is_said_to_break_the_invariant() -> None:
    kernels = select_kernels(_config(), dtype=torch.bfloat16, device=CPU, exact=False)
    if kernels.attention != "native":
        pytest.skip("the compiled attention does not run here")
    assert kernels.deterministic
    asked = select_kernels(
        _config(), dtype=torch.bfloat16, device=CPU, exact=False, attention="matmul"
    )
    assert asked.row_dependences == (
        "the attention is 'matmul': decodes and prefill chunks are summed by other operators",
    )
