"""The callers' speech read from a file made beforehand ($DUPLEX_DEMO_SPEECH): what a machine
without Piper (scripts/device-check.sh's GPU machine) runs the demo with."""

from __future__ import annotations

import base64
import json

from duplex_actors.demo import run as demo_run


def test_speech_file_round_trips_and_replaces_synthesis(tmp_path, monkeypatch):
    texts = ("hello there", "uh-huh")
    # Bytes Piper would never make: if synthesis ran instead of the file, they would differ.
    canned = {text: bytes([i + 1]) * (100 + i) for i, text in enumerate(texts)}
    path = tmp_path / "speech.json"
    path.write_text(json.dumps({t: base64.b64encode(b).decode() for t, b in canned.items()}))
    assert demo_run.load_speech(path) == canned

    monkeypatch.setattr(demo_run, "_SPEECH", {})
    monkeypatch.setenv(demo_run.SPEECH_FILE_ENV, str(path))

    def no_piper():
        raise AssertionError("Piper was asked for speech the file holds")

    monkeypatch.setattr("duplex_actors.audio.tts.default_tts", no_piper)
    assert demo_run.synthesize_speech(list(texts)) == canned


def test_a_text_missing_from_the_file_is_still_synthesised(tmp_path, monkeypatch):
    path = tmp_path / "speech.json"
    path.write_text(json.dumps({"known": base64.b64encode(b"\x01\x02").decode()}))
    monkeypatch.setattr(demo_run, "_SPEECH", {})
    monkeypatch.setenv(demo_run.SPEECH_FILE_ENV, str(path))
    asked = []

    class FakeTts:
        pass

    monkeypatch.setattr("duplex_actors.audio.tts.default_tts", lambda: FakeTts())
    monkeypatch.setattr(
        "duplex_actors.audio.utterances.synthesize_utterance",
        lambda text, tts: asked.append(text) or b"\x09" * 4,
    )
    speech = demo_run.synthesize_speech(["known", "new words"])
    assert speech == {"known": b"\x01\x02", "new words": b"\x09" * 4}
    assert asked == ["new words"]
