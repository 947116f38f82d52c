"""TorchModelRunner driven by the real scheduler, against transformers.

A small synchronous driver plays the engine: it schedules step N+1 *before* applying step N's
outcome (pipeline depth 2), so pending inputs always come from the device, and it forces
chunked prefill, mixed batches and (with a tiny pool) preemption.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch

from tests.engine.models.test_llama import (
    make_tiny_model,
    random_sequences,
)
from tests.engine.runners.test_sampler import reference_penalties
from twostroke.engine.attention import kernels as attention_kernels
from twostroke.engine.attention.kv_cache import KVCache
from twostroke.engine.attention.metadata import AttentionMetadata
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.kernels.build import NATIVE_ENV
from twostroke.engine.models.loading import LoadedModel, load_model, open_model
from twostroke.engine.runners.torch import RunnerError, TorchModelRunner
from twostroke.states.params import SamplingParams
from twostroke.states.plan import ScheduledRequest, StepPlan, TokenLogprobs
from twostroke.states.request import Request
from twostroke.states.scheduler import Scheduler, SchedulerConfig, SchedulerStatistics
from twostroke.states.speculation import Speculator
from twostroke.states.windowed import WindowedKV, window_pool_blocks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


PROMPT_LENGTHS = [1, 3, 8, 13, 21, 34, 50, 5]


@attrs.frozen
class Run:
    tokens: dict[int, list[int]]
    logprobs: dict[int, list[TokenLogprobs]]
    statistics: SchedulerStatistics
    #: Steps with decodes and at least two multi-token chunks (prefills) of other requests.
    num_mixed_steps: int


def attending(loaded: LoadedModel, kernel: str) -> LoadedModel:
    """The model ``loaded`` loaded again by its plan, with the attention ``kernel`` asked."""
    return load_model(loaded.plan.replanned(attention=kernel))


def generate(
    loaded: LoadedModel,
    prompts: list[list[int]],
    params: list[SamplingParams],
    *,
    arrivals: list[int] | None = None,
    num_blocks: int = 256,
    block_size: int = 4,
    max_num_batched_tokens: int = 16,
    pipeline_depth: int = 2,
    seed: int = 0,
    enable_prefix_caching: bool = True,
    speculator: Speculator | None = None,
    attention_kernel: str | None = None,
    after_step: Callable[[TorchModelRunner, Scheduler], None] | None = None,
    **runner_options: Any,
) -> Run:
    """Serve every prompt as one continuous batch; request ``i`` arrives at step ``arrivals[i]``
    (``attention_kernel``: the model loaded again by its plan with that attention asked).

    A model whose windowed layers keep their KV apart gets their pool as the engine sizes it
    (:func:`window_pool_blocks`) and runs without prefix caching, as the engine runs it;
    ``after_step`` sees the runner and the scheduler after each step's outcome."""
    if attention_kernel is not None:
        loaded = attending(loaded, attention_kernel)
    runner = TorchModelRunner.from_loaded(loaded, seed=seed, **runner_options)
    window = runner.windowed_kv_window
    windowed = None
    if window is not None:
        drafts = 0 if speculator is None else speculator.config.num_speculative_tokens
        count = window_pool_blocks(
            window=window,
            block_size=block_size,
            max_num_seqs=16,
            max_num_batched_tokens=max_num_batched_tokens,
            max_drafts=drafts,
        )
        windowed = WindowedKV(window=window, num_blocks=count)
        enable_prefix_caching = False
    runner.allocate_kv_cache(
        num_blocks, block_size, num_windowed_blocks=0 if windowed is None else windowed.num_blocks
    )
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=16,
            max_model_len=runner.max_model_len,
            pipeline_depth=pipeline_depth,
            enable_prefix_caching=enable_prefix_caching,
            windowed_kv=windowed,
        ),
        speculator=speculator,
    )
    arrivals = arrivals or [0] * len(prompts)
    pending = sorted(range(len(prompts)), key=arrivals.__getitem__)
    inflight: collections.deque[tuple[StepPlan, Any]] = collections.deque()
    tokens: dict[int, list[int]] = collections.defaultdict(list)
    logprobs: dict[int, list[TokenLogprobs]] = collections.defaultdict(list)
    steps = mixed = 0
    while pending or not scheduler.is_idle():
        while pending and arrivals[pending[0]] <= steps:
            index = pending.pop(0)
            scheduler.add_request(Request(index, prompts[index], params[index], 0.0))
        while scheduler.can_schedule and (plan := scheduler.schedule()) is not None:
            inflight.append((plan, runner.execute(plan)))
            steps += 1
            sizes = [entry.num_tokens for entry in plan.requests]
            mixed += 1 in sizes and sum(size > 1 for size in sizes) >= 2
        if not inflight:
            steps += 1  # idle until the next arrival
            continue
        plan, launched = inflight.popleft()
        assert launched.event.query()
        output = launched.readback()
        assert output.step_id == plan.step_id
        report = scheduler.apply(output)
        if after_step is not None:
            after_step(runner, scheduler)
        place: dict[int, int] = collections.Counter()
        for request_id, token in report.new_tokens:
            tokens[request_id].append(token)
            entries = output.token_logprobs(request_id)
            if entries:
                entry = entries[place[request_id]]
                place[request_id] += 1
                assert entry.token_id == token
                logprobs[request_id].append(entry)
        scheduler.check_invariants()
    assert scheduler.is_idle()
    return Run(dict(tokens), dict(logprobs), scheduler.statistics(), mixed)


def transformers_greedy(reference: Any, prompt: list[int], **kwargs: Any) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        output = reference.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # else ids equal to pad_token_id are masked
            max_new_tokens=32,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return output[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny random model, loaded in fp32, with transformers' greedy outputs."""
    path = tmp_path_factory.mktemp(request.param)
    reference = make_tiny_model(request.param, path, seed=11)
    prompts = random_sequences(PROMPT_LENGTHS, seed=12)
    expected = [transformers_greedy(reference, prompt) for prompt in prompts]
    return reference, open_model(path, dtype=torch.float32, device=CPU), prompts, expected


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LoadedModel]:
    path = tmp_path_factory.mktemp("llama")
    reference = make_tiny_model("llama", path, seed=21)
    return reference, open_model(path, dtype=torch.float32, device=CPU)


@pytest.mark.parametrize(("pipeline_depth", "kernel"), [(2, "native"), (1, "native"), (2, "bag")])
def test_greedy_continuous_batch_matches_transformers(
    tiny: Any, pipeline_depth: int, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 prompts x 32 tokens, chunked prefill (16-token budget), staggered arrivals; with
    the CPU's compiled decode attention and with its fallback (``TWOSTROKE_NATIVE=0``)."""
    _, loaded, prompts, expected = tiny
    monkeypatch.setenv(NATIVE_ENV, "0" if kernel == "bag" else "1")
    loaded = open_model(loaded.source, dtype=torch.float32, device=CPU)  # chosen at load
    runner = TorchModelRunner.from_loaded(loaded)
    runner.allocate_kv_cache(8, 4)
    assert runner.attention_kernel == kernel
    run = generate(
        loaded,
        prompts,
        [GREEDY] * len(prompts),
        arrivals=[0, 0, 0, 3, 3, 9, 9, 20],
        pipeline_depth=pipeline_depth,
    )
    assert [run.tokens[i] for i in range(len(prompts))] == expected
    assert run.statistics.num_preemptions == 0
    assert run.num_mixed_steps > 0


def test_blocks_are_zeroed_before_their_first_read(
    tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache is allocated unzeroed; NaN left in that memory never reaches attention.

    Preemption (a pool of 26 blocks) makes requests reuse blocks others wrote, and padded
    decode histories read slots past their lengths.
    """
    allocate = KVCache.allocate

    def garbage(**kwargs: Any) -> KVCache:
        cache = allocate(**kwargs)
        if not kwargs["zeroed"]:
            cache.data.fill_(float("nan"))
        return cache

    monkeypatch.setattr(KVCache, "allocate", garbage)
    _, loaded, prompts, expected = tiny
    run = generate(loaded, prompts, [GREEDY] * len(prompts), num_blocks=26)
    assert run.statistics.num_preemptions > 0
    assert [run.tokens[i] for i in range(len(prompts))] == expected


def test_preemption_gives_identical_tokens(tiny: Any) -> None:
    _, loaded, prompts, expected = tiny
    run = generate(loaded, prompts, [GREEDY] * len(prompts), num_blocks=26)
    assert run.statistics.num_preemptions > 0
    assert [run.tokens[i] for i in range(len(prompts))] == expected


def test_logprobs_match_transformers_log_softmax(tiny_llama: tuple[Any, LoadedModel]) -> None:
    reference, loaded = tiny_llama
    prompts = random_sequences([4, 17, 30], seed=2)
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, logprobs=0, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, logprobs=5, ignore_eos=True),
    ]
    run = generate(loaded, prompts, params)
    for index, (prompt, param) in enumerate(zip(prompts, params, strict=True)):
        sequence = prompt + run.tokens[index]
        with torch.no_grad():
            logits = reference(torch.tensor([sequence])).logits[0].float()
        expected = torch.log_softmax(logits, dim=-1)
        assert len(run.logprobs[index]) == param.max_tokens
        for step, entry in enumerate(run.logprobs[index]):
            row = expected[len(prompt) - 1 + step]
            assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
            assert param.logprobs is not None
            assert len(entry.top) == param.logprobs
            values, ids = row.topk(param.logprobs) if param.logprobs else (row[:0], row[:0])
            assert [token for token, _ in entry.top] == ids.tolist()
            for (_, value), want in zip(entry.top, values.tolist(), strict=True):
                assert value == pytest.approx(want, abs=1e-4)


def test_seeded_requests_ignore_batch_composition(tiny_llama: tuple[Any, LoadedModel]) -> None:
    """The same seeded request alone, then among others arriving in another order."""
    _, loaded = tiny_llama
    prompts = random_sequences([9, 14, 3, 25, 6], seed=8)
    seeded = [
        SamplingParams(max_tokens=20, temperature=1.0, seed=1, ignore_eos=True),
        SamplingParams(
            max_tokens=20, temperature=0.7, top_k=20, top_p=0.95, seed=2, ignore_eos=True
        ),
    ]
    alone = [generate(loaded, [prompts[i]], [seeded[i]]).tokens[0] for i in range(2)]
    others = [
        SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.5, seed=99, min_p=0.1, ignore_eos=True),
    ]
    mixed = generate(
        loaded,
        prompts[2:] + prompts[:2],
        others + seeded,
        arrivals=[0, 0, 0, 4, 1],
        max_num_batched_tokens=12,
        seed=77,
    )
    assert [mixed.tokens[3], mixed.tokens[4]] == alone
    assert alone[0] != generate(loaded, [prompts[0]], [attrs.evolve(seeded[0], seed=5)]).tokens[0]


def reference_penalized_greedy(
    loaded: LoadedModel, prompt: list[int], params: SamplingParams
) -> list[int]:
    tokens, output = list(prompt), []
    for _ in range(params.max_tokens):
        logits = loaded.module.forward_logits([tokens])[0][-1].tolist()
        penalized = reference_penalties(logits, prompt, output, params)
        token = max(range(len(penalized)), key=penalized.__getitem__)
        tokens.append(token)
        output.append(token)
    return output


@pytest.mark.parametrize("num_blocks", [256, 30], ids=["roomy", "preempting"])
def test_penalties_use_the_device_history(
    tiny_llama: tuple[Any, LoadedModel], num_blocks: int
) -> None:
    """Presence, frequency and repetition penalties under the lookahead, vs a plain loop."""
    _, loaded = tiny_llama
    prompts = random_sequences([5, 22, 40, 11], seed=9)
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, presence_penalty=1.5, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, frequency_penalty=0.7, ignore_eos=True),
        SamplingParams(
            max_tokens=24,
            temperature=0.0,
            repetition_penalty=2.0,
            presence_penalty=-0.5,
            frequency_penalty=0.3,
            ignore_eos=True,
        ),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    ]
    run = generate(loaded, prompts, params, num_blocks=num_blocks)
    if num_blocks == 30:
        assert run.statistics.num_preemptions > 0
    for index, (prompt, param) in enumerate(zip(prompts, params, strict=True)):
        assert run.tokens[index] == reference_penalized_greedy(loaded, prompt, param)


def test_repetition_penalty_matches_transformers(tiny_llama: tuple[Any, LoadedModel]) -> None:
    reference, loaded = tiny_llama
    prompts = random_sequences([6, 19], seed=10)
    params = SamplingParams(max_tokens=32, temperature=0.0, repetition_penalty=1.8, ignore_eos=True)
    run = generate(loaded, prompts, [params] * 2)
    for index, prompt in enumerate(prompts):
        assert run.tokens[index] == transformers_greedy(reference, prompt, repetition_penalty=1.8)


def test_decode_groups_gather_within_decode_gather_bytes(
    tiny_llama: tuple[Any, LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Long and short histories decoding together: no group gathers past the budget (unless
    one history alone is larger), and the tokens are those of an unbounded run. The
    native kernel reads no padding: its decodes stay one group whatever the budget."""
    _, loaded = tiny_llama
    built: list[AttentionMetadata] = []
    build = AttentionMetadata.build.__func__  # type: ignore[attr-defined]

    def spy(cls: type, *args: Any, **kwargs: Any) -> AttentionMetadata:
        built.append(build(cls, *args, **kwargs))
        return built[-1]

    monkeypatch.setattr(AttentionMetadata, "build", classmethod(spy))
    config = loaded.module.config
    block_size = 4
    per_position = 2 * config.num_kv_heads * config.head_dim * 4
    budget = 40 * per_position  # 40 padded key positions per group
    prompts = random_sequences([3, 60, 5, 7, 90, 4], seed=3)
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * len(prompts)
    # The bag kernel: the CPU's that cuts groups.
    bounded = generate(
        loaded,
        prompts,
        params,
        block_size=block_size,
        decode_gather_bytes=budget,
        attention_kernel="bag",
    )
    groups = [group for metadata in built for group in metadata.decode_groups]
    assert any(len(metadata.decode_groups) > 2 for metadata in built)
    assert any(group.num_decodes > 1 for group in groups)
    for group in groups:
        # Padded positions (the mask's width) of every decode: what the matmul and sdpa
        # kernels gather, and what the bag kernel scores in place.
        gathered = group.num_decodes * group.mask.shape[-1] * per_position
        assert gathered <= budget or group.num_decodes == 1, (group.num_decodes, gathered)
    built.clear()
    unbounded = generate(
        loaded,
        prompts,
        params,
        block_size=block_size,
        decode_gather_bytes=None,
        attention_kernel="bag",
    )
    assert max(len(metadata.decode_groups) for metadata in built) == 1  # CPU: no padding cut
    assert bounded.tokens == unbounded.tokens
    built.clear()
    # The kernel chosen at load: the compiled one.
    native = generate(loaded, prompts, params, block_size=block_size, decode_gather_bytes=budget)
    assert {metadata.kernel for metadata in built} == {"native"}
    assert max(len(metadata.decode_groups) for metadata in built) == 1
    assert native.tokens == unbounded.tokens
    with pytest.raises(ValueError, match=r"^decode_gather_bytes must be >= 1, got 0$"):
        TorchModelRunner.from_loaded(loaded, decode_gather_bytes=0)


# --- the protocol ---------------------------------------------------------------------------


def entry(request_id: int, start: int, token_ids: tuple[int, ...], **changes: Any) -> Any:
    fields: dict[str, Any] = {
        "request_id": request_id,
        "start": start,
        "token_ids": token_ids,
        "pending_input": False,
        "sample": True,
        "sample_index": 0,
        "num_prompt_tokens": start + len(token_ids),
        "block_table": (0, 1),
        "params": SamplingParams(temperature=0.0),
    }
    return ScheduledRequest(**{**fields, **changes})


def test_protocol_errors_leave_the_runner_usable(tiny_llama: tuple[Any, LoadedModel]) -> None:
    _, loaded = tiny_llama
    runner = TorchModelRunner.from_loaded(loaded, max_model_len=100)
    good = StepPlan(0, (entry(1, 0, (5, 6, 7)),))
    with pytest.raises(RunnerError, match=r"allocate_kv_cache\(\) must be called before execute"):
        runner.execute(good)
    runner.allocate_kv_cache(4, 4)
    with pytest.raises(RunnerError, match="the KV cache can be allocated only once"):
        runner.allocate_kv_cache(4, 4)
    first = runner.execute(good).readback().sampled[1]
    pending = StepPlan(1, (entry(2, 3, (), pending_input=True, sample_index=1),))
    with pytest.raises(
        RunnerError,
        match="step 1: request 2 has a pending input but the previous step sampled nothing for it",
    ):
        runner.execute(pending)
    with pytest.raises(
        RunnerError, match=r"step 2: token ids must be in \[0, 256\), got \[256, 999\]"
    ):
        runner.execute(StepPlan(2, (entry(3, 0, (1, 999, 256)),)))
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 4\), got \[7\]"):
        runner.execute(StepPlan(3, (entry(4, 0, (1, 2)), entry(5, 0, (3,), block_table=(7,)))))
    again = runner.execute(StepPlan(4, (entry(1, 0, (5, 6, 7)),))).readback()
    assert again.step_id == 4
    assert again.sampled == {1: first}


def test_pending_inputs_come_from_the_previous_step_on_the_device(
    tiny_llama: tuple[Any, LoadedModel],
) -> None:
    _, loaded = tiny_llama
    runner = TorchModelRunner.from_loaded(loaded)
    runner.allocate_kv_cache(8, 4)
    prompt = (9, 8, 7, 6, 5)
    first = runner.execute(StepPlan(0, (entry(1, 0, prompt, block_table=(3, 1)),)))
    second = runner.execute(
        StepPlan(1, (entry(1, 5, (), pending_input=True, sample_index=1, block_table=(3, 1)),))
    )
    token = first.readback().sampled[1]
    expected = loaded.module.forward_logits([[*prompt, token]])[0][-1].argmax().item()
    assert second.readback().sampled == {1: expected}


def test_an_attention_kernel_that_cannot_run_is_refused(
    tiny_llama: tuple[Any, LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, loaded = tiny_llama
    with pytest.raises(
        ValueError, match=r"^attention_kernel must be one of \(.*\) or None, got 'fast'$"
    ):
        loaded.plan.replanned(attention="fast")
    runner = TorchModelRunner.from_loaded(attending(loaded, "matmul"))
    runner.allocate_kv_cache(8, 4)
    assert runner.attention_kernel == "matmul"
    monkeypatch.setattr(attention_kernels, "paged_decode_kernel", lambda **shape: None)
    native = TorchModelRunner.from_loaded(attending(loaded, "native"))
    with pytest.raises(ValueError, match=r"^the 'native' kernel does not run for torch\.float32"):
        native.allocate_kv_cache(8, 4)


def test_sizes(tiny_llama: tuple[Any, LoadedModel]) -> None:
    _, loaded = tiny_llama
    runner = TorchModelRunner.from_loaded(loaded, max_model_len=10_000)
    assert runner.max_model_len == 512  # the model's own limit wins
    assert TorchModelRunner.from_loaded(loaded, max_model_len=64).max_model_len == 64
    # 3 layers x (K and V) x 16 positions x 2 kv heads x 16 wide x 4 bytes
    assert runner.kv_cache_bytes_per_block(16) == 3 * 2 * 16 * 2 * 16 * 4
    assert "LlamaForCausalLM" in repr(runner)
    assert "no KV cache" in repr(runner)
    with pytest.raises(ValueError, match="max_model_len must be >= 1, got 0"):
        TorchModelRunner.from_loaded(loaded, max_model_len=0)


# --- the default model ----------------------------------------------------------------------

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain gravity to a child in one sentence.",
]


@pytest.mark.slow
# A few seconds once the session's Hugging Face copy of SmolLM2 exists (the fixture spends
# about 20 s on transformers' GGUF reading on a 2-core AVX2 machine with another job busy);
# the timeout keeps room for making it here.
@pytest.mark.timeout(240)
def test_smollm2_greedy_matches_transformers_on_the_same_gguf(smollm2_hf_fp32: ModelSpec) -> None:
    """Chat prompts, 24 greedy tokens each, against transformers reading the same GGUF in fp32.

    transformers dequantized the GGUF itself (the session's Hugging Face copy of it, written
    by ``save_pretrained``), so the reference shares no loading code with twostroke. It checks
    our tokens by teacher forcing: one forward pass over prompt + our tokens, whose argmax at
    every position must be our next token. By induction that is exactly "transformers' greedy
    generate gives the same tokens", at a fraction of the time.
    """
    transformers = pytest.importorskip("transformers")

    loaded = open_model("smollm2", dtype=torch.float32, device=CPU)
    assert loaded.source == smollm2_hf_fp32.source
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_hf_fp32.hf_dir)
    prompts = []
    for text in CHAT_PROMPTS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    run = generate(
        loaded,
        prompts,
        [params] * len(prompts),
        block_size=16,
        num_blocks=64,
        max_num_batched_tokens=48,
    )
    del loaded

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_hf_fp32.hf_dir, dtype=torch.float32
    )
    reference.eval()
    for index, prompt in enumerate(prompts):
        tokens = run.tokens[index]
        assert len(tokens) == 24
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0]
        expected = logits[len(prompt) - 1 : -1].argmax(dim=-1).tolist()
        assert tokens == expected, CHAT_PROMPTS[index]
    assert "Paris" in tokenizer.decode(run.tokens[0])
