"""The pieces split out of core/session.py: response assembly, calls, playback, the old names."""

import duplex_actors.core.session as session
from duplex_actors.core import actions, session_config
from duplex_actors.core.function_calls import RECENT_CALLS, FunctionCallRegistry
from duplex_actors.core.playback import RECENT_RESPONSES, PlaybackLedger
from duplex_actors.core.response import ResponseAssembly


def test_moved_names_are_still_importable_from_core_session_and_are_the_same_objects():
    moved = {
        "SessionConfig": session_config,
        "SessionCounters": session_config,
        "SubmitTurn": actions,
        "TranscribeInput": actions,
        "InputTranscript": actions,
        "AbortRequests": actions,
        "EngineAction": actions,
    }
    for name, home in moved.items():
        assert getattr(session, name) is getattr(home, name), name
        assert name in session.__all__
    assert "SessionCore" in session.__all__


def _assembly(modalities=("text", "audio")):
    return ResponseAssembly("resp_1", "item_1", 0, 0, modalities, None)


def test_a_text_and_audio_response_is_an_audio_part_with_its_text_as_transcript_words():
    r = _assembly()
    r.text.append("hi")
    r.transcript.append("hello")
    r.audio_ms = 120.6
    part = r.item("completed").content[0]
    assert (r.spoken, r.part_type) == (False, "audio")
    assert (part.type, part.transcript, part.audio_ms) == ("output_audio", "hi", 120)


def test_a_spoken_response_uses_its_transcript_and_a_text_response_its_text():
    spoken = _assembly(("audio",))
    spoken.transcript.append("said")
    assert spoken.spoken and spoken.item("completed").content[0].transcript == "said"
    text = _assembly(("text",))
    text.text.append("written")
    part = text.item("incomplete").content[0]
    assert (part.type, part.text) == ("output_text", "written")


def test_heard_ms_from_a_truncation_wins_and_the_streaming_item_rounds_audio_up():
    r = _assembly()
    r.audio_ms = 99.2
    assert r.streaming_item().content[0].audio_ms == 100
    assert r.streaming_item().status == "in_progress"
    r.heard_ms = 40
    assert r.item("completed").content[0].audio_ms == 40


def test_output_items_keep_the_order_they_were_added_in():
    r = _assembly()
    message = r.item("completed")
    r.open_message()
    assert r.output_items(message) == (message,)
    first = r.add_call("item_2", "call_a", "f", "{}")
    second = r.add_call("item_3", "call_b", "g", "")
    assert (first.output_index, second.output_index) == (1, 2)
    assert [i.id for i in r.output_items(message)] == ["item_1", "item_2", "item_3"]


def test_a_call_only_response_has_no_message_and_a_message_after_a_call_follows_it():
    r = _assembly()
    call = r.add_call("item_2", "call_a", "f", "{}")
    assert call.output_index == 0
    assert [i.id for i in r.output_items(None)] == ["item_2"]  # never opened: calls only
    r.open_message()
    assert r.message_index == 1
    assert [i.id for i in r.output_items(r.item("completed"))] == ["item_2", "item_1"]


def test_the_registry_answers_only_known_calls_keeps_the_recent_ones_and_hands_results_once():
    calls = FunctionCallRegistry()
    calls.remember("call_0", "lookup")
    assert "call_0" in calls and "call_x" not in calls
    calls.answer("call_0", "42")
    calls.answer("call_x", "?")  # the core refuses unknown ids first; the name is just unknown
    results = calls.take_results()
    assert [(r.call_id, r.output, r.name) for r in results] == [
        ("call_0", "42", "lookup"),
        ("call_x", "?", None),
    ]
    assert calls.take_results() == ()
    for i in range(1, RECENT_CALLS + 1):
        calls.remember(f"call_{i}", "f")
    assert "call_0" not in calls and f"call_{RECENT_CALLS}" in calls


def test_the_playback_ledger_bounds_acknowledgements_and_keeps_truncations_by_item():
    ledger = PlaybackLedger()
    assert ledger.played_ms("resp_a") == 0 and len(ledger) == 0
    ledger.acknowledge("resp_a", 120)
    ledger.truncated("item_a", 15)
    assert ledger.played_ms("resp_a") == 120
    assert ledger.snapshot() == {"resp_a": 120, "item_a": 15}
    for i in range(RECENT_RESPONSES):
        ledger.acknowledge(f"resp_{i}", i)
    assert len(ledger) == RECENT_RESPONSES and ledger.played_ms("resp_a") == 0
