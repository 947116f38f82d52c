"""``profile_decode_step`` and ``twostroke profile-step`` on tiny random models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.models.test_llama import make_tiny_model
from twostroke.engine.bench.step_profile import DecodeStep, StepProfile, profile_decode_step
from twostroke.engine.cli import main
from twostroke.engine.models.loading import LoadedModel, open_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: The most torch calls one decoder layer may make from Python in a decode step. SmolLM2's
#: layer made about 95 before issue 16's item 4 and 34 after (one decode group; see
#: docs/performance.md): a change that brings many back fails here.
MAX_CALLS_PER_LAYER = 40


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, LoadedModel]:
    """The tiny Llama of the model tests with 2 and with 3 layers."""
    models = {}
    for layers in (2, 3):
        path = tmp_path_factory.mktemp(f"llama-{layers}")
        make_tiny_model("llama", path, num_hidden_layers=layers)
        models[layers] = open_model(path, dtype=torch.float32, device=torch.device("cpu"))
    return models


def profile(loaded: LoadedModel, batch: int = 4) -> StepProfile:
    step = DecodeStep.prefill(loaded, batch=batch, history=(5, 30), block_size=4, max_steps=16)
    return profile_decode_step(step, repeats=2)


def test_counts_are_exact_and_grow_by_one_layer_s_calls(
    tiny_models: dict[int, LoadedModel],
) -> None:
    two, three = profile(tiny_models[2]), profile(tiny_models[3])
    assert counts(profile(tiny_models[2])) == counts(two)  # the same every time
    calls = dict(two.top_calls)
    assert calls["linear"] == 4 * 2 + 1  # q/k/v, o, gate/up and down per layer; the output
    assert dict(three.top_calls)["linear"] == 4 * 3 + 1
    per_layer = three.torch_calls - two.torch_calls
    assert 0 < per_layer <= MAX_CALLS_PER_LAYER
    assert two.torch_calls - 2 * per_layer > 0  # the step's own (embedding, metadata, sampler)
    assert three.aten_ops > two.aten_ops > 0
    assert two.attribute_reads > 0
    assert two.batch == 4


def counts(result: StepProfile) -> tuple[object, ...]:
    """Everything but the timings, which vary from run to run."""
    return (
        result.batch,
        result.torch_calls,
        result.attribute_reads,
        result.aten_ops,
        result.top_calls,
    )


def test_times_are_a_split_of_the_step(tiny_models: dict[int, LoadedModel]) -> None:
    result = profile(tiny_models[2])
    assert 0 < result.kernel_seconds <= result.profiled_seconds
    assert 0 < result.kernel_seconds + result.compiled_seconds <= result.profiled_seconds
    assert 0 < result.gil_free_fraction <= 1
    assert len(result.step_samples) == 2
    assert result.step_seconds in (min(result.step_samples), sum(result.step_samples) / 2)
    text = result.report()
    assert text.startswith("decode step, batch 4\n")
    assert f"in {result.compiled_calls} calls)" in text
    assert f"torch calls from Python  {result.torch_calls}" in text


def test_the_steps_are_consecutive_decodes_of_one_batch(
    tiny_models: dict[int, LoadedModel],
) -> None:
    step = DecodeStep.prefill(tiny_models[2], batch=3, history=(5, 9), block_size=4, max_steps=3)
    positions = [sorted(entry.start for entry in step.plan.requests)]
    with pytest.raises(RuntimeError, match=r"^advance\(\) needs the current step executed"):
        step.advance()
    step.execute()
    step.advance()
    positions.append(sorted(entry.start for entry in step.plan.requests))
    assert [p + 1 for p in positions[0]] == positions[1]
    step.execute()
    with pytest.raises(RuntimeError, match=r"^the decode steps ran out"):
        step.advance()  # 3 tokens: the prefill's, and two decodes


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"batch": 0}, "batch must be >= 1, got 0"),
        ({"batch": 1, "max_steps": 0}, "max_steps must be >= 1, got 0"),
        ({"batch": 1, "history": (9, 5)}, r"history must be \(low, high\) with 1 <= low <= high"),
        ({"batch": 1, "history": (0, 5)}, r"history must be .*, got \(0, 5\)"),
    ],
)
def test_bad_arguments_are_refused(
    tiny_models: dict[int, LoadedModel], options: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        DecodeStep.prefill(tiny_models[2], **options)  # type: ignore[arg-type]


def test_repeats_below_one_are_refused(tiny_models: dict[int, LoadedModel]) -> None:
    step = DecodeStep.prefill(tiny_models[2], batch=1, history=(3, 3), max_steps=8)
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        profile_decode_step(step, repeats=0)


def test_the_command_prints_the_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_tiny_model("llama", tmp_path, num_hidden_layers=2)
    arguments = ["--model", str(tmp_path), "--batch", "2", "--history", "4", "12"]
    assert main(["profile-step", *arguments, "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(
        f"{tmp_path.name}, torch.float32, weights in the dtype, KV cache float32, "
        "1 torch thread(s), CPU capability "
    )
    assert lines[1] == "decode step, batch 2"
    assert lines[2].startswith("  torch calls from Python  ")


def test_the_compiled_kernels_calls_are_timed_apart_from_torchs_ops(
    tiny_models: dict[int, LoadedModel],
) -> None:
    """The tiny models attend with the compiled kernel (exact float32 keeps torch's glue and
    projections): one call a layer, whose time counts as GIL-free too."""
    two, three = profile(tiny_models[2]), profile(tiny_models[3])
    if (two.compiled_calls, three.compiled_calls) == (0, 0):
        pytest.skip("no compiled attention kernel on this machine")
    assert (two.compiled_calls, three.compiled_calls) == (2, 3)
    assert 0 < two.compiled_seconds < two.profiled_seconds


def test_a_model_whose_windowed_layers_keep_their_kv_apart_decodes_too(tmp_path: Path) -> None:
    """Gemma 3's windowed layers get their own pool here as in the engine: the decodes run
    past the window (histories of 9-12 positions, a window of 4)."""
    import transformers

    from tests.engine.models import parity

    parity.make_model(
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        tmp_path,
        head_dim=16,
        sliding_window=4,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
    )
    loaded = open_model(tmp_path, dtype=torch.float32, device=torch.device("cpu"))
    step = DecodeStep.prefill(loaded, batch=2, history=(9, 12), block_size=4, max_steps=5)
    assert step.runner.windowed_kv_window == 4
    assert step.runner.num_windowed_blocks > 0
    for _ in range(3):
        step.execute()
        step.advance()
