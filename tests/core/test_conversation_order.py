"""Conversation.previous_of names the item just before another, wherever it sits."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from duplex_actors.core.conversation import ContentPart, Conversation, Item


def item(n: int) -> Item:
    return Item(id=f"item_{n}", role="user", content=(ContentPart(type="input_text", text=str(n)),))


@given(st.lists(st.integers(min_value=-1, max_value=40), min_size=1, max_size=40), st.integers(2, 50))
def test_previous_of_is_the_item_before_in_order(positions, capacity):
    conversation = Conversation(capacity)
    for n, at in enumerate(positions):
        ids = [i.id for i in conversation]
        previous = None if at < 0 or not ids else ("root" if at == 0 else ids[min(at, len(ids)) - 1])
        conversation.add(item(n), previous)
    ids = [i.id for i in conversation]
    for index, item_id in enumerate(ids):
        assert conversation.previous_of(item_id) == (ids[index - 1] if index else None)
    assert conversation.previous_of("item_missing") is None
