"""Runtime bugs the testing kit found, kept as regression tests now that they are fixed."""

import anyio

from duplex_actors import Runtime, Script, ScriptedEngine


def test_next_event_does_not_lose_the_rest_of_a_batch():
    async def main():
        engine = ScriptedEngine(Script(tokens=("a", "b"), audio_packets=0))
        async with Runtime(engine, reaper_interval_s=0) as rt:
            session = await rt.open_session()
            session.append_audio(b"\0\0" * 3200)
            await session.commit()
            await anyio.sleep(0.05)  # the whole response now waits in the session's outbox
            first = await session.next_event()
            second = await session.next_event(timeout=1.0)  # TimeoutError today
            return first.type, second.type

    assert anyio.run(main) == ("session.created", "input_audio_buffer.committed")
