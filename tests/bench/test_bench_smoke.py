"""Smoke tests of the benchmark suite: every piece runs at tiny sizes and produces its keys.

No timing is asserted anywhere (figures on a shared machine are noise at these sizes); what is
checked is that the suite works end to end, prints ratios and writes its files.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from typer.testing import CliRunner

from duplex_actors.bench import report
from duplex_actors.bench import runtime_bench as rb
from duplex_actors.bench.cli_commands import register, run_suite

FIGURE_KEYS = {"metric", "value", "unit", "baseline", "baseline_label", "ratio", "target", "met"}


def _check(result: dict, name: str) -> None:
    assert result["name"] == name
    assert result["figures"], "a bench must print at least one figure"
    for fig in result["figures"]:
        assert fig.keys() >= FIGURE_KEYS
        if fig["baseline"] and fig["value"] is not None:
            assert fig["ratio"] == pytest.approx(fig["value"] / fig["baseline"])
    json.dumps(result, default=str)  # JSON-able


def test_throughput_tiny():
    r = rb.bench_throughput(sizes=(3, 2, 2, 5, 1))
    _check(r, "throughput")
    assert {
        "append_msgs_per_s",
        "turn_msgs_per_s",
        "turns_per_s",
        "ask_round_trip_s",
        "bare_put_get_per_s",
        "bare_ping_pong_s",
    } <= r["raw"].keys()


def test_scale_tiny():
    r = rb.bench_scale(quick=True, sessions=200)
    _check(r, "scale")
    for kind in ("runtime", "bare"):
        steps = r["series"][kind]
        assert steps[-1]["sessions"] == 200
        assert {"sessions", "seconds", "rss_bytes"} <= steps[-1].keys()
        assert r["raw"][kind]["tracemalloc_bytes_per_session"] > 0


@pytest.mark.slow
def test_realtime_tiny():
    r = rb.bench_realtime(quick=True, sizes=(4,), seconds=0.4)
    _check(r, "realtime")
    row = r["rows"][0]
    assert row["sessions"] == 4
    for key in (
        "append_to_core_ms",
        "commit_to_engine_ms",
        "event_delivery_lag_ms",
        "bare_append_ms",
        "cpu_fraction",
        "cpu_us_per_chunk",
        "sessions_per_core",
        "gc_pauses",
        "errors",
    ):
        assert key in row
    assert row["append_to_core_ms"]["n"] > 0
    assert set(r["series"]["4"]) == {"runtime", "bare"}


@pytest.mark.slow
def test_barge_in_tiny():
    r = rb.bench_barge_in(quick=True, sessions=4, seconds=1.2)
    _check(r, "barge_in")
    assert {
        "barge_ins",
        "stale_after_done",
        "dropped_undelivered_audio",
        "stale_outputs_consumed",
        "engine_aborted",
    } <= r["counts"].keys()
    # The one non-timing promise: no audio of a cancelled response after its response.done.
    assert r["counts"]["stale_after_done"] == 0


def test_percentiles_and_cdf():
    p = rb.percentiles([float(i) for i in range(100)])
    assert (p["n"], p["p50"], p["p99"], p["max"]) == (100, 50.0, 99.0, 99.0)
    assert rb.percentiles([])["p99"] is None
    cdf = rb.cdf_points([3.0, 1.0, 2.0])
    assert cdf[-1] == (3.0, 1.0)


@pytest.mark.slow
def test_report_files(tmp_path):
    results = [
        rb.bench_throughput(sizes=(2, 2, 1, 3, 1)),
        rb.bench_realtime(quick=True, sizes=(3,), seconds=0.3),
        {"name": "engine", "skipped": "torch is not installed"},
    ]
    lines: list[str] = []
    for r in results:
        report.print_result(r, lines.append)
    assert any("ratio" in line for line in lines)
    assert any("skipped" in line for line in lines)
    path = report.write_json(results, tmp_path, quick=True)
    doc = json.loads(path.read_text())
    assert [r["name"] for r in doc["results"]] == ["throughput", "realtime", "engine"]
    assert "| throughput |" in report.markdown_table(results)
    pngs = report.write_pngs(results, tmp_path, lines.append)
    pytest.importorskip("matplotlib")
    assert (tmp_path / "realtime_cdf.png") in pngs


def test_cli_runs_and_writes_files(tmp_path, monkeypatch):
    import typer

    from duplex_actors.bench import cli_commands

    tiny = {
        "throughput": lambda: rb.bench_throughput(sizes=(2, 2, 1, 3, 1)),
        "engine": lambda: cli_commands._engine_bench(
            "engine", "duplex_actors.bench.no_such_bench", "json", True
        ),
        "vllm": lambda: cli_commands._engine_bench(
            "vllm", "duplex_actors.bench.vllm_bench", "no_such_module_xyz", True
        ),
    }
    monkeypatch.setattr(cli_commands, "_plan", lambda quick: tiny)
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a second command keeps typer in sub-command mode
    out = tmp_path / "out"
    res = CliRunner().invoke(
        app,
        ["bench", "--quick", "--out", str(out), "--only", "throughput", "--only", "engine", "--only", "vllm"],
    )
    assert res.exit_code == 0, res.output
    assert "ratio" in res.output
    assert "skipped: duplex_actors.bench.no_such_bench is not present" in res.output
    assert "skipped: 'no_such_module_xyz' is not installed" in res.output
    doc = json.loads((out / "bench.json").read_text())
    assert [r["name"] for r in doc["results"]] == ["throughput", "engine", "vllm"]
    assert (out / "bench.md").exists()


def test_embedded_figures_from_engine_bench_shape():
    from duplex_actors.bench.cli_commands import _embedded_figures

    raw = {
        "engine_tokens_per_s": {1: 900.0, 64: 20000.0},
        "bare_tokens_per_s": {1: 1000.0, 64: 21000.0},
        "sequential_b1_tokens_per_s": 1000.0,
        "targets": {"engine_vs_bare": 0.8},
    }
    figs = _embedded_figures(raw)
    assert [f["met"] for f in figs] == [True, True, True]
    assert _embedded_figures({"unexpected": 1}) is None


def test_unknown_bench_name_is_refused(tmp_path):
    import typer

    with pytest.raises(typer.BadParameter):
        run_suite(True, tmp_path, ["nope"], lambda _: None)


def test_wire_tiny():
    pytest.importorskip("websockets")
    from duplex_actors.bench.wire_bench import bench_wire

    r = bench_wire(quick=True, turns=3, vad_turns=0)
    _check(r, "wire")
    assert r["commit_ms"]["n"] == 3 and r["bare_ms"]["n"] == 3
    assert r["commit_added_ms"]["p50"] is not None
    # The floor arm ran the same turns against a bare websockets server.
    assert r["floor_added_ms"]["n"] == 3 and r["floor_added_ms"]["p50"] is not None
    metrics = [f["metric"] for f in r["figures"]]
    assert any("server-added on the commit path" in m and m.endswith("p99") for m in metrics)
    added = next(f for f in r["figures"] if f["metric"].startswith("server-added on the commit path"))
    assert added["baseline"] == r["floor_added_ms"]["p50"]


@pytest.mark.slow
def test_flood_bench_churn_tiny(capsys):
    """The churn flood runs end to end with a connect rate: some handshakes are refused (the
    flooder retries at once), no session is left behind, and the ratio line is printed."""
    from duplex_actors.bench import flood_bench

    # The neighbour's key has the same rate (its turns open a connection each, ~15 a second).
    assert (
        flood_bench.main(["--churn", "--seconds", "1.5", "--connections", "2", "--connect-rate", "20"]) == 0
    )
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("churn from 2 connections") and "at the median" in line
    opened = int(line.split(": ")[1].split(" sessions opened")[0])
    refused = int(line.split("), ")[1].split(" handshakes refused")[0])
    assert 1 <= opened <= 20 + 20 * 2 and refused > 0  # the burst, plus 20 a second
    assert "sessions left 0" in line


@pytest.mark.slow
def test_flood_bench_held_audio_tiny(capsys):
    """The held-audio flood runs end to end: with a budget of 8 MiB, 8 sessions from 2
    addresses hold the budget (to the append), not the ~61 MiB their own bounds allow."""
    from duplex_actors.bench import flood_bench

    assert flood_bench.main(["--held-audio", "8", "--addresses", "2", "--audio-budget-mb", "8"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("8 sessions from 2 addresses holding G.711 input audio, budget 8 MiB")
    held = float(line.split("the sessions hold ")[1].split(" MiB")[0])
    assert 7.9 <= held <= 8.1, line  # within an append (32 KB) of the budget


@pytest.mark.slow
def test_flood_bench_held_audio_transcribed_tiny(capsys):
    """With input transcription on, the turns waiting for the real recogniser count in the
    budget beside the buffers: what the budget counts is what both hold."""
    from duplex_actors.audio.transcription import default_transcriber
    from duplex_actors.bench import flood_bench

    if default_transcriber() is None:
        pytest.skip("no recogniser installed (extra 'transcription' or 'moonshine')")
    argv = ["--held-audio", "8", "--addresses", "2", "--audio-budget-mb", "48", "--transcribed"]
    assert flood_bench.main(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "(transcribed), budget 48 MiB" in line, line
    held, requests, queued, counted = _held_audio_figures(line)
    assert queued > 0, line  # some turns were taken, and their audio waits
    assert requests == 0, line  # and no response asked for
    assert abs(counted - (held + queued)) < 0.1, line
    assert counted < 2 * 48, line


def _held_audio_figures(line: str) -> tuple[float, ...]:
    """``--held-audio``'s report: what the sessions hold, their responses' requests, the
    recogniser's queue, and what the budget counts (MiB)."""

    def after(words: str) -> float:
        return float(line.split(words)[1].split(" MiB")[0])

    return (
        after("the sessions hold "),
        after("responses' requests "),
        after("MiB, and "),
        after("recogniser, "),
    )


@pytest.mark.slow
def test_flood_bench_held_audio_responding_tiny(capsys):
    """A response's request carries the committed turn it took: the budget counts it beside
    the buffers while the engine holds the request."""
    from duplex_actors.bench import flood_bench

    argv = ["--held-audio", "8", "--addresses", "2", "--audio-budget-mb", "16", "--responding"]
    assert flood_bench.main(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "and asking for responses, budget 16 MiB" in line, line
    held, requests, queued, counted = _held_audio_figures(line)
    assert requests > 0 and queued == 0, line
    assert abs(counted - (held + requests)) < 0.1, line
    assert counted < 2 * 16, line


@pytest.mark.slow
def test_flood_bench_held_audio_model_native_tiny(capsys):
    """A model-native session's units carry its audio to the engine, which holds them
    undecided: the budget counts them, and refuses the client more once they fill it."""
    from duplex_actors.bench import flood_bench

    argv = ["--held-audio", "8", "--addresses", "2", "--audio-budget-mb", "4", "--model-native"]
    assert flood_bench.main(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "(model-native: units the engine holds), budget 4 MiB" in line, line
    held, requests, queued, counted = _held_audio_figures(line)
    assert requests > 3.5 and queued == 0, line  # the units hold nearly all of it
    assert abs(counted - (held + requests)) < 0.1, line
    assert counted < 2 * 4, line  # not the 2 minutes (about 30 MiB) the sessions sent


@pytest.mark.slow
def test_flood_bench_held_audio_model_native_pending_words_tiny(capsys):
    """Every unit's request carries the words of the items pending: the units of a session
    carry one string between them (not one each), and the text budget counts it."""
    from duplex_actors.bench import flood_bench

    argv = ["--held-audio", "4", "--addresses", "2", "--audio-budget-mb", "4"]
    assert flood_bench.main([*argv, "--model-native", "--pending-words"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    _, requests, _, _ = _held_audio_figures(line)
    words = float(line.split("the requests carry ")[1].split(" MiB")[0])
    text_counted = float(line.split("the text budget counts ")[1].split(" MiB")[0])
    # Four items of 65,000 emoji a session: about 1 MiB of words each, joined once a session,
    # where about 30 units a session wait (a megabyte each, before).
    assert requests > 3.5, line
    assert 3.5 < words < 4.5, line
    assert text_counted > 2 * words - 0.2, line  # the items themselves, and the joins (to rounding)


@pytest.mark.slow
@pytest.mark.parametrize("parts", ["1", "4"])
def test_flood_bench_held_text_tiny(capsys, parts):
    """The held-text flood runs end to end over compressed frames: with a budget of 8 MiB, 8
    sessions from 2 addresses hold the budget (to within a message), not the ~18 MiB of text
    their own bounds allow, and the rest is refused as resource_exhausted; with items of one
    part or of four."""
    from duplex_actors.bench import flood_bench

    given = ["--held-text", "8", "--addresses", "2", "--text-budget-mb", "8", "--item-parts", parts]
    assert flood_bench.main(given) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("8 sessions from 2 addresses holding text, budget 8 MiB"), line
    assert "'resource_exhausted'" in line, line
    held = float(line.split("the sessions hold ")[1].split(" MiB")[0])
    assert 6.0 <= held <= 9.0, line  # within a message (~1 MiB) of the budget


@pytest.mark.slow
def test_flood_bench_held_responses_tiny(capsys):
    """The held-responses flood runs end to end over compressed frames: with a budget of 4 MiB,
    responses with ~960 KB of their own text each are held to it (to within one), counted, and
    the rest refused as resource_exhausted."""
    from duplex_actors.bench import flood_bench

    assert flood_bench.main(["--held-responses", "8", "--addresses", "2", "--text-budget-mb", "4"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("8 sessions from 2 addresses each asking for a response"), line
    assert "'resource_exhausted'" in line and "'response.created'" in line, line
    counted = float(line.split("; ")[1].split(" MiB counted")[0])
    assert 2.5 <= counted <= 5.0, line


@pytest.mark.slow
def test_flood_bench_large_messages_tiny(capsys):
    """The large-messages flood runs end to end against serve's assembly in its own process:
    every message is answered (refused as an unknown type) and nothing of them stays."""
    from duplex_actors.bench import flood_bench

    assert flood_bench.main(["--large-messages", "4", "--messages", "2", "--addresses", "2"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("4 sessions from 2 addresses, 2 messages of ~1 MB each"), line
    assert "8 refused, 0 connections dropped" in line, line
    after = float(line.rsplit("after +", 1)[1])
    assert after < 16, line


@pytest.mark.slow
def test_flood_bench_responses_tiny():
    """The response flood runs serve's engine end to end: the flooder's sessions got responses,
    and the neighbour was answered with speech both alone and during the flood."""
    pytest.importorskip("torch")
    pytest.importorskip("piper")
    from duplex_actors.bench import flood_bench

    r = asyncio.run(flood_bench._run_responses(2, 2.0, turns=1))
    assert r["flooder_responses"] >= 2 and r["during_turns"] >= 1
    for key in ("first_alone", "first_during"):
        median, worst = r[key]
        assert 0 < median <= worst
    # First audio comes before the response is done.
    assert r["first_alone"][1] < r["done_alone"][1]


@pytest.mark.slow
def test_flood_bench_scripted_responses_tiny(capsys):
    """The response flood on the scripted engine (the loop's own work per response), each
    response cancelled as soon as asked for, from the command line: its line reports the
    churn, the engine, the loop share and both figures."""
    from duplex_actors.bench import flood_bench

    argv = ["--responses", "2", "--engine", "scripted", "--seconds", "1.5", "--policy", "off"]
    assert flood_bench.main([*argv, "--cancel-after", "0"]) == 0
    line = capsys.readouterr().out
    assert "each cancelled after 0 s (scripted engine, loop share off, held 0.0 s" in line, line
    # A connection for each response, dropped as soon as it has asked.
    assert flood_bench.main([*argv, "--how", "drop"]) == 0
    line = capsys.readouterr().out
    assert "asking drop (scripted engine" in line and "the neighbour's first audio" in line, line
    done = int(line.split("; ")[1].split(" done")[0])
    assert done >= 2, line
    assert "the neighbour's first audio" in line and "response done" in line


@pytest.mark.slow
def test_flood_bench_audio_sessions_tiny():
    """Several sessions of one key flooding audio: the neighbour's turns ran during it, and with
    the loop shared by client the figures come back whole."""
    from duplex_actors.bench import flood_bench

    r = asyncio.run(flood_bench._run_audio_sessions(3, 1.5, True, turns=1))
    assert r["sessions"] == 3 and r["shared"] and r["during_turns"] >= 1
    assert 0 < r["during_s"] <= r["during_p90_s"] <= r["during_worst_s"]
    assert r["accepted_x_real_time"] > 0 and r["held_s"] >= 0


@pytest.mark.slow
def test_flood_bench_unread_audio_tiny(capsys):
    """Dropped clients' long answers, end to end through the command line (the server in its
    own process); what it holds is tested in tests/server/test_edge_memory.py."""
    from duplex_actors.bench import flood_bench

    assert flood_bench.main(["--unread-audio", "4", "--addresses", "2", "--seconds", "0.5"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("4 sessions from 2 addresses each asking for 2.7 MiB of speech"), line
    assert "(the engine waits for its listeners): server RSS" in line, line
