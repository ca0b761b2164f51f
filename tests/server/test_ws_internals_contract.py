"""The contract server/ws_internals.py relies on below websockets' documented API, checked on
the installed websockets: an upgrade that moves any of it fails here, by name, instead of
silently keeping closed connections' memory alive or sending events one write each."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect

import pytest

websockets = pytest.importorskip("websockets")

from websockets.asyncio.server import ServerConnection, serve  # noqa: E402
from websockets.frames import Frame, Opcode  # noqa: E402
from websockets.protocol import Protocol  # noqa: E402

from duplex_actors.server import ws_internals  # noqa: E402


def test_the_sans_io_protocol_has_what_send_burst_and_the_traceback_release_use():
    for name in ("send_text", "data_to_send", "parse"):
        assert callable(getattr(Protocol, name, None)), name
    # The parser's ending exception is kept on the protocol under this name (set in parse).
    assert "parser_exc" in inspect.getsource(Protocol.parse)
    # The parser is the generator kept as ``parser`` and only ever advanced with next(): the
    # idle one put in its place at close keeps receive_data and receive_eof harmless.
    assert "next(self.parser)" in inspect.getsource(Protocol.receive_data)
    assert "next(self.parser)" in inspect.getsource(Protocol.receive_eof)


def test_a_live_server_connection_has_the_attributes_the_server_reaches():
    async def main():
        seen: dict[str, object] = {}

        async def handler(ws: ServerConnection) -> None:
            seen["send_context"] = callable(getattr(ws, "send_context", None))
            queue = ws.recv_messages
            seen["pause"] = callable(queue.pause) and callable(queue.resume)
            # Nothing read yet: a message parsed now would be the next one recv() returns.
            seen["next_to_read"] = ws_internals.next_to_read(ws) and len(queue.frames) == 0
            seen["transport"] = ws.transport is not None
            seen["protocol"] = isinstance(ws.protocol, Protocol)
            seen["select_subprotocol"] = "select_subprotocol" in vars(ws.protocol)
            seen["parser"] = inspect.isgenerator(ws.protocol.parser)
            # asyncio's selector transport keeps its read callback on itself (a bound method).
            callback = vars(ws.transport).get("_read_ready_cb")
            seen["_read_ready_cb"] = getattr(callback, "__self__", None) is ws.transport
            # The burst write works end to end: two frames out in one write.
            await ws_internals.send_burst(ws, [b'{"a":1}', b'{"b":2}'])
            await ws.wait_closed()

        async with serve(handler, "127.0.0.1", 0, select_subprotocol=lambda conn, offered: None) as server:
            port = server.sockets[0].getsockname()[1]
            async with websockets.connect(f"ws://127.0.0.1:{port}") as client:
                got = [await client.recv(), await client.recv()]
        return seen, got

    seen, got = asyncio.run(asyncio.wait_for(main(), 10))
    assert seen == {name: True for name in seen} and len(seen) == 8, seen
    assert got == ['{"a":1}', '{"b":2}']


def test_a_frames_payload_can_be_let_go_and_the_read_queue_added_up():
    # Frame is a plain (mutable) dataclass whose payload is ``data``: forget_payload sets it.
    assert dataclasses.is_dataclass(Frame) and not Frame.__dataclass_params__.frozen
    frame = Frame(Opcode.TEXT, b"x" * 10)
    ws_internals.forget_payload(frame)
    assert frame.data == b""
    # The parser keeps the last frame it parsed as a local named ``frame`` (the reason for
    # forget_payload: tests/server/test_connection.py checks it through a real parse).
    assert "frame = yield from Frame.parse(" in inspect.getsource(Protocol.parse)

    async def main():
        seen: dict[str, object] = {}

        async def handler(ws: ServerConnection) -> None:
            await ws.recv()  # the first message, then two more queued behind it
            while len(ws.recv_messages.frames) < 2:
                await asyncio.sleep(0.01)
            seen["queued_bytes"] = ws_internals.queued_bytes(ws)
            seen["whole"] = ws_internals.whole_message_queued(ws)
            await ws.wait_closed()

        async with serve(handler, "127.0.0.1", 0, compression=None) as server:
            port = server.sockets[0].getsockname()[1]
            async with websockets.connect(f"ws://127.0.0.1:{port}", compression=None) as client:
                for text in ("a", "bb", "ccc"):
                    await client.send(text)
                while not seen:
                    await asyncio.sleep(0.01)
        return seen

    assert asyncio.run(asyncio.wait_for(main(), 10)) == {"queued_bytes": 5, "whole": True}
