"""OpeningSlots: at most ``limit`` connections opening at once, the rest queued with clients
taking turns (each client's own in the order they came); a closed connection in the queue
passes its turn on (server/opening_slots.py)."""

from __future__ import annotations

import pytest
from hypothesis import example, given
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

    def counting_enter(self, wake, client=None):
        took = enter(self, wake, client)
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


def test_a_client_arriving_behind_a_storm_goes_before_the_storm_s_queue():
    """One client's 5 queued connections, then a newcomer: the newcomer gets the next slot,
    not the sixth (first come, first served it waited for the whole storm)."""
    slots = OpeningSlots(1)
    woken: list[str] = []

    def waiter(name: str):
        return lambda: woken.append(name) or True

    assert slots.enter(waiter("storm0"), "10.0.0.1")
    for i in range(1, 6):
        assert not slots.enter(waiter(f"storm{i}"), "10.0.0.1")
    assert not slots.enter(waiter("newcomer"), "10.0.0.2")
    for _ in range(6):
        slots.leave()
    assert woken == ["newcomer", "storm1", "storm2", "storm3", "storm4", "storm5"]


def test_two_clients_queued_take_turns_each_in_its_own_order():
    slots = OpeningSlots(1)
    woken: list[str] = []
    assert slots.enter(lambda: True, "a")
    for name in ("a1", "a2", "a3", "b1", "b2", "b3"):
        assert not slots.enter(lambda name=name: woken.append(name) or True, name[0])
    for _ in range(6):
        slots.leave()
    # b never served goes first, then they alternate; each client's in the order it came.
    assert woken == ["b1", "a1", "b2", "a2", "b3", "a3"]


@given(
    st.integers(1, 3),
    st.lists(
        st.tuples(st.sampled_from(["enter", "leave"]), st.sampled_from("abc"), st.booleans()), max_size=80
    ),
)
@example(  # a client's two queued before another's: first come, first served fails this
    1,
    [("enter", "c", True), ("enter", "a", True), ("enter", "a", True), ("enter", "b", True)]
    + [("leave", "a", True)] * 3,
)
@example(  # two clients with two queued each alternate: each gets one between the other's two
    1,
    [("enter", "a", False), ("enter", "a", True), ("enter", "a", True), ("enter", "b", True)]
    + [("enter", "b", True)]
    + [("leave", "a", False)] * 4,
)
def test_while_a_client_waits_no_other_client_gets_two_slots(limit, steps):
    """The fair share's promise at the slots: from the moment a client's connection queues
    until it gets a slot, every other client is handed at most one more than this client is
    (its other queued connections take their turns meanwhile: with none, every other client
    gets at most one). A connection that closes while queued withdraws (as a closing connection
    does), so it uses nobody's turn."""
    slots = OpeningSlots(limit)
    holding = 0
    handed: list[str] = []  # clients, in the order their queued connections got a slot
    waiting: list[list] = []  # [client, handed_at or None, queued_at]

    for action, client, stays in steps:
        if action == "enter":
            cell = [client, None, len(handed)]

            def wake(cell=cell):
                cell[1] = len(handed)
                handed.append(cell[0])
                return True

            if slots.enter(wake, client):
                holding += 1
            elif stays:
                waiting.append(cell)
            else:
                slots.withdraw(wake)  # closed while queued
        elif holding:
            slots.leave()
            holding -= 1
            for cell in [c for c in waiting if c[1] is not None]:
                holding += 1
                others = handed[cell[2] : cell[1]]
                own = others.count(cell[0])
                assert all(others.count(o) <= own + 1 for o in set(others) if o != cell[0]), (cell, handed)
            waiting = [c for c in waiting if c[1] is None]
        assert slots.active == holding <= limit
        assert slots.waiting == len(waiting)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("proxied", [False, True], ids=["direct", "behind_a_trusted_proxy"])
async def test_over_real_sockets_a_newcomer_is_not_queued_behind_another_clients_storm(
    anyio_backend, monkeypatch, proxied
):
    """One slot; 60 connections from 127.0.0.2 at once, and while 20 or more of them wait, one
    from 127.0.0.3: the newcomer gets a slot ahead of most of the storm's queue (first come,
    first served, it got the last). Behind a trusted proxy (all from 127.0.0.1), the same by
    the clients the proxy forwards in X-Forwarded-For."""
    import asyncio
    import json

    from websockets.asyncio.client import connect

    from .conftest import running_server

    made: list[OpeningSlots] = []
    handed: list[object] = []  # the client of each queued connection given a slot, in order
    init, enter = OpeningSlots.__init__, OpeningSlots.enter

    def recording_init(self, limit):
        init(self, limit)
        made.append(self)

    def recording_enter(self, wake, client=None):
        def woken() -> bool:
            took = wake()
            if took:
                handed.append(client)
            return took

        return enter(self, woken, client)

    monkeypatch.setattr(OpeningSlots, "__init__", recording_init)
    monkeypatch.setattr(OpeningSlots, "enter", recording_enter)
    proxy = {"trusted_proxies": ("127.0.0.1/32",)} if proxied else {}
    storm_client, newcomer_client = ("203.0.113.2", "203.0.113.3") if proxied else ("127.0.0.2", "127.0.0.3")
    async with running_server(max_opening_connections=1, **proxy) as server:
        (slots,) = made

        async def one(client: str) -> str:
            if proxied:  # the test is the proxy, on 127.0.0.1, forwarding for ``client``
                options: dict = {"additional_headers": {"X-Forwarded-For": client}}
            else:
                options = {"local_addr": (client, 0)}
            async with connect(server.url, open_timeout=30, **options) as ws:
                return json.loads(await ws.recv())["type"]

        storm = [asyncio.create_task(one(storm_client)) for _ in range(60)]
        async with asyncio.timeout(20):
            while slots.waiting < 20:
                await asyncio.sleep(0.001)
        newcomer = asyncio.create_task(one(newcomer_client))
        kinds = await asyncio.wait_for(asyncio.gather(*storm, newcomer), 60)
    assert kinds == ["session.created"] * 61
    assert newcomer_client in handed, "the newcomer never queued: the storm's queue had drained"
    after = len(handed) - 1 - handed.index(newcomer_client)
    assert after >= 10, (after, handed)


def test_a_queued_connection_that_closes_withdraws_and_is_never_woken():
    slots = OpeningSlots(1)
    woken: list[str] = []

    def waiter(name: str):
        return lambda: woken.append(name) or True

    assert slots.enter(waiter("open"), "a")
    gone, after = waiter("gone"), waiter("after")
    assert not slots.enter(gone, "b") and not slots.enter(after, "b")
    slots.withdraw(gone)
    slots.withdraw(gone)  # twice, or once it is no longer queued: nothing
    assert slots.waiting == 1
    slots.leave()
    assert woken == ["after"] and slots.active == 1
    slots.leave()
    assert slots.active == 0 and slots.waiting == 0
