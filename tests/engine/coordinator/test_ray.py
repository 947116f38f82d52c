"""Ray actor replicas on a local Ray cluster (slow: Ray starts in ~10 s, each actor in ~5 s).

The cluster is local and loopback-only (``ray.init(num_cpus=2)`` on 127.0.0.1, no
dashboard, no token file in the home directory). The first test runs the Ray example of
``docs/scaling.md`` as written there (the fast docs run skips it).
"""

from __future__ import annotations

import functools
import pathlib
import re
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from twostroke.engine import Coordinator, ReplicaFailed, SamplingParams

from .test_local import bare_outputs, comparable, workload

ray = pytest.importorskip("ray")

# A cluster start is ~10 s on a quiet 2-core machine, but Ray's own processes compete for
# the same cores: with another job busy and the other test worker running, one start took
# over 100 s. Each test is bounded by its own waits; the timeout only catches a hang.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DOC = pathlib.Path(__file__).parents[3] / "docs" / "scaling.md"


def loopback(patch: pytest.MonkeyPatch) -> None:
    """``ray.init`` on loopback, without a dashboard or a token file in the home directory."""
    patch.setenv("RAY_AUTH_MODE", "disabled")
    patch.setattr(
        ray,
        "init",
        functools.partial(
            ray.init, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False
        ),
    )


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A two-CPU Ray cluster for this module's tests; shut down at the end."""
    with pytest.MonkeyPatch.context() as patch:
        loopback(patch)
        ray.init(num_cpus=2)
        try:
            yield
        finally:
            ray.shutdown()


def ray_example() -> str:
    """The Python block of docs/scaling.md that follows its ``<!-- skip: next -->`` marker."""
    text = DOC.read_text(encoding="utf-8")
    found = re.search(r"<!-- skip: next -->\s*```python\n(.*?)```", text, re.DOTALL)
    assert found, "docs/scaling.md lost its Ray example"
    return found.group(1)


def test_the_ray_example_of_the_docs_starts_one_local_cluster_and_stops_it(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Runs before the module's cluster: the example has none to join, so the coordinator
    starts one (on two CPUs here, as every cluster of the suite), once for its two replicas,
    and shuts it down when it leaves its block.

    The example runs on asyncio (``anyio.run``); Ray placement on both backends is the next
    test's. One cluster start costs 22-65 s on two busy cores, so the suite makes no more of
    them than it needs.
    """
    assert not ray.is_initialized()
    loopback(monkeypatch)
    loopback_init = ray.init
    calls: list[int] = []
    lock = threading.Lock()

    def init(*args: Any, **kwargs: Any) -> Any:
        with lock:
            calls.append(threading.get_ident())
            if len(calls) > 1:  # one local cluster per replica: the process died ~60 s later
                raise RuntimeError("ray.init was called again while it was starting a cluster")
        return loopback_init(*args, num_cpus=2, **kwargs)

    monkeypatch.setattr(ray, "init", init)
    code = ray_example()
    assert "ray.init" not in code
    try:
        exec(compile(code, str(DOC), "exec"), {"__name__": "__main__"})
        assert capsys.readouterr().out.strip()
        assert len(calls) == 1
        assert not ray.is_initialized()  # it started the cluster, so it shut it down
    finally:
        if ray.is_initialized():
            ray.shutdown()


@pytest.mark.anyio
async def test_ray_actors_serve_like_a_bare_engine_and_a_killed_one_fails_alone(
    local_ray: None,
) -> None:
    requests = workload(8)
    expected = await bare_outputs(requests)
    long = SamplingParams(max_tokens=4000, ignore_eos=True)
    async with Coordinator.open(
        model="toy", replicas=2, placement="ray", device="cpu", num_blocks=2048, block_size=4
    ) as coordinator:
        outputs = [await coordinator.generate(*request) for request in requests]
        assert [comparable(o) for o in outputs] == [comparable(o) for o in expected]
        streams = [coordinator.submit(f"stream {i}", long) for i in range(4)]
        for handle in streams:
            await handle.next_delta()
        placed = [coordinator._relay.open[h.request_id].replica for h in streams]
        assert sorted(set(placed)) == [0, 1]
        actor = coordinator._replicas[0].replica.actor  # type: ignore[attr-defined]
        await anyio.to_thread.run_sync(ray.kill, actor)
        for handle, replica in zip(streams, placed, strict=True):
            if replica == 0:
                with pytest.raises(ReplicaFailed, match="replica 0 failed: its Ray actor is gone"):
                    await handle.result()
            else:
                await handle.next_delta()
                handle.cancel()
        stats = coordinator.statistics()
        assert [r.alive for r in stats.replicas] == [False, True]
        assert (await coordinator.generate("still here", SamplingParams(max_tokens=3))).text
    assert ray.is_initialized()  # the cluster it was given stays up for its owner
