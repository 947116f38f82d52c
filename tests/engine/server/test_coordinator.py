"""The server takes any engine surface: the same API over a coordinator of two replicas."""

from __future__ import annotations

from functools import partial

import anyio
import pytest

from twostroke.engine.coordinator import Coordinator
from twostroke.engine.server import serve

from .conftest import OPENAI_STREAMS_ON_TRIO, http_client, openai_client

pytestmark = [pytest.mark.anyio, OPENAI_STREAMS_ON_TRIO]


async def test_serving_a_coordinator() -> None:
    async with Coordinator.open(model="toy", replicas=2, device="cpu") as coordinator:
        async with anyio.create_task_group() as task_group:
            port = await task_group.start(partial(serve, coordinator, port=0))
            base_url = f"http://127.0.0.1:{port}"
            async with (
                openai_client(f"{base_url}/v1", api_key="-") as client,
                http_client(base_url) as http,
            ):
                reply = await client.completions.create(
                    model="toy", prompt="hello", max_tokens=6, n=4, extra_body={"ignore_eos": True}
                )
                assert reply.usage is not None
                assert reply.usage.completion_tokens == 24
                stream = await client.completions.create(
                    model="toy", prompt="long", max_tokens=2000, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                async for _ in stream:
                    break
                await stream.close()
                with anyio.fail_after(10):
                    await coordinator.wait_idle()
                    while (
                        'finished_reason="abort",model_name="toy"} 1.0'
                        not in (await http.get("/metrics")).text
                    ):
                        pass
                assert (await http.get("/health")).status_code == 200
            task_group.cancel_scope.cancel()
        stats = coordinator.statistics()
        assert stats.num_free_blocks == stats.num_blocks
        assert stats.num_open_requests == 0
