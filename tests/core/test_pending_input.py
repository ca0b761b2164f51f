"""What the next response reads of the items a client writes: the words and function outputs
created since the last response, minus the items deleted since, and minus whatever a
client-written assistant item (a message or a function call) comes after: the model answered
those already.

Found with livekit, unmodified: a deleted function output still reached the next response, and
after a reconnect (livekit replays its whole history into the new session every 20 minutes by
default) the next response read the whole history as new input, answered outputs included.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_actors.core import commands as cmd
from duplex_actors.core.clock import ManualClock
from duplex_actors.core.conversation import ContentPart, Item
from duplex_actors.core.session import SessionCore, SubmitTurn
from duplex_actors.core.session_config import SessionConfig


def _core() -> SessionCore:
    return SessionCore("sess_pending_input", SessionConfig(), ManualClock(0.0))


def _user(item_id: str, text: str) -> Item:
    return Item(id=item_id, role="user", content=(ContentPart(type="input_text", text=text),))


def _assistant(item_id: str, text: str) -> Item:
    return Item(id=item_id, role="assistant", content=(ContentPart(type="output_text", text=text),))


def _call(item_id: str, call_id: str) -> Item:
    return Item(id=item_id, type="function_call", call_id=call_id, name="f", arguments="{}")


def _output(item_id: str, call_id: str, output: str) -> Item:
    return Item(id=item_id, type="function_call_output", call_id=call_id, output=output)


def _respond(core: SessionCore):
    core.handle(cmd.CreateResponse())
    request = next(a.request for a in core.take_actions() if isinstance(a, SubmitTurn))
    return request.input_text, [(r.call_id, r.output) for r in request.function_results]


def test_a_deleted_item_is_not_read_by_the_next_response():
    core = _core()
    for item in (_user("u1", "keep"), _user("u2", "gone"), _call("fc1", "c1"), _call("fc2", "c2")):
        core.handle(cmd.CreateItem(item=item))
    core.handle(cmd.CreateItem(item=_output("fo1", "c1", "rainy")))
    core.handle(cmd.CreateItem(item=_output("fo2", "c2", "sunny")))
    core.handle(cmd.DeleteItem(item_id="u2"))
    core.handle(cmd.DeleteItem(item_id="fo1"))
    # The calls came after the user's words: those were answered (by the calls).
    assert _respond(core) == ("", [("c2", "sunny")])


def test_deleting_an_output_that_a_later_one_replaced_keeps_the_later_one():
    core = _core()
    core.handle(cmd.CreateItem(item=_call("fc1", "c1")))
    core.handle(cmd.CreateItem(item=_output("fo1", "c1", "first")))
    core.handle(cmd.CreateItem(item=_output("fo2", "c1", "second")))
    core.handle(cmd.DeleteItem(item_id="fo1"))
    assert _respond(core) == ("", [("c1", "second")])


def test_replayed_history_is_not_read_again_only_what_follows_the_last_answer():
    core = _core()
    history = (
        _user("u1", "weather?"),
        _call("fc1", "c1"),
        _output("fo1", "c1", "rainy in Paris"),
        _assistant("a1", "It is rainy."),
        _user("u2", "and tomorrow?"),
    )
    for item in history:
        core.handle(cmd.CreateItem(item=item))
    assert _respond(core) == ("and tomorrow?", [])


def test_an_assistant_item_written_earlier_in_the_conversation_answers_only_what_is_before_it():
    core = _core()
    for item in (_user("u1", "one"), _user("u2", "two")):
        core.handle(cmd.CreateItem(item=item))
    core.handle(cmd.CreateItem(item=_assistant("a1", "reply to one"), previous_item_id="u1"))
    assert _respond(core) == ("two", [])


# --- the rule, as a model, over any sequence of item writes and deletes ----------------------------

_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("user"), st.sampled_from(["a", "b", "c"])),
        st.tuples(st.just("assistant"), st.just("")),
        st.tuples(st.just("call"), st.sampled_from(["c1", "c2", "c3"])),
        st.tuples(st.just("output"), st.sampled_from(["c1", "c2", "c3"])),
        st.tuples(st.just("delete"), st.integers(0, 30)),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_the_next_response_reads_exactly_what_is_pending_by_the_rule(ops):
    core = _core()
    texts: dict[str, str] = {}  # item id -> words, pending
    outputs: dict[str, tuple[str, str]] = {}  # call id -> (item id, output), pending
    held: list[str] = []  # the conversation's item ids
    known_calls: set[str] = set()
    for n, (kind, arg) in enumerate(ops):
        item_id = f"i{n}"
        if kind == "delete":
            if not held:
                continue
            victim = held.pop(arg % len(held))
            core.handle(cmd.DeleteItem(item_id=victim))
            texts.pop(victim, None)
            outputs = {c: v for c, v in outputs.items() if v[0] != victim}
            continue
        if kind == "output" and arg not in known_calls:
            continue  # refused (an unknown call_id): covered by the function call tests
        text = f"{arg}{n}"
        if kind == "user":
            item = _user(item_id, text)
        elif kind == "assistant":
            item = _assistant(item_id, text)
        elif kind == "call":
            item = _call(item_id, arg)
        else:
            item = _output(item_id, arg, text)
        core.handle(cmd.CreateItem(item=item))
        held.append(item_id)
        if kind == "user":
            texts[item_id] = text
        elif kind == "output":
            outputs.pop(arg, None)  # a later output for a call replaces the earlier one
            outputs[arg] = (item_id, text)
        else:  # the model's own words or call: everything before it was answered
            texts.clear()
            outputs.clear()
            if kind == "call":
                known_calls.add(arg)
    expected = (" ".join(texts.values()), [(c, out) for c, (_, out) in outputs.items()])
    assert _respond(core) == expected
