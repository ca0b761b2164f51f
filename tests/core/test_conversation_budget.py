"""The conversation keeps within its item and character bounds, oldest items forgotten first."""

from __future__ import annotations

import attrs
from hypothesis import given
from hypothesis import strategies as st

from duplex_actors.core import commands as cmd
from duplex_actors.core.clock import ManualClock
from duplex_actors.core.conversation import ContentPart, Conversation, Item
from duplex_actors.core.function_calls import RECENT_CALLS, FunctionCallRegistry
from duplex_actors.core.session import SessionCore, SubmitTurn
from duplex_actors.core.session_config import SessionConfig


def text_item(n: int, chars: int) -> Item:
    return Item(id=f"item_{n}", role="user", content=(ContentPart(type="input_text", text="x" * chars),))


def test_the_oldest_items_go_until_the_text_fits_and_the_newest_always_stays():
    conversation = Conversation(capacity=100, max_chars=1000)
    for n in range(5):
        conversation.add(text_item(n, 300))
    assert [i.id for i in conversation] == ["item_2", "item_3", "item_4"]
    assert conversation.chars == 900 and conversation.forgotten == 2
    # One item over the budget alone was accepted, so it stays, alone.
    conversation.add(text_item(5, 5000))
    assert [i.id for i in conversation] == ["item_5"] and conversation.chars == 5000
    # An item inserted first ("root") is kept too: the oldest after it goes instead.
    conversation.add(text_item(6, 10))
    conversation.add(text_item(7, 10), "root")
    assert [i.id for i in conversation] == ["item_7", "item_6"] and conversation.chars == 20


def test_count_bound_never_forgets_an_item_just_added_at_the_root():
    conversation = Conversation(capacity=2)
    conversation.add(text_item(0, 1))
    conversation.add(text_item(1, 1))
    conversation.add(text_item(2, 1), "root")
    assert [i.id for i in conversation] == ["item_2", "item_1"]


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 400), st.integers(-1, 12)),
        st.tuples(st.just("delete"), st.integers(0, 12), st.just(0)),
        st.tuples(st.just("replace"), st.integers(0, 12), st.integers(0, 400)),
        st.tuples(st.just("clear"), st.just(0), st.just(0)),
    ),
    max_size=60,
)


@given(_OPS, st.integers(1, 8), st.one_of(st.none(), st.integers(1, 1000)))
def test_any_edits_keep_the_bounds_and_an_exact_character_count(ops, capacity, max_chars):
    conversation = Conversation(capacity, max_chars)
    made = 0
    for op, a, b in ops:
        ids = [i.id for i in conversation]
        if op == "add":
            previous = None if b < 0 or not ids else ("root" if b == 0 else ids[min(b, len(ids)) - 1])
            conversation.add(text_item(made, a), previous)
            newest = f"item_{made}"
            made += 1
            assert newest in conversation  # never the item just added
        elif op == "delete" and ids:
            conversation.delete(ids[a % len(ids)])
        elif op == "replace" and ids:
            target = ids[a % len(ids)]
            conversation.replace(
                attrs.evolve(
                    conversation.get(target), content=(ContentPart(type="input_text", text="y" * b),)
                )
            )
            assert target in conversation
        elif op == "clear":
            conversation.clear()
        held = list(conversation)
        assert conversation.chars == sum(i.chars for i in held)
        assert len(held) <= capacity
        assert max_chars is None or conversation.chars <= max_chars or len(held) == 1


def test_a_session_keeps_its_conversation_within_the_configured_characters():
    core = SessionCore("sess_budget", SessionConfig(max_conversation_chars=200_000), ManualClock(0.0))
    for _ in range(10):
        core.handle(
            cmd.CreateItem(
                item=Item(id="", role="user", content=(ContentPart(type="input_text", text="w" * 65_536),))
            )
        )
    conversation = core._conversation
    assert conversation.chars <= 200_000 and len(conversation) == 3 and conversation.forgotten == 7


def test_words_waiting_for_a_response_stay_within_the_budget_and_the_newest_are_read():
    config = SessionConfig(max_conversation_chars=200_000, respond_on_commit=True)
    core = SessionCore("sess_pending", config, ManualClock(0.0))
    for n in range(50):
        text = f"{n:02d}" + "w" * 65_534
        core.handle(
            cmd.CreateItem(
                item=Item(id="", role="user", content=(ContentPart(type="input_text", text=text),))
            )
        )
    # Before: all 50 texts (3.3 M characters) waited for a response that never came.
    assert core._pending_chars == sum(len(" ".join(t)) for t in core._pending_text.values()) <= 200_000
    core.handle(cmd.CreateResponse())
    request = next(a.request for a in core.take_actions() if isinstance(a, SubmitTurn))
    assert request.input_text.startswith("47") and request.input_text.count("w" * 65_534) == 3
    assert core._pending_text == {} and core._pending_chars == 0


def test_an_item_of_several_parts_waits_for_its_response_without_a_copy_of_its_words():
    # Its words were joined into one string for the next response: an item of three parts of
    # 65,000 emoji kept a second 780 KB of them, which the text budget did not count.
    import tracemalloc

    core = SessionCore("sess_parts", SessionConfig(), ManualClock(0.0))
    parts = tuple(ContentPart(type="input_text", text=chr(0x1F600 + n) * 65_000) for n in range(3))
    item = Item(id="", role="user", content=parts)
    words = 3 * 65_000 * 4
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        core.handle(cmd.CreateItem(item=item))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < words // 4, f"{held} bytes held for {words} bytes of words"
    # The response still reads every part, in order, one space apart.
    core.handle(cmd.CreateResponse())
    request = next(a.request for a in core.take_actions() if isinstance(a, SubmitTurn))
    assert request.input_text == " ".join(p.text for p in parts)


def test_function_outputs_waiting_for_a_turn_are_one_per_call_and_bounded():
    registry = FunctionCallRegistry()
    for n in range(RECENT_CALLS * 3):
        registry.remember(f"call_{n}", "f")
    for _ in range(1000):  # the same call answered over and over
        registry.answer(f"call_{RECENT_CALLS * 3 - 1}", "again")
    assert len(registry.take_results()) == 1
    for n in range(RECENT_CALLS * 3):
        registry.answer(f"call_{n}", str(n))
    results = registry.take_results()
    assert len(results) == RECENT_CALLS and results[-1].output == str(RECENT_CALLS * 3 - 1)


def test_function_outputs_waiting_for_a_turn_keep_the_conversations_character_budget():
    """64 outputs at the item limit (65,536 characters) waited for a turn: 4.2 M characters a
    session, 16.8 MB as emoji. They now keep the conversation's character budget together,
    oldest dropped first, never the newest."""
    registry = FunctionCallRegistry(max_chars=200_000)
    for n in range(RECENT_CALLS):
        registry.remember(f"call_{n}", "f")
        registry.answer(f"call_{n}", f"{n:02d}" + "o" * 99_998)
    results = registry.take_results()
    assert [r.call_id for r in results] == ["call_62", "call_63"]
    assert sum(len(r.output) for r in results) <= 200_000
    registry.answer("call_1", "x" * 500_000)  # one output past the budget alone is kept whole
    (only,) = registry.take_results()
    assert only.output == "x" * 500_000


def test_a_session_bounds_the_function_outputs_a_client_replays_and_answers():
    core = SessionCore("sess_budget_calls", SessionConfig(max_conversation_chars=100_000), ManualClock(0.0))
    # The calls first (one response's parallel calls), then their outputs: a call replayed
    # after an output would say the model had already read it.
    for n in range(RECENT_CALLS):
        call = Item(id=f"fc_{n}", type="function_call", call_id=f"c{n}", name="f", arguments="{}")
        core.handle(cmd.CreateItem(item=call))
    for n in range(RECENT_CALLS):
        output = Item(id=f"fo_{n}", type="function_call_output", call_id=f"c{n}", output="o" * 40_000)
        core.handle(cmd.CreateItem(item=output))
    core.handle(cmd.CreateResponse())
    request = next(a.request for a in core.take_actions() if isinstance(a, SubmitTurn))
    assert [r.call_id for r in request.function_results] == ["c62", "c63"]
