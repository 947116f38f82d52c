"""Speculative decoding without a draft model: drafts from the request's own tokens.

A request that decodes one token a step pays the step's fixed cost for every token. Drafts
let one step verify several: the request's last token and ``k`` drafted tokens go into the
step as one chunk, the runner samples at every one of the ``k + 1`` positions exactly as it
would without drafts, and the drafts are accepted while each equals the token sampled at
its position; the first token that differs is kept in its place (it is what the request would
have sampled there), and the rest is rolled back. Greedy or not, seeded or not, the output is
the one without drafts: a seeded request's ``i``-th output token takes the same random draw
either way (the sampler seeds it by ``(seed, i)``), and an unseeded request's tokens have the
same distribution (accepting draft ``x`` exactly when a draw from ``p`` gives ``x`` accepts
it with probability ``p(x)``, and on a rejection the token kept is that draw, distributed as
``p`` without ``x``, renormalized: the rejection sampling of a point-mass draft).

Two proposers, both pure functions of token ids, run on the bookkeeping stroke while the step
before runs:

* ``ngram`` (prompt lookup, vLLM's name): the longest n-gram at the end of the request's
  tokens (``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens) that occurred before in
  its prompt or output, and the tokens that followed its latest occurrence.
* ``suffix`` (suffix decoding, arXiv 2411.04975): a suffix trie of bounded depth over the
  request's own tokens, and one over the outputs of recent requests, whose counts pick the
  most frequent continuation of the longest suffix matched.

:class:`Speculator` keeps one drafter per running request, adapts each request's draft
length to its measured acceptance, switches drafting off for a request while it does not pay
(and for the whole step at ``disable_by_batch_size`` running requests), and counts drafts and
accepted tokens as vLLM names them. Which requests may draft at all, and what a verified
draft changes, is the scheduler's (:mod:`twostroke.states.scheduler`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs

from twostroke.states.validators import boolean, int_at_least, int_in, number_in, one_of

__all__ = [
    "MAX_PROMPT_LOOKUP",
    "MAX_SPECULATIVE_TOKENS",
    "NgramIndex",
    "Proposer",
    "SpeculativeConfig",
    "Speculator",
    "SuffixTrie",
    "speculative_config",
]

#: The most draft tokens one step may verify for a request.
MAX_SPECULATIVE_TOKENS = 16
#: The longest n-gram prompt lookup may match (``prompt_lookup_max``). The index keeps one
#: entry per length per token, an entry of ``n`` tokens, so its memory grows with the square
#: of this: for an 8,192-token request 3.5 MiB at the default 5, 17 MiB at 16, 165 MiB at
#: 64 (tracemalloc, CPython 3.11); 100,000 cost 457 MiB on a 700-token prompt. vLLM's
#: examples match 4 or 5 tokens; 16, the longest draft, leaves three times that.
MAX_PROMPT_LOOKUP = 16
_LOOKUP_NOTE = (
    " (the n-gram index holds every length up to it for each token: memory grows with its square)"
)

SpeculativeMethod = Literal["ngram", "suffix"]

#: A proposer of one's own: ``(request_id, known token ids, wanted) -> draft`` (a test's
#: drafts: perfect, random or adversarial). The draft's first tokens stand for the tokens a
#: step in flight samples, as with the built-in methods.
Proposer = Callable[[int, Sequence[int], int], Sequence[int]]


@attrs.frozen(kw_only=True)
class SpeculativeConfig:
    """How requests draft tokens (``speculative_config``, vLLM's names where vLLM has them).

    Args:
        method: ``"ngram"`` (prompt lookup) or ``"suffix"`` (suffix decoding).
        num_speculative_tokens: The most draft tokens a request verifies in one step
            (1 to :data:`MAX_SPECULATIVE_TOKENS`). With ``adaptive``, each request drafts
            fewer while its drafts are rejected early.
        prompt_lookup_min: ``ngram``: the shortest n-gram matched.
        prompt_lookup_max: ``ngram``: the longest n-gram matched (tried first), at most
            :data:`MAX_PROMPT_LOOKUP`.
        suffix_max_depth: ``suffix``: the deepest path of either trie, so the longest suffix
            matched plus the draft that follows it. A trie over ``n`` tokens holds at most
            ``n * suffix_max_depth`` nodes (about 200 bytes each in CPython).
        suffix_cache_tokens: ``suffix``: output tokens of finished requests kept in the
            shared trie (the oldest requests' leave first); 0 keeps none (each request
            drafts from its own tokens only). The shared trie's memory is bounded by
            ``suffix_cache_tokens * suffix_max_depth`` nodes.
        suffix_min_probability: ``suffix``: a draft stops at the first continuation whose
            share of its parent's occurrences is below this.
        disable_by_batch_size: No request drafts in a step planned while this many requests
            (or more) run: the forward is then bound by compute, not by the step's fixed
            cost, and verifying drafts costs what it saves. ``None`` never disables it.
        adaptive: Adapt each request's draft length to its acceptance, and stop drafting
            for a request (probing again later) while drafts would cost more than they give.
            ``False`` always drafts ``num_speculative_tokens`` where a proposal is found.
    """

    method: SpeculativeMethod = attrs.field(validator=one_of("ngram", "suffix"))
    num_speculative_tokens: int = attrs.field(
        default=5, validator=int_in(1, MAX_SPECULATIVE_TOKENS)
    )
    prompt_lookup_min: int = attrs.field(
        default=2, validator=int_in(1, MAX_PROMPT_LOOKUP, note=_LOOKUP_NOTE)
    )
    prompt_lookup_max: int = attrs.field(
        default=5, validator=int_in(1, MAX_PROMPT_LOOKUP, note=_LOOKUP_NOTE)
    )
    suffix_max_depth: int = attrs.field(default=24, validator=int_in(2, 256))
    suffix_cache_tokens: int = attrs.field(default=16_384, validator=int_at_least(0))
    suffix_min_probability: float = attrs.field(default=0.1, validator=number_in(0, 1))
    disable_by_batch_size: int | None = attrs.field(
        default=8, validator=int_at_least(1, optional=True, note=" (or None: never)")
    )
    adaptive: bool = attrs.field(default=True, validator=boolean)

    def __attrs_post_init__(self) -> None:
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max must be >= prompt_lookup_min ({self.prompt_lookup_min}), "
                f"got {self.prompt_lookup_max}"
            )


def speculative_config(value: object) -> SpeculativeConfig | None:
    """A :class:`SpeculativeConfig` from what a caller gives: one, a mapping of its fields
    (``{"method": "ngram", "num_speculative_tokens": 4}``), or ``None`` (no speculation).

    Raises:
        TypeError: neither of those, a field of the wrong type, or a key that is not a field
            (the message lists the fields).
        ValueError: a field out of range, or an unknown ``method``.
    """
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(
            "speculative_config must be a SpeculativeConfig, a mapping of its fields or None, "
            f"got {type(value).__name__} {value!r}"
        )
    fields = attrs.fields_dict(SpeculativeConfig)
    unknown = sorted(str(key) for key in value if key not in fields)
    if unknown:
        raise TypeError(
            f"speculative_config has no field {', '.join(map(repr, unknown))}; its fields are "
            f"{', '.join(fields)}"
        )
    if "method" not in value:
        raise TypeError('speculative_config needs "method": "ngram" or "suffix"')
    chosen: dict[str, Any] = dict(value)
    return SpeculativeConfig(**chosen)


# --- proposers --------------------------------------------------------------------------


class NgramIndex:
    """Prompt lookup over one growing token sequence.

    Every n-gram (``low`` to ``high`` tokens) is indexed by where the token after its latest
    occurrence is, once that token exists: the n-gram at the very end of the sequence is
    indexed only when the next token comes, so a lookup never finds the end itself. Adding a
    token costs ``high - low + 1`` dictionary stores; a lookup at most as many reads.
    """

    def __init__(self, low: int, high: int) -> None:
        self._low = low
        self._high = high
        self._tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, token_ids: Sequence[int]) -> None:
        tokens = self._tokens
        table = self._next
        low, high = self._low, self._high
        for token_id in token_ids:
            end = len(tokens)  # the n-grams ending just before the new token
            for n in range(low, min(high, end) + 1):
                table[tuple(tokens[end - n : end])] = end
            tokens.append(token_id)

    def propose(self, num_tokens: int) -> tuple[int, ...]:
        """The tokens after the latest earlier occurrence of the longest n-gram at the end."""
        tokens = self._tokens
        for n in range(min(self._high, len(tokens)), self._low - 1, -1):
            start = self._next.get(tuple(tokens[-n:]))
            if start is not None:
                return tuple(tokens[start : start + num_tokens])
        return ()


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Counts of every path of up to ``depth`` tokens in the sequences added to it.

    Each added token extends the paths of the suffixes that end before it (at most ``depth``
    of them), so a sequence of ``n`` tokens adds at most ``n * depth`` nodes, and removing it
    (:meth:`remove`) takes its counts back and frees the nodes no other sequence holds.

    Args:
        depth: The longest path.
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._root = _Node()
        self._num_nodes = 0
        # Per open sequence (a request being extended): the nodes of its current suffixes.
        self._active: dict[int, list[_Node]] = {}

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def extend(self, key: int, token_ids: Sequence[int]) -> None:
        """Add ``token_ids`` to the end of sequence ``key`` (a new key starts a sequence)."""
        active = self._active.setdefault(key, [])
        limit = self.depth
        for token_id in token_ids:
            grown: list[_Node] = []
            for node in (self._root, *active):
                child = node.children.get(token_id)
                if child is None:
                    child = node.children[token_id] = _Node()
                    self._num_nodes += 1
                child.count += 1
                grown.append(child)
            # The suffix that reached ``depth`` tokens stops growing.
            active = grown[: limit - 1]
        self._active[key] = active

    def close(self, key: int) -> None:
        """Stop extending sequence ``key`` (its counts stay)."""
        self._active.pop(key, None)

    def remove(self, token_ids: Sequence[int]) -> None:
        """Take back the counts of a whole sequence that was added (and closed)."""
        for start in range(len(token_ids)):
            node = self._root
            path: list[tuple[_Node, int]] = []
            for token_id in token_ids[start : start + self.depth]:
                path.append((node, token_id))
                node = node.children[token_id]
            for parent, token_id in reversed(path):
                child = parent.children[token_id]
                child.count -= 1
                if not child.count:
                    del parent.children[token_id]
                    self._num_nodes -= 1

    def propose(self, context: Sequence[int], num_tokens: int, min_probability: float) -> Draft:
        """The most frequent continuation of the longest suffix of ``context`` seen here.

        Returns:
            The draft (empty if no suffix of ``context`` has a continuation), the length of
            the suffix matched, and the product of the continuation's shares: an estimate
            of the chance that the whole draft is right.
        """
        longest = min(len(context), self.depth - 1)
        for length in range(longest, 0, -1):
            found = self._walk(context[len(context) - length :])
            if found is None or not found.children:
                continue
            node = found
            draft: list[int] = []
            chance = 1.0
            depth = length
            while len(draft) < num_tokens and node.children and depth < self.depth:
                token_id, child = max(node.children.items(), key=_by_count)
                share = child.count / sum(c.count for c in node.children.values())
                if share < min_probability:
                    break
                draft.append(token_id)
                chance *= share
                node = child
                depth += 1
            if draft:
                return Draft(tuple(draft), length, chance)
        return Draft((), 0, 0.0)

    def _walk(self, path: Sequence[int]) -> _Node | None:
        node = self._root
        for token_id in path:
            child = node.children.get(token_id)
            if child is None:
                return None
            node = child
        return node


def _by_count(item: tuple[int, _Node]) -> int:
    return item[1].count


@attrs.frozen
class Draft:
    """A proposal: the tokens, the length of the suffix they continue, and their estimated
    chance of all being right (1 for prompt lookup, which has no counts)."""

    token_ids: tuple[int, ...]
    match_length: int
    chance: float


# --- the speculator ---------------------------------------------------------------------

#: What a step of one request costs per drafted position, and once per verification (the
#: step a speculating request sits out under the lookahead, or the bookkeeping the device
#: waits for when it runs alone), as fractions of one decode step. Drafting ``k`` tokens at
#: a per-position acceptance ``a`` is expected to add ``a + a**2 + ... + a**k`` tokens.
#: Measured on SmolLM2-135M, one request, 2 AVX2 cores: a step verifying 1, 3, 5 and 7
#: drafts took 1.11, 1.34, 1.64 and 2.27 times a decode step (0.11-0.18 a position).
DRAFT_POSITION_COST = 0.12
VERIFICATION_COST = 0.15
#: The acceptance a request starts from before its first verification, and how much of the
#: estimate each verification keeps (an exponential average of positions reached and
#: accepted).
INITIAL_ACCEPTANCE = 0.6
ACCEPTANCE_DECAY = 0.7
#: Steps a request waits before drafting again after a verification that did not pay (the
#: wait doubles at each one in a row, up to the most).
PROBE_AFTER = 4
PROBE_AFTER_MOST = 64


@attrs.define(eq=False)
class _Drafting:
    """One request's drafter and its acceptance."""

    seen: int = 0  # tokens of the request given to the drafter so far
    ngram: NgramIndex | None = None
    trie: SuffixTrie | None = None
    accepted: float = INITIAL_ACCEPTANCE  # decayed sums: positions accepted ...
    reached: float = 1.0  # ... of positions reached
    wait: int = 0  # steps before the next draft
    backoff: int = PROBE_AFTER

    @property
    def acceptance(self) -> float:
        return self.accepted / self.reached


def draft_length(acceptance: float, most: int) -> int:
    """The draft length that maximizes expected tokens less their cost (0: do not draft).

    Position ``i`` of a draft is reached and accepted with probability ``acceptance ** i``
    and costs :data:`DRAFT_POSITION_COST`; a verification costs :data:`VERIFICATION_COST`
    once. So a draft grows while its next position is worth its cost, and is worth making
    only if its whole gain passes the verification's.
    """
    if acceptance <= 0:
        return 0
    gain = 0.0
    length = 0
    while length < most:
        step = acceptance ** (length + 1)
        if step < DRAFT_POSITION_COST:
            break
        gain += step
        length += 1
    if gain - length * DRAFT_POSITION_COST <= VERIFICATION_COST:
        return 0
    return length


class Speculator:
    """Drafts for running requests and what their verifications measured.

    Args:
        config: The method and its limits.
        propose: Proposes instead of ``config.method`` (its limits and adaptation stay).
    """

    def __init__(self, config: SpeculativeConfig, *, propose: Proposer | None = None) -> None:
        self.config = config
        self._propose_instead = propose
        self._requests: dict[int, _Drafting] = {}
        self._shared = SuffixTrie(config.suffix_max_depth) if config.method == "suffix" else None
        self._kept: collections.deque[tuple[int, ...]] = collections.deque()
        self._num_kept_tokens = 0
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * MAX_SPECULATIVE_TOKENS

    def enabled_for(self, num_running: int) -> bool:
        """Whether any request may draft in a step planned while ``num_running`` run."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running < limit

    def draft(
        self, request_id: int, token_ids: Sequence[int], num_pending: int, most: int
    ) -> tuple[int, ...]:
        """Draft tokens to follow a request's tokens; ``()`` for none.

        Args:
            request_id: The request.
            token_ids: Its known tokens (prompt and output): every call gives at least the
                tokens of the call before, and the drafter reads only the new ones.
            num_pending: Tokens after those that a step in flight samples (0 or 1): the
                proposal's first tokens stand for them, and the draft starts after.
            most: The most tokens the draft may have (its own limit may be lower).
        """
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _Drafting()
        if state.wait:
            state.wait -= 1
            return ()
        length = min(most, self.config.num_speculative_tokens)
        if self.config.adaptive:
            length = min(length, max(draft_length(state.acceptance, length), 1))
        wanted = length + num_pending
        proposal = self._propose(request_id, state, token_ids, wanted)
        return proposal[num_pending:wanted]

    def _propose(
        self, request_id: int, state: _Drafting, token_ids: Sequence[int], wanted: int
    ) -> tuple[int, ...]:
        config = self.config
        if self._propose_instead is not None:
            return tuple(self._propose_instead(request_id, token_ids, wanted))[:wanted]
        fresh = token_ids[state.seen :]
        state.seen = len(token_ids)
        if config.method == "ngram":
            if state.ngram is None:
                state.ngram = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
            state.ngram.extend(fresh)
            return state.ngram.propose(wanted)
        assert self._shared is not None
        if state.trie is None:
            state.trie = SuffixTrie(config.suffix_max_depth)
        state.trie.extend(request_id, fresh)
        context = token_ids[-(config.suffix_max_depth - 1) :]
        own = state.trie.propose(context, wanted, config.suffix_min_probability)
        shared = self._shared.propose(context, wanted, config.suffix_min_probability)
        best = max((own, shared), key=lambda d: (len(d.token_ids) * d.chance, d.match_length))
        return best.token_ids

    def verified(self, request_id: int, num_drafted: int, num_accepted: int) -> None:
        """Record a verification: ``num_accepted`` of ``num_drafted`` drafts were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
        state = self._requests.get(request_id)
        if state is None:
            return
        reached = min(num_accepted + 1, num_drafted)
        state.accepted = state.accepted * ACCEPTANCE_DECAY + num_accepted
        state.reached = state.reached * ACCEPTANCE_DECAY + reached
        if not self.config.adaptive:
            return
        if draft_length(state.acceptance, self.config.num_speculative_tokens):
            state.backoff = PROBE_AFTER
        else:
            state.wait = state.backoff
            state.backoff = min(2 * state.backoff, PROBE_AFTER_MOST)

    def acceptance(self, request_id: int) -> float | None:
        """A running request's estimated per-position acceptance (``None`` if unknown)."""
        state = self._requests.get(request_id)
        return None if state is None else state.acceptance

    def finished(self, request_id: int, output_token_ids: Sequence[int]) -> None:
        """Forget a request; with ``suffix``, keep its output for the requests after it."""
        self._requests.pop(request_id, None)
        if self._shared is None:
            return
        limit = self.config.suffix_cache_tokens
        output = tuple(output_token_ids)[-limit:] if limit else ()
        if not output:
            return
        self._shared.extend(request_id, output)
        self._shared.close(request_id)
        self._kept.append(output)
        self._num_kept_tokens += len(output)
        while self._num_kept_tokens > limit:
            oldest = self._kept.popleft()
            self._shared.remove(oldest)
            self._num_kept_tokens -= len(oldest)

    @property
    def num_trie_nodes(self) -> int:
        """Nodes held by the suffix tries (0 for ``ngram``)."""
        if self._shared is None:
            return 0
        own = sum(s.trie.num_nodes for s in self._requests.values() if s.trie is not None)
        return own + self._shared.num_nodes

    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts (vLLM's mean acceptance length); 1 before any draft."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
