"""The ``ray`` placement: replicas as Ray actors, on any node of a cluster.

Each actor (:class:`ReplicaActor`, one CPU, or one GPU when the engine's device is CUDA)
listens on a TCP port of its node and serves one coordinator connection with
:func:`~twostroke.engine.coordinator.replica_server.serve`: the very frames a child process
gets on its stdin, over :func:`anyio.connect_tcp` instead. The first peer to prove it holds the
coordinator's secret is served (:mod:`~twostroke.engine.coordinator.auth`); any other is
closed. Ray's own calls are blocking (or asyncio-only), so they run through
:func:`anyio.to_thread.run_sync`, which keeps the coordinator on asyncio and trio alike. A
killed actor closes its connection, which the supervisor sees at once, like a killed child
process.

Ray is optional (``pip install 'twostroke[ray]'``). The coordinator uses the Ray cluster
this process is connected to, or starts a local one (``ray.init()``) once, before its first
replica, if there is none (:func:`ray_cluster`); a cluster it started is shut down when the
last coordinator using it closes.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import anyio
import anyio.abc

from twostroke.engine.coordinator.auth import (
    AUTH_TIMEOUT,
    HandshakeFailed,
    accept_authenticated,
    connect_authenticated,
)
from twostroke.engine.coordinator.frames import FrameError, Start
from twostroke.engine.coordinator.replica_client import Relay, RemoteReplica
from twostroke.engine.errors import ReplicaFailed

__all__ = ["RayReplica", "ReplicaActor", "ray_cluster", "serve_authenticated"]


async def serve_authenticated(
    host: str,
    secret: bytes,
    *,
    answer_within: float = AUTH_TIMEOUT,
    task_status: anyio.abc.TaskStatus[tuple[str, int]] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Listen on ``host`` (a port the OS picks), then serve the first peer that holds
    ``secret`` until it says ``Shutdown``; every other peer is closed.

    Args:
        host: The address to listen on.
        secret: The coordinator's secret.
        answer_within: Seconds each peer has to prove it holds the secret.
        task_status: Gets the address once listening.
    """
    listeners = await anyio.create_tcp_listener(local_host=host, local_port=0)
    async with listeners:
        (listener,) = listeners.listeners  # one address: one listener
        assert isinstance(listener, anyio.abc.SocketListener)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        task_status.started((host, port))
        stream, receive = await accept_authenticated(listener, secret, answer_within=answer_within)
        from twostroke.engine.coordinator.replica_server import serve

        async with stream:  # entered before the next checkpoint: closed if cancelled there
            await listeners.aclose()  # no one else gets in while the peer is served
            await serve(receive, stream)


class ReplicaActor:
    """The body of a replica actor: a thread that serves one connection on a TCP port."""

    def __init__(self) -> None:
        self._address: tuple[str, int] | None = None
        self._error: BaseException | None = None
        self._listening = threading.Event()
        self._thread: threading.Thread | None = None

    def listen(self, secret: bytes) -> tuple[str, int]:
        """Start serving on this node's address (a port the OS picks); that address.

        Args:
            secret: The coordinator's secret, which its peer must prove it holds.

        Raises:
            OSError: it could not listen.
        """
        import ray

        host = str(cast(Any, ray).util.get_node_ip_address())
        self._thread = threading.Thread(target=self._run, args=(host, secret), daemon=True)
        self._thread.start()
        self._listening.wait()
        if self._error is not None:
            raise self._error
        assert self._address is not None
        return self._address

    def _run(self, host: str, secret: bytes) -> None:
        try:
            anyio.run(self._serve, host, secret)
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._listening.set()  # listen() returns (and raises) if it failed to listen

    async def _serve(self, host: str, secret: bytes) -> None:
        async with anyio.create_task_group() as task_group:
            self._address = await task_group.start(serve_authenticated, host, secret)
            self._listening.set()


#: Coordinators of this process using Ray now, and whether one of them started it (Ray's
#: connection is per process, so this bookkeeping is too).
_ray_lock = threading.Lock()
_ray_users = 0
_ray_started_here = False


def _join_ray(ray: Any) -> None:
    global _ray_users, _ray_started_here
    with _ray_lock:
        if _ray_users == 0 and not ray.is_initialized():
            ray.init()
            _ray_started_here = True
        _ray_users += 1


def _leave_ray(ray: Any) -> None:
    global _ray_users, _ray_started_here
    with _ray_lock:
        _ray_users -= 1
        if _ray_users == 0 and _ray_started_here:
            _ray_started_here = False
            ray.shutdown()


@asynccontextmanager
async def ray_cluster() -> AsyncIterator[None]:
    """Ray for a coordinator's block: the cluster this process is connected to, or else a
    local one, started once (``ray.init()``) before any replica and shut down when the last
    coordinator using it leaves its block.

    Without Ray installed it does nothing (each replica then says Ray is missing).

    Cancellation: a cluster it started is shut down all the same.
    """
    try:
        import ray
    except ImportError:
        yield
        return
    await anyio.to_thread.run_sync(_join_ray, ray)
    try:
        yield
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_leave_ray, ray)


class RayReplica(RemoteReplica):
    """A replica in a Ray actor.

    Args:
        index: The replica's index.
        relay: The coordinator.
        start: The first frame (model and engine options).
        grace_period: Seconds an actor told to shut down may take to close its connection.
        secret: The coordinator's secret (:func:`~.auth.new_secret`), which the actor gets
            through Ray and the coordinator proves it holds on the connection.
    """

    placement = "ray"

    def __init__(
        self, index: int, relay: Relay, start: Start, *, grace_period: float, secret: bytes
    ) -> None:
        super().__init__(index, relay, start)
        self._grace_period = grace_period
        self._secret = secret
        self._device = str(start.options.get("device", "cpu"))
        #: The replica's Ray actor handle, once started.
        self.actor: Any = None

    async def run(self) -> None:
        try:
            import ray
        except ImportError as exc:
            self._start_cause = exc
            self.settle_start("placement='ray' needs Ray: pip install 'twostroke[ray]'")
            return
        actor: Any = None
        cause: BaseException | None = None
        try:
            actor, (host, port) = await anyio.to_thread.run_sync(self._start_actor, ray)
            # Retried with a bounded backoff: the actor drops a handshake to make room when
            # too many peers connect at once (auth.MAX_PENDING_PEERS).
            stream, receive = await connect_authenticated(host, port, self._secret)
            async with stream, anyio.create_task_group() as task_group:
                task_group.start_soon(self._close_after_grace, stream)
                cause = await self.serve(receive, stream)
                task_group.cancel_scope.cancel()
        except HandshakeFailed as exc:
            self._start_cause = exc
            self._start_problem = str(exc)
        except (OSError, FrameError, anyio.IncompleteRead, ray.exceptions.RayError) as exc:
            if self._started:
                cause = exc
            else:
                self._start_cause = exc
                self._start_problem = f"its actor could not start: {exc}"
        finally:
            if actor is not None:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(ray.kill, actor)
            self.settle_start()
        if cause is not None:
            error = ReplicaFailed(self.index, f"its Ray actor is gone: {cause}")
            error.__cause__ = cause
            self.fail(error)

    async def _close_after_grace(self, stream: anyio.abc.SocketStream) -> None:
        """An actor told to stop gets ``grace_period`` seconds to close its connection."""
        await self.wait_closed(self._grace_period)
        await stream.aclose()

    def _start_actor(self, ray: Any) -> tuple[Any, tuple[str, int]]:
        # Ray is connected already (ray_cluster, before any replica): a ray.init() per
        # replica here started one local cluster each, at once, and the process died.
        resources = {"num_gpus": 1} if self._device.startswith("cuda") else {"num_cpus": 1}
        actor = ray.remote(**resources)(ReplicaActor).remote()
        self.actor = actor
        address = ray.get(actor.listen.remote(self._secret), timeout=600)
        return actor, tuple(address)
