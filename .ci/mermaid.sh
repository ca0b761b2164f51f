#!/usr/bin/env bash
# Render every committed Mermaid file with Mermaid's own CLI (mermaid-cli, a real browser
# renderer), so a chart that Mermaid cannot draw, or draws wrongly, fails CI.
#
#   .ci/mermaid.sh               # set up .ci/mermaid/node_modules once, then render
#   .ci/mermaid.sh --setup-only  # only set up (scripts/test.sh: the main suite then renders)
#
# No browser is downloaded: puppeteer's download is skipped and Debian's chromium package is
# used (installed with apt when missing, as are node and npm). mermaid-cli 12 declares node
# >= 22.13; it renders on the node 20 of this project's machines (npm only warns).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HERE="$ROOT/.ci/mermaid"
CHROMIUM="${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}"
if ! command -v npm >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
fi
if [[ -z "$CHROMIUM" ]]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    CHROMIUM="$(command -v chromium)"
fi
if [[ ! -x "$HERE/node_modules/.bin/mmdc" ]]; then
    (cd "$HERE" && PUPPETEER_SKIP_DOWNLOAD=1 npm ci --no-audit --no-fund --silent)
fi
if [[ "${1:-}" == "--setup-only" ]]; then
    exit 0
fi
# The rendering itself is a pytest module (it also checks every box is titled with its state);
# it runs in the main suite too whenever the renderer is set up.
export DUPLEX_MERMAID_CHROMIUM="$CHROMIUM" DUPLEX_REQUIRE_MERMAID=1
cd "$ROOT"
exec python -m pytest -q -p no:cacheprovider tests/tooling/test_mermaid_render.py
