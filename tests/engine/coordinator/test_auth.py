"""The Ray replica's listener serves only a peer that holds the coordinator's secret.

The actor's body (:func:`serve_authenticated`) runs here on loopback, without Ray, with a toy
engine behind it; rogue peers connect first and try what a peer on the node's network could.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.abc
import pytest
import trio.testing
from anyio.streams.buffered import BufferedByteReceiveStream

from twostroke.engine.coordinator import ray
from twostroke.engine.coordinator.auth import (
    AUTH_TIMEOUT,
    CONNECT_TIMEOUT,
    FIRST_RETRY_PAUSE,
    HANDSHAKE_FRAME_BYTES,
    MAX_PENDING_PEERS,
    MAX_RETRY_PAUSE,
    Challenge,
    HandshakeFailed,
    Hello,
    accept_authenticated,
    authenticate,
    connect_authenticated,
    new_secret,
)
from twostroke.engine.coordinator.frames import (
    FrameDecoder,
    FrameReader,
    FromReplica,
    Ready,
    Shutdown,
    Start,
    encode_frame,
)
from twostroke.engine.coordinator.ray import serve_authenticated

pytestmark = pytest.mark.anyio

TOY = Start("toy", {"device": "cpu", "num_blocks": 64, "block_size": 4})


async def everything(stream: anyio.abc.ByteReceiveStream) -> bytes:
    """What the peer receives until the replica closes the connection."""
    data = b""
    with anyio.fail_after(30):
        while True:
            try:
                data += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return data


def challenge_of(data: bytes) -> Challenge:
    (challenge,) = FrameDecoder(Challenge, "the replica").feed(data)
    assert isinstance(challenge, Challenge)
    assert len(challenge.nonce) == 32
    return challenge


async def test_only_a_peer_holding_the_secret_is_served_and_rogues_first_change_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = new_secret()
    caplog.set_level(logging.WARNING, "twostroke.engine.coordinator.auth")
    # Every peer is closed on every path: a socket this test left open would fail a later
    # test, when the garbage collector finds it, as a ResourceWarning.
    async with anyio.create_task_group() as task_group, contextlib.AsyncExitStack() as peers:
        address = await task_group.start(serve_authenticated, "127.0.0.1", secret)

        async def connect() -> anyio.abc.SocketStream:
            return await peers.enter_async_context(await anyio.connect_tcp(*address))

        # A peer that connects first and says nothing holds up no one.
        silent = await connect()
        # The attack of old: connect first and send a Start that chooses the model.
        rogue = await connect()
        await rogue.send(encode_frame(TOY))
        assert challenge_of(await everything(rogue))  # a challenge, then closed
        # A peer that knows the protocol but not the secret.
        guesser = await connect()
        await guesser.send(encode_frame(Hello(b"\x00" * 32)))
        challenge_of(await everything(guesser))
        # One that speaks the protocol with a secret of its own: closed, never welcomed.
        other = await connect()
        with pytest.raises(anyio.IncompleteRead):
            await authenticate(other, new_secret())
        # One that announces a huge frame to make the replica buffer it.
        greedy = await connect()
        await greedy.send((HANDSHAKE_FRAME_BYTES + 1).to_bytes(4, "big"))
        challenge_of(await everything(greedy))

        # The coordinator proves it holds the secret and is served.
        stream = await connect()
        receive = await authenticate(stream, secret)
        await stream.send(encode_frame(TOY))
        frames = FrameReader(receive, FromReplica, "replica 0")
        ready: Any = await anext(frames)
        assert isinstance(ready, Ready)
        assert ready.model_name == "toy"
        # The listener is closed now, and so is the peer still in its handshake.
        with pytest.raises(OSError, match=r"[Cc]onnect"):
            await anyio.connect_tcp(*address)
        challenge_of(await everything(silent))
        await stream.send(encode_frame(Shutdown(cancel=True)))
        async for _ in frames:
            pass
    refusals = [r.getMessage() for r in caplog.records]
    assert len(refusals) == 4, refusals
    assert all(r.startswith("refused a peer of the replica: ") for r in refusals)
    assert any("more than the limit of 256" in r for r in refusals)
    assert any("its answer was wrong" in r for r in refusals)


def virtual_time_on_trio() -> list[Any]:
    return [
        pytest.param("asyncio", id="asyncio"),
        pytest.param(
            ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}), id="trio-virtual"
        ),
    ]


@pytest.mark.parametrize("anyio_backend", virtual_time_on_trio())
async def test_a_peer_that_does_not_answer_in_time_is_closed_and_the_next_is_served(
    anyio_backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The deadline holds for every peer, the one that answers too: it must be far longer than
    a handshake on a loaded machine. With 0.05 s, a busy machine that did not run the test's
    process for 50 ms while the coordinator signed its challenge refused the coordinator
    too, and the test failed (and the sockets it left open failed a later test as a
    ``ResourceWarning``). On trio the clock is virtual (``MockClock``): the default
    :data:`AUTH_TIMEOUT` is checked exactly and at no cost; on asyncio the deadline is a
    real second, which a handshake on loopback (well under a millisecond) never nears: a
    loop kept waiting for a core by a background load on both cores loses tens of
    milliseconds a turn, and the handshake takes three turns. The lower bound cannot fail
    on a slow machine: ``began`` is taken before the connection, and the deadline runs
    from it.
    """
    secret = new_secret()
    answer_within = AUTH_TIMEOUT if anyio_backend != "asyncio" else 1.0
    # Virtual time is exact (up to float rounding); a busy machine may notice a real one late.
    slack = 1e-6 if anyio_backend != "asyncio" else 10.0
    caplog.set_level(logging.WARNING, "twostroke.engine.coordinator.auth")
    async with anyio.create_task_group() as task_group, contextlib.AsyncExitStack() as peers:
        address = await task_group.start(
            lambda task_status: serve_authenticated(
                "127.0.0.1", secret, answer_within=answer_within, task_status=task_status
            )
        )
        began = anyio.current_time()
        silent = await peers.enter_async_context(await anyio.connect_tcp(*address))
        challenge_of(await everything(silent))  # closed at its deadline
        waited = anyio.current_time() - began
        assert answer_within - 1e-6 <= waited <= answer_within + slack, waited
        stream = await peers.enter_async_context(await anyio.connect_tcp(*address))
        receive = await authenticate(stream, secret)
        await stream.send(encode_frame(TOY))
        frames = FrameReader(receive, FromReplica, "replica 0")
        assert isinstance(await anext(frames), Ready)
        await stream.send(encode_frame(Shutdown(cancel=True)))
        async for _ in frames:
            pass
    refusals = [r.getMessage() for r in caplog.records]
    assert refusals == [
        f"refused a peer of the replica: it did not answer within {answer_within} s"
    ]


class CancelledWithItsAccept(anyio.abc.SocketListener):
    """A listener that cancels ``outer`` when its ``accept`` is cancelled.

    ``accept_authenticated`` cancels its ``accept`` when a peer has passed: this cancels the
    actor as well at that very moment (the actor stopped just as the coordinator got in).
    """

    def __init__(self, listener: anyio.abc.SocketListener, outer: anyio.CancelScope) -> None:
        self._listener = listener
        self._outer = outer

    async def accept(self) -> anyio.abc.SocketStream:
        try:
            return await self._listener.accept()
        except anyio.get_cancelled_exc_class():
            self._outer.cancel()
            raise

    async def aclose(self) -> None:
        await self._listener.aclose()

    @property
    def _raw_socket(self) -> socket.socket:
        return self._listener.extra(anyio.abc.SocketAttribute.raw_socket)


async def test_a_peer_that_passes_as_the_actor_is_cancelled_is_closed() -> None:
    """Cancellation closes every connection accepted so far, the one that passed too."""
    secret = new_secret()
    returned: list[object] = []
    async with (
        await anyio.create_tcp_listener(local_host="127.0.0.1") as listeners,
        anyio.create_task_group() as task_group,
    ):
        (listener,) = listeners.listeners
        assert isinstance(listener, anyio.abc.SocketListener)
        address = ("127.0.0.1", listener.extra(anyio.abc.SocketAttribute.local_port))

        async def actor() -> None:
            with anyio.CancelScope() as outer:
                wrapped = CancelledWithItsAccept(listener, outer)
                returned.append(await accept_authenticated(wrapped, secret))

        task_group.start_soon(actor)
        async with await anyio.connect_tcp(*address) as stream:
            await authenticate(stream, secret)
            assert await everything(stream) == b""  # closed, not left to the garbage collector
    assert returned == []


async def test_the_actor_cancelled_once_its_peer_passed_closes_the_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between the handshake and serving, the listener is closed (a checkpoint): the peer's
    connection is closed if the actor is cancelled there."""
    secret = new_secret()

    async with anyio.create_task_group() as task_group:

        async def actor(*, task_status: anyio.abc.TaskStatus[tuple[str, int]]) -> None:
            with anyio.CancelScope() as outer:

                async def then_cancelled(*args: Any, **kwargs: Any) -> Any:
                    passed = await accept_authenticated(*args, **kwargs)
                    outer.cancel()  # the actor is stopped just as its peer got in
                    return passed

                monkeypatch.setattr(ray, "accept_authenticated", then_cancelled)
                await serve_authenticated("127.0.0.1", secret, task_status=task_status)

        address = await task_group.start(actor)
        async with await anyio.connect_tcp(*address) as stream:
            await authenticate(stream, secret)
            assert await everything(stream) == b""  # closed, not left to the garbage collector


async def read_challenge(peer: anyio.abc.SocketStream) -> BufferedByteReceiveStream:
    """Read the actor's challenge to ``peer`` (so its handshake is pending); the rest."""
    receive = BufferedByteReceiveStream(peer)
    with anyio.fail_after(30):  # a hang tripwire: the challenge comes at once
        header = await receive.receive_exactly(4)
        challenge_of(header + await receive.receive_exactly(int.from_bytes(header, "big")))
    return receive


async def test_silent_peers_at_the_limit_push_out_the_oldest_and_the_coordinator_gets_in(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``MAX_PENDING_PEERS`` peers that connect and say nothing once made the actor close
    every newcomer at once, the coordinator too, until their deadline; renewed, they locked
    it out for good. Now a newcomer pushes the oldest out: the coordinator always gets its
    challenge, and only a flood within its one round trip could push it out in turn."""
    secret = new_secret()
    caplog.set_level(logging.WARNING, "twostroke.engine.coordinator.auth")
    async with anyio.create_task_group() as task_group, contextlib.AsyncExitStack() as peers:
        address = await task_group.start(serve_authenticated, "127.0.0.1", secret)

        async def silent_peer() -> BufferedByteReceiveStream:
            return await read_challenge(
                await peers.enter_async_context(await anyio.connect_tcp(*address))
            )

        silent = [await silent_peer() for _ in range(MAX_PENDING_PEERS)]
        # One more: the oldest is closed to make room, while its handshake was pending.
        silent.append(await silent_peer())
        assert await everything(silent[0]) == b""
        # The coordinator, with the room full again: it pushes out the next oldest and passes.
        stream = await peers.enter_async_context(await anyio.connect_tcp(*address))
        receive = await authenticate(stream, secret)
        await stream.send(encode_frame(TOY))
        frames = FrameReader(receive, FromReplica, "replica 0")
        assert isinstance(await anext(frames), Ready)
        for peer in silent[1:]:  # the rest were closed when the coordinator passed
            assert await everything(peer) == b""
        await stream.send(encode_frame(Shutdown(cancel=True)))
        async for _ in frames:
            pass
    pushed_out = (
        "refused a peer of the replica: it had not answered when "
        f"{MAX_PENDING_PEERS} newer peers were in their handshakes (the oldest makes room)"
    )
    assert [r.getMessage() for r in caplog.records] == [pushed_out, pushed_out]


class ClosingListener:
    """A listener that closes the first ``refusals`` connections at once, then lets the
    handshake decide (``accept_authenticated``)."""

    def __init__(self, listener: anyio.abc.SocketListener, refusals: int) -> None:
        self.listener = listener
        self.refusals = refusals
        self.accepted = 0
        self.passed: list[tuple[anyio.abc.SocketStream, anyio.abc.ByteReceiveStream]] = []

    async def serve(self, secret: bytes) -> None:
        while self.accepted < self.refusals:
            await anyio.aclose_forcefully(await self.listener.accept())
            self.accepted += 1
        self.passed.append(await accept_authenticated(self.listener, secret))
        self.accepted += 1


@contextlib.asynccontextmanager
async def loopback_listener() -> AsyncIterator[tuple[anyio.abc.SocketListener, int]]:
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listeners:
        (listener,) = listeners.listeners
        assert isinstance(listener, anyio.abc.SocketListener)
        yield listener, listener.extra(anyio.abc.SocketAttribute.local_port)


def pauses_logged(caplog: pytest.LogCaptureFixture) -> list[float]:
    """The pauses the coordinator announced between its attempts, in order."""
    found = [re.search(r"again in (\S+) s$", r.getMessage()) for r in caplog.records]
    return [float(match.group(1)) for match in found if match is not None]


def doubling(count: int, first: float, most: float) -> list[float]:
    return [min(first * 2**index, most) for index in range(count)]


@pytest.mark.parametrize("anyio_backend", virtual_time_on_trio())
async def test_the_coordinator_tries_again_until_the_actor_lets_it_in(
    anyio_backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Three connections closed at once (an actor with no room, or not listening yet), then
    the handshake: the coordinator gets in on its fourth attempt, after pauses that double."""
    secret = new_secret()
    # Real pauses on asyncio are short, to keep the test quick; virtual ones are the defaults.
    first = FIRST_RETRY_PAUSE if anyio_backend != "asyncio" else 0.01
    caplog.set_level(logging.INFO, "twostroke.engine.coordinator.auth")
    async with loopback_listener() as (listener, port), anyio.create_task_group() as task_group:
        actor = ClosingListener(listener, refusals=3)
        task_group.start_soon(actor.serve, secret)
        stream, _ = await connect_authenticated("127.0.0.1", port, secret, first_pause=first)
        async with stream:
            pass
    (passed,) = actor.passed
    await passed[0].aclose()
    assert actor.accepted == 4
    assert pauses_logged(caplog) == doubling(3, first, MAX_RETRY_PAUSE)


@pytest.mark.parametrize("anyio_backend", virtual_time_on_trio())
@pytest.mark.parametrize("actor", ["closes", "is-silent", "is-not-listening"])
async def test_the_coordinator_gives_up_in_bounded_time_naming_what_it_tried(
    anyio_backend: Any, actor: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A listener that closes every connection, one that accepts and never says a word, or
    none at all: the coordinator tries until ``give_up_after`` (the default
    :data:`CONNECT_TIMEOUT`, in virtual time on trio), pausing longer each time up to
    :data:`MAX_RETRY_PAUSE`, then raises :class:`HandshakeFailed` with the address, the
    attempts and the last failure."""
    secret = new_secret()
    virtual = anyio_backend != "asyncio"
    # On asyncio the clock is real: a short budget, so the test stays quick, and an attempt
    # long enough for the listener's task to accept under a loaded machine (at 0.1 s the
    # accept could come after the attempt had timed out, and the "closes" case read as a
    # silent actor).
    give_up_after = CONNECT_TIMEOUT if virtual else 1.0
    attempt_within = AUTH_TIMEOUT if virtual else 0.5
    first = FIRST_RETRY_PAUSE if virtual else 0.01
    caplog.set_level(logging.INFO, "twostroke.engine.coordinator.auth")
    accepted = 0
    async with (
        loopback_listener() as (listener, port),
        contextlib.AsyncExitStack() as held,
        anyio.create_task_group() as task_group,
    ):

        async def answer_every_connection() -> None:
            nonlocal accepted
            while True:
                peer = await listener.accept()
                accepted += 1
                if actor == "closes":
                    await anyio.aclose_forcefully(peer)
                else:
                    await held.enter_async_context(peer)

        if actor == "is-not-listening":
            await listener.aclose()  # the port is closed: each connection is refused
        else:
            task_group.start_soon(answer_every_connection)
        began = anyio.current_time()
        with pytest.raises(HandshakeFailed) as raised:
            await connect_authenticated(
                "127.0.0.1",
                port,
                secret,
                give_up_after=give_up_after,
                attempt_within=attempt_within,
                first_pause=first,
            )
        spent = anyio.current_time() - began
        task_group.cancel_scope.cancel()
    error = raised.value
    attempts = error.attempts
    assert error.address == ("127.0.0.1", port)
    # In virtual time the schedule is exact; a real half second may hold a single attempt
    # on a loaded machine, so asyncio checks the wording, not the count.
    assert attempts >= (2 if virtual else 1)
    assert attempts == accepted or actor == "is-not-listening"
    message = str(error)
    tried = f"{attempts} attempts" if attempts > 1 else "1 attempt"
    assert message.startswith(
        f"could not pass the handshake of the replica actor at 127.0.0.1:{port}: {tried} in "
    ), message
    assert f"(at most {give_up_after:g} s, each at most {attempt_within:g} s)" in message
    if actor == "is-silent":
        # The last attempt gets what is left of the budget, at most ``attempt_within``.
        last = re.search(r"; the last failed: it got no welcome within (\S+) s$", message)
        assert last is not None, message
        assert 0 < float(last.group(1)) <= attempt_within
        assert isinstance(error.__cause__, TimeoutError)
    elif actor == "closes":
        assert message.endswith(
            "; the last failed: the actor closed the connection before its welcome"
        ), message
        assert isinstance(error.__cause__, anyio.IncompleteRead)
    else:
        assert message.endswith("; the last failed: OSError: All connection attempts failed")
        assert isinstance(error.__cause__, OSError)
    assert pauses_logged(caplog) == doubling(attempts - 1, first, MAX_RETRY_PAUSE)
    if virtual:  # exact: the budget holds, and one more pause would have overrun it
        assert spent <= give_up_after + 1e-9
        assert spent + min(first * 2 ** (attempts - 1), MAX_RETRY_PAUSE) >= give_up_after


async def test_a_coordinator_cancelled_in_its_handshake_closes_its_connection() -> None:
    async with loopback_listener() as (listener, port):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(connect_authenticated, "127.0.0.1", port, new_secret())
            peer = await listener.accept()
            task_group.cancel_scope.cancel()
        async with peer:
            assert await everything(peer) == b""
