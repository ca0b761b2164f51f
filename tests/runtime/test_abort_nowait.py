"""A backend with a synchronous abort is told while the barge-in is processed; one that only
overrides ``abort`` is still called through it."""

import anyio
import pytest

from duplex_actors import Runtime, Script, ScriptedEngine
from duplex_actors.engines.base import sync_abort
from duplex_actors.engines.pacing import PacedEngine

CHUNK = b"\x01\x00" * 320
LONG = Script(tokens=("a",) * 500, token_latency_s=0.01, audio_packets=0)
pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


class CountingAborts(ScriptedEngine):
    """Overrides abort only: abort_nowait (inherited) must not bypass it."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.abort_calls = 0

    async def abort(self, request_id: str) -> None:
        self.abort_calls += 1
        await super().abort(request_id)


def test_sync_abort_only_where_abort_is_defined_with_it():
    assert sync_abort(ScriptedEngine()) is not None
    assert sync_abort(CountingAborts()) is None
    # through a wrapper too
    assert sync_abort(PacedEngine(ScriptedEngine())) is not None
    assert sync_abort(PacedEngine(CountingAborts())) is None


async def barge_in_once(engine, aborted_at_once) -> None:
    async with Runtime(engine, reaper_interval_s=0) as rt:
        session = await rt.open_session()
        session.append_audio(CHUNK)
        await session.commit()
        with anyio.fail_after(5):
            async for event in session.events():
                if event.type == "response.output_text.delta":
                    break
        await session.barge_in()
        # ask() resumes before a task started while the barge-in was processed could run
        assert aborted_at_once()


async def test_abort_nowait_called_when_the_barge_in_is_processed():
    engine = ScriptedEngine(LONG, produces_audio=False)
    await barge_in_once(engine, lambda: len(engine.aborted) == 1)


# Reads the abort count at a point where asyncio has not yet run the aborting task; trio may run
# it earlier (no order promised among runnable tasks), so the "not yet" is asyncio's only.
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_overridden_abort_still_called():
    engine = CountingAborts(LONG, produces_audio=False)
    await barge_in_once(engine, lambda: engine.abort_calls == 0)  # through a task: not yet
    assert engine.abort_calls == 1
