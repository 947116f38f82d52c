"""The windowed layers' own KV (Gemma 2 and 3): kept to the window, and never short.

The tables are checked on the scheduler's own plans over the simulated device (every key a
query's window reads is the one its request wrote there, and a pool the scheduler admits
against, from the longest request's need to ``max_num_seqs`` whole windows, never runs out,
through chunks, drafts, preemptions and either pipeline depth); the tokens on a tiny
Gemma 3 through the runner, against transformers and against the same model keeping every
position (``swa_full``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.models import parity
from tests.engine.models.test_llama import random_sequences
from tests.engine.runners.test_torch import GREEDY, generate
from twostroke.engine.models.loading import LoadedModel, open_model
from twostroke.engine.runners.torch import RunnerError, TorchModelRunner
from twostroke.engine.runners.window_kv import WindowKV
from twostroke.states.blocks import blocks_for
from twostroke.states.params import SamplingParams
from twostroke.states.plan import RunnerOutput, StepPlan
from twostroke.states.request import Request
from twostroke.states.scheduler import Scheduler, SchedulerConfig
from twostroke.states.simulation import SimulatedKV
from twostroke.states.testing import windowed_pools
from twostroke.states.testing.harness import SimulatedEngine
from twostroke.states.windowed import window_pool_blocks

# --- the tables, alone ------------------------------------------------------------------------


def test_a_table_covers_the_row_and_pads_what_is_behind_the_window() -> None:
    pool = WindowKV(num_blocks=8, block_size=4, window=6)
    table, taken = pool.table(7, 0, 10)  # a prefill of 10 positions: blocks 0-2
    assert table == tuple(taken) == (1, 2, 3)
    pool.settle(7, 10, 0)  # the next query is at 10 and sees 5..10: blocks 1.. stay
    assert pool.held(7) == 2
    assert pool.num_free == 5
    table, taken = pool.table(7, 10, 13)  # keys from 5: block 1 on, block 3 new
    assert (table, taken) == ((0, 2, 3, 4), [4])
    pool.drop(7)
    pool.drop(7)  # idempotent
    assert pool.held(7) == 0
    assert pool.num_free == 7


def test_what_no_table_can_serve_is_a_runner_error() -> None:
    pool = WindowKV(num_blocks=4, block_size=4, window=4)
    with pytest.raises(RunnerError, match="starts at position 8, but the windowed layers hold"):
        pool.table(1, 8, 9)  # a prefix-cache hit: the windowed KV before 8 is nowhere
    pool.table(1, 0, 12)
    pool.settle(1, 12, 0)
    with pytest.raises(RunnerError, match="starts at position 2, behind the windowed KV"):
        pool.table(1, 2, 3)
    with pytest.raises(
        RunnerError, match="pool of 4 blocks has 2 free, and request 2 needs 3 more"
    ):
        pool.table(2, 0, 12)


def test_the_pool_size_is_checked() -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        WindowKV(num_blocks=1, block_size=4, window=4)
    with pytest.raises(ValueError, match="max_drafts must be >= 0, got -1"):
        window_pool_blocks(
            window=4, block_size=4, max_num_seqs=1, max_num_batched_tokens=4, max_drafts=-1
        )
    # 1 padding + 2 requests x (blocks_for(4 - 1 + 2) + 2) + blocks_for(8)
    assert (
        window_pool_blocks(
            window=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=8, max_drafts=2
        )
        == 1 + 2 * 4 + 2
    )


# --- the tables on the scheduler's plans --------------------------------------------------------


class CheckedTables(SimulatedKV):
    """The simulated device, and beside it the windowed layers' tables: each position a row
    computes is written to its table's slot, and each key a query's window reads must be
    the one its own request wrote at that position."""

    def __init__(self, kv: SimulatedKV, pool: WindowKV, max_drafts: int) -> None:
        self.__dict__.update(kv.__dict__)
        self.pool = pool
        self.max_drafts = max_drafts
        self.slots: dict[tuple[int, int], tuple[int, int]] = {}

    def execute(self, plan: StepPlan, allowed: Any = None) -> RunnerOutput:
        pool, size, window = self.pool, self.pool.block_size, self.pool.window
        for request_id in (*plan.finished_request_ids, *plan.preempted_request_ids):
            pool.drop(request_id)
        tables = {}
        for entry in plan.requests:
            table, taken = pool.table(entry.request_id, entry.start, entry.end)
            for block in taken:  # zeroed: what was there is gone
                for offset in range(size):
                    self.slots.pop((block, offset), None)
            tables[entry.request_id] = table
        for entry in plan.requests:
            table = tables[entry.request_id]
            assert len(table) >= blocks_for(entry.end, size)  # (more after rejected drafts)
            for position in range(entry.start, entry.end):
                self.slots[table[position // size], position % size] = (entry.request_id, position)
            for query in range(entry.start, entry.end):
                for key in range(max(query - window + 1, 0), query + 1):
                    block = table[key // size]
                    assert block != 0, f"position {key} of {entry.request_id} is padding"
                    assert self.slots.get((block, key % size)) == (entry.request_id, key)
        for entry in plan.requests:
            pool.settle(entry.request_id, entry.end, len(entry.draft_token_ids))
            assert pool.held(entry.request_id) <= blocks_for(window - 1 + self.max_drafts, size) + 1
        return super().execute(plan, allowed)


@settings(max_examples=80, deadline=None)
@given(
    window=st.integers(1, 12),
    block_size=st.integers(1, 5),
    budget=st.integers(1, 16),
    max_num_seqs=st.integers(1, 4),
    depth=st.integers(1, 2),
    drafts=st.sampled_from([0, 3]),
    spare=st.integers(0, 6),
    requests=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 16)), min_size=1, max_size=6),
    data=st.data(),
)
def test_the_tables_hold_every_window_and_the_pool_never_runs_out(
    window: int,
    block_size: int,
    budget: int,
    max_num_seqs: int,
    depth: int,
    drafts: int,
    spare: int,
    requests: list[tuple[int, int]],
    data: st.DataObject,
) -> None:
    """The windowed pool anywhere from what the longest request alone needs to what
    max_num_seqs whole windows take: the scheduler admits by reservations, the runner's
    tables never run out and always hold each query's window."""
    longest = max(prompt + tokens for prompt, tokens in requests)
    speculative = {"method": "ngram", "num_speculative_tokens": drafts} if drafts else None
    windowed = data.draw(
        windowed_pools(
            window=window,
            block_size=block_size,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            max_drafts=drafts,
            totals=[prompt + tokens for prompt, tokens in requests],
        )
    )
    config = SchedulerConfig(
        # A pool the longest request fits, with a few blocks more: others preempt.
        num_blocks=blocks_for(longest, block_size) + spare,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=longest + 1,
        pipeline_depth=depth,
        enable_prefix_caching=False,
        speculative_config=speculative,
        windowed_kv=windowed,
    )
    engine = SimulatedEngine(Scheduler(config))
    pool = WindowKV(num_blocks=windowed.num_blocks, block_size=block_size, window=window)
    engine.kv = CheckedTables(engine.kv, pool, drafts)
    for index, (prompt, tokens) in enumerate(requests):
        ids = [(index * 7 + i) % 5 for i in range(prompt)]  # repetitive: drafts find matches
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        engine.submit(Request(index, ids, params, 0.0))
    for _ in range(2000):
        if not engine.advance():
            break
        engine.check()
    engine.check_idle()


# --- the tokens of a tiny Gemma 3 --------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, LoadedModel]:
    """Windows of 6 positions on prompts of 9-23 and 32 tokens more: a global layer between
    windowed ones."""
    path = tmp_path_factory.mktemp("gemma3")
    reference = parity.make_model(
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        path,
        seed=3,
        head_dim=16,
        sliding_window=6,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    return reference, path, open_model(path, dtype=torch.float32, device=parity.CPU)


PROMPT_LENGTHS = [9, 23, 14, 11]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"pipeline_depth": 1, "max_num_batched_tokens": 5},
        {"num_blocks": 20},  # global blocks of 4 for 55 positions at most: preemptions
    ],
    ids=["batched", "serial-chunked", "preempted"],
)
def test_gemma3_keeps_its_window_and_transformers_tokens(
    gemma3: tuple[Any, Path, LoadedModel], options: dict[str, Any]
) -> None:
    reference, _, loaded = gemma3
    prompts = random_sequences(PROMPT_LENGTHS, seed=4)
    window = loaded.config.sliding_window
    assert window == 6
    most = blocks_for(window - 1, 4) + 1

    def bounded(runner: TorchModelRunner, scheduler: Scheduler) -> None:
        pool = runner._window_kv
        assert pool is not None
        assert all(pool.held(request.request_id) <= most for request in scheduler)

    run = generate(loaded, prompts, [GREEDY] * len(prompts), after_step=bounded, **options)
    full = generate(loaded, prompts, [GREEDY] * len(prompts), swa_full=True, **options)
    expected = [parity.greedy(reference, prompt)[len(prompt) :] for prompt in prompts]
    assert [run.tokens[i] for i in range(len(prompts))] == expected
    assert run.tokens == full.tokens
    if "num_blocks" in options:
        assert run.statistics.num_preemptions > 0


def test_the_pool_holds_the_global_layers_and_the_window_its_own(
    gemma3: tuple[Any, Path, LoadedModel],
) -> None:
    _, _, loaded = gemma3
    apart = TorchModelRunner.from_loaded(loaded)
    full = TorchModelRunner.from_loaded(loaded, swa_full=True)
    assert (apart.windowed_kv_window, full.windowed_kv_window) == (6, None)
    # Three layers: one global in the pool, two windowed apart.
    assert apart.kv_cache_bytes_per_block(4) * 3 == full.kv_cache_bytes_per_block(4)
    assert apart.windowed_kv_bytes_per_block(4) == 2 * apart.kv_cache_bytes_per_block(4)
    assert full.windowed_kv_bytes_per_block(4) == 0
    with pytest.raises(ValueError, match="num_windowed_blocks must be >= 2 exactly where"):
        apart.allocate_kv_cache(8, 4)
    with pytest.raises(ValueError, match="num_windowed_blocks must be >= 2 exactly where"):
        full.allocate_kv_cache(8, 4, num_windowed_blocks=8)
    apart.allocate_kv_cache(8, 4, num_windowed_blocks=9)
    cache = apart._cache
    assert cache is not None
    assert cache.windowed is not None
    assert (cache.data.shape[0], cache.windowed.shape[0], cache.num_windowed_blocks) == (1, 2, 9)
    assert cache.windowed_layers == (0, 2)
