"""A projection computes with one method, its weight's form, chosen once: each form against
F.linear, the tied output projection sharing the embedding, and a method of one's own."""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F

from twostroke.engine.kernels.projection import projection_kernel
from twostroke.engine.models.forms import (
    FullPrecision,
    LinearMethod,
    OneDNNWeight,
    QuantizedWeight,
    WeightForm,
    can_pack,
    weight_method,
)
from twostroke.engine.models.linear import Linear
from twostroke.engine.models.quantization import kernel_available

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")


def loaded_linear(dtype: torch.dtype = torch.float32, *, bias: bool = True) -> Linear:
    linear = Linear(6, 5, bias=bias, dtype=dtype, device=CPU)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        assert linear.weight is not None
        linear.weight.copy_(torch.randn(5, 6, generator=generator))
        if linear.bias is not None:
            linear.bias.copy_(torch.randn(5, generator=generator))
    return linear


def available(form: WeightForm) -> bool:
    if form == "onednn":
        return can_pack(torch.float32, CPU, exact=False)
    if form == "fp16" or form == "int8":
        return kernel_available(form, CPU)
    return form == "dense"


@pytest.mark.parametrize("form", ["dense", "onednn", "fp16", "int8"])
def test_each_form_is_one_callable_that_computes_the_product(form: WeightForm) -> None:
    if not available(form):
        pytest.skip(f"{form}'s kernel does not run here")
    linear = loaded_linear()
    assert linear.weight is not None
    weight, bias = linear.weight.clone(), linear.bias
    assert bias is not None
    bias = bias.clone()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        expected = F.linear(x, weight, bias)
        linear.convert(form)
        got = linear(x)
    kinds = {
        "dense": FullPrecision,
        "onednn": OneDNNWeight,
        "fp16": QuantizedWeight,
        "int8": QuantizedWeight,
    }
    assert type(linear.method) is kinds[form]
    if form == "dense":
        assert torch.equal(got, expected)  # F.linear's bits, the parameters kept
        assert linear.weight.numel() == 30
        return
    torch.testing.assert_close(got, expected, atol=0.1, rtol=0.05)
    assert linear.weight.numel() == 0  # one copy: the method's
    assert linear.bias is None
    with pytest.raises(RuntimeError, match=r"computes with \w+ already: .* chosen once$"):
        linear.convert("dense")
    with pytest.raises(RuntimeError, match="chosen once"):
        linear.use(FullPrecision(weight, bias))


@attrs.frozen
class Doubled:
    """A method of one's own (as llama.cpp's block formats will be): twice the product."""

    weight: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * F.linear(x, self.weight)


def test_any_callable_is_a_method() -> None:
    linear = loaded_linear(bias=False)
    assert linear.weight is not None
    weight = linear.weight.detach().clone()
    method: LinearMethod = Doubled(weight)
    linear.use(method)
    x = torch.ones(2, 6)
    assert torch.equal(linear(x), 2 * F.linear(x, weight))
    assert linear.weight.numel() == 0


def test_a_tied_projection_shares_the_weight_it_is_given() -> None:
    embedding = torch.nn.Parameter(torch.randn(7, 6), requires_grad=False)
    head = Linear.tied(embedding)
    assert (head.in_features, head.out_features) == (6, 7)
    assert head.weight is None
    assert list(head.state_dict()) == []  # its owner's state dict holds it
    x = torch.randn(3, 6)
    assert torch.equal(head(x), F.linear(x, embedding))
    if can_pack(torch.float32, CPU, exact=False):
        with torch.inference_mode():
            head.convert("onednn")
        assert isinstance(head.method, OneDNNWeight)
        assert embedding.shape == (7, 6)  # the embedding stays dense: lookups read it
        torch.testing.assert_close(head(x), F.linear(x, embedding), atol=1e-5, rtol=1e-5)


def test_panels_need_the_compiled_kernel() -> None:
    weight = torch.zeros(4, 6, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="the 'panels' form needs the compiled projection"):
        weight_method("panels", weight, None)
    kernel = projection_kernel()
    if kernel is not None:  # AVX512-BF16
        linear = Linear(6, 4, bias=False, dtype=torch.bfloat16, device=CPU)
        linear.convert("panels", kernel=kernel)
        assert linear.method.__class__.__name__ == "PanelWeight"
