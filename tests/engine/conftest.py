"""Engine test helpers: a toy engine with a leak check when it closes; the artifact cache."""

from __future__ import annotations

import fcntl
import functools
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest

from twostroke.engine import Engine, SamplingParams
from twostroke.engine.artifacts.cache import CACHE_DIR_ENV, NO_CACHE_ENV
from twostroke.engine.bench.model import ModelSpec, ensure_hf_dir
from twostroke.engine.runners.toy import ByteTokenizer, ToyRunner, toy_text_next_token
from twostroke.gpu.device import Device
from twostroke.states.testing import reference_output


@pytest.fixture(autouse=True, scope="session")
def artifact_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point ``$TWOSTROKE_CACHE_DIR`` at one session folder: tests never write to the home.

    Converted models and tokenizers (seconds to make) are shared by every engine test of
    the session; a test that needs a fresh conversion removes its own entry.
    """
    folder = tmp_path_factory.mktemp("artifact-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_DIR_ENV, str(folder))
        patch.delenv(NO_CACHE_ENV, raising=False)
        yield folder


@pytest.fixture(scope="session")
def smollm2_hf_fp32(tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    """SmolLM2 as ``transformers`` reads its GGUF (dequantized, fp32), written once as a
    Hugging Face folder (``spec.hf_dir``) that the tests comparing with transformers share.

    Reading the GGUF through transformers is most of those tests' time (about 20 s on a
    2-core AVX2 machine with another job busy, 79 s in make test beside the rest); the
    folder reads back in about one. Under xdist the workers share one folder, so the modules
    that use it may run on both workers without converting twice.
    """
    pytest.importorskip("accelerate")  # transformers' GGUF loading needs it
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        work = tmp_path_factory.mktemp("hf-smollm2")
    else:  # written once for all the workers of this run (their temp folders' parent)
        work = tmp_path_factory.getbasetemp().parent / f"hf-smollm2-{run}"
        work.mkdir(exist_ok=True)
    with (work / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker writing it: wait, then reuse it
        spec = ModelSpec.resolve("smollm2", work_dir=work, dtype="float32")
        with gguf_work_done_once():
            ensure_hf_dir(spec)
    return spec


@contextmanager
def gguf_work_done_once() -> Iterator[None]:
    """transformers' GGUF loading, unchanged but for work it repeats on the same inputs.

    Making SmolLM2's transformers model parses the GGUF file with ``gguf.GGUFReader`` three
    times (the configuration, the tensors, then the configuration again for
    ``AutoTokenizer``), and naming its tensors builds ``gguf``'s name table of the
    architecture once per submodule (397 times). Both are functions of their arguments
    alone, the reader over a read-only memory map, so inside this block each is computed
    once: transformers still reads, maps and dequantizes the file with its own code, and
    the weights it writes are the same (the fixture's setup, 2 AVX2 cores, load average
    1.7-2.2: 39.7 s -> 18.5 s; the folder it writes is byte for byte the same).
    """
    gguf = pytest.importorskip("gguf")
    readers: dict[tuple[str, str], Any] = {}
    make_reader = gguf.GGUFReader

    def reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if mode != "r":  # writable: not shared
            return make_reader(path, mode)
        if key not in readers:
            readers[key] = make_reader(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        patch.setattr(
            gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
        )
        yield


@asynccontextmanager
async def toy_engine(
    *,
    runner: ToyRunner | None = None,
    device: Device | str = "cpu",
    **config: Any,
) -> AsyncIterator[Engine]:
    """A toy engine that proves, when its block ends normally, that nothing leaked."""
    config.setdefault("num_blocks", 64)
    config.setdefault("block_size", 4)
    async with Engine.open(
        runner=runner or ToyRunner(), tokenizer=ByteTokenizer(), device=device, **config
    ) as engine:
        yield engine
        await engine.wait_idle()
        engine.check_invariants()
        stats = engine.statistics()
        assert stats.num_free_blocks == stats.num_blocks, stats
        assert stats.num_open_requests == 0, stats


def expected_tokens(prompt: str, params: SamplingParams) -> list[int]:
    """The toy model's output for ``prompt`` alone, computed without any engine."""
    tokenizer = ByteTokenizer()
    return reference_output(
        tokenizer.encode(prompt),
        params,
        eos_token_ids=tokenizer.eos_token_ids,
        next_token=toy_text_next_token,
    )[0]
