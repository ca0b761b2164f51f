"""GA details on a real vLLM engine: a forced tool call's arguments are written under the
tool's JSON schema (structured outputs) and valid for it; every turn reports the prompt it read."""

from __future__ import annotations

import json
import re

import attrs
import pytest

pytest.importorskip("vllm")

from duplex_actors.core.engine_io import EngineFailure, FunctionCall, FunctionTool, TurnDone

from .support import collect, make_request

pytestmark = pytest.mark.vllm

SCHEMA = {
    "type": "object",
    "properties": {
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "detailed": {"type": "boolean"},
        "city": {"type": "string", "enum": ["Oslo", "Paris", "Lima"]},
    },
    "required": ["unit", "detailed", "city"],
    "additionalProperties": False,
}


def test_a_forced_call_carries_arguments_valid_for_the_schema(vllm):
    jsonschema = pytest.importorskip("jsonschema")
    tool = FunctionTool("get_weather", parameters=json.dumps(SCHEMA))
    request = attrs.evolve(make_request(200), tools=(tool,), tool_choice="required")
    outputs = vllm.run(collect(vllm.engine, request))
    calls = [o for o in outputs if isinstance(o, FunctionCall)]
    assert len(calls) == 1, outputs
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMA)
    assert calls[0].token_count >= 1
    done = outputs[-1]
    assert isinstance(done, TurnDone) and done.input is not None and done.input.text_tokens > 0


def test_a_turn_reports_its_prompt_tokens(vllm):
    request = make_request(4)
    prompt = vllm.engine.render_prompt(vllm.engine._prompt_builder(request))
    outputs = vllm.run(collect(vllm.engine, request))
    done = outputs[-1]
    assert isinstance(done, TurnDone) and done.input is not None
    assert done.input.text_tokens == len(prompt["prompt_token_ids"]) and done.input.audio_tokens == 0


def test_the_words_a_turn_brings_reach_the_model(vllm):
    # The default prompt left out what the user typed: a text model never read it.
    words = "please tell me about the weather in Oslo tomorrow morning"
    plain = make_request(4)
    typed = attrs.evolve(plain, input_text=words)
    read = []
    for request in (plain, typed):
        done = vllm.run(collect(vllm.engine, request))[-1]
        assert isinstance(done, TurnDone) and done.input is not None, done
        read.append(done.input.text_tokens)
    prompt = vllm.engine.render_prompt(vllm.engine._prompt_builder(typed))
    assert read[1] == len(prompt["prompt_token_ids"])
    assert read[1] > read[0] + len(words.split()) // 2, read  # the words, not only a line about audio


@pytest.mark.parametrize("tokenizer", ["fast", "vllm's"])
def test_words_longer_than_the_window_are_cut_from_their_start_and_the_turn_is_answered(vllm, tokenizer):
    # A pasted document and a question after it: 1,024 tokens of window, far more words. The
    # prompt was refused ("longer than the maximum model length") and the response failed.
    engine = vllm.engine
    window = engine._llm.model_config.max_model_len
    words = " ".join(f"line{i} of the pasted text." for i in range(3000)) + " So what about Oslo?"
    request = attrs.evolve(make_request(4), input_text=words)
    fast = engine._fast_encode, engine._fit_tokenizer
    if tokenizer != "fast":
        engine._fast_encode = engine._fit_tokenizer = None  # vLLM's own tokenizer measures the cut
    try:
        prompt, dropped = vllm.run(engine.prompt_for(request))
        outputs = vllm.run(collect(engine, request), timeout=60)
    finally:
        engine._fast_encode, engine._fit_tokenizer = fast
    kept = len(words) - dropped
    assert 0 < dropped < len(words)
    done = outputs[-1]
    assert isinstance(done, TurnDone) and done.input is not None, outputs[-1:]
    assert done.input.text_tokens == len(prompt["prompt_token_ids"]) <= window - 4
    assert done.input.text_tokens > window - 4 - 16  # the window filled, not a token-for-char guess
    text = engine._llm.get_tokenizer().decode(prompt["prompt_token_ids"])
    assert "So what about Oslo?" in text and text.startswith(("<s>", "Answer briefly.")), text[:40]
    lines = [int(n) for n in re.findall(r"\bline(\d+) of", text)]
    assert lines == list(range(lines[0], 3000)) and lines[0] > 0  # the oldest lines went first
    assert kept <= len(words) - lines[0] * len("line0 of the pasted text. ")


def test_instructions_longer_than_the_window_still_fail_that_request_alone(vllm):
    request = attrs.evolve(make_request(4), instructions="word " * 4000, input_text="hello")
    outputs = vllm.run(collect(vllm.engine, request), timeout=60)
    assert [type(o) for o in outputs] == [EngineFailure] and not outputs[0].retryable, outputs
    assert isinstance(vllm.run(collect(vllm.engine, make_request(4)), timeout=60)[-1], TurnDone)


@pytest.mark.parametrize(
    "parameter",
    [
        {"type": "array", "minItems": 10**9, "items": {"type": "integer"}},
        {"type": "string", "minLength": 10**9},
        {"type": "string", "pattern": r"^(\w+\s?)*[!?]$"},  # backtracks for minutes under re
    ],
    ids=["billion-items", "billion-characters", "backtracking-pattern"],
)
def test_a_hostile_schema_ends_its_own_request_and_the_engine_serves_the_next(vllm, parameter):
    # Structured outputs compile the client's schema in vLLM's engine core: what no argument
    # within the token limit satisfies fails that request alone (measured 0.15-0.28 s each on
    # the tiny model), and the engine goes on.
    schema = {"type": "object", "properties": {"x": parameter}, "required": ["x"]}
    tool = FunctionTool("f", parameters=json.dumps(schema))
    request = attrs.evolve(make_request(64), tools=(tool,), tool_choice="required")
    outputs = vllm.run(collect(vllm.engine, request), timeout=60)
    if "pattern" in parameter and len(outputs) > 1:
        # The grammar is a regular language's, with no backtracking: a short match is a call.
        call = next(o for o in outputs if isinstance(o, FunctionCall))
        assert re.fullmatch(parameter["pattern"], json.loads(call.arguments)["x"])
    else:
        assert [type(o) for o in outputs] == [EngineFailure], outputs
        assert not outputs[0].retryable and "'f'" in outputs[0].message
    after = vllm.run(collect(vllm.engine, make_request(4)), timeout=60)
    assert isinstance(after[-1], TurnDone)


class _Lent:
    """The shared engine lent to one runtime: starting and closing it stay the fixture's."""

    name = "vllm-lent"

    def __init__(self, engine) -> None:
        self._engine = engine
        self.capabilities = engine.capabilities

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    def generate(self, request):
        return self._engine.generate(request)

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)


def test_a_pasted_document_longer_than_the_window_is_answered_through_the_runtime(vllm):
    # As an application would: a user message of 86 k characters, then a response. The
    # session keeps the words (within max_conversation_chars); the engine fits them.
    from duplex_actors import Runtime
    from duplex_actors.core import commands as cmd
    from duplex_actors.core.conversation import ContentPart, Item

    text = " ".join(f"line{i} of the pasted text." for i in range(3000)) + " So what about Oslo?"

    async def converse():
        async with Runtime(_Lent(vllm.engine)) as runtime:
            session = await runtime.open_session(modalities=("text",))
            item = Item(id="", role="user", content=(ContentPart(type="input_text", text=text),))
            await session.ask(cmd.CreateItem(item=item))
            await session.create_response(max_tokens=4)
            while (event := await session.next_event(timeout=60)).type != "response.done":
                pass
            await session.close()
            return event

    done = vllm.run(converse())
    # The fixture's engine ignores EOS: an answer always runs to its 4 tokens (failed before).
    assert (done.status, done.reason) == ("incomplete", "max_output_tokens")
    window = vllm.engine._llm.model_config.max_model_len
    assert done.input_usage is not None and window - 24 < done.input_usage.text_tokens <= window - 4
    assert done.output_tokens == 4


def test_a_later_turn_reads_the_earlier_ones_through_the_runtime(vllm):
    # A text model behind vLLM read only the newest words: no earlier turn, not its own
    # answers. Now the conversation is in the prompt, and what the model read grows with it.
    from duplex_actors import Runtime
    from duplex_actors.core import commands as cmd
    from duplex_actors.core.conversation import ContentPart, Item

    async def converse():
        read = []
        async with Runtime(_Lent(vllm.engine)) as runtime:
            session = await runtime.open_session(modalities=("text",))
            for words in ("my name is Ada and I live in Oslo", "what is my name?"):
                item = Item(id="", role="user", content=(ContentPart(type="input_text", text=words),))
                await session.ask(cmd.CreateItem(item=item))
                await session.create_response(max_tokens=4)
                while (event := await session.next_event(timeout=60)).type != "response.done":
                    pass
                read.append(event.input_usage.text_tokens)
            await session.close()
        return read

    first, second = vllm.run(converse())
    tokenizer = vllm.engine._llm.get_tokenizer()
    earlier = len(tokenizer.encode("User: my name is Ada and I live in Oslo\n", add_special_tokens=False))
    assert second >= first + earlier, (first, second, earlier)  # the first exchange, and more


def test_a_history_longer_than_the_window_loses_its_oldest_items_with_no_words_pending(vllm):
    # A turn of committed audio alone (no typed words) after a long conversation: the prompt's
    # length is all history, which must be fitted as the words are.
    from duplex_actors.core.conversation import ContentPart, Item

    history = tuple(
        Item(id=f"it_{i}", role="user", content=(ContentPart(type="input_text", text=f"line{i} " * 40),))
        for i in range(60)
    )
    request = attrs.evolve(make_request(4), history=history)
    prompt, dropped = vllm.run(vllm.engine.prompt_for(request))
    window = vllm.engine._llm.model_config.max_model_len
    assert dropped == 0 and len(prompt["prompt_token_ids"]) <= window - 4
    text = vllm.engine._llm.get_tokenizer().decode(prompt["prompt_token_ids"])
    assert "line59 " in text and "line0 " not in text and "User audio:" in text
    done = vllm.run(collect(vllm.engine, request), timeout=60)[-1]
    assert isinstance(done, TurnDone), done
