"""The runtime embedded under a plain ``asyncio.run``: nothing names the async library there,
and a plain loop callback has no current task, yet the server tells sessions appends from such
callbacks (an append handled as websockets parses it, the VAD batcher's ``call_soon``). An
append may start engine work there: a model-native unit, or the abort of an answer the user
talked over. Each must reach the engine (actors/async_library.py)."""

from __future__ import annotations

import asyncio

import anyio

from duplex_actors import Runtime, Script, ScriptedEngine
from duplex_actors.core import commands as cmd
from duplex_actors.core.engine_io import TurnKind

from ..reliability.conftest import CHUNK


class AsyncOnlyAbort(ScriptedEngine):
    """Aborts only in a task, as the engine process's client, vLLM and Ray do: the engine
    actor starts a task for each abort."""

    async def abort(self, request_id: str) -> None:
        await super().abort(request_id)


def _from_a_callback(tell) -> asyncio.Future[None]:
    """Run ``tell`` as a plain loop callback (no task), as a protocol's data_received runs;
    the future is done once it has."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def callback() -> None:
        assert asyncio.current_task() is None
        try:
            tell()
            done.set_result(None)
        except BaseException as exc:  # pragma: no cover - what the test is there to catch
            done.set_exception(exc)

    loop.call_soon(callback)
    return done


def test_a_unit_completed_by_an_append_told_from_a_plain_callback_reaches_the_engine():
    async def main() -> None:
        engine = ScriptedEngine(Script(speak=False, first_latency_s=0.05))
        async with Runtime(engine, reaper_interval_s=0) as rt:
            s = await rt.open_session(model_native=True, unit_samples=len(CHUNK) // 2)
            s.append_audio(CHUNK)  # idle -> listening: a unit is asked for from here on
            await s.barrier()
            before = len(engine.submitted)
            await _from_a_callback(lambda: s.tell(cmd.AppendAudio(pcm=CHUNK)))
            with anyio.fail_after(5):
                while len(engine.submitted) == before:
                    await anyio.sleep(0.005)
            assert engine.submitted[-1].kind is TurnKind.UNIT
            with anyio.fail_after(5):
                while s.core.in_flight_requests:  # decided (listen), so the unit ended
                    await anyio.sleep(0.005)

    asyncio.run(main())


def test_an_answer_talked_over_from_a_plain_callback_is_aborted_in_the_engine():
    async def main() -> None:
        engine = AsyncOnlyAbort(Script(tokens=("word",) * 400, token_latency_s=0.01))
        async with Runtime(engine, reaper_interval_s=0) as rt:
            s = await rt.open_session(min_interruption_ms=40)
            s.tell(cmd.CreateResponse())
            with anyio.fail_after(5):
                while s.core.state != "responding":
                    await anyio.sleep(0.005)
            s.tell(cmd.SpeechStartedSignal())
            await s.barrier()
            # Speech over the answer, told as the server tells it: 60 ms cancel it at 40.
            for _ in range(3):
                await _from_a_callback(lambda: s.tell(cmd.AppendAudio(pcm=CHUNK)))
            with anyio.fail_after(5):
                while not engine.aborted:
                    await anyio.sleep(0.005)
            assert s.core.state != "responding"

    asyncio.run(main())
