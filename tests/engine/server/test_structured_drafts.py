"""Constrained requests to a server that drafts (speculative decoding), over HTTP.

Issue 48: ``twostroke serve --model toy --speculative-config '{"method": "ngram",
"num_speculative_tokens": 8, "adaptive": false}'`` answered the first constrained request
whose draft the constraint refused with a 503 ``engine_dead``, and every request after it
too: the masks after a refused draft handed llguidance the request's matcher twice.
"""

from __future__ import annotations

import json
import re
from typing import Any

import anyio
import httpx
import pytest

from tests.engine.server.test_structured import TOOLS
from twostroke.engine import Engine
from twostroke.engine.server import build_app

pytestmark = pytest.mark.anyio

REGEX = "(ab){2,6}c(ba){2,6}"
CHAT = [{"role": "user", "content": "Say yes or no, then the weather in Oslo as JSON."}]
TOOL = TOOLS[1]  # get_time: a zone from an enum


#: Each kind of constraint: the endpoint and the body.
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "ababababc babababa", "structured_outputs": {"regex": REGEX}}),
    (
        "/v1/completions",
        {"prompt": "yes or no? yes no yes", "structured_outputs": {"choice": ["yes", "no"]}},
    ),
    (
        "/v1/completions",
        {"prompt": "abbb abbb abbb", "structured_outputs": {"grammar": 'start: "a" "b"+'}},
    ),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"}}),
    (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "time", "schema": TOOL["function"]["parameters"]},
            },
        },
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "tools": [TOOL], "tool_choice": "required", "max_tokens": 200},
    ),
]


async def answers(spec: dict[str, Any] | None) -> list[Any]:
    """The choices a toy server answers :data:`REQUESTS` with, one after the other.

    Through the application itself (ASGI), each request shielded: an engine that dies
    cancels its block's body, and the test wants the answer a client got (a 503 before the
    fix), not the cancellation.
    """
    async with Engine.open(
        model="toy", device="cpu", speculative_config=spec, pipeline_depth=2
    ) as engine:
        transport = httpx.ASGITransport(app=build_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            choices = []
            for path, body in REQUESTS:
                with anyio.CancelScope(shield=True):
                    reply = await http.post(path, json={"model": "toy", "max_tokens": 64} | body)
                assert reply.status_code == 200, (path, body, reply.text)
                choices.append(reply.json()["choices"])
                for call in choices[-1][0].get("message", {}).get("tool_calls") or []:
                    del call["id"]  # random: the rest is what the model wrote
            assert (await http.get("/health")).status_code == 200
        if spec is not None:
            assert engine.statistics().num_spec_decode_drafts > 0
        await engine.wait_idle()
        engine.check_invariants()
    return choices


@pytest.mark.parametrize("method", ["ngram", "suffix"])
async def test_a_server_that_drafts_answers_every_kind_of_constraint(method: str) -> None:
    """The same answers as without drafts; the issue's regex request among them."""
    plain = await answers(None)
    drafted = await answers({"method": method, "num_speculative_tokens": 8, "adaptive": False})
    assert drafted == plain
    assert re.fullmatch(REGEX, drafted[0][0]["text"])
    assert json.loads(drafted[4][0]["message"]["content"])["zone"] in {"UTC", "CET"}
    call = drafted[5][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_time"
