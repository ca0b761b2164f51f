"""Shared helpers for the reliability suite: a reader that keeps every event, the invariants
every session's event stream must satisfy, and the leak check every test ends with."""

from __future__ import annotations

import anyio
import pytest

from duplex_actors import Runtime

CHUNK = b"\x01\x00" * 320  # 20 ms of 16 kHz pcm16
SECOND = b"\x01\x00" * 16000


@pytest.fixture
def anyio_backend():
    return "asyncio"


class Reader:
    """One long-lived consumer of a session's events; keeps all of them for the audit."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.events: list = []
        self._it = handle.events().__aiter__()
        self.ended = False

    async def next(self, timeout: float = 5.0):
        with anyio.fail_after(timeout):
            try:
                event = await self._it.__anext__()
            except StopAsyncIteration:
                self.ended = True
                raise
        self.events.append(event)
        return event

    async def until(self, predicate, timeout: float = 5.0):
        with anyio.fail_after(timeout):
            while True:
                event = await self.next(timeout)
                if predicate(event):
                    return event

    async def until_type(self, type_: str, timeout: float = 5.0):
        return await self.until(lambda e: e.type == type_, timeout)

    async def drain(self, timeout: float = 5.0) -> list:
        """Read to the end of the stream (session.closed)."""
        with anyio.fail_after(timeout):
            while not self.ended:
                try:
                    await self.next(timeout)
                except StopAsyncIteration:
                    break
        return self.events

    def of_type(self, type_: str) -> list:
        return [e for e in self.events if e.type == type_]


async def turn(handle, reader: Reader, audio: bytes = CHUNK * 5, timeout: float = 5.0):
    """One user turn: append, commit, read to its response.done; returns the response.done."""
    handle.append_audio(audio)
    await handle.commit()
    return await reader.until_type("response.done", timeout)


def audit(events: list, *, closed: bool = True, first_seq: int = 1) -> None:
    """The invariants of one session's complete event stream."""
    seqs = [e.seq for e in events]
    assert seqs == list(range(first_seq, first_seq + len(seqs))), f"seq gap or reorder: {seqs}"
    created = [e.response_id for e in events if e.type == "response.created"]
    done = [e.response_id for e in events if e.type == "response.done"]
    assert len(created) == len(set(created)), "response.created twice for one response"
    assert sorted(created) == sorted(done), f"created {created} but done {done}"
    closes = [e for e in events if e.type == "session.closed"]
    if closed:
        assert len(closes) == 1, f"{len(closes)} session.closed events"
        assert events[-1].type == "session.closed", "session.closed is not the last event"
    else:
        assert not closes


async def settle(rt: Runtime, timeout: float = 5.0, backend=None) -> None:
    """Wait until nothing is left in flight anywhere, then assert no leak."""
    backend = backend if backend is not None else rt.backend
    with anyio.move_on_after(timeout):
        while True:
            st = rt.engine.statistics()
            active = getattr(backend, "active", set())
            if (
                st.in_flight == 0
                and st.routes == 0
                and st.pending_abort_retries == 0
                and not active
                and not rt.statistics().ready
            ):
                break
            await anyio.sleep(0.01)
    st = rt.engine.statistics()
    assert st.in_flight == 0, f"engine requests leaked: {st}"
    assert st.routes == 0, f"routes leaked: {st}"
    assert st.pending_abort_retries == 0, f"aborts never succeeded: {st}"
    assert not getattr(backend, "active", set()), f"backend still holds {backend.active}"
