"""Every bench entry point runs in CI in a smoke form.

Each module of duplex_actors/bench with an entry point (``main`` or ``__main__``), and each
``duplex-actors bench --only`` name, is listed in ``COVERED`` with the test that runs it at a
tiny size; the first test below fails when a new one appears without one. No timing is
asserted (at these sizes figures are noise): what is checked is that each runs to the end and
reports its figures against a bare baseline of the same run.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest

import duplex_actors.bench as bench_pkg
from duplex_actors.bench.cli_commands import BENCHES, OPT_IN

BENCH_DIR = Path(bench_pkg.__file__).parent
TESTS = Path(__file__).resolve().parents[1]

#: Entry point -> (test file under tests/, test function) that runs it at a smoke size.
COVERED = {
    # python -m duplex_actors.bench (the CLI's options are listed below, by name)
    "__main__": ("bench/test_bench_smoke.py", "test_cli_runs_and_writes_files"),
    "barge_in_bench": ("bench/test_barge_in_bench.py", "test_barge_in_bench_main_tiny"),
    "transcription_bench": ("bench/test_transcription_bench.py", "test_transcription_bench_main_tiny"),
    "engine_bench": ("bench/test_bench_entry_points.py", "test_engine_bench_main_tiny_writes_its_report"),
    "flood_bench": ("bench/test_bench_smoke.py", "test_flood_bench_churn_tiny"),
    "ray_bench": ("bench/test_bench_entry_points.py", "test_ray_bench_and_bench_only_ray"),
    "serve_bench": ("ray/test_serve_bench.py", "test_the_serve_bench_runs_both_arms_and_prints_a_ratio"),
    "stall_bench": ("bench/test_bench_entry_points.py", "test_stall_bench_main_tiny"),
    "soak": ("reliability/test_soak_short.py", "test_soak_short_form_loses_nothing_and_leaks_nothing"),
    "vad_bench": ("bench/test_vad_bench.py", "test_every_arm_streams_and_the_batched_one_batches"),
    "vad_rate_bench": ("bench/test_vad_rate_bench.py", "test_vad_rate_bench_main_tiny"),
    "vllm_bench": (
        "vllm/test_vllm_bench.py",
        "test_vllm_bench_smoke_reports_every_figure_against_bare_asyncllm",
    ),
    "tls_relay_bench": ("bench/test_bench_entry_points.py", "test_tls_relay_bench_main_tiny"),
    "wire_capacity_bench": ("bench/test_bench_entry_points.py", "test_wire_capacity_bench_main_quick"),
    "workers_bench": (
        "bench/test_workers_bench.py",
        "test_every_arm_serves_turns_and_the_cpu_split_names_the_processes",
    ),
    # duplex-actors bench --only NAME
    "bench:throughput": ("bench/test_bench_smoke.py", "test_throughput_tiny"),
    "bench:scale": ("bench/test_bench_smoke.py", "test_scale_tiny"),
    "bench:realtime": ("bench/test_bench_smoke.py", "test_realtime_tiny"),
    "bench:barge_in": ("bench/test_bench_smoke.py", "test_barge_in_tiny"),
    "bench:wire": ("bench/test_bench_smoke.py", "test_wire_tiny"),
    "bench:wire_capacity": ("bench/test_bench_entry_points.py", "test_bench_only_wire_capacity_tiny"),
    "bench:engine": ("bench/test_bench_entry_points.py", "test_bench_only_engine_at_smoke_size"),
    # .ci/vllm.sh also runs `bench --only vllm` itself (DUPLEX_VLLM_BENCH_SIZE=smoke).
    "bench:vllm": (
        "vllm/test_vllm_bench.py",
        "test_vllm_bench_smoke_reports_every_figure_against_bare_asyncllm",
    ),
    "bench:ray": ("bench/test_bench_entry_points.py", "test_ray_bench_and_bench_only_ray"),
}


def _entry_points() -> set[str]:
    found = set()
    for path in BENCH_DIR.glob("*.py"):
        text = path.read_text()
        if re.search(r"^if __name__ == .__main__.:", text, re.M) or re.search(r"^def main\(", text, re.M):
            found.add(path.stem)
    return found | {f"bench:{name}" for name in BENCHES + OPT_IN}


def test_every_bench_entry_point_has_a_smoke_test():
    missing = sorted(_entry_points() - COVERED.keys())
    assert not missing, f"bench entry points without a smoke test (add one and list it in COVERED): {missing}"
    for name, (file, test) in COVERED.items():
        source = (TESTS / file).read_text()
        assert f"def {test}" in source, f"{name}: no {test} in tests/{file}"


def _tiny_engine_run():
    from duplex_actors.bench import engine_bench

    return functools.partial(engine_bench.run, tiny=True, concurrency=(1, 4))


def test_engine_bench_main_tiny_writes_its_report(tmp_path, capsys):
    pytest.importorskip("torch")
    from duplex_actors.bench import engine_bench

    path = tmp_path / "engine.json"
    argv = ["--tiny", "--concurrency", "1,4", "--compare-eager", "--json", str(path)]
    assert engine_bench.main(argv) == 0
    printed = capsys.readouterr().out
    assert "engine/bare" in printed and "TTFT" in printed and "device cpu" in printed
    report = json.loads(path.read_text())
    assert report["concurrency"] == [1, 4] and report["model"]["device"] == "cpu"
    for n in ("1", "4"):
        engine, bare = report["engine_tokens_per_s"][n], report["bare_tokens_per_s"][n]
        assert engine > 0 and bare > 0
        assert report["engine_vs_bare"][n] == pytest.approx(engine / bare)
    # The eager-loop arm (what --cuda-graphs is measured against; here both loops are eager).
    assert set(report["bare_vs_bare_eager"]) == {"1", "4"}
    assert all(r > 0 for r in report["bare_vs_bare_eager"].values())
    ttft = report["ttft"]
    assert ttft["samples"] == 2 and ttft["engine_ms_p50"] > 0 and ttft["bare_ms_p50"] > 0


def test_bench_only_engine_at_smoke_size(tmp_path, monkeypatch):
    """`duplex-actors bench --only engine` end to end (engine_bench at its tiny size): its
    figures come out with the bare loop as their baseline, and the report files are written."""
    pytest.importorskip("torch")
    from duplex_actors.bench import engine_bench
    from duplex_actors.bench.cli_commands import run_suite

    monkeypatch.setattr(engine_bench, "run", _tiny_engine_run())
    lines: list[str] = []
    (result,) = run_suite(True, tmp_path, ["engine"], lines.append)
    assert "error" not in result, result.get("traceback")
    figures = result["figures"]
    assert [f["baseline_label"] for f in figures[:2]] == ["bare batched decode loop, same model"] * 2
    assert all(f["ratio"] == pytest.approx(f["value"] / f["baseline"]) for f in figures)
    assert "batch 1" in figures[-1]["baseline_label"]
    assert json.loads((tmp_path / "bench.json").read_text())["results"][0]["name"] == "engine"


@pytest.mark.ray
@pytest.mark.slow
def test_ray_bench_and_bench_only_ray(tmp_path, capsys):
    """ray_bench's quick size is already small (40 turns): through `bench --only ray`, then
    its module's printer."""
    pytest.importorskip("ray")
    from duplex_actors.bench import ray_bench
    from duplex_actors.bench.cli_commands import run_suite

    (result,) = run_suite(True, tmp_path, ["ray"], lambda _line: None)
    assert "error" not in result and "skipped" not in result, result
    assert any(f["baseline"] for f in result["figures"])
    for f in result["figures"]:
        if f["baseline"]:
            assert f["ratio"] == pytest.approx(f["value"] / f["baseline"])
    ray_bench._print(result)
    assert "ratio" in capsys.readouterr().out


@pytest.mark.slow
def test_stall_bench_main_tiny(tmp_path):
    """stall_bench as its command runs it (its own process: it patches how the server reads
    client addresses), at 20 idle sessions: the probe's baseline on the bare server and the
    windows with the sessions held both come out, and every session was opened."""
    report = _stall_bench(tmp_path, ["--sessions", "20", "--seconds", "0.5", "--reclaim-s", "0.2"])
    assert report["mode"] == "idle" and report["opened"] == 20 and report["server_sessions"] >= 20
    for window in ("baseline", "idle_first", "idle_steady"):
        assert report[window]["samples"] > 0 and report[window]["max_ms"] >= report[window]["p50_ms"]


def _check_capacity(result, arms, against_bare=("serve",)):
    """Each arm measured its N with frames handled, CPU per frame and probe latencies; the
    serve arm's figures carry the bare parse server of the same run as their baseline."""
    assert set(result["arms"]) == set(arms), result.get("skipped_arms")
    for arm in arms:
        (sweep,) = result["arms"][arm]["rounds"]
        assert sweep["steps"], sweep["stopped"]
        assert "error" not in sweep["received"], sweep["received"]  # the arm's path, not refusals
        assert {int(n) for n in result["arms"][arm]["by_n"]} == {step["sessions"] for step in sweep["steps"]}
        for step in sweep["steps"]:
            assert step["frames"] > 0 and step["cpu_per_frame_us"] > 0
            assert step["probes"] > 0 and step["p99_ms"] >= step["p50_ms"] > 0
            assert step["closed_by_server"] == 0
            # serve also times the probes to its reader (the decoder): before the core
            assert (step["read_p50_ms"] is not None) == arm.startswith("serve")
    for arm in against_bare:
        cpu = next(
            f for f in result["figures"] if f["metric"].startswith(f"{arm}: server CPU per 20 ms frame")
        )
        assert cpu["baseline"] > 0 and cpu["ratio"] == pytest.approx(cpu["value"] / cpu["baseline"])
        if arm == "serve":  # the goal's own figure
            assert cpu["target"] and cpu["met"] in (True, False)


@pytest.mark.slow
def test_wire_capacity_bench_arms_of_the_frame_handled_as_parsed(tmp_path):
    """The bare server parsing each frame as websockets' parser hands it over, and serve with
    its own such path off, each at the smoke size."""
    pytest.importorskip("websockets")
    from duplex_actors.bench import wire_capacity_bench

    out = tmp_path / "capacity.json"
    arms = ("bare", "bare:direct", "serve:novad-queued")
    argv = ["--quick", "--arms", ",".join(arms), "--sessions", "3", "--window", "1", "--warm", "0.3"]
    assert wire_capacity_bench.main([*argv, "--json", str(out)]) == 0
    _check_capacity(json.loads(out.read_text()), arms, against_bare=arms[1:])


def test_wire_capacity_arms_of_several_parts_take_each_parts_settings():
    from duplex_actors.bench.wire_capacity_bench import DEFAULT_ARMS, LEVER_ARMS, _arm_options

    both = _arm_options("serve:listens-nogate")
    assert both["listens"] and both["config"] == _arm_options("serve:nogate")["config"] != {}
    assert _arm_options("serve:listens")["listens"] and _arm_options("serve:listens")["config"] == {}
    assert not _arm_options("serve:nogate")["listens"]
    # the batching windows the latency table measures (docs/benchmarks.md), in seconds
    assert [_arm_options(f"serve:vad{ms}")["config"] for ms in (2, 3, 5)] == [
        {"vad_batch_window_s": ms / 1000} for ms in (2, 3, 5)
    ]
    assert _arm_options("serve:int8")["config"] == {"vad_precision": "int8"}
    for arm in DEFAULT_ARMS + LEVER_ARMS:  # every arm the bench knows parses
        _arm_options(arm)


@pytest.mark.slow
def test_wire_capacity_bench_duplex_native_arm(tmp_path):
    """serve with clients on the binary-audio and 16 kHz extensions, at the smoke size: the
    server takes the declaration and the binary frames (no error, no close), and the manual
    turns' commits make items, so the arm measures what it says."""
    pytest.importorskip("websockets")
    from duplex_actors.bench import wire_capacity_bench

    out = tmp_path / "capacity.json"
    arms = ("bare", "serve:binary-16k-novad")
    argv = ["--quick", "--arms", ",".join(arms), "--sessions", "3", "--window", "1.5", "--warm", "0.3"]
    assert wire_capacity_bench.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    _check_capacity(result, arms, against_bare=arms[1:])
    (sweep,) = result["arms"]["serve:binary-16k-novad"]["rounds"]
    assert sweep["frame_bytes"] == 8 + 640  # a masked frame's header, then 20 ms at 16 kHz
    received = sweep["received"]
    assert received["session.updated"] == 3, received
    assert received["input_audio_buffer.committed"] >= 1, received


def test_wire_capacity_16k_arms_send_the_sessions_own_rate_and_declare_it():
    """A ``16k`` part: 20 ms frames of 16 kHz pcm16 (640 bytes), declared on the session as
    the extension's ``audio/pcm`` at 16000, with the other parts' settings kept."""
    from duplex_actors.bench.wire_capacity_bench import MASK, _apply_mask, _arm_options, _Frames

    native = _arm_options("serve:binary-16k-novad")
    assert (native["binary"], native["novad"], native["rate"]) == (True, True, 16_000)
    assert _arm_options("serve:binary")["rate"] == 24_000 and not _arm_options("serve:16k-novad")["binary"]
    frames = _Frames(binary=True, manual=True, text_probes=True, rate=16_000)
    assert {len(chunk) for chunk in frames.chunks} == {640}
    (setup,) = frames.setup
    assert setup[1] & 0x7F == 126 and setup[4:8] == MASK  # a masked frame of a 16-bit length
    update = json.loads(_apply_mask(setup[8:], MASK))
    assert update["session"]["audio"]["input"] == {
        "turn_detection": None,
        "format": {"type": "audio/pcm", "rate": 16_000},
    }
    assert {len(chunk) for chunk in _Frames(binary=False).chunks} == {960}


@pytest.mark.slow
def test_wire_capacity_bench_main_quick(tmp_path, capsys):
    """The module's command at its smoke size: the bare parse server and serve (server VAD on,
    real-time clients), both swept, the JSON written, the ratios printed."""
    pytest.importorskip("websockets")
    from duplex_actors.bench import wire_capacity_bench

    out = tmp_path / "capacity.json"
    argv = ["--quick", "--sessions", "3,6", "--window", "1", "--warm", "0.3", "--json", str(out)]
    assert wire_capacity_bench.main(argv) == 0
    printed = capsys.readouterr().out
    assert "server CPU per 20 ms frame" in printed and "sessions per server core" in printed
    _check_capacity(json.loads(out.read_text()), ("bare", "serve"))


@pytest.mark.slow
def test_bench_only_wire_capacity_tiny(tmp_path, monkeypatch):
    """`duplex-actors bench --only wire_capacity`, at a tiny size."""
    pytest.importorskip("websockets")
    from duplex_actors.bench import wire_capacity_bench
    from duplex_actors.bench.cli_commands import run_suite

    tiny = functools.partial(wire_capacity_bench.bench_wire_capacity, sessions=(4,), window_s=1.0, warm_s=0.3)
    monkeypatch.setattr(wire_capacity_bench, "bench_wire_capacity", tiny)
    (result,) = run_suite(True, tmp_path, ["wire_capacity"], lambda _line: None)
    assert "error" not in result, result.get("traceback")
    _check_capacity(result, ("bare", "serve"))


@pytest.mark.slow
@pytest.mark.parametrize("in_loop", [False, True], ids=["own-process", "in-loop"])
def test_stall_bench_resume_tiny(tmp_path, in_loop):
    """stall_bench's mass resume at 16 sessions of 4 clients: every session resumed, none lost,
    and both users were timed before and during the storm (the neighbour on its own open
    connection, the newcomer connecting for each turn), in a process of their own or, as an
    A/B, on the server's loop (with the old A/B engine pace, so both paces run)."""
    argv = ["--resume", "--sessions", "16", "--clients", "4", "--seconds", "0.5"]
    report = _stall_bench(
        tmp_path, argv + (["--users-in-loop", "--engine-pace", "after-each"] if in_loop else [])
    )
    assert report["users"] == ("in the server's loop" if in_loop else "a process of their own")
    assert report["engine_pace"] == ("after-each" if in_loop else "from-start")
    assert report["mode"] == "resume" and report["opened"] == 16
    assert report["resume"]["outcomes"] == {"resumed": 16}, report["resume"]
    for user in ("neighbour", "newcomer"):
        assert report[f"{user}_alone_ms"] > 0 and report[f"{user}_turns"] >= 1, report
        assert report[f"{user}_worst_ms"] >= report[f"{user}_during_ms"] > 0, report


def _stall_bench(tmp_path, argv: list[str]) -> dict:
    """stall_bench as its command runs it, in its own process (it patches how the server reads
    client addresses); its JSON report."""
    import subprocess
    import sys

    pytest.importorskip("websockets")
    out = tmp_path / "stall.json"
    proc = subprocess.run(
        [sys.executable, "-m", "duplex_actors.bench.stall_bench", *argv, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_tls_relay_bench_main_tiny(tmp_path):
    """tls_relay_bench as its command runs it, at 40 frames a round: both paths measured (the
    front alternates, so a relayed round and a direct one), each worker's CPU split reported."""
    import shutil
    import subprocess
    import sys

    pytest.importorskip("websockets")
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make the bench's certificate")
    out = tmp_path / "relay.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "duplex_actors.bench.tls_relay_bench",
            "--frames",
            "40",
            "--rounds",
            "2",
            "--json",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=180,
    )
    report = json.loads(out.read_text())
    assert sorted(r["path"] for r in report["rounds"]) == ["direct", "relayed"], report["rounds"]
    for result in report["rounds"]:
        assert set(result["by_worker_us_per_frame"]) == {"dx-worker0", "dx-worker1"}, result
    assert {"direct_us_per_frame", "relayed_us_per_frame", "relayed_over_direct"} <= report.keys()
