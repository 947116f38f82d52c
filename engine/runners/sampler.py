"""The sampler: one batched pass from a step's logits to one token per request, on the device.

vLLM's semantics, in vLLM's order: penalties on the raw logits (repetition over prompt and
output, presence and frequency over output only); greedy rows take the argmax of that;
random rows divide by their temperature, drop tokens under ``min_p`` times the top
probability, keep the top-k and then the top-p nucleus, and draw by the exponential race
(``argmax(p / q)`` with ``q ~ Exp(1)``, which picks token ``i`` with probability ``p_i``).
Log-probabilities are those of the raw logits (vLLM's default ``raw_logprobs``).

Seeded requests are reproducible whatever else is batched: the noise of a seeded row comes
from a generator seeded by ``(seed, sample_index)`` alone, so the n-th token of a request
gets the same draw in any batch, order or step. Unseeded rows share one generator call.

Penalties need each request's token history *including the token the previous step sampled*
(which the host does not know yet, under the one-step lookahead), so the history lives on the
device (:class:`TokenHistory`) and is updated there from the sampled ids.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import attrs
import torch

from twostroke.gpu.staging import to_device
from twostroke.states.params import SamplingParams

__all__ = ["Sampler", "SamplerOutput", "SamplingBatch", "TokenHistory", "draw_seed"]

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, sample_index: int) -> int:
    """The generator seed for output token ``sample_index`` of a request seeded with ``seed``.

    SplitMix64 of the pair: neighbouring indices and seeds give unrelated streams, and the
    value depends on nothing else (not the batch, not the process).
    """
    x = (seed ^ (sample_index * 0x9E3779B97F4A7C15)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1  # torch seeds are signed 64-bit


def _rows(indices: list[int], device: torch.device) -> torch.Tensor | None:
    return to_device(indices, device=device) if indices else None


def _floats(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(values, device=device, dtype=torch.float32)


@attrs.frozen
class SamplingBatch:
    """The sampling parameters of one step's rows, as device tensors.

    Build it with :meth:`Sampler.prepare`. Row ``i`` is row ``i`` of the logits.

    Attributes:
        num_rows: Rows of the logits.
        random_rows: Rows drawn at random (the rest are greedy), or ``None``.
        temperature: ``[len(random_rows)]``.
        min_p: ``[len(random_rows)]``, or ``None`` when no random row uses it.
        top_k: ``[len(random_rows)]`` (vocabulary size when off), or ``None``.
        max_top_k: The largest of ``top_k`` (known on the host, so no device sync).
        top_p: ``[len(random_rows)]`` (1 when off), or ``None``.
        seeds: ``(index into random_rows, generator seed)`` for seeded random rows.
        num_unseeded: Random rows without a seed.
        penalty_rows: Rows with penalties, or ``None``.
        repetition_penalty: ``[len(penalty_rows)]``.
        presence_penalty: ``[len(penalty_rows)]``.
        frequency_penalty: ``[len(penalty_rows)]``.
        logprob_rows: Rows that want log-probabilities (host indices).
        num_logprobs: Alternatives each of ``logprob_rows`` wants.
    """

    num_rows: int
    random_rows: torch.Tensor | None = None
    temperature: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    max_top_k: int = 0
    top_p: torch.Tensor | None = None
    seeds: tuple[tuple[int, int], ...] = ()
    num_unseeded: int = 0
    penalty_rows: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    logprob_rows: tuple[int, ...] = ()
    num_logprobs: tuple[int, ...] = ()


@attrs.frozen
class SamplerOutput:
    """What the sampler produced, still on the device.

    Attributes:
        sampled: ``[num_rows]`` token ids.
        logprobs: ``[len(logprob_rows)]`` log-probability of each chosen token, or ``None``.
        top_ids: ``[len(logprob_rows), max(num_logprobs)]`` most likely ids, or ``None``.
        top_logprobs: Their log-probabilities, same shape, or ``None``.
    """

    sampled: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


class Sampler:
    """Samples one token per row of a logits matrix.

    Args:
        vocab_size: Columns of the logits.
        device: Where the logits live.
        seed: Seeds the generator shared by unseeded rows (``None``: from the OS).
        argmax: Takes the greedy rows' tokens from float32 logits ``[rows, vocab]``, as
            ``torch.argmax(logits, dim=-1)`` does (ties and NaN included); ``None`` takes
            that. The CPU runner passes the decoder glue's compiled one
            (:meth:`~twostroke.engine.kernels.glue.DecoderGlue.argmax`).
    """

    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        *,
        seed: int | None = None,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._argmax = argmax
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(random.SystemRandom().getrandbits(63) if seed is None else seed)

    def prepare(
        self, params: Sequence[SamplingParams], sample_indices: Sequence[int]
    ) -> SamplingBatch:
        """Gather the rows' parameters into device tensors.

        Args:
            params: Each row's sampling parameters.
            sample_indices: Each row's index in its request's output (seeds the draw).

        Returns:
            The batch, ready for :meth:`sample`.
        """
        device = self.device
        random_rows: list[int] = []
        temperature: list[float] = []
        min_p: list[float] = []
        top_k: list[int] = []
        top_p: list[float] = []
        seeds: list[tuple[int, int]] = []
        penalty_rows: list[int] = []
        penalties: tuple[list[float], list[float], list[float]] = ([], [], [])
        logprob_rows: list[int] = []
        num_logprobs: list[int] = []
        for row, (param, index) in enumerate(zip(params, sample_indices, strict=True)):
            if param.uses_penalties:
                penalty_rows.append(row)
                penalties[0].append(param.repetition_penalty)
                penalties[1].append(param.presence_penalty)
                penalties[2].append(param.frequency_penalty)
            if param.logprobs is not None:
                logprob_rows.append(row)
                num_logprobs.append(param.logprobs)
            if param.greedy:
                continue
            if param.seed is not None:
                seeds.append((len(random_rows), draw_seed(param.seed, index)))
            random_rows.append(row)
            temperature.append(param.temperature)
            min_p.append(param.min_p)
            top_k.append(min(param.top_k or self.vocab_size, self.vocab_size))
            top_p.append(param.top_p)
        batch = SamplingBatch(
            num_rows=len(params), logprob_rows=tuple(logprob_rows), num_logprobs=tuple(num_logprobs)
        )
        if penalty_rows:
            batch = attrs.evolve(
                batch,
                penalty_rows=_rows(penalty_rows, device),
                repetition_penalty=_floats(penalties[0], device),
                presence_penalty=_floats(penalties[1], device),
                frequency_penalty=_floats(penalties[2], device),
            )
        if random_rows:
            vocab = self.vocab_size
            batch = attrs.evolve(
                batch,
                random_rows=_rows(random_rows, device),
                temperature=_floats(temperature, device),
                min_p=_floats(min_p, device) if any(min_p) else None,
                top_k=to_device(top_k, device=device) if any(k < vocab for k in top_k) else None,
                max_top_k=max(top_k),
                top_p=_floats(top_p, device) if any(p < 1 for p in top_p) else None,
                seeds=tuple(seeds),
                num_unseeded=len(random_rows) - len(seeds),
            )
        return batch

    def sample(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        history: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: ``[num_rows, vocab_size]`` float32 raw logits (not modified).
            batch: The rows' parameters.
            history: For ``batch.penalty_rows``: a ``[P, vocab]`` bool mask of the tokens in
                each prompt and a ``[P, vocab]`` count of each token in each output.

        Returns:
            The sampled ids and the requested log-probabilities, on the device.

        Raises:
            ValueError: the batch has penalty rows but no ``history`` was given.
        """
        processed = logits
        if batch.penalty_rows is not None:
            if history is None:
                raise ValueError("a batch with penalty rows needs their token history, got None")
            processed = logits.clone()
            rows = logits.index_select(0, batch.penalty_rows)
            processed.index_copy_(0, batch.penalty_rows, _apply_penalties(rows, batch, *history))
        sampled = processed.argmax(dim=-1) if self._argmax is None else self._argmax(processed)
        if batch.random_rows is not None:
            drawn = self._draw(processed.index_select(0, batch.random_rows), batch)
            sampled.index_copy_(0, batch.random_rows, drawn)
        if not batch.logprob_rows:
            return SamplerOutput(sampled=sampled)
        rows = to_device(batch.logprob_rows, device=logits.device)
        logprobs = torch.log_softmax(logits.index_select(0, rows), dim=-1)
        chosen = logprobs.gather(1, sampled.index_select(0, rows)[:, None])[:, 0]
        top_ids = top_logprobs = None
        widest = max(batch.num_logprobs)
        if widest:
            top_logprobs, top_ids = logprobs.topk(widest, dim=-1)
        return SamplerOutput(
            sampled=sampled, logprobs=chosen, top_ids=top_ids, top_logprobs=top_logprobs
        )

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        assert batch.temperature is not None
        logits = logits / batch.temperature[:, None]
        if batch.min_p is not None:
            probs = logits.softmax(dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * batch.min_p[:, None]
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if batch.top_p is not None:
            logits = _top_k_top_p(logits, batch.top_k, batch.top_p)
        elif batch.top_k is not None:
            logits = _top_k(logits, batch.top_k, batch.max_top_k)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        if batch.num_unseeded:
            noise.exponential_(generator=self._generator)
        for index, seed in batch.seeds:
            generator = torch.Generator(device=probs.device)
            generator.manual_seed(seed)
            noise[index].exponential_(generator=generator)
        return probs.div_(noise).argmax(dim=-1)


def _apply_penalties(
    logits: torch.Tensor, batch: SamplingBatch, prompt_mask: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    assert batch.repetition_penalty is not None
    assert batch.presence_penalty is not None
    assert batch.frequency_penalty is not None
    output_mask = counts > 0
    repetition = batch.repetition_penalty[:, None].expand_as(logits)
    penalties = torch.where(prompt_mask | output_mask, repetition, 1.0)
    logits = logits * torch.where(logits > 0, 1.0 / penalties, penalties)
    logits = logits - batch.frequency_penalty[:, None] * counts
    return logits - batch.presence_penalty[:, None] * output_mask


def _top_k(logits: torch.Tensor, top_k: torch.Tensor, widest: int) -> torch.Tensor:
    """Keep each row's ``k`` largest logits (and ties with the k-th); no sort of the vocabulary."""
    kth = logits.topk(widest, dim=-1).values.gather(1, (top_k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """vLLM's ``apply_top_k_top_p``: mask in ascending sorted order, then scatter back."""
    ordered, order = logits.sort(dim=-1)
    if top_k is not None:
        kth = ordered.gather(1, (logits.shape[1] - top_k)[:, None])
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    dropped = cumulative <= 1 - top_p[:, None]
    dropped[:, -1] = False
    ordered = ordered.masked_fill(dropped, float("-inf"))
    return ordered.scatter(1, order, ordered)


class TokenHistory:
    """Each penalized request's tokens, kept on the device across steps.

    A slot per request holds a mask of its prompt tokens and the count of each output token.
    Prompt tokens are known on the host and added as the steps that compute them are
    launched; output tokens are counted on the device straight from the sampled ids, so the
    history already holds a token the host has not read back yet. After a preemption the
    recomputed positions are not added again: the history is kept until the request is gone.

    Args:
        vocab_size: Columns of the history.
        device: Where it lives.
        capacity: Initial slots (doubled when full).
    """

    def __init__(self, vocab_size: int, device: torch.device, *, capacity: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._prompt = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=device)
        self._counts = torch.zeros(capacity, vocab_size, dtype=torch.int32, device=device)
        self._slots: dict[int, int] = {}
        self._prompt_length: dict[int, int] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def slot(self, request_id: int) -> int:
        """The request's slot, created empty on first use."""
        slot = self._slots.get(request_id)
        if slot is None:
            if not self._free:
                self._grow()
            slot = self._free.pop()
            self._prompt[slot].zero_()
            self._counts[slot].zero_()
            self._slots[request_id] = slot
            self._prompt_length[request_id] = 0
        return slot

    def add_prompt(self, request_id: int, start: int, token_ids: Sequence[int]) -> None:
        """Record prompt tokens at positions ``[start, start + len(token_ids))``.

        Positions recorded before (a chunk recomputed after preemption) are skipped.
        """
        slot = self.slot(request_id)
        seen = self._prompt_length[request_id]
        fresh = token_ids[max(seen - start, 0) :]
        if fresh:
            ids = to_device(fresh, device=self.device)
            self._prompt[slot].index_fill_(0, ids, True)
            self._prompt_length[request_id] = start + len(token_ids)

    def count(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count one sampled token per slot (device tensors, no host sync).

        A flat ``index_add_`` over ``slot * vocab + token``: on CUDA, ``index_put_`` with
        ``accumulate=True`` reads its index range back to the host before it runs, which
        would make every launch with a penalized row wait for the step before it.
        """
        flat = slots * self.vocab_size + token_ids
        ones = torch.ones_like(flat, dtype=torch.int32)
        self._counts.view(-1).index_add_(0, flat, ones)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt masks and output counts of ``slots``, row by row."""
        return self._prompt.index_select(0, slots), self._counts.index_select(0, slots)

    def release(self, request_id: int) -> None:
        """Forget a request (idempotent)."""
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            del self._prompt_length[request_id]
            self._free.append(slot)

    def _grow(self) -> None:
        capacity = self._prompt.shape[0]
        self._prompt = torch.cat((self._prompt, torch.zeros_like(self._prompt)))
        self._counts = torch.cat((self._counts, torch.zeros_like(self._counts)))
        self._free.extend(range(2 * capacity - 1, capacity - 1, -1))
