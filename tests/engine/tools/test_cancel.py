"""A request under the tools' lazy constraint cancelled at any point: nothing is lost."""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twostroke.engine import RequestCancelled
from twostroke.engine.tools import GENERIC, ToolSpec, Turn, render_prompt, tool_constraint
from twostroke.states.params import SamplingParams

from ..conftest import toy_engine
from ..server.scripted import ScriptedRunner

pytestmark = pytest.mark.anyio

TOOL = ToolSpec("now", None, {"type": "object", "properties": {"zone": {"type": "string"}}})
REPLY = 'Let me see. <tool_call>\n{"name": "now", "arguments": {"zone": "CET"}}\n</tool_call>'


@settings(max_examples=5, deadline=None)
@given(cut=st.integers(0, len(REPLY) + 2))
async def test_a_cancel_anywhere_in_a_call_leaves_nothing_open_or_constrained(cut: int) -> None:
    """Cancel after ``cut`` output tokens (in the text, the trigger, the name, the
    arguments, the closing tag or after the end): the request ends cancelled or finished,
    every block is free, and the next request, unconstrained, samples no masked row."""
    prompt = render_prompt(GENERIC, [Turn("user", "The time?")], [TOOL])
    params = SamplingParams(max_tokens=120, constraint=tool_constraint(GENERIC, [TOOL]))
    async with toy_engine(runner=ScriptedRunner(lambda _: REPLY), num_blocks=256) as engine:
        handle = engine.submit(prompt, params)
        received = 0
        async for delta in handle:
            received += len(delta.token_ids)
            if received >= cut:
                handle.cancel()
                break
        with anyio.fail_after(10):
            try:
                output = await handle.result()
            except RequestCancelled:
                pass
            else:
                assert output.text == REPLY  # it had finished before the cancel
            await engine.wait_idle()
        masked = engine.statistics().num_masked_rows
        plain = await engine.generate(prompt, SamplingParams(max_tokens=8))
        assert plain.text == REPLY[:8]
        assert engine.statistics().num_masked_rows == masked
    # toy_engine checked on leaving: idle, invariants hold, every block free, none open
