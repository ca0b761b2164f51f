"""What server VAD's turn detector signals on a run of 32 ms windows: shared by the VAD tests."""

from __future__ import annotations

from duplex_actors.audio.turn_detection import TurnDetectionConfig, TurnDetector
from duplex_actors.audio.vad import SileroVad

WINDOW = 2 * 512  # bytes of one 32 ms window at 16 kHz
WINDOW_MS = 32


def windows_of(pcm: bytes) -> list[bytes]:
    return [pcm[i : i + WINDOW] for i in range(0, len(pcm) - WINDOW + 1, WINDOW)]


def signals(vad: SileroVad, windows: list[bytes]) -> list[tuple[str, int]]:
    """(signal's class name, its audio_start_ms or audio_end_ms) for each signal, in order."""
    detector = TurnDetector(TurnDetectionConfig(), vad)
    out = []
    for w in windows:
        for s in detector.judge([vad.probability(w)], 0.0):
            out.append(
                (type(s).__name__, getattr(s, "audio_start_ms", None) or getattr(s, "audio_end_ms", 0))
            )
    return out


async def send_at_16k(ws, pcm: bytes) -> str:
    """On a new session's websocket: declare 16 kHz pcm input, then send ``pcm`` in 20 ms
    appends. Returns the session's id."""
    import base64
    import json

    from ..server.conftest import recv_json, recv_until

    sid = (await recv_json(ws))["session"]["id"]
    fmt = {"type": "audio/pcm", "rate": 16000}
    await ws.send(json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": fmt}}}}))
    await recv_until(ws, "session.updated")
    for i in range(0, len(pcm), 640):
        chunk = base64.b64encode(pcm[i : i + 640]).decode()
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
    return sid
