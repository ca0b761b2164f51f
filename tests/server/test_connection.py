"""The server connection's read gate: websockets' read queue and control-frame pacing pause the
same transport, and reading resumes only when neither holds it."""

from __future__ import annotations

import anyio
import pytest
from websockets.frames import Frame, Opcode
from websockets.server import ServerProtocol

from duplex_actors.server.connection import control_paced_connection

pytestmark = pytest.mark.anyio


class _Transport:
    """What the connection asks of its transport, with the reading state kept."""

    def __init__(self) -> None:
        self.reading = True
        self.pauses = 0

    def pause_reading(self) -> None:
        self.pauses += self.reading
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def get_extra_info(self, name, default=None):
        return default


class _Server:
    def __init__(self) -> None:
        self.handler_tasks: set = set()

    async def handler(self, connection) -> None:
        pass


def _connection(rate: float, burst: int, waits: list[float]):
    cls = control_paced_connection(rate, burst, on_paced=waits.append)
    conn = cls(ServerProtocol(), _Server())
    transport = _Transport()
    conn.connection_made(transport)
    conn.request = object()  # past the handshake: later events are frames
    return conn, transport


async def test_reading_resumes_only_when_the_queue_and_the_control_debt_both_let_go():
    waits: list[float] = []
    conn, transport = _connection(rate=100.0, burst=5, waits=waits)
    conn.recv_messages.pause()  # the read queue is full
    for _ in range(5):  # within the burst
        conn.process_event(Frame(Opcode.PING, b""))
    assert waits == []
    # 3 over, 30 ms owed: the first asks for a 10 ms wait, the others add to it as it runs
    for _ in range(3):
        conn.process_event(Frame(Opcode.PONG, b""))
    assert len(waits) == 1 and waits[0] == pytest.approx(0.01, rel=0.5)
    conn.recv_messages.resume()  # the queue drained, but the debt holds reading
    assert not transport.reading
    with anyio.fail_after(1):
        while not transport.reading:
            await anyio.sleep(0.002)
    assert conn.control_paced_s >= 0.029
    assert transport.pauses == 1, "one pause for both reasons"


async def test_the_queue_resumes_reading_when_no_control_debt_is_owed():
    conn, transport = _connection(rate=100.0, burst=5, waits=[])
    conn.process_event(Frame(Opcode.PING, b""))
    conn.recv_messages.pause()
    assert not transport.reading
    conn.recv_messages.resume()
    assert transport.reading


async def test_data_frames_are_not_charged_as_control_frames():
    waits: list[float] = []
    conn, transport = _connection(rate=1.0, burst=1, waits=waits)
    for _ in range(10):
        conn.process_event(Frame(Opcode.TEXT, b"{}"))
    assert transport.reading and waits == []


async def test_a_lost_connection_cancels_its_pending_resume():
    conn, transport = _connection(rate=1.0, burst=1, waits=[])
    conn.process_event(Frame(Opcode.PING, b""))
    conn.process_event(Frame(Opcode.PING, b""))
    assert conn._control_wait is not None
    conn.connection_lost(None)
    assert conn._control_wait is None
