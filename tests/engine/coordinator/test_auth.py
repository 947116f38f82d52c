"""The Ray replica's listener serves only a peer that holds the coordinator's secret.

The actor's body (:func:`serve_authenticated`) runs here on loopback, without Ray, with a toy
engine behind it; rogue peers connect first and try what a peer on the node's network could.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from typing import Any

import anyio
import anyio.abc
import pytest
import trio.testing

from twostroke.engine.coordinator import ray
from twostroke.engine.coordinator.auth import (
    AUTH_TIMEOUT,
    HANDSHAKE_FRAME_BYTES,
    Challenge,
    Hello,
    accept_authenticated,
    authenticate,
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
        # One that speaks the protocol with a secret of its own.
        other = await connect()
        await authenticate(other, new_secret())
        assert await everything(other) == b""  # closed, nothing served
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
    real second, which a handshake on loopback (well under a millisecond) never nears.
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
