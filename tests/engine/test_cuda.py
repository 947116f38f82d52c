"""The runner and the engine on a real GPU (marked ``cuda``: skipped without one).

scripts/gpu_check.sh runs these on a GPU machine; the CPU-only tests check the same code
through a ``TorchDispatchMode`` (tests/engine/runners/test_device_syncs.py) and fakes.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.models.test_llama import make_tiny_model, random_sequences
from tests.engine.runners.test_device_syncs import BATCHES
from tests.engine.runners.test_torch import generate, transformers_greedy
from twostroke.engine.models.loading import LoadedModel, open_model
from twostroke.engine.runners.torch import TorchModelRunner
from twostroke.states.params import SamplingParams

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def tiny_on_cuda(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LoadedModel]:
    path: Path = tmp_path_factory.mktemp("llama")
    reference = make_tiny_model("llama", path, seed=11)
    return reference, open_model(path, dtype=torch.float32, device=CUDA)


class _StrictRunner(TorchModelRunner):
    """Every launch runs under CUDA's sync debug mode set to raise on a synchronizing call."""

    def execute(self, plan: Any) -> Any:
        with warnings.catch_warnings():
            # torch 2.11 warns that the mode is a prototype each time it is set (the suite
            # turns warnings into errors); what it detects is what this test needs.
            warnings.filterwarnings("ignore", "Synchronization debug mode", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        try:
            return super().execute(plan)
        finally:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Synchronization debug mode", UserWarning)
                torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("batch", [*BATCHES, "everything"])
def test_launches_never_synchronize_on_cuda(
    tiny_on_cuda: tuple[Any, LoadedModel], batch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the dispatch-mode test checks on the CPU, by CUDA itself."""
    _, loaded = tiny_on_cuda
    monkeypatch.setattr(
        TorchModelRunner,
        "from_loaded",
        classmethod(lambda cls, loaded, **options: _StrictRunner(loaded.module, **options)),
    )
    params = [p for ps in BATCHES.values() for p in ps] if batch == "everything" else BATCHES[batch]
    prompts = random_sequences([5 + 7 * i for i in range(len(params))], seed=len(params))
    run = generate(
        loaded, prompts, params, arrivals=list(range(len(params))), max_num_batched_tokens=12
    )
    assert all(len(run.tokens[i]) == 6 for i in range(len(params)))


@pytest.mark.parametrize("pipeline_depth", [2, 1])
def test_greedy_on_cuda_matches_transformers(
    tiny_on_cuda: tuple[Any, LoadedModel], pipeline_depth: int
) -> None:
    reference, loaded = tiny_on_cuda
    prompts = random_sequences([1, 3, 8, 21, 50, 5], seed=12)
    expected = [transformers_greedy(reference, prompt) for prompt in prompts]
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    run = generate(loaded, prompts, [greedy] * len(prompts), pipeline_depth=pipeline_depth)
    assert [run.tokens[i] for i in range(len(prompts))] == expected
