"""EngineProcessClient + EngineHostServer over a real Unix socket: one backend, many runtimes.

The host runs in the test's own loop here (the subprocess case is in
tests/server/test_workers.py), so the hosted ScriptedEngine's ``active`` and ``aborted`` can be
read directly."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile

import anyio
import pytest

from duplex_actors import Runtime, Script, ScriptedEngine
from duplex_actors.core.engine_io import Aborted, EngineFailure, ModelTurnRequest, TurnDone, TurnKind
from duplex_actors.core.fence import Fence
from duplex_actors.engines.engine_process import EngineHostServer, EngineProcessClient

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
CHUNK = b"\x01\x00" * 320


@pytest.fixture
def anyio_backend():
    return "asyncio"


@contextlib.asynccontextmanager
async def hosted(script: Script = Script(token_latency_s=0.001)):
    folder = tempfile.mkdtemp(prefix="dx-eng-")
    path = os.path.join(folder, "engine.sock")
    backend = ScriptedEngine(script)
    async with EngineHostServer(backend, path) as host:
        yield host, backend, path
    shutil.rmtree(folder, ignore_errors=True)


def request(n: int, kind: TurnKind = TurnKind.RESPONSE) -> ModelTurnRequest:
    fence = Fence("sess_test", 0, n)
    return ModelTurnRequest(fence.request_id(), fence, kind, audio=CHUNK)


async def drain(stream) -> list:
    out = []
    with anyio.fail_after(10):
        async for output in stream:
            out.append(output)
    return out


async def test_a_conversation_through_the_engine_process_matches_the_in_process_engine():
    script = Script(token_latency_s=0.001)

    async def conversation(engine) -> list[str]:
        async with Runtime(engine) as rt:
            session = await rt.open_session()
            session.append_audio(CHUNK)
            await session.commit()
            types = []
            with anyio.fail_after(10):
                async for event in session.events():
                    types.append(event.type)
                    if event.type == "response.done":
                        assert event.status == "completed"
                        break
            return types

    expected = await conversation(ScriptedEngine(script))
    async with hosted(script) as (host, backend, path):
        client = EngineProcessClient(path)
        assert await conversation(client) == expected
        await client.aclose()
        assert client.name == "scripted" and client.capabilities == backend.capabilities
        assert host.streams_total == 1 and backend.active == set()


async def test_two_runtimes_share_one_backend_with_requests_in_flight_together():
    slow = Script(token_latency_s=0.02, tokens=tuple(f"w{i} " for i in range(10)), audio_packets=0)
    async with hosted(slow) as (_host, _backend, path):
        a, b = EngineProcessClient(path), EngineProcessClient(path)
        async with Runtime(a) as rt_a, Runtime(b) as rt_b:
            sessions = [await rt_a.open_session(), await rt_b.open_session()]
            for s in sessions:
                s.append_audio(CHUNK)
                await s.commit()
            for s in sessions:
                with anyio.fail_after(10):
                    async for event in s.events():
                        if event.type == "response.done":
                            assert event.status == "completed"
                            break
            stats = await a.remote_statistics()
        assert stats["connections_total"] == 2 and stats["streams_total"] == 2
        assert stats["max_runtimes_in_flight"] == 2, "both runtimes' turns were in the backend at once"
        await a.aclose()
        await b.aclose()


async def test_turns_asked_for_in_one_pass_reach_the_engine_process_in_one_write():
    # Several sessions asking at once must wake the engine process once, not once each; every
    # stream still gets its own outputs and exactly one terminal.
    unpaced = Script(tokens=("a", "b"), audio_packets=1)
    async with hosted(unpaced) as (host, _backend, path):
        client = EngineProcessClient(path)
        await client.start()
        writer = client._writer
        assert writer is not None
        writes = []
        write = writer.write
        writer.write = lambda data: (writes.append(data), write(data))[1]  # type: ignore[method-assign]
        requests = [request(n) for n in range(5)]
        outputs: dict[str, list] = {}

        async def consume(req: ModelTurnRequest) -> None:
            outputs[req.request_id] = await drain(client.generate(req))

        async with anyio.create_task_group() as tg:
            for req in requests:
                tg.start_soon(consume, req)
        assert len(writes) == 1, [len(w) for w in writes]
        assert host.streams_total == 5
        for req in requests:
            terminals = [
                o for o in outputs[req.request_id] if isinstance(o, (Aborted, TurnDone, EngineFailure))
            ]
            assert [type(t) for t in terminals] == [TurnDone] and outputs[req.request_id][-1] is terminals[0]
            assert all(o.request_id == req.request_id for o in outputs[req.request_id])
        await client.aclose()


async def test_cancelling_the_consumer_frees_the_request_in_the_host():
    endless = Script(token_latency_s=0.01, tokens=("x",) * 10_000, audio_packets=0)
    async with hosted(endless) as (_host, backend, path):
        client = EngineProcessClient(path)
        await client.start()
        req = request(1)
        seen = []

        async def consume():  # as the engine actor consumes: closing the stream on cancel
            async with contextlib.aclosing(client.generate(req)) as stream:
                async for output in stream:
                    seen.append(output)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            with anyio.fail_after(5):
                while len(seen) < 3:
                    await anyio.sleep(0.005)
            assert backend.active == {req.request_id}
            tg.cancel_scope.cancel()
        with anyio.fail_after(5):
            while backend.active:
                await anyio.sleep(0.005)
        assert req.request_id in backend.aborted
        await client.aclose()


async def test_abort_ends_the_stream_with_exactly_one_aborted_terminal():
    endless = Script(token_latency_s=0.01, tokens=("x",) * 10_000, audio_packets=0)
    async with hosted(endless) as (_host, backend, path):
        client = EngineProcessClient(path)
        await client.start()
        req = request(2)
        stream = client.generate(req)
        first = await stream.__anext__()
        await client.abort(req.request_id)
        rest = await drain(stream)
        outputs = [first, *rest]
        terminals = [o for o in outputs if isinstance(o, (Aborted, TurnDone, EngineFailure))]
        assert terminals == [Aborted(req.request_id, produced_at=terminals[0].produced_at)]
        assert outputs[-1] is terminals[0]
        with anyio.fail_after(5):
            while backend.active:
                await anyio.sleep(0.005)
        await client.aclose()


async def test_a_lost_engine_process_fails_open_streams_retryably_and_the_next_turn_reconnects():
    endless = Script(token_latency_s=0.01, tokens=("x",) * 10_000, audio_packets=0)
    async with hosted(endless) as (host, backend, path):
        client = EngineProcessClient(path)
        await client.start()
        stream = client.generate(request(3))
        await stream.__anext__()
        for conn in list(host.connections):  # the engine side of the channel dies
            conn.writer.transport.abort()
        rest = await drain(stream)
        assert isinstance(rest[-1], EngineFailure) and rest[-1].retryable
        assert "connection lost" in rest[-1].message
        # The host is still there: the next request reconnects and completes.
        backend._script = Script(token_latency_s=0.0)
        outputs = await drain(client.generate(request(4)))
        assert isinstance(outputs[-1], TurnDone)
        assert client.disconnects == 1
        await client.aclose()


async def test_an_unreachable_engine_process_is_a_retryable_failure_not_a_hang():
    client = EngineProcessClient(
        os.path.join(tempfile.gettempdir(), "dx-no-such-engine.sock"), connect_timeout_s=1.0
    )
    outputs = await drain(client.generate(request(5)))
    assert len(outputs) == 1 and isinstance(outputs[0], EngineFailure) and outputs[0].retryable
    await client.aclose()


def test_frames_over_the_limit_are_refused():
    from duplex_actors.engines import engine_process
    from duplex_actors.errors import EngineFailed

    async def main():
        reader = asyncio.StreamReader()
        reader.feed_data((engine_process.MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
        with pytest.raises(EngineFailed):
            await engine_process._read_frame(reader)

    asyncio.run(main())
