"""The checks every architecture passes against transformers and llama.cpp (issue 50), written
once: each architecture's test module builds a tiny random model of transformers' own class
with every feature of the architecture on, and calls these.

Tolerances, stated once:

* float32, transformers' arithmetic (``exact=True``): logits within 1e-4 absolute (logits
  of order 1 to 10: the differences are float32 rounding of different summation orders in
  the attention), and the greedy continuation identical over 32 steps;
* bfloat16 weights, activations and cache: within 5 % of the largest float32 logit;
* llama.cpp on the same GGUF file, its KV cache in float32: F32 within 1e-3 (ggml's own
  float32 kernels; its default float16 cache alone costs 1.5e-3); Q8_0 within 5 % of the
  largest logit (llama.cpp quantizes the activations to 8 bits for its Q8_0 products,
  twostroke's products take them in float32: about 2 % measured on Qwen3, where a block
  read wrongly would cost 100 %).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.engine.models.llamacpp_reference import llamacpp_logits, write_gguf
from tests.engine.models.test_llama import TINY, random_sequences, reference_logits
from twostroke.engine.models.loading import LoadedModel, open_model

CPU = torch.device("cpu")
#: Prompts of the logits checks: one token, a few, several cache blocks.
LENGTHS = [1, 5, 23, 40]
#: Greedy steps after the prompt.
STEPS = 32
#: transformers' logits at every position of a sequence (:func:`reference_logits`: one call).
LogitsOf = Callable[[Any, list[int]], torch.Tensor]


def make_model(
    config_class: Any,
    model_class: Any,
    path: Path,
    seed: int = 0,
    norms: tuple[float, float] = (0.5, 1.5),
    **fields: Any,
) -> Any:
    """A seeded random transformers model of ``model_class``, saved to ``path`` (safetensors).

    Every norm weight and bias is drawn too (transformers initializes them to constants), so
    a weight loaded into the wrong place changes the logits: norm weights uniformly within
    ``norms`` (Gemma's scale by ``1 + weight``: theirs are drawn 1 lower, to scale alike).
    """
    torch.manual_seed(seed)
    config = config_class(**{**TINY, **fields})
    model = model_class(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(*norms)
            elif name.endswith("bias"):
                parameter.normal_(0, 0.1)
    model.eval()
    model.save_pretrained(path)
    return model


def check_logits(
    reference: Any,
    loaded: LoadedModel,
    chunk_size: int | None,
    logits_of: LogitsOf = reference_logits,
) -> None:
    """float32 logits at every position within 1e-4 of transformers' (``logits_of``), the
    prompts prefilled whole (``None``), in chunks, or decoded one token a step (``1``)."""
    sequences = random_sequences(LENGTHS)
    ours = loaded.module.forward_logits(sequences, chunk_size=chunk_size)
    for tokens, logits in zip(sequences, ours, strict=True):
        expected = logits_of(reference, tokens)
        assert logits.shape == expected.shape
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def greedy(
    reference: Any,
    prompt: list[int],
    steps: int = STEPS,
    logits_of: LogitsOf = reference_logits,
) -> list[int]:
    """transformers' greedy continuation of ``prompt``: the prompt and ``steps`` tokens."""
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(logits_of(reference, tokens)[-1].argmax()))
    return tokens


def check_greedy(
    reference: Any,
    loaded: LoadedModel,
    chunk_size: int | None,
    logits_of: LogitsOf = reference_logits,
) -> None:
    """twostroke's argmax at every position of transformers' greedy continuation is the
    token transformers chose next: so twostroke's greedy run gives the same 32 tokens.
    ``chunk_size=1`` decodes each generated token through the paged cache, as generation
    does; ``None`` and 3 prefill the whole or in chunks."""
    prompt = random_sequences([7], seed=5)[0]
    tokens = greedy(reference, prompt, logits_of=logits_of)
    [logits] = loaded.module.forward_logits([tokens], chunk_size=chunk_size)
    chosen = logits[len(prompt) - 1 : -1].argmax(dim=-1).tolist()
    assert chosen == tokens[len(prompt) :]


def check_bfloat16(path: Path, loaded: LoadedModel) -> None:
    """The model in bfloat16 (weights, activations, cache) within 5 % of the largest float32
    logit, in the plan's fastest arrangement here (the compiled glue and bfloat16 panels
    where they run; the stack off, which :func:`check_plan` checks)."""
    low = open_model(path, dtype=torch.bfloat16, device=CPU, exact=False)
    sequences = random_sequences([5, 33])
    exact = loaded.module.forward_logits(sequences)
    for ours, high in zip(low.module.forward_logits(sequences, chunk_size=5), exact, strict=True):
        assert ours.dtype == torch.float32
        assert (ours - high).abs().max() < 0.05 * high.abs().max()


def check_plan(path: Path) -> None:
    """The fastest plan runs the layers one by one, and its log line says why: the compiled
    stack computes Llama's layer only."""
    loaded = open_model(path, dtype=torch.bfloat16, device=CPU, exact=False)
    assert loaded.module.stack is None
    assert "stack off (it computes Llama's layer, and this model's has " in loaded.plan.describe()


def check_llamacpp(
    reference: Any,
    arch: str,
    folder: Path,
    matrices: str,
    *,
    exact: bool,
    f32_bound: float = 1e-3,
) -> None:
    """twostroke's logits on the GGUF file of ``reference`` equal llama.cpp's on it: F32
    within ``f32_bound`` (1e-3 unless the architecture's module says why not), Q8_0 within
    5 % of the largest logit. ``exact=False`` runs the plan's fastest arrangement here (a
    Q8_0 file's blocks as stored, the compiled glue)."""
    path = folder / f"{arch}-{matrices}.gguf"
    write_gguf(path, reference, arch, matrices=matrices)  # type: ignore[arg-type]
    sequences = random_sequences([3, 24], seed=6)
    theirs = llamacpp_logits(path, sequences)
    loaded = open_model(path, dtype=torch.float32, device=CPU, exact=exact)
    ours = loaded.module.forward_logits(sequences, chunk_size=5)
    for mine, other in zip(ours, theirs, strict=True):
        assert mine.shape == other.shape
        bound = f32_bound if matrices == "f32" else 0.05 * float(other.abs().max())
        torch.testing.assert_close(mine, other, atol=bound, rtol=0)
