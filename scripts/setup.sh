#!/usr/bin/env bash
# Creates .venv and installs duplex_actors with the extras the main job and tests need.
# torch is pinned to 2.13.0 by the 'embedded' extra: on this project's CPU machines pip takes
# the CPU wheel that lies on disk; no CUDA build is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v dot >/dev/null 2>&1; then
    # Graphviz renders the SVG statecharts (and transitions' diagram support uses it).
    (apt-get update -qq && apt-get install -y -qq graphviz >/dev/null) || echo "warning: graphviz not installed"
fi
if ! command -v chromium >/dev/null 2>&1; then
    # Debian's chromium: the web console's browser test drives it (playwright over CDP; no
    # browser is downloaded), and Mermaid's renderer uses it too.
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
        || echo "warning: chromium not installed"
fi
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
. .venv/bin/activate
# pip's find-links config on these machines prints one warning per missing local index entry;
# only that line is filtered. pip's own exit status is kept (pipefail), so a failed install
# (a full disk, a missing wheel) stops here with pip's error rather than at the first import.
quiet_pip() { "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }; }
quiet_pip python -m pip install -q --upgrade pip
quiet_pip pip install -q -e ".[${DUPLEX_EXTRAS:-all}]"
python -c "import duplex_actors, torch; print('duplex_actors', duplex_actors.__version__, '| torch', torch.__version__)"
