"""GA out-of-band responses (``response.conversation: "none"``) and ``response.input``.

An out-of-band response writes nothing into the conversation, and the user's pending turn
(committed audio, texts not yet answered) waits for its own response. ``response.input``
gives a response its own context instead of the pending turn: items written in the request,
or ids of items already in the conversation.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duplex_actors.core import commands as cmd
from duplex_actors.core.clock import ManualClock
from duplex_actors.core.conversation import ContentPart, Item
from duplex_actors.core.engine_io import AudioPacket, FunctionCall, TextDelta
from duplex_actors.core.session import SessionConfig, SessionCore
from duplex_actors.errors import ItemNotFound

from .helpers import respond, user_text

AUDIO = b"\x05\x00" * 3200  # 200 ms


def session() -> SessionCore:
    # As the Realtime server runs sessions: a commit only commits, audio responses.
    config = SessionConfig(respond_on_commit=False, modalities=("audio",))
    core = SessionCore("sess_outofband000", config, ManualClock(0.0))
    core.take_events()
    return core


def pending_turn(core: SessionCore) -> None:
    core.handle(cmd.AppendAudio(pcm=AUDIO))
    core.handle(cmd.CommitInput())
    core.handle(cmd.CreateItem(item=user_text("what is the weather")))
    core.take_events()


def test_an_out_of_band_response_reads_the_pending_turn_and_leaves_it_for_the_next_response():
    core = session()
    pending_turn(core)
    items_before = len(core._conversation)
    request, events = respond(
        core,
        cmd.CreateResponse(out_of_band=True, metadata={"purpose": "classify"}),
        lambda rid: TextDelta(rid, "weather question"),
    )
    assert request.audio == AUDIO and request.input_text == "what is the weather"
    types = [e.type for e in events]
    assert "conversation.item.added" not in types and "conversation.item.done" not in types
    created, done = events[0], events[-1]
    assert created.out_of_band and done.out_of_band and done.status == "completed"
    assert done.output and done.output[0].id not in core._conversation
    assert len(core._conversation) == items_before
    # The user's turn is still there for the default conversation's response.
    request, events = respond(core, cmd.CreateResponse())
    assert request.audio == AUDIO and request.input_text == "what is the weather"
    assert "conversation.item.added" in [e.type for e in events] and not events[0].out_of_band


def test_a_response_with_its_own_input_reads_exactly_those_items_in_order():
    core = session()
    core.handle(cmd.CreateItem(item=user_text("remember the number seven", "it_user")))
    _, events = respond(
        core,
        cmd.CreateResponse(),
        lambda rid: TextDelta(rid, "seven it is"),
        lambda rid: AudioPacket(rid, b"\x01\x00" * 2400, 24000),
    )
    spoken = events[-1].output[0].id
    pending_turn(core)
    own = (user_text("summarise:"), "it_user", spoken)
    request, events = respond(core, cmd.CreateResponse(out_of_band=True, input=own))
    assert request.input_text == "summarise: remember the number seven seven it is"
    assert request.audio == b""  # its own context: not the pending turn's audio
    request, _ = respond(core, cmd.CreateResponse())
    assert request.audio == AUDIO and request.input_text == "what is the weather"


def test_an_unknown_item_reference_is_refused_naming_it_and_changes_nothing():
    core = session()
    pending_turn(core)
    with pytest.raises(ItemNotFound) as refused:
        core.handle(cmd.CreateResponse(out_of_band=True, input=(user_text("x"), "it_nope")))
    assert refused.value.param == "response.input[1].id"
    assert core.state == "idle" and core.take_actions() == [] and core.take_events() == []


def test_an_in_band_response_with_its_own_input_is_written_to_the_conversation():
    core = session()
    pending_turn(core)
    request, events = respond(core, cmd.CreateResponse(input=(user_text("just say hi"),)))
    assert request.input_text == "just say hi"
    assert events[-1].output[0].id in core._conversation and not events[-1].out_of_band
    request, _ = respond(core, cmd.CreateResponse())
    assert request.audio == AUDIO  # the pending turn was not its context, so it is still there


def test_an_out_of_band_call_stays_out_of_the_conversation_and_its_output_is_still_accepted():
    core = session()
    _, events = respond(
        core,
        cmd.CreateResponse(out_of_band=True),
        lambda rid: FunctionCall(rid, call_id="c1", name="lookup", arguments="{}"),
    )
    assert "conversation.item.added" not in [e.type for e in events]
    assert all(item.call_id != "c1" for item in core._conversation._items.values())
    output = Item(id="", type="function_call_output", call_id="c1", output="found")
    core.handle(cmd.CreateItem(item=output))
    request, _ = respond(core, cmd.CreateResponse())
    assert [r.call_id for r in request.function_results] == ["c1"]


def test_references_to_a_long_item_give_the_engine_the_conversations_bound_not_a_copy_each():
    # 64 references cost the client a few bytes each; joined, they made one response's
    # context 64 times its item (a 3 KB frame: 64 MiB, which the engine then split into words).
    core = session()
    part = "\U0001f600 " * 32_000  # 64,000 characters, four bytes each in memory
    long_item = Item(
        id="it_long", role="user", content=tuple(ContentPart(type="input_text", text=part) for _ in range(4))
    )
    core.handle(cmd.CreateItem(item=long_item))
    core.handle(cmd.CreateItem(item=user_text("and the last word", "it_last")))
    core.take_events()
    budget = core.config.max_conversation_chars
    request, events = respond(
        core, cmd.CreateResponse(out_of_band=True, input=("it_long",) * 63 + ("it_last",))
    )
    assert events[-1].status == "completed"
    # The newest entries that fit: the short item and one copy of the long one.
    assert request.input_text == " ".join([part] * 4 + ["and the last word"])
    assert len(request.input_text) <= budget
    # Whole entries, the oldest left out first: the short item fits beside one copy, not two.
    request, _ = respond(core, cmd.CreateResponse(out_of_band=True, input=("it_last", "it_long", "it_long")))
    assert request.input_text == " ".join([part] * 4)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=12),
    budget=st.integers(min_value=1, max_value=120),
)
def test_a_responses_own_context_is_the_newest_entries_within_the_conversations_bound(lengths, budget):
    config = SessionConfig(respond_on_commit=False, modalities=("audio",), max_conversation_chars=budget)
    core = SessionCore("sess_outofband001", config, ManualClock(0.0))
    entries = tuple(user_text("x" * n) if n else Item(id="", role="user", content=()) for n in lengths)
    request, _ = respond(core, cmd.CreateResponse(out_of_band=True, input=entries))
    texts = ["x" * n for n in lengths if n]
    # The longest run of the newest texts whose join fits; the newest alone when none does.
    kept = texts[-1:]
    while len(kept) < len(texts) and len(" ".join(texts[-len(kept) - 1 :])) <= budget:
        kept = texts[-len(kept) - 1 :]
    assert request.input_text == " ".join(kept)
    assert len(request.input_text) <= budget or len(kept) == 1
