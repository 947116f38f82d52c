"""The routing policy: properties over any arrival sequence, and pinned behaviour."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from twostroke.states.errors import EngineError
from twostroke.states.routing import NoLiveReplica, Router, RoutingConfig, prefix_hashes

#: A small pool of prompts, so that identical prompts and shared prefixes recur.
PROMPTS = st.sampled_from(["abc", "abcd", "x" * 40, "x" * 40 + "y", "hello world" * 5, "q"]) | (
    st.lists(st.integers(0, 3), min_size=1, max_size=70).map(tuple)
)
MAX_COST = 600
CONFIGS = st.builds(
    RoutingConfig,
    imbalance_tokens=st.integers(1, 800),
    imbalance_ratio=st.floats(1.0, 4.0),
    prefix_chunk=st.integers(1, 16),
    prefix_capacity=st.just(100_000),
)


def arrival() -> st.SearchStrategy[tuple[str, Any, int, int]]:
    return st.tuples(
        st.just("arrive"), PROMPTS, st.integers(0, MAX_COST // 2), st.integers(0, MAX_COST // 2)
    )


def bound(router: Router) -> float:
    loads = [router.load(r) for r in router.live_replicas]
    least = min(loads)
    config = router.config
    return max(least + config.imbalance_tokens, config.imbalance_ratio * least) + MAX_COST


@given(
    config=CONFIGS,
    num_replicas=st.integers(1, 5),
    events=st.lists(
        arrival() | st.tuples(st.just("remove"), st.integers(0, 4), st.just(0), st.just(0)),
        max_size=80,
    ),
)
def test_the_imbalance_bound_holds_over_any_arrival_sequence(
    config: RoutingConfig, num_replicas: int, events: list[tuple[str, Any, int, int]]
) -> None:
    router = Router(num_replicas, config)
    for request_id, (kind, value, prompt_tokens, max_tokens) in enumerate(events):
        if kind == "remove":
            if len(router.live_replicas) > 1:
                router.remove_replica(value)
        else:
            replica = router.route(request_id, value, prompt_tokens, max_tokens)
            assert replica in router.live_replicas
        router.check_invariants()
        assert max(router.load(r) for r in router.live_replicas) <= bound(router)


@given(
    config=CONFIGS,
    num_replicas=st.integers(1, 5),
    events=st.lists(
        arrival()
        | st.tuples(st.just("progress"), st.integers(0, 200), st.integers(1, 50), st.just(0))
        | st.tuples(st.just("correct"), st.integers(0, 200), st.integers(0, 300), st.just(0))
        | st.tuples(st.just("release"), st.integers(0, 200), st.just(0), st.just(0))
        | st.tuples(st.just("remove"), st.integers(0, 4), st.just(0), st.just(0)),
        max_size=120,
    ),
)
def test_every_decision_follows_the_rule_in_any_sequence(
    config: RoutingConfig, num_replicas: int, events: list[tuple[str, Any, int, int]]
) -> None:
    """Never a dead replica; imbalanced: the least loaded; balanced: the last server of the
    same prompt; loads always equal the open requests' outstanding tokens."""
    router = Router(num_replicas, config)
    last_server: dict[Any, int] = {}
    open_ids: list[int] = []
    for request_id, (kind, value, first, second) in enumerate(events):
        if kind == "arrive":
            key = value
            imbalanced = router.is_imbalanced()
            least = min(router.load(r) for r in router.live_replicas)
            replica = router.route(request_id, key, first, second)
            open_ids.append(request_id)
            assert replica in router.live_replicas
            if imbalanced:
                assert router.load(replica) - first - second == least
            elif key in last_server and last_server[key] in router.live_replicas:
                assert replica == last_server[key]
            last_server[key] = replica
        elif open_ids:
            target = open_ids[value % len(open_ids)]
            if kind == "progress":
                router.progress(target, first)
            elif kind == "correct":
                router.set_prompt_tokens(target, first)
            elif kind == "release":
                router.release(target)
                open_ids.remove(target)
        if kind == "remove" and len(router.live_replicas) > 1:
            orphans = router.remove_replica(value)
            assert all(router.replica_of(rid) is None for rid in orphans)
            open_ids = [rid for rid in open_ids if rid not in orphans]
            assert value not in router.live_replicas
        router.check_invariants()
    assert len(router) == len(open_ids)


def test_identical_prompts_go_to_the_same_replica_and_new_ones_rotate() -> None:
    router = Router(3)
    first = [router.route(i, f"prompt number {i}", 10, 10) for i in range(3)]
    assert first == [0, 1, 2]  # nothing served yet: equal loads, ties rotate
    assert router.route(3, "prompt number 1", 10, 10) == 1
    assert router.route(4, list(range(50)), 50, 10) == 0  # least loaded (0 and 2 tie: rotate)
    assert router.route(5, [*range(50), 7], 51, 10) == 0  # shares 32 ids: affinity
    assert router.live_replicas == (0, 1, 2)
    assert router.replica_of(5) == 0
    assert router.replica_of(99) is None
    assert router.open_requests(1) == [1, 3]
    assert repr(router) == "<Router 6 open, loads {0: 141, 1: 40, 2: 20}>"


def test_imbalanced_replicas_send_even_a_known_prompt_to_the_least_loaded() -> None:
    router = Router(2, RoutingConfig(imbalance_tokens=100, imbalance_ratio=2.0))
    assert router.route(0, "same", 5, 200) == 0
    assert router.is_imbalanced()  # 205 vs 0: beyond 100 tokens and 2x
    assert router.route(1, "same", 5, 10) == 1
    router.progress(0, 150)  # 55 vs 15: within 100 tokens
    assert not router.is_imbalanced()
    assert router.route(2, "same", 5, 10) == 1  # the last server of "same"


def test_load_follows_progress_corrections_and_release() -> None:
    router = Router([4, 7])
    assert router.route(0, "abc", 10, 5) == 4
    router.set_prompt_tokens(0, 12)
    assert router.load(4) == 17
    router.progress(0, 2)  # prefilled: the prompt no longer counts
    assert router.load(4) == 3
    router.set_prompt_tokens(0, 99)  # too late: ignored
    router.progress(0, 10)  # more than remains (the engine's one lookahead token): clamped
    assert router.load(4) == 0
    router.release(0)
    router.release(0)  # idempotent
    assert len(router) == 0
    router.check_invariants()


def test_removing_a_replica_returns_its_requests_and_forgets_its_prefixes() -> None:
    router = Router(2)
    assert router.route(0, "abc", 1, 1) == 0
    assert router.route(1, "def", 1, 1) == 1
    assert router.route(2, "abc", 1, 1) == 0
    assert router.remove_replica(0) == [0, 2]
    assert router.remove_replica(0) == []
    assert router.load(0) == 0
    assert router.route(3, "abc", 1, 1) == 1
    assert router.remove_replica(1) == [1, 3]
    assert not router.is_imbalanced()
    with pytest.raises(NoLiveReplica, match="no live replica is left") as caught:
        router.route(4, "abc", 1, 1)
    assert isinstance(caught.value, EngineError)
    router.check_invariants()


def test_the_affinity_table_is_bounded() -> None:
    router = Router(2, RoutingConfig(prefix_chunk=4, prefix_capacity=8))
    for request_id in range(20):
        router.route(request_id, f"{request_id:04d}" * 5, 1, 1)
        router.check_invariants()
    assert len(router._affinity) == 8


def test_prefix_hashes_chain_full_chunks_and_tag_the_whole_prompt() -> None:
    short, longer = prefix_hashes("abcdefg", 3), prefix_hashes("abcdefgh", 3)
    assert len(short) == 3
    assert len(longer) == 3
    assert short[:2] == longer[:2]
    assert short[2] != longer[2]
    assert prefix_hashes("abcdef", 3)[:2] == short[:2]
    assert prefix_hashes("abc", 3)[-1] != prefix_hashes("abcdef", 3)[0]
    assert prefix_hashes([1, 2, 3], 3)[0] != prefix_hashes("\x01\x02\x03", 3)[0]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: Router(0), ValueError, "a router needs at least one replica, got none"),
        (lambda: Router([1, 1]), ValueError, r"replica ids must be distinct, got \[1, 1\]"),
        (
            lambda: RoutingConfig(imbalance_tokens=0),
            ValueError,
            "imbalance_tokens must be >= 1, got 0",
        ),
        (
            lambda: RoutingConfig(prefix_chunk=True),
            TypeError,
            "prefix_chunk must be an int, got bool True",
        ),
        (
            lambda: RoutingConfig(imbalance_ratio=0.5),
            ValueError,
            "imbalance_ratio must be >= 1, got 0.5",
        ),
        (
            lambda: RoutingConfig(imbalance_ratio="2"),
            TypeError,
            "imbalance_ratio must be a number, got str '2'",
        ),
    ],
)
def test_bad_configuration_is_refused(call: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=f"^{message}$"):
        call()


def test_bad_calls_name_the_rule_and_leave_the_router_unchanged() -> None:
    router = Router(1)
    router.route(0, "abc", 1, 1)
    with pytest.raises(ValueError, match=r"^request 0 is open already$"):
        router.route(0, "abc", 1, 1)
    with pytest.raises(ValueError, match=r"^token counts must be >= 0, got prompt_tokens=-1"):
        router.route(1, "abc", -1, 1)
    with pytest.raises(ValueError, match=r"^request 5 is not open in the router$"):
        router.progress(5, 1)
    with pytest.raises(ValueError, match=r"^new_tokens must be >= 1, got 0$"):
        router.progress(0, 0)
    with pytest.raises(ValueError, match=r"^prompt_tokens must be >= 0, got -3$"):
        router.set_prompt_tokens(0, -3)
    assert router.load(0) == 2
    router.check_invariants()


# --- the thresholds, the rotation and the affinity table, pinned -----------------------------


def loaded(*loads: int, **config: Any) -> Router:
    """A router whose replicas 0, 1, ... carry ``loads`` (one open request each)."""
    router = Router(len(loads), RoutingConfig(**config))
    for replica, load in enumerate(loads):
        assert router.route(replica, f"prompt {replica}", load, 0) == replica
    return router


@pytest.mark.parametrize(
    ("loads", "imbalanced"),
    [
        ((21, 10), True),  # 11 more tokens, and 2.1 times
        ((14, 4), False),  # exactly the absolute threshold is not beyond it
        ((30, 15), False),  # 15 more tokens, but exactly the ratio is not beyond it
        ((31, 15), True),
        ((9, 4), False),  # beyond the ratio but within the tokens (9 - 4, not 9 + 4)
        ((0, 0), False),
    ],
)
def test_imbalance_needs_both_thresholds_strictly(loads: tuple[int, int], imbalanced: bool) -> None:
    router = loaded(*loads, imbalance_tokens=10, imbalance_ratio=2.0)
    assert router.is_imbalanced() is imbalanced


def test_ties_rotate_from_past_the_last_choice() -> None:
    router = Router([3, 5, 8])
    chosen = [router.route(request_id, f"new {request_id}", 0, 0) for request_id in range(5)]
    assert chosen == [3, 5, 8, 3, 5]


def test_the_affinity_table_forgets_the_least_recently_used_prompt() -> None:
    # Chunks longer than the prompts: each prompt leaves one hash, the whole prompt's.
    router = Router(3, RoutingConfig(prefix_chunk=100, prefix_capacity=2))
    assert [router.route(rid, key, 0, 0) for rid, key in enumerate("abc")] == [0, 1, 2]
    # "a" was forgotten, "c" (the newest) and "b" are remembered.
    assert router.route(3, "c", 0, 0) == 2
    assert router.route(4, "b", 0, 0) == 1
    assert router.route(5, "a", 0, 0) == 0  # no affinity: the rotation's next, not a memory
    router.check_invariants()


def test_a_prefilled_prompt_is_not_corrected_any_more() -> None:
    router = Router(1)
    router.route(0, "a", 10, 5)
    router.set_prompt_tokens(0, 12)
    assert router.load(0) == 17
    router.progress(0, 1)
    assert router.load(0) == 4
    router.set_prompt_tokens(0, 50)  # the replica reports the length late: ignored
    assert router.load(0) == 4
    router.check_invariants()


def test_no_live_replica_is_an_error_naming_the_rule() -> None:
    router = Router(1)
    router.remove_replica(0)
    with pytest.raises(NoLiveReplica, match=r"^no live replica is left to route a request to$"):
        router.route(0, "a", 1, 1)


def test_a_prompt_may_be_corrected_down_to_zero_tokens() -> None:
    # The bound is the one route() applies to its estimate: >= 0, not >= 1.
    router = Router(1)
    router.route(0, "a", 10, 5)
    router.set_prompt_tokens(0, 0)
    assert router.load(0) == 5
    router.check_invariants()
