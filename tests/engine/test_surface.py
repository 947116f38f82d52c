"""The engine surface: what every front end may ask of an engine, and its bad input."""

from __future__ import annotations

import pytest

from twostroke.engine import Engine, EngineClosed, SamplingParams
from twostroke.engine.runners.toy import ByteTokenizer, ToyRunner
from twostroke.engine.surface import EngineSurface, open_surface
from twostroke.states.constraints import Choice, Regex
from twostroke.states.errors import ConstraintRejected

pytestmark = pytest.mark.anyio


async def test_the_engine_satisfies_the_surface_and_names_its_model() -> None:
    async with Engine.open(model="toy", device="cpu", num_blocks=16) as engine:
        assert isinstance(engine, EngineSurface)
        assert engine.model_name == "toy"
        assert isinstance(engine.tokenizer, ByteTokenizer)
        assert engine.max_model_len == 4096
        engine.check_health()
    async with Engine.open(
        runner=ToyRunner(max_model_len=64), tokenizer=ByteTokenizer(), num_blocks=16
    ) as engine:
        assert engine.model_name == "ToyRunner"
        assert engine.max_model_len == 64
    async with Engine.open(model="toy", model_name="served-as", num_blocks=16) as engine:
        assert engine.model_name == "served-as"


async def test_tokenize_and_detokenize_round_trip_and_reject_bad_input() -> None:
    async with Engine.open(model="toy", device="cpu", num_blocks=16) as engine:
        ids = await engine.tokenize("héllo")
        assert ids == list("héllo".encode())
        assert await engine.detokenize(ids) == "héllo"
        chat = await engine.tokenize([{"role": "user", "content": "hi"}])
        assert (await engine.detokenize(chat)).endswith("<assistant>")
        with pytest.raises(ValueError, match=r"prompt must not be empty, got ''"):
            await engine.tokenize("")
        with pytest.raises(TypeError, match=r"token_ids must be a sequence of ints, got str"):
            await engine.detokenize("abc")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"token ids must be ints, got float at index 1"):
            await engine.detokenize([1, 2.0])  # type: ignore[list-item]
        with pytest.raises(
            ValueError, match=r"token ids must be in \[0, 257\), got 999 at index 0"
        ):
            await engine.detokenize([999])
        # bad input changed nothing: the engine still serves
        output = await engine.generate("still here", SamplingParams(max_tokens=3))
        assert len(output.token_ids) <= 3


async def test_check_health_raises_once_the_block_is_left() -> None:
    async with Engine.open(model="toy", device="cpu", num_blocks=16) as engine:
        engine.check_health()
    with pytest.raises(EngineClosed, match="its async with block was left"):
        engine.check_health()
    with pytest.raises(EngineClosed):
        engine.submit("late")


@pytest.mark.parametrize("device", [3, None, 1.5, object()])
async def test_a_device_that_is_neither_a_device_nor_a_kind_is_a_type_error(
    device: object,
) -> None:
    message = (
        r"device must be a Device or one of 'auto', 'cuda', 'cpu', 'fake', got "
        + type(device).__name__
    )
    with pytest.raises(TypeError, match=message):
        async with Engine.open(model="toy", device=device):  # type: ignore[arg-type]
            pass


async def test_model_name_must_be_text() -> None:
    with pytest.raises(TypeError, match="model_name must be a str, got int"):
        async with Engine.open(model="toy", model_name=5):  # type: ignore[arg-type]
            pass


async def test_a_coordinator_serves_a_constrained_request_and_refuses_a_bad_one() -> None:
    async with open_surface(
        model="toy", replicas=1, placement="local", device="cpu", num_blocks=64, block_size=4,
    ) as surface:  # fmt: skip
        choice = SamplingParams(max_tokens=8, constraint=Choice(["yes", "no"]))
        output = await surface.generate("hi", choice)
        assert (output.text, output.finish_reason.value) in {("yes", "stop"), ("no", "stop")}
        # A pattern the backend cannot enforce is the handle's ConstraintRejected, and the
        # surface goes on serving.
        with pytest.raises(ConstraintRejected) as caught:
            await surface.generate("hi", SamplingParams(constraint=Regex("(?=a)b")))
        assert caught.value.field == "constraint.pattern"
        output = await surface.generate("hi", SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(output.token_ids) == 3
