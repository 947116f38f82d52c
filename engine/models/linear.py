"""The decoder's projection layer: :class:`Linear`, ``y = x W^T + b`` computed by one
:class:`~twostroke.engine.models.forms.LinearMethod`.

A projection starts in full precision (:class:`~twostroke.engine.models.forms.FullPrecision`,
``F.linear`` on uninitialized parameters the loader fills); once loaded, the form the run's
plan names (:mod:`~twostroke.engine.models.forms` has them all) replaces it, once, never back.
"""

from __future__ import annotations

import torch
from torch import nn

from twostroke.engine.kernels.projection import ProjectionKernel
from twostroke.engine.models.forms import FullPrecision, LinearMethod, WeightForm, weight_method

__all__ = ["Linear", "empty_parameter"]


def empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialized, frozen parameter: the loader fills it."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T + b``, computed by :attr:`method` (see the module).

    Its parameters are uninitialized (the loader fills them) and exist while the weight is
    in full precision: a method that holds the weight in another form replaces them, so the
    module holds one copy. A projection that shares another module's weight (the tied output
    projection and the embedding, :meth:`tied`) registers no parameter of its own.

    Attributes:
        in_features: Input width.
        out_features: Output width.
        weight: The full-precision weight while the module computes with it (an empty
            tensor after, ``None`` where the weight is shared).
        bias: The bias while it does, or ``None``.
        method: What computes the product.
    """

    weight: nn.Parameter | None
    bias: nn.Parameter | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = empty_parameter(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_parameter(out_features, dtype=dtype, device=device) if bias else None
        self.method: LinearMethod = FullPrecision(self.weight, self.bias)

    @classmethod
    def tied(cls, weight: nn.Parameter) -> Linear:
        """A projection by ``weight``, another module's ``[out_features, in_features]``
        parameter (the embedding, for a tied output projection): it is not registered here,
        so the state dict holds it once, under its owner's name, and stays dense when this
        projection takes another form (a copy in that form)."""
        linear = cls.__new__(cls)
        nn.Module.__init__(linear)
        linear.in_features, linear.out_features = int(weight.shape[1]), int(weight.shape[0])
        linear.register_parameter("weight", None)
        linear.register_parameter("bias", None)
        linear.method = FullPrecision(weight, None)
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method(x)

    def use(self, method: LinearMethod) -> None:
        """Compute with ``method`` from now on, in place of full precision; no way back.

        The full-precision parameters are dropped (an empty weight stays in their place), so
        the module holds one copy of its weights.

        Raises:
            RuntimeError: the projection computes with another form already (a form is
                chosen once).
        """
        self._full_precision()
        self.method = method
        if self.weight is not None:
            self.weight = empty_parameter(0, dtype=self.weight.dtype, device=self.weight.device)
            self.bias = None

    def convert(
        self,
        form: WeightForm,
        *,
        kernel: ProjectionKernel | None = None,
        into: torch.Tensor | None = None,
        panel_rows: int | None = None,
    ) -> None:
        """Take ``form`` (:func:`weight_method`) of the full-precision weight; ``"dense"``
        keeps it.

        Raises:
            RuntimeError: the weight is in another form already.
        """
        dense = self._full_precision()
        if form != "dense":
            method = weight_method(
                form, dense.weight, dense.bias, kernel=kernel, into=into, panel_rows=panel_rows
            )
            self.use(method)

    def _full_precision(self) -> FullPrecision:
        method = self.method
        if isinstance(method, FullPrecision):
            return method
        raise RuntimeError(
            f"the projection computes with {type(method).__name__} already: its weight form "
            "is chosen once"
        )
