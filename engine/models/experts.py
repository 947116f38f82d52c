"""The mixture-of-experts MLP (:class:`SparseMoE`): a router picks each token's experts, and
each picked expert's SwiGLU runs once for all the step's tokens that picked it.

The arithmetic is transformers' (``Qwen3MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``)
operation for operation: the router's logits in the model's dtype, softmax in float32, top-k,
the picked probabilities divided by their sum where the architecture says
(``normalize_expert_weights``), then per expert ``down(silu(gate(x)) * up(x))`` times its
weight, added into the output row by row (``index_add_``) in the order of the experts. So
float32 logits match transformers' to rounding, and a token's output does not depend on which
other tokens picked the same experts (each row's sum is over its own experts, in expert
order).

The experts' weights are stacked, one tensor per projection for all the experts
(``gate_up [experts, 2 * width, hidden]``, ``down [experts, hidden, width]``), as a GGUF
file stores them (``ffn_gate_exps`` ...) and transformers 5 holds them; an HF checkpoint's
experts one by one fill their slices (:meth:`SparseMoE.target`). Where the run's plan puts
the projections in GGUF blocks and the experts can follow
(:attr:`~twostroke.engine.models.plan.RunPlan.experts_in_blocks`), each expert computes
from blocks instead (:meth:`SparseMoE.load_blocks`, :meth:`SparseMoE.use_blocks`): a GGUF
file's own, each expert's rows of the stacked tensor a view of the file's memory map (an
expert no token picks is never read, so its pages are never touched), or the experts
quantized at load (``q8_0``, ``q4_0``). An expert is then two
:class:`~twostroke.engine.models.forms.BlockWeight` projections, its gate and up side by
side as the dense MLP's ``gate_up`` and its down, multiplied by the same block products as
every other projection, and the stacked tensors are dropped. Otherwise the experts take the
form the plan chose for the dense projections (:meth:`SparseMoE.use_form`: the compiled
bfloat16 panels of an HF checkpoint's experts, oneDNN's packing, fbgemm's float16 or int8),
one pair of projections an expert. The router stays dense.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from twostroke.engine.checkpoints.gguf import BlockTensor
from twostroke.engine.kernels.gguf_blocks import BlockKernel
from twostroke.engine.kernels.projection import ProjectionKernel
from twostroke.engine.models.config import ModelConfig
from twostroke.engine.models.forms import BlockWeight, LinearMethod, WeightForm, weight_method
from twostroke.engine.models.layers import Glue
from twostroke.engine.models.linear import empty_parameter

__all__ = ["SparseMoE"]

#: One expert's matrix in an HF checkpoint (transformers 4's layout, which
#: ``save_pretrained`` of transformers 5 writes too): ``experts.<n>.<proj>.weight``.
_ONE_EXPERT = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
#: Every expert's matrix at once: a GGUF file's (``experts.<proj>.weight``, mapped from
#: ``ffn_<proj>_exps``) or transformers 5's fused parameters (``experts.gate_up_proj``).
_ALL_EXPERTS = re.compile(r"experts\.(gate_proj|up_proj|down_proj|gate_up_proj)(\.weight)?")
#: An expert's matrices, in the order an expert's forms are made of them.
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class SparseMoE(nn.Module):
    """The mixture-of-experts MLP of one layer.

    Args:
        config: The model's shape (``num_experts``, ``experts_per_token``,
            ``expert_intermediate_size``, ``normalize_expert_weights``).
        dtype: The weights' dtype.
        device: Where they live.
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        experts, hidden = config.num_experts, config.hidden_size
        width = config.expert_intermediate_size
        self.num_experts = experts
        #: Multiply each token's row by its router and experts alone (the plan's
        #: experts_by_row: batch-invariant, a product a row).
        self.by_row = False
        self.top_k = config.experts_per_token
        self.hidden = hidden
        self.width = width
        self.normalize = config.normalize_expert_weights
        # The router stays a dense matrix of the model's dtype whatever the projections'
        # form: a quantized router would move the top-k's ties, and it is [experts, hidden].
        self.router = empty_parameter(experts, hidden, dtype=dtype, device=device)
        self.gate_up = empty_parameter(experts, 2 * width, hidden, dtype=dtype, device=device)
        self.down = empty_parameter(experts, hidden, width, dtype=dtype, device=device)
        #: Each expert's ``(gate_up, down)`` in GGUF blocks once :meth:`use_blocks` made
        #: them (the stacked tensors are then empty); ``None``: the stacked tensors.
        self.forms: tuple[tuple[LinearMethod, LinearMethod], ...] | None = None
        # The same forms where they are blocks (use_blocks), for the one-token path.
        self._blocks: tuple[tuple[BlockWeight, BlockWeight], ...] | None = None
        # The experts' matrices in blocks as load_blocks took them, by (expert, projection),
        # until use_blocks makes the forms of them.
        self._stored: dict[tuple[int, str], BlockTensor] = {}

    def forward(self, x: torch.Tensor, glue: Glue) -> torch.Tensor:
        """The mixture's output for ``x`` ``[tokens, hidden]``: each expert that a token
        picked reads its weights once, for all the tokens that picked it."""
        weights, picked = self.route(x)
        return self.mix(x, weights, picked, glue)

    def mix(
        self, x: torch.Tensor, weights: torch.Tensor, picked: torch.Tensor, glue: Glue
    ) -> torch.Tensor:
        """The mixture's output for ``x`` routed as given (:meth:`route`'s routes, or a
        test's): each token's picked experts' SwiGLUs times their weights, summed in the
        order of the experts. Each picked expert reads its weights once for all the tokens
        that picked it (one row at a time where :attr:`by_row`); an expert no token picked
        is never read.

        Args:
            x: ``[tokens, hidden]``.
            weights: ``[tokens, top_k]``, in ``x``'s dtype.
            picked: int64 ``[tokens, top_k]``: each token's experts.
            glue: What computes ``silu(gate) * up``.

        Raises:
            ValueError: routes other than ``[tokens, top_k]``, or an expert outside
                ``[0, num_experts)``.
        """
        shape = (int(x.shape[0]), self.top_k)
        if tuple(weights.shape) != shape or tuple(picked.shape) != shape:
            raise ValueError(
                f"routes must be [tokens, top_k] = [{shape[0]}, {shape[1]}] for x "
                f"{tuple(x.shape)}, got weights {tuple(weights.shape)} and picked "
                f"{tuple(picked.shape)}"
            )
        out = torch.zeros_like(x)
        # Sorting the (token, slot) pairs by expert groups each expert's tokens in one slice.
        flat = picked.flatten()
        if flat.numel():
            low, high = int(flat.min()), int(flat.max())
            if low < 0 or high >= self.num_experts:
                raise ValueError(
                    f"picked experts must be in [0, {self.num_experts}), got "
                    f"{low if low < 0 else high}"
                )
        if shape[0] == 1 and self._blocks is not None:  # a decode's one token
            return self._one_row_in_blocks(x, self._blocks, weights[0], picked[0], glue)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        start = 0
        for expert, taken in enumerate(counts):
            if not taken:
                continue  # an expert no token picked is never read
            rows = order[start : start + taken]
            token_ids = tokens[start : start + taken]
            start += taken
            chosen = x[token_ids]
            if self.by_row:  # one product shape whatever else picked this expert
                down = torch.cat(
                    [self._expert(row, expert, glue) for row in torch.split(chosen, 1)]
                )
            else:
                down = self._expert(chosen, expert, glue)
            share = weights.flatten()[rows, None]
            out.index_add_(0, token_ids, (down * share).to(out.dtype))
        return out

    def _one_row_in_blocks(
        self,
        x: torch.Tensor,
        blocks: tuple[tuple[BlockWeight, BlockWeight], ...],
        weights: torch.Tensor,
        picked: torch.Tensor,
        glue: Glue,
    ) -> torch.Tensor:
        """One token's experts in blocks in two foreign calls, not two an expert: every picked
        expert's gate and up in one product (the row quantized once), then their downs in
        another, row ``i`` (expert ``i``'s SwiGLU) kept in expert ``i``'s columns. The blocks
        sum each output of a row alike whatever the rows and parts beside it, so each is the
        per-expert call's bit for bit; the shares are added in the order of the experts, as
        :meth:`mix` adds them."""
        order = torch.argsort(picked)
        chosen = [blocks[expert] for expert in picked[order].tolist()]
        kernel, count = chosen[0][0].kernel, len(chosen)
        gate_up = BlockWeight(kernel, tuple(part for pair in chosen for part in pair[0].parts))
        mixed = glue.silu_mul(gate_up(x).view(count, 2 * self.width))
        own = torch.cat(
            [pair[1](row) for pair, row in zip(chosen, torch.split(mixed, 1), strict=True)]
        )
        shares = (own * weights[order, None]).to(x.dtype)
        out = shares[0].clone()
        for share in shares[1:]:
            out += share
        return out[None]

    def _expert(self, rows: torch.Tensor, expert: int, glue: Glue) -> torch.Tensor:
        """Expert ``expert``'s SwiGLU of ``rows``."""
        if self.forms is not None:
            gate_up, down = self.forms[expert]
            return down(glue.silu_mul(gate_up(rows)))
        mixed = glue.silu_mul(F.linear(rows, self.gate_up[expert]))
        return F.linear(mixed, self.down[expert])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights, as transformers' routers compute them:
        softmax in float32, top-k, divided by their sum where the architecture says.

        Returns:
            The weights ``[tokens, top_k]`` in the model's dtype (Qwen3-MoE's router casts
            them back so; the same values in float32) and the experts' indices
            ``[tokens, top_k]``.
        """
        if self.by_row:  # the router's product too: a row's picks are its own
            logits = torch.cat([F.linear(row, self.router) for row in torch.split(x, 1)])
        else:
            logits = F.linear(x, self.router)
        probabilities = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, picked = torch.topk(probabilities, self.top_k, dim=-1)
        if self.normalize:
            top /= top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), picked

    def target(self, name: str) -> tuple[torch.Tensor, tuple[str, ...]] | None:
        """The tensor a checkpoint's expert weight fills, and the per-expert names it
        stands for, or ``None`` for a name that is not one.

        Args:
            name: The name after the layer's ``mlp.``: ``gate.weight``,
                ``experts.<n>.<gate|up|down>_proj.weight``, ``experts.<proj>.weight``
                (every expert's, stacked), or transformers 5's ``experts.gate_up_proj`` /
                ``experts.down_proj``.
        """
        if name == "gate.weight":
            return self.router, ("gate.weight",)
        if self.forms is not None:
            return None  # the experts are blocks now: no tensor holds them
        one = _ONE_EXPERT.fullmatch(name)
        if one is not None:
            expert, proj = int(one.group(1)), one.group(2)
            if expert >= self.num_experts:
                return None
            return self._part(proj)[expert], (name,)
        every = _ALL_EXPERTS.fullmatch(name)
        if every is None:
            return None
        proj = every.group(1)
        if proj == "gate_up_proj":
            if every.group(2):
                return None
            projs: tuple[str, ...] = ("gate_proj", "up_proj")
            tensor: torch.Tensor = self.gate_up
        else:
            projs, tensor = (proj,), self._part(proj)
        names = tuple(
            f"experts.{expert}.{part}.weight"
            for expert in range(self.num_experts)
            for part in projs
        )
        return tensor, names

    def load_blocks(self, name: str, tensor: BlockTensor) -> tuple[str, ...] | None:
        """Take an expert's matrix, or every expert's stacked, in GGUF blocks as they are
        (each expert's rows a view of ``tensor``'s, not copied), for :meth:`use_blocks`.

        Args:
            name: The name after the layer's ``mlp.``:
                ``experts.<n>.<gate|up|down>_proj.weight``, or ``experts.<proj>.weight``
                for every expert's at once, ``[experts * rows, row bytes]``: each expert's
                rows after the one before's, as a GGUF file stores ``ffn_<proj>_exps``.
            tensor: The blocks.

        Returns:
            The per-expert names (after ``mlp.``) it stands for, or ``None`` for a name
            that is not an expert matrix's.

        Raises:
            ValueError: the shape does not fit.
        """
        one = _ONE_EXPERT.fullmatch(name)
        every = _ALL_EXPERTS.fullmatch(name)
        if one is not None and int(one.group(1)) < self.num_experts:
            count, proj = 1, one.group(2)
        elif every is not None and every.group(1) in _PROJECTIONS and every.group(2):
            count, proj = self.num_experts, every.group(1)
        else:
            return None
        rows, width = (
            (self.hidden, self.width) if proj == "down_proj" else (self.width, self.hidden)
        )
        shape = (count * rows, width)
        if (tensor.out_features, tensor.in_features) != shape:
            raise ValueError(
                f"tensor {name!r} has shape {(tensor.out_features, tensor.in_features)}, "
                f"expected {shape}"
            )
        if one is not None:
            self._stored[int(one.group(1)), proj] = tensor
            return (name,)
        for expert in range(count):
            data = tensor.data[expert * rows : (expert + 1) * rows]  # a view: no copy
            label = f"{tensor.name}[{expert}]"
            self._stored[expert, proj] = BlockTensor(label, tensor.block_type, data)
        return tuple(f"experts.{expert}.{proj}.weight" for expert in range(count))

    def use_blocks(self, kernel: BlockKernel) -> None:
        """Compute each expert from the blocks :meth:`load_blocks` took, by ``kernel``: its
        gate and up side by side in one :class:`BlockWeight`, as the dense MLP's
        ``gate_up``, and its down in another; the stacked tensors are dropped. Nothing
        changes where no expert was taken in blocks.

        Raises:
            ValueError: some of the experts' matrices are in blocks and others are not.
        """
        stored = self._stored
        if not stored:
            return
        missing = [
            f"experts.{expert}.{proj}.weight"
            for expert in range(self.num_experts)
            for proj in _PROJECTIONS
            if (expert, proj) not in stored
        ]
        if missing:
            raise ValueError(
                f"{len(stored)} of the experts' {3 * self.num_experts} matrices are GGUF "
                f"blocks and the others are not (first {missing[0]!r}); the experts compute "
                "in one form"
            )
        self._blocks = tuple(
            (
                BlockWeight(kernel, (stored[expert, "gate_proj"], stored[expert, "up_proj"])),
                BlockWeight(kernel, (stored[expert, "down_proj"],)),
            )
            for expert in range(self.num_experts)
        )
        self.forms = self._blocks
        self._stored = {}
        dtype, device = self.gate_up.dtype, self.gate_up.device
        self.gate_up = empty_parameter(0, dtype=dtype, device=device)
        self.down = empty_parameter(0, dtype=dtype, device=device)

    def use_form(
        self,
        form: WeightForm,
        *,
        kernel: ProjectionKernel | None = None,
        panel_rows: int | None = None,
    ) -> None:
        """Compute each expert from its matrices in ``form``, the form the run's plan chose
        for every dense projection (the compiled bfloat16 panels, oneDNN's packing, fbgemm's
        float16 or int8: :func:`~twostroke.engine.models.forms.weight_method`), so the
        experts multiply by the same kernels; the stacked tensors are dropped. ``"dense"``
        keeps them as they are; experts already in blocks stay so.

        Args:
            form: The dense projections' form (not ``"blocks"``: :meth:`use_blocks`).
            kernel: The compiled projection, for ``"panels"``.
            panel_rows: For ``"panels"``, the most rows the panels take.

        Raises:
            ValueError: ``"blocks"``, or ``"panels"`` without a kernel.
        """
        if form == "dense" or self.forms is not None:
            return
        if form == "blocks":
            raise ValueError("an expert's blocks come from a file or a requantization: use_blocks")

        def method(weight: torch.Tensor) -> LinearMethod:
            return weight_method(form, weight, None, kernel=kernel, panel_rows=panel_rows)

        self.forms = tuple(
            (method(self.gate_up[expert]), method(self.down[expert]))
            for expert in range(self.num_experts)
        )
        dtype, device = self.gate_up.dtype, self.gate_up.device
        self.gate_up = empty_parameter(0, dtype=dtype, device=device)
        self.down = empty_parameter(0, dtype=dtype, device=device)

    def expected(self) -> list[str]:
        """The checkpoint names (after ``mlp.``) of every weight, experts one by one."""
        return ["gate.weight"] + [
            f"experts.{expert}.{proj}.weight"
            for expert in range(self.num_experts)
            for proj in ("gate_proj", "up_proj", "down_proj")
        ]

    def _part(self, proj: str) -> torch.Tensor:
        """Every expert's ``proj`` matrix: a slice of the stacked tensors."""
        if proj == "down_proj":
            return self.down
        start = 0 if proj == "gate_proj" else self.width
        return self.gate_up.narrow(1, start, self.width)
