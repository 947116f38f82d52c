"""No launch waits for the device: the runner's ``execute`` never calls an op that syncs on CUDA.

Under the one-step lookahead the forward stroke launches step N+1 while step N runs; one op
in the launch that reads a device value back to the host (an ``.item()``, a ``nonzero``, a
boolean mask index, an accumulating ``index_put_``) makes that launch wait for step N, and
depth 2 silently becomes depth 1. Those ops are the same on every device, so a
``TorchDispatchMode`` sees them on the CPU: every launch below runs under one that records
each op that would synchronize on CUDA, for every kind of batch the sampler handles and on
the attention kernels built from torch's operators (the CPU's in-place bags, and CUDA's
SDPA).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.engine.models.test_llama import make_tiny_model, random_sequences
from tests.engine.runners.test_torch import generate
from twostroke.engine.attention import metadata as attention_metadata
from twostroke.engine.models.loading import LoadedModel, open_model
from twostroke.engine.runners.torch import TorchModelRunner
from twostroke.states.params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

aten = torch.ops.aten

#: Ops that always read device memory back to the host before they return (their output
#: shape or value depends on the data).
ALWAYS_SYNC = {
    aten._local_scalar_dense,  # .item(), int(t), float(t), bool(t)
    aten.is_nonzero,
    aten.equal,
    aten.nonzero,
    aten.masked_select,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.unique_dim_consecutive,
}
_INDEX_PUT = {aten.index_put_, aten.index_put, aten._index_put_impl_}


def _is_mask(index: object) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def syncing_reason(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why ``func(*args, **kwargs)`` would synchronize the host with a CUDA device, or None."""
    packet = func.overloadpacket
    if packet in ALWAYS_SYNC:
        return "reads a device value back to the host"
    if packet is aten.index and any(_is_mask(index) for index in args[1]):
        return "indexes with a boolean mask (a nonzero)"
    if packet in _INDEX_PUT:
        if any(_is_mask(index) for index in args[1]):
            return "assigns through a boolean mask (a nonzero)"
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        if accumulate:
            return "accumulates (CUDA reads the index range back first)"
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size (sums the repeats on the host)"
    return None


class SyncRecorder(TorchDispatchMode):
    """Records every op that would make the host wait for a CUDA device."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        reason = syncing_reason(func, args, kwargs)
        if reason is not None:
            self.syncs.append(f"{func}: {reason}")
        return func(*args, **kwargs)


class _WatchedRunner(TorchModelRunner):
    """A runner whose launches (``execute``) run under a :class:`SyncRecorder`."""

    recorder: SyncRecorder

    def execute(self, plan: Any) -> Any:
        with self.recorder:
            return super().execute(plan)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A tiny grouped-query Llama (4 query heads, 2 key/value heads), random weights."""
    path = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama", path, seed=5)
    return open_model(path, dtype=torch.float32, device=torch.device("cpu"))


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> SyncRecorder:
    """Every runner ``generate`` makes in this test launches under one recorder."""
    recorder = SyncRecorder()
    _WatchedRunner.recorder = recorder
    monkeypatch.setattr(
        TorchModelRunner, "from_loaded", classmethod(_from_loaded_watched), raising=True
    )
    return recorder


def _from_loaded_watched(cls: type, loaded: LoadedModel, **options: Any) -> TorchModelRunner:
    return _WatchedRunner(loaded.module, **options)


@pytest.fixture(params=["bag", "sdpa"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The CPU's torch-operator attention (in-place bags), or CUDA's (SDPA, decodes in one
    group).

    The gathering ``"matmul"`` kernel (the CPU's before the bags) builds its indices with
    the same sync-free arithmetic as SDPA's, which the ``"sdpa"`` runs cover. The CPU's
    compiled kernel runs only on the CPU, where nothing can wait for a device.
    """
    if request.param == "sdpa":
        monkeypatch.setattr(attention_metadata, "default_group_overhead", lambda device: None)
    return str(request.param)


BATCHES = {
    "greedy": [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)],
    "penalized": [
        SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.5, ignore_eos=True),
        SamplingParams(
            max_tokens=6,
            temperature=0.9,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            ignore_eos=True,
        ),
    ],
    "top-k-top-p": [
        SamplingParams(max_tokens=6, temperature=0.8, top_k=10, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.8, top_k=5, top_p=0.8, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=1.2, min_p=0.1, ignore_eos=True),
    ],
    "seeded": [
        SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.7, top_k=20, seed=4, ignore_eos=True),
    ],
    "logprobs": [
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=1.0, logprobs=0, ignore_eos=True),
    ],
}


@pytest.mark.parametrize("batch", [*BATCHES, "everything"])
def test_launches_never_synchronize_the_host(
    tiny_llama: LoadedModel, recorder: SyncRecorder, kernel: str, batch: str
) -> None:
    """Chunked prefills with history, mixed batches and decodes, under the lookahead."""
    loaded = tiny_llama
    params = [p for ps in BATCHES.values() for p in ps] if batch == "everything" else BATCHES[batch]
    prompts = random_sequences([5 + 7 * i for i in range(len(params))], seed=len(params))
    # Arrivals spread over steps: prefills with history land in batches with decodes.
    run = generate(
        loaded,
        prompts,
        params,
        arrivals=list(range(len(params))),
        max_num_batched_tokens=12,
        attention_kernel=kernel,
    )
    assert all(len(run.tokens[i]) == 6 for i in range(len(params)))
    assert recorder.syncs == []


def test_the_recorder_sees_each_kind_of_sync() -> None:
    """The denylist works: each op named in it is caught on the CPU."""
    values = torch.arange(6.0)
    mask = values > 2
    slots = torch.tensor([0, 0, 1])
    with SyncRecorder() as recorder:
        values.sum().item()
        bool(values[0])  # an `if tensor:` (is_nonzero, which reaches the mode as this)
        values.nonzero()
        values.masked_select(mask)
        values[mask]
        values[mask] = 0.0
        torch.zeros(2, 3).index_put_((slots, slots), torch.ones(3), accumulate=True)
        torch.unique(slots)
        torch.equal(values, values)
        torch.repeat_interleave(slots, torch.tensor([1, 2, 3]))
        # These never sync: index_add_, masked_fill, repeat_interleave with output_size.
        torch.zeros(4).index_add_(0, slots, torch.ones(3))
        values.masked_fill(mask, 0.0)
        torch.repeat_interleave(slots, torch.tensor([1, 2, 3]), output_size=6)
    reasons = [sync.split(":", 1)[0] for sync in recorder.syncs]
    assert reasons == [
        "aten._local_scalar_dense.default",
        "aten._local_scalar_dense.default",
        "aten.nonzero.default",
        "aten.masked_select.default",
        "aten.index.Tensor",
        "aten.index_put_.default",
        "aten.index_put_.default",
        "aten._unique2.default",
        "aten.equal.default",
        "aten.repeat_interleave.Tensor",
    ]
