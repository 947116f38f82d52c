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
experts one by one fill their slices (:meth:`SparseMoE.target`). They stay in full precision
in this step: the plan's projection forms are the attention's and the dense layers'.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from twostroke.engine.models.config import ModelConfig
from twostroke.engine.models.layers import Glue
from twostroke.engine.models.linear import empty_parameter

__all__ = ["SparseMoE"]

#: One expert's matrix in an HF checkpoint (transformers 4's layout, which
#: ``save_pretrained`` of transformers 5 writes too): ``experts.<n>.<proj>.weight``.
_ONE_EXPERT = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
#: Every expert's matrix at once: a GGUF file's (``experts.<proj>.weight``, mapped from
#: ``ffn_<proj>_exps``) or transformers 5's fused parameters (``experts.gate_up_proj``).
_ALL_EXPERTS = re.compile(r"experts\.(gate_proj|up_proj|down_proj|gate_up_proj)(\.weight)?")


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
        self.width = width
        self.normalize = config.normalize_expert_weights
        # The router stays a dense matrix of the model's dtype whatever the projections'
        # form: a quantized router would move the top-k's ties, and it is [experts, hidden].
        self.router = empty_parameter(experts, hidden, dtype=dtype, device=device)
        self.gate_up = empty_parameter(experts, 2 * width, hidden, dtype=dtype, device=device)
        self.down = empty_parameter(experts, hidden, width, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, glue: Glue) -> torch.Tensor:
        """The mixture's output for ``x`` ``[tokens, hidden]``: each expert that a token
        picked reads its weights once, for all the tokens that picked it."""
        weights, picked = self.route(x)
        out = torch.zeros_like(x)
        # Sorting the (token, slot) pairs by expert groups each expert's tokens in one slice.
        flat = picked.flatten()
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

    def _expert(self, rows: torch.Tensor, expert: int, glue: Glue) -> torch.Tensor:
        """Expert ``expert``'s SwiGLU of ``rows``."""
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
