"""The conversation a response's request carries for an engine that reads it
(``ModelTurnRequest.history``, ``EngineCapabilities.reads_history``): the items before the
pending words, oldest first; none for an engine that does not read it, nor for a response on
its own ``response.input``."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_actors.core import commands as cmd
from duplex_actors.core.clock import ManualClock
from duplex_actors.core.engine_io import FunctionCall, TextDelta
from duplex_actors.core.session import SessionConfig, SessionCore

from .helpers import respond as run_response
from .helpers import user_text


def session(history: bool = True) -> SessionCore:
    config = SessionConfig(respond_on_commit=False, modalities=("text",))
    core = SessionCore("sess_history00000", config, ManualClock(0.0), history=history)
    core.take_events()
    return core


def respond(core: SessionCore, command: cmd.CreateResponse, *outputs):
    """The request one response to its end gave the engine (the events and actions taken)."""
    request, _ = run_response(core, command, *outputs)
    core.take_actions()
    return request


def test_a_response_carries_the_earlier_turns_and_its_own_words_apart():
    core = session()
    core.handle(cmd.CreateItem(item=user_text("my name is Ada")))
    first = respond(core, cmd.CreateResponse(), lambda rid: TextDelta(rid, "hello Ada", 2))
    assert first.history == () and first.input_text == "my name is Ada"
    core.handle(cmd.CreateItem(item=user_text("what is my name")))
    second = respond(core, cmd.CreateResponse())
    assert second.input_text == "what is my name"
    assert [item.role for item in second.history] == ["user", "assistant"]
    assert second.history[0].text == "my name is Ada"
    assert second.history[1].content[0].text == "hello Ada"  # its own answer


def test_a_function_call_and_its_output_are_in_the_history_the_next_response_reads():
    core = session()
    core.handle(cmd.CreateItem(item=user_text("weather in Oslo?")))
    respond(core, cmd.CreateResponse(), lambda rid: FunctionCall(rid, "call_1", "weather", '{"city":"Oslo"}'))
    core.handle(cmd.AddFunctionOutput(call_id="call_1", output='{"c": 4}'))
    after = respond(core, cmd.CreateResponse())
    kinds = [item.type for item in after.history]
    assert kinds[-2:] == ["function_call", "function_call_output"], kinds
    assert after.history[-1].output == '{"c": 4}' and after.history[-2].name == "weather"


def test_no_history_for_an_engine_that_does_not_read_it_nor_for_a_responses_own_input():
    for history in (False, True):
        core = session(history)
        core.handle(cmd.CreateItem(item=user_text("one")))
        respond(core, cmd.CreateResponse(), lambda rid: TextDelta(rid, "two", 1))
        own = respond(core, cmd.CreateResponse(input=(user_text("only this"),), out_of_band=True))
        assert own.history == () and own.input_text == "only this"
        core.handle(cmd.CreateItem(item=user_text("three")))
        plain = respond(core, cmd.CreateResponse())
        assert (len(plain.history) > 0) is history


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.text(min_size=1, max_size=5), st.booleans(), st.booleans()), max_size=12))
def test_the_history_is_the_conversation_less_the_pending_words_in_order(steps):
    # Items created at the end or after the first item (previous_item_id), some answered by a
    # response: the history is every conversation item whose words are not the request's.
    core = session()
    for text, earlier, answer in steps:
        first = next(iter(core._conversation), None)
        previous = first.id if earlier and first is not None else None
        core.handle(cmd.CreateItem(item=user_text(text), previous_item_id=previous))
        if answer:
            before, pending = list(core._conversation), dict(core._pending_text)
            request = respond(core, cmd.CreateResponse(), lambda rid: TextDelta(rid, "ok", 1))
            assert request.history == tuple(item for item in before if item.id not in pending)
            # The pending words in the conversation's order, as the history is (they were read
            # in the order they were added: an item inserted early came last).
            in_order = [item.id for item in before if item.id in pending]
            assert request.input_text == " ".join(t for i in in_order for t in pending[i])


def test_words_inserted_early_are_read_in_the_conversations_order():
    core = session()
    core.handle(cmd.CreateItem(item=user_text("then this")))
    core.handle(cmd.CreateItem(item=user_text("first this"), previous_item_id="root"))
    request = respond(core, cmd.CreateResponse())
    assert request.input_text == "first this then this"


@settings(max_examples=200, deadline=None)
@given(
    st.integers(2, 4),
    st.sampled_from([None, 8, 20]),
    st.lists(
        st.tuples(
            st.sampled_from(["end", "root", "after"]),
            st.integers(0, 5),
            st.text("ab", min_size=1, max_size=6),
        ),
        max_size=14,
    ),
)
def test_pending_words_keep_the_conversations_order_and_their_count_under_its_bounds(
    max_items, max_chars, steps
):
    # The conversation's own bounds let go of its oldest items, some of whose words may still be
    # pending; inserting early reorders what is pending. The character count stays exact, the
    # words of held items follow the conversation, and those let go come first (the oldest).
    config = SessionConfig(
        respond_on_commit=False, modalities=("text",), max_items=max_items, max_conversation_chars=max_chars
    )
    core = SessionCore("sess_history00001", config, ManualClock(0.0), history=True)
    for where, at, text in steps:
        ids = [item.id for item in core._conversation]
        previous = None if where == "end" or not ids else "root" if where == "root" else ids[at % len(ids)]
        core.handle(cmd.CreateItem(item=user_text(text), previous_item_id=previous))
        pending = core._pending_text
        assert core._pending_chars == sum(sum(map(len, t)) + len(t) - 1 for t in pending.values())
        held = [item.id for item in core._conversation if item.id in pending]
        let_go = [i for i in pending if i not in core._conversation]
        assert list(pending) == let_go + held
        assert len(pending) <= max_items
