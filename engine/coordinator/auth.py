"""The handshake that proves a replica's peer is its coordinator (the ``ray`` placement).

A Ray replica actor listens on a TCP port of its node, where anyone who can reach the node
can connect. Before it reads a single frame of the protocol, the actor makes each peer prove
that it holds the coordinator's secret (:func:`new_secret`, handed to the actor through Ray
when the actor is created, never over this connection):

1. the actor sends a :class:`Challenge`: 32 fresh random bytes;
2. the peer answers with a :class:`Hello`: the HMAC-SHA256 of the challenge under the secret;
3. the actor compares it with its own (:func:`hmac.compare_digest`, constant time).

A peer that answers wrongly, sends anything else, announces a frame longer than
:data:`HANDSHAKE_FRAME_BYTES` or takes more than :data:`AUTH_TIMEOUT` seconds is closed, and
the actor keeps listening; the first peer that passes is served and the listener closes. At
most :data:`MAX_PENDING_PEERS` handshakes run at once (a peer beyond them is closed at once).

The secret itself never crosses the network and a MAC answers one challenge only, so a peer
that overhears a handshake learns nothing it can replay. Everything after the handshake
(prompts, options, tokens) crosses the network **in cleartext**: the network between the
coordinator and its Ray nodes must be trusted.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import struct
from typing import Any

import anyio
import anyio.abc
import msgspec
from anyio.streams.buffered import BufferedByteReceiveStream

from twostroke.engine.coordinator.frames import FrameError, encode_frame

__all__ = [
    "AUTH_TIMEOUT",
    "HANDSHAKE_FRAME_BYTES",
    "MAX_PENDING_PEERS",
    "Challenge",
    "Hello",
    "accept_authenticated",
    "authenticate",
    "new_secret",
]

#: Seconds a peer has, from its connection, to answer the challenge.
AUTH_TIMEOUT = 10.0
#: The longest handshake frame either side reads (a challenge or a MAC is a few dozen).
HANDSHAKE_FRAME_BYTES = 256
#: Handshakes the actor runs at once; a peer beyond them is closed at once.
MAX_PENDING_PEERS = 64

_SECRET_BYTES = 32
_NONCE_BYTES = 32
#: Bound into every MAC, so a MAC of this protocol means nothing to any other.
_CONTEXT = b"twostroke replica handshake v1\x00"
_HEADER = struct.Struct(">I")

logger = logging.getLogger(__name__)


class Challenge(msgspec.Struct, tag="challenge", array_like=True):
    """The actor's first frame: fresh random bytes for the peer to sign."""

    nonce: bytes


class Hello(msgspec.Struct, tag="hello", array_like=True):
    """The peer's first frame: the HMAC-SHA256 of the challenge under the secret."""

    mac: bytes


def new_secret() -> bytes:
    """A coordinator's secret: 32 random bytes (:func:`secrets.token_bytes`)."""
    return secrets.token_bytes(_SECRET_BYTES)


def _mac(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, _CONTEXT + nonce, hashlib.sha256).digest()


async def _read_frame(receive: BufferedByteReceiveStream, frame_type: Any, peer: str) -> Any:
    """Exactly one handshake frame (no byte of the next is read)."""
    (length,) = _HEADER.unpack(await receive.receive_exactly(_HEADER.size))
    if length > HANDSHAKE_FRAME_BYTES:
        raise FrameError(
            f"malformed handshake frame from {peer}: it announces {length} bytes, more than "
            f"the limit of {HANDSHAKE_FRAME_BYTES}"
        )
    body = await receive.receive_exactly(length)
    try:
        return msgspec.msgpack.decode(body, type=frame_type)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(f"malformed handshake frame from {peer}: {exc}") from exc


async def authenticate(stream: anyio.abc.ByteStream, secret: bytes) -> anyio.abc.ByteReceiveStream:
    """The coordinator's half: answer the actor's challenge (callers bound the wait).

    Args:
        stream: The connection to the actor.
        secret: The coordinator's secret.

    Returns:
        What to read the actor's frames from from now on.

    Raises:
        FrameError: what came is no challenge.
        anyio.IncompleteRead: the connection ended first.
    """
    receive = BufferedByteReceiveStream(stream)
    challenge = await _read_frame(receive, Challenge, "the replica")
    await stream.send(encode_frame(Hello(_mac(secret, challenge.nonce))))
    return receive


async def _verify(stream: anyio.abc.ByteStream, secret: bytes) -> BufferedByteReceiveStream | None:
    """The actor's half for one peer: its stream if it proved it holds ``secret``."""
    nonce = secrets.token_bytes(_NONCE_BYTES)
    await stream.send(encode_frame(Challenge(nonce)))
    receive = BufferedByteReceiveStream(stream)
    hello = await _read_frame(receive, Hello, "a peer")
    return receive if hmac.compare_digest(hello.mac, _mac(secret, nonce)) else None


async def accept_authenticated(
    listener: anyio.abc.SocketListener,
    secret: bytes,
    *,
    answer_within: float = AUTH_TIMEOUT,
) -> tuple[anyio.abc.SocketStream, anyio.abc.ByteReceiveStream]:
    """The actor's half: the first peer that proves it holds ``secret``.

    Every other peer is closed: one that fails, or is still in its handshake when another
    passes. Handshakes run concurrently, so a peer that holds its connection open without
    answering delays no one.

    Args:
        listener: Where peers connect.
        secret: The coordinator's secret.
        answer_within: Seconds each peer has, from its connection, to answer.

    Returns:
        The peer's connection, and what to read its frames from.

    Cancellation: every connection accepted so far is closed.
    """
    winner: list[tuple[anyio.abc.SocketStream, anyio.abc.ByteReceiveStream]] = []
    pending = 0

    async def check(stream: anyio.abc.SocketStream, scope: anyio.CancelScope) -> None:
        nonlocal pending
        receive: BufferedByteReceiveStream | None = None
        problem = "its answer was wrong"
        try:
            with anyio.move_on_after(answer_within) as deadline:
                receive = await _verify(stream, secret)
            if deadline.cancelled_caught:
                problem = f"it did not answer within {answer_within} s"
        except (FrameError, anyio.IncompleteRead, anyio.BrokenResourceError, OSError) as exc:
            problem = str(exc) or type(exc).__name__
        finally:
            pending -= 1
            if receive is not None and not winner:
                winner.append((stream, receive))
                scope.cancel()
            else:
                await anyio.aclose_forcefully(stream)
        if receive is None:
            logger.warning("refused a peer of the replica: %s", problem)

    try:
        async with anyio.create_task_group() as task_group:
            while True:
                stream = await listener.accept()
                if pending >= MAX_PENDING_PEERS:
                    await anyio.aclose_forcefully(stream)
                    continue
                pending += 1
                task_group.start_soon(check, stream, task_group.cancel_scope)
    except BaseException:
        # Cancelled (or failed) after a peer passed, while the others were being closed:
        # the winner's connection is nobody's yet, so it is closed here too.
        for passed, _ in winner:
            await anyio.aclose_forcefully(passed)
        raise
    return winner[0]
