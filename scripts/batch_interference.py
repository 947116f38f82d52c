"""Interactive TTFT and TPOT with and without a batch running on the same engine.

Not a test: the measurement behind docs/serving.md's "Batches" (a batch runs behind
interactive traffic). The server runs in this process (``serve`` on a free loopback port,
the engine on the CPU), and the official ``openai`` client streams interactive chat
completions one after another, first alone, then while a batch of ``--batch-lines`` lines
(each ``--batch-tokens`` tokens, at priority 1000, at most ``--in-flight`` at once) runs.
It prints the CPU (``torch.backends.cpu.get_cpu_capability()``), then the median and p90
TTFT and TPOT of each phase, and how many batch lines were answered meanwhile::

    .venv/bin/python scripts/batch_interference.py                 # SmolLM2-135M
    .venv/bin/python scripts/batch_interference.py --model toy --requests 3 --batch-lines 4

The machine's other load changes the numbers: compare phases of one run, not runs.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from functools import partial

import anyio
import torch
from openai import AsyncOpenAI

from twostroke.engine import Engine
from twostroke.engine.server import ServerConfig, serve


async def interactive(
    client: AsyncOpenAI, model: str, count: int, tokens: int
) -> list[tuple[float, float]]:
    """(TTFT, TPOT) of ``count`` streamed chat completions, one after another."""
    timings = []
    for index in range(count):
        started = time.perf_counter()
        first = last = None
        chunks = 0
        stream = await client.chat.completions.create(
            model=model, max_tokens=tokens, stream=True, temperature=0,
            messages=[{"role": "user", "content": f"Tell me a story, number {index}."}],
        )  # fmt: skip
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                last = time.perf_counter()
                first = first or last
                chunks += 1
        assert first is not None, "the stream had no text"
        assert last is not None
        timings.append((first - started, (last - first) / max(chunks - 1, 1)))
    return timings


def summary(name: str, timings: list[tuple[float, float]]) -> str:
    def cut(values: list[float]) -> str:
        ordered = sorted(values)
        p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        return f"median {statistics.median(ordered) * 1000:7.1f} ms, p90 {p90 * 1000:7.1f} ms"

    ttft, tpot = zip(*timings, strict=True)
    return f"{name:>14}: TTFT {cut(list(ttft))} | TPOT {cut(list(tpot))}"


async def main(args: argparse.Namespace) -> None:
    print(
        f"cpu: {torch.backends.cpu.get_cpu_capability()}, torch threads {torch.get_num_threads()}"
    )
    config = ServerConfig(batches_store=":memory:", batch_max_in_flight=args.in_flight)
    async with Engine.open(model=args.model, device="cpu") as engine:
        model = engine.model_name
        async with anyio.create_task_group() as group:
            port = await group.start(partial(serve, engine, port=0, config=config))
            async with AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-",
                                   max_retries=0) as client:  # fmt: skip
                await interactive(client, model, 1, 4)  # warm-up
                alone = await interactive(client, model, args.requests, args.tokens)
                lines = [
                    {"custom_id": f"b{index}", "method": "POST", "url": "/v1/chat/completions",
                     "body": {"model": model, "max_tokens": args.batch_tokens, "ignore_eos": True,
                              "messages": [{"role": "user", "content": f"Essay {index}."}]}}
                    for index in range(args.batch_lines)
                ]  # fmt: skip
                content = "".join(json.dumps(line) + "\n" for line in lines).encode()
                upload = await client.files.create(
                    file=("batch.jsonl", io.BytesIO(content)), purpose="batch"
                )
                batch = await client.batches.create(
                    input_file_id=upload.id, endpoint="/v1/chat/completions",
                    completion_window="24h",
                )  # fmt: skip
                while (await client.batches.retrieve(batch.id)).status == "validating":  # noqa: ASYNC110
                    await anyio.sleep(0.05)  # a poll of the server's batch, as a client polls
                beside = await interactive(client, model, args.requests, args.tokens)
                after = await client.batches.retrieve(batch.id)
                counts = after.request_counts
                if after.status == "in_progress":
                    await client.batches.cancel(batch.id)
            group.cancel_scope.cancel()
    print(summary("alone", alone))
    print(summary("beside a batch", beside))
    done = counts.completed if counts is not None else 0
    print(f"batch lines answered meanwhile: {done} of {args.batch_lines} ({after.status})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=10, help="interactive requests a phase")
    parser.add_argument("--tokens", type=int, default=32, help="tokens an interactive request")
    parser.add_argument("--batch-lines", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=128)
    parser.add_argument("--in-flight", type=int, default=8, help="batch_max_in_flight")
    anyio.run(main, parser.parse_args())
