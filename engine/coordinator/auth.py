"""The handshake that proves a replica's peer is its coordinator (the ``ray`` placement).

A Ray replica actor listens on a TCP port of its node, where anyone who can reach the node
can connect. Before it reads a single frame of the protocol, the actor makes each peer prove
that it holds the coordinator's secret (:func:`new_secret`, handed to the actor through Ray
when the actor is created, never over this connection):

1. the actor sends a :class:`Challenge`: 32 fresh random bytes;
2. the peer answers with a :class:`Hello`: the HMAC-SHA256 of the challenge under the secret;
3. the actor compares it with its own (:func:`hmac.compare_digest`, constant time) and, if
   they match, sends a :class:`Welcome`: the coordinator knows it got in.

A peer that answers wrongly, sends anything else, announces a frame longer than
:data:`HANDSHAKE_FRAME_BYTES` or takes more than :data:`AUTH_TIMEOUT` seconds is closed, and
the actor keeps listening; the first peer that passes is served and the listener closes.
Handshakes run concurrently, at most :data:`MAX_PENDING_PEERS` at once: when a peer connects
while that many are pending, the *oldest* is dropped to make room. So peers that connect and
say nothing cannot lock the coordinator out (refusing the newcomer instead, 64 silent
connections renewed every :data:`AUTH_TIMEOUT` did): the coordinator's handshake takes one
round trip, and only :data:`MAX_PENDING_PEERS` more connections within that round trip push it
out.

The coordinator's half (:func:`connect_authenticated`) tries again when the connection is
refused, lost or dropped during its handshake, after a pause that doubles from
:data:`FIRST_RETRY_PAUSE` to :data:`MAX_RETRY_PAUSE`, for at most :data:`CONNECT_TIMEOUT`
seconds in all; then it raises :class:`HandshakeFailed`, which names the address, the attempts
and the last failure.

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
import attrs
import msgspec
from anyio.streams.buffered import BufferedByteReceiveStream

from twostroke.engine.coordinator.frames import FrameError, encode_frame
from twostroke.states.errors import EngineError

__all__ = [
    "AUTH_TIMEOUT",
    "CONNECT_TIMEOUT",
    "FIRST_RETRY_PAUSE",
    "HANDSHAKE_FRAME_BYTES",
    "MAX_PENDING_PEERS",
    "MAX_RETRY_PAUSE",
    "Challenge",
    "HandshakeFailed",
    "Hello",
    "Welcome",
    "accept_authenticated",
    "authenticate",
    "connect_authenticated",
    "new_secret",
]

#: Seconds a peer has, from its connection, to answer the challenge (and the coordinator, on
#: each attempt, to connect and get it).
AUTH_TIMEOUT = 10.0
#: The longest handshake frame either side reads (a challenge or a MAC is a few dozen).
HANDSHAKE_FRAME_BYTES = 256
#: Handshakes the actor runs at once; a peer that connects beyond them drops the oldest.
MAX_PENDING_PEERS = 64
#: Seconds the coordinator keeps trying to connect to its actor and pass the handshake.
CONNECT_TIMEOUT = 60.0
#: The coordinator's pause before its second attempt; each pause after doubles it...
FIRST_RETRY_PAUSE = 0.1
#: ...up to this many seconds.
MAX_RETRY_PAUSE = 5.0

_SECRET_BYTES = 32
_NONCE_BYTES = 32
#: Bound into every MAC, so a MAC of this protocol means nothing to any other.
_CONTEXT = b"twostroke replica handshake v2\x00"
_HEADER = struct.Struct(">I")

logger = logging.getLogger(__name__)


class HandshakeFailed(EngineError):
    """The coordinator could not connect to a replica's actor and pass its handshake in time.

    Its message names the address, how many attempts were made over how long, and the last
    attempt's failure (also its ``__cause__``). The Ray replica fails its start with it
    (:class:`~twostroke.engine.errors.ReplicaFailed`, whose ``__cause__`` it is).

    Attributes:
        address: The actor's ``(host, port)``.
        attempts: Connections tried.
    """

    def __init__(self, message: str, address: tuple[str, int], attempts: int) -> None:
        super().__init__(message)
        self.address = address
        self.attempts = attempts


class Challenge(msgspec.Struct, tag="challenge", array_like=True):
    """The actor's first frame: fresh random bytes for the peer to sign."""

    nonce: bytes


class Hello(msgspec.Struct, tag="hello", array_like=True):
    """The peer's first frame: the HMAC-SHA256 of the challenge under the secret."""

    mac: bytes


class Welcome(msgspec.Struct, tag="welcome", array_like=True):
    """The actor's second frame, to a peer that passed: the handshake is over.

    Without it the coordinator could not tell a passed handshake from a connection the
    actor dropped after the answer, which it must try again.
    """


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
    """The coordinator's half on one connection: answer the actor's challenge and wait for
    its welcome (callers bound the wait).

    Args:
        stream: The connection to the actor.
        secret: The coordinator's secret.

    Returns:
        What to read the actor's frames from from now on.

    Raises:
        FrameError: what came is no challenge, or no welcome.
        anyio.IncompleteRead: the connection ended first: the actor refused the answer or
            dropped the connection (to make room for newer peers, or at its deadline).
        anyio.BrokenResourceError: the connection was lost.
    """
    receive = BufferedByteReceiveStream(stream)
    challenge = await _read_frame(receive, Challenge, "the replica")
    await stream.send(encode_frame(Hello(_mac(secret, challenge.nonce))))
    await _read_frame(receive, Welcome, "the replica")
    return receive


#: What one failed attempt of the coordinator's may raise (anything else is no transient).
_ATTEMPT_FAILURES = (OSError, anyio.IncompleteRead, anyio.BrokenResourceError)


async def connect_authenticated(
    host: str,
    port: int,
    secret: bytes,
    *,
    give_up_after: float = CONNECT_TIMEOUT,
    attempt_within: float = AUTH_TIMEOUT,
    first_pause: float = FIRST_RETRY_PAUSE,
    max_pause: float = MAX_RETRY_PAUSE,
) -> tuple[anyio.abc.SocketStream, anyio.abc.ByteReceiveStream]:
    """The coordinator's half: connect to the actor at ``(host, port)`` and pass its
    handshake, trying again until it gets in or ``give_up_after`` seconds have passed.

    An attempt fails when the connection is refused or lost, or ends before the actor's
    welcome (it dropped the connection: too many peers at once, or its deadline), or takes
    more than ``attempt_within`` seconds; the next one follows a pause that starts at
    ``first_pause`` and doubles up to ``max_pause``. A malformed frame ends the attempts at
    once: whoever listens there is no replica actor.

    Args:
        host: The actor's address.
        port: Its port.
        secret: The coordinator's secret.
        give_up_after: Seconds from the first attempt after which no other starts.
        attempt_within: Seconds one attempt has to connect and be welcomed.
        first_pause: Seconds before the second attempt.
        max_pause: The longest pause between two attempts.

    Returns:
        The connection, and what to read the actor's frames from.

    Raises:
        HandshakeFailed: no attempt got in; it names the address, the attempts, the time
            they took and the last failure (its ``__cause__``).
        FrameError: the peer sent a malformed frame.

    Cancellation: the connection being tried is closed.
    """
    address = (host, port)
    began = anyio.current_time()
    give_up_at = began + give_up_after
    pause = first_pause
    attempts = 0
    while True:
        attempts += 1
        try:
            # The last attempt ends at the deadline too: the bound is on the whole.
            within = min(attempt_within, max(give_up_at - anyio.current_time(), 0.0))
            with anyio.fail_after(within):
                stream = await anyio.connect_tcp(host, port)
                try:
                    receive = await authenticate(stream, secret)
                except BaseException:
                    await anyio.aclose_forcefully(stream)
                    raise
            return stream, receive
        except _ATTEMPT_FAILURES as exc:
            failure: Exception = exc
        if isinstance(failure, TimeoutError):  # fail_after's, with no message of its own
            why = f"it got no welcome within {within:g} s"
        elif isinstance(failure, anyio.IncompleteRead):
            why = "the actor closed the connection before its welcome"
        else:
            why = f"{type(failure).__name__}: {failure}"
        now = anyio.current_time()
        if now + pause >= give_up_at:
            raise HandshakeFailed(
                f"could not pass the handshake of the replica actor at {host}:{port}: "
                f"{attempts} attempt{'s' if attempts > 1 else ''} in {now - began:.1f} s "
                f"(at most {give_up_after:g} s, each at most {attempt_within:g} s); the last "
                f"failed: {why}",
                address,
                attempts,
            ) from failure
        logger.info(
            "attempt %d to reach the replica actor at %s:%d failed (%s); again in %g s",
            attempts,
            host,
            port,
            why,
            pause,
        )
        await anyio.sleep(pause)
        pause = min(pause * 2, max_pause)


async def _verify(stream: anyio.abc.ByteStream, secret: bytes) -> BufferedByteReceiveStream | None:
    """The actor's half for one peer: its stream if it proved it holds ``secret`` (then it
    has been welcomed)."""
    nonce = secrets.token_bytes(_NONCE_BYTES)
    await stream.send(encode_frame(Challenge(nonce)))
    receive = BufferedByteReceiveStream(stream)
    hello = await _read_frame(receive, Hello, "a peer")
    if not hmac.compare_digest(hello.mac, _mac(secret, nonce)):
        return None
    await stream.send(encode_frame(Welcome()))
    return receive


@attrs.define(eq=False)
class _Pending:
    """One peer's handshake in progress, as the actor's accept loop tracks it."""

    #: Ends the handshake: at the peer's deadline, or when a newer peer pushes it out.
    scope: anyio.CancelScope
    pushed_out: bool = False


async def accept_authenticated(
    listener: anyio.abc.SocketListener,
    secret: bytes,
    *,
    answer_within: float = AUTH_TIMEOUT,
) -> tuple[anyio.abc.SocketStream, anyio.abc.ByteReceiveStream]:
    """The actor's half: the first peer that proves it holds ``secret``.

    Every other peer is closed: one that fails, one still in its handshake when another
    passes, and the oldest of :data:`MAX_PENDING_PEERS` pending handshakes when one more
    peer connects. Handshakes run concurrently, so a peer that holds its connection open
    without answering delays no one, and silent peers cannot fill the actor's room: each
    newcomer gets its challenge.

    Args:
        listener: Where peers connect.
        secret: The coordinator's secret.
        answer_within: Seconds each peer has, from its connection, to answer.

    Returns:
        The peer's connection, and what to read its frames from.

    Cancellation: every connection accepted so far is closed.
    """
    winner: list[tuple[anyio.abc.SocketStream, anyio.abc.ByteReceiveStream]] = []
    # Handshakes in progress, oldest first (a dict keeps its insertion order).
    pending: dict[_Pending, None] = {}

    async def check(
        stream: anyio.abc.SocketStream, handshake: _Pending, group: anyio.CancelScope
    ) -> None:
        receive: BufferedByteReceiveStream | None = None
        problem = "its answer was wrong"
        try:
            with handshake.scope:
                receive = await _verify(stream, secret)
            if handshake.scope.cancelled_caught:
                problem = (
                    f"it had not answered when {MAX_PENDING_PEERS} newer peers were in their "
                    "handshakes (the oldest makes room)"
                    if handshake.pushed_out
                    else f"it did not answer within {answer_within} s"
                )
        except (FrameError, anyio.IncompleteRead, anyio.BrokenResourceError, OSError) as exc:
            problem = str(exc) or type(exc).__name__
        finally:
            pending.pop(handshake, None)
            if receive is not None and not winner:
                winner.append((stream, receive))
                group.cancel()
            else:
                await anyio.aclose_forcefully(stream)
        if receive is None:
            logger.warning("refused a peer of the replica: %s", problem)

    try:
        async with anyio.create_task_group() as task_group:
            while True:
                stream = await listener.accept()
                if len(pending) >= MAX_PENDING_PEERS:
                    oldest = next(iter(pending))
                    del pending[oldest]
                    oldest.pushed_out = True
                    oldest.scope.cancel()
                deadline = anyio.current_time() + answer_within
                handshake = _Pending(anyio.CancelScope(deadline=deadline))
                pending[handshake] = None
                task_group.start_soon(check, stream, handshake, task_group.cancel_scope)
    except BaseException:
        # Cancelled (or failed) after a peer passed, while the others were being closed:
        # the winner's connection is nobody's yet, so it is closed here too.
        for passed, _ in winner:
            await anyio.aclose_forcefully(passed)
        raise
    return winner[0]
