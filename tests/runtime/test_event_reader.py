"""SessionActor.events hands out each batch it takes from the core, then asks the core whether
there is more (has_events) before it takes again: a take that finds nothing (after nearly every
batch) is never made, and nothing is lost or reordered by it."""

from __future__ import annotations

import pytest

from duplex_actors import Runtime, ScriptedEngine
from duplex_actors.core import commands as cmd
from duplex_actors.core.session import SessionCore
from duplex_actors.engines.scripted import Script

from ..reliability.conftest import CHUNK

pytestmark = pytest.mark.anyio


async def test_the_reader_takes_only_when_the_core_has_events_and_loses_none(monkeypatch):
    engine = ScriptedEngine(Script(tokens=("a", "b", "c"), audio_packets=2))
    async with Runtime(engine, reaper_interval_s=0) as rt:
        s = await rt.open_session()
        core = s.core
        takes: list[int] = []
        take = SessionCore.take_events

        def counting_take(self: SessionCore, limit: int | None = None) -> list:
            batch = take(self, limit)
            if self is core:
                takes.append(len(batch))
            return batch

        monkeypatch.setattr(SessionCore, "take_events", counting_take)
        seen = []
        for _ in range(3):
            s.append_audio(CHUNK)
            s.tell(cmd.CommitInput())
            async for event in s.events():
                seen.append(event)
                if event.type == "response.done":
                    break
        assert takes and 0 not in takes  # every take found a batch
        assert sum(takes) == len(seen)  # and every event taken was handed out, once
        seqs = [e.seq for e in seen]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert [e.type for e in seen].count("response.done") == 3
