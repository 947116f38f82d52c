"""The torch model runner: step plans in, sampled tokens out, on the CPU or a CUDA device.

:class:`TorchModelRunner` implements :class:`~twostroke.engine.runners.protocol.ModelRunner` for the
Llama-family decoder. One :meth:`~TorchModelRunner.execute` builds the step's inputs, runs the
model over the paged cache and the sampler, and returns a
:class:`~twostroke.gpu.completion.Launched` whose ``readback`` gives the sampled ids.

The one-step lookahead happens here. A scheduled request with ``pending_input`` needs, as its
last input id, the token the previous step sampled for it; the host does not know that token
yet. The runner keeps the previous step's sampled-ids tensor on the device with a map from
request id to row, and copies the ids into this step's input on the device. Penalty history
is likewise updated on the device (see :class:`~twostroke.engine.runners.sampler.TokenHistory`).

On the CPU ``execute`` runs the step to the end (in the engine's worker thread) and returns
an event that has already fired. On CUDA it only enqueues: the sampled ids are copied
non-blocking into fresh pinned host memory, a fresh ``torch.cuda.Event`` is recorded after
the copy, and every tensor the step touches is kept alive in ``keepalive``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import attrs
import torch

from twostroke.engine.attention.kernels import AttentionKernel
from twostroke.engine.attention.kv_cache import KVCache
from twostroke.engine.attention.metadata import AttentionMetadata, ChunkSpec
from twostroke.engine.kernels.paged_attention import PagedDecodeKernel
from twostroke.engine.models.decoder import CausalLM
from twostroke.engine.models.loading import LoadedModel
from twostroke.engine.models.plan import RunPlan
from twostroke.engine.runners.errors import RunnerError
from twostroke.engine.runners.sampler import Sampler, SamplerOutput, TokenHistory
from twostroke.engine.runners.window_kv import WindowKV
from twostroke.engine.structured.masks import StepMasks
from twostroke.gpu.completion import Launched, ReadyEvent, SupportsQuery
from twostroke.gpu.staging import to_device
from twostroke.states.params import SamplingParams
from twostroke.states.plan import (
    RunnerOutput,
    ScheduledRequest,
    StepPlan,
    TokenLogprobs,
    verify_draft,
)

__all__ = ["DEFAULT_DECODE_GATHER_BYTES", "RunnerError", "TorchModelRunner"]

#: What one layer may gather for a group of decodes by default (see ``decode_gather_bytes``).
DEFAULT_DECODE_GATHER_BYTES = 256 << 20


@attrs.frozen
class _Staged:
    """Host views of a step's outputs: pinned copies on CUDA, the tensors themselves on CPU."""

    sampled: torch.Tensor
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


class TorchModelRunner:
    """Runs a :class:`CausalLM` over a paged KV cache, one step plan at a time.

    Args:
        model: The decoder, weights loaded.
        max_model_len: Caps the context below the model's own limit.
        max_num_seqs: The most requests the engine runs at once (sizes the penalty history
            it starts with; it grows if needed).
        seed: Seeds the sampling of unseeded requests (``None``: from the OS).
        decode_gather_bytes: The most bytes of padded history one layer gathers for a group
            of decodes (keys and values, in the model's dtype): the decodes of a step are
            cut into groups that stay under it, so the transient memory of decode attention
            is bounded whatever the mix of history lengths (one 8k-token request among 64
            decodes of an 8B model would otherwise pad every row to 8k: ~2 GiB a layer). A
            single decode whose own history is larger gets a group of its own, which takes
            its history's size (at most ``max_model_len`` positions). The KV cache is sized
            from what memory is left after this (``kv_cache_memory``), so keep it well
            under that margin. The CPU's in-place attention gathers nothing: the ``"bag"``
            kernel's groups are cut the same way (which bounds their padded scores), the
            ``"native"`` kernel's decodes are one group. ``None``: no bound.
        plan: The plan the model was loaded by (:meth:`from_loaded` gives it), which
            :attr:`plan` shows.
        swa_full: Where the model's sliding-window layers sit beside global ones (Gemma 2
            and 3), keep every position of their KV in the pool with the global layers'
            (llama.cpp's ``--swa-full``), so that prefix caching can serve them; by default
            they keep only their window, apart (:attr:`windowed_kv_window`).

    Raises:
        ValueError: ``max_model_len``, ``max_num_seqs`` or ``decode_gather_bytes`` below 1.
    """

    def __init__(
        self,
        model: CausalLM,
        *,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        seed: int | None = None,
        decode_gather_bytes: int | None = DEFAULT_DECODE_GATHER_BYTES,
        plan: RunPlan | None = None,
        swa_full: bool = False,
    ) -> None:
        for name, value in (
            ("max_model_len", max_model_len),
            ("max_num_seqs", max_num_seqs),
            ("decode_gather_bytes", decode_gather_bytes),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        # The attention, like every kernel, is the run's plan's, asked once when the model
        # loaded (RunPlan): the runner does not choose again.
        kernels = model.kernels
        self.kernels = kernels
        self._plan = plan
        self.model = model
        self.config = model.config
        self.device = model.device
        limit = model.config.max_position_embeddings
        self._max_model_len = limit if max_model_len is None else min(limit, max_model_len)
        self._history_capacity = min(max_num_seqs or 8, 64)
        self._sampler = Sampler(
            model.config.vocab_size, model.device, seed=seed, argmax=kernels.glue.argmax
        )
        self._history: TokenHistory | None = None
        self._cache: KVCache | None = None
        self._swa_full = swa_full
        self._window_kv: WindowKV | None = None  # the windowed layers' tables, if apart
        # The chosen attention, the compiled kernel built for the cache's blocks: set once.
        self._attention: AttentionKernel | PagedDecodeKernel = kernels.attention
        self._zeroed = bytearray()  # per KV block: zeroed since allocation
        self._previous_sampled: torch.Tensor | None = None
        self._previous_rows: dict[int, int] = {}
        self._num_steps = 0
        config = model.config
        per_position = 2 * config.num_kv_heads * config.head_dim * model.cache_dtype.itemsize
        self._max_decode_positions = (
            None if decode_gather_bytes is None else max(1, decode_gather_bytes // per_position)
        )

    @classmethod
    def from_loaded(
        cls,
        loaded: LoadedModel,
        *,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        seed: int | None = None,
        decode_gather_bytes: int | None = DEFAULT_DECODE_GATHER_BYTES,
        swa_full: bool = False,
    ) -> TorchModelRunner:
        """A runner for a model :func:`~twostroke.engine.models.loading.load_model` loaded.

        Args:
            loaded: The loaded model.
            max_model_len: See the class.
            max_num_seqs: See the class.
            seed: See the class.
            decode_gather_bytes: See the class.
            swa_full: See the class.

        Returns:
            The runner (its KV cache is allocated later, by the engine).
        """
        return cls(
            loaded.module,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            seed=seed,
            decode_gather_bytes=decode_gather_bytes,
            plan=loaded.plan,
            swa_full=swa_full,
        )

    def __repr__(self) -> str:
        cache = "no KV cache" if self._cache is None else f"{self._cache.num_blocks} KV blocks"
        return (
            f"<TorchModelRunner {self.config.architecture} {self.model.dtype} on "
            f"{self.device}, {cache}, {self._num_steps} steps>"
        )

    # --- the ModelRunner protocol ---------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt and output) the model accepts."""
        return self._max_model_len

    @property
    def plan(self) -> RunPlan:
        """What the run decided about its model
        (:class:`~twostroke.engine.models.plan.RunPlan`), where the runner was made from a
        loaded model (:meth:`from_loaded`).

        Raises:
            AttributeError: a runner made from a bare module has none.
        """
        if self._plan is None:
            raise AttributeError("this runner was made from a module, not a planned load")
        return self._plan

    @property
    def attention_kernel(self) -> AttentionKernel:
        """How decodes attend: the run's plan's, chosen when the model loaded."""
        return self.kernels.attention

    @property
    def deterministic(self) -> bool:
        """Whether its kernels are batch-invariant (:attr:`CpuKernels.deterministic
        <twostroke.engine.models.choice.CpuKernels.deterministic>`)."""
        return self.kernels.deterministic

    @property
    def kv_window(self) -> int | None:
        """The sliding window where every layer has it (Mistral; not Gemma 3, whose global
        layers see every position), else ``None``: see
        :class:`~twostroke.engine.runners.protocol.WindowedRunner`."""
        config = self.config
        if config.sliding_window is None or config.global_layers:
            return None
        return config.sliding_window

    @property
    def windowed_kv_window(self) -> int | None:
        """The window of the sliding-window layers where they keep their KV apart from the
        global layers' and only as far back as it (Gemma 2 and 3, unless ``swa_full``; a
        window shorter than the context), else ``None``: see
        :mod:`~twostroke.engine.runners.window_kv`. The global layers' blocks are the
        scheduler's pool; a prefix-cache hit cannot be served (the windowed KV of the
        positions it skips is not kept)."""
        config = self.config
        window = config.sliding_window
        if self._swa_full or window is None or not config.global_layers:
            return None
        return window if window < self._max_model_len else None

    @property
    def num_windowed_blocks(self) -> int:
        """Blocks of the windowed layers' own KV, allocated (0 before, and without)."""
        return 0 if self._cache is None else self._cache.num_windowed_blocks

    def _bytes_per_block(self, num_layers: int, block_size: int) -> int:
        config = self.config
        return KVCache.bytes_per_block(
            num_layers=num_layers,
            block_size=block_size,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=self.model.cache_dtype,
        )

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes of KV cache one block of ``block_size`` positions of the pool takes: every
        layer's, or the global layers' where the windowed layers keep theirs apart."""
        apart = len(self.model.local_layers) if self.windowed_kv_window is not None else 0
        return self._bytes_per_block(self.config.num_layers - apart, block_size)

    def windowed_kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block of the windowed layers' own KV takes (0 where they keep none
        apart: :attr:`windowed_kv_window`)."""
        if self.windowed_kv_window is None:
            return 0
        return self._bytes_per_block(len(self.model.local_layers), block_size)

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, *, num_windowed_blocks: int = 0
    ) -> None:
        """Create the paged KV cache. Called once, before the first step.

        Args:
            num_blocks: Blocks of the pool the scheduler hands out.
            block_size: Positions per block.
            num_windowed_blocks: Blocks of the windowed layers' own KV, where they keep it
                apart (:attr:`windowed_kv_window`; the scheduler's
                :class:`~twostroke.states.windowed.WindowedKV` admits against them); 0
                elsewhere.

        Raises:
            RunnerError: the cache exists already.
            ValueError: ``num_blocks`` or ``block_size`` below 1, ``num_windowed_blocks``
                below 2 for a model that keeps its windowed KV apart (or given to one that
                does not), or the ``"native"`` attention where it does not run for these
                blocks (see :meth:`CausalLM.attention_for
                <twostroke.engine.models.decoder.CausalLM.attention_for>`).
        """
        if self._cache is not None:
            raise RunnerError("the KV cache can be allocated only once")
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        window = self.windowed_kv_window
        if (window is None) != (num_windowed_blocks == 0):
            raise ValueError(
                f"num_windowed_blocks must be >= 2 exactly where the windowed layers keep "
                f"their KV apart (window {window}), got {num_windowed_blocks}"
            )
        # The compiled attention is built for these blocks here, once (it fails here, not in
        # a step); every step's layout receives it.
        self._attention = self.model.attention_for(block_size, self.kernels.attention)
        if window is not None:
            self._window_kv = WindowKV(
                num_blocks=num_windowed_blocks, block_size=block_size, window=window
            )
        # Unzeroed: each block is zeroed the first time a step writes it (see KVCache).
        self._cache = self.model.allocate_kv_cache(
            num_blocks, block_size, zeroed=False, num_windowed_blocks=num_windowed_blocks
        )
        self._zeroed = bytearray(num_blocks)
        self._zero_new_blocks([0], self._cache)  # padded decode histories read block 0

    def execute(self, plan: StepPlan) -> Launched[RunnerOutput]:
        """Launch one step without constraints (see :meth:`execute_masked`)."""
        return self.execute_masked(plan, None)

    def execute_masked(self, plan: StepPlan, masks: StepMasks | None) -> Launched[RunnerOutput]:
        """Launch one step (on the CPU: run it) and return how to read its tokens back.

        The constrained rows (those of ``masks``) sample under their masks: once the layers
        are launched, this waits on the device's thread for the bookkeeping stroke to fill
        them (on CUDA the layers run meanwhile), copies them to the device and sets the
        logits they leave out to ``-inf``. A step without constrained rows never waits.

        Args:
            plan: The step; plans must come in the scheduler's order.

        Returns:
            The launched step; its ``readback`` gives the sampled ids and any logprobs.

        Raises:
            RunnerError: no KV cache, a pending input with no sample from the previous step,
                or a token id outside the vocabulary. The runner stays usable.
            ValueError: a block table does not cover its positions.
        """
        if self._cache is None:
            raise RunnerError("allocate_kv_cache() must be called before execute()")
        try:
            with torch.inference_mode():
                return self._execute(plan, self._cache, masks)
        except BaseException:
            # A failed step fails all its requests, so nothing may refer to its samples.
            self._previous_sampled = None
            self._previous_rows = {}
            raise

    # --- one step -------------------------------------------------------------------------

    def _execute(
        self, plan: StepPlan, cache: KVCache, masks: StepMasks | None = None
    ) -> Launched[RunnerOutput]:
        history = self._history
        if history is not None:
            for request_id in plan.finished_request_ids:
                history.release(request_id)
        # Single-token chunks first, longest first: the attention batches them, in groups
        # of similar lengths.
        entries = sorted(plan.requests, key=_batch_order)
        input_ids, pending_rows, pending_sources, logit_rows = self._layout(plan, entries)
        device = self.device
        ids = to_device(input_ids, device=device)
        if pending_rows:
            assert self._previous_sampled is not None
            sources = self._previous_sampled.index_select(
                0, to_device(pending_sources, device=device)
            )
            ids.index_copy_(0, to_device(pending_rows, device=device), sources)
        layout = partial(
            AttentionMetadata.build,
            block_size=cache.block_size,
            num_kv_heads=self.config.num_kv_heads,
            dtype=self.model.dtype,
            device=device,
            kernel=self._attention,
            max_decode_positions=self._max_decode_positions,
            num_heads=self.config.num_heads,
            head_dim=self.config.head_dim,
        )
        metadata = layout(
            [ChunkSpec(entry.start, entry.num_tokens, entry.block_table) for entry in entries],
            num_blocks=cache.num_blocks,
        )
        window_kv = self._window_kv
        if window_kv is not None:
            metadata = metadata.with_windowed_layout(
                layout(self._windowed_chunks(plan, entries, window_kv, cache),
                       num_blocks=cache.num_windowed_blocks)
            )  # fmt: skip
        # Every block a step reads was written by this step or an earlier one, except block 0
        # (padding): zeroing the blocks this step writes covers everything read.
        written: list[int] = []
        for entry in entries:
            table = entry.block_table
            written.extend(
                table[entry.start // cache.block_size : -(-entry.end // cache.block_size)]
            )
        self._zero_new_blocks(written, cache)
        logits = self.model(ids, metadata, cache, to_device(logit_rows, device=device))
        if window_kv is not None:
            for entry in entries:
                window_kv.settle(entry.request_id, entry.end, len(entry.draft_token_ids))

        sampling = [entry for entry in entries if entry.sample]
        # A row with drafts samples at each of its last 1 + k positions, as a row without
        # drafts would there: the same parameters, the sample index of that output token.
        first_rows: list[int] = []
        row_params: list[SamplingParams] = []
        row_indices: list[int] = []
        for entry in sampling:
            first_rows.append(len(row_params))
            for offset in range(entry.num_samples):
                row_params.append(entry.params)
                row_indices.append(entry.sample_index + offset)
        bitmask = None
        if masks is not None:
            bitmask = self._apply_masks(logits, sampling, first_rows, masks)
        batch = self._sampler.prepare(row_params, row_indices)
        slots = self._record_prompts(entries, sampling)
        token_history = None
        if slots is not None:
            assert self._history is not None
            token_history = self._history.gather(slots)
        output = self._sampler.sample(logits, batch, token_history)
        if slots is not None:
            assert self._history is not None
            assert batch.penalty_rows is not None
            self._history.count(slots, output.sampled.index_select(0, batch.penalty_rows))

        self._previous_sampled = output.sampled
        # No step takes a pending input from a row with drafts: the scheduler plans none
        # until its drafts are verified, and a plan that did would find no row here.
        self._previous_rows = {
            entry.request_id: row
            for row, entry in zip(first_rows, sampling, strict=True)
            if not entry.draft_token_ids
        }
        self._num_steps += 1
        staged = _stage(output, device)
        readback = _readback(
            plan.step_id, sampling, first_rows, batch.logprob_rows, batch.num_logprobs, staged
        )
        keepalive = (ids, metadata, logits, output, staged, token_history, bitmask)
        event: SupportsQuery = ReadyEvent()
        if device.type == "cuda":
            cuda_event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            cuda_event.record()
            event = cuda_event
        return Launched(event, readback, keepalive)

    def _apply_masks(
        self,
        logits: torch.Tensor,
        sampling: list[ScheduledRequest],
        first_rows: list[int],
        masks: StepMasks,
    ) -> torch.Tensor | None:
        """Wait for the constrained rows' masks and apply them to their logits, in place.

        A request's logits rows start at its ``first_rows`` entry, one per position it
        samples at (more than one with drafts), as its mask rows do.
        """
        rows: list[int] = []
        mask_rows: list[int] = []
        for first, entry in zip(first_rows, sampling, strict=True):
            start = masks.rows.get(entry.request_id)
            if start is None:
                continue
            rows.extend(range(first, first + entry.num_samples))
            mask_rows.extend(range(start, start + entry.num_samples))
        if not rows:
            return None
        from twostroke.engine.structured.bitmask import apply_bitmask

        host = masks.wait()
        picked = host.index_select(0, torch.tensor(mask_rows))
        if self.device.type == "cuda":
            picked = picked.pin_memory()
        bitmask = picked.to(self.device, non_blocking=True)
        apply_bitmask(logits, bitmask, to_device(rows, device=self.device))
        return bitmask

    @staticmethod
    def _windowed_chunks(
        plan: StepPlan, entries: list[ScheduledRequest], window_kv: WindowKV, cache: KVCache
    ) -> list[ChunkSpec]:
        """The step's chunks over the windowed layers' own tables (taking their blocks):
        the requests the plan says are gone or preempted give theirs back first."""
        for request_id in (*plan.finished_request_ids, *plan.preempted_request_ids):
            window_kv.drop(request_id)
        chunks = []
        for entry in entries:
            table, taken = window_kv.table(entry.request_id, entry.start, entry.end)
            cache.zero_windowed_blocks(taken)  # another request's KV was there
            chunks.append(ChunkSpec(entry.start, entry.num_tokens, table))
        return chunks

    def _zero_new_blocks(self, block_ids: list[int], cache: KVCache) -> None:
        zeroed = self._zeroed
        fresh = [block for block in block_ids if not zeroed[block]]
        if fresh:
            cache.zero_blocks(fresh)
            for block in fresh:
                zeroed[block] = 1

    def _layout(
        self, plan: StepPlan, entries: list[ScheduledRequest]
    ) -> tuple[list[int], list[int], list[int], list[int]]:
        """Input ids (0 where pending), where pending ids go and come from, and logit rows."""
        input_ids: list[int] = []
        pending_rows: list[int] = []
        pending_sources: list[int] = []
        logit_rows: list[int] = []
        for entry in entries:
            input_ids.extend(entry.token_ids)
            if entry.pending_input:
                row = self._previous_rows.get(entry.request_id)
                if row is None:
                    raise RunnerError(
                        f"step {plan.step_id}: request {entry.request_id} has a pending input "
                        "but the previous step sampled nothing for it"
                    )
                pending_rows.append(len(input_ids))
                pending_sources.append(row)
                input_ids.append(0)
            input_ids.extend(entry.draft_token_ids)
            if entry.sample:
                end = len(input_ids)
                logit_rows.extend(range(end - entry.num_samples, end))
        vocab = self.config.vocab_size
        if input_ids and not 0 <= min(input_ids) <= max(input_ids) < vocab:
            bad = sorted({i for i in input_ids if not 0 <= i < vocab})
            raise RunnerError(
                f"step {plan.step_id}: token ids must be in [0, {vocab}), got {bad[:10]}"
            )
        return input_ids, pending_rows, pending_sources, logit_rows

    def _record_prompts(
        self, entries: list[ScheduledRequest], sampling: list[ScheduledRequest]
    ) -> torch.Tensor | None:
        """Add prompt tokens of penalized requests to their history; their slots, row order."""
        penalized = [entry for entry in entries if entry.params.uses_penalties]
        if not penalized:
            return None
        if self._history is None:
            self._history = TokenHistory(
                self.config.vocab_size, self.device, capacity=self._history_capacity
            )
        history = self._history
        for entry in penalized:
            prompt_end = min(entry.end, entry.num_prompt_tokens)
            if entry.start < prompt_end:
                prompt_ids = entry.token_ids[: prompt_end - entry.start]
                history.add_prompt(entry.request_id, entry.start, prompt_ids)
            else:
                history.slot(entry.request_id)
        slots = [history.slot(e.request_id) for e in sampling if e.params.uses_penalties]
        return to_device(slots, device=self.device) if slots else None


def _batch_order(entry: ScheduledRequest) -> tuple[bool, int]:
    decode = entry.num_tokens == 1
    return not decode, -entry.start if decode else 0


def _stage(output: SamplerOutput, device: torch.device) -> _Staged:
    """Start copying the outputs to host memory (pinned and non-blocking on CUDA)."""

    def host(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None or device.type != "cuda":
            return tensor
        # A fresh buffer per step: one a copy in flight may still write is never reused.
        pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return pinned.copy_(tensor, non_blocking=True)

    sampled = host(output.sampled)
    assert sampled is not None
    return _Staged(
        sampled=sampled,
        logprobs=host(output.logprobs),
        top_ids=host(output.top_ids),
        top_logprobs=host(output.top_logprobs),
    )


def _readback(
    step_id: int,
    sampling: list[ScheduledRequest],
    first_rows: list[int],
    logprob_rows: tuple[int, ...],
    num_logprobs: tuple[int, ...],
    staged: _Staged,
) -> Callable[[], RunnerOutput]:
    def readback() -> RunnerOutput:
        tokens = staged.sampled.tolist()
        by_row: dict[int, TokenLogprobs] = {}
        if logprob_rows:
            assert staged.logprobs is not None
            chosen = staged.logprobs.tolist()
            top_ids = staged.top_ids.tolist() if staged.top_ids is not None else None
            top_values = staged.top_logprobs.tolist() if staged.top_logprobs is not None else None
            for index, (row, count) in enumerate(zip(logprob_rows, num_logprobs, strict=True)):
                top: tuple[tuple[int, float], ...] = ()
                if count and top_ids is not None and top_values is not None:
                    top = tuple(zip(top_ids[index][:count], top_values[index][:count], strict=True))
                by_row[row] = TokenLogprobs(token_id=tokens[row], logprob=chosen[index], top=top)
        sampled: dict[int, int] = {}
        speculated: dict[int, tuple[int, ...]] = {}
        logprobs: dict[int, TokenLogprobs] = {}
        speculated_logprobs: dict[int, tuple[TokenLogprobs, ...]] = {}
        for first, entry in zip(first_rows, sampling, strict=True):
            request_id = entry.request_id
            drafts = entry.draft_token_ids
            rows = range(first, first + entry.num_samples)
            # The tokens up to the first that differs from its draft: what the request would
            # have sampled one step at a time.
            kept = rows[: verify_draft(drafts, tokens[first : rows.stop]) + 1]
            sampled[request_id] = tokens[first]
            if first in by_row:
                logprobs[request_id] = by_row[first]
            if drafts:
                speculated[request_id] = tuple(tokens[row] for row in kept[1:])
                if first in by_row:
                    speculated_logprobs[request_id] = tuple(by_row[row] for row in kept[1:])
        return RunnerOutput(
            step_id=step_id,
            sampled=sampled,
            logprobs=logprobs,
            speculated=speculated,
            speculated_logprobs=speculated_logprobs,
        )

    return readback
