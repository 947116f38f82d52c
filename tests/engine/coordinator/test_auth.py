"""The Ray replica's listener serves only a peer that holds the coordinator's secret.

The actor's body (:func:`serve_authenticated`) runs here on loopback, without Ray, with a toy
engine behind it; rogue peers connect first and try what a peer on the node's network could.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import anyio.abc
import pytest

from twostroke.engine.coordinator.auth import (
    HANDSHAKE_FRAME_BYTES,
    Challenge,
    Hello,
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
    async with anyio.create_task_group() as task_group:
        address = await task_group.start(serve_authenticated, "127.0.0.1", secret)
        # A peer that connects first and says nothing holds up no one.
        silent = await anyio.connect_tcp(*address)
        # The attack of old: connect first and send a Start that chooses the model.
        rogue = await anyio.connect_tcp(*address)
        await rogue.send(encode_frame(TOY))
        assert challenge_of(await everything(rogue))  # a challenge, then closed
        # A peer that knows the protocol but not the secret.
        guesser = await anyio.connect_tcp(*address)
        await guesser.send(encode_frame(Hello(b"\x00" * 32)))
        challenge_of(await everything(guesser))
        # One that speaks the protocol with a secret of its own.
        other = await anyio.connect_tcp(*address)
        await authenticate(other, new_secret())
        assert await everything(other) == b""  # closed, nothing served
        # One that announces a huge frame to make the replica buffer it.
        greedy = await anyio.connect_tcp(*address)
        await greedy.send((HANDSHAKE_FRAME_BYTES + 1).to_bytes(4, "big"))
        challenge_of(await everything(greedy))

        # The coordinator proves it holds the secret and is served.
        stream = await anyio.connect_tcp(*address)
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
        await stream.aclose()
        for peer in (silent, rogue, guesser, other, greedy):
            await peer.aclose()
    refusals = [r.getMessage() for r in caplog.records]
    assert len(refusals) == 4, refusals
    assert all(r.startswith("refused a peer of the replica: ") for r in refusals)
    assert any("more than the limit of 256" in r for r in refusals)
    assert any("its answer was wrong" in r for r in refusals)


async def test_a_peer_that_does_not_answer_in_time_is_closed_and_the_next_is_served() -> None:
    secret = new_secret()
    async with anyio.create_task_group() as task_group:
        address = await task_group.start(
            lambda task_status: serve_authenticated(
                "127.0.0.1", secret, answer_within=0.05, task_status=task_status
            )
        )
        silent = await anyio.connect_tcp(*address)
        challenge_of(await everything(silent))  # closed at its deadline
        stream = await anyio.connect_tcp(*address)
        receive = await authenticate(stream, secret)
        await stream.send(encode_frame(TOY))
        frames = FrameReader(receive, FromReplica, "replica 0")
        assert isinstance(await anext(frames), Ready)
        await stream.send(encode_frame(Shutdown(cancel=True)))
        async for _ in frames:
            pass
        await stream.aclose()
        await silent.aclose()
