"""OpeningSlots: at most ``limit`` connections opening at once, the rest first come first
served; a closed connection in the queue passes its turn on (server/opening_slots.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from duplex_actors.server.opening_slots import OpeningSlots


def test_the_limit_holds_and_the_queue_is_first_come_first_served():
    slots = OpeningSlots(2)
    woken: list[str] = []

    def waiter(name: str, alive: bool = True):
        return lambda: woken.append(name) or alive

    assert slots.enter(waiter("a")) and slots.enter(waiter("b"))
    assert not slots.enter(waiter("c"))
    assert not slots.enter(waiter("gone", alive=False))
    assert not slots.enter(waiter("d"))
    assert slots.active == 2 and slots.waiting == 3
    slots.leave()  # a is open: c takes its slot
    assert woken == ["c"] and slots.active == 2
    slots.leave()  # the closed one passes its turn on to d
    assert woken == ["c", "gone", "d"] and slots.active == 2 and slots.waiting == 0
    slots.leave()
    slots.leave()
    assert slots.active == 0


def test_a_limit_below_one_is_refused():
    with pytest.raises(ValueError):
        OpeningSlots(0)


@given(
    st.integers(1, 4), st.lists(st.tuples(st.sampled_from(["enter", "leave"]), st.booleans()), max_size=60)
)
def test_never_more_than_the_limit_open_and_no_slot_lost(limit, steps):
    """Whatever the order of arrivals, openings and closes in the queue: active never exceeds
    the limit, and a slot is free whenever nobody alive waits."""
    slots = OpeningSlots(limit)
    holding = 0  # connections that hold a slot and have not left yet
    alive_waiting: list[list[bool]] = []

    for action, alive in steps:
        if action == "enter":
            cell = [alive, False]  # alive, woken

            def wake(cell=cell):
                cell[1] = True
                return cell[0]

            if slots.enter(wake):
                holding += 1
            else:
                alive_waiting.append(cell)
        elif holding:
            slots.leave()
            holding -= 1
            for cell in alive_waiting:
                if cell[1] and cell[0]:
                    holding += 1
            alive_waiting = [c for c in alive_waiting if not c[1]]
        assert slots.active == holding <= limit
        if any(c[0] for c in alive_waiting):
            assert slots.active == limit  # nobody alive waits while a slot is free


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_over_real_sockets_handshakes_queue_for_the_slot_and_all_get_in(anyio_backend, monkeypatch):
    """With one slot, 24 clients connecting at once: every handshake completes, one at a time
    (some waited unread for the slot); and a client that connected and sent nothing holds no
    slot (a slow client must not hold every handshake for the handshake timeout)."""
    import asyncio
    import json
    from urllib.parse import urlsplit

    from websockets.asyncio.client import connect

    from .conftest import running_server

    seen = {"most_active": 0, "queued": 0}
    enter = OpeningSlots.enter

    def counting_enter(self, wake):
        took = enter(self, wake)
        seen["most_active"] = max(seen["most_active"], self.active)
        seen["queued"] += not took
        return took

    monkeypatch.setattr(OpeningSlots, "enter", counting_enter)
    async with running_server(max_opening_connections=1) as server:
        where = urlsplit(server.url)
        _, silent = await asyncio.open_connection(where.hostname, where.port)
        try:
            await asyncio.sleep(0.2)

            async def one() -> str:
                async with connect(server.url, open_timeout=20) as ws:
                    return json.loads(await ws.recv())["type"]

            kinds = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(24))), 30)
        finally:
            silent.close()
    assert kinds == ["session.created"] * 24
    assert seen["most_active"] == 1 and seen["queued"] > 0, seen
