"""The ``ray`` placement: replicas as Ray actors, on any node of a cluster.

Each actor (:class:`ReplicaActor`, one CPU, or one GPU when the engine's device is CUDA)
listens on a TCP port of its node and serves one coordinator connection with
:func:`~twostroke.engine.coordinator.replica.serve`: the very frames a child process gets on
its stdin, over :func:`anyio.connect_tcp` instead. Ray's own calls are blocking (or
asyncio-only), so they run through :func:`anyio.to_thread.run_sync`, which keeps the
coordinator on asyncio and trio alike. A killed actor closes its connection, which the
supervisor sees at once, like a killed child process.

Ray is optional (``pip install 'twostroke[ray]'``). The coordinator uses the Ray cluster
this process is connected to, or starts a local one (``ray.init()``) if there is none.
"""

from __future__ import annotations

import threading
from typing import Any, cast

import anyio
import anyio.abc

from twostroke.engine.coordinator.frames import Start
from twostroke.engine.coordinator.replicas import Relay, RemoteReplica
from twostroke.engine.errors import ReplicaFailed

__all__ = ["RayReplica", "ReplicaActor"]


class ReplicaActor:
    """The body of a replica actor: a thread that serves one connection on a TCP port."""

    def __init__(self) -> None:
        self._address: tuple[str, int] | None = None
        self._listening = threading.Event()
        self._thread: threading.Thread | None = None

    def listen(self) -> tuple[str, int]:
        """Start serving on this node's address (a port the OS picks); that address."""
        import ray

        host = str(cast(Any, ray).util.get_node_ip_address())
        self._thread = threading.Thread(target=anyio.run, args=(self._serve, host), daemon=True)
        self._thread.start()
        self._listening.wait()
        assert self._address is not None
        return self._address

    async def _serve(self, host: str) -> None:
        listeners = await anyio.create_tcp_listener(local_host=host, local_port=0)
        async with listeners:
            (listener,) = listeners.listeners  # one address: one listener
            assert isinstance(listener, anyio.abc.SocketListener)
            port = listener.extra(anyio.abc.SocketAttribute.local_port)
            self._address = (host, port)
            self._listening.set()
            stream = await listener.accept()
        from twostroke.engine.coordinator.replica import serve

        async with stream:
            await serve(stream, stream)


class RayReplica(RemoteReplica):
    """A replica in a Ray actor.

    Args:
        index: The replica's index.
        relay: The coordinator.
        start: The first frame (model and engine options).
        grace_period: Seconds an actor told to shut down may take to close its connection.
    """

    placement = "ray"

    def __init__(self, index: int, relay: Relay, start: Start, *, grace_period: float) -> None:
        super().__init__(index, relay, start)
        self._grace_period = grace_period
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
            actor, address = await anyio.to_thread.run_sync(self._start_actor, ray)
            stream = await anyio.connect_tcp(*address)
            async with stream, anyio.create_task_group() as task_group:
                task_group.start_soon(self._close_after_grace, stream)
                cause = await self.serve(stream, stream)
                task_group.cancel_scope.cancel()
        except (OSError, ray.exceptions.RayError) as exc:
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
        if not ray.is_initialized():
            ray.init()
        resources = {"num_gpus": 1} if self._device.startswith("cuda") else {"num_cpus": 1}
        actor = ray.remote(**resources)(ReplicaActor).remote()
        self.actor = actor
        address = ray.get(actor.listen.remote(), timeout=600)
        return actor, tuple(address)
