"""Embedding duplex_actors in an application: one caller, two turns, one barge-in.

Run:  python examples/embed_app.py            (scripted engine: no model, runs anywhere)
      python examples/embed_app.py --embedded (the embedded CPU engine; extra 'embedded')
      python examples/embed_app.py --trio     (the same under trio: the runtime is anyio only)
"""

from __future__ import annotations

import sys

import anyio

from duplex_actors import Runtime, Script, ScriptedEngine


def make_engine(embedded: bool):
    if embedded:
        from duplex_actors.engines.embedded import make_embedded_engine

        return make_embedded_engine()
    # A reply of eight words, 20 ms apart, with 100 ms audio packets.
    return ScriptedEngine(Script(token_latency_s=0.02, packet_latency_s=0.0))


async def converse(embedded: bool = False) -> dict:
    summary = {"responses": [], "events": 0}
    chunk = b"\x10\x00" * 320  # 20 ms of (very quiet) 16 kHz pcm16
    async with Runtime(make_engine(embedded)) as runtime:
        session = await runtime.open_session()
        for turn in range(2):
            for _ in range(25):  # half a second of "speech"
                session.append_audio(chunk)
            await session.commit()
            async for event in session.events():
                summary["events"] += 1
                if event.type == "response.output_text.delta":
                    print(f"  model says: {event.delta!r}")
                    if turn == 1:
                        # The user talks over the second answer: stop it at once.
                        await session.barge_in()
                elif event.type == "response.done":
                    m = event.metrics
                    print(
                        f"turn {turn}: response.done status={event.status} reason={event.reason} "
                        f"ttft={m.ttft_ms and round(m.ttft_ms, 2)} ms source={m.source}"
                    )
                    summary["responses"].append((event.status, event.reason))
                    break
        await session.close()
        async for event in session.events():
            summary["events"] += 1
            if event.type == "session.closed":
                print(f"session.closed reason={event.reason}")
    return summary


def main() -> None:
    anyio.run(converse, "--embedded" in sys.argv, backend="trio" if "--trio" in sys.argv else "asyncio")


if __name__ == "__main__":
    main()
