"""The embedded engine's documented tool trigger: a forced tool_choice makes it call the tool
(random weights cannot choose one); "auto" and follow-up turns decode as usual."""

from __future__ import annotations

import attrs
import pytest

pytest.importorskip("torch")

from duplex_actors.core.engine_io import (
    Decision,
    FunctionCall,
    FunctionResult,
    FunctionTool,
    TextDelta,
    TurnDone,
)

from .helpers import request, run, small_engine

pytestmark = pytest.mark.embedded

TOOLS = (FunctionTool("get_weather"), FunctionTool("get_time"))


async def _outputs(engine, req):
    return [o async for o in engine.generate(req)]


def test_forced_tool_choice_calls_that_tool_and_auto_decodes():
    async def main():
        engine = small_engine()
        await engine.start()
        try:
            named = await _outputs(
                engine, attrs.evolve(request("sess_t"), tools=TOOLS, tool_choice="get_time")
            )
            required = await _outputs(
                engine, attrs.evolve(request("sess_r"), tools=TOOLS, tool_choice="required")
            )
            auto = await _outputs(engine, attrs.evolve(request("sess_a"), tools=TOOLS))
            follow = await _outputs(
                engine,
                attrs.evolve(
                    request("sess_f"),
                    tools=TOOLS,
                    tool_choice="required",
                    function_results=(FunctionResult("call_1", "21 C", "get_weather"),),
                ),
            )
        finally:
            await engine.aclose()
        return named, required, auto, follow

    named, required, auto, follow = run(main())
    assert [type(o) for o in named] == [Decision, FunctionCall, TurnDone]
    assert named[1].name == "get_time" and named[1].arguments == "{}" and named[1].call_id
    assert required[1].name == "get_weather"
    for decoded in (auto, follow):
        assert not any(isinstance(o, FunctionCall) for o in decoded)
        assert any(isinstance(o, TextDelta) for o in decoded) and isinstance(decoded[-1], TurnDone)
